"""
Context parallel, by hand: each of the cp ranks holds a part of every sequence, and the
attention's keys and values pass between them (ring attention: Liu et al. 2023,
arXiv:2310.01889; the load-balanced split as in Megatron-LM's context parallelism and Llama 3's
training). context_parallel() applies it to a built model from outside; model.py knows none of it.
"""

from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from model import apply_rope
from guards.guard_errors import check

# Everything in a block but the attention is per token, so a rank that holds a part of the
# sequence runs the norms, matmuls, residuals and the MLP on its part alone, with the whole
# weights (replicated across the cp ranks, as data parallelism replicates them). Only
# attention mixes tokens: a query needs the keys and values of every earlier token, which
# live on other ranks. Two ways to get them here:
#   allgather_attention (the naive one, the test oracle): all-gather K and V (backward:
#   reduce-scatter
#     their gradients, each rank keeping the sum for its own tokens), then one SDPA of the
#     local queries against the whole sequence, with the causal mask at global positions.
#     Memory: the whole K and V of a layer on every rank. It also runs attention dropout.
#   RingAttention: cp steps; at step s a rank holds the K/V block of rank (r - s) mod cp,
#     computes its queries' attention to that block (a partial softmax: the block's output and
#     log-sum-exp), merges it into the running output (the online softmax), and passes the
#     block on to rank r + 1 while receiving the next from r - 1. Backward walks the ring
#     again, each block travelling with the gradient accumulated for it so far, and arriving
#     home after cp steps with the sum over every rank's queries. Memory: two blocks at a time.
# Causality makes a naive contiguous split unfair: the rank with the first T / cp tokens has
# almost nothing to attend to, the last one everything. Cut the sequence into 2 cp chunks and
# give rank r chunks r and 2 cp - 1 - r: every rank then holds one early and one late chunk,
# the same amount of causal work, and of every block but its own exactly half is visible to it
# (_visible), which is all the ring computes.
# RoPE rotates each token by its global position (cos and sin at this rank's positions); the
# loss gathers each token's cross-entropy into the whole (B, T), so every cp rank holds the loss
# of the whole sequence and the token mean is over all of it. Every rank then computes the same
# loss from the same gathered values, so the gather's backward keeps this rank's slice of the
# upstream gradient (GatherLoss; K and V's gather must sum every rank's gradient instead). The
# weights' gradients, each rank's part, are summed over the cp group after backward
# (sum_gradients), as data parallelism sums over its replicas.


def positions(T, cp, rank, device=None):
    """The global positions of rank `rank`'s T / cp tokens: chunks rank and 2 cp - 1 - rank of 2
    cp."""
    c = T // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c, device=device),
                      torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)])


def _order(T, cp, device):
    """(every rank's positions in rank order, the permutation that puts them in sequence order)."""
    ranked = torch.cat([positions(T, cp, r, device) for r in range(cp)])
    return ranked, torch.argsort(ranked)


class GatherSeq(torch.autograd.Function):
    """All-gather the ranks' parts along `dim` into the whole sequence, in sequence order;
    backward, a reduce-scatter: each rank's part gets the sum of every rank's gradient for it."""

    @staticmethod
    def forward(ctx, x, dim, group):
        cp = dist.get_world_size(group)
        ctx.dim, ctx.group = dim, group
        parts = [torch.empty_like(x) for _ in range(cp)]
        dist.all_gather(parts, x.contiguous(), group=group)
        ranked, order = _order(x.shape[dim] * cp, cp, x.device)
        return torch.cat(parts, dim).index_select(dim, order)

    @staticmethod
    def backward(ctx, grad):
        cp = dist.get_world_size(ctx.group)
        ranked, _ = _order(grad.shape[ctx.dim], cp, grad.device)
        parts = [p.contiguous() for p in grad.index_select(ctx.dim, ranked).chunk(cp, ctx.dim)]
        out = torch.empty_like(parts[0])
        dist.reduce_scatter(out, parts, group=ctx.group)
        return out, None, None


class GatherLoss(GatherSeq):
    """GatherSeq for a value every rank then uses alike (the loss): its backward is this rank's
    slice of the gradient, which every rank holds whole and the same."""

    @staticmethod
    def backward(ctx, grad):
        cp, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        ranked, _ = _order(grad.shape[ctx.dim], cp, grad.device)
        return grad.index_select(ctx.dim, ranked).chunk(cp, ctx.dim)[rank], None, None


def allgather_attention(q, k, v, pos, docs, dropout, group):
    """The naive context-parallel attention: q (B, n_head, Tq, hd) at global positions `pos`
    against the whole sequence's K and V (gathered): SDPA with the causal mask of these
    queries' rows (docs, the whole rows' document ids (B, T): and the document mask's)."""
    k, v = GatherSeq.apply(k, 2, group), GatherSeq.apply(v, 2, group)  # (B, n_kv_head, T, hd)
    # causal at global positions: query i sees keys 0..pos[i]
    mask = torch.arange(k.shape[2], device=q.device)[None, :] <= pos[:, None]  # (Tq, T)
    if docs is not None:  # and only its own document's
        mask = (docs.index_select(1, pos)[:, :, None] == docs[:, None, :])[:, None] & mask
    if k.shape[1] != q.shape[1]:  # GQA
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)


def cp_attention(att, mesh, attend, x, cos, sin, mask=None, cache=None):
    """model.Attention.forward for this rank's part of the sequence, x (B, T / cp, n_embd):
    RoPE at the tokens' global positions (cos, sin: the whole sequence's tables), then
    `attend` (allgather_attention or ring_attention) across the cp group."""
    assert cache is None, "generation runs on one process, without context parallelism"
    B, T, C = x.shape
    pos = positions(cos.shape[0], mesh.cp, mesh.cp_rank, x.device)
    q, k, v = att.heads(x)  # (B, n_head or n_kv_head, T / cp, head_dim)
    n_head = q.shape[1]
    cos, sin = cos.index_select(0, pos), sin.index_select(0, pos)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    # a packed row's documents (doc_attention.Documents): each block's mask is built from their
    # ids, never the whole T x T one
    docs = None if mask is None else mask.ids
    y = attend(q, k, v, pos, docs, att.dropout if att.training else 0.0, mesh.cp_group)
    return att.wo(y.transpose(1, 2).reshape(B, T, n_head * att.head_dim))


def cp_losses(inner, mesh, h, head, targets, chunk=0, keep=False):
    """The model's loss_fn (`inner`) on this rank's tokens, h (B, T / cp, n_embd), gathered
    into every target's loss (B, T), in sequence order, the same on every cp rank."""
    pos = positions(targets.shape[1], mesh.cp, mesh.cp_rank, targets.device)
    losses = inner(h, head, targets.index_select(1, pos), chunk, keep)
    return GatherLoss.apply(losses, 1, mesh.cp_group)


def context_parallel(model, mesh, ring=True):
    """Splits `model`'s sequence over mesh.cp_group, in place: after the embedding (and its
    dropout) each rank keeps its tokens (positions()), each attention attends across the
    ranks (ring_attention; ring=False or attention dropout: allgather_attention), and the
    loss is gathered.
    Returns the model; a no-op at cp=1."""
    if mesh.cp == 1:
        return model
    w, T = model.cfg.sliding_window, model.cfg.block_size
    check(not 0 < w < T, f"sliding_window={w} is shorter than block_size={T}: context parallelism "
                         f"(cp={mesh.cp}) has no sliding window; set block_size={w} or drop cp")
    # (the ring has no dropout)
    attend = ring_attention if ring and model.cfg.dropout == 0 else allgather_attention
    for block in model.layers.values():
        block.attention.forward = partial(cp_attention, block.attention, mesh, attend)
    model.drop.register_forward_hook(  # (B, T, n_embd) -> this rank's (B, T / cp, n_embd)
        lambda m, args, x: x.index_select(1,
                                          positions(x.shape[1], mesh.cp, mesh.cp_rank, x.device)))
    model.loss_fn = partial(cp_losses, model.loss_fn, mesh)
    return model


def sum_gradients(params, mesh):
    """After backward: each cp rank's gradient came from its part of the sequences, so
    `params`' gradients become their sum over the cp group, in one all-reduce."""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params
             if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=mesh.cp_group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


# ---- ring attention ---------------------------------------------------------------------


def ring_pass(t, group, tag=0):
    """Starts sending t to the next rank of the ring and receiving the previous rank's:
    (the pending requests, the tensor the previous rank's arrives in). Two messages in flight
    at once carry different tags."""
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    recv = torch.empty_like(t)
    ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(group, (r + 1) % cp), group, tag),
           dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, (r - 1) % cp), group, tag)]
    return dist.batch_isend_irecv(ops), recv


def _visible(r, src, n):
    """Which of this rank's n queries see which of rank src's n keys, as (query rows, key
    rows, whether the causal mask is needed): the load-balanced split makes every block but
    the diagonal one half empty and half full. Rank r holds chunks r (early) and 2 cp - 1 - r
    (late); a block from src < r: its early chunk is before both of ours, its late one after
    both; from src > r: only our late chunk sees it, all of it."""
    if src == r:
        return slice(None), slice(None), True
    return ((slice(None), slice(0, n // 2), False) if src < r
            else (slice(n // 2, None), slice(None), False))


def _block_scores(q, k, pos, kpos, docs, scale, causal):
    """Scores of queries q (B, n_head, Tq, hd) at `pos` against keys k (B, n_head, Tk, hd) at
    `kpos`, float32, -inf where a query may not look (the future when `causal`; another
    document: docs, the whole rows' document ids (B, T))."""
    s = (q.float() @ k.float().transpose(-2, -1)) * scale  # (B, n_head, Tq, Tk)
    # causal at global positions (Tq, Tk)
    allowed = kpos[None, :] <= pos[:, None] if causal else None
    if docs is not None:  # (B, 1, Tq, Tk): the same document
        same = docs.index_select(1, pos)[:, :, None] == docs.index_select(1, kpos)[:, None, :]
        allowed = same[:, None] & (True if allowed is None else allowed)
    return s if allowed is None else s.masked_fill(~allowed, float("-inf"))


def _ring_forward(q, k, v, pos, docs, group):
    """RingAttention's forward: (out (B, n_head, Tq, hd), its log-sum-exp (B, n_head, Tq))."""
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    n, scale, groups = q.shape[2], q.shape[-1] ** -0.5, q.shape[1] // k.shape[1]
    kv = torch.stack([k, v])  # one message per step: (2, B, n_kv_head, Tk, hd)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), device=q.device)
    for step in range(cp):
        if step < cp - 1:  # the next block is on its way while this one is computed
            pending, nxt = ring_pass(kv, group)
        src = (r - step) % cp
        qs, ks, causal = _visible(r, src, n)
        kb, vb = (t[:, :, ks].repeat_interleave(groups, dim=1) for t in kv)  # GQA
        s = _block_scores(q[:, :, qs], kb, pos[qs], positions(n * cp, cp, src, q.device)[ks],
                          docs, scale, causal)
        block_lse = torch.logsumexp(s, dim=-1)  # -inf: no key of this block is visible (documents)
        p = torch.exp(s - block_lse.nan_to_num(neginf=0.0)[..., None])
        old = lse[:, :, qs]
        new = torch.logaddexp(old, block_lse)  # finite from step 0 on: a query sees itself
        out[:, :, qs] = (out[:, :, qs] * torch.exp(old - new)[..., None]
                         + (p @ vb.float()) * torch.exp(block_lse - new)[..., None])
        lse[:, :, qs] = new
        if step < cp - 1:
            for req in pending:
                req.wait()
            kv = nxt
    return out.to(q.dtype), lse


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries against every rank's keys and values, passed
    around the ring one block per step (the top of this file). Forward: per block the
    partial softmax, merged by log-sum-exp (the online softmax). Backward by hand, as flash
    attention's: each block's probabilities recomputed from the saved log-sum-exp, the
    queries' gradient summed here, the block's key and value gradients travelling with it
    around the ring and home. Only the visible half of each off-diagonal block is computed."""

    @staticmethod
    def forward(ctx, q, k, v, pos, docs, group):
        # float32 scores and sums, as backward's
        with torch.autocast(q.device.type, enabled=False):
            out, lse = _ring_forward(q, k, v, pos, docs, group)
        ctx.save_for_backward(q, k, v, pos, out, lse, *([] if docs is None else [docs]))
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, pos, out, lse, *docs = ctx.saved_tensors
        docs = docs[0] if docs else None
        group = ctx.group
        cp, r = dist.get_world_size(group), dist.get_rank(group)
        n, scale, groups = q.shape[2], q.shape[-1] ** -0.5, q.shape[1] // k.shape[1]
        dout = dout.float()
        D = (dout * out.float()).sum(-1, keepdim=True)  # (B, n_head, Tq, 1): rowsum(dO * O)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # travels with its block
        for step in range(cp):
            src = (r - step) % cp
            qs, ks, causal = _visible(r, src, n)
            kb, vb = (t[:, :, ks].repeat_interleave(groups, dim=1).float() for t in kv)
            qb, dob = q[:, :, qs].float(), dout[:, :, qs]
            s = _block_scores(qb, kb, pos[qs], positions(n * cp, cp, src, q.device)[ks], docs,
                              scale, causal)
            p = torch.exp(s - lse[:, :, qs, None])  # the final softmax's probabilities
            ds = p * (dob @ vb.transpose(-2, -1) - D[:, :, qs]) * scale
            dq[:, :, qs] += ds @ kb
            B, H, Tk, hd = kb.shape  # GQA: a kv head's gradient is the sum over its query heads
            dkv[0][:, :,
                   ks] += (ds.transpose(-2, -1) @ qb).view(B, H // groups, groups, Tk, hd).sum(2)
            dkv[1][:, :,
                   ks] += (p.transpose(-2, -1) @ dob).view(B, H // groups, groups, Tk, hd).sum(2)
            # pass the block and its gradient on; after cp passes the gradient is home, summed
            # over every rank's queries (the last pass needs no keys and values any more)
            pending, dkv_next = ring_pass(dkv, group, tag=1)
            if step < cp - 1:
                more, kv_next = ring_pass(kv, group)
                pending += more
            for req in pending:
                req.wait()
            dkv = dkv_next
            if step < cp - 1:
                kv = kv_next
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q, k, v, pos, docs, dropout, group):
    """Context-parallel attention by the ring: q (B, n_head, Tq, hd) at global positions `pos`,
    k and v this rank's (B, n_kv_head, Tk, hd); docs None (causal) or the whole rows' document
    ids (B, T). No dropout (context_parallel() uses allgather_attention then)."""
    assert dropout == 0.0, "ring attention has no dropout"
    return RingAttention.apply(q, k, v, pos, docs, group)
