"""Activation memory by choice (techniques/activations.py, techniques/memory_plan.py): every `ac`
policy and activation offload give the plain model's loss and gradients bit for bit in float32
(dense, mixture of experts, LoRA) and the single-process curve on the layouts; the saved-bytes
counter orders them none > layers:2 > op > full, offload leaves nothing of theirs on the device;
the memory plan is within 10% of the counter, on each rank of tp, cp and pipeline runs; plan=True
prints it once, for the model the run trains; a run that cannot fit stops before its first
step, naming what would."""

import os
import re

import pytest
import torch
from conftest import (REFERENCE, ROOT, assert_same_curve, read_metrics, run_train, torchrun,
                      validate_as_train)

import configurator
from guards import guard_config
from model import ModelConfig, Transformer
from real_model import smollm2_dir
from techniques import activations, memory_plan
from techniques.lora import apply_lora

POLICIES = ("none", "layers:2", "op", "full")
SHAPE = dict(vocab_size=128, n_layer=4, n_head=4, n_kv_head=2, n_embd=32)
# the memory plan's keys of a single process
RUN = dict(ffn_dim=0, head_dim=0, tie_embeddings=False, batch_size=2, block_size=16, tp=1, cp=1,
           pp=1, sp=False, dtype="float32", grad_ckpt=False, loss_chunk=0, loss_recompute=True,
           grad_accum_steps=1, pp_virtual=1, pp_schedule="1f1b", pp_layers="", fsdp=False, zero=0,
           lora_rank=0)


def step(ac, offload, lora=False, **kw):
    """One training forward and backward of SHAPE's model under (ac, offload): (loss, grads,
    the counter)."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**SHAPE, "block_size": 16, **kw})).train()
    if lora:
        apply_lora(model, 4, 8.0, 0.0, ["wq", "wv", "wo", "w2"], seed=0)
        for name, p in model.named_parameters():  # B starts at 0: move it, so A's grads are not 0
            if "lora_B" in name:
                p.data.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    activations.apply(model, ac, offload)
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    with activations.SavedBytes(model) as saved:
        _, loss = model(x, x.roll(-1, 1))
    loss.backward()
    return loss, [p.grad for p in model.parameters() if p.grad is not None], saved


@pytest.mark.parametrize("kind", ["dense", "moe", "lora"])
def test_every_policy_and_offload_gives_the_same_loss_and_gradients(kind):
    kw = dict(n_experts=4, moe_top_k=2) if kind == "moe" else {}
    ref_loss, ref_grads, _ = step("none", False, kind == "lora", **kw)
    kept = {}
    # (the mixture of experts and LoRA: the selective policy with offload, and a whole block)
    runs = ([(ac, o) for ac in POLICIES for o in (False, True)] if kind == "dense"
            else [("op", True), ("full", False)])
    for ac, offload in runs:
        loss, grads, saved = step(ac, offload, kind == "lora", **kw)
        assert loss.item() == ref_loss.item() and len(grads) == len(ref_grads), (ac, offload)
        assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads)), (ac, offload)
        kept[ac, offload] = saved
    if kind != "dense":
        return
    device = [kept[ac, False].device for ac in POLICIES]
    assert device == sorted(device, reverse=True) and len(set(device)) == len(device), device
    # offload: nothing left on the device, `op`'s kept matmul outputs (the selective
    # checkpoint's own cache, no saved tensor) included; each byte moved once
    for ac in POLICIES:
        left = kept[ac, True]
        assert left.device == 0 and left.offloaded == kept[ac, False].device, (ac, left.device)


@pytest.mark.parametrize("kw", [{}, {"loss_chunk": 8}, {"n_kv_head": 4, "block_size": 8},
                                {"n_experts": 4, "moe_top_k": 2}],
                         ids=["plain", "loss_chunk", "mha", "moe"])
def test_the_plan_is_within_10_percent_of_the_counter(kw):
    for ac in POLICIES:
        for offload in (False, True) if not kw else (False,):
            c = {**RUN, **SHAPE, **kw, "ac": ac, "offload_activations": offload}
            torch.manual_seed(0)
            model = Transformer(ModelConfig(**{**SHAPE, **kw, "block_size": c["block_size"]},
                                            )).train()
            activations.apply(model, ac, offload)
            x = torch.randint(0, 128, (c["batch_size"], c["block_size"]))
            with activations.SavedBytes(model) as saved:
                model(x, x)
            planned = memory_plan.activation_bytes(c, 1)
            assert abs(planned - saved.device) <= 0.1 * saved.device, (ac, offload, planned,
                                                                       saved.device)


# (one launch per layout: tp x sp x fsdp with op and offload, the interleaved pipeline with
# layers:2 and offload, 1F1B and cp's ring attention with op: the recomputed forwards repeat
# their collectives; full on the layouts: grad_ckpt=True in test_tp.py, test_long.py,
# test_moe.py)
def count_kept(rank):
    """before= of torchrun: the most bytes (device and offloaded) this rank's training forwards
    keep for backward at once (a pipeline's micro-batches in flight), written to saved.RANK
    after each for the test to hold the plan to."""
    from techniques import activations
    apply = activations.apply

    def counted(model, ac, offload=False):
        line, forward = apply(model, ac, offload), model.forward
        saved = activations.SavedBytes(model)

        def each(*args, **kwargs):
            if not torch.is_grad_enabled():  # (evaluation keeps nothing)
                return forward(*args, **kwargs)
            with saved:
                out = forward(*args, **kwargs)
            with open(f"saved.{rank}", "w") as f:
                f.write(str(saved.peak))
            return out
        model.forward = each
        return line
    activations.apply = counted


@pytest.mark.parametrize("nproc, layout, says", [
    (4, ["tp=2", "sp=True", "fsdp=True", "ac=op", "offload_activations=True"], "0,1,2,3"),
    (2, ["pp=2", "pp_schedule=interleaved", "pp_virtual=2", "pp_layers=1,1,1,1", "ac=layers:2",
         "offload_activations=True"], "0,2"),
    (2, ["pp=2", "ac=op"], "0,1,2"), (2, ["cp=2", "ac=op"], "0,1,2,3")],
    ids=["tp2-sp-fsdp2-op-offload", "pp2-interleaved-layers2-offload", "pp2-1f1b-op", "cp2-op"])
def test_policies_on_layouts_give_the_single_process_curve(nproc, layout, says, dataset,
                                                           reference_run, tmp_path):
    out = str(tmp_path / "run")
    p = torchrun(nproc, [*REFERENCE, f"dataset={dataset}", f"out_dir={out}", *layout,
                         "ddp_bucket_mb=0.01"], cwd=tmp_path, before=count_kept)
    # the plan of each rank's stage within 10% of the most it kept (offloaded: the plan of the
    # same run without offload): the tp x sp split, cp's ring, a pipeline's in-flight chunks
    c = {**RUN, **SHAPE, **dict(a.split("=") for a in REFERENCE + layout)}
    c = {k: type(RUN.get(k, SHAPE.get(k, "")))(v) if k in RUN or k in SHAPE else v
         for k, v in c.items()}
    c["offload_activations"] = False
    for r in range(nproc):
        saved = int((tmp_path / f"saved.{r}").read_text())
        planned = memory_plan.activation_bytes(c, nproc, stage=r // (c["cp"] * c["tp"]) % c["pp"])
        assert abs(planned - saved) <= 0.1 * saved, (r, saved, planned)
    # (rank 0's blocks: the first pipeline stage holds layers 0 and 2, both taken by layers:2)
    assert f"layers {says} recomputed in backward" in p.stdout
    assert ("waits in CPU memory" in p.stdout) == ("offload_activations=True" in layout)
    assert_same_curve(reference_run, read_metrics(out))
    # plan=True on this run's out_dir: its checkpoint's shape, not the config's
    if "cp=2" in layout:
        p = run_train(["plan=True", f"out_dir={out}"], cwd=tmp_path, fork=True)
        c = {**configurator.script_defaults(os.path.join(ROOT, "train.py")), "out_dir": out,
             "plan": True}
        shape = guard_config.model_shape(c)
        assert (shape["n_embd"], c["n_embd"]) == (32, 128), (shape["n_embd"], c["n_embd"])
        assert p.stdout.strip() == memory_plan.lines(shape, 1), p.stdout


def test_plan_prints_and_a_run_that_cannot_fit_names_what_would(tmp_path):
    p = torchrun(2, ["plan=True", "ac=op", "batch_size=2"], cwd=tmp_path)
    # once, from rank 0 (every rank runs train.py)
    assert p.stdout.startswith("memory plan per rank (ac=op, offload_activations=False, 2 x 64 "
                               "tokens a micro-batch): weights ")
    assert p.stdout.count("memory plan per rank") == 1 and not (tmp_path / "out").exists()
    # a Hugging Face directory's shape (SmolLM2-135M: 0.50 GiB of float32 weights), read
    # without its weights, not the config's (0.01 GiB)
    smol = smollm2_dir()
    p = run_train(["plan=True", f"init_from={smol}", "batch_size=1"], cwd=tmp_path, fork=True)
    c = validate_as_train({**configurator.script_defaults(os.path.join(ROOT, "train.py")),
                           "init_from": smol, "batch_size": 1, "plan": True}, {}, 1)
    expected = memory_plan.lines(guard_config.model_shape(c), 1)
    assert p.stdout.strip() == expected and "weights 0.50 GiB" in expected, p.stdout
    # a 1B-parameter shape at 128k tokens a row: the activations alone are terabytes
    big = ["n_layer=16", "n_embd=2048", "n_head=32", "n_kv_head=8", "ffn_dim=8192",
           "vocab_size=8192", "block_size=131072", "batch_size=2", "loss_chunk=1024",
           "eval_iters=1"]
    p = run_train(big, cwd=tmp_path, check=False, fork=True)
    assert p.returncode != 0 and "error: memory plan per rank" in p.stderr + p.stdout
    assert "what would fit: " in p.stderr + p.stdout and not (tmp_path / "out").exists()


def test_what_fits_names_the_batch_the_policy_or_the_split():
    """SmolLM2-135M's shape at 32k tokens a row in bf16 (the plan: 29 GiB at ac=none, 15 at op,
    6.6 at full, 16 at cp=2): what fits in 20, 64, 160 and 8 GiB."""
    smol = {**RUN, "n_layer": 30, "n_embd": 576, "n_head": 9, "n_kv_head": 3, "ffn_dim": 1536,
            "vocab_size": 49152, "tie_embeddings": True, "block_size": 32768, "batch_size": 1,
            "dtype": "bfloat16", "loss_chunk": 4096, "ac": "none", "offload_activations": False}
    gib = 2 ** 30
    assert memory_plan.what_fits(smol, 1, 20 * gib) == "ac=op, or cp=2 (on 2 ranks)"
    assert memory_plan.what_fits({**smol, "batch_size": 4}, 1, 20 * gib) == (
        "ac=full, or cp=8 (on 8 ranks)")
    assert memory_plan.what_fits({**smol, "batch_size": 4}, 1, 160 * gib) == ""
    assert memory_plan.what_fits({**smol, "batch_size": 4}, 1, 64 * gib) == (
        "batch_size=2, or ac=op, or cp=2 (on 2 ranks)")
    assert memory_plan.what_fits({**smol, "batch_size": 4}, 1, 8 * gib) == "a smaller model"


@pytest.mark.parametrize("given, says", [
    ({"ac": "layers:0"}, "ac='layers:0' is not 'none', 'full', 'op' or 'layers:K'"),
    ({"ac": "selective"}, "ac='selective' is not 'none', 'full', 'op' or 'layers:K'"),
    ({"ac": "op", "grad_ckpt": True}, "grad_ckpt=True is ac='full', but ac='op' is given too")])
def test_a_policy_misspelt_is_one_line(given, says, tmp_path):
    import configurator
    from guards.guard_errors import UserError
    defaults = configurator.script_defaults(os.path.join(ROOT, "train.py"))
    with pytest.raises(UserError, match=re.escape(says)):
        validate_as_train({**defaults, **given, "out_dir": str(tmp_path / "out")}, given, 1)
