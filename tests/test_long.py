"""Long sequences: sequence parallelism inside tp (tensor_parallel.py, sp=True) and context
parallelism (context_parallel.py, cp=N) on real gloo processes. A sharded model's loss and
gathered gradients against the single process, the dropout streams of the sequence slices,
then train.py under torchrun: the single-process curve."""

import dataclasses
import os

import pytest
import torch
from conftest import REFERENCE, assert_same_curve, read_metrics, run_train, spawn, torchrun

import parallel
from model import ModelConfig, Transformer
from techniques import context_parallel
from techniques import tensor_parallel

CFG = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_dim=64)


def batch():
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 64, (2, 17), generator=g)
    mask = (torch.rand(2, 16, generator=g) < 0.6).long()
    return data[:, :-1], data[:, 1:], mask


def documents():
    """doc_ids (2, 16): packed rows of a few documents each."""
    return torch.cumsum(
        (torch.rand(2, 16, generator=torch.Generator().manual_seed(3)) < 0.2).long(), 1)


def full_grads(model):
    """name -> the full gradient (tp slices gathered)."""
    return {n: parallel.tp_gather(p.grad, p) if hasattr(p, "_split_dim") else p.grad
            for n, p in model.named_parameters()}


def sp_checks(mesh):
    out = {}
    # the head and loss whole and in chunks; a tied head
    for chunk, tie in ((0, False), (8, True)):
        torch.manual_seed(0)
        model = Transformer(ModelConfig(**CFG, loss_chunk=chunk, tie_embeddings=tie))
        tensor_parallel.tensor_parallel(model, mesh, sp=True)
        x, y, mask = batch()
        seen = []  # what a block holds: this rank's slice of the sequence
        model.layers["0"].register_forward_hook(lambda m, args, o: seen.append(tuple(o.shape)))
        _, loss = model(x, y, mask)
        loss.backward()
        out[f"model_{chunk}_{tie}"] = (loss.detach(), full_grads(model), seen[0])
    # dropout under sp: the embedding's and each block's residual dropout of each slice draw a
    # stream of their tp rank's own, and the shared stream (which LoRA's dropout on the gathered
    # input uses) moves on alike
    torch.manual_seed(0)
    model = tensor_parallel.tensor_parallel(Transformer(ModelConfig(**{**CFG, "dropout": 0.5})),
                                            mesh, sp=True)
    masks = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Dropout):  # the first mask each draws
            m.register_forward_hook(lambda m, args, o, name=name: masks.setdefault(name, o == 0))
    torch.manual_seed(1)  # the shared stream (train.py: seed + rank // tp)
    model(batch()[0], batch()[1])[1].backward()
    out["masks"], out["after"] = masks, torch.get_rng_state()
    return out


def test_sequence_parallel_model_equals_single_process():
    ranks = spawn(sp_checks, 2, tp=2)
    for chunk, tie in ((0, False), (8, True)):
        torch.manual_seed(0)
        model = Transformer(ModelConfig(**CFG, loss_chunk=chunk, tie_embeddings=tie))
        x, y, mask = batch()
        _, loss = model(x, y, mask)
        loss.backward()
        for rank in ranks:
            got, grads, seen = rank[f"model_{chunk}_{tie}"]
            assert seen == (2, 8, 32)  # (B, T / tp, n_embd): really split
            torch.testing.assert_close(got, loss.detach(), rtol=1e-5, atol=1e-6)
            for n, p in model.named_parameters():  # the norm gains too: summed over the slices
                torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)
    a, b = ranks
    assert sorted(a["masks"]) == ["drop", "layers.0.drop", "layers.1.drop"]
    for name, mask in a["masks"].items():
        assert mask.shape == (2, 8, 32) and not torch.equal(mask, b["masks"][name]), name
    assert torch.equal(a["after"], b["after"])


# ---- train.py under torchrun ------------------------------------------------------------
# (the fsdp=2 run recomputes each block in backward: the all-gathers and reduce-scatters run again)
@pytest.mark.parametrize("nproc, layout",
                         [(2, ["tp=2", "sp=True"]),
                          (4, ["tp=2", "sp=True", "fsdp=True", "grad_ckpt=True"])],
                         ids=["tp2-sp", "tp2-fsdp2-sp-grad_ckpt"])
def test_torchrun_sp_gives_the_single_process_curve(nproc, layout, dataset, reference_run,
                                                    tmp_path):
    out = str(tmp_path / "run")
    p = torchrun(nproc, [*REFERENCE, f"dataset={dataset}", f"out_dir={out}", *layout],
                 cwd=tmp_path)
    assert f"dp={nproc // 2} x pp=1 x tp=2" in p.stdout
    assert_same_curve(reference_run, read_metrics(out))


# ---- context parallel -------------------------------------------------------------------
def cp_checks(mesh):
    """A model under context parallelism on all the spawned ranks (their dp grid taken as the
    cp group): its loss and gradients (averaged over cp), with and without a document mask, by
    the ring and by the all-gather."""
    mesh = dataclasses.replace(mesh, cp=mesh.dp, cp_rank=mesh.dp_rank, cp_group=mesh.dp_group,
                               dp=1, dp_rank=0)
    out = {"positions": context_parallel.positions(16, mesh.cp, mesh.cp_rank)}
    for ring in (True, False):
        for doc in (False, True):
            torch.manual_seed(0)
            model = context_parallel.context_parallel(Transformer(ModelConfig(**CFG)), mesh, ring)
            x, y, mask = batch()
            _, loss = model(x, y, mask, documents() if doc else None)
            loss.backward()
            context_parallel.sum_gradients(list(model.parameters()), mesh)  # the sum over cp
            out[f"{ring}_{doc}"] = (loss.detach(),
                                    {n: p.grad for n, p in model.named_parameters()})
    return out


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_model_equals_single_process(cp):
    ranks = spawn(cp_checks, cp)
    c = 16 // (2 * cp)  # rank r holds chunks r and 2 cp - 1 - r: together every position once
    assert torch.equal(ranks[0]["positions"], torch.tensor([*range(c), *range(16 - c, 16)]))
    assert sorted(torch.cat([r["positions"] for r in ranks]).tolist()) == list(range(16))
    for doc in (False, True):
        torch.manual_seed(0)
        model = Transformer(ModelConfig(**CFG, doc_attention="dense"))  # the reference's mask
        x, y, mask = batch()
        _, loss = model(x, y, mask, documents() if doc else None)
        loss.backward()
        for rank in ranks:
            for ring in (True, False):
                got, grads = rank[f"{ring}_{doc}"]
                torch.testing.assert_close(got, loss.detach(), rtol=1e-5, atol=1e-6)
                for n, p in model.named_parameters():
                    torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6,
                                               msg=f"{n} ring={ring}")


def test_context_parallel_refuses_a_sliding_window_shorter_than_the_sequence():
    """The ring and the all-gather build causal (and document) masks, no window: a Mistral base
    whose window is shorter than block_size is refused in one line, not trained without it."""
    from types import SimpleNamespace
    from guards.guard_errors import UserError
    model = Transformer(ModelConfig(**{**CFG, "sliding_window": 8}))
    with pytest.raises(UserError, match=r"sliding_window=8 is shorter than block_size=16: context "
                                        r"parallelism \(cp=2\) has no sliding window"):
        context_parallel.context_parallel(model, SimpleNamespace(cp=2))


def test_one_run_moves_between_context_parallel_and_one_process(dataset, reference_run, tmp_path):
    """One out_dir, 8 iterations of REFERENCE, each leg resuming the last: cp=2 -> one process
    -> cp=2 x dp=2 (grad_ckpt) -> cp=2 x fsdp=2. The chain is the single-process curve: a cp
    checkpoint loads into one process and back, and every leg trains like one process. The
    first leg ends with the sample every run ends with by default (its model read back whole)."""
    out = str(tmp_path / "run")
    chain = [a for a in REFERENCE if not a.startswith("max_iters=")] + [
        f"dataset={dataset}", "lr_decay_iters=8", "keep_ckpts=0", f"out_dir={out}",
        "init_from=auto"]
    p = torchrun(2, [*chain, "max_iters=2", "cp=2", "sample_tokens=8"], cwd=tmp_path)
    # sampled on one process, without cp
    assert "dp=1 x pp=1 x cp=2" in p.stdout and " sample " in p.stdout
    run_train([*chain, "max_iters=4"], cwd=tmp_path, fork=True)
    p = torchrun(4, [*chain, "max_iters=6", "cp=2", "grad_ckpt=True", "ddp_bucket_mb=0.01"],
                 cwd=tmp_path)
    assert "dp=2 x pp=1 x cp=2" in p.stdout
    torchrun(4, [*chain, "max_iters=8", "cp=2", "fsdp=True"], cwd=tmp_path)
    assert_same_curve(reference_run, read_metrics(out))
    assert (sorted(os.listdir(os.path.join(out, "ckpt")))[:4]
            == [f"iter_{i:07d}" for i in (2, 4, 6, 8)])


@pytest.mark.parametrize("args, world, message", [
    ({"sp": True}, 1, "sp=True splits the sequence over the tensor-parallel ranks, but tp=1"),
    ({"sp": True, "tp": 2, "block_size": 63}, 2, "block_size=63 does not divide by 2"),
    ({"sp": True, "tp": 2, "pp": 2}, 4, "sequence parallelism does not yet pass sequence slices"),
    ({"cp": 2, "tp": 2}, 4, "context parallelism does not yet"),
    ({"cp": 2, "zero": 1}, 4, "context parallelism does not yet"),
    ({"cp": 4, "block_size": 60}, 4, "cuts each sequence in 2 x cp = 8 equal chunks"),
    ({"cp": 2}, 3, "cp=2 x tp=1 does not divide the 3 ranks"),
])
def test_a_long_sequence_layout_mistake_is_one_line(args, world, message):
    import configurator
    from guards.guard_errors import UserError
    from conftest import ROOT, validate_as_train
    config = {**configurator.script_defaults(os.path.join(ROOT, "train.py")), **args}
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace("+", r"\+")):
        validate_as_train(config, args, world)


def test_sp_and_cp_with_the_options_that_change_what_trains(dataset, tmp_path):
    """Muon, tied embeddings, the chunked head + loss and document masks, in one process (the
    dense mask) and under tp=2 sp x zero=1 (dp=2) and cp=2 x torch DDP (dp=2): the same curve.
    learning_rate=3e-3: at REFERENCE's 1e-2 the tied embedding learns at 0.1 (embed_lr_scale),
    where AdamW's first steps (about lr x sign(g)) turn float32 rounding into a difference of
    4.1e-4 in one grad norm of cp=2 on an AVX512-BF16 CPU (2.6e-7 the step before); at 3e-3
    the largest is 2.7e-7."""
    args = [*REFERENCE, f"dataset={dataset}", "optim=muon", "tie_embeddings=True", "loss_chunk=24",
            "doc_mask=True", "learning_rate=3e-3", "min_lr=3e-4"]
    # the single process with the dense document mask; the layouts attend within each document
    # (doc_attention's default; cp's ring builds each block's mask from the document ids)
    run_train([*args, f"out_dir={tmp_path / 'single'}", "doc_attention=dense"], cwd=tmp_path,
              fork=True)
    single = read_metrics(tmp_path / "single")
    torchrun(4, [*args, f"out_dir={tmp_path / 'sp'}", "tp=2", "sp=True", "zero=1"], cwd=tmp_path)
    assert_same_curve(single, read_metrics(tmp_path / "sp"))
    torchrun(4, [*args, f"out_dir={tmp_path / 'cp'}", "cp=2", "ddp_impl=torch"], cwd=tmp_path)
    assert_same_curve(single, read_metrics(tmp_path / "cp"))


def test_lora_under_sp_and_cp(hf_dir, dataset, tmp_path):
    """LoRA adapters on every linear of a Hugging Face base: tp=2 sp and cp=2 train the
    single-process curve (the adapters sliced like their bases under tp; whole under cp)."""
    from conftest import RUN
    args = [*RUN, f"dataset={dataset}", f"init_from={hf_dir}", "max_iters=6", "lora_rank=4",
            "lora_alpha=8", "lora_targets=wq,wk,wv,wo,w1,w2,w3,output", "grad_clip=0.5"]
    run_train([*args, f"out_dir={tmp_path / 'single'}"], cwd=tmp_path, fork=True)
    for name, layout in (("sp", ["tp=2", "sp=True"]), ("cp", ["cp=2"])):
        p = torchrun(2, [*args, f"out_dir={tmp_path / name}", *layout], cwd=tmp_path)
        assert "lora: r=4" in p.stdout
        assert_same_curve(read_metrics(tmp_path / "single"), read_metrics(tmp_path / name))
