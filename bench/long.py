"""Long sequences: activation bytes per rank (what autograd saves for backward) and ms of forward +
backward at T = 512, 1024, 2048 for one process, tp=2, tp=2 with sequence parallelism, and cp=2
by the ring and by the all-gather (a small model, gloo ranks)."""

import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

import parallel
import workarounds
from model import ModelConfig, Transformer
from techniques import context_parallel
from techniques import tensor_parallel

from bench.base import run_ranks


# blocks, not the head, dominate
LONG_MODEL = dict(vocab_size=512, n_layer=2, n_head=4, n_kv_head=2, n_embd=128)


LONG_BATCH = 2


def long_worker(layout, lengths):
    """One rank of the long table: for each sequence length T, the bytes that autograd saves for
    one micro-batch's backward on this rank (distinct storages, parameters and buffers left
    out: the activations), and the median ms of forward + backward."""
    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    workarounds.keep_freed_memory()  # as train.py on a CPU
    split = world if layout != "one process" else 1
    mesh = parallel.setup("auto", 300, tp=split if layout.startswith("tp") else 1,
                          cp=split if layout.startswith("cp") else 1)
    rows = {}
    for T in lengths:
        torch.manual_seed(0)
        model = Transformer(ModelConfig(**LONG_MODEL, block_size=T)).to(mesh.device)
        tensor_parallel.tensor_parallel(model, mesh, sp=layout == "tp=2 sp")
        context_parallel.context_parallel(model, mesh, ring=layout == "cp=2 ring")
        x = torch.randint(0, LONG_MODEL["vocab_size"], (LONG_BATCH, T + 1), device=mesh.device,
                          generator=torch.Generator(mesh.device).manual_seed(0))
        skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        saved = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in skip:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        times = []
        for i in range(3):
            dist.barrier()
            t0 = time.perf_counter()
            with (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if i == 0
                  else nullcontext()):
                _, loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
            times.append(time.perf_counter() - t0)
        rows[T] = {"act_mb": sum(saved.values()) / 2 ** 20, "ms": sorted(times)[1] * 1000}
    rows = parallel.all_gather_object(rows, mesh)
    parallel.teardown(mesh)
    # the busiest rank
    return {T: {k: max(r[T][k] for r in rows) for k in rows[0][T]} for T in lengths}


def table_long(lengths=(512, 1024, 2048)):
    B, C, L = LONG_BATCH, LONG_MODEL["n_embd"], LONG_MODEL["n_layer"]
    print("\n## long sequences (gloo): activation MB per rank (what autograd saves for backward, "
          f"parameters left out) and ms of one forward + backward, by sequence length T; {L} "
          f"layers, width {C}, batch {B}, vocab {LONG_MODEL['vocab_size']}, fp32, one core "
          "per rank")
    layouts = [("one process", 1), ("tp=2", 2), ("tp=2 sp", 2), ("cp=2 ring", 2),
               ("cp=2 all-gather", 2)]
    results = {name: run_ranks(long_worker, world, name, list(lengths)) for name, world in layouts}
    print(f"{'T':>6} | " + " | ".join(f"{name:>19}" for name, _ in layouts))
    print("-" * (9 + 22 * len(layouts)))
    for T in lengths:
        print(f"{T:>6} | " + " | ".join(f"{r[str(T)]['act_mb']:7.1f} MB {r[str(T)]['ms']:5.0f} ms"
                                        for r in results.values()))
    one = 4 * B * C / 2 ** 20  # MB of one fp32 (B, 1, n_embd) slice: per token of T
    print("communication per layer and micro-batch, forward (backward the same), for T tokens: "
          "tp: 2 all-reduces of (B, T, C); tp + sp: 2 all-gathers + 2 reduce-scatters of (B, T, "
          "C) (the same bytes on a ring: an all-reduce is a reduce-scatter then an all-gather); "
          "cp: (cp - 1) passes of this rank's K and V, 2 x (B, T/cp, n_kv_head x head_dim) each "
          f"({one * 2 * LONG_MODEL['n_kv_head'] / LONG_MODEL['n_head']:.4f} MB per token of T "
          "here), backward twice that (K/V and their gradients).")
