"""The real model, SmolLM2-135M-Instruct (a LLaMA: 30 layers, width 576, 9 heads, 3 KV heads,
tied embeddings, 49,152 ids), trained step after step through ours (model.Transformer,
optim.build_optimizer's AdamW, parallel.clip_grad_norm_, as train.py runs them with
config/cpt.py) and through the loop a user would otherwise write (transformers'
AutoModelForCausalLM, torch.optim.AdamW with its defaults, torch's clip_grad_norm_): the same
weights, tokens per step, AdamW and clipping, each side eager and under torch.compile (the first
step, where compile runs, reported apart). The dtype is the one a user gets: dtype=auto as
train.py picks it (bf16 autocast over float32 weights where the matmuls run bf16 natively:
CUDA, AVX512-BF16 CPUs; else float32), or `dtype=...` on the command line. B=4 x T=256, then
B=1 x T=1024 with activation checkpointing on both sides (grad_ckpt=True; transformers'
gradient_checkpointing_enable): 1,024 tokens a step. Each row runs in a fresh process (its peak
memory is its own: max RSS on a CPU, max allocated on CUDA), the sides alternated, `rounds` of
each (`rounds=N` on the command line): ms/step (the median of `steps`), tokens/s, peak memory,
MFU (6 FLOPs per weight per token plus attention, against the measured matmul rate in the dtype
used; on a GPU its data-sheet peak), the first step's time and each side's first loss (one
model: equal to rounding). The model directory: `python bench.py real model=DIR`, or
$BENCH_REAL_MODEL, or .cache/smollm2. Without its weights (no such directory, or a config.json
alone) the same architecture gets random weights, and the table says so: the speed does not
depend on the values."""

import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import nullcontext

import torch

import parallel
from bench.base import ROOT, SMOKE, in_subprocess, peak_memory_mb

# SmolLM2-135M-Instruct's config.json, the fields that shape it (--smoke: a tiny one)
SMOLLM2 = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
           "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
           "rope_theta": 100000.0, "tie_word_embeddings": True, "bos_token_id": 1,
           "eos_token_id": 2}
if SMOKE:
    SMOLLM2.update(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512)
# (B, T, grad_ckpt)
SHAPES = ((1, 16, False), (1, 16, True)) if SMOKE else ((4, 256, False), (1, 1024, True))
WARMUP, STEPS = (0, 1) if SMOKE else (2, 5)
KEYS = ("model", "dtype", "rounds")  # python bench.py real key=value
DTYPES = ("auto", "float32", "bfloat16", "float16")


def arg(key, default=None):
    """The value of key=value on the command line, else default."""
    return next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith(key + "=")), default)


def autocast(device, dtype):
    """train.py's: float32 runs without autocast, bf16 and fp16 under it over float32 weights."""
    if dtype == "float32":
        return nullcontext()
    return torch.autocast(device.type, getattr(torch, dtype))


def cpu_name():
    """The CPU's model name (Linux), and whether it runs bf16 matmuls natively (AVX512-BF16)."""
    import platform
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.processor() or platform.machine()
    return f"{name}, {'with' if torch.cpu._is_avx512_bf16_supported() else 'no'} AVX512-BF16"


def find_model():
    """(a directory with the weights, or None; the line that says which)."""
    path = (arg("model") or os.environ.get("BENCH_REAL_MODEL")
            or os.path.join(ROOT, ".cache", "smollm2"))
    files = os.listdir(path) if os.path.isdir(path) and not SMOKE else []
    if any(f.endswith(".safetensors") for f in files):
        return path, f"the weights of {path}"
    shape = "its config.json" if "config.json" in files else "SmolLM2-135M-Instruct's shape"
    return None, (f"random weights on {shape} (no weights in {path}: pass the directory or set "
                  "BENCH_REAL_MODEL; "
                  f"the speed does not depend on the values)")


def random_weights_dir(path):
    """A Hugging Face directory of the architecture (path's config.json, else SMOLLM2) with random
    weights, so that both sides load the same weights as from a real directory."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = os.path.join(path, "config.json")
    cfg = json.load(open(config)) if os.path.isfile(config) and not SMOKE else SMOLLM2
    cfg = {k: v for k, v in cfg.items()
           if k not in ("architectures", "transformers_version", "_name_or_path")}
    torch.manual_seed(0)
    out = tempfile.mkdtemp(prefix="real_random_")
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=torch.float32)
    model.save_pretrained(out)
    return out


def ours(path, T, grad_ckpt, device, dtype, compiled):
    """train.py's model, optimizer and step as `python train.py config/cpt.py init_from=...` runs
    them on a trained model: AdamW (at the recipe's rate; the speed does not depend on it) and
    the head and loss in chunks (loss_chunk, loss_recompute); compiled: train.py's compile=True."""
    import configurator
    from formats import hf
    import optim
    import parallel
    from model import ModelConfig, Transformer
    defaults = configurator.script_defaults(os.path.join(ROOT, "train.py"))
    c = {**defaults, **configurator.configure(defaults, [os.path.join(ROOT, "config", "cpt.py")])}
    kwargs, weights = hf.load_hf(path)
    model = Transformer(ModelConfig(**{**kwargs, "block_size": T, "loss_chunk": c["loss_chunk"],
                                       "loss_recompute": c["loss_recompute"]}))
    if grad_ckpt:  # (train.py's grad_ckpt=True)
        from techniques import activations
        activations.apply(model, "full")
    # tied: one tensor, two names
    weights.setdefault("output.weight", weights["tok_embeddings.weight"])
    model.load_state_dict(weights)
    model.to(device)
    mesh = parallel.setup(device.type)
    opt, params = optim.build_optimizer(model, model, mesh, c)
    run = torch.compile(model) if compiled else model

    def step(x, y):
        with autocast(device, dtype):
            _, loss = run(x, y)
        loss.backward()
        parallel.clip_grad_norm_(params, c["grad_clip"], mesh)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return model.flops_per_token(), step


def transformers_loop(path, T, grad_ckpt, device, dtype, compiled):
    """The plain loop: AutoModelForCausalLM in float32 (under autocast unless dtype is float32),
    torch.optim.AdamW; compiled: torch.compile on the model, as a user would add it."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    model.train()
    # transformers 5.24 renamed gradient_checkpointing_enable; a GPU box may have 5.17
    if grad_ckpt:
        model.config.use_cache = False
        enable = (getattr(model, "activation_checkpointing_enable", None)
                  or model.gradient_checkpointing_enable)
        enable({"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1)
    run = torch.compile(model) if compiled else model

    def step(x, y):
        with autocast(device, dtype):
            # y: the targets, already shifted
            loss = run(input_ids=x, labels=y, shift_labels=y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return None, step


def real_row(side, path, B, T, grad_ckpt, steps=STEPS, dtype="float32", compiled=False):
    """One side at one shape, eager or compiled, timed in this process: a dict of measurements
    (first_s: the first step, where torch.compile compiles)."""
    import workarounds
    from parallel import peak_flops
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        workarounds.keep_freed_memory()  # as train.py does on a CPU
    make = ours if side == "ours" else transformers_loop
    flops, step = make(path, T, grad_ckpt, device, dtype, compiled)
    vocab = json.load(open(os.path.join(path, "config.json")))["vocab_size"]
    x = torch.randint(0, vocab, (B, T + 1), generator=torch.Generator().manual_seed(0)).to(device)
    x, y = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times, first = [], None
    for _ in range(WARMUP + steps):
        sync()
        t0 = time.perf_counter()
        loss = step(x, y).item()
        times.append(time.perf_counter() - t0)
        first = loss if first is None else first
    dt = sorted(times[WARMUP:])[steps // 2]
    if device.type == "cuda":
        from bench.gpu import gpu_peak
        peak = gpu_peak()
    else:
        peak = peak_flops(device, getattr(torch, dtype))[0]
    return {"side": side, "ms": dt * 1000, "tok_s": B * T / dt, "flops_per_s": B * T / dt / peak,
            "peak_mb": peak_memory_mb(device), "first_loss": first, "flops": flops,
            "first_s": times[0]}


def table_real(rounds=2, shapes=SHAPES, steps=STEPS, compile_at=None):
    """Each side eager, then compiled at the shapes in compile_at (None: every shape; --smoke
    compiles at one, each compile ~25 s even there)."""
    rounds, dtype = int(arg("rounds", rounds)), arg("dtype", "auto")
    if dtype not in DTYPES:
        sys.exit(f"error: dtype={dtype}: choose from {', '.join(DTYPES)}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    used = parallel.auto_dtype(device) if dtype == "auto" else dtype
    path, weights = find_model()
    made = None if path else random_weights_dir(os.environ.get("BENCH_REAL_MODEL") or
                                                os.path.join(ROOT, ".cache", "smollm2"))
    import transformers
    where = (torch.cuda.get_device_name() if device == "cuda"
             else f"{cpu_name()}, {torch.get_num_threads()} threads")
    how = "float32" if used == "float32" else f"{used} autocast over float32 weights"
    print(f"\n## real model: SmolLM2-135M-Instruct, ours (config/cpt.py's step) vs transformers "
          f"{transformers.__version__} (AutoModelForCausalLM + torch.optim.AdamW), each eager and "
          f"torch.compile'd; dtype={dtype}: {how}; AdamW, clipping; {where}; {weights}; the "
          f"median of {steps} steps after {WARMUP} (the first apart: compile's), each row a "
          f"fresh process, the sides alternated, {rounds} rounds")
    print(f"{'side':>12} | {'compile':>7} | {'B x T':>8} | {'grad_ckpt':>9} | {'ms/step':>8} | "
          f"{'tokens/s':>9} | {'MFU':>6} | {'peak mem':>9} | {'1st step':>8} | {'first loss':>10}")
    print("-" * 115)
    rows = {}
    try:
        for B, T, ckpt in shapes:
            modes = (False, True) if compile_at is None or (B, T, ckpt) in compile_at else (False,)
            for r in range(rounds):
                for compiled in modes:
                    for side in ("ours", "transformers")[::1 if r % 2 == 0 else -1]:
                        row = in_subprocess("real", side=side, path=path or made, B=B, T=T,
                                            grad_ckpt=ckpt, steps=steps, dtype=used,
                                            compiled=compiled)
                        rows.setdefault((B, T, ckpt, side, compiled), []).append(row)
                        # transformers' row gives no FLOPs a token: ours' at the shape
                        mine = [x for m in modes for x in rows.get((B, T, ckpt, "ours", m), [])]
                        flops = (mine or [row])[0]["flops"]
                        mfu = f"{row['flops_per_s'] * flops:6.1%}" if flops else f"{'':6}"
                        print(f"{side:>12} | {str(compiled):>7} | {B:>3} x {T:<4} | "
                              f"{str(ckpt):>9} | "
                              f"{row['ms']:8.0f} | {row['tok_s']:9,.0f} | {mfu} | "
                              f"{row['peak_mb']:6.0f} MB | {row['first_s']:6.1f} s | "
                              f"{row['first_loss']:10.4f}", flush=True)
            summary(rows, B, T, ckpt, modes)
    finally:
        if made:
            shutil.rmtree(made, ignore_errors=True)


def summary(rows, B, T, ckpt, modes):
    """Each shape's ratios, the fastest round of each row: ours against transformers eager and
    compiled, and the recipe's step (the faster of ours' modes) against issue 58's goals."""
    best = {(s, m): min(rows[B, T, ckpt, s, m], key=lambda x: x["ms"])
            for s in ("ours", "transformers") for m in modes}
    speed = {m: best["transformers", m]["ms"] / best["ours", m]["ms"] for m in modes}
    mem = {m: best["ours", m]["peak_mb"] / best["transformers", m]["peak_mb"] for m in modes}
    name = {False: "eager", True: "compiled"}
    print(f"B={B} x T={T}, grad_ckpt={ckpt}: ours at "
          + ", ".join(f"{speed[m]:.2f}x transformers' tokens/s {name[m]}" for m in modes)
          + " (the fastest round of each); peak memory "
          + ", ".join(f"{mem[m]:.2f}x {name[m]}" for m in modes))
    mode = min(modes, key=lambda m: best["ours", m]["ms"])
    ours, plain = best["ours", mode], best["transformers", False]
    goals = [(plain["ms"] / ours["ms"], 1.3, "transformers eager's tokens/s")]
    if True in modes:
        compiled = best["transformers", True]["ms"] / ours["ms"]
        goals.append((compiled, 1.1, "transformers compiled's"))
    line = ", ".join(f"{x:.2f}x {what} (goal {goal}x: {'met' if x >= goal else 'NOT met'})"
                     for x, goal, what in goals)
    m = ours["peak_mb"] / plain["peak_mb"]
    print(f"  the recipe's step (ours {name[mode]}, the faster): {line}; peak memory {m:.2f}x "
          f"transformers eager's (goal at most 1.00x: {'met' if m <= 1 else 'NOT met'})")
