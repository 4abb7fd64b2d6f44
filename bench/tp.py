"""Tensor parallel at 1, 2 and 4 ranks, the default model and one global batch: ms/iter, per-rank
parameter bytes and activation bytes (what autograd saves for one micro-batch), and the
all-reduce volume of one iteration counted at dist.all_reduce against the theory."""

import os
import time

import torch
import torch.distributed as dist

import parallel
from model import ModelConfig, Transformer
from techniques import tensor_parallel

from bench.base import ITERS, MODEL, SMOKE, WARMUP, run_ranks, sized


def tp_worker():
    """One rank of the tp table: the default model sharded over all ranks (tp = world)."""
    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    mesh = parallel.setup("auto", 300, tp=world)
    dev = mesh.device
    torch.manual_seed(0)
    model = tensor_parallel.tensor_parallel(Transformer(ModelConfig(**TP_MODEL)).to(dev), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, MODEL["vocab_size"], (TP_ACCUM, TP_BATCH, MODEL["block_size"] + 1),
                      device=dev, generator=torch.Generator(dev).manual_seed(0))
    # count what enters an all-reduce, forward and backward, by wrapping the collective
    volume, phase, all_reduce = {"forward": 0, "backward": 0}, ["forward"], dist.all_reduce

    def counting(t, *args, **kwargs):
        volume[phase[0]] += t.numel() * t.element_size()
        return all_reduce(t, *args, **kwargs)
    times = []
    for i in range(WARMUP + ITERS):
        dist.barrier()
        if i == WARMUP:  # one iteration counted
            dist.all_reduce = counting  # parallel.py calls dist.all_reduce through the module
        t0 = time.perf_counter()
        for k in range(TP_ACCUM):
            phase[0] = "forward"
            _, loss = model(x[k, :, :-1], x[k, :, 1:])
            phase[0] = "backward"
            (loss / TP_ACCUM).backward()
        dist.all_reduce = all_reduce
        parallel.clip_grad_norm_(model.parameters(), 1.0, mesh)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x[0, :, :-1], x[0, :, 1:])
    row = {"ms": sorted(times[WARMUP:])[ITERS // 2] * 1000,
           "params_mb": sum(p.numel() * p.element_size() for p in model.parameters()) / 2 ** 20,
           "act_mb": sum(saved) / 2 ** 20,
           "fwd_mb": volume["forward"] / 2 ** 20, "bwd_mb": volume["backward"] / 2 ** 20}
    parallel.teardown(mesh)
    return row


TP_BATCH, TP_ACCUM = 2 if SMOKE else 8, 2


# tp=4 needs 4 key/value heads: plain multi-head attention
TP_MODEL = sized({**MODEL, "n_kv_head": MODEL["n_head"]})


def table_tp(worlds=(1, 2, 4)):
    B, T, C, L = TP_BATCH, TP_MODEL["block_size"], TP_MODEL["n_embd"], TP_MODEL["n_layer"]
    # bytes of one fp32 (B, T, n_embd) activation: what each f or g all-reduces
    one = 4 * B * T * C
    # per micro-batch: forward 2 g per block + the embedding's g + the loss's (max, sum-exp,
    # target logit: 3 floats per token); backward 2 f per block + the head's f
    theory = {"fwd": TP_ACCUM * ((2 * L + 1) * one + 3 * 4 * B * T),
              "bwd": TP_ACCUM * (2 * L + 1) * one}
    print("\n## tensor parallel (gloo), tp = ranks, the default model with "
          f"n_kv_head={TP_MODEL['n_kv_head']}, global batch {B} x {TP_ACCUM} micro-batches "
          f"({B * TP_ACCUM * T} tokens/iter), one core per rank, median of {ITERS} iterations")
    print(f"{'tp':>3} | {'ms/iter':>8} | {'params MB':>9} | {'activations MB':>14} | "
          f"{'all-reduce fwd MB':>17} | {'bwd MB':>6} | {'theory fwd / bwd MB':>19}")
    print("-" * 96)
    for world in worlds:
        r = run_ranks(tp_worker, world)
        th = (f"{theory['fwd'] / 2 ** 20:7.2f} / {theory['bwd'] / 2 ** 20:6.2f}" if world > 1
              else "0 / 0")
        print(f"{world:>3} | {r['ms']:8.1f} | {r['params_mb']:9.2f} | {r['act_mb']:14.1f} | "
              f"{r['fwd_mb']:17.2f} | {r['bwd_mb']:6.2f} | {th:>19}")
    print("theory: per block and direction 2 all-reduces of B x T x n_embd fp32 = 2 x "
          f"{one / 2 ** 20:.2f} MB per micro-batch, plus the embedding (forward) and the head "
          "(backward), plus 3 floats per token for the loss; MB entering the all-reduce (a ring "
          "sends 2 (tp-1)/tp of it per rank). The clip's one float is left out.")
