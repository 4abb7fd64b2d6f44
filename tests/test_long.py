"""Long sequences: sequence parallelism inside tp (tensor_parallel.py, sp=True) and context
parallelism (context_parallel.py, cp=N) on real gloo processes. A sharded model's loss and
gathered gradients against the single process, the dropout streams of the sequence slices,
then train.py under torchrun: the single-process curve."""

import pytest
import torch
from conftest import REFERENCE, assert_same_curve, read_metrics, spawn, torchrun

import tensor_parallel
from model import ModelConfig, Transformer

CFG = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_dim=64)


def batch():
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 64, (2, 17), generator=g)
    mask = (torch.rand(2, 16, generator=g) < 0.6).long()
    return data[:, :-1], data[:, 1:], mask


def full_grads(model):
    """name -> the full gradient (tp slices gathered)."""
    return {n: tensor_parallel.tp_gather(p.grad, p) if hasattr(p, "_tp_dim") else p.grad
            for n, p in model.named_parameters()}


def sp_checks(mesh):
    out = {}
    for chunk, tie in ((0, False), (8, True)):  # the head and loss whole and in chunks; a tied head
        torch.manual_seed(0)
        model = Transformer(ModelConfig(**CFG, loss_chunk=chunk, tie_embeddings=tie))
        tensor_parallel.tensor_parallel(model, mesh, sp=True)
        x, y, mask = batch()
        seen = []  # what a block holds: this rank's slice of the sequence
        model.layers["0"].register_forward_hook(lambda m, args, o: seen.append(tuple(o.shape)))
        _, loss = model(x, y, mask)
        loss.backward()
        out[f"model_{chunk}_{tie}"] = (loss.detach(), full_grads(model), seen[0])
    # dropout under sp: the residual dropout of each slice draws a stream of its tp rank's own,
    # and the shared stream (which LoRA's dropout on the gathered input uses) moves on alike
    torch.manual_seed(0)
    model = tensor_parallel.tensor_parallel(Transformer(ModelConfig(**{**CFG, "dropout": 0.5})), mesh, sp=True)
    masks = []
    model.layers["0"].drop.register_forward_hook(lambda m, args, o: masks.append(o == 0))
    torch.manual_seed(1)  # the shared stream (train.py: seed + rank // tp)
    model(batch()[0], batch()[1])[1].backward()
    out["masks"], out["after"] = masks[0], torch.get_rng_state()
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
    assert a["masks"].shape == (2, 8, 32) and not torch.equal(a["masks"], b["masks"])
    assert torch.equal(a["after"], b["after"])


# ---- train.py under torchrun ------------------------------------------------------------
# (the fsdp=2 run recomputes each block in backward: the all-gathers and reduce-scatters run again)
@pytest.mark.parametrize("nproc, layout", [(2, ["tp=2", "sp=True"]), (4, ["tp=2", "sp=True", "fsdp=True", "grad_ckpt=True"])],
                         ids=["tp2-sp", "tp2-fsdp2-sp-grad_ckpt"])
def test_torchrun_sp_gives_the_single_process_curve(nproc, layout, dataset, reference_run, tmp_path):
    out = str(tmp_path / "run")
    p = torchrun(nproc, [*REFERENCE, f"dataset={dataset}", f"out_dir={out}", *layout], cwd=tmp_path)
    assert f"dp={nproc // 2} x pp=1 x tp=2" in p.stdout
    assert_same_curve(reference_run, read_metrics(out))
