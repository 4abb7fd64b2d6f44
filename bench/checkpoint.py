"""How long the loop is blocked per checkpoint save, plain (ckpt_async=False) vs async
(ckpt_async=True: copying the state to CPU memory, then the finish once the background write is
done), at the default model and one ~10x larger, 1 and 2 ranks (dp), weights and AdamW state;
plus how long the background write took."""

import contextlib
import io
import os
import shutil
import tempfile
import time

import torch

import checkpoint
import parallel
from model import ModelConfig, Transformer
from optim import AdamW
from techniques import ckpt_async

from bench.base import MODEL, run_ranks, sized


def ckpt_worker(model_kw, saves_n):
    """One rank of the checkpoint table: `saves_n` plain saves, then `saves_n` async ones, of a
    model with AdamW state. Async: blocked = AsyncSaves.save (the copy to CPU) + finish, called
    once every rank has written (as the loop does); the time in between, when the loop would
    train, is the background write. Rank 0's times (it also writes the manifest and moves
    `latest`)."""
    mesh = parallel.setup("auto", 600)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**model_kw)).to(mesh.device)
    opt = AdamW(model.parameters(), lr=1e-4)  # optim.py's: it hands checkpoints its state by names
    x = torch.randint(0, model_kw["vocab_size"], (2, model_kw["block_size"] + 1),
                      device=mesh.device)
    model(x[:, :-1], x[:, 1:])[1].backward()
    opt.step()  # AdamW state exists: a checkpoint holds weights, exp_avg and exp_avg_sq
    out = tempfile.mkdtemp(prefix="bench_ckpt_") if mesh.master else None
    out = parallel.broadcast_object(out, mesh)
    saves = ckpt_async.AsyncSaves(out, model, opt, mesh, 2)
    row, it = {"params_m": sum(p.numel() for p in model.parameters()) / 1e6}, 0
    for mode in ("sync", "async"):
        blocked, background, copy = [], [], []
        for _ in range(saves_n):
            it += 1
            parallel.barrier(mesh)
            t0 = time.perf_counter()
            if mode == "async":
                saves.save(it, {"rng_cpu": []}, {"iter": it})
                t1 = time.perf_counter()
                while not saves.written():  # the loop trains meanwhile
                    time.sleep(0.005)
                background.append(time.perf_counter() - t1)
                # every rank has written (the loop learns it by a collective)
                parallel.barrier(mesh)
                t2 = time.perf_counter()
                with contextlib.redirect_stdout(io.StringIO()):  # its "saved checkpoint" line
                    saves.finish(it)
                blocked.append(t1 - t0 + time.perf_counter() - t2)
                copy.append(t1 - t0)
            else:
                checkpoint.save(out, it, model, opt, {"rng_cpu": []}, {"iter": it}, mesh, 2)
                blocked.append(time.perf_counter() - t0)
        row[mode] = sorted(blocked)[len(blocked) // 2] * 1000
        if background:
            row["background"] = sorted(background)[len(background) // 2] * 1000
            row["copy"] = sorted(copy)[len(copy) // 2] * 1000
    if mesh.master:
        final = os.path.join(out, "ckpt", f"iter_{it:07d}")
        row["ckpt_mb"] = sum(os.path.getsize(os.path.join(final, n))
                             for n in os.listdir(final)) / 2 ** 20
        shutil.rmtree(out, ignore_errors=True)
    parallel.teardown(mesh)
    return row


BIG = sized({**MODEL, "n_layer": 2 * MODEL["n_layer"],
             "n_embd": 4 * MODEL["n_embd"], "n_head": 2 * MODEL["n_head"],
             "n_kv_head": 2 * MODEL["n_kv_head"]})  # ~10x the default model's parameters


def table_checkpoint(worlds=(1, 2), saves=3, models=None):
    print("\n## checkpoint saves: ms the loop is blocked per save, plain vs async "
          f"(ckpt_async=True), weights + AdamW state, median of {saves} saves to local disk, dp "
          "ranks; async = copy to CPU memory + finish")
    print(f"{'model':<34} | {'params':>7} | {'ckpt MB':>7} | {'ranks':>5} | {'plain ms':>8} | "
          f"{'async ms':>8} | {'of which copy':>13} | {'background write ms':>19}")
    print("-" * 123)
    for kw in models or (MODEL, BIG):
        name = f"n_layer={kw['n_layer']} n_embd={kw['n_embd']} n_head={kw['n_head']}"
        for world in worlds:
            r = run_ranks(ckpt_worker, world, kw, saves)
            print(f"{name:<34} | {r['params_m']:6.1f}M | {r['ckpt_mb']:7.0f} | {world:>5} | "
                  f"{r['sync']:8.0f} | {r['async']:8.0f} | {r['copy']:13.0f} | "
                  f"{r['background']:19.0f}")
    print("plain: the whole write, the hashing and the manifest; async: the loop waits only for "
          "the copy of its state to CPU memory and for the finish (gathering the ranks' "
          "checksums, state.pt, meta.json, the manifest, the rename, `latest`); the write and the "
          "hashing run in a background thread while the loop trains (here it sleeps: with "
          "training the thread shares the cores)")
