"""Data parallel on real gloo processes: the hand-written versions against the single-process
run and against torch's DistributedDataParallel, then train.py under torchrun end to end."""

import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import nullcontext

import pytest
import torch
import torch.nn as nn
from conftest import (
    CFG,
    REFERENCE,
    ROOT,
    TINY,
    assert_same_curve,
    free_port,
    read_metrics,
    run_train,
    spawn,
    torchrun,
)
from torch.nn.parallel import DistributedDataParallel

import data_parallel

from model import ModelConfig, Transformer


def global_batch(n_micro):
    """n_micro micro-batches of 2 sequences: (n_micro, 2, block_size + 1)."""
    return torch.randint(0, 64, (n_micro, 2, 17), generator=torch.Generator().manual_seed(0))


def single_process_grads(n_micro):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**CFG))
    data = global_batch(n_micro)
    for k in range(n_micro):
        _, loss = model(data[k, :, :-1], data[k, :, 1:])
        (loss / n_micro).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def wrap(model, mesh, impl, bucket_mb, **torch_kwargs):
    if impl == "torch":
        return DistributedDataParallel(model, bucket_cap_mb=bucket_mb, **torch_kwargs)
    return data_parallel.NaiveDataParallel(model, mesh) if impl == "naive" else data_parallel.DataParallel(model, mesh, bucket_mb)


def dp_step(mesh, impl, n_micro, bucket_mb, use_no_sync=False):
    """One optimizer step's gradient under data parallelism: this rank's share of the
    micro-batches, sync only on the last one (the way train.py does it: the flag, or
    no_sync() around the earlier micro-steps)."""
    torch.manual_seed(0 if mesh.rank == 0 else 123)  # other ranks start wrong: the wrapper must broadcast
    model = Transformer(ModelConfig(**CFG))
    ddp = wrap(model, mesh, impl, bucket_mb)
    k_per = n_micro // mesh.dp
    mine = global_batch(n_micro)[mesh.dp_rank * k_per:(mesh.dp_rank + 1) * k_per]
    in_flight = []  # all-reduces already launched when the embedding's gradient (the last one) arrives
    if impl == "bucketed":
        model.tok_embeddings.weight.register_hook(lambda g: in_flight.append(len(ddp.pending)))
    for k in range(k_per):
        if not use_no_sync:
            ddp.require_backward_grad_sync = k == k_per - 1
        with ddp.no_sync() if use_no_sync and k < k_per - 1 else nullcontext():
            _, loss = ddp(mine[k, :, :-1], mine[k, :, 1:])
            (loss / k_per).backward()
    if impl != "torch":
        ddp.wait()
    out = {"grads": {n: p.grad.clone() for n, p in model.named_parameters()}}
    if impl != "torch":
        names = {p: n for n, p in model.named_parameters()}
        buckets = getattr(ddp, "buckets", [])
        out.update(launches=ddp.launches, n_buckets=len(buckets), n_params=len(ddp.params), in_flight=in_flight,
                   first_bucket=[names[p] for p in buckets[0].params] if buckets else [])
    return out


def all_impls(mesh, n_micro, bucket_mb):
    return {impl: dp_step(mesh, impl, n_micro, bucket_mb) for impl in ("naive", "bucketed", "torch")}


def test_dp_gradients_equal_single_process_and_torch_ddp():
    ranks = spawn(all_impls, 2, 2, 0.002)  # 2 ranks, one micro-batch each, ~500-float buckets
    ref = single_process_grads(2)
    for impl in ("naive", "bucketed", "torch"):
        for rank in ranks:
            for name, g in ref.items():
                torch.testing.assert_close(rank[impl]["grads"][name], g, msg=f"{impl} {name}")
        for name in ref:  # ours against torch's DDP directly, and every rank the same
            torch.testing.assert_close(ranks[0][impl]["grads"][name], ranks[0]["torch"]["grads"][name])
            torch.testing.assert_close(ranks[1][impl]["grads"][name], ranks[0][impl]["grads"][name], rtol=0, atol=0)


def no_sync_steps(mesh, n_micro, bucket_mb):
    out = {f"{impl}{how}": dp_step(mesh, impl, n_micro, bucket_mb, use_no_sync=how == "_no_sync")
           for impl in ("bucketed", "naive") for how in ("", "_no_sync")}
    # forgetting no_sync on the earlier micro-steps is caught, not silently wrong
    model = data_parallel.DataParallel(Transformer(ModelConfig(**CFG)), mesh, bucket_mb)
    data = global_batch(2)
    try:
        for k in range(2):
            model(data[k, :, :-1], data[k, :, 1:])[1].backward()
        out["twice"] = ""
    except RuntimeError as e:
        out["twice"] = str(e)
    return out


def test_no_sync_accumulation_equals_one_big_step_and_launches_once_per_bucket():
    ranks = spawn(no_sync_steps, 2, 8, 0.005)  # 4 micro-steps per rank
    ref = single_process_grads(8)
    for rank in ranks:
        for impl in ("bucketed", "naive"):
            for name, g in ref.items():
                torch.testing.assert_close(rank[impl]["grads"][name], g, msg=f"{impl} {name}")
                # the no_sync() context is the flag: the same gradients, bit for bit
                torch.testing.assert_close(rank[impl + "_no_sync"]["grads"][name], rank[impl]["grads"][name],
                                           rtol=0, atol=0, msg=f"{impl} no_sync {name}")
            assert rank[impl + "_no_sync"]["launches"] == rank[impl]["launches"]
        b = rank["bucketed"]
        assert b["n_buckets"] > 3
        assert b["launches"] == b["n_buckets"]  # once per bucket per optimizer step, not per micro-step
        assert rank["naive"]["launches"] == rank["naive"]["n_params"]
        assert b["first_bucket"][0] == "output.weight"  # reverse order of use: the head's gradient comes first
        # overlap: only the last backward communicates, and it had launched all buckets but the
        # embedding's before the embedding's gradient was computed
        assert b["in_flight"] == [0, 0, 0, b["n_buckets"] - 1]
        assert "gradient sync ran twice" in rank["twice"]


class Branchy(nn.Module):
    """Small layers whose use varies: `extra` runs only when asked, `never` never runs, and
    `frozen` runs but is not trained. `never` is registered first, so it is the last bucket."""

    def __init__(self):
        super().__init__()
        self.never, self.a, self.extra, self.b = (nn.Linear(8, 8) for _ in range(4))
        self.frozen = nn.Linear(8, 8).requires_grad_(False)

    def forward(self, x, use_extra):
        h = self.a(x).tanh()
        if use_extra:
            h = self.extra(h).tanh()
        return self.frozen(self.b(h)).square().mean()


# per optimizer step, per rank: does each micro-step use `extra`? Step 0: rank 1 skips it.
# Step 1: rank 1 uses it only in its first micro-step (under no_sync), so it has a gradient
# that its last backward does not complete.
BRANCHY_PLAN = [[[True], [False]], [[True, True], [True, False]]]


def branchy_input(step, rank, k):
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + 10 * rank + k))


def branchy_reference():
    """The mean over both ranks' losses in one process: what data parallelism must give."""
    torch.manual_seed(0)
    model, out = Branchy(), []
    for step, plan in enumerate(BRANCHY_PLAN):
        model.zero_grad(set_to_none=True)
        for rank, uses in enumerate(plan):
            for k, use in enumerate(uses):
                (model(branchy_input(step, rank, k), use) / (len(uses) * len(plan))).backward()
        out.append({n: p.grad for n, p in model.named_parameters()})
    return out


def branchy_steps(mesh):
    out = {}
    for impl in ("naive", "bucketed", "torch"):
        torch.manual_seed(0)
        model = Branchy()
        ddp = wrap(model, mesh, impl, 0, find_unused_parameters=True)  # bucket_mb=0: one parameter per bucket
        order = []  # bucket indices in the order they were launched
        if impl == "bucketed":
            launch = ddp._launch
            ddp._launch = lambda bucket: (order.append(ddp.buckets.index(bucket)), launch(bucket))
        steps = []
        for step, plan in enumerate(BRANCHY_PLAN):
            model.zero_grad(set_to_none=True)
            uses = plan[mesh.dp_rank]
            for k, use in enumerate(uses):
                with ddp.no_sync() if k < len(uses) - 1 else nullcontext():
                    (ddp(branchy_input(step, mesh.dp_rank, k), use) / len(uses)).backward()
            in_backward = list(order)
            if impl != "torch":
                ddp.wait()
            steps.append({"grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
                          "in_backward": in_backward, "order": list(order)})
            order.clear()
        out[impl] = steps
        if impl != "torch":
            names = {p: n for n, p in model.named_parameters()}
            out[impl + "_params"] = [names[p] for p in ddp.params]
    return out


def test_unused_parameters_and_fixed_bucket_order():
    ranks = spawn(branchy_steps, 2)
    ref = branchy_reference()
    for rank in ranks:
        for impl in ("naive", "bucketed", "torch"):
            for step, r in enumerate(ref):
                for name, g in r.items():
                    mine = rank[impl][step]["grads"][name]
                    if g is None:  # `never`, unused on every rank, and `frozen`: no gradient, so AdamW skips them
                        assert mine is None, f"{impl} step {step} {name}"
                    else:  # `extra` on the rank that skipped it: the mean of the other rank's gradient and zero
                        torch.testing.assert_close(mine, g, msg=f"{impl} step {step} {name}")
        for impl in ("naive", "bucketed"):
            assert "frozen.weight" not in rank[impl + "_params"] and "never.weight" in rank[impl + "_params"]
    assert ref[0]["extra.weight"] is not None and ref[0]["never.weight"] is None and ref[0]["frozen.weight"] is None
    # buckets: b.bias, b.weight, extra.bias, extra.weight, a.bias, a.weight, never.bias, never.weight.
    # Every rank launches them in this order. Rank 0 launches 0-5 during backward; on rank 1
    # extra's buckets (2, 3) never complete in the last backward, so a's (4, 5) wait in line
    # behind them and all go in wait(), in order.
    for step in range(2):
        for rank, launched_in_backward in zip(ranks, ([0, 1, 2, 3, 4, 5], [0, 1])):
            assert rank["bucketed"][step]["order"] == list(range(8)), step
            assert rank["bucketed"][step]["in_backward"] == launched_in_backward, step


# one run per implementation (their gradients are compared in-process above); compile=True is
# checked under tp (test_tp.py) and fsdp x pp (test_fsdp.py)
@pytest.mark.parametrize("nproc, impl, extra", [(2, "bucketed", []), (2, "torch", []), (4, "naive", [])])
def test_torchrun_gives_the_single_process_curve(nproc, impl, extra, dataset, reference_run, tmp_path):
    out = str(tmp_path / "run")
    p = torchrun(nproc, [*REFERENCE, f"dataset={dataset}", f"out_dir={out}", f"ddp_impl={impl}", "ddp_bucket_mb=0.01",
                         *extra], cwd=tmp_path)
    assert f"dp={nproc} x pp=1" in p.stdout
    assert_same_curve(reference_run, read_metrics(out), rtol=1e-3 if extra else 3e-4)


def test_resume_at_two_ranks_is_exact_and_moves_to_one(dataset, tmp_path):
    # with Muon: its momentum buffers are checkpointed too, and every rank orthogonalizes the same mean gradient
    common = [*TINY, f"dataset={dataset}", "lr_decay_iters=12", "ckpt_interval=100", "ddp_bucket_mb=0.01", "optim=muon"]
    full, half, one = str(tmp_path / "full"), str(tmp_path / "half"), str(tmp_path / "one")
    torchrun(2, [*common, f"out_dir={full}", "max_iters=12"], cwd=tmp_path)
    torchrun(2, [*common, f"out_dir={half}", "max_iters=6"], cwd=tmp_path)
    shutil.copytree(half, one)  # the same checkpoint, continued by one process below
    torchrun(2, [*common, f"out_dir={half}", "max_iters=12", "init_from=resume"], cwd=tmp_path)
    assert_same_curve(read_metrics(full), read_metrics(half), exact=True)
    run_train([*common, f"out_dir={one}", "max_iters=12", "init_from=resume"], cwd=tmp_path)
    assert_same_curve(read_metrics(full), read_metrics(one))


def test_resuming_into_more_dp_ranks_gives_each_its_own_random_stream(dataset, tmp_path):
    """tp=2 saves one stream (its two ranks share it); resumed at dp=2, rank 1 has none of its
    own and must start a fresh one (from seed, rank, iteration), not continue rank 0's:
    the next checkpoint's two streams differ (dropout on, so they are used)."""
    import checkpoint
    out = str(tmp_path / "run")
    common = [*TINY, f"dataset={dataset}", f"out_dir={out}", "dropout=0.1", "keep_ckpts=0"]
    torchrun(2, [*common, "max_iters=2", "tp=2"], cwd=tmp_path)
    torchrun(2, [*common, "max_iters=3"], cwd=tmp_path)
    _, state = checkpoint.read_meta(os.path.join(out, "ckpt", "iter_0000003"))
    assert len(state["rng_cpu"]) == 2 and not torch.equal(state["rng_cpu"][0], state["rng_cpu"][1])


def test_a_layout_error_under_torchrun_is_one_line(dataset, tmp_path):
    # the other layout mistakes are checked in-process (test_train.py: MISTAKES); this one
    # goes through torchrun, whose rank-prefixing of stderr must not hide the line
    p = torchrun(2, [*TINY, f"dataset={dataset}", "grad_accum_steps=3", "max_iters=2"], cwd=tmp_path, check=False)
    assert p.returncode != 0 and "error: grad_accum_steps=3 micro-batches per iteration cannot be shared evenly by 2" \
        in p.stderr  # (torchrun itself then prints its own summary of the failed workers)


@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_a_dead_or_hung_rank_ends_the_run_within_the_timeout(fault, dataset, tmp_path):
    """Two ranks started by hand (no torchrun to clean up): rank 1 is killed, or frozen with
    SIGSTOP, mid-run. Rank 0 must exit with an error naming the timeout key, not hang."""
    port, timeout_s = free_port(), 10
    out = str(tmp_path / "run")
    procs = []
    for rank in range(2):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"}
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "train.py"), *TINY, f"dataset={dataset}", f"out_dir={out}",
             "max_iters=100000", f"dist_timeout_s={timeout_s}", "eval_interval=1000"],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        deadline = time.time() + 120
        while not (os.path.exists(os.path.join(out, "metrics.jsonl")) and len(read_metrics(out)) > 3):
            assert time.time() < deadline and procs[0].poll() is None, "the run did not start"
            time.sleep(0.2)
        os.kill(procs[1].pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        t0 = time.time()
        _, err = procs[0].communicate(timeout=timeout_s + 60)
        assert procs[0].returncode != 0
        assert time.time() - t0 < timeout_s + 30
        assert "dist_timeout_s" in err.strip().splitlines()[-1], err[-2000:]
    finally:
        for p in procs:
            p.kill()
            p.wait()


KEEP_FREED = """
import sys, torch, workarounds
from model import ModelConfig, Transformer
faults = lambda: int(open("/proc/self/stat").read().split()[9])  # minor page faults so far
if sys.argv[1] == "keep":
    assert workarounds.keep_freed_memory()
torch.set_num_threads(1)
model = Transformer(ModelConfig(vocab_size=8192, block_size=128, n_layer=1, n_head=2, n_kv_head=2, n_embd=32))
x = torch.randint(0, 8192, (4, 128))  # logits and their gradients: 16 MB each
for i in range(12):
    if i == 2:  # two warm-up steps
        start = faults()
    model(x, x)[1].backward()
print(faults() - start)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="keep_freed_memory sets glibc's malloc options")
def test_keep_freed_memory_cuts_the_page_faults_of_each_step():
    # without it a step's 16 MB tensors are often fresh mmaps whose 4 KB pages fault in one by one
    # (measured 57k-115k faults over 10 steps here, 5k-13k with it)
    faults = {}
    for mode in ("plain", "keep"):
        p = subprocess.run([sys.executable, "-c", KEEP_FREED, mode], cwd=ROOT, capture_output=True, text=True,
                           check=True, env={**os.environ, "PYTHONPATH": ROOT})
        faults[mode] = int(p.stdout)
    assert faults["plain"] > 10 * 2000 and faults["keep"] * 4 < faults["plain"], faults
