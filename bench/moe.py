"""Mixture of experts. (1) The default job dense against a MoE of equal active parameters (8
experts of half the SwiGLU width, 2 a token: the same matmul FLOPs a token) on the default
corpus: each a whole `python train.py` run, tokens/s (median), and the train loss at equal wall
time (the shorter run's training time; the mean of the 10 losses logged before it). (2) The
all-to-all's share of a training step at ep=2 (2 spawned ranks): the time inside the exchanges
(counts, dispatch and combine, forward and backward) over the step's."""

import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import parallel
from model import ModelConfig, Transformer
from techniques import data_parallel
from techniques import expert_parallel
from techniques import moe

from bench.base import (ACCUM, BATCH, ITERS, MODEL, RUN_KEYS, SMOKE, TRAIN, TRAIN_PY, WARMUP,
                        run_ranks)


def moe_keys(ffn_dim):
    """8 experts of half the dense width, 2 a token: per token the dense model's FFN FLOPs."""
    return dict(n_experts=8, moe_top_k=2, moe_ffn_dim=ffn_dim // 2)


def train_run(keys, max_iters):
    """A whole train.py run (one process): its train lines [(seconds of training so far, loss)] and
    its median tokens/s."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out")
        args = [f"{k}={v}" for k, v in keys.items()] + [f"max_iters={max_iters}", "log_interval=1",
                                                         f"eval_interval={max_iters}",
                                                         "sample_tokens=0",
                                                         f"out_dir={out}", *RUN_KEYS]
        subprocess.run([sys.executable, TRAIN_PY, *args], check=True, capture_output=True,
                       text=True)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [r for r in map(json.loads, f) if r.get("loss") is not None and "dt_ms" in r]
    t, curve = 0.0, []
    for r in rows:
        t += r["dt_ms"] / 1000
        curve.append((t, r["loss"]))
    return curve, sorted(r["tok_per_s"] for r in rows)[len(rows) // 2]


def loss_at(curve, seconds, n=10):
    """The mean of the last n losses logged by `seconds` of training (nan: none yet)."""
    before = [loss for t, loss in curve if t <= seconds + 1e-9][-n:]
    return sum(before) / len(before) if before else float("nan")


def exchange_worker(model_kw, ep):
    """One rank: a MoE model with its experts over ep ranks, data parallel around it; the median
    step's seconds and the seconds inside all_to_all_single in it."""
    mesh = parallel.setup("auto", 300)
    dev = mesh.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    spent = [0.0]
    exchange = dist.all_to_all_single

    def timed(*args, **kwargs):  # (the bench's own wrapper: every exchange of expert_parallel.py)
        sync()
        t0 = time.perf_counter()
        out = exchange(*args, **kwargs)
        sync()
        spent[0] += time.perf_counter() - t0
        return out
    dist.all_to_all_single = timed
    cfg = ModelConfig(**model_kw)
    torch.manual_seed(0)
    model = expert_parallel.expert_parallel(moe.attach(Transformer(cfg).to(dev), cfg), mesh, ep,
                                            moe.moe_layers)
    wrapped = data_parallel.DataParallel(model, mesh, 4.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    micro = ACCUM // mesh.dp if ACCUM >= mesh.dp else 1
    x = torch.randint(0, cfg.vocab_size, (micro, BATCH, cfg.block_size + 1), device=dev,
                      generator=torch.Generator(dev).manual_seed(mesh.rank))
    steps, shares = [], []
    for i in range(WARMUP + ITERS):
        dist.barrier()
        spent[0] = 0.0
        t0 = time.perf_counter()
        for k in range(micro):
            wrapped.require_backward_grad_sync = k == micro - 1
            _, loss = wrapped(x[k, :, :-1], x[k, :, 1:])
            (loss / micro).backward()
        wrapped.wait()
        expert_parallel.sync_grads(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if i >= WARMUP:
            steps.append(time.perf_counter() - t0)
            shares.append(spent[0])
    order = sorted(range(len(steps)), key=steps.__getitem__)[len(steps) // 2]
    return {"step_s": steps[order], "exchange_s": shares[order]}


def table_moe(max_iters=None, worlds=(2,)):
    max_iters = max_iters or TRAIN["max_iters"]
    ffn = ModelConfig(n_embd=TRAIN["n_embd"], n_head=TRAIN["n_head"],
                      n_kv_head=TRAIN["n_kv_head"]).ffn_dim
    keys = moe_keys(ffn)
    print(f"\n## mixture of experts: the default job ({max_iters} iterations, one process) dense "
          f"(SwiGLU width {ffn}) against MoE ({', '.join(f'{k}={v}' for k, v in keys.items())}: "
          "the same FLOPs a token)")
    (dense, dense_tps), (mixed, moe_tps) = train_run({}, max_iters), train_run(keys, max_iters)
    at = min(dense[-1][0], mixed[-1][0])
    print(f"{'model':>6} | {'tokens/s':>9} | {'train s':>8} | {f'loss at {at:.0f} s':>14} | "
          f"{'final loss':>10}")
    print("-" * 60)
    for name, curve, tps in (("dense", dense, dense_tps), ("moe", mixed, moe_tps)):
        print(f"{name:>6} | {tps:9,.0f} | {curve[-1][0]:8.1f} | {loss_at(curve, at):14.4f} | "
              f"{loss_at(curve, curve[-1][0]):10.4f}", flush=True)
    model_kw = {**MODEL, **keys}
    if SMOKE:
        model_kw["moe_ffn_dim"] = max(8, model_kw["n_embd"] // 2)
    print(f"\n## expert parallel: the all-to-all's share of a step ({model_kw['n_experts']} "
          f"experts, {BATCH} x {ACCUM} micro-batches of {MODEL['block_size']} tokens over all "
          f"ranks, median of {ITERS})")
    print(f"{'ranks':>5} | {'ep':>3} | {'step ms':>8} | {'all-to-all ms':>13} | {'share':>6}")
    print("-" * 48)
    for world in worlds:
        r = run_ranks(exchange_worker, world, model_kw, world)
        print(f"{world:5d} | {world:3d} | {r['step_s'] * 1000:8.1f} | "
              f"{r['exchange_s'] * 1000:13.1f} | {r['exchange_s'] / r['step_s']:6.1%}", flush=True)
