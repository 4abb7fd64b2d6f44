"""
Train a LLaMA-style model. The whole run, top to bottom:

    python train.py                                  # the default job: Python's stdlib, CPU-sized
    torchrun --standalone --nproc_per_node=2 train.py    # the same on 2 data-parallel ranks (pp=, fsdp= for more)
    python train.py config/tiny.py max_iters=50      # a config file, then key=value overrides
    python train.py                                  # run again: continues from out_dir's latest checkpoint

Every key below can be overridden; see README.md for what each one does.
"""

import json
import math
import os
import signal
import sys
import time
import uuid
from contextlib import nullcontext
from dataclasses import asdict

import torch

import checkpoint
import configurator
import data
import parallel
import sample
from model import (LORA_TARGETS, ModelConfig, MuonWithAdamW, Transformer, apply_lora, grow_vocab, make_stage,
                   measure_matmul_flops, merge_lora, pipeline_split, stage_layers)

# ---------------------------------------------------------------------------------------
# defaults: every one can be overridden by a config file or key=value
# I/O
out_dir = "out"                 # checkpoints, metrics.jsonl and config.json go here
init_from = "auto"              # 'auto': resume if out_dir has a checkpoint, else start fresh; 'resume': must resume;
                                # 'scratch': a new model (refused if out_dir already has checkpoints); or a path:
                                # a Hugging Face LLaMA directory, or another run's out_dir, to start from its weights
export_hf = ""                  # at the end, also write the model as a Hugging Face LLaMA directory here
export_shard_mb = 5000.0        # export_hf: weights past this many MB (10^6 bytes) are split into shards +
                                # model.safetensors.index.json (5000: huggingface_hub's default 5GB; 0: one file)
eval_interval = 100             # evaluate val loss every this many iterations (and at the end)
eval_iters = 10                 # global batches of val data per evaluation
log_interval = 10               # print and append to metrics.jsonl every this many iterations
ckpt_interval = 250             # save a checkpoint every this many iterations (and at the end)
keep_ckpts = 2                  # keep the newest this many checkpoints (0: keep all)
ckpt_async = False              # write checkpoints in the background: the loop pauses only to copy the state to CPU
wandb_log = False               # also log to Weights & Biases (WANDB_MODE=offline works)
wandb_project = "trainer"
wandb_run_name = ""             # '' : the base name of out_dir
# data
dataset = "stdlib"              # a name under data/, or a directory holding train.bin/val.bin/meta.json
datasets = ""                   # a mixture instead of `dataset`: 'stdlib:0.7,notes:0.3' (names or directories)
mix_temperature = 1.0           # mixture weights become weights ** (1 / T), normalized (T > 1: flatter)
phases = []                     # curriculum: [(start_iter, {source: weight}), (start_iter, weights, lr_scale), ...]
data_source = ""                # what to prepare when the dataset is missing: '' = 'stdlib' for dataset 'stdlib';
                                # else 'stdlib', a directory or glob of .txt files, or a .jsonl file
tokenizer = "cl100k_base"       # any tiktoken encoding; cl100k_base works offline
vocab_size = 8192               # truncate the BPE to this many ids (0: the whole tokenizer)
extra_tokens = ""               # a file of domain strings (one per line) to add to the tokenizer when preparing data
val_fraction = 0.01             # share of documents that go to val when preparing data
batch_size = 8                  # sequences per micro-batch per rank
grad_accum_steps = 2            # micro-batches per iteration, summed over data-parallel ranks
block_size = 64                 # tokens per sequence
# model
n_layer = 4
n_head = 4
n_kv_head = 2                   # < n_head: grouped-query attention
n_embd = 128
ffn_dim = 0                     # SwiGLU hidden width (0: 8/3 * n_embd, rounded up to a multiple of 32)
dropout = 0.0
tie_embeddings = False          # share the token embedding with the output head
grad_ckpt = False               # activation checkpointing: recompute each block in backward
doc_mask = False                # attention stays inside each document (<|endoftext|>-separated) of a packed sequence
neftune_alpha = 0.0             # NEFTune: uniform noise of scale alpha/sqrt(T*n_embd) on the input embeddings, training only
# LoRA: train low-rank adapters on a frozen base (init_from= the base); the checkpoints hold the adapters only
lora_rank = 0                   # rank r of the adapters (0: no LoRA, full fine-tuning)
lora_alpha = 16.0               # the adapters' update B A is scaled by lora_alpha / lora_rank
lora_dropout = 0.0              # dropout on the adapters' input (the base path has none)
lora_targets = "wq,wk,wv,wo"    # the linears that get adapters: any of wq,wk,wv,wo,w1,w2,w3,output
lora_from = ""                  # start from these adapters (a PEFT adapter directory) instead of fresh ones
export_lora = ""                # at the end, also write the adapters here in PEFT's format (adapter_config.json ...)
# optimizer: weight decay on 2-D weights only
optim = "muon"                  # 'adamw', or 'muon': Muon for the layers' matrices, AdamW for embeddings, head, gains
learning_rate = 4e-3            # peak learning rate (Muon's updates are scaled to AdamW's size: one rate for both)
embed_lr_scale = 10.0           # the token embedding's rate is learning_rate x this (a row learns only when its token appears)
muon_momentum = 0.95            # Muon's Nesterov momentum
max_iters = 800
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0                 # clip the global gradient norm to this (0: no clipping; the norm is logged anyway)
# learning rate schedule: linear warmup, then 'cosine' decay to min_lr, or 'wsd' (warmup-stable-decay):
# flat at learning_rate, then a linear decay to min_lr over the last cooldown_frac of lr_decay_iters
lr_schedule = "cosine"
warmup_iters = 50
lr_decay_iters = 0              # 0: = max_iters
cooldown_frac = 0.2             # wsd: the share of lr_decay_iters spent decaying
min_lr = 4e-4
# faults
nan_max_consecutive = 3         # a non-finite loss or grad norm skips the step; after this many in a row ...
nan_action = "rollback"         # ... 'rollback' to the latest checkpoint and step over the bad batches, or 'stop'
fault_nan_at = -1               # testing the guard: poison the gradients of this iteration (-1: never) ...
fault_nan_steps = 1             # ... and of the ones after it, this many in all
fault_save_delay_s = 0.0        # testing async saves: every checkpoint write starts this many seconds late
# system
device = "auto"                 # 'auto': cuda if available, else cpu
dtype = "auto"                  # 'auto': bfloat16 autocast on CUDA, float32 elsewhere; or 'float32' / 'bfloat16'
compile = False                 # torch.compile the model
seed = 1337                     # weights, data order and dropout all derive from it
peak_flops = 0.0                # FLOP/s that MFU is measured against (0: measure this device's matmul rate)
dist_timeout_s = 300            # a collective waiting longer than this (dead peer) ends the run with an error
backend = "auto"                # 'auto': nccl on CUDA, gloo on CPU
pp = 1                          # pipeline stages; the data-parallel degree is dp = world_size // (pp * tp)
tp = 1                          # tensor-parallel ranks per stage (consecutive ranks); dp = world_size // (pp * tp)
pp_schedule = "1f1b"            # '1f1b', 'gpipe' (all forwards, then all backwards) or 'interleaved' (pp_virtual chunks)
pp_virtual = 1                  # interleaved: chunks of layers per stage (virtual stages v * pp + stage), at least 2
pp_layers = ""                  # layers per stage, e.g. '3,1' (per virtual stage with pp_virtual); '': balanced by cost
pp_trace = False                # print the pipeline schedule as an ASCII timeline (second iteration)
ddp_impl = "bucketed"           # data parallel: 'bucketed' (hand-written, overlapped), 'naive' (one all-reduce
                                # per parameter after backward) or 'torch' (DistributedDataParallel)
ddp_bucket_mb = 4.0             # bucket size of the bucketed all-reduce
fsdp = False                    # shard parameters, gradients and optimizer state over the dp ranks (FSDP2)
reshard_after_forward = True    # fsdp: free each block's gathered weights after its forward (gather again for backward)
zero = 0                        # ZeRO over the dp ranks: 0 plain data parallel, 1 shard the optimizer state, 2 and the
                                # gradients (stage 3 is fsdp=True); with one dp rank there is nothing to shard
offload = False                 # zero=1/2 or fsdp: optimizer state (fsdp: parameters too) in CPU memory, AdamW steps
                                # there (CUDA; on a CPU device it changes nothing)
sample_tokens = 120             # tokens to generate at the end of the run (0: none)
# ---------------------------------------------------------------------------------------


sys.excepthook = parallel.excepthook  # a UserError (and a dead peer) prints one line, not a traceback
config_keys = [k for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, bool, str, list))]
defaults = {k: globals()[k] for k in config_keys}
overrides = configurator.configure(defaults, sys.argv[1:])
globals().update(overrides)
config = {k: globals()[k] for k in config_keys}
started = time.time()  # metrics' elapsed_s: wall seconds since launch (data preparation and compiling included)


# ---- check the config: all of it, before anything touches the disk or a process group --


def check(ok, problem):
    """A mistake in the config: one line that names it and the fix, and nothing touched yet."""
    if not ok:
        raise configurator.UserError(problem)


world = int(os.environ.get("WORLD_SIZE", 1))  # torchrun's; the process group comes later
for key, choices in (("nan_action", ("rollback", "stop")), ("ddp_impl", ("bucketed", "naive", "torch")),
                     ("pp_schedule", ("1f1b", "gpipe", "interleaved")), ("dtype", ("auto", "float32", "bfloat16")),
                     ("optim", ("adamw", "muon")), ("lr_schedule", ("cosine", "wsd")),
                     ("backend", ("auto", "gloo", "nccl"))):
    check(config[key] in choices, f"{key}={config[key]!r} is not one of {', '.join(choices)}")
for key in ("n_layer", "n_head", "n_kv_head", "n_embd", "block_size", "batch_size", "grad_accum_steps",
            "eval_interval", "eval_iters", "log_interval", "ckpt_interval", "nan_max_consecutive", "pp", "tp",
            "pp_virtual"):
    check(config[key] >= 1, f"{key}={config[key]} must be at least 1")
for key in ("max_iters", "vocab_size", "ffn_dim", "keep_ckpts", "warmup_iters", "lr_decay_iters", "learning_rate",
            "embed_lr_scale", "min_lr", "weight_decay", "grad_clip", "neftune_alpha", "peak_flops", "sample_tokens",
            "fault_save_delay_s", "export_shard_mb"):
    check(config[key] >= 0, f"{key}={config[key]} must not be negative")
for key, lo, hi in (("dropout", 0, 1), ("val_fraction", 0, 1), ("beta1", 0, 1), ("beta2", 0, 1),
                    ("muon_momentum", 0, 1), ("cooldown_frac", 0, 1.000001)):
    check(lo <= config[key] < hi, f"{key}={config[key]} must be in [{lo}, {hi})")
# the mixture: sources and their weights, then the phases (pure checks, nothing read yet)
check(not (datasets and "dataset" in overrides), f"dataset={dataset} and datasets={datasets} both given: use "
                                                 f"datasets= for a mixture, dataset= for one source")
mixture = data.parse_mixture(datasets) if datasets else {dataset: 1.0}  # {source: weight}
source_names = [data.source_name(s) for s in mixture]
phase_list = data.parse_phases(phases, source_names)
mix_weights = data.temper(list(mixture.values()), mix_temperature)  # val_loss averages the sources' with these
check(dist_timeout_s > 0 and ddp_bucket_mb > 0, "dist_timeout_s and ddp_bucket_mb must be positive")
check(n_embd % n_head == 0, f"n_embd={n_embd} is not divisible by n_head={n_head}: make n_embd a multiple of n_head")
check(n_head % n_kv_head == 0, f"n_head={n_head} is not divisible by n_kv_head={n_kv_head}: each key/value head "
                               f"serves a whole group of query heads; use a divisor of n_head")
check(n_embd // n_head % 2 == 0, f"head_dim = n_embd / n_head = {n_embd // n_head} is odd: rotary positions "
                                 f"rotate pairs of features; change n_embd or n_head")
# the layout: dp x pp x tp over the world
check(world % pp == 0, f"pp={pp} pipeline stages do not divide the {world} ranks: start a multiple of pp processes "
                       f"(torchrun --nproc_per_node=N), or change pp")
check(world % (pp * tp) == 0, f"pp={pp} x tp={tp} does not divide the {world} ranks: start a multiple of pp * tp "
                              f"processes (torchrun --nproc_per_node=N), or change tp")
dp = world // (pp * tp)
# tensor parallel: each tp rank holds whole heads and an equal slice of the SwiGLU width (the
# vocabulary, known once the data is, is checked when the model is sharded)
ffn_width = ModelConfig(n_embd=n_embd, n_head=n_head, n_kv_head=n_kv_head, ffn_dim=ffn_dim).ffn_dim  # 0: the default
for key, n in (("n_head", n_head), ("n_kv_head", n_kv_head), ("ffn_dim", ffn_width)):
    check(n % tp == 0, f"tp={tp} does not divide {key}={n}: each tp rank needs an equal share of the heads and of "
                       f"the SwiGLU width; use a tp that divides n_head, n_kv_head and ffn_dim")
check(tp == 1 or not fsdp, "fsdp=True with tp > 1 is not supported: use plain data parallel over dp (fsdp=False)")
check(tp == 1 or not zero, f"zero={zero} with tp > 1 is not supported (ZeRO would slice the tp shards, and its "
                           f"checkpoint gathering does not know them): use plain data parallel over dp (zero=0)")
check(tp == 1 or not (lora_rank or lora_from), "LoRA with tp > 1 is not supported: the adapters would need their own "
                                               "slices; use tp=1 for LoRA runs")
check(tp == 1 or len(mixture) == 1, "a mixture (datasets=) with tp > 1 is not supported: the per-source losses need "
                                    "the full logits; use tp=1, or one dataset")
check(pp <= n_layer, f"pp={pp} stages but only n_layer={n_layer} layers: every stage needs at least one")
# the pipeline's schedule and split (pp_layers: counts per stage, or per virtual stage when interleaved)
check((pp_schedule == "interleaved") == (pp_virtual > 1) and (pp_virtual == 1 or pp > 1),
      f"pp_schedule={pp_schedule} with pp_virtual={pp_virtual} pp={pp}: interleaved 1F1B needs pp > 1 and "
      f"pp_virtual >= 2 (chunks per stage), and pp_virtual > 1 needs pp_schedule=interleaved")
check(pp * pp_virtual <= n_layer, f"pp={pp} x pp_virtual={pp_virtual} virtual stages but only n_layer={n_layer} "
                                  f"layers: every virtual stage needs at least one; lower pp_virtual")
check(pp_schedule != "interleaved" or grad_accum_steps // dp % pp == 0,
      f"pp_schedule=interleaved runs the micro-batches in groups of pp={pp}, but each pipeline gets "
      f"grad_accum_steps / dp = {grad_accum_steps // dp}: use a multiple of {pp * dp} for grad_accum_steps")
check(pp_schedule != "interleaved" or not fsdp, "pp_schedule=interleaved with fsdp=True is not supported (FSDP's "
                                                "per-block hooks expect one forward and backward per micro-batch): "
                                                "use plain data parallel (fsdp=False) or pp_schedule=1f1b")
layer_counts = None  # pp_layers as a list; None: model.pipeline_split's balanced split
if pp_layers.strip():
    check(all(c.strip().isdigit() for c in pp_layers.split(",")), f"pp_layers='{pp_layers}' is not a comma-separated "
                                                                  f"list of layer counts, e.g. pp_layers=3,1")
    layer_counts = [int(c) for c in pp_layers.split(",")]
    check(len(layer_counts) == pp * pp_virtual and min(layer_counts) >= 1 and sum(layer_counts) == n_layer,
          f"pp_layers='{pp_layers}' must give {pp * pp_virtual} layer counts (one per stage"
          f"{', per virtual stage' if pp_virtual > 1 else ''}), each at least 1, summing to n_layer={n_layer}")
check(pp == 1 or not tie_embeddings, "tie_embeddings=True with pp > 1: the embedding (first stage) and the head "
                                     "(last stage) would be one tensor on two ranks; use tie_embeddings=False")
check(grad_accum_steps % dp == 0, f"grad_accum_steps={grad_accum_steps} micro-batches per iteration cannot be shared "
                                  f"evenly by {dp} data-parallel ranks: use a multiple of {dp} (and lower batch_size "
                                  f"to keep the global batch), or start fewer ranks")
check(not (pp > 1 and dp > 1 and ddp_impl == "torch"),
      "ddp_impl=torch cannot sit inside a pipeline (torch DDP decides in forward whether to sync, and 1F1B "
      "interleaves forwards with backwards): use ddp_impl=bucketed or naive")
check(not (fsdp and "ddp_impl" in overrides), f"fsdp=True shards with FSDP2, so ddp_impl={ddp_impl} would be "
                                              f"ignored: drop one of the two")
check(zero in (0, 1, 2), f"zero={zero} is not a ZeRO stage we run by hand (0, 1 or 2): for stage 3 use fsdp=True")
check(not (zero and fsdp), f"zero={zero} with fsdp=True: fsdp is ZeRO stage 3 and already shards optimizer state and "
                           f"gradients; use one of the two")
check(not (zero and ddp_impl != "bucketed"), f"zero={zero} shards along the buckets of ddp_impl=bucketed, so "
                                             f"ddp_impl={ddp_impl} cannot carry it: drop ddp_impl")
check(not offload or zero or fsdp, "offload=True moves sharded optimizer state to CPU memory: use it with zero=1, "
                                   "zero=2 or fsdp=True")
# Muon orthogonalizes each weight matrix whole: layouts that slice the matrices cannot run it as written
for on, what in ((zero, f"zero={zero}"), (tp > 1, f"tp={tp}"), (lora_rank or lora_from, "LoRA")):
    check(optim != "muon" or not on,
          f"optim=muon with {what}: Muon orthogonalizes each weight matrix whole, and {what} "
          f"{'trains adapters only' if what == 'LoRA' else 'slices them over ranks'}; use optim=adamw, or "
          f"data parallel, fsdp or pipeline stages")
# LoRA (what needs the checkpoint, the base or the adapter is checked under "LoRA" below)
lora_target_list = sorted({t.strip() for t in lora_targets.split(",") if t.strip()})
check(lora_rank >= 0, f"lora_rank={lora_rank} is negative: use 0 (full fine-tuning) or the adapters' rank")
check(lora_target_list and not set(lora_target_list) - set(LORA_TARGETS),
      f"lora_targets='{lora_targets}': name one or more of {','.join(LORA_TARGETS)}, separated by commas")
check(0 <= lora_dropout < 1 and lora_alpha > 0,
      f"lora_dropout={lora_dropout} must be in [0, 1) and lora_alpha={lora_alpha} above 0")
# the files: where the weights come from and where the run writes
check(init_from in ("auto", "scratch", "resume") or os.path.isdir(init_from),
      f"init_from='{init_from}' is not 'auto', 'scratch', 'resume' or a directory (another run's out_dir, or a "
      f"Hugging Face LLaMA directory)")
check(out_dir.strip() != "", "out_dir='' names no directory: give one for checkpoints and logs, e.g. out_dir=out")
check(not os.path.exists(out_dir) or os.path.isdir(out_dir), f"out_dir={out_dir} is a file, not a directory: "
                                                             f"pick another out_dir")
writable = os.path.abspath(out_dir)
while not os.path.exists(writable):  # the nearest directory that exists is where out_dir will be made
    writable = os.path.dirname(writable)
check(os.access(writable, os.W_OK | os.X_OK), f"out_dir={out_dir} is not writable ({writable} is read-only to "
                                              f"this user): fix its permissions or pick another out_dir")
check(not export_hf or not os.path.exists(export_hf) or (os.path.isdir(export_hf) and not os.listdir(export_hf)),
      f"export_hf={export_hf} already exists and is not an empty directory: remove it or export elsewhere (checked "
      f"now rather than after the run has trained)")

# ---- setup ----------------------------------------------------------------------------
mesh = parallel.setup(device, dist_timeout_s, backend, pp, tp)
if dtype == "auto":
    dtype = "bfloat16" if mesh.device.type == "cuda" else "float32"
# weights stay float32; on CUDA the matmuls run in bf16 under autocast (no loss scaler needed)
autocast = (torch.autocast(mesh.device.type, dtype=torch.bfloat16) if dtype == "bfloat16" else nullcontext())
if mesh.device.type == "cuda":
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
elif mesh.device.type == "cpu":
    parallel.keep_freed_memory()  # no page faults for each step's large tensors (~7% of a CPU step)
lr_decay_iters = lr_decay_iters or max_iters
mesh.print0("config: " + " ".join(f"{k}={config[k]!r}" for k in config_keys))
if mesh.master:  # one run per out_dir: a second one fails here, before it writes anything
    checkpoint.lock_out_dir(out_dir)

# ---- data: one source, or a mixture -------------------------------------------------
metas, data_dirs = {}, []
for source, name in zip(mixture, source_names):
    data_dir = source if os.sep in source else os.path.join("data", source)
    if not os.path.exists(os.path.join(data_dir, "meta.json")):
        prep = (data_source if not datasets else "") or ("stdlib" if source == "stdlib" else "")
        if not prep:
            raise configurator.UserError(
                f"dataset '{source}' is not prepared ({data_dir}/meta.json missing): " +
                ("run `python data.py SOURCE --out DIR` for it" if datasets else
                 "set data_source= to a directory, glob or .jsonl file to prepare it from"))
        if mesh.master:  # rank 0 prepares, the others wait at the barrier
            mesh.print0(f"preparing {data_dir} from {prep} (once)")
            data.prepare(prep, data_dir, tokenizer, vocab_size, val_fraction, extra_tokens=extra_tokens or ())
        parallel.barrier(mesh)
    metas[name] = data.load_meta(data_dir)
    data_dirs.append(data_dir)
meta = data.check_tokenizers(metas)  # the vocabulary that covers every source
base_vocab = meta.get("base_vocab_size", meta["vocab_size"])  # before chat and extra tokens
if meta["tokenizer"] != tokenizer or base_vocab != (vocab_size or base_vocab):
    raise configurator.UserError(
        f"{', '.join(data_dirs)} was prepared with tokenizer={meta['tokenizer']} vocab_size={base_vocab}, but this run "
        f"has tokenizer={tokenizer} vocab_size={vocab_size}: set those, or prepare into another dataset")
data_dir = ",".join(data_dirs)  # what checkpoints record
train_loader = data.MixtureLoader([data.Loader(d, "train", block_size, batch_size, grad_accum_steps, seed, mesh.dp_rank,
                                               mesh.dp) for d in data_dirs],
                                  source_names, list(mixture.values()), phase_list, mix_temperature)
val_loaders = {name: data.Loader(d, "val", block_size, batch_size, grad_accum_steps, seed, mesh.dp_rank, mesh.dp)
               for name, d in zip(source_names, data_dirs)}
tokens_per_iter = batch_size * grad_accum_steps * block_size  # global: all ranks together

# ---- the model: where its weights come from -------------------------------------------
# One of four places, first match wins: (1) this run's own newest intact checkpoint (resume:
# weights, AdamW state, RNG and iteration; loaded below, once the layout exists); (2)
# init_from= another run of ours (its newest checkpoint's weights, a fresh optimizer); (3)
# init_from= a Hugging Face LLaMA directory; (4) fresh random weights from the seed.
# The model is built on the meta device (shapes only), cut to this rank's pipeline stage,
# sliced (tp) and sharded (fsdp) there, and only then given storage and filled: each rank
# allocates and reads only what it holds, never the whole model. Two rare cases need the
# whole tensors first and build the model whole on the CPU as before: LoRA (its frozen base
# is loaded whole, then the adapters go on) and vocabulary growth (the new rows are the mean
# of all old rows).
model_cfg = ModelConfig(vocab_size=meta["vocab_size"], block_size=block_size, n_layer=n_layer, n_head=n_head,
                        n_kv_head=n_kv_head, n_embd=n_embd, ffn_dim=ffn_dim, dropout=dropout,
                        tie_embeddings=tie_embeddings, grad_ckpt=grad_ckpt, neftune_alpha=neftune_alpha)
ckpt_path = checkpoint.find(out_dir, mesh, warn=mesh.print0)  # corrupt ones are reported and skipped
check(not (init_from == "resume" and ckpt_path is None), f"init_from=resume but {out_dir}/ckpt has no checkpoint: "
                                                         f"use init_from=auto (or scratch), or the out_dir of the "
                                                         f"run to continue")
check(not (init_from == "scratch" and ckpt_path), f"init_from=scratch but {out_dir} holds checkpoints of an earlier "
                                                  f"run: continue it with init_from=auto, or pick a new out_dir (or "
                                                  f"delete {out_dir}/ckpt)")
init_path = "" if init_from in ("auto", "scratch", "resume") else init_from
init_ckpt = hf_index = saved = None
if ckpt_path:                                                    # (1) resume
    ckpt_meta, ckpt_state = checkpoint.read_meta(ckpt_path)
    saved, where = ckpt_meta["model"], f"the checkpoint in {out_dir}"
elif init_path and os.path.isdir(os.path.join(init_path, "ckpt")):  # (2) a run of ours
    init_ckpt = checkpoint.find(init_path, mesh, warn=mesh.print0)
    check(init_ckpt is not None, f"init_from={init_path} is a run directory with no checkpoint in ckpt/: "
                                 f"train it first, or point at another run or a Hugging Face model")
    saved, where = checkpoint.read_meta(init_ckpt)[0]["model"], f"the checkpoint {init_ckpt}"
    check(not checkpoint.read_meta(init_ckpt)[0].get("lora"),  # its checkpoints hold adapters, not a model
          f"init_from={init_path} is a LoRA run: start from its merged model (export_hf= of train.py or sample.py), "
          f"or its base with lora_from= its export_lora")
elif init_path:                                                  # (3) Hugging Face
    saved, hf_index = checkpoint.hf_llama_index(init_path)  # checks the files; reads no weights yet
    where = f"the Hugging Face model in {init_path}"
if saved is not None:
    # the model's shape comes from there; an explicit override that disagrees is a mistake
    shape_keys = ("n_layer", "n_head", "n_kv_head", "n_embd", "ffn_dim", "tie_embeddings", "vocab_size")
    for key in shape_keys:
        # (vocab_size= names the tokenizer's base size, already checked against the data: a model
        # grown by chat or extra tokens, here or in an earlier stage, has more rows)
        check(key not in overrides or key not in saved or overrides[key] == saved[key] or
              (key == "vocab_size" and overrides[key] == base_vocab),
              f"{key}={overrides.get(key)} but {where} has {key}={saved.get(key)}: drop the override, or use a "
              f"new out_dir")
    run_keys = {"block_size": block_size, "dropout": dropout, "grad_ckpt": grad_ckpt, "neftune_alpha": neftune_alpha}
    model_cfg = ModelConfig(**{**saved, **run_keys})
    check(mesh.pp <= model_cfg.n_layer, f"pp={mesh.pp} stages but {where} has n_layer={model_cfg.n_layer}: "
                                        f"use at most that many stages")
whole_first = (bool(lora_rank or lora_from or (ckpt_path and ckpt_meta.get("lora"))) or
               model_cfg.vocab_size < meta["vocab_size"])  # LoRA, or vocabulary growth: see above
torch.manual_seed(seed)  # whole_first: Transformer draws each weight from (seed, its name), as init_tensor below
with nullcontext() if whole_first else torch.device("meta"):
    raw_model = Transformer(model_cfg)  # the plain module: checkpoints, eval and sampling use it
if whole_first and hf_index is not None:
    init_weights = checkpoint.load_hf_llama(init_path)[1]
    if model_cfg.tie_embeddings:  # one tensor under two names
        init_weights.setdefault("output.weight", init_weights["tok_embeddings.weight"])
    raw_model.load_state_dict(init_weights)
elif whole_first and init_ckpt is not None:
    checkpoint.load(init_ckpt, raw_model, no_dist=True)  # every rank reads the whole model
# ---- LoRA: adapters on a frozen base -------------------------------------------------
# Order: the base's weights are in (loaded above, or below when resuming), then the adapters,
# then the pipeline cut, FSDP / data parallel and the optimizer (over what trains only).
lora = None  # {"rank", "alpha", "dropout", "targets", "base"}: kept in meta.json; None: full fine-tuning
adapter = None  # lora_from's tensors
if ckpt_path and ckpt_meta.get("lora"):  # resuming a LoRA run: the settings and the base come from its checkpoint
    lora, where = dict(ckpt_meta["lora"]), f"the checkpoint in {out_dir}"
elif ckpt_path and (lora_rank or lora_from):
    raise configurator.UserError(f"lora_rank / lora_from given but {out_dir} holds a full fine-tuning run: LoRA on top "
                                 f"of it needs a new out_dir with init_from={out_dir}")
elif lora_from and not ckpt_path:
    lora, adapter = checkpoint.load_peft_lora(lora_from)
    where = f"the adapter in {lora_from}"
elif lora_rank:
    lora = {"rank": lora_rank, "alpha": lora_alpha, "dropout": lora_dropout, "targets": lora_target_list}
if lora:
    # like the model's shape: an explicit key that disagrees with the checkpoint or adapter is a mistake
    for key, value in (("lora_rank", lora_rank), ("lora_alpha", lora_alpha), ("lora_targets", lora_target_list)):
        have = lora[key.removeprefix("lora_")]
        if key in overrides and value != have:
            raise configurator.UserError(f"{key}={overrides[key]} but {where} has {have}: drop the override")
    lora["dropout"] = lora_dropout if "lora_dropout" in overrides else lora["dropout"]  # a run key, like dropout
    if not (init_path or ckpt_path):
        raise configurator.UserError("LoRA adapts a trained model: set init_from= to a Hugging Face LLaMA directory "
                                     "or a run's out_dir (the base, which stays frozen)")
    if model_cfg.vocab_size < meta["vocab_size"]:
        raise configurator.UserError(f"{data_dir} has {meta['vocab_size']} token ids but the base has "
                                     f"{model_cfg.vocab_size}: LoRA keeps the embeddings frozen, so new tokens would "
                                     f"never be learned; prepare the data without added tokens, or use lora_rank=0")
    if model_cfg.tie_embeddings and "output" in lora["targets"]:
        raise configurator.UserError("lora_targets has output but the base ties the head to the embedding: merging "
                                     "would change the embedding too; drop output from lora_targets")
    if mesh.pp > 1 and lora["targets"] == ["output"]:
        raise configurator.UserError("lora_targets=output with pp > 1: the first stages would have nothing to train; "
                                     "add a per-layer target (wq, ...) or use pp=1")
    if ckpt_path:  # the checkpoint references its base (path + sha256); read it again
        checkpoint.load_base(raw_model, lora["base"], mesh)
    else:
        lora["base"] = checkpoint.base_reference(init_path if hf_index is not None else init_ckpt, mesh)
    apply_lora(raw_model, lora["rank"], lora["alpha"], lora["dropout"], lora["targets"], seed)
    if adapter is not None:
        checkpoint.load_lora_adapter(raw_model, adapter, lora_from)
    trainable = sum(p.numel() for p in raw_model.parameters() if p.requires_grad)
    mesh.print0(f"lora: r={lora['rank']} alpha={lora['alpha']:g} on {','.join(lora['targets'])}"
                f"{f' from {lora_from}' if adapter is not None else ''}: {trainable:,} trainable parameters "
                f"({trainable / raw_model.num_params():.2%}); the base ({lora['base']['path']}) is frozen")
if export_lora and not lora:
    raise configurator.UserError("export_lora= needs a LoRA run: set lora_rank= (e.g. 8) or lora_from=")
# ---- LoRA end
if model_cfg.vocab_size < meta["vocab_size"]:
    # vocabulary expansion: the data has tokens the model has never seen (extra and chat
    # tokens); new embedding and head rows start at the mean of the existing ones
    mesh.print0(f"growing the vocabulary from {model_cfg.vocab_size} to {meta['vocab_size']} (new rows: the mean row)")
    grow_vocab(raw_model, meta["vocab_size"])
    model_cfg = raw_model.cfg
flops_per_token, n_params = raw_model.flops_per_token(), raw_model.num_params()  # of the whole model

# ---- parallelism, applied from outside, and the optimizer -----------------------------
# In this order: cut the pipeline stage, move to the device, split the matmuls (tensor
# parallel: it swaps parameters, so before anything holds them), shard (FSDP), give the meta
# model storage and its weights, compile, then wrap for data parallel (whose hooks must see
# the compiled module's parameters).
# pp > 1: keep this stage's layers only, split by estimated cost (or as pp_layers says)
check(layer_counts is None or sum(layer_counts) == model_cfg.n_layer,
      f"pp_layers='{pp_layers}' sums to {sum(layer_counts or [])} but the model has n_layer={model_cfg.n_layer}")
check(mesh.pp * pp_virtual <= model_cfg.n_layer, f"pp={mesh.pp} x pp_virtual={pp_virtual} virtual stages but the "
                                                  f"model has n_layer={model_cfg.n_layer}: lower pp_virtual")
pp_counts = layer_counts or pipeline_split(model_cfg, mesh.pp * pp_virtual)
raw_model = make_stage(raw_model, mesh.pp_rank, mesh.pp, pp_counts, pp_virtual)
if whole_first:
    raw_model.to(mesh.device)
parallel.tensor_parallel(raw_model, mesh)  # tp > 1: each block's matmuls, the embedding and the head become slices
use_fsdp = fsdp and mesh.dp > 1  # with one dp rank there is nothing to shard over
mesh.print0(f"model: {n_params / 1e6:.2f}M parameters, {flops_per_token / 1e6:.1f} MFLOP/token; "
            f"{mesh.world} ranks: dp={mesh.dp} x pp={mesh.pp}" + (f" x tp={mesh.tp}" if mesh.tp > 1 else "") +
            "".join(f"; stage {s}: layers " + ", ".join(f"{r.start}-{r.stop - 1}" for r in rs)
                    for s in range(mesh.pp) if mesh.pp > 1
                    for rs in [[stage_layers(pp_counts, v * mesh.pp + s) for v in range(pp_virtual)]]))
if use_fsdp:  # shards raw_model in place: its parameters become DTensor shards
    parallel.fully_shard_model(raw_model, mesh, reshard_after_forward, bf16=dtype == "bfloat16", offload=offload)
if not whole_first:  # storage for what this rank holds, then its weights
    # (FSDP's CPU offload keeps the parameter shards in CPU memory: they are made there)
    parallel.materialize(raw_model, torch.device("cpu") if use_fsdp and offload else mesh.device)
    raw_model.init_rope(mesh.device)  # buffers derived from the config, not loaded
    with torch.no_grad():
        if hf_index is not None:  # (3): only this rank's tensors, and of a shard only its rows
            checkpoint.load_hf_parts(hf_index, parallel.local_parts(raw_model))
        elif init_ckpt is not None:  # (2): DCP reads only what this rank holds
            checkpoint.load(init_ckpt, raw_model)
        else:  # (4): this rank's slices of the weights a single process would draw; for (1) the
            # starting point until its checkpoint is loaded below, with the optimizer state (what
            # the wrappers and the optimizer built before that copy is defined, as before)
            parallel.init_weights(raw_model, seed)
model = torch.compile(raw_model) if compile else raw_model
if mesh.dp > 1 and not use_fsdp and ddp_impl == "torch":
    model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=ddp_bucket_mb, process_group=mesh.dp_group)
elif mesh.dp > 1 and not use_fsdp and ddp_impl == "naive":
    model = parallel.NaiveDataParallel(model, mesh)
elif mesh.dp > 1 and not use_fsdp and zero:  # ZeRO 1/2: each dp rank owns a slice of every bucket
    model = parallel.ZeroDataParallel(model, mesh, ddp_bucket_mb, zero)
elif mesh.dp > 1 and not use_fsdp:
    model = parallel.DataParallel(model, mesh, ddp_bucket_mb)
use_zero = isinstance(model, parallel.ZeroDataParallel)

# only what trains (all of it, or LoRA's adapters): the optimizer holds no state for frozen weights
trains = [(n, p) for n, p in raw_model.named_parameters() if p.requires_grad]
hidden = [p for n, p in trains if optim == "muon" and p.dim() == 2 and n.startswith("layers.")]
embedding = [p for n, p in trains if n == "tok_embeddings.weight"]  # (with tie_embeddings also the head)
decay = [p for n, p in trains if p.dim() >= 2 and all(p is not q for q in hidden + embedding)]  # head (+ AdamW: matmuls)
no_decay = [p for n, p in trains if p.dim() < 2]                                                # norm gains
groups = [{"params": embedding, "weight_decay": weight_decay, "lr_scale": embed_lr_scale},
          {"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
groups = [g for g in groups if g["params"]]  # a pipeline stage without the embedding, LoRA (frozen embedding)
fused = mesh.device.type == "cuda" and not offload
if use_zero:  # AdamW on this rank's slices, then an all-gather of the updated weights
    optimizer = parallel.ZeroOptimizer(model, groups, offload, lr=learning_rate, betas=(beta1, beta2), fused=fused)
elif optim == "muon":  # the layers' matrices (a stage's, with pp) by Muon, the rest by AdamW
    groups.append({"params": hidden, "weight_decay": weight_decay, "muon": True})
    optimizer = MuonWithAdamW(groups, lr=learning_rate, betas=(beta1, beta2), momentum=muon_momentum,
                              ns_dtype=torch.bfloat16 if mesh.device.type == "cuda" else torch.float32)
    if mesh.dp > 1 and not use_fsdp:  # every dp rank holds the same mean gradients: share the orthogonalizing
        optimizer.orthogonalize = parallel.shared_orthogonalize(mesh, optimizer.ns_dtype)
else:
    optimizer = torch.optim.AdamW(groups, lr=learning_rate, betas=(beta1, beta2), fused=fused)
# the gradients that clipping measures and the step uses: the model's, or (ZeRO) this rank's slices of them
grad_params = optimizer.params if use_zero else list(raw_model.parameters())
if ckpt_path:  # (1) weights and AdamW state, into whatever layout this run has
    checkpoint.load(ckpt_path, raw_model, optimizer)
act_shape = (batch_size, block_size, model_cfg.n_embd)  # what travels between pipeline stages


def get_lr(it):
    """Linear warmup to learning_rate, then down to min_lr at lr_decay_iters (flat after it):
    a cosine from the end of warmup, or (wsd) flat until the last cooldown_frac of the
    iterations and a straight line down in them. WSD's loss stays high while the rate is
    high and falls in the cooldown; it lets a run be extended by moving the cooldown."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / warmup_iters
    if it >= lr_decay_iters:
        return min_lr
    if lr_schedule == "wsd":
        cooldown = max(1, round(cooldown_frac * lr_decay_iters))
        progress = max(0.0, (it - (lr_decay_iters - cooldown)) / cooldown)
        return learning_rate - progress * (learning_rate - min_lr)
    progress = (it - warmup_iters) / max(1, lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (learning_rate - min_lr)


def micro_batches(x, y, mask):
    """[(x, y, loss_mask, doc_ids) of micro-batch k, on the device]: the unit that the plain
    loop and the pipeline schedules consume. loss_mask (SFT) and doc_ids (doc_mask) may be None."""
    doc = data.doc_ids(x, meta["eot_token"]) if doc_mask else None
    return [tuple(None if t is None else t[k].to(mesh.device) for t in (x, y, mask, doc)) for k in range(x.size(0))]


def token_weights(y, mask):
    """Each of this rank's micro-batches' weight in the mean over ALL target tokens of the
    global batch: n_k * dp / N, where n_k counts micro-batch k's target tokens (its loss-mask
    ones; without a mask, all) and N those of every micro-batch of every dp rank. A model's
    loss is the mean over its micro-batch, so loss_k * n_k is its token sum; the dp average
    divides by dp, which the factor dp undoes. Without masks every n_k is the same and the
    weight is 1 / micro_steps, the classic recipe, and no count needs to travel."""
    if mask is None:
        return [1.0 / y.size(0)] * y.size(0)  # = n * dp / (n * micro_steps * dp), exactly
    n = mask.sum(dim=(1, 2)).double()
    total = parallel.all_reduce_sum(n.sum(), mesh, group=mesh.dp_group).item()
    return (n * mesh.dp / max(total, 1.0)).tolist()


@torch.no_grad()
def evaluate(val_loader):
    """Mean loss over the target tokens of eval_iters global batches of val data (the same
    batches every time), weighted by tokens exactly like the training loss."""
    raw_model.eval()
    batches = [val_loader.batch(i) for i in range(eval_iters)]
    x, y, mask = (None if batches[0][j] is None else torch.cat([b[j] for b in batches]) for j in range(3))
    micro, weights = micro_batches(x, y, mask), token_weights(y, mask)
    if mesh.pp > 1:
        loss_sum = parallel.pipeline_forward(raw_model, mesh, micro, act_shape, autocast, weights, pp_virtual)
    else:
        loss_sum = torch.zeros((), device=mesh.device)
        for (xk, yk, mk, dk), w in zip(micro, weights):
            with autocast:
                _, loss = raw_model(xk, yk, mk, dk)
            loss_sum += loss * w
    raw_model.train()
    parallel.reshard(raw_model)  # fsdp with reshard_after_forward=False: free the weights eval gathered
    # the global mean, as in training: the sum over all ranks / dp (with pp only last stages hold
    # losses; with tp every rank of a tp group holds the same one)
    return parallel.all_reduce_sum(loss_sum.double(), mesh).item() / (mesh.dp * mesh.tp)


# ---- per-source loss of a mixture ---------------------------------------------------
# The model returns the mean loss of a micro-batch; the loss per source needs each sequence's
# token sum. A forward hook on the model (on the last pipeline stage: the one with the
# logits) recomputes them from the logits, so the plain loop and the pipeline schedules run
# unchanged. The schedules run the forwards in micro-batch order, so the k-th entry is
# micro-batch k's.
seq_losses = None  # a list while a training step runs: (B, 2) (token-loss sum, target tokens) per micro-batch


def record_seq_losses(module, args, output):
    logits, loss = output
    if seq_losses is None or loss is None:
        return
    targets, loss_mask = args[1], args[2] if len(args) > 2 else None
    with torch.no_grad():
        ce = torch.nn.functional.cross_entropy(logits.detach().flatten(0, 1).float(), targets.flatten(),
                                               reduction="none").view(targets.shape).double()
        m = torch.ones_like(ce) if loss_mask is None else loss_mask.double()
        seq_losses.append(torch.stack([(ce * m).sum(1), m.sum(1)], dim=1))


def source_sums(src):
    """(sources, 2) (token-loss sum, target tokens) of this rank's sequences per source (zeros
    on a stage without the head, and for one source); src: each sequence's source, (micro_steps,
    batch_size)."""
    out = torch.zeros(len(source_names), 2, dtype=torch.float64, device=mesh.device)
    if seq_losses:
        out.index_add_(0, src.flatten().to(mesh.device), torch.cat(seq_losses))
    return out


if len(source_names) > 1:
    raw_model.register_forward_hook(record_seq_losses)


# ---- run state, logging, checkpoints --------------------------------------------------
metrics_path = os.path.join(out_dir, "metrics.jsonl")


def rng_states():
    """This rank's random streams (dropout, NEFTune): the CPU one, and the GPU's where there is one."""
    return {"cpu": torch.get_rng_state(), **({"cuda": torch.cuda.get_rng_state()} if mesh.device.type == "cuda" else {})}


def set_rng_states(state):
    """Restores this rank's streams from a checkpoint's state.pt (one entry per rank that saved it)."""
    r = (mesh.rank - mesh.tp_rank) % len(state["rng_cpu"])  # a tp group shares one stream (its replicated dropout)
    torch.set_rng_state(state["rng_cpu"][r])
    if mesh.device.type == "cuda" and "rng_cuda" in state:
        torch.cuda.set_rng_state(state["rng_cuda"][r])


def truncate_metrics(upto):
    """Keep exactly the history up to a checkpoint at iteration `upto`: lines written after it
    (by a run that crashed, or before a rollback) are dropped, because those iterations are
    computed and logged again. (A train line's "iter" k is step k, the (k+1)-th; a val
    line's "iter" k comes after k steps.)"""
    if not mesh.master:
        return
    old = []
    if upto and os.path.exists(metrics_path):
        old = checkpoint.read_metrics(metrics_path)  # a torn last line (killed mid-append) is dropped
        old = [r for r in old if r["iter"] < upto or ("val_loss" in r and r["iter"] == upto)]
    with open(metrics_path + ".tmp", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in old)
    os.replace(metrics_path + ".tmp", metrics_path)


start_iter = 0
run_id = None
skip_iters = set()  # iterations whose batch gave non-finite values: stepped over after a rollback
if ckpt_path:
    start_iter = ckpt_meta["iter"]
    run_id = ckpt_meta.get("wandb_id")
    skip_iters = set(ckpt_meta.get("skip_iters", []))
    set_rng_states(ckpt_state)
    mesh.print0(f"resumed from {ckpt_path} at iteration {start_iter}")
else:
    torch.manual_seed(seed + mesh.rank // mesh.tp)  # dropout masks differ across ranks (on CPU and GPU), not within a tp group
if mesh.master:
    os.makedirs(out_dir, exist_ok=True)
    truncate_metrics(start_iter)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    if wandb_log:
        import wandb
        run_id = run_id or uuid.uuid4().hex[:8]  # kept in checkpoints: a resumed run logs to the same wandb run
        wandb.init(project=wandb_project, name=wandb_run_name or os.path.basename(os.path.abspath(out_dir)),
                   id=run_id, resume="allow", config=config, dir=out_dir)


def compact(by_source):
    """' [a 3.210, b 4.021]' of {'loss/a': 3.21, ...} for stdout ('' for one source)."""
    parts = [f"{key.split('/', 1)[1]} {value:.3f}" for key, value in by_source.items()]
    return f" [{', '.join(parts)}]" if parts else ""


def log(record):
    if mesh.master:
        with open(metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if wandb_log:
            wandb.log({k: v for k, v in record.items() if k != "iter"}, step=record["iter"])


pending = None  # the save in flight (ckpt_async): started, not finished yet
save_group = checkpoint.save_group(mesh) if ckpt_async else None  # its own process group (see checkpoint.py)


def save(it):
    """Every rank writes its part (weights and AdamW state under global names: the whole
    model once, whatever the layout, so any layout can resume it); rank 0 adds every rank's
    RNG states and the run's metadata, taken now. With ckpt_async the write goes on in the
    background and finish_save() completes it later; one save is in flight at most."""
    global pending
    finish_save(it)  # the previous save first
    info = {"iter": it, "config": config, "model": asdict(model_cfg), "tokens": it * tokens_per_iter,
            "dataset": data_dir, "tokenizer": tokenizer, "wandb_id": run_id, "world": mesh.world,
            "skip_iters": sorted(skip_iters), "extra_tokens": meta.get("extra_tokens", []), "lora": lora}
    rngs = parallel.gather_to_master(rng_states(), mesh)  # each rank's dropout streams
    state = None if rngs is None else {f"rng_{k}": [r[k] for r in rngs] for k in rngs[0]}
    pending = checkpoint.start_save(out_dir, it, raw_model, optimizer, state, info, mesh, ckpt_async, save_group,
                                    fault_save_delay_s)
    if not ckpt_async:
        finish_save(it)


def finish_save(now):
    """Waits for the save in flight, if any, to be written on every rank, then makes it the
    latest checkpoint (manifest, rename, ckpt/latest, pruning). Every rank calls it at the same
    point: at the next save, once the all-reduce of a step says every rank has written, before
    a rollback, and at the end, before anything reads the checkpoints (`now`: the iteration
    counter then). A failed write raises its UserError here."""
    global pending
    if pending is None:
        return
    done, pending = pending, None
    path = checkpoint.finish_save(done, keep_ckpts, resumed_from=ckpt_path)
    mesh.print0(f"saved checkpoint {path}" + (f" (async: finished at iteration {now})" if ckpt_async else ""))


def rollback(streak, it):
    """The NaN guard's last resort: reload the latest checkpoint (weights, AdamW state, RNG)
    and return its iteration. The bad iterations stay in skip_iters, so this time their
    batches are stepped over. With nan_action=stop, or nothing to go back to, an error."""
    finish_save(it)  # an async save in flight is the latest checkpoint once finished
    back = checkpoint.find(out_dir, mesh, warn=mesh.print0)
    if nan_action == "stop" or back is None:
        raise configurator.UserError(
            f"{streak} iterations in a row (up to {it}) had a non-finite loss or gradient norm"
            f"{'' if back else ' and there is no checkpoint to roll back to'}: lower learning_rate, "
            f"check the data around these iterations, or raise nan_max_consecutive")
    back_meta, back_state = checkpoint.read_meta(back)
    checkpoint.load(back, raw_model, optimizer)
    set_rng_states(back_state)
    skip_iters.update(back_meta.get("skip_iters", []))
    truncate_metrics(back_meta["iter"])
    mesh.print0(f"rolled back to {back}: continuing from iteration {back_meta['iter']}, stepping over "
                f"{sorted(i for i in skip_iters if i >= back_meta['iter'])}")
    return back_meta["iter"]


signals = []  # SIGTERM / SIGUSR1 (preemption notice) / Ctrl-C received


def on_signal(signum, frame):
    # finish the step in progress, checkpoint and exit 0: the stop is agreed by all ranks at
    # the end of the step, in the same all-reduce as the loss. A second Ctrl-C exits at once.
    if signum == signal.SIGINT and signals:
        os._exit(130)
    signals.append(signum)
    print(f"rank {mesh.rank}: got {signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
          f"(Ctrl-C again to quit at once)", file=sys.stderr, flush=True)


for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
    signal.signal(sig, on_signal)

peak = peak_flops or measure_matmul_flops(mesh.device, torch.bfloat16 if dtype == "bfloat16" else torch.float32)
flops_per_iter = flops_per_token * tokens_per_iter
mesh.print0(f"{tokens_per_iter:,} tokens/iter ({train_loader.n_chunks:,} train chunks, "
            f"{train_loader.epoch(max_iters):.2f} epochs by max_iters), peak {peak / 1e9:.1f} GFLOP/s for MFU")

# ---- the loop -------------------------------------------------------------------------
it = start_iter
evaluated_at = start_iter if ckpt_path else None  # its val loss is already in metrics.jsonl
saved_at = start_iter  # the checkpoint of this iteration exists (or it is iteration 0)
dt_avg = None
stop = False       # a signal asked this run to stop (agreed by all ranks)
bad_streak = 0     # consecutive iterations with a non-finite loss or gradient norm
while True:
    if (it % eval_interval == 0 or it == max_iters) and it != evaluated_at:
        val = {name: evaluate(loader) for name, loader in val_loaders.items()}  # mixture: every source's
        val_loss = sum(w * val[name] for name, w in zip(source_names, mix_weights))
        by_source = {f"val_loss/{name}": v for name, v in val.items()} if len(val) > 1 else {}
        mesh.print0(f"iter {it}: val loss {val_loss:.4f}" + compact(by_source))
        log({"iter": it, "val_loss": val_loss, **by_source, "tokens": it * tokens_per_iter,
             "elapsed_s": time.time() - started})
    if it != saved_at and (it % ckpt_interval == 0 or it == max_iters or stop):
        save(it)
        saved_at = it
    if it >= max_iters or stop:
        break
    if it in skip_iters:  # its batch gave non-finite values before a rollback: step over it
        mesh.print0(f"iter {it}: skipped (non-finite before the rollback)")
        log({"iter": it, "loss": None, "grad_norm": None, "skipped": "known bad batch"})
        it += 1
        continue

    # ================================ TRAINING SECTION BEGIN ================================
    t0 = time.perf_counter()
    lr = get_lr(it) * train_loader.lr_scale(it)  # the curriculum phase's factor (1 without phases)
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    optimizer.zero_grad(set_to_none=True)
    x, y, mask, src = train_loader.batch(it)  # this rank's micro-batches: (micro_steps, batch_size, block_size)
    seq_losses = [] if len(source_names) > 1 else None  # mixture: filled by the forward hook
    micro = micro_batches(x, y, mask)    # [(x, y, loss_mask, doc_ids) of micro-batch k]
    # The objective is the mean cross-entropy over every target token of the global batch.
    # backward() adds each micro-step's gradient into .grad and data parallel averages over
    # the dp ranks, so micro-batch k's loss (a mean over its own n_k tokens) is weighted by
    # n_k * dp / N (N: target tokens of the whole global batch). The classic recipe, loss /
    # micro_steps, is the same only when every micro-batch has as many target tokens; with
    # loss masks (SFT) it would weigh a micro-batch with 3 target tokens like one with 300.
    weights = token_weights(y, mask)
    trace = [] if pp_trace and mesh.pp > 1 and it == start_iter + 1 else None
    if mesh.pp == 1:
        # plain: one micro-step after the other, each a whole forward and backward
        loss_sum = torch.zeros((), device=mesh.device)
        for k, (xk, yk, mk, dk) in enumerate(micro):
            # data parallel (DataParallel / DDP all-reduce, FSDP reduce-scatter): sync only in the
            # last micro-step's backward (no_sync before). The communication is launched by
            # hooks *during* backward, so the flag must be set before this micro-step's
            # backward starts; we set it before its forward.
            parallel.set_grad_sync(model, k == len(micro) - 1)
            with autocast:
                _, loss = model(xk, yk, mk, dk)
            (loss * weights[k]).backward()
            loss_sum += loss.detach() * weights[k]
    else:
        # pipeline: this stage runs its part of every micro-batch's forward and backward in the
        # schedule's order (the same weights inside), sending activations to the next stage and
        # their gradients to the previous one; with dp, the stage's gradients are all-reduced
        # in its last backward only. The loss exists on the last stage only.
        loss_sum, _ = parallel.pipeline_step(pp_schedule, model, mesh, micro, act_shape, autocast, trace, weights,
                                             pp_virtual)
    if isinstance(model, parallel.DataParallelBase):
        model.wait()  # the last buckets' all-reduces may still be in flight: every rank now has the mean gradient
    if fault_nan_at <= it < fault_nan_at + fault_nan_steps:  # fault injection, for testing the guard below
        for p in grad_params:
            if p.grad is not None:  # frozen weights have none
                p.grad.fill_(float("nan"))
    # one all-reduce for the loss (the global mean: the weighted sums of all ranks / dp, as in
    # evaluate), the stop flag, the ranks whose async save is written, and a mixture's
    # per-source (token-loss sum, target tokens)
    flags = torch.tensor([float(bool(signals)), float(pending is not None and checkpoint.written(pending))],
                         dtype=torch.float64, device=loss_sum.device)
    totals = parallel.all_reduce_sum(torch.cat([loss_sum.double().view(1), flags, source_sums(src).flatten()]), mesh)
    loss_mean, stop = totals[0].item() / (mesh.dp * mesh.tp), totals[1].item() > 0  # tp: the same loss tp times
    all_written = totals[2].item() == mesh.world
    seq_losses, per_source = None, totals[3:].view(-1, 2).tolist()
    # clip by the norm of the whole model's gradient, across pipeline stages, FSDP shards and ZeRO slices
    # (computed even when not clipping, for the log); every rank gets the same norm
    grad_norm = parallel.clip_grad_norm_(grad_params, grad_clip, mesh, sharded=use_zero).item()
    finite = math.isfinite(loss_mean) and math.isfinite(grad_norm)  # the same verdict on every rank
    if finite:
        optimizer.step()
        bad_streak = 0
    else:  # NaN / Inf guard: no update from this batch
        bad_streak += 1
        skip_iters.add(it)
    dt = time.perf_counter() - t0  # .item() above waited for the device
    # ================================ TRAINING SECTION END ==================================
    # everything that follows now is diagnostics, logging, the NaN guard's decision and an async save's end
    if all_written:  # every rank has written the save in flight: make it the latest checkpoint
        finish_save(it + 1)
    dt_avg = dt if dt_avg is None else 0.9 * dt_avg + 0.1 * dt
    if trace is not None:
        parallel.print_pipeline_timeline(trace, mesh, len(micro), pp_virtual)
    if it == start_iter:  # what this rank holds, once gradients and optimizer state exist
        mem = parallel.memory_bytes(raw_model, optimizer)
        split = (f" (fsdp: 1/{mesh.dp} of each)" if use_fsdp else
                 f" (zero={zero}: 1/{mesh.dp} of the optimizer{' and grads' if zero == 2 else ''})" if use_zero else "")
        if offload and (use_zero or use_fsdp) and mesh.device.type == "cuda":
            split += " (optimizer in CPU memory)"
        mesh.print0("memory per rank: " + ", ".join(f"{k} {v / 2 ** 20:.2f} MB" for k, v in mem.items()) + split)
    if not finite:
        mesh.print0(f"iter {it}: non-finite loss {loss_mean} / grad norm {grad_norm}: step skipped "
                    f"({bad_streak} in a row, nan_max_consecutive={nan_max_consecutive})")
        log({"iter": it, "loss": None, "grad_norm": None, "skipped": "non-finite loss or grad norm"})
        if bad_streak >= nan_max_consecutive:  # stop, or roll back and go on from the checkpoint
            it = evaluated_at = saved_at = rollback(bad_streak, it)
            bad_streak = 0
            continue
        it += 1
        continue
    if it % log_interval == 0 or it == max_iters - 1:
        tok_per_s = tokens_per_iter / dt
        mfu = flops_per_iter / dt / (peak * mesh.world)
        # a mixture: each source's loss over its target tokens in the global batch
        by_source = {f"loss/{name}": total / n for name, (total, n) in zip(source_names, per_source)
                     if n > 0 and len(source_names) > 1}
        mesh.print0(f"iter {it}: loss {loss_mean:.4f}, lr {lr:.2e}, grad norm {grad_norm:.3f}, "
                    f"{dt * 1000:.0f} ms, {tok_per_s:,.0f} tok/s, mfu {mfu:.1%}, "
                    f"eta {dt_avg * (max_iters - it - 1) / 60:.1f} min" + compact(by_source))
        log({"iter": it, "loss": loss_mean, "lr": lr, "grad_norm": grad_norm, "tokens": (it + 1) * tokens_per_iter,
             "dt_ms": dt * 1000, "tok_per_s": tok_per_s, "mfu": mfu, **by_source})
    it += 1

# ---- the end --------------------------------------------------------------------------
finish_save(it)  # load-bearing: the last checkpoint is complete, and `latest` names it, only after this
if stop:
    mesh.print0(f"stopped by a signal after iteration {it}: checkpoint saved; run the same command again to continue")
if mesh.master and wandb_log:
    wandb.finish()
whole = mesh.pp == 1 and mesh.tp == 1 and not use_fsdp  # rank 0 holds the whole model (else: a stage, shards or slices)
parallel.teardown(mesh)  # the other ranks are done: rank 0's export and sample below take as long as they need
if mesh.master and not stop and (export_hf or export_lora or sample_tokens > 0):
    final = raw_model if whole else checkpoint.load_whole(checkpoint.find(out_dir, None))[0].to(mesh.device)
    final.eval()
    if export_lora and lora:
        checkpoint.save_peft_lora(export_lora, final, lora)
        print(f"exported the LoRA adapters in PEFT's format to {export_lora}", flush=True)
    merge_lora(final)  # LoRA: W + (alpha / r) B A, which export_hf writes and sampling runs; else nothing
    if export_hf:
        checkpoint.save_hf_llama(export_hf, {k: v.cpu() for k, v in final.state_dict().items()}, model_cfg,
                                 data.tokenizer_from_meta(meta), export_shard_mb)
        print(f"exported the model as a Hugging Face LLaMA to {export_hf}", flush=True)
    if sample_tokens > 0:
        text = sample.sample_text(final, data.tokenizer_from_meta(meta), "", sample_tokens, 0.8, 50, autocast)
        print("-" * 30 + " sample " + "-" * 30 + "\n" + text + "\n" + "-" * 68, flush=True)
if mesh.backend:
    parallel.exit_now()  # all is written and the process group is gone: not through the interpreter's
                         # shutdown, where gloo's worker threads can abort a finished run (SIGABRT)
