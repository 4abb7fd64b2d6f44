"""Data parallel on real gloo processes: the hand-written versions against the single-process
run and against torch's DistributedDataParallel; global-norm clipping (parallel.clip_grad_norm_)
against torch.nn.utils.clip_grad_norm_ on whole, replicated, FSDP, ZeRO, tensor-parallel and
pipeline-stage gradients; then train.py under torchrun end to end."""

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
    INTERLEAVED,
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

import parallel
from model import ModelConfig, Transformer
from guards import guard_ckpt
from techniques import data_parallel
from techniques import fsdp
from techniques import tensor_parallel
from techniques import zero


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
    if impl == "torch":  # with the comm hook train.py gives it: gradients summed, not averaged
        ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_mb, **torch_kwargs)
        ddp.register_comm_hook(mesh.dp_group, data_parallel.sum_hook)
        return ddp
    return (data_parallel.NaiveDataParallel(model, mesh) if impl == "naive"
            else data_parallel.DataParallel(model, mesh, bucket_mb))


def dp_step(mesh, impl, n_micro, bucket_mb, use_no_sync=False):
    """One optimizer step's gradient under data parallelism: this rank's share of the
    micro-batches, sync only on the last one (the way train.py does it: the flag, or
    no_sync() around the earlier micro-steps)."""
    # other ranks start wrong: the wrapper must broadcast
    model = Transformer(ModelConfig(**CFG), seed=0 if mesh.rank == 0 else 123)
    ddp = wrap(model, mesh, impl, bucket_mb)
    k_per = n_micro // mesh.dp
    mine = global_batch(n_micro)[mesh.dp_rank * k_per:(mesh.dp_rank + 1) * k_per]
    # all-reduces already launched when the embedding's gradient (the last one) arrives
    in_flight = []
    if impl == "bucketed":
        model.tok_embeddings.weight.register_hook(lambda g: in_flight.append(len(ddp.pending)))
    for k in range(k_per):
        if not use_no_sync:
            ddp.require_backward_grad_sync = k == k_per - 1
        with ddp.no_sync() if use_no_sync and k < k_per - 1 else nullcontext():
            _, loss = ddp(mine[k, :, :-1], mine[k, :, 1:])
            (loss / n_micro).backward()  # the loop's token weights: the sum is the mean
    if impl != "torch":
        ddp.wait()
    out = {"grads": {n: p.grad.clone() for n, p in model.named_parameters()}}
    if impl != "torch":
        names = {p: n for n, p in model.named_parameters()}
        buckets = getattr(ddp, "buckets", [])
        out.update(launches=ddp.launches, n_buckets=len(buckets),
                   n_params=len(ddp.params), in_flight=in_flight,
                   first_bucket=[names[p] for p in buckets[0].params] if buckets else [])
    return out


def all_impls(mesh, n_micro, bucket_mb):
    return {impl: dp_step(mesh, impl, n_micro, bucket_mb)
            for impl in ("naive", "bucketed", "torch")}


def test_dp_gradients_equal_single_process_and_torch_ddp():
    ranks = spawn(all_impls, 2, 2, 0.002)  # 2 ranks, one micro-batch each, ~500-float buckets
    ref = single_process_grads(2)
    for impl in ("naive", "bucketed", "torch"):
        for rank in ranks:
            for name, g in ref.items():
                torch.testing.assert_close(rank[impl]["grads"][name], g, msg=f"{impl} {name}")
        for name in ref:  # ours against torch's DDP directly, and every rank the same
            torch.testing.assert_close(ranks[0][impl]["grads"][name],
                                       ranks[0]["torch"]["grads"][name])
            torch.testing.assert_close(ranks[1][impl]["grads"][name],
                                       ranks[0][impl]["grads"][name], rtol=0, atol=0)


# ---- clipping against torch.nn.utils.clip_grad_norm_ ----
# The peer shares none of our code: torch's clip on the whole model's gradients in one process.
# Ours must give its norm and its clipped gradients whatever holds the gradients: one process,
# replicas, FSDP shards, ZeRO slices (stage 1: views of whole gradients; stage 2: reduced
# chunks), tensor-parallel slices with replicated norm gains, pipeline stages. Two max_norms:
# half the norm (clips) and twice it (must leave the gradients alone: never scale them up).
CLIP_CFG = dict(CFG, ffn_dim=64)  # tp=2 cuts the SwiGLU width in two


def clip_batch():
    data = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(7))
    return data[:, :-1], data[:, 1:]


def clip_model_grads(model, rows=slice(None)):
    """Backward of the mean loss over `rows` of clip_batch weighted by their share of its rows, as
    the loop weighs a rank's micro-batches (all: the whole model's gradient)."""
    x, y = clip_batch()
    (model(x[rows], y[rows])[1] * (x[rows].shape[0] / x.shape[0])).backward()
    return model


def torch_clipped(max_norm):
    """(total norm, {name: clipped gradient}) from torch's clip on the single-process gradients."""
    torch.manual_seed(0)
    model = clip_model_grads(Transformer(ModelConfig(**CLIP_CFG)))
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm, {n: p.grad for n, p in model.named_parameters()}


def clip_max_norms():
    # max_norm=0: torch scales everything to zero; we only need its norm
    norm = torch_clipped(0.0)[0].item()
    return [norm / 2, norm * 2]


def assert_clipped_like_torch(norm, grads, max_norm, what):
    want_norm, want = torch_clipped(max_norm)
    torch.testing.assert_close(torch.as_tensor(norm), want_norm, rtol=1e-5, atol=0,
                               msg=f"{what}: norm")
    assert set(grads) == set(want), what
    for n, g in want.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-7,
                                   msg=f"{what} at max_norm={max_norm:.3g}: {n}")


def test_clipping_equals_torch_in_one_process():
    mesh = parallel.setup("cpu")
    for max_norm in clip_max_norms():
        torch.manual_seed(0)
        model = clip_model_grads(Transformer(ModelConfig(**CLIP_CFG)))
        norm = parallel.clip_grad_norm_(model.parameters(), max_norm, mesh)
        assert_clipped_like_torch(norm, {n: p.grad for n, p in model.named_parameters()}, max_norm,
                                  "one process")


def clip_over_dp(mesh, max_norms):
    """This rank's clipped gradients under each data-parallel kind, each rank on half the batch:
    {kind: [(norm, gradients) per max_norm]}: replicas and FSDP give every whole gradient
    (FSDP's gathered), ZeRO this rank's slices as {name: [(start, flat piece)]}."""
    rows = slice(2 * mesh.dp_rank, 2 * mesh.dp_rank + 2)
    out = {}
    for kind in ("dp", "fsdp", "zero1", "zero2"):
        out[kind] = []
        for max_norm in max_norms:
            torch.manual_seed(0)
            model = Transformer(ModelConfig(**CLIP_CFG))
            names = {p: n for n, p in model.named_parameters()}
            if kind == "dp":  # replicas: every rank holds the whole mean gradient, counted once
                clip_model_grads(data_parallel.DataParallel(model, mesh, 0.002), rows).wait()
                norm = parallel.clip_grad_norm_(model.parameters(), max_norm, mesh)
                grads = {n: p.grad for n, p in model.named_parameters()}
            elif kind == "fsdp":
                clip_model_grads(fsdp.fully_shard_model(model, mesh), rows)
                norm = parallel.clip_grad_norm_(model.parameters(), max_norm, mesh)
                grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            else:
                ddp = zero.ZeroDataParallel(model, mesh, 0.002, stage=int(kind[-1]))
                clip_model_grads(ddp, rows).wait()
                opt = zero.ZeroOptimizer(ddp, [{"params": list(model.parameters())}], lr=1e-3)
                norm = parallel.clip_grad_norm_(opt.params, max_norm, mesh, sharded=True)
                grads = {}
                for s in ddp.shards:
                    grads.setdefault(names[s.param], []).append((s.start, s.tensor.grad.clone()))
            out[kind].append((norm, grads))
    return out


def clip_over_tp_and_pp(mesh, max_norms):
    """tp=2 x pp=2: each rank clips the tensor-parallel slices of its stage's parameters (the
    whole model's backward runs on every rank; the stages split its parameters as a pipeline
    does: the embedding and layer 0, then layer 1, the norm and the head).
    [(norm, {name: (gradient slice, the dimension it is cut along or None)}) per max_norm]"""
    out = []
    for max_norm in max_norms:
        torch.manual_seed(0)
        model = clip_model_grads(
            tensor_parallel.tensor_parallel(Transformer(ModelConfig(**CLIP_CFG)), mesh))
        mine = {n: p for n, p in model.named_parameters()
                if n.startswith(("tok_embeddings.", "layers.0.")) == mesh.first_stage}
        norm = parallel.clip_grad_norm_(mine.values(), max_norm, mesh)
        out.append((norm, {n: (p.grad, getattr(p, "_split_dim", None)) for n, p in mine.items()}))
    return out


def zero_gathered(ranks, shapes):
    """Whole gradients from every rank's ZeRO slices;
    each element must come from exactly one slice."""
    out = {}
    for n, shape in shapes.items():
        flat, count = torch.zeros(shape).view(-1), torch.zeros(shape.numel())
        for pieces in ranks:
            for start, g in pieces.get(n, []):
                flat[start:start + g.numel()] += g
                count[start:start + g.numel()] += 1
        assert (count == 1).all(), n
        out[n] = flat.view(shape)
    return out


def test_clipping_sharded_gradients_equals_torch_on_the_whole():
    max_norms = clip_max_norms()
    shapes = {n: g.shape for n, g in torch_clipped(0.0)[1].items()}
    dp_ranks = spawn(clip_over_dp, 2, max_norms)
    tp_pp_ranks = spawn(clip_over_tp_and_pp, 4, max_norms, pp=2, tp=2)
    for k, max_norm in enumerate(max_norms):
        for kind in ("dp", "fsdp"):
            for r, rank in enumerate(dp_ranks):
                assert_clipped_like_torch(*rank[kind][k], max_norm, f"{kind} rank {r}")
        for kind in ("zero1", "zero2"):
            for r, rank in enumerate(dp_ranks):
                torch.testing.assert_close(rank[kind][k][0], dp_ranks[0][kind][k][0],
                                           rtol=0, atol=0)
            assert_clipped_like_torch(
                dp_ranks[0][kind][k][0],
                zero_gathered([rank[kind][k][1] for rank in dp_ranks], shapes), max_norm, kind)
        # ranks (stage 0: tp 0, 1; stage 1: tp 0, 1): a stage's tp slices concatenated, its
        # replicated gains from tp 0
        grads = {}
        for stage in (0, 1):
            (norm0, part0), (norm1, part1) = (tp_pp_ranks[2 * stage][k],
                                              tp_pp_ranks[2 * stage + 1][k])
            for n, (g, dim) in part0.items():
                grads[n] = g if dim is None else torch.cat([g, part1[n][0]], dim)
                if dim is None:  # a replicated gain holds the same gradient on both tp ranks
                    torch.testing.assert_close(part1[n][0], g, rtol=0, atol=0)
        for r, rank in enumerate(tp_pp_ranks):
            assert_clipped_like_torch(rank[k][0], grads, max_norm,
                                      f"tp=2 x pp=2 (norm of rank {r})")

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
                torch.testing.assert_close(rank[impl + "_no_sync"]["grads"][name],
                                           rank[impl]["grads"][name],
                                           rtol=0, atol=0, msg=f"{impl} no_sync {name}")
            assert rank[impl + "_no_sync"]["launches"] == rank[impl]["launches"]
        b = rank["bucketed"]
        assert b["n_buckets"] > 3
        # once per bucket per optimizer step, not per micro-step
        assert b["launches"] == b["n_buckets"]
        assert rank["naive"]["launches"] == rank["naive"]["n_params"]
        # reverse order of use: the head's gradient comes first
        assert b["first_bucket"][0] == "output.weight"
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
        # bucket_mb=0: one parameter per bucket
        ddp = wrap(model, mesh, impl, 0, find_unused_parameters=True)
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
                    (ddp(branchy_input(step, mesh.dp_rank, k), use)
                     / (len(uses) * mesh.dp)).backward()
            in_backward = list(order)
            if impl != "torch":
                ddp.wait()
            steps.append({"grads": {n: None if p.grad is None else p.grad.clone()
                                    for n, p in model.named_parameters()},
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
                    # `never`, unused on every rank, and `frozen`: no gradient, so AdamW skips them
                    if g is None:
                        assert mine is None, f"{impl} step {step} {name}"
                    else:
                        # `extra` on the rank that skipped it: the mean of the other
                        # rank's gradient and zero
                        torch.testing.assert_close(mine, g, msg=f"{impl} step {step} {name}")
        for impl in ("naive", "bucketed"):
            assert ("frozen.weight" not in rank[impl + "_params"]
                    and "never.weight" in rank[impl + "_params"])
    assert (ref[0]["extra.weight"] is not None and ref[0]["never.weight"] is None
            and ref[0]["frozen.weight"] is None)
    # buckets: b.bias, b.weight, extra.bias, extra.weight, a.bias, a.weight, never.bias,
    # never.weight. Every rank launches them in this order. Rank 0 launches 0-5 during backward; on
    # rank 1 extra's buckets (2, 3) never complete in the last backward, so a's (4, 5) wait in line
    # behind them and all go in wait(), in order.
    for step in range(2):
        for rank, launched_in_backward in zip(ranks, ([0, 1, 2, 3, 4, 5], [0, 1])):
            assert rank["bucketed"][step]["order"] == list(range(8)), step
            assert rank["bucketed"][step]["in_backward"] == launched_in_backward, step


# one run per implementation (their gradients are compared in-process above), each at dp=2 beside
# another layout train.py accepts with it: torch DDP around tensor-parallel blocks, naive under the
# interleaved pipeline; compile=True is checked under tp (test_tp.py) and fsdp x pp (test_fsdp.py)
@pytest.mark.parametrize("nproc, impl, extra, layout", [(2, "bucketed", [], "dp=2 x pp=1"),
                                                        (4, "torch", ["tp=2"],
                                                         "dp=2 x pp=1 x tp=2"),
                                                        (4, "naive", INTERLEAVED, "dp=2 x pp=2")],
                         ids=["bucketed", "torch-tp2", "naive-interleaved"])
def test_torchrun_gives_the_single_process_curve(nproc, impl, extra, layout, dataset,
                                                 reference_run, tmp_path):
    out = str(tmp_path / "run")
    p = torchrun(nproc,
                 [*REFERENCE, f"dataset={dataset}", f"out_dir={out}", f"ddp_impl={impl}",
                  "ddp_bucket_mb=0.01", *extra], cwd=tmp_path)
    assert layout in p.stdout, p.stdout[-2000:]
    rows = read_metrics(out)
    assert_same_curve(reference_run, rows)
    # MFU: the whole model's FLOPs at the logged token rate, against the peak of every rank
    # (TINY's peak_flops=1e9 each); tok/s counts the global batch
    with torch.device("meta"):
        flops = Transformer(ModelConfig(vocab_size=512, block_size=32, n_layer=4, n_head=4,
                                        n_kv_head=2, n_embd=32)).flops_per_token()
    for r in (r for r in rows if "mfu" in r):
        assert r["mfu"] == pytest.approx(flops * r["tok_per_s"] / (1e9 * nproc), rel=1e-6), r
        # 4 x 4 x 32 tokens
        assert r["tok_per_s"] == pytest.approx(4 * 4 * 32 / (r["dt_ms"] / 1000), rel=1e-6), r


@pytest.fixture(scope="module")
def tied_run(dataset, tmp_path_factory):
    """optim -> one process's metrics for REFERENCE with the head tied to the embedding
    (on demand)."""
    runs = {}

    def get(optim):
        if optim not in runs:
            out = str(tmp_path_factory.mktemp("tied") / "run")
            run_train([*REFERENCE, f"dataset={dataset}", f"out_dir={out}",
                       "tie_embeddings=True", f"optim={optim}"],
                      cwd=os.path.dirname(out), fork=True)
            runs[optim] = read_metrics(out)
        return runs[optim]
    return get


# a tied head is one tensor that takes two gradients (embedding and head): under each layout that
# accepts it (pp refuses it), cut in vocabulary slices, ZeRO slices or FSDP shards
@pytest.mark.parametrize("nproc, extra",
                         [(4, ["tp=2", "ddp_impl=naive"]), (2, ["zero=2", "offload=True"]),
                          (2, ["fsdp=True", "optim=muon"])],
                         ids=["tp2-naive", "zero2-offload", "fsdp-muon"])
def test_tied_embeddings_give_the_single_process_curve(nproc, extra, dataset, tied_run, tmp_path):
    out = str(tmp_path / "run")
    torchrun(nproc,
             [*REFERENCE, f"dataset={dataset}", f"out_dir={out}", "tie_embeddings=True",
              "ddp_bucket_mb=0.01", *extra], cwd=tmp_path)
    assert_same_curve(tied_run("muon" if "optim=muon" in extra else "adamw"), read_metrics(out))


def count_newton_schulz(rank):
    """before= of torchrun: counts the matrices this rank orthogonalizes (a stack counts each),
    written at every checkpoint save to ns_<rank>.txt in the run's cwd."""
    import checkpoint
    import optim
    seen, ns, save = [0], optim.newton_schulz, checkpoint.train_state

    def newton_schulz(g, *args, **kw):
        seen[0] += g.shape[0] if g.dim() == 3 else 1
        return ns(g, *args, **kw)

    def train_state(model, optimizer):
        with open(f"ns_{rank}.txt", "w") as f:
            f.write(str(seen[0]))
        return save(model, optimizer)
    optim.newton_schulz, checkpoint.train_state = newton_schulz, train_state


def test_resume_at_two_ranks_is_exact_and_moves_to_one(dataset, tmp_path):
    # with Muon: its momentum buffers are checkpointed too, and every rank orthogonalizes the same
    # mean gradient; each rank orthogonalizes half of the 14 matrices a step
    # (optim.orthogonalize_shared)
    common = [*TINY, f"dataset={dataset}", "lr_decay_iters=12", "ckpt_interval=100",
              "ddp_bucket_mb=0.01", "optim=muon"]
    full, half, one = str(tmp_path / "full"), str(tmp_path / "half"), str(tmp_path / "one")
    torchrun(2, [*common, f"out_dir={full}", "max_iters=12"], cwd=tmp_path,
             before=count_newton_schulz)
    assert [int((tmp_path / f"ns_{r}.txt").read_text()) for r in range(2)] == [12 * 14 // 2] * 2
    torchrun(2, [*common, f"out_dir={half}", "max_iters=6"], cwd=tmp_path)
    shutil.copytree(half, one)  # the same checkpoint, continued by one process below
    torchrun(2, [*common, f"out_dir={half}", "max_iters=12", "init_from=resume"], cwd=tmp_path)
    assert_same_curve(read_metrics(full), read_metrics(half), exact=True)
    run_train([*common, f"out_dir={one}", "max_iters=12", "init_from=resume"], cwd=tmp_path,
              fork=True)
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
    _, state = guard_ckpt.read_meta(os.path.join(out, "ckpt", "iter_0000003"))
    assert len(state["rng_cpu"]) == 2 and not torch.equal(state["rng_cpu"][0], state["rng_cpu"][1])


def test_a_layout_error_under_torchrun_is_one_line(dataset, tmp_path):
    # the other layout mistakes are checked in-process (test_train.py: MISTAKES); this one
    # goes through torchrun, whose rank-prefixing of stderr must not hide the line
    p = torchrun(2, [*TINY, f"dataset={dataset}", "grad_accum_steps=3", "max_iters=2"],
                 cwd=tmp_path, check=False, agent=True)
    assert p.returncode != 0 and ("error: grad_accum_steps=3 micro-batches per iteration cannot "
                                  "be shared evenly by 2") \
        in p.stderr  # (torchrun itself then prints its own summary of the failed workers)


@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_a_dead_or_hung_rank_ends_the_run_within_the_timeout(fault, dataset, tmp_path):
    """Two ranks started by hand (no torchrun to clean up): rank 1 is killed, or frozen with
    SIGSTOP, mid-run. Rank 0 must exit with an error naming the timeout key, not hang."""
    port, timeout_s = free_port(), 10
    out = str(tmp_path / "run")
    procs = []
    for rank in range(2):
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"}
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "train.py"),
             *TINY, f"dataset={dataset}", f"out_dir={out}",
             "max_iters=100000", f"dist_timeout_s={timeout_s}", "eval_interval=1000"],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        deadline = time.time() + 120
        while not (os.path.exists(os.path.join(out, "metrics.jsonl"))
                   and len(read_metrics(out)) > 3):
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


@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="keep_freed_memory sets glibc's malloc options")
def test_keep_freed_memory_cuts_the_page_faults_of_each_step():
    # without it a step's 16 MB tensors are often fresh mmaps whose 4 KB pages fault in one by one
    # (measured 57k-115k faults over 10 steps here, 5k-13k with it)
    # Each mode's fewest of three runs: the machine's memory reclaim (kdamond here) adds faults
    # to a run now and then; under the suite's load one suite saw plain 29k against keep 12k
    # (fewest of two), so the bound is a cut by more than half, not the quiet machine's 4x.
    faults = {}
    for mode in ("plain", "keep"):
        faults[mode] = min(
            int(subprocess.run([sys.executable, "-c", KEEP_FREED, mode], cwd=ROOT,
                               capture_output=True, text=True, check=True,
                               env={**os.environ, "PYTHONPATH": ROOT}).stdout)
                            for _ in range(3))
    assert faults["plain"] > 10 * 2000 and faults["keep"] * 2 < faults["plain"], faults


def test_mfu_peak_is_the_datasheet_on_a_known_gpu_else_a_measured_matmul(monkeypatch):
    """On CUDA under bf16/fp16 the peak is the GPU's datasheet figure (the longer names matched
    first: an H100 NVL is not an H100 SXM, an A100 not an A10), else the probe's matmul."""
    names = {"NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100 NVL": 835e12,
             "NVIDIA H100 PCIe": 756e12, "NVIDIA A100-SXM4-80GB": 312e12, "NVIDIA A10G": 125e12,
             "NVIDIA L40S": 362e12, "NVIDIA L4": 121e12, "NVIDIA H200": 989e12,
             "NVIDIA B200": 2250e12, "NVIDIA GeForce RTX 4090": 165e12}
    for name, flops in names.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        for dtype in (torch.bfloat16, torch.float16):
            peak, how = parallel.peak_flops("cuda", dtype)
            assert peak == flops and "datasheet" in how, (name, peak, how)
    # a CPU (and float32 anywhere) measures: a positive rate, said to be measured
    peak, how = parallel.peak_flops("cpu", torch.bfloat16, n=64, seconds=0.01)
    assert peak > 0 and how == "a measured matmul"
