"""The real model, SmolLM2-135M-Instruct (a LLaMA: 30 layers, width 576, 9 heads, 3 KV heads,
tied embeddings, 49,152 ids), trained step after step through ours (model.Transformer,
optim.build_optimizer's AdamW, parallel.clip_grad_norm_, as train.py runs them) and through the
loop a user would otherwise write (transformers' AutoModelForCausalLM, torch.optim.AdamW with its
defaults, torch's clip_grad_norm_): the same weights, tokens per step, dtype (bf16 autocast over
float32 weights), AdamW and clipping. B=4 x T=256, then B=1 x T=1024 with activation checkpointing
on both sides (grad_ckpt=True; transformers' gradient_checkpointing_enable): 1,024 tokens a step.
Each row runs in a fresh process (its peak memory is its own: max RSS on a CPU, max allocated on
CUDA), the sides alternated, `rounds` of each: ms/step (the median of `steps`), tokens/s, peak
memory, MFU (6 FLOPs per weight per token plus attention, against the measured bf16 matmul rate;
on a GPU its data-sheet peak) and each side's first loss (one model: equal to bf16 rounding).
The model directory: `python bench.py real model=DIR`, or $BENCH_REAL_MODEL, or .cache/smollm2. Without
its weights (no such directory, or a config.json alone) the same architecture gets random
weights, and the table says so: the speed does not depend on the values."""

import json
import os
import shutil
import sys
import tempfile
import time

import torch

from bench.base import ROOT, SMOKE, in_subprocess, peak_memory_mb

# SmolLM2-135M-Instruct's config.json, the fields that shape it (--smoke: a tiny one)
SMOLLM2 = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
           "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192,
           "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True, "bos_token_id": 1,
           "eos_token_id": 2}
if SMOKE:
    SMOLLM2.update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512)
SHAPES = ((1, 16, False), (1, 16, True)) if SMOKE else ((4, 256, False), (1, 1024, True))  # (B, T, grad_ckpt)
WARMUP, STEPS = (0, 1) if SMOKE else (2, 5)


def find_model(args):
    """(a directory with the weights, or None; the line that says which)."""
    given = next((a.split("=", 1)[1] for a in args if a.startswith("model=")), None)
    path = given or os.environ.get("BENCH_REAL_MODEL") or os.path.join(ROOT, ".cache", "smollm2")
    files = os.listdir(path) if os.path.isdir(path) and not SMOKE else []
    if any(f.endswith(".safetensors") for f in files):
        return path, f"the weights of {path}"
    shape = "its config.json" if "config.json" in files else "SmolLM2-135M-Instruct's shape"
    return None, (f"random weights on {shape} (no weights in {path}: pass the directory or set BENCH_REAL_MODEL; "
                  f"the speed does not depend on the values)")


def random_weights_dir(path):
    """A Hugging Face directory of the architecture (path's config.json, else SMOLLM2) with random
    weights, so that both sides load the same weights as from a real directory."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = os.path.join(path, "config.json")
    cfg = json.load(open(config)) if os.path.isfile(config) and not SMOKE else SMOLLM2
    cfg = {k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version", "_name_or_path")}
    torch.manual_seed(0)
    out = tempfile.mkdtemp(prefix="real_random_")
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=torch.float32).save_pretrained(out)
    return out


def ours(path, T, grad_ckpt, device):
    """train.py's model, optimizer and step as `python train.py config/cpt.py init_from=...` runs
    them on a trained model: AdamW (at the recipe's rate; the speed does not depend on it) and
    the head and loss in chunks (loss_chunk)."""
    import configurator
    import hf
    import optim
    import parallel
    from model import ModelConfig, Transformer
    defaults = configurator.script_defaults(os.path.join(ROOT, "train.py"))
    c = {**defaults, **configurator.configure(defaults, [os.path.join(ROOT, "config", "cpt.py")])}
    kwargs, weights = hf.load_hf(path)
    model = Transformer(ModelConfig(**{**kwargs, "block_size": T, "grad_ckpt": grad_ckpt,
                                       "loss_chunk": c["loss_chunk"]}))
    weights.setdefault("output.weight", weights["tok_embeddings.weight"])  # tied: one tensor, two names
    model.load_state_dict(weights)
    model.to(device)
    mesh = parallel.setup(device.type)
    opt, params = optim.build_optimizer(model, model, mesh, c)

    def step(x, y):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            _, loss = model(x, y)
        loss.backward()
        parallel.clip_grad_norm_(params, c["grad_clip"], mesh)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return model.flops_per_token(), step


def transformers_loop(path, T, grad_ckpt, device):
    """The plain loop: AutoModelForCausalLM in float32 under bf16 autocast, torch.optim.AdamW."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    model.train()
    if grad_ckpt:  # transformers 5.24 renamed gradient_checkpointing_enable; a GPU box may have 5.17
        model.config.use_cache = False
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable({"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1)

    def step(x, y):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=y, shift_labels=y).loss  # y: the targets, already shifted
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return None, step


def real_row(side, path, B, T, grad_ckpt, steps=STEPS):
    """One side at one shape, timed in this process: a dict of measurements."""
    import workarounds
    from parallel import measure_matmul_flops
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        workarounds.keep_freed_memory()  # as train.py does on a CPU
    flops, step = (ours if side == "ours" else transformers_loop)(path, T, grad_ckpt, device)
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
        peak = measure_matmul_flops(device, torch.bfloat16)
    return {"side": side, "ms": dt * 1000, "tok_s": B * T / dt, "flops_per_s": B * T / dt / peak,
            "peak_mb": peak_memory_mb(device), "first_loss": first, "flops": flops}


def table_real(rounds=2, shapes=SHAPES, steps=STEPS):
    path, weights = find_model(sys.argv[1:])
    made = None if path else random_weights_dir(os.environ.get("BENCH_REAL_MODEL") or
                                                os.path.join(ROOT, ".cache", "smollm2"))
    import transformers
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    print(f"\n## real model: SmolLM2-135M-Instruct, ours vs transformers {transformers.__version__} "
          f"(AutoModelForCausalLM + torch.optim.AdamW), bf16 autocast over float32 weights, AdamW, clipping, {where}; "
          f"{weights}; the median of {steps} steps after {WARMUP}, each row a fresh process, the sides alternated, "
          f"{rounds} rounds")
    print(f"{'side':>12} | {'B x T':>8} | {'grad_ckpt':>9} | {'ms/step':>8} | {'tokens/s':>9} | {'MFU':>6} | "
          f"{'peak mem':>9} | {'first loss':>10}")
    print("-" * 92)
    rows = {}
    try:
        for B, T, ckpt in shapes:
            for r in range(rounds):
                for side in ("ours", "transformers")[::1 if r % 2 == 0 else -1]:
                    row = in_subprocess("real", side=side, path=path or made, B=B, T=T, grad_ckpt=ckpt, steps=steps)
                    rows.setdefault((B, T, ckpt, side), []).append(row)
                    flops = next(x["flops"] for x in rows.get((B, T, ckpt, "ours"), [row]))
                    mfu = f"{row['flops_per_s'] * flops:6.1%}" if flops else f"{'':6}"
                    print(f"{side:>12} | {B:>3} x {T:<4} | {str(ckpt):>9} | {row['ms']:8.0f} | {row['tok_s']:9,.0f} | "
                          f"{mfu} | {row['peak_mb']:6.0f} MB | {row['first_loss']:10.4f}", flush=True)
            o, t = (min(rows[B, T, ckpt, s], key=lambda x: x["ms"]) for s in ("ours", "transformers"))
            print(f"B={B} x T={T}, grad_ckpt={ckpt}: ours at {t['ms'] / o['ms']:.2f}x transformers' tokens/s (the "
                  f"fastest round of each), peak memory {o['peak_mb'] / t['peak_mb']:.2f}x")
    finally:
        if made:
            shutil.rmtree(made, ignore_errors=True)
