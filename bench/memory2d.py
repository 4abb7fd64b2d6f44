"""The 2D layouts at 4 ranks beside tp=2 and fsdp=4 (and one process): per-rank bytes of
parameters, gradients and optimizer state (AdamW) against the whole model's, which tp=2 x fsdp=2
and tp=2 x zero=2 should cut to about 1/(tp x dp); then Muon (the default) on dp=4, zero=2 (4
ranks), fsdp=4, tp=2 (x dp=2) and tp=2 x fsdp=2: the Newton-Schulz FLOPs each rank does per step
(its share of the whole) and the ms that orthogonalizing takes (gathering, the Newton-Schulz
steps, sharing the results)."""

import math
import os
import time

import torch

import parallel
from model import ModelConfig, Transformer
from techniques import data_parallel
from techniques import fsdp
from techniques import tensor_parallel
from techniques import zero

from bench.base import MODEL, SMOKE, run_ranks
from bench.memory import MEM_ACCUM, MEM_BATCH


def layout2d_worker(layout, optim_name):
    """One model per `layout` ('dp', 'zero1', 'zero2', 'fsdp', each with an optional 'tp2+'
    prefix) trained ITERS2 steps through train.py's own pieces (tensor_parallel, fsdp, zero,
    optim.build_optimizer); returns the busiest rank's bytes and the Newton-Schulz work."""
    import optim
    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    tp = 2 if layout.startswith("tp2+") else 1
    shard = layout.removeprefix("tp2+")
    mesh = parallel.setup("auto", 300, tp=tp)
    dev = mesh.device
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**MODEL)).to(dev)
    tensor_parallel.tensor_parallel(model, mesh)
    if shard == "fsdp" and mesh.dp > 1:
        fsdp.fully_shard_model(model, mesh)
    use_zero = shard.startswith("zero") and mesh.dp > 1
    wrapped = model
    if use_zero:  # as train.py picks them: ZeRO's wrapper and optimizer, or plain data parallel
        wrapped = zero.ZeroDataParallel(model, mesh, 4.0, int(shard[4]))
    elif mesh.dp > 1 and shard != "fsdp":
        wrapped = data_parallel.wrap(model, mesh, "bucketed", 4.0)
    c = dict(optim=optim_name, weight_decay=0.1, embed_lr_scale=10.0, beta1=0.9, beta2=0.95,
             offload=False, learning_rate=1e-4, muon_momentum=0.95)
    opt, clip = optim.build_optimizer(model, wrapped, mesh, c,
                                      zero.ZeroOptimizer if use_zero else None)
    work = {"flops": 0.0, "ms": 0.0}
    ns = optim.newton_schulz

    # 5 steps of X X^T (s x s from s x l), G G (s^3), (.) X (s x s times s x l), 2 FLOPs a MAC
    def counted(g, **kw):
        *k, m, n = g.shape  # one matrix, or a stack of k (newton_schulz_each)
        s, l = min(m, n), max(m, n)
        work["flops"] += math.prod(k) * 5 * 2 * (2 * s * s * l + s ** 3)
        return ns(g, **kw)
    optim.newton_schulz = counted
    inner = getattr(opt, "optimizer", opt)  # ZeroOptimizer's MuonWithAdamW
    if hasattr(inner, "orthogonalize"):
        plain = inner.orthogonalize

        def timed(params, gs):
            t0 = time.perf_counter()
            out = plain(params, gs)
            work["ms"] += (time.perf_counter() - t0) * 1000
            return out
        inner.orthogonalize = timed
    micro = MEM_ACCUM // mesh.dp
    x = torch.randint(0, MODEL["vocab_size"], (micro, MEM_BATCH, MODEL["block_size"] + 1),
                      device=dev, generator=torch.Generator(dev).manual_seed(mesh.dp_rank))
    for _ in range(ITERS2):
        for k in range(micro):
            parallel.set_grad_sync(wrapped, k == micro - 1)
            (wrapped(x[k, :, :-1], x[k, :, 1:])[1] / micro).backward()
        parallel.wait_grad_sync(wrapped)
        parallel.clip_grad_norm_(clip, 1.0, mesh, sharded=use_zero)
        opt.step()
        mem = parallel.memory_bytes(model, opt)
        opt.zero_grad(set_to_none=True)
    row = {**{k: v / 2 ** 20 for k, v in mem.items()}, "ns_gflop": work["flops"] / ITERS2 / 1e9,
           "ns_ms": work["ms"] / ITERS2}
    rows = parallel.all_gather_object(row, mesh)
    parallel.teardown(mesh)
    return {k: max(r[k] for r in rows) for k in row}


ITERS2 = 1 if SMOKE else 3


LAYOUTS_2D = (("tp=2", "tp2+dp", 2), ("fsdp=4", "fsdp", 4), ("tp=2 x fsdp=2", "tp2+fsdp", 4),
              ("tp=2 x zero=2", "tp2+zero2", 4), ("tp=2 x zero=1", "tp2+zero1", 4))


MUON_2D = (("dp=4", "dp", 4), ("zero=2", "zero2", 4), ("fsdp=4", "fsdp", 4),
           ("tp=2 (x dp=2)", "tp2+dp", 4), ("tp=2 x fsdp=2", "tp2+fsdp", 4))


def table_memory2d(layouts=LAYOUTS_2D, muon_layouts=MUON_2D):
    whole = run_ranks(layout2d_worker, 1, "dp", "adamw")
    total = whole["params"] + whole["grads"] + whole["optimizer"]
    n = Transformer(ModelConfig(**MODEL)).num_params()
    print(f"\n## 2D layouts: bytes per rank, the default model ({n / 1e6:.2f}M "
          f"parameters, fp32, AdamW), 4 ranks; the busiest rank")
    print(f"{'layout':<16} {'ranks':>5} | {'params MB':>9} | {'grads MB':>8} | {'optim MB':>8} | "
          f"{'p+g+o':>6} | {'of one process':>14}")
    print("-" * 82)
    for name, layout, world in (("one process", "dp", 1), *layouts):
        r = whole if world == 1 else run_ranks(layout2d_worker, world, layout, "adamw")
        sum_ = r["params"] + r["grads"] + r["optimizer"]
        print(f"{name:<16} {world:>5} | {r['params']:9.2f} | {r['grads']:8.2f} | "
              f"{r['optimizer']:8.2f} | {sum_:6.2f} | {sum_ / total:14.2f}")
    print("tp slices every matmul, the embedding and the head (norm gains are whole on every tp "
          "rank); fsdp and zero then shard each slice over the 2 dp ranks: about 1/(tp x dp) = "
          "0.25 of params, grads and optimizer state (zero=2: grads and optimizer; zero=1: "
          "optimizer only).")
    print("\n## Muon per step: Newton-Schulz work per rank (the busiest) and the time in "
          f"orthogonalize (gathers, Newton-Schulz, sharing), 4 ranks unless noted")
    print(f"{'layout':<16} {'ranks':>5} | {'NS GFLOP/rank':>13} | {'share of all':>12} | "
          f"{'orthogonalize ms':>16}")
    print("-" * 74)
    one = run_ranks(layout2d_worker, 1, "dp", "muon")
    for name, layout, world in (("one process", "dp", 1), *muon_layouts):
        r = one if world == 1 else run_ranks(layout2d_worker, world, layout, "muon")
        share = r["ns_gflop"] / one["ns_gflop"]
        print(
            f"{name:<16} {world:>5} | {r['ns_gflop']:13.3f} | {share:12.2f} | {r['ns_ms']:16.1f}")
    print("Each matrix is orthogonalized whole by one rank of its stage's dp x tp ranks, in "
          "rounds of largest first: a rank's share is about 1/world (more when the matrices do "
          "not divide evenly); the time includes assembling the matrices (zero: an all-reduce of "
          "pieces, fsdp: all-gathers, tp: all-gathers) and the all-gather of the results.")
