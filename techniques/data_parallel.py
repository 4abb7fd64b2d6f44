"""
Data parallel, by hand: every dp rank holds the whole model (or pipeline stage) and runs its
own micro-batches; the gradients are summed over the ranks before the optimizer step (the
loss weights make the sum the mean: train.py's token_weights).
NaiveDataParallel (one all-reduce per parameter, after backward: the oracle) beside the
bucketed, overlapped DataParallel, both with no_sync() and the require_backward_grad_sync
flag that train.py toggles for gradient accumulation. zero.py builds ZeRO on these buckets.
"""

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from techniques.pipeline import tied_copy

# Every rank then takes the same step, so the weights stay identical. Two ways to sum, side
# by side, with one interface (forward, no_sync() or the require_backward_grad_sync flag, wait()):
#   NaiveDataParallel: after backward, one all-reduce per parameter, in wait(). Simple,
#             and the test oracle.
#   DataParallel (bucketed): parameters are grouped into buckets of ~bucket_mb, in reverse
#             order of use (backward produces the last layer's gradients first). A hook on
#             each parameter fires when its gradient is final; a complete bucket is copied
#             into one flat buffer and all-reduced asynchronously while backward goes on
#             computing earlier layers. wait() collects everything before the optimizer step.
#
# Collectives pair up by their order on each rank, so both wrappers make the same calls in
# the same order on every rank, whatever each rank's graph did:
# - buckets launch in bucket order (as torch DDP does). A bucket that completes before an
#   earlier one waits in line; otherwise a rank whose graph skipped a parameter would pair
#   its bucket 2 with another rank's bucket 1.
# - unused parameters: every trainable parameter that got a gradient on *some* dp rank is
#   reduced on every rank, a missing .grad counting as zeros. So a parameter unused on rank
#   1 only gets g0 + 0, what torch DDP(find_unused_parameters=True) gives. A
#   parameter unused on every rank keeps grad None, so AdamW leaves it alone (no momentum,
#   no decay), again as torch DDP does. Knowing "unused everywhere" costs one small
#   all-reduce in wait(), of a vector of used-flags (one per parameter).
# Frozen parameters (requires_grad=False) are neither hooked nor reduced.


class DataParallelBase(nn.Module):
    """What both data-parallel wrappers share: the same start on every replica, the forward,
    and the sync flag. Subclasses sum the gradients; call wait() before clipping."""

    def __init__(self, module, mesh):
        super().__init__()
        self.module, self.mesh = module, mesh
        # off: backward only accumulates into the local .grad
        self.require_backward_grad_sync = True
        self.launches = 0  # gradient all-reduces launched so far: the tests count them
        with torch.no_grad():  # every replica starts from the weights of dp rank 0
            # (not the experts of expert parallelism, different on each rank of an ep group:
            # expert_parallel.py)
            for t in ([p for p in module.parameters() if not hasattr(p, "_ep")]
                      + list(module.buffers())):
                # from the global rank of grid[0, pp_rank, cp_rank, tp_rank]
                dist.broadcast(t, src=mesh.rank % (mesh.world // mesh.dp), group=mesh.dp_group)
        self.params = [p for p in module.parameters() if p.requires_grad and not hasattr(p, "_ep")]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Gradient accumulation: no communication inside, gradients only add up in .grad."""
        before, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before

    def _used_anywhere(self):
        """For each parameter: did it get a gradient on at least one dp rank this step?"""
        used = torch.tensor([p.grad is not None for p in self.params], dtype=torch.float32,
                            device=self.mesh.device)
        dist.all_reduce(used, group=self.mesh.dp_group)
        return (used > 0).tolist()


class NaiveDataParallel(DataParallelBase):
    """Data parallelism with one blocking all-reduce per parameter in wait(), after the last
    backward. Nothing is sent during backward, so the sync flag and no_sync() change nothing
    here."""

    def wait(self):
        """Sums the gradients: after this every rank holds the same gradient of the mean loss."""
        for p, used in zip(self.params, self._used_anywhere()):
            if not used:
                continue  # no gradient on any rank: stays None
            if p.grad is None:  # unused here, used elsewhere: this rank contributes zeros
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=self.mesh.dp_group)
            self.launches += 1


class DataParallel(DataParallelBase):
    """Data parallelism with bucketed all-reduces overlapped with backward."""

    def __init__(self, module, mesh, bucket_mb=25.0):
        super().__init__(module, mesh)
        # buckets in reverse registration order, which is roughly the order backward finishes them
        cap = bucket_mb * 2 ** 20
        self.buckets, current = [], []
        # pipeline.py
        tied = tied_copy(getattr(module, "_orig_mod", module)) if mesh.pp > 1 else None
        for p in reversed(self.params):
            # a bucket of its own: ZeRO then slices it alike on the first and the last stage
            if p is tied:
                self.buckets += [Bucket(current), Bucket([p])] if current else [Bucket([p])]
                current = []
                continue
            current.append(p)
            if sum(q.numel() * q.element_size() for q in current) >= cap:
                self.buckets.append(Bucket(current))
                current = []
        if current:
            self.buckets.append(Bucket(current))
        self.launched = 0  # buckets 0 .. launched - 1 are on their way, in this order
        self.pending = []  # (bucket, async work) in launch order
        for bucket in self.buckets:
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(
                    lambda p, bucket=bucket: self._grad_ready(bucket))

    def _grad_ready(self, bucket):
        # runs inside backward, right after a parameter's .grad received this micro-step's
        # gradient. With sync off it does nothing; so the flag has to be right *before* the
        # last backward starts: set after it, the hooks have already fired and nothing was sent.
        if not self.require_backward_grad_sync:
            return
        if bucket.ready == len(bucket.params):
            raise RuntimeError("gradient sync ran twice in one step: use no_sync() "
                               "(require_backward_grad_sync=False) on every micro-step but the "
                               "last, and call wait() before the optimizer step")
        bucket.ready += 1
        # launch in bucket order: this bucket, and the complete ones waiting behind it, go
        # only once every bucket before them has gone
        while self.launched < len(self.buckets) and self.buckets[self.launched].complete():
            self._launch(self.buckets[self.launched])

    def _launch(self, bucket):
        offset = 0
        for p in bucket.params:  # p.grad holds the sum over all micro-steps of this iteration
            n = p.numel()
            # only when wait() launches it: no gradient on this rank, so it contributes zeros
            if p.grad is None:
                bucket.flat[offset:offset + n].zero_()
            else:
                bucket.flat[offset:offset + n].copy_(p.grad.reshape(-1))
            offset += n
        self.pending.append((bucket,
                             dist.all_reduce(bucket.flat, group=self.mesh.dp_group,
                                             async_op=True)))
        self.launched += 1
        self.launches += 1

    def wait(self):
        """Finishes the gradient sum: after this every rank holds the same gradient of the mean
        loss."""
        # buckets backward did not complete (a parameter without gradient on this rank, or
        # gradients from no_sync micro-steps only) go now, still in bucket order
        while self.launched < len(self.buckets):
            self._launch(self.buckets[self.launched])
        # the buckets first: a dead peer's missing all-reduce times out here
        for _, work in self.pending:
            work.wait()
        used = dict(zip(self.params, self._used_anywhere()))
        for bucket, _ in self.pending:
            offset = 0
            for p in bucket.params:
                n = p.numel()
                if used[p]:  # a parameter no rank used keeps grad None (its slice is zeros)
                    if p.grad is None:
                        p.grad = torch.empty_like(p)
                    p.grad.copy_(bucket.flat[offset:offset + n].view_as(p))
                offset += n
            bucket.ready = 0
        self.pending, self.launched = [], 0


class Bucket:
    def __init__(self, params):
        self.params = params
        self.ready = 0  # parameters whose gradient is final in this backward
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                                device=params[0].device)

    def complete(self):
        return self.ready == len(self.params)


def sum_hook(group, bucket):
    """torch DDP's comm hook that all-reduces a bucket and leaves the sum (its default divides)."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def wrap(model, mesh, impl="bucketed", bucket_mb=4.0):
    """train.py's data-parallel line: the model in the wrapper that sums its gradients over the
    dp ranks: ours by hand (bucketed, or naive), or torch's DistributedDataParallel (the peer,
    which averages unless a comm hook says otherwise: ours sums, as torchtitan's does). ZeRO 1/2
    (zero.py's ZeroDataParallel, on these buckets) is train.py's own line."""
    if impl == "torch":
        ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_mb, process_group=mesh.dp_group)
        ddp.register_comm_hook(mesh.dp_group, sum_hook)
        return ddp
    if impl == "naive":
        return NaiveDataParallel(model, mesh)
    return DataParallel(model, mesh, bucket_mb)
