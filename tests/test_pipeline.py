"""Pipeline parallel on real gloo processes: the schedules against the single-process model
and torch.distributed.pipelining, activation counts, and train.py under torchrun."""


import conftest
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from guards import guard_ckpt
from conftest import REFERENCE, assert_same_curve, read_metrics, spawn, torchrun

from model import ModelConfig, Transformer
from techniques import pipeline
from techniques.pipeline import make_stage, pipeline_split, stage_costs, stage_layers

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


def stage_of(mesh, virtual=1):
    torch.manual_seed(0)
    return make_stage(Transformer(ModelConfig(**CFG)), mesh.pp_rank, mesh.pp, virtual=virtual)


def run_schedules(mesh, m, weights=None):
    """Our GPipe, 1F1B and (at pp=2, 2 chunks of one layer per rank) interleaved 1F1B, then
    (without weights) torch's Schedule1F1B and ScheduleInterleaved1F1B, on the same stages."""
    x, y = micro_batches(m)
    out = {}
    interleaved = 2 * mesh.pp <= CFG["n_layer"] and m % mesh.pp == 0
    for schedule in ("gpipe", "1f1b") + (("interleaved",) if interleaved else ()):
        virtual = 2 if schedule == "interleaved" else 1
        stage = stage_of(mesh, virtual)
        micro = [(x[k], y[k], None, None) for k in range(m)]
        trace = []
        loss, peak = pipeline.pipeline_step(schedule, stage, mesh, micro, (B, 16, 32),
                                            weights=weights, trace=trace, virtual=virtual)
        out[schedule] = {"loss": loss.item(), "peak": peak,
                         "trace": [e[:2] + e[4:] for e in trace],
                         "grads": {n: p.grad.clone() for n, p in stage.named_parameters()}}

    # torch's Schedule1F1B refuses fewer micro-batches than stages; ours runs them
    if m < mesh.pp or weights:
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
    sched = Schedule1F1B(
        pipe, m, loss_fn=lambda logits, tgt: F.cross_entropy(logits.flatten(0, 1), tgt.flatten()))
    losses = []
    if mesh.first_stage:
        sched.step(x.reshape(m * B, 16))
    elif mesh.last_stage:
        sched.step(target=y.reshape(m * B, 16), losses=losses)
    else:
        sched.step()
    out["torch"] = {"loss": sum(l.item() for l in losses) / m,
                    "grads": {n: p.grad.clone() for n, p in stage.named_parameters()}}
    if not interleaved:
        return out
    from torch.distributed.pipelining import ScheduleInterleaved1F1B
    # torch's interleaved schedule runs one module per virtual stage: ours cut from a pipeline
    # of 2 * pp stages, with the same layers as our chunks (one module per rank, chunk views)
    chunks = []
    for v in range(2):
        torch.manual_seed(0)
        chunks.append(
            make_stage(Transformer(ModelConfig(**CFG)), v * mesh.pp + mesh.pp_rank, 2 * mesh.pp))
    pipes = [PipelineStage(Logits(c), v * mesh.pp + mesh.pp_rank, 2 * mesh.pp, mesh.device)
             for v, c in enumerate(chunks)]
    sched = ScheduleInterleaved1F1B(
        pipes, m, loss_fn=lambda logits, tgt: F.cross_entropy(logits.flatten(0, 1), tgt.flatten()))
    losses = []
    if mesh.first_stage:
        sched.step(x.reshape(m * B, 16))
    elif mesh.last_stage:
        sched.step(target=y.reshape(m * B, 16), losses=losses)
    else:
        sched.step()
    out["torch interleaved"] = {"loss": sum(l.item() for l in losses) / m,
                                "grads": {n: p.grad.clone() for c in chunks
                                          for n, p in c.named_parameters()}}
    return out


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 3)])
def test_schedules_equal_single_process_and_torch_1f1b(pp, m):
    ranks = spawn(run_schedules, pp, m, pp=pp)
    ref_loss, ref_grads = single_process(m)
    seen = set()
    schedules = ("gpipe", "1f1b", "torch") if m >= pp else ("gpipe", "1f1b")
    if pp == 2:
        schedules += ("interleaved", "torch interleaved")
    for stage, r in enumerate(ranks):
        assert set(schedules) <= set(r)
        for schedule in schedules:
            for name, g in r[schedule]["grads"].items():
                torch.testing.assert_close(g, ref_grads[name],
                                           msg=f"stage {stage} {schedule} {name}")
                seen.add(name)
        # activations alive at once: m for GPipe, pp - stage for 1F1B (or m, if fewer)
        assert r["gpipe"]["peak"] == m
        assert r["1f1b"]["peak"] == min(pp - stage, m)
    assert seen == set(ref_grads)  # the stages together own every parameter
    # interleaved: each rank ran every micro-batch through both its chunks, chunk 1 after chunk 0
    if pp == 2:
        for r in ranks:
            ops = r["interleaved"]["trace"]
            assert sorted(ops) == sorted((kind, k, c) for kind in "FB" for k in range(m)
                                         for c in range(2))
            assert all(ops.index(("F", k, 0)) < ops.index(("F", k, 1)) < ops.index(("B", k, 1))
                       < ops.index(("B", k, 0)) for k in range(m))
    last = ranks[-1]
    for schedule in schedules:
        # the mean of the micro-batch losses
        assert abs(last[schedule]["loss"] - ref_loss) < 1e-5, schedule


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
                torch.testing.assert_close(g, ref_grads[name],
                                           msg=f"stage {stage} {schedule} {name}")
    for schedule in ("gpipe", "1f1b"):
        assert abs(ranks[-1][schedule]["loss"] - ref_loss) < 1e-5, schedule
        assert ranks[0][schedule]["loss"] == 0  # the loss exists on the last stage only


def test_pipeline_split_balances_the_head_and_keeps_global_names():
    # a head that costs next to nothing (tiny vocabulary): nearly even, the middle stages take the
    # extra layers (the first pays the embedding lookup, the last the small head)
    cheap = ModelConfig(vocab_size=2, n_layer=10, n_embd=128, n_head=4, block_size=128)
    assert pipeline_split(cheap, 4) == [2, 3, 3, 2]
    # the default model: the 8192 x 128 head with its loss costs ~8 layers,
    # so the last stage gets one layer
    default = ModelConfig(vocab_size=8192, n_layer=4, n_embd=128, n_head=4, block_size=128)
    block, head, emb = stage_costs(default)
    assert 7 < head / block < 8.5 and emb < block / 100
    # a block's forward is a third of what flops_per_token counts per layer for training, also
    # where n_head x head_dim is not n_embd (Qwen3's heads), once the head and the gains are out
    wide = ModelConfig(vocab_size=64, n_layer=2, n_embd=64, n_head=4, n_kv_head=2, head_dim=32,
                       block_size=32)
    m = Transformer(wide)
    gains = sum(p.numel() for p in m.parameters() if p.dim() == 1)
    training = m.flops_per_token() - 6 * (m.output.weight.numel() + gains)
    assert stage_costs(wide)[0] * 3 * wide.n_layer == training
    assert pipeline_split(default, 2) == [3, 1] and pipeline_split(default, 4) == [1, 1, 1, 1]
    assert (pipeline_split(ModelConfig(vocab_size=8192, n_layer=12, n_embd=128, block_size=128), 3)
            == [5, 6, 1])
    for n, stages in [(7, 3), (8, 8), (5, 2), (12, 4)]:
        counts = pipeline_split(ModelConfig(n_layer=n), stages)
        assert (min(counts) >= 1 and [i for s in range(stages) for i in stage_layers(counts, s)]
                == list(range(n)))
    torch.manual_seed(0)
    last = make_stage(Transformer(ModelConfig(**CFG)), 1, 2, counts=[3, 1])
    assert last.tok_embeddings is None and last.output is not None
    assert sorted(k for k in last.state_dict()
                  if k.startswith("layers.")) [0].startswith("layers.3.")  # global names
    # interleaved: rank 0 of 2 x 2 virtual stages holds virtual stages 0 and 2 (layers 0 and 2),
    # the embedding, and runs one chunk at a time
    torch.manual_seed(0)
    full = Transformer(ModelConfig(**CFG))
    torch.manual_seed(0)
    first = make_stage(Transformer(ModelConfig(**CFG)), 0, 2, virtual=2)
    assert first.chunks == [range(0, 1), range(2, 3)] and first.output is None
    assert (sorted({k.split(".")[1] for k in first.state_dict() if k.startswith("layers.")})
            == ["0", "2"])
    x = torch.randint(0, CFG["vocab_size"], (2, 8))
    h, loss = first(x, chunk=0)
    assert loss is None
    torch.testing.assert_close(
        h, full.layers["0"](full.tok_embeddings(x), full.rope_cos[:8], full.rope_sin[:8]))
    torch.testing.assert_close(first(h, chunk=1)[0],
                               full.layers["2"](h, full.rope_cos[:8], full.rope_sin[:8]))


# each layout once, the schedules alternating: both are compared with the single process (and
# torch's Schedule1F1B) in-process above, so these runs check train.py's wiring of each layout
# (the balanced split puts REFERENCE's 4 layers as 3, 1 on 2 stages; pp_layers=1,3 is the other way
# round); interleaved with dp=2: the buckets of the other chunk's layers are all-reduced in wait()
@pytest.mark.parametrize("nproc, pp, schedule, extra, stages", [
    (2, 2, "1f1b", ["pp_layers=1,3"], "stage 0: layers 0-0; stage 1: layers 1-3"),
    (4, 4, "gpipe", [], "stage 3: layers 3-3"),
    (4, 2, "1f1b", [], "stage 0: layers 0-2; stage 1: layers 3-3"),
    (4, 2, "interleaved", ["pp_virtual=2", "pp_layers=1,1,1,1"],
     "stage 0: layers 0-0, 2-2; stage 1: layers 1-1, 3-3")])
def test_torchrun_pipeline_gives_the_single_process_curve(nproc, pp, schedule, extra, stages,
                                                         dataset, reference_run, tmp_path):
    out = str(tmp_path / "run")
    p = torchrun(nproc, [*REFERENCE, f"dataset={dataset}", f"out_dir={out}", f"pp={pp}",
                         f"pp_schedule={schedule}", "pp_trace=True", "ddp_bucket_mb=0.01", *extra],
                 cwd=tmp_path)
    assert f"dp={nproc // pp} x pp={pp}" in p.stdout and stages in p.stdout
    assert "bubble: measured" in p.stdout and "stage 1 |" in p.stdout  # the timeline was drawn
    assert_same_curve(reference_run, read_metrics(out))


@pytest.mark.parametrize("pp", [2, 4])
def test_interleaved_schedule_idles_exactly_the_theory(pp):
    # with every op one round long (communication free, stages balanced), the schedule's own
    # idle share is the textbook bubble: (p-1)/(V*m+p-1), V times smaller than 1F1B's
    # (p-1)/(m+p-1) for V*m >> p; a schedule that waited one round too many would fail this
    for virtual in (1, 2, 3):
        for m in (pp, 2 * pp, 4 * pp):
            rounds = pipeline.interleaved_rounds(pp, virtual, m)
            for row in rounds:  # every rank runs each of its ops once
                ops = [op for op in row if op is not None]
                assert sorted(ops) == sorted((kind, c, k) for kind in "FB" for c in range(virtual)
                                             for k in range(m))
            idle = sum(op is None for row in rounds for op in row) / (pp * len(rounds[0]))
            assert idle == pytest.approx((pp - 1) / (virtual * m + pp - 1)), (virtual, m)


def test_tied_embeddings_across_stages_and_interleaved_fsdp_resume_into_one_process(
        dataset, tmp_path):
    """tie_embeddings with pp=2 (embedding on stage 0, head on stage 1: their gradients summed
    every step, the norm counting the weight once) under interleaved 1F1B with fsdp over dp=2
    reproduces the single process; its checkpoint holds one optimizer entry for the tied
    weight and resumes into one process, which ends on the single-process curve. So do
    ZeRO-1 (interleaved) and ZeRO-2 (1F1B), where each stage's copy is a bucket of its own
    and the sum runs over this rank's slice; the clip is active (REFERENCE's grad_clip=0.5)."""
    import checkpoint
    run = [*REFERENCE, f"dataset={dataset}", "tie_embeddings=True", "ckpt_interval=4",
           "lr_decay_iters=8"]
    single, multi = str(tmp_path / "single"), str(tmp_path / "multi")
    conftest.run_train([*run, f"out_dir={single}"], cwd=tmp_path)
    torchrun(4,
             [*run, f"out_dir={multi}", "pp=2", "fsdp=True", "pp_schedule=interleaved",
              "pp_virtual=2", "pp_layers=1,1,1,1", "max_iters=4"], cwd=tmp_path)
    keys = guard_ckpt.read_dcp_metadata(f"{multi}/ckpt/iter_0000004").state_dict_metadata
    assert ("optim.tok_embeddings.weight.exp_avg" in keys
            and not any(k.startswith("optim.output.") for k in keys))
    conftest.run_train([*run, f"out_dir={multi}"], cwd=tmp_path)  # resumes at 4 in one process
    assert_same_curve(read_metrics(single), read_metrics(multi), rtol=1e-5)
    # the clip clips
    assert max(r["grad_norm"] for r in read_metrics(single) if "grad_norm" in r) > 0.5
    for name, layout in (
            ("zero1", ["zero=1", "pp_schedule=interleaved", "pp_virtual=2", "pp_layers=1,1,1,1"]),
            ("zero2", ["zero=2"])):
        out = str(tmp_path / name)
        torchrun(4, [*run, f"out_dir={out}", "pp=2", *layout], cwd=tmp_path)
        keys = guard_ckpt.read_dcp_metadata(f"{out}/ckpt/iter_0000008").state_dict_metadata
        assert ("optim.tok_embeddings.weight.exp_avg" in keys
                and not any(k.startswith("optim.output.") for k in keys))
        assert_same_curve(read_metrics(single), read_metrics(out), rtol=1e-5)


def test_a_tied_hugging_face_model_across_stages(dataset, tmp_path):
    """A tied model imported from Hugging Face (tie_embeddings comes from its config.json, not
    the command line) is tied across the stages too: pp=2 reproduces one process."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**conftest.HF, "tie_word_embeddings": True})).save_pretrained(
        tmp_path / "hf")
    run = [*conftest.RUN, f"dataset={dataset}", f"init_from={tmp_path / 'hf'}", "max_iters=4",
           "grad_clip=0.5"]
    conftest.run_train([*run, f"out_dir={tmp_path / 'one'}"], cwd=tmp_path)
    torchrun(2, [*run, f"out_dir={tmp_path / 'pp2'}", "pp=2"], cwd=tmp_path)
    assert_same_curve(read_metrics(tmp_path / "one"), read_metrics(tmp_path / "pp2"), rtol=1e-5)
