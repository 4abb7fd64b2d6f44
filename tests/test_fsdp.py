"""FSDP2 on real gloo processes: the single-process curve, sharded checkpoints that any
layout resumes, export to one file, and per-rank memory."""

import os

import pytest
import torch
from conftest import (
    CFG,
    INTERLEAVED,
    REFERENCE,
    assert_same_curve,
    read_metrics,
    run_train,
    spawn,
    torchrun,
)

import parallel
from model import ModelConfig, Transformer
from formats import hf
from formats import hf_safetensors
from techniques import fsdp


# offload=True: on a CPU device there is nothing to move, the same path
# (run so that the combination runs)
@pytest.mark.parametrize("nproc, extra",
                         [(2, []), (4, ["reshard_after_forward=False", "offload=True"]),
                          (4, ["pp=2"])],
                         ids=["fsdp2", "fsdp4-no-reshard-offload", "fsdp2-pp2"])
def test_fsdp_gives_the_single_process_curve(nproc, extra, dataset, reference_run, tmp_path):
    out = str(tmp_path / "run")
    # REFERENCE has 4 micro-batches per iteration: gradient accumulation is on at every layout here
    p = torchrun(nproc, [*REFERENCE, f"dataset={dataset}", f"out_dir={out}", "fsdp=True", *extra],
                 cwd=tmp_path)
    assert "(fsdp: 1/" in p.stdout
    assert_same_curve(reference_run, read_metrics(out))


def test_muon_under_fsdp_and_pipeline_gives_the_single_process_curve(dataset, tmp_path):
    """Muon needs whole matrices: under FSDP each one is gathered for the orthogonalization
    (and this rank's rows kept); a pipeline stage orthogonalizes its own layers. fsdp over 2
    ranks x 2 stages, each stage compiled, reproduces one plain process, with wsd as the schedule;
    so do naive data parallel x the interleaved pipeline (a stage's two chunks,
    each its own layers)."""
    args = [*REFERENCE, f"dataset={dataset}", "optim=muon", "lr_schedule=wsd", "cooldown_frac=0.5"]
    single, sharded = str(tmp_path / "single"), str(tmp_path / "sharded")
    run_train([*args, f"out_dir={single}"], cwd=tmp_path, fork=True)
    p = torchrun(
        4, [*args, f"out_dir={sharded}", "fsdp=True", "pp=2", "compile=True", "offload=True"],
        cwd=tmp_path)
    assert "(fsdp: 1/2" in p.stdout
    assert_same_curve(read_metrics(single), read_metrics(sharded), rtol=1e-3)  # compiled vs eager
    torchrun(4, [*args, f"out_dir={tmp_path / 'interleaved'}", *INTERLEAVED, "ddp_impl=naive"],
             cwd=tmp_path)
    assert_same_curve(read_metrics(single), read_metrics(tmp_path / "interleaved"))
    # warmup 2, flat, then down over the last 4
    lrs = [r["lr"] for r in read_metrics(single) if "lr" in r]
    assert (lrs[1] == lrs[2] == lrs[3] == lrs[4] == 1e-2
            and lrs[4] > lrs[5] > lrs[6] > lrs[7] > 1e-3), lrs


def test_one_run_moves_through_every_layout(dataset, reference_run, tmp_path):
    """One out_dir, 8 iterations, each leg a different layout that resumes the checkpoint of
    the leg before: zero=1 x tp=2 -> fsdp x tp=2 -> tp=2 x pp=2 -> pp=4 -> one process. The
    chain is the uninterrupted single-process curve; a sharded checkpoint read whole holds the
    single-process weights, and export_hf from tp x pp writes the single-process model."""
    import checkpoint
    out, single = str(tmp_path / "run"), str(tmp_path / "single")
    common = [a for a in REFERENCE if not a.startswith("max_iters=")] + [
        f"dataset={dataset}", "lr_decay_iters=8", "ddp_bucket_mb=0.01", "keep_ckpts=0"]
    chain = [*common, f"out_dir={out}", "init_from=auto"]
    torchrun(4, [*chain, "max_iters=2", "zero=1", "tp=2"], cwd=tmp_path)
    torchrun(4, [*chain, "max_iters=4", "fsdp=True", "tp=2"], cwd=tmp_path)
    torchrun(4, [*chain, "max_iters=5", "tp=2", "pp=2", f"export_hf={tmp_path / 'hf_tp_pp'}"],
             cwd=tmp_path)
    torchrun(4, [*chain, "max_iters=6", "pp=4"], cwd=tmp_path)
    run_train([*chain, "max_iters=8"], cwd=tmp_path, fork=True)
    assert_same_curve(reference_run, read_metrics(out))
    assert (sorted(os.listdir(os.path.join(out, "ckpt")))[:5]
            == [f"iter_{i:07d}" for i in (2, 4, 5, 6, 8)])

    # the truth at iterations 4 and 5: one process
    run_train([*common, f"out_dir={single}", "max_iters=5",
               "ckpt_interval=4", f"export_hf={tmp_path / 'hf_one'}"],
              cwd=tmp_path, fork=True)
    # written by fsdp x tp
    a = checkpoint.load_whole(os.path.join(out, "ckpt", "iter_0000004"))[0].state_dict()
    b = checkpoint.load_whole(os.path.join(single, "ckpt", "iter_0000004"))[0].state_dict()
    assert set(a) == set(b) and "layers.3.feed_forward.w2.weight" in a
    for k in a:
        # atol 5e-5: tp's sliced matmuls round differently, and AdamW's first steps (lr * g / (|g|
        # + eps)) turn that rounding in near-zero gradient entries into weight
        # differences of up to 1.8e-5
        # (measured: plain tp=2 after 2 iterations; zero=1 at 2 ranks: 7.4e-7)
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=5e-5, msg=k)
    one = hf_safetensors.read_safetensors(str(tmp_path / "hf_one" / "model.safetensors"))
    two = hf_safetensors.read_safetensors(str(tmp_path / "hf_tp_pp" / "model.safetensors"))
    assert set(one) == set(two)
    for k in one:
        # measured 2.2e-5 (tp: see above)
        torch.testing.assert_close(two[k], one[k], rtol=1e-4, atol=5e-5, msg=k)


def one_step_memory(mesh, shard):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**CFG))
    if shard:
        fsdp.fully_shard_model(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(mesh.rank))
    model(x[:, :-1], x[:, 1:])[1].backward()
    opt.step()
    return parallel.memory_bytes(model, opt)


def check_one_nth(ranks):
    full, n = spawn(one_step_memory, 1, False)[0], len(ranks)
    for rank in ranks:
        for kind in ("params", "grads", "optimizer"):
            assert 0 < rank[kind] <= full[kind] / n * 1.10, (kind, rank[kind], full[kind])


def test_fsdp_holds_one_nth_per_rank():
    # n=4: test_meta.py, on the processes it starts anyway
    check_one_nth(spawn(one_step_memory, 2, True))


def bf16_forward(mesh, shard):
    """One forward under bf16 autocast (dtype=bfloat16's path, on CPU): the loss, and the dtypes
    that a block's weight and the residual stream have inside it."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**CFG))
    if shard:
        fsdp.fully_shard_model(model, mesh)
    seen = {}
    model.layers["0"].attention.wq.register_forward_hook(
        lambda m, args, out: seen.update(weight=str(m.weight.dtype)))
    model.layers["1"].register_forward_pre_hook(
        lambda m, args: seen.update(residual=str(args[0].dtype)))
    x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(x[:, :-1], x[:, 1:])
    return {"loss": loss.detach().float(), **seen}


def test_fsdp_in_bf16_keeps_fp32_weights_and_residual_as_one_process_does():
    one = spawn(bf16_forward, 1, False)[0]
    sharded = spawn(bf16_forward, 2, True)[0]
    # autocast casts inside the matmuls only
    assert one["weight"] == one["residual"] == "torch.float32"
    assert sharded["weight"] == sharded["residual"] == "torch.float32", sharded
    # the same bits: fsdp gathers the fp32 weights
    assert torch.equal(sharded["loss"], one["loss"])
