"""Attention inside each document (doc_attention.py): each document's own causal attention
equals one SDPA over the row with the dense document mask, forward and backward, with GQA, one-
token documents (packing's padding) and rows of different shapes; under every layout doc_mask
runs on, the runs of the other test files compare it with the dense reference (test_sft.py's
sft_single and test_long.py's single process run doc_attention=dense)."""

import pytest
import torch
import torch.nn.functional as F

import data
from model import ModelConfig, Transformer
from techniques.doc_attention import Documents, document_mask


def packed_rows(B, T, eot, seed, pad_from=None):
    """(B, T) token rows with documents of random lengths; row 0 ends in padding (one eot per
    position, as packing.py pads) from pad_from on."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, 50, (B, T), generator=g)
    x[torch.rand(B, T, generator=g) < 0.08] = eot
    if pad_from is not None:
        x[0, pad_from:] = eot
    return x


def dense_attention(q, k, v, ids):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(ids))


def each_document(q, k, v, ids):
    return Documents(ids).attend(q, k, v, lambda q, k, v, m: F.scaled_dot_product_attention(
        q, k, v, attn_mask=m, is_causal=m is None, enable_gqa=k.shape[1] != q.shape[1]))


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_each_documents_attention_equals_the_dense_mask(kv_heads):
    B, H, T, hd = 3, 4, 96, 8
    ids = data.doc_ids(packed_rows(B, T, 0, seed=kv_heads, pad_from=70), 0)
    docs = Documents(ids)
    lengths = sorted(g.shape[1] for g in docs.groups)
    assert lengths[0] == 1 and len(lengths) > 3  # one-token documents (the padding) and others
    assert sum(g.numel() for g in docs.groups) == B * T  # every position in one document
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, H, T, hd, generator=g, requires_grad=True)
    k, v = (torch.randn(B, kv_heads, T, hd, generator=g, requires_grad=True) for _ in range(2))
    grads = []
    outs = []
    for attention in (dense_attention, each_document):
        y = attention(q, k, v, ids)
        (y * torch.linspace(-1, 1, hd)).sum().backward()
        outs.append(y.detach())
        grads.append([t.grad.clone() for t in (q, k, v)])
        for t in (q, k, v):
            t.grad = None
    # the same sums of the same float32 terms, in another order: rounding of a few ulps of the
    # values (|y| < 1 here); a document mask gone wrong moves them by the size of the values
    assert torch.allclose(outs[0], outs[1], atol=1e-5, rtol=0)
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)
    # can fail: attending over the whole row (plain causal) differs by far more
    whole = F.scaled_dot_product_attention(q, k.repeat_interleave(H // kv_heads, 1),
                                           v.repeat_interleave(H // kv_heads, 1), is_causal=True)
    assert (whole.detach() - outs[0]).abs().max() > 1e-2


def test_the_model_with_each_documents_attention_equals_the_dense_reference(monkeypatch):
    """A whole model, forward and backward, under bf16 autocast too (where the CPU attention runs
    in float32 and recomputes): doc_attention='varlen' and 'dense' give the same losses and
    gradients; and each ran its own path (the numbers alone would not tell: varlen builds no
    T x T mask, dense builds it once)."""
    import model as model_py
    made = []

    class Seen(Documents):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)
    monkeypatch.setattr(model_py, "Documents", Seen)
    x = packed_rows(2, 48, 0, seed=3, pad_from=40)
    ids = data.doc_ids(x, 0)
    results = {}
    for kind in ("dense", "varlen"):
        for autocast in (False, True):
            torch.manual_seed(0)
            model = Transformer(ModelConfig(vocab_size=64, block_size=48, n_layer=2, n_head=4,
                                            n_kv_head=2, n_embd=32, doc_attention=kind))
            made.clear()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                losses, loss = model(x, x.roll(-1, 1), doc_ids=ids)
            assert made and all((d.mask is not None) == (kind == "dense") for d in made), kind
            loss.backward()
            results[kind, autocast] = (losses.detach().float(),
                                       [p.grad.float() for p in model.parameters()])
    for autocast, tol in ((False, 1e-5), (True, 2e-2)):
        # bf16: both attend in float32 from the same bf16 q, k, v, but the matmuls around them
        # round to bf16 (8 bits): a few 1e-3 on losses of ~4
        (la, ga), (lb, gb) = results["dense", autocast], results["varlen", autocast]
        assert torch.allclose(la, lb, atol=tol, rtol=0)
        for a, b in zip(ga, gb):
            assert torch.allclose(a, b, atol=tol, rtol=tol)
    # can fail: without the documents the losses differ
    torch.manual_seed(0)
    plain = Transformer(ModelConfig(vocab_size=64, block_size=48, n_layer=2, n_head=4,
                                    n_kv_head=2, n_embd=32))
    with torch.no_grad():
        assert (plain(x, x.roll(-1, 1))[0] - results["dense", False][0]).abs().max() > 1e-3


def test_under_torch_compile_the_documents_take_the_dense_mask_in_one_graph():
    """Compiled, a batch's documents (new lengths in every batch) would compile again and again:
    under torch.compile the model takes the dense mask, one graph for every batch, with the
    losses of the uncompiled model (each document's own attention)."""
    import torch._dynamo
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4,
                                    n_kv_head=2, n_embd=32))
    compiled = torch.compile(model)
    for seed in range(3):
        x = packed_rows(2, 32, 0, seed=seed)
        ids = data.doc_ids(x, 0)
        with torch.no_grad():
            # (inductor fuses the float32 sums in its own order: a few ulps of losses of ~4)
            assert torch.allclose(compiled(x, x, doc_ids=ids)[0], model(x, x, doc_ids=ids)[0],
                                  atol=1e-5, rtol=0)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
