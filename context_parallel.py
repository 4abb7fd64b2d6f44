"""
Context parallel, by hand: each of the cp ranks holds a part of every sequence, and the
attention's keys and values pass between them (ring attention). context_parallel() applies it
to a built model from outside; model.py knows none of it.
"""

from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

from model import apply_rope

# ---------------------------------------------------------------------------------------
# context parallel (Liu et al. 2023, ring attention, arXiv:2310.01889; the load-balanced
# split as in Megatron-LM's context parallelism and Llama 3's training)
#
# Everything in a block but the attention is per token, so a rank that holds a part of the
# sequence runs the norms, matmuls, residuals and the MLP on its part alone, with the whole
# weights (replicated across the cp ranks, as data parallelism replicates them). Only
# attention mixes tokens: a query needs the keys and values of every earlier token, which
# live on other ranks. Two ways to get them here:
#   AllGatherKV (the naive one, the test oracle): all-gather K and V (backward: reduce-scatter
#     their gradients, each rank keeping the sum for its own tokens), then one SDPA of the
#     local queries against the whole sequence, with the causal mask at global positions.
#     Memory: the whole K and V of a layer on every rank.
#   RingAttention: cp steps; at step s a rank holds the K/V block of rank (r - s) mod cp,
#     computes its queries' attention to that block (a partial softmax: the block's output and
#     log-sum-exp), merges it into the running output (the online softmax), and passes the
#     block on to rank r + 1 while receiving the next from r - 1. Backward walks the ring
#     again, each block travelling with the gradient accumulated for it so far, and arriving
#     home after cp steps with the sum over every rank's queries. Memory: two blocks at a time.
# Causality makes a naive contiguous split unfair: the rank with the first T / cp tokens has
# almost nothing to attend to, the last one everything. Cut the sequence into 2 cp chunks and
# give rank r chunks r and 2 cp - 1 - r: every rank then holds one early and one late chunk,
# the same amount of causal work.
# RoPE rotates each token by its global position (cos and sin at this rank's positions); the
# loss gathers each token's cross-entropy into the whole (B, T) (backward: reduce-scatter, as
# K and V), so every cp rank holds the loss of the whole sequence and the token mean is over
# all of it. The weights' gradients, each rank's part times cp (the gather's backward sums
# cp copies of the same upstream gradient), are averaged over the cp group after backward
# (average_grads), as data parallelism averages over its replicas.


def positions(T, cp, rank, device=None):
    """The global positions of rank `rank`'s T / cp tokens: chunks rank and 2 cp - 1 - rank of 2 cp."""
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


def allgather_attention(q, k, v, pos, mask, dropout, group):
    """The naive context-parallel attention: q (B, n_head, Tq, hd) at global positions `pos`
    against the whole sequence's K and V (gathered): SDPA with the causal (or document) mask
    of these queries' rows."""
    k, v = GatherSeq.apply(k, 2, group), GatherSeq.apply(v, 2, group)  # (B, n_kv_head, T, hd)
    if mask is None:  # causal at global positions: query i sees keys 0..pos[i]
        mask = torch.arange(k.shape[2], device=q.device)[None, :] <= pos[:, None]  # (Tq, T)
    else:  # the document mask's rows for these queries
        mask = mask.index_select(2, pos)  # (B, 1, Tq, T)
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
    q, k, v = att.wq(x), att.wk(x), att.wv(x)
    n_head, n_kv_head = q.shape[-1] // att.head_dim, k.shape[-1] // att.head_dim
    q = q.view(B, T, n_head, att.head_dim).transpose(1, 2)     # (B, n_head, T / cp, head_dim)
    k = k.view(B, T, n_kv_head, att.head_dim).transpose(1, 2)  # (B, n_kv_head, T / cp, head_dim)
    v = v.view(B, T, n_kv_head, att.head_dim).transpose(1, 2)
    cos, sin = cos.index_select(0, pos), sin.index_select(0, pos)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    y = attend(q, k, v, pos, mask, att.dropout if att.training else 0.0, mesh.cp_group)
    return att.wo(y.transpose(1, 2).reshape(B, T, n_head * att.head_dim))


def cp_losses(inner, mesh, h, head, targets, chunk=0):
    """The model's loss_fn (`inner`) on this rank's tokens, h (B, T / cp, n_embd), gathered
    into every target's loss (B, T), in sequence order, the same on every cp rank."""
    pos = positions(targets.shape[1], mesh.cp, mesh.cp_rank, targets.device)
    return GatherSeq.apply(inner(h, head, targets.index_select(1, pos), chunk), 1, mesh.cp_group)


def context_parallel(model, mesh, ring=True):
    """Splits `model`'s sequence over mesh.cp_group, in place: after the embedding (and its
    dropout) each rank keeps its tokens (positions()), each attention attends across the
    ranks (ring_attention; ring=False: allgather_attention), and the loss is gathered.
    Returns the model; a no-op at cp=1."""
    if mesh.cp == 1:
        return model
    attend = ring_attention if ring else allgather_attention
    for block in model.layers.values():
        block.attention.forward = partial(cp_attention, block.attention, mesh, attend)
    model.drop.register_forward_hook(  # (B, T, n_embd) -> this rank's (B, T / cp, n_embd)
        lambda m, args, x: x.index_select(1, positions(x.shape[1], mesh.cp, mesh.cp_rank, x.device)))
    model.loss_fn = partial(cp_losses, model.loss_fn, mesh)
    return model


def average_grads(params, mesh):
    """The gradients averaged over the cp group, in one all-reduce (see the top of this file)."""
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=mesh.cp_group)
    flat /= mesh.cp  # all_reduce summed; we want the mean (gloo has no AVG)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


ring_attention = allgather_attention  # replaced below by the ring
