"""Attention inside each document (doc_mask=True) at T = 512, 2,048 and 8,192, documents of ~500
tokens (250 to 750), one row of SmolLM2-135M's attention (9 query heads, 3 key/value heads of 64),
forward and backward: plain causal attention over the whole row (no documents: what doc_mask
must not cost more than), the dense (B, 1, T, T) mask (doc_attention=dense, the reference) and
each document's own attention (doc_attention=varlen, the default). ms (median) and the peak
memory above the inputs (CUDA: max allocated; CPU: max RSS), each row in a fresh process."""

import torch
import torch.nn.functional as F

import data
from techniques.doc_attention import Documents

from bench.base import ITERS, SMOKE, in_subprocess, peak_and_median

HEADS, KV_HEADS, HEAD_DIM = (4, 2, 8) if SMOKE else (9, 3, 64)


def docmask_row(kind, T, seed=0):
    """One attention's forward and backward at length T: median ms and peak MB above the inputs."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(seed)
    ends = torch.cumsum(torch.randint(250, 751, (T // 250 + 1,), generator=g), 0)
    x = torch.ones(1, T, dtype=torch.long)
    x[0, ends[ends < T]] = 0  # a document ends at each 0
    ids = data.doc_ids(x, 0).to(device)
    q = torch.randn(1, HEADS, T, HEAD_DIM, generator=g).to(device).requires_grad_()
    k, v = (torch.randn(1, KV_HEADS, T, HEAD_DIM, generator=g).to(device).requires_grad_()
            for _ in range(2))

    def sdpa(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=m is None,
                                              enable_gqa=k.shape[1] != q.shape[1])

    def step():  # (the documents found, or the dense mask built, once a forward: timed with it)
        docs = None if kind == "causal" else Documents(ids, dense=kind == "dense")
        y = sdpa(q, k, v, None) if kind == "causal" else docs.attend(q, k, v, sdpa)
        y.sum().backward()
        q.grad = k.grad = v.grad = None
    return peak_and_median(step, device)


def table_docmask(lengths=(512, 2048, 8192)):
    print(f"\n## doc_mask: one attention ({HEADS} heads, {KV_HEADS} kv heads of {HEAD_DIM}), "
          f"forward + backward, documents of 250-750 tokens, median of {ITERS}")
    print(f"{'T':>6} | {'causal ms':>9} | {'dense ms':>9} | {'varlen ms':>9} | "
          f"{'varlen/causal':>13} | {'causal MB':>9} | {'dense MB':>8} | {'varlen MB':>9}")
    print("-" * 94)
    for T in lengths:
        r = {kind: in_subprocess("docmask", kind=kind, T=T)
             for kind in ("causal", "dense", "varlen")}
        print(f"{T:6,} | {r['causal']['ms']:9.1f} | {r['dense']['ms']:9.1f} | "
              f"{r['varlen']['ms']:9.1f} | {r['varlen']['ms'] / r['causal']['ms']:12.2f}x | "
              f"{r['causal']['peak_mb']:9.0f} | {r['dense']['peak_mb']:8.0f} | "
              f"{r['varlen']['peak_mb']:9.0f}", flush=True)
