"""
Expert parallelism (`ep=N`), by hand: the experts of every MoE layer (moe.py) split over ep
ranks taken from the data-parallel ones, tokens sent to the rank holding their expert and
back with all_to_all_single (its backward written out too), and the experts' gradients
summed over the ranks that hold the same experts. Applied to a built model from outside,
like tensor_parallel.py; model.py and moe.py know none of it.
"""

from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

# ---------------------------------------------------------------------------------------
# Expert parallel (GShard, Lepikhin et al. 2020; torchtitan's "dp2ep").
#
# The dp ranks of a stage form dp / ep groups of ep consecutive ranks. Inside one group, rank
# r holds experts [r E/ep, (r+1) E/ep) of every MoE layer, and every rank still routes its own
# tokens (the router, attention and the rest stay plain data parallel). Per MoE layer:
#   1. counts: each rank tells each other how many of its token slots go to each of their
#      experts (all_to_all_single of E numbers);
#   2. dispatch: the token slots, already sorted by expert, go to the rank of their expert
#      (all_to_all_single with split sizes both ways: rows for rank s, rows from rank s);
#   3. the local experts run on what arrived, regrouped expert by expert;
#   4. combine: the outputs go back the way they came (the same exchange, splits swapped).
# The backward of an exchange is the exchange with the splits swapped: the gradient of a row
# goes back to the rank the row came from. gloo has all_to_all_single (not the list form).
# A rank whose experts got no token still joins both exchanges with zero rows: every rank
# calls the same collectives in the same order, or the group hangs.
#
# Gradients. Rank r's backward scales its tokens' loss by 1 / N (train.py's token weights:
# every gradient collective sums). An expert on rank r collects the gradient of every token of
# its ep group that chose it, each with that 1 / N; the dp / ep ranks that hold the same experts
# (one in each ep group) together saw every token once. So the expert gradients are summed over
# those replicas (sync_grads), as the others are over dp (tests/test_moe.py checks against one
# process). The experts are kept out of the data-parallel wrapper (marked _ep).
#
# The experts' slices carry the marks of a tensor-parallel slice (_split_dim=0, _split_group = the
# ep group): a range of the full tensor along one dimension. So checkpoints gather them whole
# (experts by their global index: a run resumes into any ep, dp, or one process), the
# meta-device build draws or reads only this rank's experts, clipping sums their squares over
# the group, and Muon orthogonalizes each expert's matrices whole.


class AllToAll(torch.autograd.Function):
    """x (sum(send), ...) -> (sum(recv), ...): rows send[s] of x to rank s of the group, rows
    recv[s] from rank s; backward: the same exchange with the splits swapped."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


def run_exchanged(experts, x, counts, group, ep):
    """moe.MoE's run_experts under ep: x (sum(counts), dim), the token slots of this rank sorted by
    global expert, counts (E,); returns the experts' outputs in the same order."""
    n_local = counts.numel() // ep
    got = torch.empty_like(counts)  # got[s * n_local + j]: rows rank s sends to our expert j
    dist.all_to_all_single(got, counts, group=group)
    send = counts.view(ep, n_local).sum(1).tolist()  # rows to each rank
    got = got.view(ep, n_local)
    recv = got.sum(1).tolist()
    y = AllToAll.apply(x, send, recv, group)  # rows by source rank, then by our expert
    # regroup expert by expert (each expert's rows from rank 0, then rank 1, ...), run, and back
    by_expert = torch.arange(y.shape[0], device=y.device).split(got.flatten().tolist())
    order = torch.cat([by_expert[s * n_local + j] for j in range(n_local) for s in range(ep)])
    out = experts(y[order], got.sum(0))
    out = torch.empty_like(out).index_copy_(0, order, out)
    return AllToAll.apply(out, recv, send, group)


def groups(mesh, ep):
    """(this rank's ep group, its replica group: the ranks holding the same experts, its index in
    the ep group). Every rank creates every group, in the same order (new_group's rule)."""
    # dp rank d of this stage and tp/cp slot is global rank d * stride + offset
    stride = mesh.world // mesh.dp
    mine = {}
    for off in range(stride):
        for first in range(0, mesh.dp, ep):
            ranks = [(first + i) * stride + off for i in range(ep)]
            g = dist.new_group(ranks)
            if mesh.rank in ranks:
                mine["ep"] = g
        for i in range(ep):
            ranks = [(first + i) * stride + off for first in range(0, mesh.dp, ep)]
            g = dist.new_group(ranks)
            if mesh.rank in ranks:
                mine["replicas"] = g
    return mine["ep"], mine["replicas"], mesh.dp_rank % ep


def expert_parallel(model, mesh, ep, moe_layers):
    """Splits the experts of each MoE layer of `model` (whole or a pipeline stage, on the meta
    device or built) over the ep group, in place; the layers exchange their tokens from now on.
    moe_layers: moe.moe_layers (train.py passes it: this file imports no layer)."""
    group, replicas, r = groups(mesh, ep)
    for layer in moe_layers(model).values():
        experts, n = layer.experts, layer.n_experts // ep
        for name in ("w1", "w2", "w3"):
            full = getattr(experts, name)
            p = nn.Parameter(full.detach()[r * n:(r + 1) * n].clone(),
                             requires_grad=full.requires_grad)
            p.__dict__.update(full.__dict__)
            p._split_dim, p._split_group, p._ep = 0, group, replicas
            setattr(experts, name, p)
        layer.run_experts = partial(run_exchanged, group=group, ep=ep)
    return model


@torch.no_grad()
def sync_grads(model):
    """The experts' gradients: summed over the ranks that hold the same experts (see above).
    One all-reduce for all of them."""
    # (LoRA: frozen)
    experts = [p for p in model.parameters() if hasattr(p, "_ep") and p.requires_grad]
    # (fsdp.py: its reduce-scatter over the replicas summed them already; a pipeline stage
    # without MoE layers has none)
    if not experts or isinstance(experts[0], DTensor):
        return
    for p in experts:  # (every expert runs, with no rows if none came: a gradient on every rank)
        p.grad = torch.zeros_like(p) if p.grad is None else p.grad
    grads = [p.grad for p in experts]
    flat = torch.cat([g.reshape(-1) for g in grads])
    replicas = experts[0]._ep
    if dist.get_world_size(replicas) > 1:
        dist.all_reduce(flat, group=replicas)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))
