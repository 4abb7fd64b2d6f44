"""Pipeline parallel on real gloo processes: the schedules against the single-process model
and torch.distributed.pipelining, activation counts, and train.py under torchrun."""

import shutil

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import parallel
import conftest
from conftest import REFERENCE, assert_same_curve, read_metrics, run_train, spawn, torchrun
from model import ModelConfig, Transformer, make_stage, stage_layers

CFG = {**conftest.CFG, "n_layer": 4}  # one layer per stage at pp=4
B = 2


def micro_batches(m):
    data = torch.randint(0, 64, (m, B, 17), generator=torch.Generator().manual_seed(0))
    return data[..., :-1], data[..., 1:]


def single_process(m, weights=None):
    """sum_k weights[k] * loss_k (default weights 1/m: the mean) and its gradient."""
    weights = weights or [1 / m] * m
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**CFG))
    x, y = micro_batches(m)
    total = 0.0
    for k in range(m):
        _, loss = model(x[k], y[k])
        (loss * weights[k]).backward()
        total += loss.item() * weights[k]
    return total, {n: p.grad for n, p in model.named_parameters()}


def stage_of(mesh):
    torch.manual_seed(0)
    return make_stage(Transformer(ModelConfig(**CFG)), mesh.pp_rank, mesh.pp)


def run_schedules(mesh, m, weights=None):
    """Our GPipe and 1F1B, then (without weights) torch's Schedule1F1B, on the same stage module."""
    x, y = micro_batches(m)
    out = {}
    for schedule in ("gpipe", "1f1b"):
        stage = stage_of(mesh)
        micro = [(x[k], y[k], None, None) for k in range(m)]
        loss, peak = parallel.pipeline_step(schedule, stage, mesh, micro, (B, 16, 32), weights=weights)
        out[schedule] = {"loss": loss.item(), "peak": peak,
                         "grads": {n: p.grad.clone() for n, p in stage.named_parameters()}}

    if m < mesh.pp or weights:  # torch's Schedule1F1B refuses fewer micro-batches than stages; ours runs them
        return out
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    class Logits(nn.Module):  # torch's stages return one tensor; ours return (output, loss)
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, inp):
            return self.inner(inp)[0]

    stage = stage_of(mesh)
    pipe = PipelineStage(Logits(stage), mesh.pp_rank, mesh.pp, mesh.device)
    sched = Schedule1F1B(pipe, m, loss_fn=lambda logits, tgt: F.cross_entropy(logits.flatten(0, 1), tgt.flatten()))
    losses = []
    if mesh.first_stage:
        sched.step(x.reshape(m * B, 16))
    elif mesh.last_stage:
        sched.step(target=y.reshape(m * B, 16), losses=losses)
    else:
        sched.step()
    out["torch"] = {"loss": sum(l.item() for l in losses) / m,
                    "grads": {n: p.grad.clone() for n, p in stage.named_parameters()}}
    return out


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 3)])
def test_schedules_equal_single_process_and_torch_1f1b(pp, m):
    ranks = spawn(run_schedules, pp, m, pp=pp)
    ref_loss, ref_grads = single_process(m)
    seen = set()
    schedules = ("gpipe", "1f1b", "torch") if m >= pp else ("gpipe", "1f1b")
    for stage, r in enumerate(ranks):
        for schedule in schedules:
            for name, g in r[schedule]["grads"].items():
                torch.testing.assert_close(g, ref_grads[name], msg=f"stage {stage} {schedule} {name}")
                seen.add(name)
        # activations alive at once: m for GPipe, pp - stage for 1F1B (or m, if fewer)
        assert r["gpipe"]["peak"] == m
        assert r["1f1b"]["peak"] == min(pp - stage, m)
    assert seen == set(ref_grads)  # the stages together own every parameter
    last = ranks[-1]
    for schedule in schedules:
        assert abs(last[schedule]["loss"] - ref_loss) < 1e-5, schedule  # the mean of the micro-batch losses


def test_loss_weights_give_the_gradient_of_the_weighted_sum():
    # unequal weights (e.g. each micro-batch's share of the target tokens): the stages' gradients
    # are those of sum_k weights[k] * loss_k, and that sum is the returned loss
    weights = [0.6, 0.1, 0.3]
    ranks = spawn(run_schedules, 2, 3, weights, pp=2)
    ref_loss, ref_grads = single_process(3, weights)
    assert abs(ref_loss - single_process(3)[0]) > 1e-3  # the weights matter: not the plain mean
    for stage, r in enumerate(ranks):
        for schedule in ("gpipe", "1f1b"):
            for name, g in r[schedule]["grads"].items():
                torch.testing.assert_close(g, ref_grads[name], msg=f"stage {stage} {schedule} {name}")
    for schedule in ("gpipe", "1f1b"):
        assert abs(ranks[-1][schedule]["loss"] - ref_loss) < 1e-5, schedule
        assert ranks[0][schedule]["loss"] == 0  # the loss exists on the last stage only


def test_stage_layers_split_evenly_earliest_first():
    assert [len(stage_layers(10, 4, s)) for s in range(4)] == [3, 3, 2, 2]
    assert [list(stage_layers(4, 2, s)) for s in range(2)] == [[0, 1], [2, 3]]
    for n, pp in [(7, 3), (8, 8), (5, 2)]:
        assert [i for s in range(pp) for i in stage_layers(n, pp, s)] == list(range(n))
    torch.manual_seed(0)
    last = make_stage(Transformer(ModelConfig(**CFG)), 1, 2)
    assert last.tok_embeddings is None and last.output is not None
    assert sorted(last.state_dict())[0].startswith("layers.2.")  # global names survive


# each layout once, the schedules alternating: both are compared with the single process (and
# torch's Schedule1F1B) in-process above, so these runs check train.py's wiring of each layout
@pytest.mark.parametrize("nproc, pp, schedule", [(2, 2, "1f1b"), (4, 4, "gpipe"), (4, 2, "1f1b")])
def test_torchrun_pipeline_gives_the_single_process_curve(nproc, pp, schedule, dataset, reference_run, tmp_path):
    out = str(tmp_path / "run")
    p = torchrun(nproc, [*REFERENCE, f"dataset={dataset}", f"out_dir={out}", f"pp={pp}", f"pp_schedule={schedule}",
                         "pp_trace=True", "ddp_bucket_mb=0.01"], cwd=tmp_path)
    assert f"dp={nproc // pp} x pp={pp}" in p.stdout
    assert "bubble: measured" in p.stdout and "stage 1 |" in p.stdout  # the timeline was drawn
    assert_same_curve(reference_run, read_metrics(out))


def test_save_at_pp2_resume_at_pp1_and_pp4(dataset, tmp_path):
    common = [*REFERENCE, f"dataset={dataset}", "lr_decay_iters=8", "ckpt_interval=100"]
    common = [a for a in common if not a.startswith("max_iters=")]
    full, half = str(tmp_path / "full"), str(tmp_path / "half")
    run_train([*common, f"out_dir={full}", "max_iters=8"], cwd=tmp_path)
    torchrun(2, [*common, f"out_dir={half}", "max_iters=4", "pp=2"], cwd=tmp_path)
    shutil.copytree(half, str(tmp_path / "half4"))
    run_train([*common, f"out_dir={half}", "max_iters=8", "init_from=resume"], cwd=tmp_path)
    assert_same_curve(read_metrics(full), read_metrics(half))
    torchrun(4, [*common, f"out_dir={tmp_path / 'half4'}", "max_iters=8", "init_from=resume", "pp=4"], cwd=tmp_path)
    assert_same_curve(read_metrics(full), read_metrics(str(tmp_path / "half4")))
