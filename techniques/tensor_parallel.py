"""
Tensor parallel, by hand (Megatron-LM: Shoeybi et al. 2019, arXiv:1909.08053):
tensor_parallel() swaps each block's matmuls for column / row slices in place, and the
embedding, head and loss for vocabulary-parallel ones; with sp=True also sequence parallelism
(the activations between them split along the sequence). model.py knows none of it.
"""

from functools import partial
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from model import RMSNorm, chunked_losses
from guards.guard_errors import UserError

# The tp ranks of a stage each hold a slice of every matmul and run the same tokens. Per
# block, two pairs:
#   attention:    x -> f -> [wq, wk, wv column-parallel: this rank's heads] -> attention of
#                 those heads -> [wo row-parallel: a partial sum of the output] -> g -> out
#   feed-forward: x -> f -> [w1, w3 column-parallel: a slice of the hidden width] -> silu(.) * .
#                 -> [w2 row-parallel] -> g -> out
# f (CopyToTP) is the identity forward and an all-reduce of the input's gradient backward
# (each rank's slice contributes to the gradient of the whole, replicated x); g
# (ReduceFromTP) is an all-reduce forward (the partial sums of the row-parallel matmul add
# up to the full output) and the identity backward. So 2 all-reduces forward and 2 backward
# per block, each of B x T x n_embd. Everything between f and g is local: a head needs only
# its own q, k, v columns, and silu(w1 x) * w3 x is elementwise in the hidden width.
# Norms, residuals and dropout run on the replicated (B, T, n_embd) on every tp rank, so
# their masks must be equal there: a tp group shares one random stream. Attention dropout
# is the exception: each rank's heads are different heads, whose masks must differ as they
# do in one process (Megatron forks a model-parallel RNG for this). own_stream_for_heads
# switches each tp rank to a stream of its own from after wv (the last of q, k, v) to after
# wo (which LoRA's row-parallel input dropout uses too), seeded from one draw of the shared
# stream, so the shared stream moves on alike everywhere and activation checkpointing's
# recompute, which restores the shared stream, draws the same masks again.
# The embedding is split by vocabulary rows (a rank looks up the ids it owns, zeros for the
# others, and g sums them); the head by vocabulary columns, and the loss is computed from
# the logit slices without gathering them (vocab_parallel_losses).
# model.py knows none of this: tensor_parallel() swaps each weight for its slice in place,
# and the attention reads its local head counts from the shapes it holds. Every sharded
# parameter carries `_split_dim` (the dimension it is cut along) and `_split_group`, which
# clipping and checkpoints (parallel.tp_gather to the full tensor, tp_slice on load) read.
#
# Sequence parallelism (sp=True; Korthikanti et al. 2022, arXiv:2205.05198): outside f and
# g the tp ranks hold the same (B, T, n_embd) tp times over, and the norms, residuals and
# dropout run on it tp times. With sp each tp rank holds a slice (B, T / tp, n_embd) of the
# sequence there instead: f becomes an all-gather along T (backward: a reduce-scatter of the
# gradient, each rank keeping its slice of the sum) and g a reduce-scatter along T (backward:
# an all-gather). An all-reduce is a reduce-scatter followed by an all-gather, so the
# communication per block is the same and the activations outside the matmuls shrink by tp.
# The embedding's g reduce-scatters too; the head's f all-gathers the final hidden states
# (the head's vocabulary slice needs every token), so the loss is the same on every tp rank
# as without sp. The norm gains are replicated but each rank's saw only its slice of the
# tokens: their gradients are all-reduced over the tp group (f on the gain). The residual
# and embedding dropouts now act on different tokens on each tp rank, so they draw from a
# stream of each tp rank's own (own_stream), seeded like the heads' one.


class CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce (sum) of the gradient over the tp group backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """g: all-reduce (sum) over the tp group forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        # the all-reduce is in place; the partial sum may be saved for backward elsewhere
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherFromSP(torch.autograd.Function):
    """f under sequence parallelism: all-gather along T forward, (B, T / tp, ...) -> (B, T, ...);
    backward, a reduce-scatter along T: this rank's slice of the sum of the ranks' gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_seq(grad, ctx.group), None


class ScatterToSP(torch.autograd.Function):
    """g under sequence parallelism: reduce-scatter along T forward (the partial sums of the
    row-parallel matmul added up, this rank keeping its slice of T), all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_seq(grad, ctx.group), None


def gather_seq(x, group):
    """(B, T / n, ...) on each of the n ranks of `group` -> the whole (B, T, ...), in rank
    order."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def reduce_scatter_seq(x, group):
    """(B, T, ...) on each rank of `group` -> this rank's slice along T of their sum (B, T / n,
    ...)."""
    parts = [p.contiguous() for p in x.chunk(dist.get_world_size(group), dim=1)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)
    return out


class VocabParallelEmbedding(nn.Module):
    """The token embedding with rows [start, start + V / tp) of the table on this rank:
    ids outside its range look up zeros, and g adds the ranks' lookups into the full one
    (ScatterToSP under sequence parallelism: this rank's slice of T of it).
    Its parameter keeps the name `weight`, so checkpoints see tok_embeddings.weight."""

    def __init__(self, weight, start, group, g=None):
        super().__init__()
        self.weight, self.start, self.group, self.g = weight, start, group, g or ReduceFromTP

    def forward(self, idx):
        local = idx - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # (B, T, n_embd)
        x = x.masked_fill(outside[..., None], 0.0)
        return self.g.apply(x, self.group)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from logit slices (N, V / tp), columns [start, start + V / tp)
    of the full (N, V), without gathering them: the row max and the sum of exp are
    all-reduced (max, then sum) over the tp group, and so is the target's logit, which lives
    on one rank. Backward is local: softmax - one_hot on this rank's columns. Targets equal
    to ignore_index (-100, as F.cross_entropy) give loss 0 and no gradient."""

    @staticmethod
    def forward(ctx, logits, targets, start, group):
        logits = logits.float()
        m = logits.max(dim=-1).values
        # the global row max, for a stable exp
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - m[:, None]
        local = targets - start
        mine = (local >= 0) & (local < logits.shape[-1])  # is the target's column on this rank?
        local = local.masked_fill(~mine, 0)
        target_logit = shifted.gather(1, local[:, None])[:, 0].masked_fill(~mine, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        both = torch.stack([sum_exp, target_logit])  # one all-reduce for the two sums
        dist.all_reduce(both, group=group)
        sum_exp, target_logit = both[0], both[1]
        valid = targets != -100
        loss = (sum_exp.log() - target_logit).masked_fill(~valid, 0.0)  # (N,)
        ctx.save_for_backward(exp / sum_exp[:, None], local, mine & valid, valid)
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine, valid = ctx.saved_tensors
        g = softmax.clone()
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows, local] -= mine.to(g.dtype)
        g *= (grad * valid.to(grad.dtype))[:, None]
        return g, None, None, None


def vocab_parallel_losses(h, head, targets, chunk=0, keep=False, start=0, group=None, f=None):
    """model.cross_entropy_losses for a head that holds a vocabulary slice (rows from `start`):
    each target's loss (B, T), the same on every tp rank, from the logit slices (never gathered):
    all at once (VocabParallelCrossEntropy), or in chunks of rows (model.ChunkedCrossEntropy with
    the row maxima and sums all-reduced over the tp group). f: the head's input function
    (CopyToTP; GatherFromSP under sequence parallelism, where h is this rank's slice of T)."""
    if not chunk:
        logits = head(h)  # (its forward pre-hook is CopyToTP)
        losses = VocabParallelCrossEntropy.apply(logits.flatten(0, 1), targets.flatten(), start,
                                                 group)
        return losses.view(targets.shape)
    h = (f or CopyToTP).apply(h, group)  # what the head's pre-hook does when the head is called
    vocab = (start, lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group),
             lambda t: dist.all_reduce(t, group=group))
    return chunked_losses(h, head, targets, chunk, vocab, keep)


def _shard(module, dim, mesh, key="weight"):
    """module.weight (or .bias) -> this tp rank's slice along dim, in place, marked for clipping
    and checkpoints."""
    full = getattr(module, key)
    part = nn.Parameter(full.detach().chunk(mesh.tp, dim)[mesh.tp_rank].clone(),
                        requires_grad=full.requires_grad)
    part._split_dim, part._split_group = dim, mesh.tp_group
    setattr(module, key, part)
    return part


def _shard_linear(lin, dim, mesh):
    """A column- (dim 0) or row-parallel (dim 1) slice of linear `lin`, in place, and of its
    LoRA adapter if it has one (lora.LoRALinear: y = x W^T + s * x A^T B^T). A column-parallel
    bias (Qwen2's q/k/v) is cut like W's output rows; no row-parallel linear has one. The adapter's
    slices follow the base's (as torchtitan derives them): column-parallel, B (out, r) is cut
    like W's output rows and A stays whole; row-parallel, A (r, in) is cut like W's input
    columns and B stays whole. The whole factor sees only this rank's part of the product:
    column-parallel, A's gradient B_i^T g_i x sums over the ranks' output slices; row-parallel,
    B's gradient g (A_i x_i)^T over their input slices. So its gradient is all-reduced over
    the tp group in backward (_SummedWeightGrad, per backward, before accumulation),
    and it stays the same replicated tensor on every tp rank."""
    assert dim == 0 or lin.bias is None, (
        "a row-parallel bias is added once, after the sum: not implemented")
    _shard(lin, dim, mesh)
    if dim == 0:
        if lin.bias is not None:
            _shard(lin, 0, mesh, "bias")
        lin.out_features //= mesh.tp
    else:
        lin.in_features //= mesh.tp
    if hasattr(lin, "lora_A"):
        cut, whole = (lin.lora_B, lin.lora_A) if dim == 0 else (lin.lora_A, lin.lora_B)
        _shard(cut, dim, mesh)
        if dim == 0:
            cut.out_features //= mesh.tp
        else:
            cut.in_features //= mesh.tp
        whole.forward = partial(_linear_summed_weight_grad, whole, mesh.tp_group)


def _linear_summed_weight_grad(lin, group, x):
    return _SummedWeightGrad.apply(x, lin.weight, group)


class _SummedWeightGrad(torch.autograd.Function):
    """x W^T whose weight gradient is all-reduced over the tp group inside backward (the
    input's gradient stays this rank's part). In the graph, not a hook on the parameter, so
    it holds when FSDP swaps the parameter for its gathered copy (fsdp x tp)."""

    @staticmethod
    def forward(ctx, x, weight, group):
        ctx.save_for_backward(x, weight)
        ctx.group = group
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        g = g.to(weight.dtype)  # bf16 under autocast
        dw = g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1]).to(weight.dtype)
        dist.all_reduce(dw, group=ctx.group)
        return (g @ weight).to(x.dtype), dw, None


def tensor_parallel(model, mesh, sp=False):
    """Shards `model` (a whole model or a pipeline stage, built whole) over mesh.tp_group,
    in place: column-parallel wq, wk, wv, w1, w3 (dim 0, whole heads per rank), row-parallel
    wo, w2 (dim 1), vocabulary-parallel embedding and head with the loss computed from the
    logit slices. Norms stay replicated (Qwen3's q_norm, k_norm: their gradients summed). sp:
    sequence parallelism outside the matmuls (the top of this file; the sequence length must
    divide by tp). Returns the model; a no-op at tp=1."""
    if mesh.tp == 1:
        return model
    cfg, tp, group = model.cfg, mesh.tp, mesh.tp_group
    # (guard_config.check_layout refuses the heads and widths tp does not divide; the vocabulary is
    # known only once the data and the model are)
    assert cfg.n_head % tp == cfg.n_kv_head % tp == cfg.ffn_dim % tp == 0, (
        f"tp={tp} does not divide the heads or width")
    if cfg.vocab_size % tp:
        raise UserError(f"tp={tp} does not divide vocab_size={cfg.vocab_size}: every tp rank "
                        f"needs an equal slice of the vocabulary; use a tp that divides it")
    fn, gn = (GatherFromSP, ScatterToSP) if sp else (CopyToTP, ReduceFromTP)
    f = lambda module, args: (fn.apply(args[0], group), *args[1:])  # noqa: E731
    g = lambda module, args, out: gn.apply(out, group)  # noqa: E731
    for block in model.layers.values():
        att, ffn = block.attention, block.feed_forward
        # column-parallel: a slice of the outputs
        for lin in (att.wq, att.wk, att.wv, ffn.w1, ffn.w3):
            _shard_linear(lin, 0, mesh)
        # row-parallel: a slice of the inputs, a partial sum of the output
        for lin in (att.wo, ffn.w2):
            _shard_linear(lin, 1, mesh)
        for m in (att, ffn):  # one f before and one g after each half of the block
            m.register_forward_pre_hook(f)
            m.register_forward_hook(g)
        if cfg.dropout > 0:  # attention dropout: this rank's heads draw their own masks
            att.wv.register_forward_hook(partial(own_stream_for_heads, att, mesh, True))
            att.wo.register_forward_hook(partial(own_stream_for_heads, att, mesh, False))
    # Qwen3's q_norm and k_norm see this rank's heads only, and with sp every norm sees only
    # this rank's tokens: each replicated gain's gradient is the sum over the tp ranks
    qk = [getattr(b.attention, n) for b in model.layers.values() for n in ("q_norm", "k_norm")
          if hasattr(b.attention, n)]
    for norm in [m for m in model.modules() if isinstance(m, RMSNorm)] if sp else qk:
        norm.forward = partial(_rmsnorm_summed_gain, norm, group)
    if sp:  # dropout: a stream per slice
        for drop in ([b.drop for b in model.layers.values()] + [model.drop] if cfg.dropout > 0
                     else []):
            drop.register_forward_pre_hook(lambda m, args: own_stream(m, mesh, True))
            drop.register_forward_hook(lambda m, args, out: own_stream(m, mesh, False))
    start = mesh.tp_rank * cfg.vocab_size // tp  # this rank's first vocabulary row
    if model.tok_embeddings is not None:
        emb = model.tok_embeddings
        model.tok_embeddings = VocabParallelEmbedding(_shard(emb, 0, mesh), start, group, gn)
    if model.output is not None:
        # the same rows of the same table
        if cfg.tie_embeddings and model.tok_embeddings is not None:
            model.output.weight = model.tok_embeddings.weight
            model.output.out_features //= tp
        else:
            _shard_linear(model.output, 0, mesh)
        model.output.register_forward_pre_hook(f)
        model.loss_fn = partial(vocab_parallel_losses, start=start, group=group, f=fn)
    return model


def _rmsnorm_summed_gain(norm, group, x):
    """RMSNorm's own forward on this rank's slice of T, its gain through f (CopyToTP): the
    gain's gradient all-reduced over the tp group in backward, in the graph (as
    _SummedWeightGrad, so that it holds under FSDP's gathered parameters)."""
    return type(norm).forward(SimpleNamespace(eps=norm.eps,
                                              weight=CopyToTP.apply(norm.weight, group)), x)


def own_stream_for_heads(att, mesh, enter, module, args, out):
    """Forward hook: enter (after wv) or leave (after wo) this tp rank's own random stream for
    the attention of its heads (see the top of this file)."""
    own_stream(att, mesh, enter)


def own_stream(holder, mesh, enter):
    """Enter (while `holder` trains) or leave this tp rank's own random stream, seeded from one
    draw of the shared stream (the same on every tp rank) and the tp rank."""
    if enter and holder.training:
        # one draw of the shared stream: the same on every tp rank
        seed = int(torch.randint(2 ** 31, ()))
        holder._own_stream = torch.random.fork_rng(devices=[mesh.device]
                                                   if mesh.device.type == "cuda" else [])
        holder._own_stream.__enter__()  # the shared stream's state, restored on leaving
        torch.manual_seed(seed * mesh.tp + mesh.tp_rank)
    elif not enter and "_own_stream" in holder.__dict__:
        holder.__dict__.pop("_own_stream").__exit__(None, None, None)

