"""Train a LLaMA-style model. The whole run, top to bottom:

    python train.py                                  # the default job: Python's stdlib, CPU-sized
    torchrun --standalone --nproc_per_node=2 train.py    # the same on 2 data-parallel ranks
    python train.py config/tiny.py max_iters=50      # a config file, then key=value overrides
    python train.py                                  # run again: continues from out_dir's latest checkpoint

Every key below can be overridden (docs/configuration.md). Optional techniques enter through
lines marked with the file that implements them, e.g. `# tensor parallel: tensor_parallel.py`.
"""

import json
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict

import common  # first: --help, and a Ctrl-C while torch imports (seconds), need no torch

common.start_command(sys.argv[1:], "train.py")
import torch

import checkpoint
import configurator
import data
import loss_scale  # fp16: loss_scale.py (dtype=float16 only; a plain run calls none of it)
import origin
import parallel
import rundir
import tokenizer as tokenizer_py
import workarounds
from model import ModelConfig, Transformer, grow_vocab
from optim import build_optimizer, get_lr, pretrained_rate_note, schedule_note

# ---- defaults: every one can be overridden by a config file or key=value (--help lists them) ----
# I/O
out_dir = "out"                 # checkpoints, metrics.jsonl and config.json go here
init_from = "auto"              # 'auto': resume out_dir's checkpoint, else fresh; 'resume' (must), 'scratch' (must not);
                                # or a path to start from its weights: a Hugging Face LLaMA directory, a run's out_dir
export_hf = ""                  # at the end, also write the model as a Hugging Face LLaMA directory here
export_shard_mb = 5000.0        # export_hf: shards of this many MB + an index (5000: huggingface_hub's; 0: one file)
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
data_source = ""                # prepare a missing dataset from: 'stdlib', a directory or glob of .txt, or a .jsonl
tokenizer = "cl100k_base"       # any tiktoken encoding; cl100k_base works offline
vocab_size = 8192               # truncate the BPE to this many ids (0: the whole tokenizer)
extra_tokens = ""               # a file of domain strings (one per line) to add to the tokenizer when preparing data
val_fraction = 0.01             # share of documents that go to val when preparing data
batch_size = 12                 # sequences per micro-batch per rank
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
loss_chunk = 0                  # the head and the loss in chunks of this many rows, never all logits (0: all at once)
doc_mask = False                # attention stays inside each document (<|endoftext|>-separated) of a packed sequence
neftune_alpha = 0.0             # NEFTune: uniform noise of scale alpha/sqrt(T*n_embd) on the input embeddings, training only
# mixture of experts (moe.py): every moe_every-th layer's feed-forward becomes n_experts SwiGLU experts
n_experts = 0                   # 0: dense
moe_top_k = 2                   # experts per token
moe_every = 1                   # layer i is MoE when (i + 1) % moe_every == 0
moe_ffn_dim = 0                 # each expert's hidden width (0: ffn_dim)
moe_score = "softmax"           # router scores: 'softmax' (Mixtral, Qwen2-MoE) or 'sigmoid' (DeepSeek-V3)
moe_norm_topk = True            # renormalise the top_k weights to sum 1
moe_shared_ffn_dim = 0          # > 0: a shared expert of this width with a sigmoid gate (Qwen2-MoE)
moe_aux_weight = 0.01           # Switch/GShard load-balancing loss, per micro-batch
moe_z_weight = 0.0              # router z-loss
moe_bias_rate = 0.0             # DeepSeek-V3 aux-loss-free balancing: the bias's step per optimizer step
ep = 1                          # expert parallel: each MoE layer's experts split over ep ranks taken from dp
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
max_iters = 350
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.99                    # AdamW's (under Muon: embedding, head, gains); 0.99 pays at small batches
grad_clip = 1.0                 # clip the global gradient norm to this (0: no clipping; the norm is logged anyway)
# learning rate schedule: linear warmup, then 'cosine' decay to min_lr, or 'wsd' (warmup-stable-decay):
# flat at learning_rate, then a linear decay to min_lr over the last cooldown_frac of lr_decay_iters
lr_schedule = "cosine"
warmup_iters = 20
lr_decay_iters = 0              # 0: = max_iters
cooldown_frac = 0.2             # wsd: the share of lr_decay_iters spent decaying
min_lr = 4e-4
# the NaN guard
nan_max_consecutive = 3         # a non-finite loss or grad norm skips the step; after this many in a row ...
nan_action = "rollback"         # ... 'rollback' to the latest checkpoint and step over the bad batches, or 'stop'
# system
device = "auto"                 # 'auto': cuda if available, else cpu
dtype = "auto"                  # autocast's (weights: float32); auto: bf16 on CUDA (or fp16), AVX512-BF16 CPUs; else fp32
loss_scale_init = 65536.0       # float16: the first loss scale (these four: torch's GradScaler's defaults)
loss_scale_growth = 2.0         # float16: the scale x this after loss_scale_interval steps in a row without an overflow
loss_scale_backoff = 0.5        # float16: the scale x this after an overflow (an inf/NaN gradient: the step is skipped)
loss_scale_interval = 2000      # float16: clean steps in a row before the scale grows
compile = False                 # torch.compile the model
seed = 1337                     # weights, data order and dropout all derive from it
peak_flops = 0.0                # FLOP/s that MFU is measured against (0: measure this device's matmul rate)
dist_timeout_s = 300            # a collective waiting longer than this (dead peer) ends the run with an error
backend = "auto"                # 'auto': nccl on CUDA, gloo on CPU
pp = 1                          # pipeline stages; the data-parallel degree is dp = world_size // (pp * cp * tp)
tp = 1                          # tensor-parallel ranks per stage (consecutive ranks); dp = world_size // (pp * cp * tp)
sp = False                      # tp > 1: sequence parallel, the activations outside the matmuls split along T over tp
cp = 1                          # context parallel: ranks that each hold a part of every sequence (ring attention)
pp_schedule = "1f1b"            # '1f1b', 'gpipe' (all forwards, then all backwards) or 'interleaved' (pp_virtual chunks)
pp_virtual = 1                  # interleaved: chunks of layers per stage (virtual stages v * pp + stage), at least 2
pp_layers = ""                  # layers per stage, e.g. '3,1' (per virtual stage with pp_virtual); '': balanced by cost
pp_trace = False                # print the pipeline schedule as an ASCII timeline (second iteration)
ddp_impl = "bucketed"           # data parallel: 'bucketed' (overlapped), 'naive' (per parameter) or 'torch' (DDP)
ddp_bucket_mb = 4.0             # bucket size of the bucketed all-reduce
fsdp = False                    # shard parameters, gradients and optimizer state over the dp ranks (FSDP2)
reshard_after_forward = True    # fsdp: free each block's gathered weights after its forward (gather again for backward)
zero = 0                        # ZeRO over dp: 1 shards the optimizer state, 2 also the gradients (3 is fsdp=True)
offload = False                 # zero/fsdp on CUDA: optimizer state (fsdp: and parameters) in CPU memory, stepped there
sample_tokens = 120             # tokens to generate at the end of the run (0: none)
# ---------------------------------------------------------------------------------------

sys.excepthook = parallel.excepthook  # a UserError (and a dead peer) prints one line, not a traceback
config_keys = [k for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, bool, str, list))]
overrides = configurator.configure({k: globals()[k] for k in config_keys}, sys.argv[1:])
globals().update(overrides)
config = {k: globals()[k] for k in config_keys}
world = int(os.environ.get("WORLD_SIZE", 1))  # torchrun's; the process group comes later
derived = configurator.validate(config, overrides, world)  # everything, before anything touches disk or peers
config["grad_accum_steps"] = grad_accum_steps = derived["grad_accum_steps"]  # the default, raised if the layout needs it
started = time.time()  # metrics' elapsed_s: wall seconds since launch (data preparation and compiling included)

# ---- setup ----------------------------------------------------------------------------
mesh = parallel.setup(device, dist_timeout_s, backend, pp, tp, cp)
if dtype == "auto":  # bf16 where the matmuls run it natively: CUDA (T4, V100 only emulate it: fp16), AVX512-BF16 CPUs
    native = torch.cuda.is_bf16_supported(False) if mesh.device.type == "cuda" else torch.cpu._is_avx512_bf16_supported()
    dtype = "bfloat16" if native else "float16" if mesh.device.type == "cuda" else "float32"
autocast = nullcontext() if dtype == "float32" else torch.autocast(mesh.device.type, dtype=getattr(torch, dtype))
scaler = loss_scale.LossScaler.from_config(config) if dtype == "float16" else None  # fp16: loss_scale.py (bf16: none)
torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = mesh.device.type == "cuda"  # TF32 on GPUs
if mesh.device.type == "cpu":
    workarounds.keep_freed_memory()  # no page faults for each step's large tensors (~7% of a CPU step)
if mesh.master and os.path.isdir(out_dir):  # a run may be writing there: lock it before reading its checkpoints
    rundir.lock_out_dir(out_dir)
src = origin.weights_source(out_dir, init_from, mesh)  # where the weights come from (see below): read-only
shape = {k: src.saved[k] for k in origin.SHAPE_KEYS if k in (src.saved or {})}  # a base's or checkpoint's: printed
mesh.print0("config: " + " ".join(f"{k}={shape.get(k, config[k])!r}" for k in config_keys))
if max_iters < warmup_iters:  # the run ends inside the warmup: say what the schedule does
    mesh.print0(schedule_note(config))
if src.kind in ("hf", "run") and learning_rate >= 1e-3 and not lora_rank:  # a from-scratch rate
    mesh.print0(pretrained_rate_note(config))
if src.kind == "resume":
    origin.check_same_run(src, config, overrides, out_dir)
if src.kind == "resume" and origin.finished(src, config, out_dir, mesh):
    parallel.teardown(mesh)  # a finished run: nothing to do, nothing rewritten
    workarounds.exit_now()
spec = None if src.kind == "fresh" else tokenizer_py.model_spec(src, tokenizer, vocab_size)  # that model's tokenizer: the data's

# ---- data: one dataset, or a mixture --------------------------------------------------
sources = derived["sources"]  # {dataset: weight}: one, or a mixture's (datasets=)
mixing = len(sources) > 1 or bool(phases)


def prepared(source, prep):  # its directory (a name under data/, or a directory), prepared first if it is missing
    data_dir = source if os.sep in source else os.path.join("data", source)
    if not os.path.exists(os.path.join(data_dir, "meta.json")):  # preparation: prepare.py
        import prepare
        prepare.prepare_missing(source, data_dir, prep, tokenizer, vocab_size, val_fraction, extra_tokens, mesh, spec)
    if "val_fraction" in overrides or "data_source" in overrides:  # the data must be what the command asks for
        data.check_made_as_asked(data_dir, {"val_fraction": val_fraction, "data_source": prep}, overrides)
    return data_dir


def loader(data_dir, split):  # this dp rank's micro-batches of every global batch
    return data.Loader(data_dir, split, block_size, batch_size, grad_accum_steps, seed, mesh.dp_rank, mesh.dp)


if not mixing:
    data_dir = prepared(dataset, data_source)
    meta = data.load_meta(data_dir)  # the tokenizer and vocabulary the data was prepared with
    train_loader, val_loaders = loader(data_dir, "train"), {dataset: loader(data_dir, "val")}
else:  # mixture: mixture.py (each sequence drawn from one source; per-source losses logged)
    import mixture
    data_dir, meta, train_loader, val_loaders, val_weights = mixture.setup(
        sources, phases, mix_temperature, lambda source: prepared(source, data_source if not datasets else ""), loader)
for d in data_dir.split(","):  # the data's ids mean what they mean to the model
    m = data.load_meta(d)
    tokenizer_py.check_model_tokenizer(m, d, spec, src.where) if spec else tokenizer_py.check_tokenizer(m, d, tokenizer, vocab_size)
tokens_per_iter = batch_size * grad_accum_steps * block_size  # global: all ranks together

# ---- the model: where its weights come from -------------------------------------------
# First match wins (src): (1) resume this run's checkpoint; (2) init_from= a run of ours or (3) a HF directory; (4) fresh.
model_cfg = ModelConfig(vocab_size=meta["vocab_size"], block_size=block_size, n_layer=n_layer, n_head=n_head,
                        n_kv_head=n_kv_head, n_embd=n_embd, ffn_dim=ffn_dim, dropout=dropout, tie_embeddings=tie_embeddings,
                        grad_ckpt=grad_ckpt, neftune_alpha=neftune_alpha, loss_chunk=loss_chunk,
                        **{k: config[k] for k in config if k == "n_experts" or k.startswith("moe_")})
if src.saved is not None:  # the shape comes from there (an explicit key that disagrees is a mistake)
    model_cfg = origin.saved_shape(src, overrides, meta.get("base_vocab_size", meta["vocab_size"]), config, world)
lora = None  # LoRA's settings (kept in checkpoints); None: full fine-tuning
if lora_rank or lora_from or src.lora:  # LoRA: lora.py
    import lora as lora_py
    lora, adapter = lora_py.settings(config, overrides, derived["lora_targets"], src)
common.check(lora or not export_lora, "export_lora= needs a LoRA run: set lora_rank= (e.g. 8) or lora_from=")
# Built whole by one process (and by every rank when LoRA or vocabulary growth need whole tensors); else on the
# meta device: cut, sliced and sharded as shapes, then given this rank's weights only (build.py).
whole_first = world == 1 or lora is not None or model_cfg.vocab_size < meta["vocab_size"]
torch.manual_seed(seed)  # each weight is drawn from (seed, its name): the same bits on every layout
with nullcontext() if whole_first else torch.device("meta"):
    raw_model = Transformer(model_cfg)  # the plain module: checkpoints, eval and sampling use it
if whole_first and src.kind in ("hf", "run"):  # (2), (3): read the whole model
    origin.load_whole_into(raw_model, src)
if lora:  # LoRA: lora.py
    lora_py.attach(raw_model, lora, adapter, src, meta, mesh, seed, lora_from)
if model_cfg.vocab_size < meta["vocab_size"]:  # the data has tokens the model has never seen (extra, chat tokens)
    mesh.print0(f"growing the vocabulary from {model_cfg.vocab_size} to {meta['vocab_size']} (new rows: the mean row)")
    model_cfg = grow_vocab(raw_model, meta["vocab_size"]).cfg
flops_per_token, n_params = raw_model.flops_per_token(), raw_model.num_params()  # of the whole model
mesh.print0(f"model: {n_params / 1e6:.2f}M parameters, {flops_per_token / 1e6:.1f} MFLOP/token; {mesh.world} ranks: "
            f"dp={mesh.dp} x pp={mesh.pp}" + "".join(f" x {k}={n}" for k, n in (("cp", cp), ("tp", tp)) if n > 1))

# ---- parallelism, applied from outside, and the optimizer -----------------------------
# In this order: cut the pipeline stage, split the matmuls (tensor parallel swaps parameters: before anything
# holds them), shard (FSDP), give a meta model its weights, compile, wrap for data parallel (its hooks: last).
if pp > 1:  # pipeline: pipeline.py (this stage's layers only, split by estimated cost or pp_layers)
    import pipeline
    raw_model = pipeline.cut_stage(raw_model, mesh, derived["layer_counts"], pp_virtual)
if whole_first:
    raw_model.to(mesh.device)
if ep > 1:  # expert parallel: expert_parallel.py (each rank of an ep group keeps its share of the experts)
    import expert_parallel
    import moe
    expert_parallel.expert_parallel(raw_model, mesh, ep, moe.moe_layers)
if tp > 1:  # tensor parallel: tensor_parallel.py (each block's matmuls, the embedding and head become slices)
    import tensor_parallel
    tensor_parallel.tensor_parallel(raw_model, mesh, sp)  # sequence parallel: tensor_parallel.py
if cp > 1:  # context parallel: context_parallel.py (each rank keeps a part of every sequence after the embedding)
    import context_parallel
    context_parallel.context_parallel(raw_model, mesh)
use_fsdp = fsdp and mesh.dp > 1  # with one dp rank there is nothing to shard over
if use_fsdp:  # FSDP: fsdp.py (raw_model's parameters become DTensor shards, in place)
    import fsdp as fsdp_py
    fsdp_py.fully_shard_model(raw_model, mesh, reshard_after_forward, offload=offload)
if not whole_first:  # the meta-device build: build.py (storage for what this rank holds, then its weights)
    import build
    build.fill(raw_model, src, seed, mesh, torch.device("cpu") if use_fsdp and offload else mesh.device)
if model_cfg.n_experts:  # mixture of experts: moe.py (its balancing losses join the loss's gradient)
    import moe
    moe.attach(raw_model, model_cfg)
model = torch.compile(raw_model) if compile else raw_model
use_zero = zero and mesh.dp > 1 and not use_fsdp
if use_zero:  # ZeRO: zero.py (data parallel whose ranks each own a slice of every bucket and its optimizer state)
    import zero as zero_py
    model = zero_py.ZeroDataParallel(model, mesh, ddp_bucket_mb, zero)
elif mesh.dp > 1 and not use_fsdp:  # data parallel: data_parallel.py
    import data_parallel
    model = data_parallel.wrap(model, mesh, ddp_impl, ddp_bucket_mb)
optimizer, grad_params = build_optimizer(raw_model, model, mesh, config, zero_py.ZeroOptimizer if use_zero else None)
if src.kind == "resume":  # (1) weights and optimizer state, into whatever layout this run has
    checkpoint.load(src.path, raw_model, optimizer)
act_shape = (batch_size, block_size, model_cfg.n_embd)  # what travels between pipeline stages


def micro_batches(x, y, mask):
    """[(x, y, loss_mask, doc_ids) of micro-batch k, on the device]: the unit that the plain
    loop and the pipeline schedules consume. loss_mask (SFT) and doc_ids (doc_mask) may be None."""
    doc = data.doc_ids(x, meta["eot_token"]) if doc_mask else None
    return [tuple(None if t is None else t[k].to(mesh.device) for t in (x, y, mask, doc)) for k in range(x.size(0))]


def token_weights(y, mask, scale=1.0):
    """Micro-batch k's weight in the mean over ALL target tokens of the global batch: n_k * dp / N
    (n_k: its target tokens, the loss-mask ones; N: those of every micro-batch of every dp rank).
    loss_k * n_k is its token sum, and the dp average divides by dp, which the factor dp undoes. x scale: fp16's."""
    if mask is None:
        return [scale / y.size(0)] * y.size(0)  # every n_k equal: 1 / micro_steps, the classic recipe
    n = mask.sum(dim=(1, 2)).double()
    total = parallel.all_reduce_sum(n.sum(), mesh, group=mesh.dp_group).item()
    return (n * mesh.dp * scale / max(total, 1.0)).tolist()


@torch.no_grad()
def evaluate(val_loader):
    """Mean loss over the target tokens of eval_iters global batches of val data (the same
    batches every time), weighted by tokens exactly like the training loss."""
    raw_model.eval()
    batches = [val_loader.batch(i) for i in range(eval_iters)]
    x, y, mask = (None if batches[0][j] is None else torch.cat([b[j] for b in batches]) for j in range(3))
    micro, weights = micro_batches(x, y, mask), token_weights(y, mask)
    if pp > 1:  # pipeline: pipeline.py
        loss_sum = pipeline.pipeline_forward(raw_model, mesh, micro, act_shape, autocast, weights, pp_virtual)
    else:
        loss_sum = torch.zeros((), device=mesh.device)
        for (xk, yk, mk, dk), w in zip(micro, weights):
            with autocast:
                _, loss = raw_model(xk, yk, mk, dk)
            loss_sum += loss * w
    raw_model.train()
    if use_fsdp:  # fsdp with reshard_after_forward=False: free the weights eval gathered
        fsdp_py.reshard(raw_model)
    # the global mean, as in training (pp: only last stages hold losses; tp, cp: a group's ranks hold the same one)
    return parallel.all_reduce_sum(loss_sum.double(), mesh).item() / (mesh.dp * mesh.tp * mesh.cp)


# ---- run state, logging, checkpoints --------------------------------------------------
metrics_path = os.path.join(out_dir, "metrics.jsonl")
torch.manual_seed(seed + mesh.rank // mesh.tp)  # dropout masks differ across ranks, not within a tp group
start_iter, run_id, skip_iters = 0, None, set()  # skip_iters: batches that gave non-finite values (see rollback)
if src.kind == "resume":  # (1) the iteration, the random streams, the wandb run and the known bad batches
    start_iter, run_id, skip_iters = rundir.resume_state(src, mesh, scaler)  # (fp16: and the loss scale)
if mesh.master:  # one run per out_dir (a new one is made only now: a refused run leaves none behind)
    rundir.lock_out_dir(out_dir)
    if os.path.exists(metrics_path):  # an earlier run's: its history up to start_iter (later lines are redone)
        rundir.truncate_metrics(metrics_path, start_iter)
    rundir.write_file(os.path.join(out_dir, "config.json"), json.dumps(config, indent=1))  # never through a link
wandb_run = None  # Weights & Biases, rank 0 (its id is kept in checkpoints: a resumed run logs to the same one)
if mesh.master and wandb_log:
    wandb_run = rundir.start_wandb(config, out_dir, wandb_project, wandb_run_name, run_id)
    run_id = wandb_run.id


def log(record):
    if mesh.master:
        rundir.append_metrics(metrics_path, record)
        if wandb_run is not None:
            wandb_run.log({k: v for k, v in record.items() if k != "iter"}, step=record["iter"])


saves = rundir.Saves(out_dir, raw_model, optimizer, mesh, keep_ckpts, ckpt_async,
                     resumed_from=src.path if src.kind == "resume" else None)  # never pruned


def save(it):  # tokenizer_spec: the model's whole tokenizer travels with it; loss_scale: fp16's scaler
    saves.save(it, {"iter": it, "config": config, "model": asdict(model_cfg), "tokens": it * tokens_per_iter,
                    "dataset": data_dir, "tokenizer": tokenizer, "wandb_id": run_id, "world": mesh.world,
                    "skip_iters": sorted(skip_iters), "extra_tokens": meta.get("extra_tokens", []), "lora": lora,
                    "tokenizer_spec": tokenizer_py.spec_of(meta), "loss_scale": scaler.state_dict() if scaler else None})


signals = rundir.catch_signals(mesh)  # SIGTERM / SIGUSR1 / Ctrl-C: finish the step, checkpoint, exit 128 + N
per_source = mixture.SourceLosses(raw_model, len(sources), mesh) if len(sources) > 1 else None  # mixture.py

flops_per_iter, peak = flops_per_token * tokens_per_iter, peak_flops  # peak: what MFU is measured against
mesh.print0(f"{tokens_per_iter:,} tokens/iter ({train_loader.n_chunks:,} train chunks, "
            f"{train_loader.epoch(max_iters):.2f} epochs by max_iters)")

# ---- the loop -------------------------------------------------------------------------
it = start_iter
evaluated_at = start_iter if src.kind == "resume" else None  # its val loss is already in metrics.jsonl
saved_at = start_iter  # the checkpoint of this iteration exists (or it is iteration 0)
dt_avg = None
stop = False       # a signal asked this run to stop (agreed by all ranks)
bad_streak, recovered = 0, True  # non-finite iterations in a row; a finite one since the last rollback (if any)
while True:
    if (it % eval_interval == 0 or it == max_iters) and it != evaluated_at:
        val = {name: evaluate(loader) for name, loader in val_loaders.items()}
        val_loss, by_source = next(iter(val.values())), {}
        if mixing:  # mixture: mixture.py (the weighted mean of the sources', and each one's)
            val_loss, by_source = mixture.val_losses(val, val_weights)
        mesh.print0(f"iter {it}: val loss {val_loss:.4f}" + (mixture.compact(by_source) if by_source else ""))
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
    lr = get_lr(it, config) * (train_loader.lr_scale(it) if mixing else 1.0)  # mixture: a phase's lr_scale
    trace = [] if pp_trace and pp > 1 and it == start_iter + 1 else None  # pipeline: pipeline.py

    # ================================ TRAINING SECTION BEGIN ================================
    t0 = time.perf_counter()
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    optimizer.zero_grad(set_to_none=True)
    x, y, mask, *src_ids = train_loader.batch(it)  # this rank's micro-batches (mixture: and their sources)
    micro = micro_batches(x, y, mask)  # [(x, y, loss_mask, doc_ids) of micro-batch k]
    # the mean cross-entropy over every target token of the global batch: token_weights (no loss mask: 1 / micro_steps)
    weights = token_weights(y, mask, scaler.scale if scaler else 1.0)  # fp16: backward from loss x scale
    if pp == 1:  # one micro-step after the other, each a whole forward and backward
        loss_sum = torch.zeros((), device=mesh.device)
        for k, (xk, yk, mk, dk) in enumerate(micro):
            # data parallel: sync only in the last micro-step's backward (hooks launch the all-reduce during it)
            if mesh.dp > 1:
                parallel.set_grad_sync(model, k == len(micro) - 1)
            with autocast:
                _, loss = model(xk, yk, mk, dk)
            (loss * weights[k]).backward()
            loss_sum += loss.detach() * weights[k]
    else:  # pipeline: pipeline.py (this stage's part of every micro-batch, in the schedule's order)
        loss_sum, _ = pipeline.pipeline_step(pp_schedule, model, mesh, micro, act_shape, autocast, trace, weights,
                                             pp_virtual)
    if mesh.dp > 1:  # data parallel: the last buckets' all-reduces may still be in flight
        parallel.wait_grad_sync(model)
    if cp > 1:  # context parallel: context_parallel.py (the mean over the cp ranks)
        context_parallel.average_gradients(grad_params, mesh)
    if ep > 1:  # expert parallel: expert_parallel.py (the experts' gradients, over the ranks holding the same ones)
        expert_parallel.sync_grads(raw_model, mesh)
    if pp > 1 and model_cfg.tie_embeddings:  # pipeline: pipeline.py (the embedding's and the tied head's gradients add up)
        pipeline.all_reduce_tied(raw_model, grad_params)
    loss_sum = scaler.unscale_(grad_params, loss_sum) if scaler else loss_sum  # fp16: the true gradients and loss
    # one all-reduce for every number the ranks agree on: the loss (the weighted sums of all ranks
    # / dp; tp and cp ranks hold the same loss tp x cp times), the stop flag, the ranks whose async save is written
    totals = parallel.all_reduce_named({"loss": loss_sum, "stop": len(signals) > 0,
                                        "saved": saves.written(),
                                        **({"sources": per_source.sums(src_ids[0])} if per_source else {})}, mesh)
    loss_mean, stop = totals["loss"].item() / (mesh.dp * mesh.tp * mesh.cp), totals["stop"].item() > 0
    # clip by the norm of the whole model's gradient, across pipeline stages, FSDP shards, ZeRO
    # slices and tp slices (computed even when not clipping, for the log): the same on every rank
    grad_norm = parallel.clip_grad_norm_(grad_params, grad_clip, mesh, sharded=use_zero).item()
    finite = math.isfinite(loss_mean) and math.isfinite(grad_norm)  # the same verdict on every rank
    if finite:  # the NaN guard: no update from a non-finite batch
        optimizer.step()
    moe_stats = moe.after_step(raw_model, mesh, finite) if model_cfg.n_experts else {}  # moe.py: the bias, the load
    # fp16: loss_scale.py. One inf/NaN in any rank's gradients makes the global norm inf/NaN on every rank: an
    # overflow, the scale backs off (unless the loss itself is not finite: that is the NaN guard's); else it may grow
    overflow = scaler is not None and scaler.update(not math.isfinite(grad_norm)) and math.isfinite(loss_mean)
    dt = time.perf_counter() - t0  # .item() above waited for the device
    # ================================ TRAINING SECTION END ==================================
    # everything that follows now is diagnostics, logging, the NaN guard's decision and an async save's end
    if totals["saved"].item() == mesh.world:  # every rank has written the save in flight: make it the latest
        saves.finish(it + 1)
    dt_avg = dt if dt_avg is None else 0.9 * dt_avg + 0.1 * dt
    if trace is not None:  # pipeline: pipeline.py
        pipeline.print_pipeline_timeline(trace, mesh, len(micro), pp_virtual)
    if it == start_iter:  # what this rank holds, once gradients and optimizer state exist
        mesh.print0(parallel.memory_line(raw_model, optimizer, mesh, zero if use_zero else 0, use_fsdp, offload))
    if overflow:  # fp16: loss_scale.py (the scale's fault, now smaller: no NaN incident; lr and data go on)
        mesh.print0(f"iter {it}: fp16 gradient overflow: step skipped, loss scale now {scaler.scale:g}")
        log({"iter": it, "loss": loss_mean, "skipped": "fp16 overflow", "loss_scale": scaler.scale})
        it += 1
        continue
    if not finite:
        bad_streak += 1
        skip_iters.add(it)
        mesh.print0(f"iter {it}: non-finite loss {loss_mean} / grad norm {grad_norm}: step skipped "
                    f"({bad_streak} in a row, nan_max_consecutive={nan_max_consecutive})")
        log({"iter": it, "loss": None, "grad_norm": None, "skipped": "non-finite loss or grad norm"})
        if bad_streak >= nan_max_consecutive:  # stop, or roll back and go on from the checkpoint
            saves.finish(it)  # an async save in flight is the latest checkpoint once finished
            it = evaluated_at = saved_at = rundir.roll_back(out_dir, raw_model, optimizer, mesh, skip_iters,
                                                            bad_streak, it, nan_action, scaler, again=not recovered)
            bad_streak, recovered = 0, False
            continue
        it += 1
        continue
    bad_streak, recovered = 0, True
    if it % log_interval == 0 or it == max_iters - 1:
        if not peak:  # peak_flops=0: this device's matmul rate, measured once, at the first log line
            peak = parallel.measure_matmul_flops(mesh.device, getattr(torch, dtype))
            mesh.print0(f"peak {peak / 1e9:.1f} GFLOP/s (a measured matmul) for MFU")
        tok_per_s, mfu = tokens_per_iter / dt, flops_per_iter / dt / (peak * mesh.world)
        by_source = mixture.train_losses(totals["sources"], sources) if per_source else {}  # mixture: mixture.py
        mesh.print0(f"iter {it}: loss {loss_mean:.4f}, lr {lr:.2e}, grad norm {grad_norm:.3f}, "
                    f"{dt * 1000:.0f} ms, {tok_per_s:,.0f} tok/s, mfu {mfu:.1%}, "
                    f"eta {dt_avg * (max_iters - it - 1) / 60:.1f} min" + (mixture.compact(by_source) if by_source else "")
                    + (moe.compact(moe_stats) if moe_stats else ""))  # moe.py
        log({"iter": it, "loss": loss_mean, "lr": lr, "grad_norm": grad_norm, "tokens": (it + 1) * tokens_per_iter,
             "dt_ms": dt * 1000, "tok_per_s": tok_per_s, "mfu": mfu, **by_source, **moe_stats,
             **({"loss_scale": scaler.scale} if scaler else {})})  # fp16: the scale the next iteration starts from
    it += 1

# ---- the end --------------------------------------------------------------------------
saves.finish(it)  # load-bearing: the last checkpoint is complete, and `latest` names it, only after this
if stop:
    mesh.print0(f"stopped by {rundir.signal_name(signals)} after iteration {it}: checkpoint saved; run the same "
                f"command again to continue")
if wandb_run is not None:
    wandb_run.finish()
whole = pp == 1 and tp == 1 and cp == 1 and ep == 1 and not use_fsdp  # rank 0 holds the whole model (else: a stage,
                                                            # shards, slices, or attention that needs its cp group)
parallel.teardown(mesh)  # the other ranks are done: rank 0's export and sample below take as long as they need
if mesh.master and not stop and (export_hf or export_lora or sample_tokens > 0):
    if whole:
        final = raw_model
    elif lora:  # LoRA: lora.py (the adapters of the checkpoint just written, onto their base)
        final = lora_py.load_whole(checkpoint.find(out_dir, None))[0].to(mesh.device)
    else:  # read back whole from the checkpoint just written
        final = checkpoint.load_whole(checkpoint.find(out_dir, None))[0].to(mesh.device)
    final.eval()
    if export_lora and lora:  # LoRA: lora.py
        named = lora_py.save_peft_lora(export_lora, final, lora)
        print(f"exported the LoRA adapters in PEFT's format to {export_lora}, on the base " + (named or "(unnamed: "
              "the base run made no export_hf; start LoRA from its export for AutoPeftModelForCausalLM)"), flush=True)
    if lora:  # LoRA: W + (alpha / r) B A, which export_hf writes and sampling runs
        lora_py.merge_lora(final)
    if export_hf:
        import hf
        hf.save_hf_llama(export_hf, {k: v.cpu() for k, v in final.state_dict().items()}, model_cfg,
                         tokenizer_py.tokenizer_from_meta(meta), export_shard_mb)
        print(f"exported the model as a Hugging Face LLaMA to {export_hf}", flush=True)
    if sample_tokens > 0:
        import sample
        text = sample.sample_text(final, tokenizer_py.tokenizer_from_meta(meta), "", sample_tokens, 0.8, 50, autocast)
        print("-" * 30 + " sample " + "-" * 30 + "\n" + text + "\n" + "-" * 68, flush=True)
if stop:  # not finished: 128 + the signal (143: SIGTERM, 130: Ctrl-C), as a shell reports a killed command
    workarounds.exit_now(rundir.exit_code(signals))
if mesh.backend:
    workarounds.exit_now()  # all is written and the process group is gone: not through the interpreter's
                            # shutdown, where gloo's worker threads can abort a finished run (SIGABRT)
