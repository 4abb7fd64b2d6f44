"""FSDP2 on real gloo processes: the single-process curve, sharded checkpoints that any
layout resumes, export to one file, and per-rank memory."""

import shutil

import pytest
import torch

import parallel
from conftest import CFG, REFERENCE, assert_same_curve, read_metrics, run_train, spawn, torchrun
from model import ModelConfig, Transformer



@pytest.mark.parametrize("nproc, extra", [(2, []), (4, ["reshard_after_forward=False"]), (4, ["pp=2"])])
def test_fsdp_gives_the_single_process_curve(nproc, extra, dataset, reference_run, tmp_path):
    out = str(tmp_path / "run")
    # REFERENCE has 4 micro-batches per iteration: gradient accumulation is on at every layout here
    p = torchrun(nproc, [*REFERENCE, f"dataset={dataset}", f"out_dir={out}", "fsdp=True", *extra], cwd=tmp_path)
    assert "(fsdp: 1/" in p.stdout
    assert_same_curve(reference_run, read_metrics(out))


def test_muon_under_fsdp_and_pipeline_gives_the_single_process_curve(dataset, tmp_path):
    """Muon needs whole matrices: under FSDP each one is gathered for the orthogonalization
    (and this rank's rows kept); a pipeline stage orthogonalizes its own layers. fsdp over 2
    ranks x 2 stages, each stage compiled, reproduces one plain process, with wsd as the schedule."""
    args = [*REFERENCE, f"dataset={dataset}", "optim=muon", "lr_schedule=wsd", "cooldown_frac=0.5"]
    single, sharded = str(tmp_path / "single"), str(tmp_path / "sharded")
    run_train([*args, f"out_dir={single}"], cwd=tmp_path)
    p = torchrun(4, [*args, f"out_dir={sharded}", "fsdp=True", "pp=2", "compile=True"], cwd=tmp_path)
    assert "(fsdp: 1/2" in p.stdout
    assert_same_curve(read_metrics(single), read_metrics(sharded), rtol=1e-3)  # compiled vs eager
    lrs = [r["lr"] for r in read_metrics(single) if "lr" in r]  # warmup 2, flat, then down over the last 4
    assert lrs[1] == lrs[2] == lrs[3] == lrs[4] == 1e-2 and lrs[4] > lrs[5] > lrs[6] > lrs[7] > 1e-3, lrs


def test_checkpoints_reshard_between_layouts(dataset, reference_run, tmp_path):
    """Save at one layout after 4 of 8 iterations, resume at another: the continuation is the
    uninterrupted single-process curve."""
    half = [a for a in REFERENCE if not a.startswith("max_iters=")] + [f"dataset={dataset}", "lr_decay_iters=8"]
    fsdp2, single = str(tmp_path / "fsdp2"), str(tmp_path / "single")
    torchrun(2, [*half, f"out_dir={fsdp2}", "max_iters=4", "fsdp=True"], cwd=tmp_path)
    run_train([*half, f"out_dir={single}", "max_iters=4"], cwd=tmp_path)
    for name in ("to_pp", "to_one"):
        shutil.copytree(fsdp2, str(tmp_path / name))
    shutil.copytree(single, str(tmp_path / "to_fsdp4"))
    # the sharded checkpoint, consolidated into one file, holds the single-process weights
    for src in (fsdp2, single):
        run_train([f"out_dir={src}", f"export={src}/model.pt"], cwd=tmp_path, script="sample.py")
    a = torch.load(f"{fsdp2}/model.pt", weights_only=True)
    b = torch.load(f"{single}/model.pt", weights_only=True)
    assert set(a) == set(b) and "layers.3.feed_forward.w2.weight" in a
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5, msg=k)

    resume = [*half, "max_iters=8", "init_from=resume"]
    run_train([*resume, f"out_dir={tmp_path / 'to_one'}"], cwd=tmp_path)                    # fsdp x2 -> 1 process
    torchrun(4, [*resume, f"out_dir={tmp_path / 'to_fsdp4'}", "fsdp=True"], cwd=tmp_path)   # 1 process -> fsdp x4
    torchrun(4, [*resume, f"out_dir={tmp_path / 'to_pp'}", "pp=2"], cwd=tmp_path)            # fsdp x2 -> dp2 x pp2
    for name in ("to_one", "to_fsdp4", "to_pp"):
        assert_same_curve(reference_run, read_metrics(str(tmp_path / name)))


def one_step_memory(mesh, shard):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**CFG))
    if shard:
        parallel.fully_shard_model(model, mesh)
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
    check_one_nth(spawn(one_step_memory, 2, True))  # n=4: test_meta.py, on the processes it starts anyway
