"""(a CUDA device only) a GPT-2-small-shaped LLaMA (12 layers, width 768, 12 heads, block 1024,
vocab 50304, batch 12: nanoGPT's bench.py shape) in bf16 autocast, compiled, flash SDPA, fused
AdamW: ms/iter, tokens/s and MFU against the GPU's dense bf16 peak, beside nanoGPT's own
bench.py (GPT-2 124M) run on the same GPU in the same run (its files in ./nanogpt or
$NANOGPT_DIR: bench.py, model.py, configurator.py; its MFU, printed against the A100's 312
TFLOP/s, is rescaled to this GPU's peak); then the same model under FSDP2 on one rank, its
checkpoint saves plain vs async, and the head + loss at vocab 128k."""

import subprocess
import sys
import time

import torch

import parallel
from model import ModelConfig, Transformer
from parallel import peak_flops
from techniques import fsdp

from bench.base import nanogpt_dir, run_ranks
from bench.checkpoint import table_checkpoint
from bench.head import table_head


GPU_MODEL = dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_kv_head=12,
                 n_embd=768)


GPU_BATCH = 12


def gpu_peak():
    """The datasheet's dense bf16 peak (parallel.GPU_PEAKS), else an 8192^2 matmul's rate."""
    return peak_flops(torch.device("cuda"), torch.bfloat16, n=8192)[0]


def gpu_worker(use_fsdp, steps=20):
    """One rank: our model at GPU_MODEL, bf16 autocast, compiled, fused AdamW (use_fsdp: under
    FSDP2 over this one rank): the median ms of `steps` steps after 10 warm-up (compiling) ones."""
    mesh = parallel.setup("cuda", 600)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # as train.py
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**GPU_MODEL)).to(mesh.device)
    if use_fsdp:
        fsdp.fully_shard_model(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=not use_fsdp)
    compiled = torch.compile(model)
    x = torch.randint(0, GPU_MODEL["vocab_size"], (GPU_BATCH, GPU_MODEL["block_size"] + 1),
                      device=mesh.device)
    times = []
    for _ in range(10 + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = compiled(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    dt = sorted(times[10:])[steps // 2]
    return {"ms": dt * 1000, "flops_per_token": model.flops_per_token(),
            "peak_mb": torch.cuda.max_memory_allocated() / 2 ** 20}


def nanogpt_row():
    """nanoGPT's own bench.py (fixed random data, compiled) in its directory: (ms/iter, its MFU
    against the A100's 312 TFLOP/s), or None when its files are not there."""
    import re
    src = nanogpt_dir("bench.py", "model.py", "configurator.py")
    if src is None:
        return None
    out = subprocess.run([sys.executable, "bench.py", "--real_data=False", "--compile=True"],
                         cwd=src, capture_output=True, text=True, check=True).stdout
    m = re.search(r"time per iteration: ([\d.]+)ms, MFU: ([\d.]+)%", out)
    if m is None:
        raise SystemExit("nanoGPT's bench.py printed no 'time per iteration' line; its output "
                         f"ended:\n{out[-2000:]}")
    return float(m[1]), float(m[2]) / 100


def table_gpu():
    if not torch.cuda.is_available():
        print("\n## gpu: no CUDA device here; this table needs one (see the docstring)")
        return
    peak, tokens = gpu_peak(), GPU_BATCH * GPU_MODEL["block_size"]
    print(f"\n## gpu: {torch.cuda.get_device_name()}, dense bf16 peak {peak / 1e12:.0f} TFLOP/s; "
          f"GPT-2-small shape ({', '.join(f'{k}={v}' for k, v in GPU_MODEL.items())}), batch "
          f"{GPU_BATCH} ({tokens:,} tokens/iter), bf16 autocast, torch.compile, median step")
    print(f"{'run':<32} | {'ms/iter':>8} | {'tokens/s':>10} | {'MFU':>6} | {'peak mem':>9}")
    print("-" * 78)
    ours = {}
    for name, use_fsdp in (("ours", False), ("ours, fsdp=True on 1 rank", True)):
        r = ours[name] = run_ranks(gpu_worker, 1, use_fsdp)
        print(f"{name:<32} | {r['ms']:8.1f} | {tokens / r['ms'] * 1000:10,.0f} | "
              f"{r['flops_per_token'] * tokens / (r['ms'] / 1000) / peak:6.1%} | "
              f"{r['peak_mb']:6.0f} MB", flush=True)
    nano = nanogpt_row()
    if nano is None:
        print("nanoGPT: its files are not in ./nanogpt (or $NANOGPT_DIR): no side-by-side row")
    else:
        mfu = nano[1] * 312e12 / peak  # nanoGPT prints its MFU against an A100
        ours_mfu = ours["ours"]["flops_per_token"] * tokens / (ours["ours"]["ms"] / 1000) / peak
        print(f"{'nanoGPT bench.py (GPT-2 124M)':<32} | {nano[0]:8.1f} | "
              f"{tokens / nano[0] * 1000:10,.0f} | {mfu:6.1%} | {'':>9}")
        print(f"ours / nanoGPT MFU: {ours_mfu / mfu:.2f}x (goal: at least 1.1x)")
    table_checkpoint(worlds=(1,), saves=3, models=(GPU_MODEL,))
    table_head(vocabs=(32768, 131072), chunk=1024, rows=tokens, width=GPU_MODEL["n_embd"])
