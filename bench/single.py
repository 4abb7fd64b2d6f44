"""Throughput of one process on the default model (train.py's defaults), with and without
activation checkpointing: ms/iter, tokens/s, MFU against this machine's measured matmul rate,
and peak memory. Each row runs in a fresh process so that its peak memory (max RSS on CPU) is
its own."""

import torch

from model import ModelConfig, Transformer
from parallel import peak_flops
from techniques import activations

from bench.base import ACCUM, BATCH, ITERS, MODEL, in_subprocess, median_step_time, peak_memory_mb


def single_row(grad_ckpt):
    """One training configuration, timed in this process: a dict of measurements."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**MODEL)).to(device)
    if grad_ckpt:  # (train.py's grad_ckpt=True)
        activations.apply(model, "full")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, MODEL["vocab_size"], (ACCUM, BATCH, MODEL["block_size"] + 1),
                      device=device)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else torch.autocast("cpu", enabled=False))
    dt = median_step_time(model, opt, x, autocast)
    tokens = ACCUM * BATCH * MODEL["block_size"]
    peak = peak_flops(device, torch.bfloat16 if device.type == "cuda" else torch.float32)[0]
    return {"grad_ckpt": grad_ckpt, "ms_iter": dt * 1000, "tok_s": tokens / dt,
            "mfu": model.flops_per_token() * tokens / dt / peak, "peak_gflops": peak / 1e9,
            "peak_mb": peak_memory_mb(device), "params_m": model.num_params() / 1e6}


def table_single():
    cfg = ", ".join(f"{k}={v}" for k, v in MODEL.items())
    print(f"\n## single process: {cfg}, batch {BATCH} x {ACCUM} micro-steps "
          f"({BATCH * ACCUM * MODEL['block_size']} tokens/iter), median of {ITERS} iterations")
    rows = [in_subprocess("single", grad_ckpt=g) for g in (False, True)]
    print(f"{'grad_ckpt':>9} | {'ms/iter':>8} | {'tokens/s':>9} | {'MFU':>6} | "
          f"{'matmul peak':>12} | {'peak mem':>9}")
    print("-" * 68)
    for r in rows:
        print(f"{str(r['grad_ckpt']):>9} | {r['ms_iter']:8.1f} | {r['tok_s']:9,.0f} | "
              f"{r['mfu']:6.1%} | {r['peak_gflops']:7.1f} GF/s | {r['peak_mb']:6.0f} MB")
    print(f"model: {rows[0]['params_m']:.2f}M parameters; grad_ckpt=True costs "
          f"{rows[1]['ms_iter'] / rows[0]['ms_iter']:.2f}x the time (one more forward per block)")
