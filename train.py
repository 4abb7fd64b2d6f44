"""Train a LLaMA-style model: the whole run, top to bottom (docs/configuration.md: every key).

    python train.py                                    # the default job; run again: it continues
    torchrun --standalone --nproc_per_node=2 train.py  # the same on 2 data-parallel ranks
    python train.py config/tiny.py max_iters=50        # a config file, then key=value overrides

Techniques enter on lines marked with their file, e.g. `# tensor parallel: tensor_parallel.py`.
"""

import json
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, fields

# first: --help, and a Ctrl-C while torch imports (seconds), need no torch
from guards import guard_errors
guard_errors.start_command(sys.argv[1:], "train.py")
import torch

import checkpoint
import configurator
import data
from guards import guard_config
from guards import guard_data
from guards import guard_dist
from guards import guard_env
from guards import guard_files
from formats import hf_cache  # init_from=ORG/NAME
from techniques import loss_scale  # fp16: loss_scale.py
import origin
import parallel
import rundir
from techniques import nan_guard
import tokenizer as tokenizer_py
import workarounds
from model import ModelConfig, Transformer, grow_vocab
from optim import build_optimizer, get_lr, pretrained_rate_note, schedule_note

# ---- defaults: a config file or key=value overrides any of them (--help lists them) ----
# I/O: out_dir holds the checkpoints, metrics.jsonl and config.json
out_dir = "out"                 # where this run writes (see above)
init_from = "auto"              # 'auto', 'resume' (must), 'scratch' (must not); or where to start
                                # from: a Hugging Face model directory, or a run's out_dir
revision = ""                   # init_from=ORG/NAME[@REV] (the hub cache's): its branch or commit
export_hf = ""                  # at the end, also write a Hugging Face LLaMA directory here
export_shard_mb = 5000.0        # its shards' size, with an index (0: one file)
eval_interval = 100             # iterations between evaluations (val loss, bits per byte)
eval_iters = 10                 # global batches of val data per evaluation
eval_tasks = ""                 # multiple-choice tasks scored at each eval: 'a.jsonl,b.jsonl'
log_interval = 10               # iterations between log lines
ckpt_interval = 250             # iterations between checkpoints (and one at the end)
keep_ckpts = 2                  # the newest this many (0: all)
ckpt_async = False              # write checkpoints in the background
wandb_log = False               # also log to Weights & Biases (rank 0)
wandb_project = "trainer"       # its project
wandb_run_name = ""             # '': out_dir's base name
tensorboard_log = False         # also write the records as TensorBoard events (tensorboard_dir)
tensorboard_dir = ""            # '': out_dir/tb (`tensorboard --logdir out_dir` shows them)
# data: a name under data/ or a directory, prepared from data_source if missing
dataset = "stdlib"              # one prepared dataset: a name under data/ or a directory
datasets = ""                   # a mixture instead: 'stdlib:0.7,notes:0.3'
mix_temperature = 1.0           # a mixture's weights^(1/T), renormalised (1: as given)
phases = []                     # [(start_iter, {source: weight}[, lr_scale]), ...]
data_source = ""                # 'stdlib', a directory or glob of .txt, .jsonl(.gz/.zst), .parquet
tokenizer = "cl100k_base"       # any tiktoken encoding; cl100k_base works offline
vocab_size = 8192               # the BPE cut to this many ids (0: whole)
extra_tokens = ""               # a file of domain strings (one a line) added to the tokenizer
val_fraction = 0.01             # preparing: the share of documents held out for val
packing = "auto"                # rows: 'concat' (end to end, cut), 'bfd' (whole documents:
                                # packing.py), 'auto' (bfd for chat data, concat for text)
# batch_size x grad_accum_steps x block_size tokens per iteration, whatever the layout
batch_size = 12                 # sequences per micro-batch per rank
grad_accum_steps = 2            # micro-batches per iteration, summed over data-parallel ranks
block_size = 64                 # tokens per sequence
max_iters = 350                 # iterations: optimizer steps
# model
n_layer = 4                     # transformer blocks
n_head = 4                      # query heads
n_kv_head = 2                   # < n_head: grouped-query attention
n_embd = 128                    # the residual stream's width
ffn_dim = 0                     # SwiGLU width (0: 8/3 n_embd, rounded up to a multiple of 32)
head_dim = 0                    # each head's width (0: n_embd / n_head)
qk_norm = False                 # RMSNorm each head's q and k before RoPE (Qwen3)
dropout = 0.0                   # 0 for layout equivalence (and for fine-tuning)
tie_embeddings = False          # the head shares the token embedding's weights
grad_ckpt = False               # recompute each block in backward (ac='full')
ac = "none"                     # what blocks recompute in backward: 'full', 'op' (all but the
                                # matmuls' and attention's outputs), 'layers:K' (every K-th whole)
offload_activations = False     # what backward reads waits in CPU memory
loss_chunk = 0                  # the head and loss in chunks of this many rows (0: all at once)
loss_recompute = True           # loss_chunk: backward recomputes each chunk's logits (False: keeps
                                # their softmax, rows x vocab floats, one head matmul less)
doc_mask = False                # attention stays inside each document of a packed sequence
doc_attention = "varlen"        # how: 'varlen' (each document's own) or 'dense' (a T x T mask)
neftune_alpha = 0.0             # noise of scale alpha/sqrt(T*n_embd) on the input embeddings
rope_theta = 0.0                # long context: a new RoPE base (0: the model's)
rope_scaling = ""               # and/or 'yarn:4', 'linear:4', 'llama3:8' ('': the model's; 'none')
# mixture of experts (moe.py): every moe_every-th feed-forward becomes n_experts (0: dense) experts
n_experts = 0                   # experts per MoE layer (0: dense)
moe_top_k = 2                   # experts each token goes to
moe_every = 1                   # every this-many-th layer is MoE (the last of each group)
moe_ffn_dim = 0                 # each expert's width (0: ffn_dim)
moe_score = "softmax"           # router scores: 'softmax' or 'sigmoid' (DeepSeek-V3)
moe_norm_topk = True            # renormalise the top_k weights to sum 1
moe_shared_ffn_dim = 0          # > 0: a shared expert this wide (Qwen2-MoE)
moe_aux_weight = 0.01           # load-balancing loss weight (Switch)
moe_z_weight = 0.0              # router z-loss weight (ST-MoE)
moe_bias_rate = 0.0             # > 0: DeepSeek-V3's aux-loss-free balancing bias step
ep = 1                          # expert parallel: the experts split over ep ranks of dp
# LoRA: adapters of rank lora_rank (0: none) on a frozen base; the checkpoints hold the adapters
lora_rank = 0                   # adapters' rank (0: no LoRA, full fine-tuning)
lora_alpha = 16.0               # the adapters' scale is lora_alpha / lora_rank
lora_dropout = 0.0              # dropout on the adapters' input
lora_targets = "wq,wk,wv,wo"    # any of wq,wk,wv,wo,w1,w2,w3,output
lora_from = ""                  # start from these adapters (a PEFT directory)
export_lora = ""                # at the end, also write the adapters here (PEFT's format)
loss_type = "sigmoid"           # pairs (preference.py): 'sigmoid' (DPO), 'ipo' or 'simpo'
beta = 0.1                      # how far from the reference (TRL's default; SimPO's paper: 2.0)
label_smoothing = 0.0           # sigmoid, simpo: the chance a pair's label is wrong (cDPO)
simpo_gamma = 0.5               # simpo: the target reward margin
# optimizer: Muon for the layers' matrices, AdamW for the rest (or AdamW alone), one learning rate
optim = "muon"                  # 'muon' (Muon + AdamW) or 'adamw'
learning_rate = 4e-3            # the peak rate
embed_lr_scale = 10.0           # the token embedding's rate is learning_rate x this
muon_momentum = 0.95            # Muon's Nesterov momentum
weight_decay = 0.1              # on matrices (2-D and up), not gains or biases
beta1 = 0.9                     # AdamW's
beta2 = 0.99                    # AdamW's
grad_clip = 1.0                 # clip the global gradient norm to this (0: no clipping)
# learning rate: warmup, then 'cosine' to min_lr, or 'wsd': flat, then linear over cooldown_frac
lr_schedule = "cosine"          # 'cosine' or 'wsd' (above)
warmup_iters = 20               # linear warmup from 0
lr_decay_iters = 0              # 0: max_iters
cooldown_frac = 0.2             # wsd: the share of iterations that decays
min_lr = 4e-4                   # the rate at the end of the decay
# the NaN guard: a non-finite loss or grad norm skips the step; nan_max_consecutive in a row stop
# the run or roll it back (nan_action)
nan_max_consecutive = 3         # non-finite steps in a row before nan_action
nan_action = "rollback"         # roll back to the latest checkpoint, or 'stop'
# system; float16 scales the loss (the loss_scale keys: torch's GradScaler's defaults)
device = "auto"                 # 'auto': cuda if available, else cpu
dtype = "auto"                  # autocast's: bf16 where native (CUDA: else fp16), else float32
loss_scale_init = 65536.0       # float16: the first loss scale
loss_scale_growth = 2.0         # times this after loss_scale_interval clean steps
loss_scale_backoff = 0.5        # times this after an overflow
loss_scale_interval = 2000      # clean steps before it grows
compile = False                 # torch.compile the model
plan = False                    # print the memory plan per rank (activations too) and exit
seed = 1337                     # weights, data order and dropout all derive from it
peak_flops = 0.0                # what MFU divides by (0: a GPU's datasheet, or a measured matmul)
dist_timeout_s = 300            # a collective waiting longer (a dead peer) ends the run
backend = "auto"                # 'auto': nccl on CUDA, gloo on CPU
# layout: dp = world_size / (pp x cp x tp)
pp = 1                          # pipeline stages
tp = 1                          # tensor parallel ranks (Megatron slices)
sp = False                      # tp: sequence parallel
cp = 1                          # context parallel: each rank holds a part of every sequence
pp_schedule = "1f1b"            # '1f1b', 'gpipe' or 'interleaved' (pp_virtual chunks per stage)
pp_virtual = 1                  # interleaved: chunks of layers per stage
pp_layers = ""                  # layers per stage, e.g. '3,1' ('': balanced by cost)
pp_trace = False                # print the schedule as an ASCII timeline
ddp_impl = "bucketed"           # 'bucketed' (overlapped), 'naive' (per parameter) or 'torch'
ddp_bucket_mb = 4.0             # data parallel's all-reduce bucket size
fsdp = False                    # shard weights, gradients and optimizer state over dp (FSDP2)
reshard_after_forward = True    # fsdp: free a block's gathered weights after its forward
zero = 0                        # ZeRO: 1 shards the optimizer state over dp, 2 also the gradients
offload = False                 # zero, fsdp on CUDA: optimizer state in CPU memory
# the end of the run, and the profiler
sample_tokens = 120             # tokens to generate at the end (0: none)
profile_iters = ""              # 'a:b': profile iterations a..b-1 (traces in out_dir/trace/)
profile_memory = False          # profile_iters on CUDA: also a snapshot of the allocator's history
# -----------------------------------------------------------------------------------------

# a UserError (or a dead peer) prints one line, not a traceback
sys.excepthook = guard_dist.run_excepthook
config_keys = [k for k, v in globals().items()
               if not k.startswith("_") and isinstance(v, (int, float, bool, str, list))]
overrides = configurator.configure({k: globals()[k] for k in config_keys}, sys.argv[1:])
globals().update(overrides)
if "/" in init_from + lora_from:  # ORG/NAME: the model in the local hub cache (hf_cache.py)
    init_from, lora_from = hf_cache.local(revision, init_from=init_from, lora_from=lora_from)
world = guard_env.world_size()  # torchrun's variables, checked
if world > 1:  # a layout may need more micro-batches than the default gives (a note says so)
    grad_accum_steps = configurator.batch_for_layout(globals(), overrides, world)
config = {k: globals()[k] for k in config_keys}
# every check, before anything is written or a peer is met
guard_config.validate(config, overrides, world)
if plan or guard_config.may_not_fit(config, world):  # the memory plan: memory_plan.py
    from techniques import memory_plan
    memory_plan.check_fits(config, world, print_only=plan)
started = time.time()

# ---- setup -----------------------------------------------------------------------------------
guard_env.wait_for_master(dist_timeout_s)
mesh = parallel.setup(device, dist_timeout_s, backend, pp, tp, cp)
if dtype == "auto":  # bf16 where native, else fp16 (CUDA) or float32
    dtype = parallel.auto_dtype(mesh.device.type)
autocast = (nullcontext() if dtype == "float32"
            else torch.autocast(mesh.device.type, dtype=getattr(torch, dtype)))
scaler = loss_scale.LossScaler.from_config(config) if dtype == "float16" else None  # fp16
torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = (
    mesh.device.type == "cuda")
if mesh.device.type == "cpu":
    # keep freed memory: each step's large tensors would page-fault in again (~7% of a CPU step)
    workarounds.keep_freed_memory()
# where the weights come from: (1) this run's checkpoint (resume), (2) another run's, (3) a Hugging
# Face directory, or (4) fresh. A run may be writing out_dir: lock it (made if new; a refused run
# removes what the lock made) before reading its checkpoints.
if mesh.master:
    guard_files.lock_out_dir(out_dir)
src = origin.weights_source(out_dir, init_from, mesh)
# a model we start from brings its tokenizer: the data must be tokenized with it
spec = None if src.kind == "fresh" else tokenizer_py.model_spec(src, tokenizer, vocab_size)
# the config as this run uses it: a model's shape and tokenizer are its own (marked *)
mesh.print0(origin.config_line(config, src, spec) if src.saved else
            "config: " + " ".join(f"{k}={v!r}" for k, v in config.items()))
if max_iters < warmup_iters:
    mesh.print0(schedule_note(config))
if src.kind in ("hf", "run") and learning_rate >= 1e-3 and not lora_rank:  # a from-scratch rate
    mesh.print0(pretrained_rate_note(config))
if src.kind == "resume":
    guard_config.check_same_run(src, config, overrides, out_dir)
    if origin.finished(src, config, out_dir, mesh):
        parallel.teardown(mesh)  # nothing to do, nothing rewritten
        workarounds.exit_now()

# ---- data: one dataset, or a mixture ---------------------------------------------------------
mixing, pref = bool(datasets or phases), None  # pref: preference alignment (preference.py)


def prepared(source, prep):
    """The directory of `source` (a name under data/ or a directory), prepared first if missing."""
    data_dir = data.dataset_dir(source)
    if not os.path.exists(os.path.join(data_dir, "meta.json")):  # preparation: prepare.py
        import prepare
        prepare.prepare_missing(source, data_dir, prep, tokenizer, vocab_size, val_fraction,
                                extra_tokens, mesh, spec, block_size)
    guard_data.check_made_as_asked(data_dir, {"val_fraction": val_fraction, "data_source": prep},
                                   overrides)
    return data_dir


def loader(data_dir, split):
    """This dp rank's micro-batches of every global batch."""
    ld = data.Loader(data_dir, split, block_size, batch_size, grad_accum_steps, seed, mesh.dp_rank,
                     mesh.dp, packing)
    if ld.packed:  # whole documents per row: packing.py
        mesh.print0("packing: " + ld.packed.note(f"{data_dir} {split}"))
    return ld


if not mixing:
    data_dir = prepared(dataset, data_source)
    # the tokenizer and vocabulary the data was prepared with
    meta = guard_data.read_meta(data_dir)
    if meta.get("format") != "preference":
        train_loader, val_loaders = loader(data_dir, "train"), {dataset: loader(data_dir, "val")}
    else:  # preference alignment: preference.py (whole pairs per micro-batch)
        from techniques import preference
        pref, train_loader, val_loaders = preference.setup(config, mesh, data_dir, dataset)
else:  # mixture: mixture.py (each sequence drawn from one source; per-source losses logged)
    from techniques import mixture
    sources = configurator.mixture_sources(config)
    data_dir, meta, train_loader, val_loaders, val_weights = mixture.setup(
        sources, phases, mix_temperature,
        lambda s: prepared(s, data_source if not datasets else ""), loader)
for d in data_dir.split(","):  # each dataset was tokenized as the model (or this run) says
    if spec:
        tokenizer_py.check_model_tokenizer(guard_data.read_meta(d), d, spec, src.where)
    else:
        guard_data.check_tokenizer(guard_data.read_meta(d), d, tokenizer, vocab_size)
tokens_per_iter = batch_size * grad_accum_steps * block_size

# ---- the model -------------------------------------------------------------------------------
# the config's model keys, the data's vocabulary (rope_theta, 0 = the model's: hf_rope.py, below)
model_keys = [f.name for f in fields(ModelConfig) if f.name not in ("vocab_size", "rope_theta")]
model_cfg = ModelConfig(vocab_size=meta["vocab_size"],
                        **{k: config[k] for k in model_keys if k in config})
if src.saved is not None:
    model_cfg = origin.saved_shape(src, overrides, meta.get("base_vocab_size", meta["vocab_size"]),
                                   config, world)
if (rope_theta or rope_scaling) and src.kind != "resume":  # long context: hf_rope.py
    from formats import hf_rope
    model_cfg = ModelConfig(**hf_rope.with_run_rope(asdict(model_cfg), rope_theta, rope_scaling,
                                                    block_size))
lora = None
if lora_rank or lora_from or src.lora:  # LoRA: lora.py
    from techniques import lora as lora_py
    lora, adapter = lora_py.settings(config, overrides, src)
guard_errors.check(lora or not export_lora,
                   "export_lora= needs a LoRA run: set lora_rank= (e.g. 8) or lora_from=")
# Where the weights come from, in a forced order. Built whole (one process, dp, ZeRO, cp; and any
# layout under LoRA or a vocabulary growth, which change a whole model): fresh, then a base or
# run loaded over them, then LoRA's adapters, a growth's rows. The others (pp, tp, FSDP, ep): on
# the meta device, cut below, then given this rank's part (fresh, base or run: meta_build.py). A
# resume loads its checkpoint into either once the optimizer exists (its state too).
use_fsdp = fsdp and mesh.dp > 1
grows = model_cfg.vocab_size < meta["vocab_size"]
holds_whole = not (pp > 1 or tp > 1 or use_fsdp or ep > 1)
built_whole = holds_whole or lora is not None or grows
# each weight is drawn from (seed, its name): the same bits on every layout; raw_model is the
# plain module that checkpoints, eval and sampling use
with nullcontext() if built_whole else torch.device("meta"):
    raw_model = Transformer(model_cfg, seed)
if built_whole and src.kind in ("hf", "run"):
    origin.load_whole_into(raw_model, src)
if lora:  # LoRA: lora.py
    lora_py.attach(raw_model, lora, adapter, src, meta, mesh, seed, lora_from)
if grows:
    mesh.print0(f"growing the vocabulary from {model_cfg.vocab_size} to {meta['vocab_size']} (new "
                f"rows: the mean row)")
    model_cfg = grow_vocab(raw_model, meta["vocab_size"]).cfg
flops_per_token, n_params = raw_model.flops_per_token(), raw_model.num_params()
mesh.print0(f"model: {n_params / 1e6:.2f}M parameters, {flops_per_token / 1e6:.1f} MFLOP/token; "
            f"{mesh.world} ranks: dp={mesh.dp} x pp={mesh.pp}"
            + "".join(f" x {k}={n}" for k, n in (("cp", cp), ("tp", tp)) if n > 1)
            + f"; {dtype}" + (" (dtype=auto)" if config["dtype"] == "auto" else ""))

# ---- parallelism, applied from outside, and the optimizer ------------------------------------
# In this order: cut the stage, split experts and matmuls (before anything holds what tp swaps),
# the sequence, shard, fill a meta model, MoE, what to recompute, compile, wrap dp last (hooks).
if pp > 1:  # pipeline: pipeline.py
    from techniques import pipeline
    raw_model = pipeline.cut_stage(raw_model, mesh, configurator.layer_counts(pp_layers),
                                   pp_virtual)
if built_whole:
    raw_model.to(mesh.device)
if ep > 1:  # expert parallel: expert_parallel.py
    from techniques import expert_parallel
    from techniques import moe
    expert_parallel.expert_parallel(raw_model, mesh, ep, moe.moe_layers)
if tp > 1:  # tensor parallel: tensor_parallel.py (sp too)
    from techniques import tensor_parallel
    tensor_parallel.tensor_parallel(raw_model, mesh, sp)
if cp > 1:  # context parallel: context_parallel.py
    from techniques import context_parallel
    context_parallel.context_parallel(raw_model, mesh)
if use_fsdp:  # FSDP: fsdp.py
    from techniques import fsdp as fsdp_py
    fsdp_py.fully_shard_model(raw_model, mesh, reshard_after_forward, offload=offload)
if not built_whole:  # the meta-device build: meta_build.py
    from techniques import meta_build
    meta_build.fill(raw_model, src, seed, mesh,
                    torch.device("cpu") if use_fsdp and offload else mesh.device)
if src.kind == "hf":
    origin.check_finite_base(raw_model, src, mesh)
if model_cfg.n_experts:  # mixture of experts: moe.py
    from techniques import moe
    moe.attach(raw_model, model_cfg)
if ac != "none" or grad_ckpt or offload_activations:  # activation memory: activations.py
    from techniques import activations
    mesh.print0(activations.apply(raw_model, "full" if grad_ckpt else ac, offload_activations))
model = torch.compile(raw_model) if compile else raw_model
use_zero = zero and mesh.dp > 1 and not use_fsdp
if use_zero:  # ZeRO: zero.py
    from techniques import zero as zero_py
    model = zero_py.ZeroDataParallel(model, mesh, ddp_bucket_mb, zero)
elif mesh.dp > 1 and not use_fsdp:  # data parallel: data_parallel.py
    from techniques import data_parallel
    model = data_parallel.wrap(model, mesh, ddp_impl, ddp_bucket_mb)
optimizer, grad_params = build_optimizer(raw_model, model, mesh, config,
                                         zero_py.ZeroOptimizer if use_zero else None)
if src.kind == "resume":
    checkpoint.load(src.path, raw_model, optimizer)
act_shape = (batch_size, block_size, model_cfg.n_embd)  # what travels between pipeline stages


def micro_batches(x, y, mask, eot):
    """[(x, y, loss_mask, doc_ids) of micro-batch k, on the device] for the loop and the pipeline
    (loss_mask, doc_ids may be None). eot: the id ending a document (a mixture's: a row's own)."""
    doc = data.doc_ids(x, eot) if doc_mask else None
    return [tuple(None if t is None else t[k].to(mesh.device) for t in (x, y, mask, doc))
            for k in range(x.size(0))]


def token_weights(y, mask, scale=1.0):
    """Micro-batch k's weight in the mean over ALL target tokens of the global batch: n_k / N
    (n_k: its target tokens, the loss-mask ones; N: those of every micro-batch of every dp rank).
    The one place the loss is normalised: every gradient collective sums, so the weighted losses
    of all ranks add up to the mean, and their gradients too. scale: fp16's loss scale."""
    if mask is None:
        return [scale / (y.size(0) * mesh.dp)] * y.size(0)
    n = mask.sum(dim=(1, 2)).double()
    total = parallel.all_reduce_sum(n.sum(), mesh, group=mesh.dp_group).item()
    return (n * scale / max(total, 1.0)).tolist()


@torch.no_grad()
def evaluate(val_loader):
    """Mean loss over the target tokens of eval_iters global batches of val data (the same
    batches every time), weighted by tokens exactly like the training loss."""
    raw_model.eval()
    batches = [val_loader.batch(i) for i in range(eval_iters)]
    x, y, mask = (None if batches[0][j] is None else torch.cat([b[j] for b in batches])
                  for j in range(3))
    micro, weights = micro_batches(x, y, mask, val_loader.eot_token), token_weights(y, mask)
    if pp > 1:  # pipeline: pipeline.py
        loss_sum = pipeline.pipeline_forward(raw_model, mesh, micro, act_shape, autocast, weights,
                                             pp_virtual)
    else:
        loss_sum = torch.zeros((), device=mesh.device)
        for (xk, yk, mk, dk), w in zip(micro, weights):
            with autocast:
                _, loss = raw_model(xk, yk, mk, dk)
            loss_sum += loss * w
    raw_model.train()
    if use_fsdp:  # fsdp: free the weights eval gathered (reshard_after_forward=False keeps them)
        fsdp_py.reshard(raw_model)
    return parallel.global_mean(parallel.all_reduce_sum(loss_sum.double(), mesh), mesh)


import evals  # evaluation: evals.py (bits per byte beside the val loss, eval_tasks)
# each id's bytes (the dataset's; a mixture's from its tokenizer), and the tasks' tokenizer
lengths = None if mixing else guard_data.read_token_bytes(data_dir, meta["vocab_size"])
scorer = evals.Evaluator(eval_tasks, val_loaders, lengths,
                         lambda: tokenizer_py.tokenizer_from_meta(meta),
                         raw_model, mesh, eval_iters)

# ---- run state, logging, checkpoints ---------------------------------------------------------
metrics_path = os.path.join(out_dir, "metrics.jsonl")
# dropout masks differ across ranks, not within a tp group (its ranks hold the same activations)
torch.manual_seed(seed + mesh.rank // mesh.tp)
start_iter, run_id, skip_iters = 0, None, set()
if src.kind == "resume":
    start_iter, run_id, skip_iters = checkpoint.resume_state(src, mesh, scaler)
# the NaN guard (nan_guard.py): skipped steps counted, known bad batches stepped over
nan = nan_guard.NanGuard(nan_max_consecutive, nan_action, skip_iters)
if mesh.master:
    if os.path.exists(metrics_path):
        rundir.truncate_metrics(metrics_path, start_iter)
    rundir.write_file(os.path.join(out_dir, "config.json"), json.dumps(config, indent=1))
# rank 0 logs to metrics.jsonl, and wandb and TensorBoard where asked; checkpoints keep wandb's
# id, so a resumed run logs to the same one
loggers, run_id = rundir.start_loggers(config, out_dir, start_iter, run_id, mesh.master)


def log(record):
    if mesh.master:
        rundir.log(metrics_path, loggers, record)


resumed_from = src.path if src.kind == "resume" else None  # never pruned
if ckpt_async:  # checkpoints written in the background: ckpt_async.py
    from techniques import ckpt_async
    saves = ckpt_async.AsyncSaves(out_dir, raw_model, optimizer, mesh, keep_ckpts, resumed_from)


def save(it):  # weights, optimizer state, RNG states, and the run's metadata that stages read
    run_meta = {"iter": it, "config": config, "model": asdict(model_cfg),
                "tokens": it * tokens_per_iter, "dataset": data_dir, "tokenizer": tokenizer,
                "wandb_id": run_id, "world": mesh.world, "skip_iters": sorted(nan.skip_iters),
                "extra_tokens": meta.get("extra_tokens", []), "lora": lora,
                "tokenizer_spec": tokenizer_py.spec_of(meta),
                "loss_scale": scaler.state_dict() if scaler else None}
    if ckpt_async:  # ckpt_async.py
        saves.save(it, checkpoint.rng_states(mesh), run_meta)
    else:
        path = checkpoint.save(out_dir, it, raw_model, optimizer, checkpoint.rng_states(mesh),
                               run_meta, mesh, keep_ckpts, resumed_from)
        mesh.print0(f"saved checkpoint {path}")


signals = rundir.catch_signals(mesh)  # SIGTERM, SIGUSR1, Ctrl-C: finish the step, save, exit
per_source = (mixture.SourceLosses(raw_model, len(sources), mesh) if mixing and len(sources) > 1
              else None)  # mixture.py
flops_per_iter, peak = flops_per_token * tokens_per_iter, peak_flops
if pref:  # preference alignment: the reference's log-probs, once (preference.py)
    pref.reference(raw_model, src, data_dir, out_dir, autocast)
passes = train_loader.passes(max_iters)
mesh.print0(f"{tokens_per_iter:,} tokens/iter ({train_loader.n_chunks:,} train chunks, "
            f"{passes:.2f} epochs by max_iters)")
if src.kind in ("hf", "run") and passes > 3:
    mesh.print0(data.passes_note(max_iters, passes))

if profile_iters:  # profiler: profiling.py (labels the loop's calls from outside)
    from techniques import profiling
    profiling.attach(profile_iters, start_iter, out_dir, mesh, raw_model, optimizer,
                     profile_memory)

# ---- the loop --------------------------------------------------------------------------------
it, stop, dt_avg = start_iter, False, None
loss_mean = grad_norm = None  # (a known bad batch is skipped before its step: nothing to report)
# the iteration whose val loss and checkpoint exist already: a resumed run's start, a rollback's
restored_at = start_iter if src.kind == "resume" else None
while True:
    if (it % eval_interval == 0 or it == max_iters) and it != restored_at:
        # an evaluation of over 10 s at peak_flops (or a CPU's 1e11 FLOP/s, a GPU's 1e14) says so
        guess = peak_flops or (1e11 if mesh.device.type == "cpu" else 1e14)
        if it == start_iter and 2 * n_params * eval_iters * tokens_per_iter > 10 * guess:
            mesh.print0(f"iter {it}: evaluating the {n_params / 1e6:.3g}M-parameter model ...")
        val = {name: evaluate(vl) for name, vl in val_loaders.items()}
        val_loss, by_source = next(iter(val.values())), {}
        if mixing:  # mixture: mixture.py (the weighted mean of the sources', and each one's)
            val_loss, by_source = mixture.val_losses(val, val_weights)
        # evaluation: evals.py
        eval_scores, line = scorer.run(val, evaluate, val_weights if mixing else None)
        by_text = mixture.compact(by_source) if by_source else ""
        mesh.print0(f"iter {it}: val loss {val_loss:.4f}{by_text}{line}")
        log({"iter": it, "val_loss": val_loss, **by_source, **eval_scores,
             "tokens": it * tokens_per_iter, "elapsed_s": time.time() - started})
    if ((it % ckpt_interval == 0 or it == max_iters or stop)
        and it not in (start_iter, restored_at)):
        save(it)
    if it >= max_iters or stop:
        break
    # mixture: a phase's lr_scale
    lr = get_lr(it, config) * (train_loader.lr_scale(it) if mixing else 1.0)
    # why this iteration leaves the weights alone, if it does (a known bad batch: before the step)
    skipped = "known bad batch" if it in nan.skip_iters else None
    if not skipped:
        # pipeline: pipeline.py
        trace = [] if pp_trace and pp > 1 and it == start_iter + 1 else None

        # ================================ TRAINING SECTION BEGIN ================================
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        optimizer.zero_grad(set_to_none=True)
        x, y, mask, *src_ids = train_loader.batch(it)
        micro = micro_batches(x, y, mask,
                              train_loader.eot_of(*src_ids) if mixing else train_loader.eot_token)
        # the loss is the mean cross-entropy over every target token of the global batch (pairs:
        # over its pairs, preference.py): each micro-batch's mean by its share (fp16: x the scale)
        weights = token_weights(y, None if pref else mask, scaler.scale if scaler else 1.0)
        if pp == 1:
            loss_sum = torch.zeros((), device=mesh.device)
            for k, (xk, yk, mk, dk) in enumerate(micro):
                # data parallel: sync only in the last micro-step's backward, where hooks launch
                # the all-reduce
                if mesh.dp > 1:
                    parallel.set_grad_sync(model, k == len(micro) - 1)
                with autocast:
                    losses, loss = model(xk, yk, mk, dk)
                loss = pref(losses, mk, src_ids[0][k]) if pref else loss  # preference.py
                (loss * weights[k]).backward()
                loss_sum += loss.detach() * weights[k]
        # pipeline: pipeline.py (this stage's part of every micro-batch, in the schedule's order)
        else:
            loss_sum, _ = pipeline.pipeline_step(pp_schedule, model, mesh, micro, act_shape,
                                                 autocast, trace, weights, pp_virtual,
                                                 pref and pref.of_micro(src_ids[0]))
        if mesh.dp > 1:
            # data parallel: the last buckets' all-reduces may still be in flight
            parallel.wait_grad_sync(model)
        if cp > 1:  # context parallel: context_parallel.py
            context_parallel.sum_gradients(grad_params, mesh)
        if ep > 1:  # expert parallel: expert_parallel.py
            expert_parallel.sync_grads(raw_model)
        if pp > 1 and model_cfg.tie_embeddings:  # pipeline: pipeline.py
            pipeline.all_reduce_tied(raw_model, grad_params)
        if scaler:  # fp16: loss_scale.py
            loss_sum = scaler.unscale_(grad_params, loss_sum)
        # One all-reduce for the numbers the ranks agree on each step: the loss (each rank's part
        # of the global mean) and the stop flag (a signal on any rank).
        agree = {"loss": loss_sum, "stop": len(signals) > 0}
        if per_source:  # mixture: mixture.py
            agree["sources"] = per_source.sums(src_ids[0])
        if pref:  # preference alignment: preference.py (TRL's metrics)
            agree["pref"] = pref.take()
        totals = parallel.all_reduce_named(agree, mesh)
        loss_mean, stop = parallel.global_mean(totals["loss"], mesh), totals["stop"].item() > 0
        # clip by the norm of the whole model's gradient, over every stage, shard and slice
        grad_norm = parallel.clip_grad_norm_(grad_params, grad_clip, mesh, sharded=use_zero).item()
        # the NaN guard: no update from a non-finite batch (the verdict is the same on every rank)
        finite = math.isfinite(loss_mean) and math.isfinite(grad_norm)
        if finite:
            optimizer.step()
        # moe.py
        moe_stats = moe.after_step(raw_model, mesh, finite) if model_cfg.n_experts else {}
        # fp16: an inf/NaN in any rank's gradients makes the global norm non-finite everywhere: an
        # overflow, and the scale backs off (a non-finite loss is the NaN guard's, not the scale's)
        overflow = (scaler is not None and scaler.update(not math.isfinite(grad_norm))
                    and math.isfinite(loss_mean))
        dt = time.perf_counter() - t0
        # ================================ TRAINING SECTION END ==================================

        # what follows is the step's bookkeeping: an async save written by every rank, the
        # timeline, the memory line, and why the step was skipped, if it was
        if ckpt_async:  # ckpt_async.py: the save in flight, once every rank has written it
            saves.finish_if_written(it + 1)
        dt_avg = dt if dt_avg is None else 0.9 * dt_avg + 0.1 * dt
        if trace is not None:  # pipeline: pipeline.py
            pipeline.print_pipeline_timeline(trace, mesh, len(micro), pp_virtual)
        if it == start_iter:
            mesh.print0(parallel.memory_line(raw_model, optimizer, mesh, zero if use_zero else 0,
                                             use_fsdp, offload))
            if compile:  # the first step compiles: its time apart from the steps that follow
                mesh.print0(f"compile: the first step took {dt:.1f} s, torch.compile included")
        # fp16: an overflow is the scale's, not a NaN incident (loss_scale.py): lr and data go on
        skipped = ("fp16 overflow" if overflow
                   else None if finite else "non-finite loss or grad norm")
    if skipped is None:
        if it % log_interval == 0 or it == max_iters - 1:
            if not peak:
                peak, how = parallel.peak_flops(mesh.device, getattr(torch, dtype))
                mesh.print0(f"peak {peak / 1e9:.1f} GFLOP/s ({how}) for MFU")
            tok_per_s, mfu = tokens_per_iter / dt, flops_per_iter / dt / (peak * mesh.world)
            # mixture.py
            by_source = mixture.train_losses(totals["sources"], sources) if per_source else {}
            if pref:  # preference alignment: preference.py
                by_source = pref.metrics(totals["pref"], train_loader.global_batch)
            extra = ((mixture.compact(by_source) if per_source else "")
                     + (preference.compact(by_source) if pref else "")
                     + (moe.compact(moe_stats) if moe_stats else ""))
            mesh.print0(f"iter {it}: loss {loss_mean:.4f}, lr {lr:.2e}, grad norm {grad_norm:.3f},"
                        f" {dt * 1000:.0f} ms, {tok_per_s:,.0f} tok/s, mfu {mfu:.1%}, "
                        f"eta {dt_avg * (max_iters - it - 1) / 60:.1f} min" + extra)
            log({"iter": it, "loss": loss_mean, "lr": lr, "grad_norm": grad_norm,
                 "tokens": (it + 1) * tokens_per_iter,
                 "dt_ms": dt * 1000, "tok_per_s": tok_per_s, "mfu": mfu,
                 "elapsed_s": time.time() - started, **by_source, **moe_stats,
                 **({"loss_scale": scaler.scale} if scaler else {})})
    else:
        # the NaN guard (nan_guard.py): report the skip; after nan_max_consecutive in a row, stop,
        # or go on from the latest checkpoint (an async save in flight is finished first)
        if nan.report(skipped, it, loss_mean, grad_norm, scaler, mesh, log):
            if ckpt_async:  # ckpt_async.py
                saves.finish(it)
            it = restored_at = nan.roll_back(out_dir, raw_model, optimizer, mesh, it, scaler)
            continue
    it += 1

# ---- the end ---------------------------------------------------------------------------------
if ckpt_async:  # ckpt_async.py: the last checkpoint is complete, and `latest` names it, after this
    saves.finish(it)
if stop:
    mesh.print0(f"stopped by {rundir.signal_name(signals)} after iteration {it}: checkpoint "
                f"saved; run the same command again to continue")
for logger in loggers:
    logger.finish()
parallel.teardown(mesh)
if mesh.master and not stop and (export_hf or export_lora or sample_tokens > 0):
    import sample
    # rank 0's model where it is whole and its attention plain (cp's: a ring), else the checkpoint
    sample.end_of_run(raw_model if holds_whole and cp == 1 else None, out_dir, lora, model_cfg,
                      meta, export_hf, export_lora, export_shard_mb, sample_tokens, autocast,
                      mesh.device)
if mesh.master:
    exports = [] if stop else [("Hugging Face export", export_hf),
                               ("PEFT adapters", export_lora if lora else "")]
    print(rundir.summary(out_dir, config, started, mesh.world, exports, stop), flush=True)
if stop:
    # not finished: 128 + the signal (143: SIGTERM, 130: Ctrl-C), as a shell reports a killed one
    workarounds.exit_now(rundir.exit_code(signals))
if mesh.backend:
    # all written, the group gone: skip the interpreter's shutdown (gloo's threads may SIGABRT)
    workarounds.exit_now()
