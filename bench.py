"""
Benchmarks, printed as tables. Not tests: timings on shared machines are noisy, so each
table compares rows measured in the same run.

    python bench.py                  # every table
    python bench.py single           # one table by name

single: throughput of one process on the default model (train.py's defaults), with and
        without activation checkpointing: ms/iter, tokens/s, MFU against this machine's
        measured matmul rate, and peak memory. Each row runs in a fresh process so that its
        peak memory (max RSS on CPU) is its own.
"""

import json
import os
import resource
import subprocess
import sys
import time

import torch

from model import ModelConfig, Transformer, measure_matmul_flops

# the default model and batch of train.py
MODEL = dict(vocab_size=8192, block_size=128, n_layer=4, n_head=4, n_kv_head=2, n_embd=128)
BATCH, ACCUM, WARMUP, ITERS = 16, 2, 3, 10


def peak_memory_mb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def single_row(grad_ckpt):
    """One training configuration, timed in this process: a dict of measurements."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**MODEL, grad_ckpt=grad_ckpt)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, MODEL["vocab_size"], (ACCUM, BATCH, MODEL["block_size"] + 1), device=device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    times = []
    for i in range(WARMUP + ITERS):
        t0 = time.perf_counter()
        for k in range(ACCUM):
            with autocast:
                _, loss = model(x[k, :, :-1], x[k, :, 1:])
            (loss / ACCUM).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - t0)
    dt = sorted(times[WARMUP:])[ITERS // 2]  # the median: robust to a noisy neighbour
    tokens = ACCUM * BATCH * MODEL["block_size"]
    peak = measure_matmul_flops(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    return {"grad_ckpt": grad_ckpt, "ms_iter": dt * 1000, "tok_s": tokens / dt,
            "mfu": model.flops_per_token() * tokens / dt / peak, "peak_gflops": peak / 1e9,
            "peak_mb": peak_memory_mb(device), "params_m": model.num_params() / 1e6}


def in_subprocess(table, **kw):
    """Runs one row in a fresh interpreter (own peak memory) and returns its dict."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count()))}
    out = subprocess.run([sys.executable, __file__, "--row", table, json.dumps(kw)], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def table_single():
    cfg = ", ".join(f"{k}={v}" for k, v in MODEL.items())
    print(f"\n## single process: {cfg}, batch {BATCH} x {ACCUM} micro-steps "
          f"({BATCH * ACCUM * MODEL['block_size']} tokens/iter), median of {ITERS} iterations")
    rows = [in_subprocess("single", grad_ckpt=g) for g in (False, True)]
    print(f"{'grad_ckpt':>9} | {'ms/iter':>8} | {'tokens/s':>9} | {'MFU':>6} | {'matmul peak':>12} | {'peak mem':>9}")
    print("-" * 68)
    for r in rows:
        print(f"{str(r['grad_ckpt']):>9} | {r['ms_iter']:8.1f} | {r['tok_s']:9,.0f} | {r['mfu']:6.1%} | "
              f"{r['peak_gflops']:7.1f} GF/s | {r['peak_mb']:6.0f} MB")
    print(f"model: {rows[0]['params_m']:.2f}M parameters; grad_ckpt=True costs "
          f"{rows[1]['ms_iter'] / rows[0]['ms_iter']:.2f}x the time (one more forward per block)")


TABLES = {"single": table_single}
ROWS = {"single": single_row}

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--row":
        print(json.dumps(ROWS[sys.argv[2]](**json.loads(sys.argv[3]))))
        sys.exit(0)
    names = sys.argv[1:] or list(TABLES)
    for name in names:
        if name not in TABLES:
            sys.exit(f"error: unknown table '{name}': choose from {', '.join(TABLES)}")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU cores"
          + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""))
    for name in names:
        TABLES[name]()
