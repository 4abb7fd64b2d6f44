"""Data parallel at 2 ranks (gloo on CPU, nccl on GPUs), the same model and global batch: our naive
and bucketed all-reduce against torch's DistributedDataParallel, measured in interleaved rounds,
plus how much of the bucketed all-reduce time is hidden behind backward."""

import time

import torch
import torch.distributed as dist

import parallel
from model import ModelConfig, Transformer
from techniques import data_parallel

from bench.base import ACCUM, BATCH, ITERS, MODEL, WARMUP, run_ranks


def dp_worker(bucket_sizes):
    """One rank of the dp table: every implementation, interleaved round by round so that a
    noisy neighbour hurts them all alike."""
    mesh = parallel.setup("auto", 300)
    dev = mesh.device
    variants = [("none", None), ("naive", None), *[("bucketed", mb) for mb in bucket_sizes],
                ("torch", bucket_sizes[0])]
    models = {}
    for impl, mb in variants:
        torch.manual_seed(0)
        model = Transformer(ModelConfig(**MODEL)).to(dev)
        if impl == "none":  # no communication at all: the compute-only floor
            ddp = model
        elif impl == "torch":
            ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=mb)
        else:
            ddp = (data_parallel.NaiveDataParallel(model, mesh) if impl == "naive"
                   else data_parallel.DataParallel(model, mesh, mb))
        models[(impl, mb)] = (ddp, torch.optim.AdamW(model.parameters(), lr=1e-4))
    micro = ACCUM // mesh.dp
    x = torch.randint(0, MODEL["vocab_size"], (micro, BATCH, MODEL["block_size"] + 1), device=dev,
                      generator=torch.Generator(dev).manual_seed(mesh.rank))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    times = {v: [] for v in variants}
    waits = {v: [] for v in variants}
    for rnd in range(WARMUP + ITERS):
        for v in variants:
            ddp, opt = models[v]
            dist.barrier()
            t0 = time.perf_counter()
            for k in range(micro):
                ddp.require_backward_grad_sync = k == micro - 1
                _, loss = ddp(x[k, :, :-1], x[k, :, 1:])
                (loss / micro).backward()
            sync()
            t1 = time.perf_counter()
            if v[0] in ("naive", "bucketed"):
                # what backward did not hide: naive's whole all-reduce, bucketed's last bucket(s)
                ddp.wait()
            sync()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            if rnd >= WARMUP:
                times[v].append(time.perf_counter() - t0)
                waits[v].append(t2 - t1)
    # the all-reduce time alone: every bucket of the bucketed layout, synchronously, no backward
    comm = {}
    for v in variants:
        if v[0] == "bucketed":
            flats = [b.flat for b in models[v][0].buckets]
            ts = []
            for _ in range(ITERS):
                dist.barrier()
                t0 = time.perf_counter()
                for f in flats:
                    dist.all_reduce(f)
                sync()
                ts.append(time.perf_counter() - t0)
            comm[v] = sorted(ts)[ITERS // 2]
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    rows = [{"impl": impl, "bucket_mb": mb, "ms_iter": med(times[(impl, mb)]) * 1000,
             "wait_ms": med(waits[(impl, mb)]) * 1000, "comm_ms": comm.get((impl, mb), 0) * 1000,
             "buckets": len(models[(impl, mb)][0].buckets) if impl == "bucketed" else None}
            for impl, mb in variants]
    parallel.teardown(mesh)
    return rows


def table_dp(world=2, bucket_sizes=(4.0, 1.0, 25.0)):
    tokens = ACCUM * BATCH * MODEL["block_size"]
    n_params = Transformer(ModelConfig(**MODEL)).num_params()
    print(f"\n## data parallel, {world} ranks "
          f"({'nccl' if torch.cuda.is_available() else 'gloo'}), same model, global batch {BATCH} "
          f"x {ACCUM} micro-batches ({tokens} tokens/iter), {n_params * 4 / 2 ** 20:.1f} MB of "
          f"fp32 gradients, median of {ITERS} interleaved rounds")
    rows = run_ranks(dp_worker, world, list(bucket_sizes))
    ms = {(r["impl"], r["bucket_mb"]): r["ms_iter"] for r in rows}
    torch_ms, floor = ms[("torch", bucket_sizes[0])], ms[("none", None)]
    bucketed_ms = ms[("bucketed", bucket_sizes[0])]
    comm_alone = rows[2]["comm_ms"]
    print(f"{'implementation':<26} | {'ms/iter':>8} | {'tokens/s':>9} | {'vs torch':>8} | "
          f"{'exposed comm':>12} | {'wait after bwd':>14} | {'hidden':>6}")
    print("-" * 102)
    for r in rows:
        name = {"none": "no sync (compute only)", "naive": "naive (per parameter)",
                "torch": "torch DDP"}.get(r["impl"], "bucketed")
        if r["bucket_mb"] is not None:
            name += f", {r['bucket_mb']:g} MB" + (f" ({r['buckets']} bkt)" if r["buckets"] else "")
        exposed = r["ms_iter"] - floor
        hidden = (f"{min(1.0, max(0.0, 1 - r['wait_ms'] / comm_alone)):6.0%}"
                  if r["impl"] in ("naive", "bucketed") else f"{'':>6}")
        wait = f"{r['wait_ms']:11.1f} ms" if r["impl"] in ("naive", "bucketed") else f"{'':>14}"
        print(f"{name:<26} | {r['ms_iter']:8.1f} | {tokens / r['ms_iter'] * 1000:9,.0f} | "
              f"{r['ms_iter'] / torch_ms:7.2f}x | {exposed:9.1f} ms | {wait} | {hidden}")
    print(f"bucketed ({bucket_sizes[0]:g} MB) / torch DDP: {bucketed_ms / torch_ms:.2f} (goal <= "
          f"1.05); naive / bucketed: {ms[('naive', None)] / bucketed_ms:.2f}. The same "
          f"all-reduces run alone take {comm_alone:.1f} ms; hidden = 1 - wait after backward / "
          "alone;\n"
          "exposed comm = ms/iter - compute only, which also counts compute slowed by the "
          "communication threads.")
