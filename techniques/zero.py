"""
ZeRO stages 1 and 2, by hand, on data_parallel.DataParallel's buckets: ZeroDataParallel
(gradients all-reduced, or reduce-scattered to this rank's slices) and ZeroOptimizer (AdamW
on this rank's slices, then an all-gather of the updated weights), with optional CPU offload
of the optimizer state. Stage 3 is fsdp.py.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from optim import AdamW, MuonWithAdamW, orthogonalize_shared, sharing_ranks, whole_shape
from parallel import tp_gather, tp_slice
from techniques.data_parallel import Bucket, DataParallel

# Where the memory of training goes: plain data parallel keeps on every rank the whole
# model's parameters (4 bytes each in fp32), their gradients (4) and AdamW's two moments
# (8): 16 bytes a parameter, and only the parameters are needed by forward and backward.
# ZeRO (Rajbhandari et al., 2019) splits the rest over the dp ranks:
#   stage 1: each rank keeps the AdamW state of 1/dp of the parameters and steps only that
#            slice; the updated slices are then all-gathered into every rank's parameters.
#            Gradients are all-reduced as in DataParallel. 4 + 4 + 8/dp bytes a parameter.
#   stage 2: the buckets are reduce-scattered instead of all-reduced: each rank receives
#            the summed gradient of its own slice only, and the full-size gradients are
#            freed once they are in flight. 4 + 4/dp + 8/dp bytes. The traffic is plain
#            data parallel's (a reduce-scatter plus an all-gather move what one all-reduce
#            does); stage 1 sends the all-gather on top of its all-reduce.
#   stage 3 shards the parameters too: that is fsdp=True (FSDP2, fsdp.py).
# The slices follow the buckets: each bucket's flat gradient is padded to a multiple of dp
# and rank r owns its r-th contiguous chunk (with one bucket: a contiguous 1/dp of the
# flat parameters). A chunk cuts across parameters, so this rank's piece of a parameter is
# a Shard: a 1-D nn.Parameter that is a *view* of the parameter's storage (stepping it
# updates the weight in place; fp32 weights need no separate master copy), with its
# gradient beside it. AdamW is elementwise, so stepping the pieces is the update of the
# whole, up to rounding. With accumulation, no_sync micro-steps keep full local gradients
# in .grad (as LowLevelZero does); only the last backward's hooks reduce.


@dataclass(eq=False)
class Shard:
    """This rank's piece param.view(-1)[start:start + n]: it sits at chunk_offset in this
    rank's chunk of `bucket`; `tensor` is that piece as the optimizer sees it."""
    param: nn.Parameter
    start: int
    n: int
    bucket: Bucket
    chunk_offset: int
    tensor: nn.Parameter


class ZeroDataParallel(DataParallel):
    """DataParallel whose optimizer state (stage 1) and also gradients (stage 2) are split
    over the dp ranks. After wait(), each Shard's tensor.grad holds the summed gradient of
    this rank's pieces (a view of the whole gradient in stage 1, of the reduced chunk in
    stage 2); ZeroOptimizer steps them."""

    def __init__(self, module, mesh, bucket_mb=25.0, stage=1):
        assert stage in (1, 2), f"ZeRO stage {stage}: 1 or 2 here (stage 3 is fsdp=True)"
        super().__init__(module, mesh, bucket_mb)
        self.stage = stage
        # stage 2: did p have a gradient here when its bucket went (its .grad is freed then)
        self.had_grad = {}
        self.shards = []
        for bucket in self.buckets:
            numel = sum(p.numel() for p in bucket.params)
            # elements per rank; the bucket is padded to chunk * dp
            bucket.chunk = -(-numel // mesh.dp)
            # this rank's chunk
            lo, hi = mesh.dp_rank * bucket.chunk, (mesh.dp_rank + 1) * bucket.chunk
            kw = dict(dtype=bucket.flat.dtype, device=bucket.flat.device)
            # stage 1 all-reduces the whole padded bucket through a persistent buffer, as
            # DataParallel;
            # stage 2 has the full-size buffer only while the bucket is being reduced, and keeps
            # its chunk
            bucket.flat = torch.zeros(bucket.chunk * mesh.dp, **kw) if stage == 1 else None
            bucket.grad_chunk = torch.zeros(bucket.chunk, **kw) if stage == 2 else None
            offset = 0
            for p in bucket.params:
                a, b = max(lo, offset), min(hi, offset + p.numel())
                if a < b:
                    assert p.is_contiguous(), (
                        "a shard is a view of the flat parameter: parameters must be contiguous")
                    piece = nn.Parameter(p.detach().view(-1)[a - offset:b - offset])
                    # Muon's scale and clipping ask what the piece is part of (its tp marks)
                    piece._whole = p
                    self.shards.append(Shard(p, a - offset, b - a, bucket, a - lo, piece))
                offset += p.numel()

    def _launch(self, bucket):
        if self.stage == 1:
            return super()._launch(bucket)
        # stage 2: gather the bucket's gradients into one full-size buffer, free each
        # parameter's full gradient, and reduce-scatter: this rank receives the sum of its chunk
        bucket.flat = torch.zeros(bucket.chunk * self.mesh.dp, dtype=bucket.grad_chunk.dtype,
                                  device=bucket.grad_chunk.device)
        offset = 0
        for p in bucket.params:
            self.had_grad[p] = p.grad is not None
            if p.grad is not None:  # None: no gradient on this rank, it contributes zeros
                bucket.flat[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
                p.grad = None
            offset += p.numel()
        work = dist.reduce_scatter_single(bucket.grad_chunk, bucket.flat, group=self.mesh.dp_group,
                                          async_op=True)
        self.pending.append((bucket, work))
        self.launched += 1
        self.launches += 1

    def _used_anywhere(self):
        if self.stage == 1:
            return super()._used_anywhere()
        used = torch.tensor([self.had_grad[p] for p in self.params], dtype=torch.float32,
                            device=self.mesh.device)
        dist.all_reduce(used, group=self.mesh.dp_group)
        return (used > 0).tolist()

    def wait(self):
        """Finishes the gradient reduction; then each shard's .grad is its piece of the summed
        gradient (None for a parameter that no rank used: AdamW leaves it alone, as in
        DataParallel)."""
        if self.stage == 1:
            # every rank holds the whole summed gradient; the shards' gradients are views of it
            super().wait()
            self.used = {p: p.grad is not None for p in self.params}
            for s in self.shards:
                s.tensor.grad = (None if s.param.grad is None
                                 else s.param.grad.view(-1)[s.start:s.start + s.n])
            return
        # buckets backward did not complete go now, in order
        while self.launched < len(self.buckets):
            self._launch(self.buckets[self.launched])
        for bucket, work in self.pending:
            work.wait()
            bucket.flat = None  # the full-size buffer goes back to the allocator
            bucket.ready = 0
        used = self.used = dict(zip(self.params, self._used_anywhere()))
        for s in self.shards:
            s.tensor.grad = (s.bucket.grad_chunk[s.chunk_offset:s.chunk_offset + s.n]
                             if used[s.param] else None)
        self.pending, self.launched = [], 0


class ZeroOptimizer:
    """AdamW (or Muon with AdamW: muon= its keywords) over this rank's shards only (the state
    of 1/dp of the model), then one all-gather per bucket that gives every rank every updated
    parameter. param_groups as for torch.optim.AdamW, over the model's parameters: a
    parameter's group decides its shards' options (weight decay on 2-D weights only, say).
    The loop uses it like AdamW: .param_groups (set "lr"), .zero_grad(), .step(), .state.
    Muon's momentum is elementwise and sharded like AdamW's moments; its orthogonalization
    needs each matrix whole: orthogonalize() assembles each from the ranks' pieces and shares
    the Newton-Schulz work over the dp (and tp) ranks, each keeping its pieces of the result.
    offload: the optimizer's state and its step live in CPU memory (each step copies the
    shards' gradients there and the updated pieces back). On a CPU device too the stepped
    pieces are copies, apart from the weights: the same path runs (and is tested) everywhere."""

    def __init__(self, model, param_groups, offload=False, muon=None, **adamw):
        assert isinstance(model, ZeroDataParallel), (
            "ZeroOptimizer steps the shards of a ZeroDataParallel")
        self.model, self.mesh, self.shards = model, model.mesh, model.shards
        self.offload = offload
        # what the optimizer steps: the shards themselves (views of the weights), or their copies
        # in CPU memory
        self.stepped = [nn.Parameter(s.tensor.detach().cpu().clone()) if self.offload else s.tensor
                        for s in self.shards]
        self.shard_of = dict(zip(self.stepped, self.shards))
        for s, t in zip(self.shards, self.stepped):
            t._whole = s.param
        group_of = {p: i for i, g in enumerate(param_groups) for p in g["params"]}
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [t for s, t in zip(self.shards, self.stepped)
                              if group_of[s.param] == i]}
                  for i, g in enumerate(param_groups)]
        self.muon_params = [p for g in param_groups if g.get("muon") for p in g["params"]
                            if not hasattr(p, "_ep")]  # every rank's, in order
        if muon:
            self.optimizer = MuonWithAdamW(groups, **muon)
            self.optimizer.orthogonalize = self.orthogonalize
        else:
            self.optimizer = torch.optim.AdamW(groups, **adamw)
        self.param_groups, self.state = self.optimizer.param_groups, self.optimizer.state
        # expert parallel (expert_parallel.py): a rank's own experts are in no bucket; a plain
        # optimizer of their own steps them whole (each expert's matrices are all here: Muon needs
        # no gathering)
        self.experts = [p for g in param_groups for p in g["params"] if hasattr(p, "_ep")]
        if self.experts:
            own = [{**{k: v for k, v in g.items() if k != "params"},
                    "params": [p for p in g["params"] if hasattr(p, "_ep")]}
                   for g in param_groups]
            own = [g for g in own if g["params"]]
            self.experts_optimizer = MuonWithAdamW(own, **muon) if muon else AdamW(own, **adamw)
            self.param_groups = self.param_groups + self.experts_optimizer.param_groups

    def orthogonalize(self, pieces, gs):
        """MuonWithAdamW.orthogonalize over this rank's pieces: each matrix that trained this
        step is assembled whole on every rank (the pieces' sum over dp, zeros elsewhere: exact;
        under tp then its slices gathered), orthogonalized by one rank, shared; each rank keeps
        its pieces of the results."""
        # a rank holds one piece of a matrix at most (its chunk is one range of the bucket)
        mine = {t._whole: (self.shard_of[t], g) for t, g in zip(pieces, gs)}
        mats = [p for p in self.muon_params if self.model.used[p]]
        tp = self.mesh.tp > 1

        def whole(i):
            p = mats[i]
            flat = torch.zeros(p.numel(), device=self.mesh.device)
            if p in mine:
                s, g = mine[p]
                flat[s.start:s.start + s.n] = g
            dist.all_reduce(flat, group=self.mesh.dp_group)
            return (tp_gather(flat.view(p.shape), p) if tp and hasattr(p, "_split_dim")
                    else flat.view(p.shape))

        def part(i, update):
            p = mats[i]
            if p not in mine:
                return None
            s, g = mine[p]
            update = tp_slice(update, p) if tp and hasattr(p, "_split_dim") else update
            return update.reshape(-1)[s.start:s.start + s.n].to(g.device)
        done = orthogonalize_shared([whole_shape(p) for p in mats], whole, part,
                                    sharing_ranks(self.mesh),
                                    self.optimizer.ns_dtype, self.mesh.device)
        return [dict(zip(mats, done))[t._whole] for t in pieces]

    @property
    def params(self):
        """The shards, whose gradients clipping measures (sharded over dp: clip_grad_norm_(...,
        sharded=True))."""
        return [s.tensor for s in self.shards] + self.experts

    def zero_grad(self, set_to_none=True):
        for p in self.model.params + self.params + self.stepped:
            p.grad = None

    @torch.no_grad()
    def step(self):
        if self.offload:
            for s, t in zip(self.shards, self.stepped):
                t.grad = None if s.tensor.grad is None else s.tensor.grad.to("cpu")
        self.optimizer.step()
        if self.experts:
            self.experts_optimizer.step()
        if self.offload:
            for s, t in zip(self.shards, self.stepped):
                s.tensor.copy_(t)  # into the weights: the shard is a view of them
        # each rank updated its own chunk of each bucket: gather everyone's into everyone's weights
        for bucket in self.model.buckets:
            full = self._gather(bucket, lambda s, t: s.tensor)
            offset = 0
            for p in bucket.params:
                p.view(-1).copy_(full[offset:offset + p.numel()])
                offset += p.numel()

    def _gather(self, bucket, piece):
        """The bucket's whole flat tensor (padded) from every rank's chunk, a chunk holding
        piece(shard, stepped tensor) at each of this rank's shards of the bucket (zeros
        elsewhere)."""
        mine = torch.zeros(bucket.chunk, device=self.mesh.device)
        for s, t in zip(self.shards, self.stepped):
            if s.bucket is bucket:
                mine[s.chunk_offset:s.chunk_offset + s.n] = piece(s, t)
        full = torch.empty(bucket.chunk * self.mesh.dp, device=self.mesh.device)
        dist.all_gather_single(full, mine, group=self.mesh.dp_group)
        return full

    # Checkpoints hold the whole AdamW state under parameter names, as a plain run saves it,
    # so any layout resumes any other: the same two calls as optim.NamedState's. Saving gathers the
    # slices into whole tensors on every
    # rank (a memory spike of the full state at save: simple, and fine at this scale; DCP
    # writes the replicated tensors once); loading reads the whole state and keeps its slices.

    def full_state(self, names):
        """{"name.exp_avg", "name.exp_avg_sq": whole tensor, "name.step": scalar} for every
        AdamW parameter, {"name.momentum_buffer": whole tensor} for every Muon one (zeros
        before the first step), as a plain run saves them. names: parameter -> its global name."""
        out, muon = {}, set(self.muon_params)
        for key in (("exp_avg", "exp_avg_sq", "momentum_buffer") if muon
                    else ("exp_avg", "exp_avg_sq")):
            for bucket in self.model.buckets:
                full = self._gather(bucket, lambda s, t: self.state[t].get(key, 0.0))
                offset = 0
                for p in bucket.params:
                    if (key == "momentum_buffer") == (p in muon):
                        out[f"{names[p]}.{key}"] = (
                            full[offset:offset + p.numel()].view_as(p).clone())
                    offset += p.numel()
        # a parameter's pieces share one step count; a rank that owns none of it says 0
        steps = torch.zeros(len(self.model.params), device=self.mesh.device)
        index = {p: i for i, p in enumerate(self.model.params)}
        for s, t in zip(self.shards, self.stepped):
            if "step" in self.state[t]:
                steps[index[s.param]] = self.state[t]["step"].item()
        dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=self.mesh.dp_group)
        for p, i in index.items():
            if p not in muon:
                out[f"{names[p]}.step"] = steps[i].cpu().clone()
        return {**out, **(self.experts_optimizer.full_state(names) if self.experts else {})}

    def load_full_state(self, state, names):
        """Takes this rank's slices of a whole AdamW state (full_state's form, as loaded from a
        checkpoint)."""
        fused = self.optimizer.defaults.get("fused")
        muon = set(self.muon_params)
        if self.experts:
            self.experts_optimizer.load_full_state(state, names)
        for s, t in zip(self.shards, self.stepped):
            name = names[s.param]
            if s.param in muon:
                self.state[t] = {"momentum_buffer": state[f"{name}.momentum_buffer"]
                                 .reshape(-1)[s.start:s.start + s.n]
                                 .to(t.device, copy=True)}
                continue
            self.state[t] = {
                "step": state[f"{name}.step"].to(t.device if fused else "cpu", torch.float32,
                                                 copy=True)}
            for key in ("exp_avg", "exp_avg_sq"):
                self.state[t][key] = state[f"{name}.{key}"].reshape(-1)[s.start:s.start + s.n].to(
                    t.device, copy=True)
