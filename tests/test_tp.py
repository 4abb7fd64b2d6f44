"""Tensor parallel on real gloo processes: the vocabulary-parallel loss against
F.cross_entropy, a sharded model against the single-process one, one block against torch's
own tensor parallel (parallelize_module), then train.py under torchrun: the single-process
curve at tp=2, tp=2 x pp=2 and tp=2 x dp=2, and checkpoints moved between tp layouts."""


import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import (
    INTERLEAVED,
    REFERENCE,
    TINY,
    assert_same_curve,
    read_metrics,
    run_train,
    spawn,
    torchrun,
)

import parallel
from model import Block, ModelConfig, Transformer, masked_mean
from guards import guard_ckpt
from guards.guard_errors import UserError
from techniques import tensor_parallel

CFG = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_dim=64)


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 64, (2, 17), generator=g)
    mask = (torch.rand(2, 16, generator=g) < 0.6).long()
    return data[:, :-1], data[:, 1:], mask


def head_and_input():
    """A final hidden state (2, 16, 32) and a head (64, 32), with large logits."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 16, 32, generator=g), torch.randn(64, 32, generator=g)


def gathered_grads(model):
    """name -> the full gradient (tp slices gathered), for comparison with the whole model's."""
    return {n: parallel.tp_gather(p.grad, p) if hasattr(p, "_split_dim") else p.grad
            for n, p in model.named_parameters()}


def tp_checks(mesh):
    out = {}
    # the vocabulary-parallel loss of this rank's slice of a head, all at once and in chunks of
    # 5 rows, against F.cross_entropy on the whole logits
    h, w = head_and_input()
    _, y, mask = batch()
    y = y.clone()
    y[0, 3] = -100  # F.cross_entropy's ignore_index: no loss, no gradient
    V, r = 64 // mesh.tp, mesh.tp_rank
    for chunk, keep in ((0, False), (5, False), (5, True)):  # keep: the softmax kept for backward
        for masked in (False, True):
            x = h.clone().requires_grad_()
            head = nn.Linear(32, V, bias=False)
            head.weight = nn.Parameter(w[r * V:(r + 1) * V].clone())
            head.register_forward_pre_hook(
                lambda m, a: (tensor_parallel.CopyToTP.apply(a[0], mesh.tp_group),))
            losses = tensor_parallel.vocab_parallel_losses(x, head, y, chunk, keep, start=r * V,
                                                           group=mesh.tp_group)
            loss = masked_mean(losses, mask if masked else None)
            loss.backward()
            out[f"ce_{chunk}{'k' * keep}_{masked}"] = (loss.detach(), x.grad, head.weight.grad)
    # a whole model, sharded (the head and loss whole, and chunked):
    # its loss and gathered gradients
    for chunk, keep in ((0, False), (8, False), (8, True)):
        torch.manual_seed(0)
        cfg = ModelConfig(**CFG, loss_chunk=chunk, loss_recompute=not keep)
        model = tensor_parallel.tensor_parallel(Transformer(cfg), mesh)
        x, y, mask = batch()
        _, loss = model(x, y, mask)
        loss.backward()
        out[f"model_{chunk}{'k' * keep}"] = (loss.detach(), gathered_grads(model))
    out["local_shapes"] = {n: tuple(p.shape) for n, p in model.named_parameters()}
    # clipping counts slices once each and replicated norm gains once
    out["norm"] = parallel.clip_grad_norm_(model.parameters(), 0.0, mesh)
    return out


def attention_dropout(mesh):
    """The masks that attention dropout draws (recorded from the stream SDPA would use: the
    same F.dropout draw, SDPA then run without dropout) and the shared stream afterwards."""
    import model as model_py
    masks, sdpa = [], model_py.F.scaled_dot_product_attention

    def recording_sdpa(q, k, v, dropout_p=0.0, **kw):
        # (B, local heads, T, T)
        masks.append(F.dropout(torch.ones(*q.shape[:3], k.shape[2]), dropout_p) > 0)
        return sdpa(q, k, v, **kw)
    model_py.F.scaled_dot_product_attention = recording_sdpa  # this spawned process only
    torch.manual_seed(0)
    model = tensor_parallel.tensor_parallel(Transformer(ModelConfig(**{**CFG, "dropout": 0.5})),
                                            mesh)
    # the shared stream, the same on both tp ranks (train.py: seed + rank // tp)
    torch.manual_seed(1)
    x, y, _ = batch()
    model(x, y)[1].backward()
    return {"masks": masks, "after": torch.get_rng_state()}


def test_attention_dropout_masks_differ_across_tp_ranks_and_the_shared_stream_does_not():
    a, b = spawn(attention_dropout, 2, tp=2)
    # 2 layers, 2 of the 4 heads each
    assert len(a["masks"]) == 2 and a["masks"][0].shape == (2, 2, 16, 16)
    for ma, mb in zip(a["masks"], b["masks"]):
        assert not torch.equal(ma, mb)  # rank 1's heads 2, 3 do not repeat rank 0's heads 0, 1
    # the residual and embedding dropouts (replicated activations) draw alike on both ranks
    assert torch.equal(a["after"], b["after"])


def test_vocab_parallel_loss_and_sharded_model_equal_single_process():
    ranks = spawn(tp_checks, 2, tp=2)
    _, y, mask = batch()
    y = y.clone()
    y[0, 3] = -100
    for masked in (False, True):
        h, w = (t.requires_grad_() for t in head_and_input())
        ce = F.cross_entropy((h @ w.T).flatten(0, 1), y.flatten(), reduction="none")
        # as masked_mean: the -100 counts as a 0
        m = mask.flatten().float() if masked else torch.ones(32)
        ref = (ce * m).sum() / m.sum()
        ref.backward()
        for chunk in (0, 5, "5k"):
            for r, rank in enumerate(ranks):
                loss, grad_h, grad_w = rank[f"ce_{chunk}_{masked}"]
                torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(grad_h, h.grad, rtol=1e-5, atol=1e-7)
                torch.testing.assert_close(grad_w, w.grad[r * 32:(r + 1) * 32], rtol=1e-5,
                                           atol=1e-7)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**CFG))
    x, y, mask = batch()
    _, loss = model(x, y, mask)
    loss.backward()
    norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters()))
    for rank in ranks:
        for chunk in (0, 8, "8k"):
            torch.testing.assert_close(rank[f"model_{chunk}"][0], loss.detach(), rtol=1e-5,
                                       atol=1e-6)
            for n, p in model.named_parameters():
                torch.testing.assert_close(rank[f"model_{chunk}"][1][n], p.grad, rtol=1e-5,
                                           atol=1e-6, msg=n)
        torch.testing.assert_close(rank["norm"], norm, rtol=1e-5, atol=1e-6)
    # really sharded: whole heads, half the width, half the vocabulary
    shapes = ranks[0]["local_shapes"]
    assert (shapes["layers.0.attention.wq.weight"] == (16, 32)
            and shapes["layers.0.attention.wk.weight"] == (8, 32))
    assert (shapes["layers.0.attention.wo.weight"] == (32, 16)
            and shapes["layers.0.feed_forward.w2.weight"] == (32, 32))
    assert shapes["tok_embeddings.weight"] == (32, 32) and shapes["output.weight"] == (32, 32)
    assert shapes["norm.weight"] == (32,)


def test_a_vocabulary_tp_does_not_divide_is_one_line():
    mesh = parallel.Mesh(rank=0, local_rank=0, world=2, dp=1, pp=1, dp_rank=0, pp_rank=0,
                         device=torch.device("cpu"), backend="gloo", tp=2)
    with pytest.raises(UserError, match="tp=2 does not divide vocab_size=63"):
        tensor_parallel.tensor_parallel(Transformer(ModelConfig(**{**CFG, "vocab_size": 63})),
                                        mesh)


def block_peer(mesh):
    """One block, sharded by us and by torch's parallelize_module (Colwise / Rowwise): the same
    input, output and gradients."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from model import rope_tables
    cfg = ModelConfig(**CFG)
    cos, sin = rope_tables(cfg.n_embd // cfg.n_head, 16, cfg.rope_theta)
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(2))
    out = {}
    for impl in ("ours", "torch"):
        torch.manual_seed(0)
        block = Block(cfg)
        if impl == "ours":
            # tensor_parallel shards a model (or a stage)
            holder = Transformer(ModelConfig(**{**CFG, "n_layer": 1}))
            holder.layers["0"] = block
            holder.tok_embeddings = holder.output = None
            tensor_parallel.tensor_parallel(holder, mesh)
        else:
            parallelize_module(block, mesh.tp_mesh, {
                **{f"attention.{n}": ColwiseParallel() for n in ("wq", "wk", "wv")},
                "attention.wo": RowwiseParallel(),
                **{f"feed_forward.{n}": ColwiseParallel() for n in ("w1", "w3")},
                "feed_forward.w2": RowwiseParallel()})
        xi = x.clone().requires_grad_()
        y = block(xi, cos, sin)
        y.pow(2).sum().backward()
        local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
        out[impl] = {"y": y.detach(), "x_grad": xi.grad,
                     "grads": {n: local(p.grad) for n, p in block.named_parameters()}}
    return out


def test_block_equals_torch_tensor_parallel():
    for rank in spawn(block_peer, 2, tp=2):
        ours, theirs = rank["ours"], rank["torch"]
        torch.testing.assert_close(ours["y"], theirs["y"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours["x_grad"], theirs["x_grad"], rtol=1e-5, atol=1e-6)
        assert set(ours["grads"]) == set(theirs["grads"])
        for n, g in ours["grads"].items():
            torch.testing.assert_close(g, theirs["grads"][n], rtol=1e-5, atol=1e-6, msg=n)


# ---- train.py under torchrun --------------------------------------------------------------
# REFERENCE trains 8 iterations; these run 10 with a clip that clips (the logged grad norms
# are well above 0.3), with 4 micro-batches of gradient accumulation
CLIPPED = [*REFERENCE, "max_iters=10", "grad_clip=0.3", "ffn_dim=64"]


@pytest.fixture(scope="module")
def clipped_run(dataset, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("clipped") / "run")
    run_train([*CLIPPED, f"dataset={dataset}", f"out_dir={out}"],
              cwd=tmp_path_factory.getbasetemp(), fork=True)
    rows = read_metrics(out)
    assert sum(r["grad_norm"] > 0.3 for r in rows if "grad_norm" in r) >= 5  # the clip is active
    return rows


# (the dp=2 run also recomputes each block in backward: the forward all-reduces run again there;
# the tp=2 run is compiled: the sharded blocks, their collectives and the vocabulary-parallel loss;
# the pipeline is interleaved, two chunks a stage: tp x pp with 1F1B is a leg of test_fsdp.py's
# chain)
@pytest.mark.parametrize("nproc, layout",
                         [(2, ["tp=2", "compile=True"]), (4, ["tp=2", *INTERLEAVED]),
                          (4, ["tp=2", "grad_ckpt=True"])],
                         ids=["tp2-compile", "tp2-interleaved", "tp2-dp2-grad_ckpt"])
def test_torchrun_tp_gives_the_single_process_curve(nproc, layout, dataset, clipped_run, tmp_path):
    out = str(tmp_path / "run")
    p = torchrun(nproc,
                 [*CLIPPED, f"dataset={dataset}", f"out_dir={out}", *layout, "ddp_bucket_mb=0.01"],
                 cwd=tmp_path)
    pp = 2 if "pp=2" in layout else 1
    assert f"dp={nproc // 2 // pp} x pp={pp} x tp=2" in p.stdout
    assert_same_curve(clipped_run, read_metrics(out),
                      rtol=1e-3 if "compile=True" in layout else 3e-4)
    # the first step's time, compiling included, said apart (once, by rank 0)
    assert p.stdout.count("compile: the first step took") == ("compile=True" in layout)


def watch_streams(rank):
    """before= of torchrun, in each rank of a run: at every checkpoint save, writes what this
    rank holds of the replicated parameters (not tp slices: norm gains) and the random state
    at its first attention calls with dropout (the draw SDPA makes for this rank's heads)."""
    import os

    import checkpoint
    import model as model_py
    seen, sdpa, save = [], model_py.F.scaled_dot_product_attention, checkpoint.train_state

    def recording_sdpa(*args, dropout_p=0.0, **kw):
        if dropout_p > 0 and len(seen) < 4:
            seen.append(torch.get_rng_state())
        return sdpa(*args, dropout_p=dropout_p, **kw)

    def train_state(model, optimizer):
        replicated = {n: p.detach().clone() for n, p in model.named_parameters()
                      if not hasattr(p, "_split_dim")}
        n = len([f for f in os.listdir() if f.startswith(f"watch_{rank}_")])
        torch.save({"replicated": replicated, "attention": seen}, f"watch_{rank}_{n}.pt")
        return save(model, optimizer)
    model_py.F.scaled_dot_product_attention = recording_sdpa  # this rank's process only
    checkpoint.train_state = train_state


def test_tp_dp_streams_with_dropout_and_their_resume(dataset, tmp_path):
    """tp=2 x dp=2 with dropout on. (a) A tp group shares one random stream (train.py seeds
    seed + rank // tp): each rank's saved stream equals its tp partner's and differs from the
    other group's, the replicated parameters (norm gains) stay identical on every rank at each
    save, and each tp rank's attention draws from a stream of its own (its heads are other
    heads than its partner's). (b) Stopped at iteration 3 and resumed, the run is the
    uninterrupted one bit for bit (losses, grad norms, val losses, final weights): each rank
    restores its group's saved stream, entry (rank // tp) * saved tp of the checkpoint."""
    import os
    import shutil

    import checkpoint
    full, half = str(tmp_path / "full"), str(tmp_path / "half")
    common = [*TINY, f"dataset={dataset}", "dropout=0.1", "tp=2", "max_iters=6",
              "lr_decay_iters=6", "ckpt_interval=3", "keep_ckpts=0", "ddp_bucket_mb=0.01"]
    watch = tmp_path / "watch"
    watch.mkdir()
    torchrun(4, [*common, f"out_dir={full}"], cwd=watch, before=watch_streams)
    _, state = guard_ckpt.read_meta(os.path.join(full, "ckpt", "iter_0000003"))
    rng = state["rng_cpu"]
    assert (torch.equal(rng[0], rng[1]) and torch.equal(rng[2], rng[3])
            and not torch.equal(rng[0], rng[2]))
    for save in (0, 1):  # iterations 3 and 6
        ranks = [torch.load(watch / f"watch_{r}_{save}.pt", weights_only=True) for r in range(4)]
        assert ranks[0]["replicated"] and all(n.endswith("norm.weight")
                                              for n in ranks[0]["replicated"])
        for r in ranks[1:]:
            for n, t in ranks[0]["replicated"].items():
                assert torch.equal(r["replicated"][n], t), (save, n)
        # each tp rank: its own stream for its heads
        for a, b in ((ranks[0], ranks[1]), (ranks[2], ranks[3])):
            assert len(a["attention"]) == 4
            assert not any(torch.equal(x, y) for x, y in zip(a["attention"], b["attention"]))
    # (b): the same run stopped after its checkpoint at 3, then resumed
    shutil.copytree(full, half)
    shutil.rmtree(os.path.join(half, "ckpt", "iter_0000006"))
    torchrun(4, [*common, f"out_dir={half}"], cwd=tmp_path)
    assert_same_curve(read_metrics(full), read_metrics(half), exact=True)
    want, got = (checkpoint.load_whole(os.path.join(d, "ckpt", "iter_0000006"))[0].state_dict()
                 for d in (full, half))
    assert all(torch.equal(want[n], got[n]) for n in want), \
        [n for n in want if not torch.equal(want[n], got[n])]
