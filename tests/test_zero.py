"""ZeRO stages 1 and 2 (zero.ZeroDataParallel + ZeroOptimizer) on real gloo processes:
the single-process curve through train.py (also under a pipeline), torch's
ZeroRedundancyOptimizer as a peer, the per-rank memory, an exact resume of a ZeRO run into
ZeRO (stage 1 -> 1 -> 2 -> 2) and into one process (moves to fsdp: test_fsdp.py's chain)."""

import os
import shutil

import pytest
import torch
from conftest import (INTERLEAVED, REFERENCE, assert_same_curve, read_metrics, run_train, spawn,
                      torchrun)
from torch.distributed.optim import ZeroRedundancyOptimizer

import checkpoint
import parallel
from model import ModelConfig, Transformer
from techniques import data_parallel
from techniques import zero

CFG = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)


# under a pipeline dp is half the world (4 ranks: dp=2 x pp=2): ZeRO averages over dp,
# not the world
@pytest.mark.parametrize("nproc, extra", [(2, ["zero=1"]), (2, ["zero=2", "offload=True"]),
                                          (4, ["zero=2"]), (4, ["zero=2", "pp=2", "offload=True"]),
                                          (4, ["zero=1", *INTERLEAVED, "offload=True"])],
                         ids=["zero1", "zero2-offload", "zero2-dp4", "zero2-pp2-offload",
                              "zero1-interleaved-offload"])
def test_zero_gives_the_single_process_curve(nproc, extra, dataset, reference_run, tmp_path):
    # the reference clips (grad_clip=0.5): the norm from the slices must be the whole model's
    assert max(r["grad_norm"] for r in reference_run if "grad_norm" in r) > 0.5
    out = str(tmp_path / "run")
    # REFERENCE has 4 micro-batches per iteration: no_sync accumulation at every layout here;
    # tiny buckets, so the slices cut across parameters and buckets
    p = torchrun(nproc,
                 [*REFERENCE, f"dataset={dataset}",
                  f"out_dir={out}", "ddp_bucket_mb=0.01", *extra],
                 cwd=tmp_path)
    assert (f"({extra[0]}: 1/{nproc // (2 if 'pp=2' in extra else 1)} of the "
            "optimizer") in p.stdout, p.stdout[-2000:]
    assert_same_curve(reference_run, read_metrics(out))


# 12 iterations whatever max_iters a leg stops at (the schedule's length is lr_decay_iters);
# tiny buckets, so each rank's slices cut across parameters
RESUME = [*REFERENCE, "lr_decay_iters=12", "ckpt_interval=100", "ddp_bucket_mb=0.01"]


@pytest.fixture(scope="module")
def zero_run(dataset, tmp_path_factory):
    """REFERENCE for 12 iterations at zero=1 on 2 ranks, uninterrupted: (out_dir, metrics).
    At 2 ranks zero=2 gives the same bits (a sum of two numbers has one order, and both
    stages step the same slices), so this one run is the reference for either stage."""
    out = str(tmp_path_factory.mktemp("zero_run") / "run")
    torchrun(2, [*RESUME, f"dataset={dataset}", f"out_dir={out}", "zero=1", "max_iters=12"],
             cwd=os.path.dirname(out))
    return out, read_metrics(out)


def final_weights(out_dir):
    return checkpoint.load_whole(os.path.join(out_dir, "ckpt", "iter_0000012"))[0].state_dict()


def test_zero_resumes_exactly_into_zero_and_moves_to_one_process(zero_run, dataset, tmp_path):
    """One out_dir, each leg resuming the last: zero=1 to 3, zero=1 to 6, zero=2 to 9, zero=2 to
    12 is the uninterrupted run bit for bit (losses, grad norms, val losses, final weights):
    every leg must reload the AdamW moments of its slices, saved whole, into the slices of
    the next layout. The checkpoint at 9, written by zero=2, continued by one process gives
    the same curve up to rounding (its moments read whole)."""
    out, one = str(tmp_path / "run"), str(tmp_path / "one")
    chain = [*RESUME, f"dataset={dataset}", f"out_dir={out}", "init_from=auto"]
    for stage, stop in ((1, 3), (1, 6), (2, 9)):
        torchrun(2, [*chain, f"zero={stage}", f"max_iters={stop}"], cwd=tmp_path)
    shutil.copytree(out, one)
    torchrun(2, [*chain, "zero=2", "max_iters=12"], cwd=tmp_path)
    ref_dir, ref = zero_run
    assert_same_curve(ref, read_metrics(out), exact=True)
    want, got = final_weights(ref_dir), final_weights(out)
    assert all(torch.equal(want[n], got[n]) for n in want), \
        [n for n in want if not torch.equal(want[n], got[n])]
    run_train([*RESUME, f"dataset={dataset}", f"out_dir={one}", "init_from=auto", "max_iters=12"],
              cwd=tmp_path, fork=True)
    assert_same_curve(ref, read_metrics(one))
    for n, t in final_weights(one).items():
        torch.testing.assert_close(t, want[n], rtol=1e-4, atol=1e-5, msg=n)


# The default optimizer on the sharded layouts: Muon's matrices are assembled whole from ZeRO's
# pieces and tp's slices, orthogonalized once and shared. grad_clip=0.3: Muon's gradient norms
# here are 0.36-0.48, so every step clips. Measured worst relative difference against one
# process: 8.4e-8 (zero=2, tp=2, fsdp; the same as AdamW's cells): the Newton-Schulz iteration
# amplifies a difference in the gradient's small singular values (up to ~3.4x a step, 5 steps),
# but float32 rounding of the mean gradient is far below what that could lift to 1e-5, so the
# Muon cells keep 1e-5.
MUON = [*REFERENCE, "optim=muon", "grad_clip=0.3"]


@pytest.fixture(scope="module")
def muon_reference(dataset, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("muon") / "one")
    run_train([*MUON, f"dataset={dataset}", f"out_dir={out}"], cwd=os.path.dirname(out), fork=True)
    return read_metrics(out)


@pytest.mark.parametrize("nproc, extra", [(2, ["zero=2"]), (2, ["tp=2"])])
def test_muon_on_sharded_layouts_gives_the_single_process_curve(
        nproc, extra, dataset, muon_reference, tmp_path):
    # every step clips
    assert min(r["grad_norm"] for r in muon_reference if "grad_norm" in r) > 0.3
    out = str(tmp_path / "run")
    torchrun(nproc, [*MUON, f"dataset={dataset}", f"out_dir={out}", "ddp_bucket_mb=0.01", *extra],
             cwd=tmp_path)
    assert_same_curve(muon_reference, read_metrics(out), rtol=1e-5)


def test_muon_moves_through_the_2d_layouts(dataset, muon_reference, tmp_path):
    """One out_dir through zero=2 x tp=2 -> fsdp x tp=2 -> one process, each leg resuming the
    last (whole momentum buffers, gathered from ZeRO pieces, tp slices and FSDP shards, and
    cut again): the single-process Muon curve."""
    out = str(tmp_path / "run")
    chain = [*[a for a in MUON if not a.startswith("max_iters=")], f"dataset={dataset}",
             f"out_dir={out}", "lr_decay_iters=8", "ddp_bucket_mb=0.01", "keep_ckpts=0"]
    p = torchrun(4, [*chain, "max_iters=3", "zero=2", "tp=2"], cwd=tmp_path)
    assert ("dp=2 x pp=1 x tp=2" in p.stdout
            and "(zero=2: 1/2 of the optimizer and grads) (tp:" in p.stdout)
    p = torchrun(4, [*chain, "max_iters=6", "fsdp=True", "tp=2"], cwd=tmp_path)
    assert "(fsdp: 1/2 of each) (tp:" in p.stdout
    run_train([*chain, "max_iters=8"], cwd=tmp_path, fork=True)
    assert_same_curve(muon_reference, read_metrics(out), rtol=1e-5)


def batch(rank, step):
    return torch.randint(0, 64, (2, 2, 17),
                         generator=torch.Generator().manual_seed(100 * step + rank))


def three_steps(mesh, kind):
    """Three AdamW steps (weight decay on 2-D weights only, clipping that clips) on this
    rank's two micro-batches, accumulated without sync; returns the weights, and after each
    step the names of the parameters it left unchanged. kind: torch_zero, zero1, zero2 or
    zero2_offload (the state stepped in separate CPU memory, then copied into the weights)."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**CFG))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    groups = [{"params": decay, "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    if kind == "torch_zero":  # torch's ZeRO-1 over our all-reduce: the peer
        ddp = data_parallel.DataParallel(model, mesh, 0.002)
        opt = ZeroRedundancyOptimizer(decay, optimizer_class=torch.optim.AdamW, lr=1e-2,
                                      weight_decay=0.1, process_group=mesh.dp_group)
        opt.add_param_group(groups[1])
    else:
        ddp = zero.ZeroDataParallel(model, mesh, 0.002, stage=int(kind[4]))
        opt = zero.ZeroOptimizer(ddp, groups, offload=kind.endswith("offload"), lr=1e-2)
    norms, unchanged = [], []
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        x = batch(mesh.dp_rank, step)
        for k in range(2):
            ddp.require_backward_grad_sync = k == 1
            (ddp(x[k, :, :-1], x[k, :, 1:])[1] / (2 * mesh.dp)).backward()
        ddp.wait()
        params = opt.params if kind != "torch_zero" else list(model.parameters())
        norms.append(
            parallel.clip_grad_norm_(params, 0.5, mesh, sharded=kind != "torch_zero").item())
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        unchanged.append([n for n, p in model.named_parameters() if torch.equal(p, before[n])])
    return {"norms": norms, "unchanged": unchanged,
            **{n: p.detach().clone() for n, p in model.named_parameters()}}


def all_kinds(mesh):
    return {kind: three_steps(mesh, kind)
            for kind in ("torch_zero", "zero1", "zero2", "zero2_offload")}


def test_stage1_and_2_match_torch_zero_redundancy_optimizer():
    for rank in spawn(all_kinds, 2):
        peer = rank["torch_zero"]
        for kind in ("zero1", "zero2", "zero2_offload"):
            # every step moved every weight on every rank
            assert rank[kind]["unchanged"] == [[], [], []], kind
            for n in peer:
                torch.testing.assert_close(rank[kind][n], peer[n], rtol=1e-5, atol=1e-6,
                                           msg=f"{kind} {n}")
        # offload steps copies in CPU memory (on a CPU device too) and copies them back:
        # the same bits
        assert all(torch.equal(rank["zero2_offload"][n], rank["zero2"][n]) for n in peer
                   if "." in n)
        # it did train
        assert not torch.equal(peer["norm.weight"], torch.ones_like(peer["norm.weight"]))
        assert min(peer["norms"]) > 0.5  # and every step clipped


def one_step_memory(mesh, stage):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**CFG))
    if stage:
        ddp = zero.ZeroDataParallel(model, mesh, 0.01, stage)
        opt = zero.ZeroOptimizer(ddp, [{"params": list(model.parameters())}], lr=1e-3)
    else:
        ddp, opt = model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(mesh.rank))
    ddp(x[:, :-1], x[:, 1:])[1].backward()
    if stage:
        ddp.wait()
    opt.step()
    return parallel.memory_bytes(model, opt)


def memory_at(mesh):
    return {stage: one_step_memory(mesh, stage) for stage in (1, 2)}


@pytest.mark.parametrize("n", [2, 4])
def test_zero_holds_one_nth_per_rank(n):
    full = spawn(one_step_memory, 1, 0)[0]
    for rank in spawn(memory_at, n):
        one, two = rank[1], rank[2]
        assert (one["params"] == two["params"] == full["params"]
                and one["grads"] == full["grads"]), (one, two, full)
        assert 0 < one["optimizer"] <= full["optimizer"] / n * 1.10, (one, full)
        assert (0 < two["grads"] + two["optimizer"]
                <= (full["grads"] + full["optimizer"]) / n * 1.10), (two, full)
        # its chunks, counted
        assert full["grads"] / n <= two["grads"] <= full["grads"] / n * 1.10, (two, full)
