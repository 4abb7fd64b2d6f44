"""The default model at 1, 2 and 4 ranks as dp, ZeRO 1 and 2 (and 2 with optimizer offload), fsdp
and pp, the same global batch: per-rank bytes of parameters, gradients and optimizer state, the
peak memory (max RSS above the process's size before the model was built, on CPU), and ms/iter."""

import os
import resource
import time

import torch
import torch.distributed as dist

import parallel
from model import ModelConfig, Transformer
from techniques import data_parallel
from techniques import fsdp
from techniques import pipeline
from techniques import zero

from bench.base import ITERS, MODEL, SMOKE, WARMUP, run_ranks


def layout_worker(layout):
    from techniques.pipeline import make_stage
    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    with open("/proc/self/statm") as f:
        base_mb = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20
    mesh = parallel.setup("auto", 300, pp=world if layout == "pp" else 1)
    dev = mesh.device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    model = make_stage(Transformer(ModelConfig(**MODEL)), mesh.pp_rank, mesh.pp).to(dev)
    if layout == "fsdp":
        fsdp.fully_shard_model(model, mesh)
    wrapped = (data_parallel.DataParallel(model, mesh, 4.0) if layout == "dp" and world > 1
               else model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    clip = list(model.parameters())
    if layout.startswith("zero"):  # "zero1", "zero2", "zero2+offload"
        wrapped = zero.ZeroDataParallel(model, mesh, 4.0, stage=int(layout[4]))
        opt = zero.ZeroOptimizer(wrapped, [{"params": list(model.parameters())}],
                                 offload="offload" in layout, lr=1e-4)
        clip = opt.params
    micro = MEM_ACCUM // mesh.dp
    x = torch.randint(0, MODEL["vocab_size"], (micro, MEM_BATCH, MODEL["block_size"] + 1),
                      device=dev, generator=torch.Generator(dev).manual_seed(mesh.dp_rank))
    times, mem = [], None
    for i in range(WARMUP + ITERS):
        dist.barrier()
        t0 = time.perf_counter()
        if layout == "pp":
            pipeline.pipeline_step("1f1b", wrapped, mesh,
                                   [(xk[:, :-1], xk[:, 1:], None, None) for xk in x],
                                   (MEM_BATCH, MODEL["block_size"], MODEL["n_embd"]))
        else:
            for k in range(micro):
                parallel.set_grad_sync(wrapped, k == micro - 1)
                (wrapped(x[k, :, :-1], x[k, :, 1:])[1] / micro).backward()
            if isinstance(wrapped, data_parallel.DataParallelBase):
                wrapped.wait()
        parallel.clip_grad_norm_(clip, 1.0, mesh, sharded=layout.startswith("zero"))
        opt.step()
        mem = parallel.memory_bytes(model, opt)
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() / 2 ** 20 if dev.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base_mb)
    row = {**{k: v / 2 ** 20 for k, v in mem.items()}, "peak_mb": peak,
           "ms": sorted(times[WARMUP:])[ITERS // 2] * 1000}
    rows = parallel.all_gather_object(row, mesh)
    parallel.teardown(mesh)
    return {k: max(r[k] for r in rows) for k in row}  # the busiest rank


MEM_BATCH, MEM_ACCUM = 2 if SMOKE else 8, 4


def table_memory(layouts=(("dp", 1), ("dp", 2), ("dp", 4), ("zero1", 2),
                          ("zero1", 4), ("zero2", 2), ("zero2", 4),
                          ("zero2+offload", 2), ("fsdp", 2), ("fsdp", 4), ("pp", 2), ("pp", 4))):
    tokens = MEM_BATCH * MEM_ACCUM * MODEL["block_size"]
    print("\n## memory and speed per layout: the default model "
          f"({Transformer(ModelConfig(**MODEL)).num_params() / 1e6:.2f}M parameters, fp32), "
          f"global batch {MEM_BATCH} x {MEM_ACCUM} micro-batches ({tokens} tokens/iter), one core "
          "per rank; the most loaded rank's numbers")
    print(f"{'layout':<13} {'ranks':>5} | {'params MB':>9} | {'grads MB':>8} | {'optim MB':>8} | "
          f"{'p+g+o':>6} | {'peak MB':>7} | {'ms/iter':>8} | {'tokens/s':>8}")
    print("-" * 97)
    for layout, world in layouts:
        r = run_ranks(layout_worker, world, layout)
        total = r["params"] + r["grads"] + r["optimizer"]
        print(f"{layout:<13} {world:>5} | {r['params']:9.2f} | {r['grads']:8.2f} | "
              f"{r['optimizer']:8.2f} | {total:6.1f} | {r['peak_mb']:7.0f} | {r['ms']:8.1f} | "
              f"{tokens / r['ms'] * 1000:8,.0f}")
    print("zero1 at N ranks holds 1/N of the optimizer state, zero2 also 1/N of the gradients; "
          "fsdp 1/N of params, grads and optimizer state; pp holds the busiest stage's share (the "
          "last stage carries the head). offload keeps the optimizer state in CPU memory: on a "
          "CPU-only machine it is the zero2 row again. Peak is max RSS above the process size "
          "before the model on CPU (activations, buffers, allocator slack included), "
          "max_memory_allocated on GPU.")
