"""
Everything that knows about processes, in the order train.py uses it:

- setup: the process group from the torchrun environment, the dp x pp rank grid (one
  explicit Mesh object, passed to whoever needs it: no hidden global), the error hook that
  turns a dead peer into one line, small collectives;
- data parallel by hand: NaiveDataParallel (one all-reduce per parameter) beside the
  bucketed, overlapped DataParallel, both with no_sync();
- ZeRO stages 1 and 2 by hand on DataParallel's buckets: ZeroDataParallel (gradients
  all-reduced, or reduce-scattered to slices) and ZeroOptimizer (AdamW on this rank's slices,
  then an all-gather), with optional CPU offload of the optimizer;
- FSDP2 (ZeRO-3): fully_shard_model wraps torch's fully_shard per block;
- tensor parallel by hand: tensor_parallel shards a built model in place (Megatron
  column / row pairs, vocabulary-parallel embedding, head and loss);
- pipeline parallel by hand: point-to-point helpers and the GPipe and 1F1B schedules;
- global-norm gradient clipping across pipeline stages, FSDP shards, ZeRO slices and tp slices, memory accounting.

Checkpoint files live in checkpoint.py. Works as a plain single process (`python train.py`)
and under torchrun.
"""

import ctypes
import os
import sys
import time
import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

from configurator import UserError
from configurator import excepthook as configurator_excepthook
from model import init_tensor, newton_schulz


# ---------------------------------------------------------------------------------------
# process setup and the rank grid


@dataclass
class Mesh:
    """Who this process is in the dp x pp x tp rank grid. The grid is
    torch.arange(world).view(dp, pp, tp): rank = (dp_rank * pp + pp_rank) * tp + tp_rank.
    tp is innermost: the tensor-parallel ranks, which all-reduce inside every block, are
    consecutive (the same node, its fastest link); then the stages of one pipeline
    (point-to-point, once per micro-batch per stage boundary); a stage's data-parallel
    replicas are pp * tp ranks apart (one all-reduce per step)."""
    rank: int          # global rank, 0 .. world - 1
    local_rank: int    # rank on this node: picks the GPU
    world: int
    dp: int            # data-parallel replicas of the whole pipeline
    pp: int            # pipeline stages
    dp_rank: int
    pp_rank: int       # this rank's stage
    device: torch.device
    backend: str       # "gloo" | "nccl" | "" for a single process
    dp_group: object = None  # the ranks with the same stage and tp slice: gradients are averaged here (None: all)
    pp_group: object = None  # the stages of this rank's pipeline (same dp_rank, same tp_rank)
    dp_mesh: object = None   # dp_group as a DeviceMesh, for FSDP2
    tp: int = 1        # tensor-parallel ranks: each holds a slice of every block's matmuls
    tp_rank: int = 0
    tp_group: object = None  # the ranks that share one stage's matmuls (consecutive ranks)
    tp_mesh: object = None   # tp_group as a DeviceMesh (the peer test against torch's tensor parallel)

    @property
    def master(self):
        return self.rank == 0

    @property
    def first_stage(self):
        return self.pp_rank == 0

    @property
    def last_stage(self):
        return self.pp_rank == self.pp - 1

    def stage_rank(self, stage):
        """Global rank of stage `stage` in this rank's pipeline: the same tp_rank, so each tp
        shard of a stage talks to the same shard of its neighbours."""
        return (self.dp_rank * self.pp + stage) * self.tp + self.tp_rank

    def print0(self, *args, **kwargs):
        if self.master:
            print(*args, **kwargs, flush=True)


def pick_device(device):
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device={device} but CUDA is not available here: use device=cpu or device=auto")
    if device.split(":")[0] not in ("cpu", "cuda", "mps"):
        raise UserError(f"device={device} is not one of auto, cpu, cuda, mps")
    return torch.device(device)


def keep_freed_memory(mmap_mb=32):
    """CPU runs on Linux: keep freed tensor memory in the process instead of handing it back.

    glibc's malloc serves a block over its mmap threshold (128 KB at first) with a fresh mmap and
    returns it to the OS when it is freed, so every step's logits, softmax and their gradients
    (512 x 8192 floats = 16 MB each in the default job) arrive as untouched pages that the kernel
    faults in and zeroes one 4 KB page at a time: ~6,600 page faults per step, measured ~7% of
    the default job's time. Fixing the threshold at `mmap_mb` (the most glibc allows on 64-bit)
    and raising the trim threshold lets the heap keep and reuse those blocks. Returns whether it
    took (False where the C library is not glibc: macOS, musl)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h
    return bool(libc.mallopt(M_MMAP_THRESHOLD, mmap_mb << 20) and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))


def setup(device="auto", dist_timeout_s=300, backend="auto", pp=1, tp=1):
    """Reads RANK / LOCAL_RANK / WORLD_SIZE from torchrun (absent: one process), starts the
    process group (nccl with one GPU per local rank, gloo on CPU) and builds the dp x pp x tp
    grid. A collective that waits longer than dist_timeout_s (a dead or hung peer) raises
    instead of hanging."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dev = pick_device(device)
    if backend not in ("auto", "gloo", "nccl"):
        raise UserError(f"backend={backend} is not one of auto, gloo, nccl")
    if backend == "nccl" and dev.type != "cuda":
        raise UserError(f"backend=nccl needs CUDA tensors but device is {dev.type}: use backend=gloo (or auto)")
    if pp < 1 or world % pp:
        raise UserError(f"pp={pp} pipeline stages do not divide the {world} ranks: start a multiple of pp "
                        f"processes (torchrun --nproc_per_node=N), or change pp")
    if tp < 1 or world % (pp * tp):
        raise UserError(f"pp={pp} x tp={tp} does not divide the {world} ranks: start a multiple of pp * tp "
                        f"processes (torchrun --nproc_per_node=N), or change pp or tp")
    if world == 1 and "RANK" not in os.environ:
        return Mesh(rank=0, local_rank=0, world=1, dp=1, pp=1, dp_rank=0, pp_rank=0, device=dev, backend="")
    if dev.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise UserError(f"LOCAL_RANK={local_rank} but this node has {torch.cuda.device_count()} GPUs: "
                            f"start at most that many processes per node (--nproc_per_node)")
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    store = None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # under torchrun the store outlives a restart of the workers (--max-restarts): prefix
        # our keys with the attempt, or the new workers can read the dead ones' addresses
        store = dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
            timeout=timedelta(seconds=dist_timeout_s)))
    dist.init_process_group(backend, store=store, timeout=timedelta(seconds=dist_timeout_s), rank=rank,
                            world_size=world, device_id=dev if backend == "nccl" else None)
    dp = world // (pp * tp)
    # the grid torch.arange(world).view(dp, pp, tp), row-major as Mesh's docstring says:
    # grid[:, s, t] is a dp group, grid[d, :, t] a pipeline, grid[d, s, :] a tp group
    grid = init_device_mesh(dev.type, (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))
    return Mesh(rank=rank, local_rank=local_rank, world=world, dp=dp, pp=pp, dp_rank=rank // (pp * tp),
                pp_rank=rank // tp % pp, device=dev, backend=backend, dp_group=grid.get_group("dp"),
                pp_group=grid.get_group("pp"), dp_mesh=grid["dp"], tp=tp, tp_rank=rank % tp,
                tp_group=grid.get_group("tp"), tp_mesh=grid["tp"])


def excepthook(kind, err, tb):
    """train.py's sys.excepthook: configurator's (a UserError is one line, a bug keeps its
    traceback) plus the two cases only a process group has. A collective that failed
    because a peer died or hung (gloo and NCCL raise a plain RuntimeError that names them)
    is one line too, with the backend's own first line, whole: it names the cause. And
    with a live process group we leave at once: the interpreter's shutdown with gloo's
    threads still holding work can hang or abort, which would stall torchrun's restart."""
    out = sys.__stderr__
    if isinstance(err, RuntimeError) and any(s in str(err) for s in ("gloo", "NCCL", "Timed out", "timed out")):
        print(f"error: a collective failed ({str(err).strip().splitlines()[0]}): a peer process died or waited "
              f"longer than dist_timeout_s; check the other ranks' output, or raise dist_timeout_s if a rank is "
              f"only slow (e.g. a long save)", file=out, flush=True)
    else:
        configurator_excepthook(kind, err, tb)
    if dist.is_initialized():
        out.flush()
        sys.stdout.flush()
        os._exit(1)


def teardown(mesh):
    if mesh.backend:
        # every rank gets here before any destroys its groups: a rank that tears down while a
        # peer is still finishing (rank 0 sampling, say) can abort in gloo's worker threads
        dist.barrier()
        dist.destroy_process_group()


def exit_now(code=0):
    """Ends a process that has torn its process group down and written everything, without
    the interpreter's shutdown. There gloo's worker threads, still holding finished work, can
    take the whole process down with SIGABRT ("terminate called without an active
    exception"; pytorch/pytorch#190489), and a run that did all its work would exit as failed:
    seen here about once in a few hundred multi-process runs."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def barrier(mesh):
    if mesh.backend:
        dist.barrier()


def all_gather_object(obj, mesh):
    """[obj of rank 0, obj of rank 1, ...] on every rank."""
    if not mesh.backend:
        return [obj]
    out = [None] * mesh.world
    dist.all_gather_object(out, obj)
    return out


def gather_to_master(obj, mesh):
    """[obj of rank 0, obj of rank 1, ...] on rank 0, None elsewhere."""
    if not mesh.backend:
        return [obj]
    out = [None] * mesh.world if mesh.master else None
    dist.gather_object(obj, out, dst=0)
    return out


def broadcast_object(obj, mesh):
    """Rank 0's obj on every rank."""
    if not mesh.backend:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_reduce_sum(t, mesh, group=None):
    """Sum of a tensor over all ranks, or over `group` (a copy; the input is left alone)."""
    t = t.to(mesh.device, copy=True)
    if mesh.backend:
        dist.all_reduce(t, group=group)
    return t


# ---------------------------------------------------------------------------------------
# data parallel, by hand
#
# Every dp rank holds the whole model and runs its own micro-batches; before the optimizer
# step the gradients are averaged over the ranks, so every rank takes the same step and the
# weights stay identical. Two ways to average, side by side, with one interface
# (forward, no_sync() or the require_backward_grad_sync flag, wait()):
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
#   1 only gets (g0 + 0) / dp, what torch DDP(find_unused_parameters=True) gives. A
#   parameter unused on every rank keeps grad None, so AdamW leaves it alone (no momentum,
#   no decay), again as torch DDP does. Knowing "unused everywhere" costs one small
#   all-reduce of a used-flag per parameter in wait().
# Frozen parameters (requires_grad=False) are neither hooked nor reduced.


class DataParallelBase(nn.Module):
    """What both data-parallel wrappers share: the same start on every replica, the forward,
    and the sync flag. Subclasses average the gradients; call wait() before clipping."""

    def __init__(self, module, mesh):
        super().__init__()
        self.module, self.mesh = module, mesh
        self.require_backward_grad_sync = True  # off: backward only accumulates into the local .grad
        self.launches = 0  # gradient all-reduces launched so far: the tests count them
        with torch.no_grad():  # every replica starts from the weights of dp rank 0
            for t in list(module.parameters()) + list(module.buffers()):
                # from the global rank of grid[0, pp_rank, tp_rank]
                dist.broadcast(t, src=mesh.pp_rank * mesh.tp + mesh.tp_rank, group=mesh.dp_group)
        self.params = [p for p in module.parameters() if p.requires_grad]

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
        used = torch.tensor([p.grad is not None for p in self.params], dtype=torch.float32, device=self.mesh.device)
        dist.all_reduce(used, group=self.mesh.dp_group)
        return (used > 0).tolist()


class NaiveDataParallel(DataParallelBase):
    """Data parallelism with one blocking all-reduce per parameter in wait(), after the last
    backward. Nothing is sent during backward, so the sync flag and no_sync() change nothing here."""

    def wait(self):
        """Averages the gradients: after this every rank holds the same mean gradient."""
        for p, used in zip(self.params, self._used_anywhere()):
            if not used:
                continue  # no gradient on any rank: stays None
            if p.grad is None:  # unused here, used elsewhere: this rank contributes zeros
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=self.mesh.dp_group)
            p.grad /= self.mesh.dp  # all_reduce summed; we want the mean (gloo has no AVG)
            self.launches += 1


class DataParallel(DataParallelBase):
    """Data parallelism with bucketed all-reduces overlapped with backward."""

    def __init__(self, module, mesh, bucket_mb=25.0):
        super().__init__(module, mesh)
        # buckets in reverse registration order, which is roughly the order backward finishes them
        cap = bucket_mb * 2 ** 20
        self.buckets, current = [], []
        for p in reversed(self.params):
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
                p.register_post_accumulate_grad_hook(lambda p, bucket=bucket: self._grad_ready(bucket))

    def _grad_ready(self, bucket):
        # runs inside backward, right after a parameter's .grad received this micro-step's
        # gradient. With sync off it does nothing; so the flag has to be right *before* the
        # last backward starts: set after it, the hooks have already fired and nothing was sent.
        if not self.require_backward_grad_sync:
            return
        if bucket.ready == len(bucket.params):
            raise RuntimeError("gradient sync ran twice in one step: use no_sync() (require_backward_grad_sync=False) "
                               "on every micro-step but the last, and call wait() before the optimizer step")
        bucket.ready += 1
        # launch in bucket order: this bucket, and the complete ones waiting behind it, go
        # only once every bucket before them has gone
        while self.launched < len(self.buckets) and self.buckets[self.launched].complete():
            self._launch(self.buckets[self.launched])

    def _launch(self, bucket):
        offset = 0
        for p in bucket.params:  # p.grad holds the sum over all micro-steps of this iteration
            n = p.numel()
            if p.grad is None:  # only when wait() launches it: no gradient on this rank, so it contributes zeros
                bucket.flat[offset:offset + n].zero_()
            else:
                bucket.flat[offset:offset + n].copy_(p.grad.reshape(-1))
            offset += n
        self.pending.append((bucket, dist.all_reduce(bucket.flat, group=self.mesh.dp_group, async_op=True)))
        self.launched += 1
        self.launches += 1

    def wait(self):
        """Finishes the gradient average: after this every rank holds the same mean gradient."""
        # buckets backward did not complete (a parameter without gradient on this rank, or
        # gradients from no_sync micro-steps only) go now, still in bucket order
        while self.launched < len(self.buckets):
            self._launch(self.buckets[self.launched])
        for _, work in self.pending:  # the buckets first: a dead peer's missing all-reduce times out here
            work.wait()
        used = dict(zip(self.params, self._used_anywhere()))
        for bucket, _ in self.pending:
            bucket.flat /= self.mesh.dp  # all_reduce summed; we want the mean (gloo has no AVG)
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
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)

    def complete(self):
        return self.ready == len(self.params)


def shared_orthogonalize(mesh, dtype):
    """Muon's Newton-Schulz under data parallel (not FSDP): after the all-reduce every dp rank
    holds the same mean gradients, so orthogonalizing every matrix on every rank repeats the
    same work dp times. Instead each rank orthogonalizes a share of the matrices (largest
    first, each to the least loaded rank, by the iteration's cost m n min(m, n)) and one
    all-gather hands everyone the results: 1/dp of the work, the same bits on every rank.
    Returns the function that replaces MuonWithAdamW.orthogonalize."""
    def orthogonalize(gs):
        if not gs:
            return []
        load, owner = [0] * mesh.dp, [0] * len(gs)
        for i in sorted(range(len(gs)), key=lambda i: -gs[i].numel() * min(gs[i].shape)):
            owner[i] = min(range(mesh.dp), key=lambda r: load[r])
            load[owner[i]] += gs[i].numel() * min(gs[i].shape)
        owned = [[i for i in range(len(gs)) if owner[i] == r] for r in range(mesh.dp)]
        size = max(sum(gs[i].numel() for i in mine) for mine in owned)
        flat = torch.zeros(size, dtype=gs[0].dtype, device=gs[0].device)  # this rank's results, padded
        offset = 0
        for i in owned[mesh.dp_rank]:
            flat[offset:offset + gs[i].numel()] = newton_schulz(gs[i], dtype=dtype).flatten()
            offset += gs[i].numel()
        every = [torch.empty_like(flat) for _ in range(mesh.dp)]
        dist.all_gather(every, flat, group=mesh.dp_group)
        out = [None] * len(gs)
        for r, mine in enumerate(owned):
            offset = 0
            for i in mine:
                out[i] = every[r][offset:offset + gs[i].numel()].view_as(gs[i])
                offset += gs[i].numel()
        return out
    return orthogonalize


# ---------------------------------------------------------------------------------------
# ZeRO stages 1 and 2, by hand, on the data-parallel buckets
#
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
#   stage 3 shards the parameters too: that is fsdp=True (FSDP2, above).
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
    over the dp ranks. After wait(), each Shard's tensor.grad holds the mean gradient of
    this rank's pieces (a view of the whole gradient in stage 1, of the reduced chunk in
    stage 2); ZeroOptimizer steps them."""

    def __init__(self, module, mesh, bucket_mb=25.0, stage=1):
        assert stage in (1, 2), f"ZeRO stage {stage}: 1 or 2 here (stage 3 is fsdp=True)"
        super().__init__(module, mesh, bucket_mb)
        self.stage = stage
        self.had_grad = {}  # stage 2: did p have a gradient here when its bucket went (its .grad is freed then)
        self.shards = []
        for bucket in self.buckets:
            numel = sum(p.numel() for p in bucket.params)
            bucket.chunk = -(-numel // mesh.dp)  # elements per rank; the bucket is padded to chunk * dp
            lo, hi = mesh.dp_rank * bucket.chunk, (mesh.dp_rank + 1) * bucket.chunk  # this rank's chunk
            kw = dict(dtype=bucket.flat.dtype, device=bucket.flat.device)
            # stage 1 all-reduces the whole padded bucket through a persistent buffer, as DataParallel;
            # stage 2 has the full-size buffer only while the bucket is being reduced, and keeps its chunk
            bucket.flat = torch.zeros(bucket.chunk * mesh.dp, **kw) if stage == 1 else None
            bucket.grad_chunk = torch.zeros(bucket.chunk, **kw) if stage == 2 else None
            offset = 0
            for p in bucket.params:
                a, b = max(lo, offset), min(hi, offset + p.numel())
                if a < b:
                    assert p.is_contiguous(), "a shard is a view of the flat parameter: parameters must be contiguous"
                    piece = nn.Parameter(p.detach().view(-1)[a - offset:b - offset])
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
        work = dist.reduce_scatter_single(bucket.grad_chunk, bucket.flat, group=self.mesh.dp_group, async_op=True)
        self.pending.append((bucket, work))
        self.launched += 1
        self.launches += 1

    def _used_anywhere(self):
        if self.stage == 1:
            return super()._used_anywhere()
        used = torch.tensor([self.had_grad[p] for p in self.params], dtype=torch.float32, device=self.mesh.device)
        dist.all_reduce(used, group=self.mesh.dp_group)
        return (used > 0).tolist()

    def wait(self):
        """Finishes the gradient reduction; then each shard's .grad is its piece of the mean
        gradient (None for a parameter that no rank used: AdamW leaves it alone, as in DataParallel)."""
        if self.stage == 1:
            super().wait()  # every rank holds the whole mean gradient; the shards' gradients are views of it
            for s in self.shards:
                s.tensor.grad = None if s.param.grad is None else s.param.grad.view(-1)[s.start:s.start + s.n]
            return
        while self.launched < len(self.buckets):  # buckets backward did not complete go now, in order
            self._launch(self.buckets[self.launched])
        for bucket, work in self.pending:
            work.wait()
            bucket.flat = None  # the full-size buffer goes back to the allocator
            bucket.grad_chunk /= self.mesh.dp  # reduce-scatter summed; we want the mean
            bucket.ready = 0
        used = dict(zip(self.params, self._used_anywhere()))
        for s in self.shards:
            s.tensor.grad = s.bucket.grad_chunk[s.chunk_offset:s.chunk_offset + s.n] if used[s.param] else None
        self.pending, self.launched = [], 0


class ZeroOptimizer:
    """AdamW over this rank's shards only (the state of 1/dp of the model), then one
    all-gather per bucket that gives every rank every updated parameter. param_groups as
    for torch.optim.AdamW, over the model's parameters: a parameter's group decides its
    shards' options (weight decay on 2-D weights only, say). The loop uses it like AdamW:
    .param_groups (set "lr"), .zero_grad(), .step(), .state.
    offload: AdamW's state and its step live in CPU memory (each step copies the shards'
    gradients there and the updated pieces back). On a CPU-only machine there is nothing
    to move and this is the same path: that is how this code runs it."""

    def __init__(self, model, param_groups, offload=False, **adamw):
        assert isinstance(model, ZeroDataParallel), "ZeroOptimizer steps the shards of a ZeroDataParallel"
        self.model, self.mesh, self.shards = model, model.mesh, model.shards
        self.offload = offload and model.mesh.device.type != "cpu"
        # what AdamW steps: the shards themselves (views of the weights), or their copies in CPU memory
        self.stepped = [nn.Parameter(s.tensor.detach().cpu().clone()) if self.offload else s.tensor
                        for s in self.shards]
        group_of = {p: i for i, g in enumerate(param_groups) for p in g["params"]}
        self.optimizer = torch.optim.AdamW(
            [{**{k: v for k, v in g.items() if k != "params"},
              "params": [t for s, t in zip(self.shards, self.stepped) if group_of[s.param] == i]}
             for i, g in enumerate(param_groups)], **adamw)
        self.param_groups, self.state = self.optimizer.param_groups, self.optimizer.state

    @property
    def params(self):
        """The shards, whose gradients clipping measures (sharded over dp: clip_grad_norm_(..., sharded=True))."""
        return [s.tensor for s in self.shards]

    def zero_grad(self, set_to_none=True):
        for p in self.model.params + self.params + self.stepped:
            p.grad = None

    @torch.no_grad()
    def step(self):
        if self.offload:
            for s, t in zip(self.shards, self.stepped):
                t.grad = None if s.tensor.grad is None else s.tensor.grad.to("cpu")
        self.optimizer.step()
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
        piece(shard, stepped tensor) at each of this rank's shards of the bucket (zeros elsewhere)."""
        mine = torch.zeros(bucket.chunk, device=self.mesh.device)
        for s, t in zip(self.shards, self.stepped):
            if s.bucket is bucket:
                mine[s.chunk_offset:s.chunk_offset + s.n] = piece(s, t)
        full = torch.empty(bucket.chunk * self.mesh.dp, device=self.mesh.device)
        dist.all_gather_single(full, mine, group=self.mesh.dp_group)
        return full

    # Checkpoints hold the whole AdamW state under parameter names, as a plain run saves it,
    # so any layout resumes any other. Saving gathers the slices into whole tensors on every
    # rank (a memory spike of the full state at save: simple, and fine at this scale; DCP
    # writes the replicated tensors once); loading reads the whole state and keeps its slices.

    def full_state(self, names):
        """{"name.exp_avg", "name.exp_avg_sq": whole tensor, "name.step": scalar} for every
        parameter (zeros before the first step). names: parameter -> its global name."""
        out = {}
        for key in ("exp_avg", "exp_avg_sq"):
            for bucket in self.model.buckets:
                full = self._gather(bucket, lambda s, t: self.state[t].get(key, 0.0))
                offset = 0
                for p in bucket.params:
                    out[f"{names[p]}.{key}"] = full[offset:offset + p.numel()].view_as(p).clone()
                    offset += p.numel()
        # a parameter's pieces share one step count; a rank that owns none of it says 0
        steps = torch.zeros(len(self.model.params), device=self.mesh.device)
        index = {p: i for i, p in enumerate(self.model.params)}
        for s, t in zip(self.shards, self.stepped):
            if "step" in self.state[t]:
                steps[index[s.param]] = self.state[t]["step"].item()
        dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=self.mesh.dp_group)
        for p, i in index.items():
            out[f"{names[p]}.step"] = steps[i].cpu().clone()
        return out

    def load_full_state(self, state, names):
        """Takes this rank's slices of a whole AdamW state (full_state's form, as loaded from a checkpoint)."""
        fused = self.optimizer.defaults.get("fused")
        for s, t in zip(self.shards, self.stepped):
            name = names[s.param]
            self.state[t] = {"step": state[f"{name}.step"].to(t.device if fused else "cpu", torch.float32, copy=True)}
            for key in ("exp_avg", "exp_avg_sq"):
                self.state[t][key] = state[f"{name}.{key}"].reshape(-1)[s.start:s.start + s.n].to(t.device, copy=True)


# ---------------------------------------------------------------------------------------
# FSDP2: fully sharded data parallel (ZeRO-3) with torch's fully_shard
#
# Each dp rank keeps 1/dp of every parameter, of its gradient and of its optimizer state.
# A block's full weights exist only while it runs: all-gathered before its forward (and
# again before its backward, if resharded after forward), and its gradients are
# reduce-scattered back to shards after its backward. Wrapping each block separately is
# what bounds the memory: only one block is whole at a time, and the next block's
# all-gather overlaps the current block's compute.


def fully_shard_model(model, mesh, reshard_after_forward=True, bf16=False, offload=False):
    """Shards `model` (a whole model or a pipeline stage) over mesh.dp_mesh, in place: each
    transformer block, then the root (embedding, final norm, head). bf16: compute in bf16
    with fp32 gradient reduction (CUDA); otherwise everything stays fp32. offload: the
    parameter shards (so the optimizer state and its step too) live in CPU memory and are
    copied to the GPU for each block's use (CPUOffloadPolicy); on a CPU device there is
    nothing to move and it is not set."""
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
          if bf16 else MixedPrecisionPolicy())
    kw = dict(mesh=mesh.dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp,
              offload_policy=CPUOffloadPolicy() if offload and mesh.device.type != "cpu" else OffloadPolicy())
    for block in model.layers.values():
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


# ---- meta-device build: no rank ever holds the whole model ------------------------------
# train.py builds the model on the meta device (shapes, no storage), cuts its pipeline stage,
# applies tensor parallel and FSDP there, then gives each rank storage for what it holds
# (materialize) and fills it: fresh weights, an imported file or a checkpoint, each rank
# reading only its own part (local_parts says which part of which full tensor that is).


def materialize(model, device):
    """Real (uninitialized) storage on `device` for the meta parameters and buffers of
    `model`, in place. FSDP2 re-points its shards at the new storage in its own to_empty.
    Otherwise we swap each Parameter by hand: nn.Module.to_empty would make new Parameters
    per module, which unties a tied head from the embedding and drops the attributes that
    tensor_parallel sets (_tp_dim, _tp_group)."""
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return model.to_empty(device=device)
    new = {}  # meta Parameter -> its replacement (a tied weight is one Parameter under two names)
    for m in model.modules():
        for key, p in m._parameters.items():
            if p is not None and p.is_meta:
                if p not in new:
                    new[p] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                    new[p].__dict__.update(p.__dict__)
                m._parameters[key] = new[p]
        for key, b in m._buffers.items():
            if b is not None and b.is_meta:
                m._buffers[key] = torch.empty_like(b, device=device)
    return model


def local_parts(model):
    """(name, local, full_shape, dim, start, stop) for each parameter of `model` (a tied one
    once): `local` is the tensor this rank holds, the slice [start, stop) along `dim` of the
    full tensor of shape full_shape; dim None: the whole tensor. An FSDP shard is a block of
    rows (dim 0, torch.chunk's split, as DTensor's Shard(0) cuts), a tensor-parallel slice
    one chunk along its _tp_dim; a layout with both is refused by train.py."""
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            assert len(p.placements) == 1 and p.placements[0].is_shard(0), f"{name}: {p.placements}, not FSDP's Shard(0)"
            local, n, r = p.to_local(), p.device_mesh.size(), p.device_mesh.get_local_rank()
            size = -(-p.shape[0] // n)  # torch.chunk's chunk size
            start = min(r * size, p.shape[0])
            dim, stop = 0, min(start + size, p.shape[0])
        elif hasattr(p, "_tp_dim"):
            local, dim, n = p, p._tp_dim, dist.get_world_size(p._tp_group)
            size = p.shape[dim]
            start, stop = dist.get_rank(p._tp_group) * size, (dist.get_rank(p._tp_group) + 1) * size
        else:
            yield name, p, tuple(p.shape), None, 0, 0
            continue
        full = tuple(p.shape) if isinstance(p, DTensor) else tuple(p.shape[:dim]) + (size * n,) + tuple(p.shape[dim + 1:])
        assert local.shape[dim] == stop - start, f"{name}: local {tuple(local.shape)} is not rows {start}:{stop} of {full}"
        yield name, local, full, dim, start, stop


@torch.no_grad()
def init_weights(model, seed):
    """Fresh weights for the parameters this rank holds (after materialize): each one drawn
    whole on the CPU from its own generator (model.init_tensor: seeded by the run's seed and
    its name), and this rank's slice kept. The same bits as `Transformer(cfg)` with that seed
    in one process, whatever the layout; the price is one transient of the largest single
    parameter (the embedding or a SwiGLU matrix), not of the model."""
    for name, local, shape, dim, start, stop in local_parts(model):
        full = init_tensor(name, shape, model.cfg.n_layer, seed)
        local.copy_(full if dim is None else full.narrow(dim, start, stop - start))


class TensorMemory(TorchDispatchMode):
    """Counts the bytes of CPU tensor storage created while active and still alive (`now`)
    and the most at any moment (`peak`): what a rank allocates while it builds or imports the
    model (bench.py, tests). Storage that existed before is not counted."""

    def __init__(self):
        super().__init__()
        self.now = self.peak = 0
        self.seen = set()

    def _free(self, key, n):
        self.seen.discard(key)
        self.now -= n

    @staticmethod
    def _cpu_storages(tree):
        for t in torch.utils._pytree.tree_leaves(tree):
            t = t.to_local() if isinstance(t, DTensor) else t
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                s = t.untyped_storage()
                yield (s.data_ptr(), s.nbytes()), s

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        old = {key for key, _ in self._cpu_storages((args, kwargs))}  # a view or an in-place result is not new
        for key, s in self._cpu_storages(out):
            if key not in self.seen and key not in old and s.nbytes():
                self.seen.add(key)
                self.now += s.nbytes()
                self.peak = max(self.peak, self.now)
                weakref.finalize(s, self._free, key, s.nbytes())
        return out


def set_grad_sync(model, sync):
    """Gradient accumulation without communication: with sync=False a backward only adds
    into the local gradients. Our data-parallel wrappers and torch DDP take a flag, FSDP2 a method."""
    model = getattr(model, "_orig_mod", model)  # under torch.compile
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)
    elif isinstance(model, (DataParallelBase, DistributedDataParallel)):
        model.require_backward_grad_sync = sync


def reshard(model):
    """Frees gathered FSDP weights. With reshard_after_forward=False a forward leaves them
    gathered for its backward; after a forward without backward (evaluation) nothing else
    would free them, and the parameters would not be the optimizer's shards."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def memory_bytes(model, optimizer):
    """Bytes this rank holds of parameters, gradients and optimizer state (shards under FSDP;
    under ZeRO the state of this rank's slices, and with stage 2 the gradient chunks
    instead of whole gradients. Stage 1's slice gradients are views of the whole ones.)"""
    size = lambda ts: sum(_local(t).numel() * _local(t).element_size() for t in ts)  # noqa: E731
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if isinstance(optimizer, ZeroOptimizer):
        grads += [b.grad_chunk for b in optimizer.model.buckets if b.grad_chunk is not None]
    return {"params": size(model.parameters()),
            "grads": size(grads),
            "optimizer": size(v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v))}


# ---------------------------------------------------------------------------------------
# tensor parallel, by hand (Megatron-LM: Shoeybi et al. 2019, arXiv:1909.08053)
#
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
# Norms, residuals and dropout run on the replicated (B, T, n_embd) on every tp rank.
# The embedding is split by vocabulary rows (a rank looks up the ids it owns, zeros for the
# others, and g sums them); the head by vocabulary columns, and the loss is computed from
# the logit slices without gathering them (vocab_parallel_cross_entropy).
# model.py knows none of this: tensor_parallel() swaps each weight for its slice in place,
# and the attention reads its local head counts from the shapes it holds. Every sharded
# parameter carries `_tp_dim` (the dimension it is cut along) and `_tp_group`, which
# clipping and checkpoints (gather to the full tensor, slice on load) read.


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
        x = x.contiguous().clone()  # the all-reduce is in place; the partial sum may be saved for backward elsewhere
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class VocabParallelEmbedding(nn.Module):
    """The token embedding with rows [start, start + V / tp) of the table on this rank:
    ids outside its range look up zeros, and g adds the ranks' lookups into the full one.
    Its parameter keeps the name `weight`, so checkpoints see tok_embeddings.weight."""

    def __init__(self, weight, start, group):
        super().__init__()
        self.weight, self.start, self.group = weight, start, group

    def forward(self, idx):
        local = idx - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # (B, T, n_embd)
        x = x.masked_fill(outside[..., None], 0.0)
        return ReduceFromTP.apply(x, self.group)


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
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)  # the global row max, for a stable exp
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


def vocab_parallel_cross_entropy(logits, targets, loss_mask=None, start=0, group=None):
    """model.masked_cross_entropy for logit slices (B, T, V / tp): the mean over the
    positions whose mask is 1 (all without a mask); the same value on every tp rank."""
    loss = VocabParallelCrossEntropy.apply(logits.flatten(0, 1), targets.flatten(), start, group)
    if loss_mask is None:
        return loss.mean()
    mask = loss_mask.flatten().to(loss.dtype)
    return (loss * mask).sum() / mask.sum().clamp(min=1)


def _shard(module, dim, mesh):
    """module.weight -> this tp rank's slice along dim, in place, marked for clipping and checkpoints."""
    full = module.weight
    part = nn.Parameter(full.detach().chunk(mesh.tp, dim)[mesh.tp_rank].clone(), requires_grad=full.requires_grad)
    part._tp_dim, part._tp_group = dim, mesh.tp_group
    module.weight = part
    return part


def tensor_parallel(model, mesh):
    """Shards `model` (a whole model or a pipeline stage, built whole) over mesh.tp_group,
    in place: column-parallel wq, wk, wv, w1, w3 (dim 0, whole heads per rank), row-parallel
    wo, w2 (dim 1), vocabulary-parallel embedding and head with the loss computed from the
    logit slices. Norms stay replicated. Returns the model; a no-op at tp=1."""
    if mesh.tp == 1:
        return model
    cfg, tp, group = model.cfg, mesh.tp, mesh.tp_group
    for key, n in (("n_head", cfg.n_head), ("n_kv_head", cfg.n_kv_head), ("ffn_dim", cfg.ffn_dim),
                   ("vocab_size", cfg.vocab_size)):
        if n % tp:
            raise UserError(f"tp={tp} does not divide {key}={n}: every tp rank needs an equal share (whole heads, "
                            f"an equal slice of the SwiGLU width and of the vocabulary); use a tp that divides it")
    f = lambda module, args: (CopyToTP.apply(args[0], group), *args[1:])  # noqa: E731
    g = lambda module, args, out: ReduceFromTP.apply(out, group)  # noqa: E731
    for block in model.layers.values():
        att, ffn = block.attention, block.feed_forward
        for lin in (att.wq, att.wk, att.wv, ffn.w1, ffn.w3):  # column-parallel: a slice of the outputs
            _shard(lin, 0, mesh)
            lin.out_features //= tp
        for lin in (att.wo, ffn.w2):  # row-parallel: a slice of the inputs, a partial sum of the output
            _shard(lin, 1, mesh)
            lin.in_features //= tp
        for m in (att, ffn):  # one f before and one g after each half of the block
            m.register_forward_pre_hook(f)
            m.register_forward_hook(g)
    start = mesh.tp_rank * cfg.vocab_size // tp  # this rank's first vocabulary row
    if model.tok_embeddings is not None:
        emb = model.tok_embeddings
        model.tok_embeddings = VocabParallelEmbedding(_shard(emb, 0, mesh), start, group)
    if model.output is not None:
        if cfg.tie_embeddings and model.tok_embeddings is not None:  # the same rows of the same table
            model.output.weight = model.tok_embeddings.weight
        else:
            _shard(model.output, 0, mesh)
        model.output.out_features //= tp
        model.output.register_forward_pre_hook(f)
        model.loss_fn = partial(vocab_parallel_cross_entropy, start=start, group=group)
    return model


def tp_gather(t, p):
    """The full tensor of which `t` is this rank's slice, cut like parameter `p` (a collective over p's tp group)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(p._tp_group))]
    dist.all_gather(parts, t.contiguous(), group=p._tp_group)
    return torch.cat(parts, dim=p._tp_dim)


def tp_slice(full, p):
    """This rank's slice of the full tensor `full`, cut like parameter `p`."""
    return full.chunk(dist.get_world_size(p._tp_group), p._tp_dim)[dist.get_rank(p._tp_group)]


# ---------------------------------------------------------------------------------------
# pipeline parallel, by hand
#
# Stage s owns a contiguous range of layers (model.make_stage): stage 0 also the embedding,
# the last stage the final norm, the head and the loss. A micro-batch's forward flows
# stage 0 -> 1 -> ... -> pp-1 (activations sent forward); its backward flows back (the
# gradients of those activations sent backward). A micro-batch is one tuple
# (x, y, loss_mask, doc_ids) of (B, T) tensors or None. Two schedules, each a short function
# over the micro-batches of one iteration, built from the same forward_step / backward_step
# and the same point-to-point steps:
#   gpipe (all forwards, then all backwards): the reference. Every micro-batch's activations
#         stay alive until the backwards start: m per stage.
#   one_f_one_b: a warmup of min(pp - stage - 1, m) forwards, a steady state of one forward /
#         one backward, a cooldown of the backwards left over. At most pp - stage micro-batches
#         are alive at once, with the same bubble as GPipe: (pp - 1) / (m + pp - 1) idle.
#   interleaved (Narayanan et al. 2021, Megatron's interleaved 1F1B): each rank holds V chunks
#         of layers, virtual stages v * pp + rank (make_stage(virtual=V)); a micro-batch goes
#         through the ranks V times, rank pp-1 handing chunk v's output to rank 0's chunk v+1.
#         The bubble shrinks V-fold, to (pp - 1) / (V * m + pp - 1) idle, for V times the
#         point-to-point traffic.
# Micro-batch k's backward starts from weights[k] * loss_k: the gradients of the micro-batches
# add up, so weights 1/m give the gradient of the mean loss (as the plain loop's loss / m).


def p2p(mesh, send_next=None, send_prev=None, recv_prev=None, recv_next=None, ring=False):
    """One round of point-to-point traffic with the neighbouring stages of this pipeline.
    send_*: a tensor to send; recv_*: a buffer to fill (shapes are known up front, so none
    are exchanged). Everything is posted at once and then waited for (batch_isend_irecv), so
    two neighbours sending to each other at the same moment cannot deadlock. On a first or
    last stage the missing neighbour's half is a no-op: nothing comes before stage 0, nothing
    after the last; ring=True (interleaved chunks) wraps around instead: rank pp-1's next is
    rank 0. Sends go in the order (next, prev) and receives (prev, next): at pp=2 both
    neighbours are one rank, and the two messages between them pair up in that order."""
    prv = None if mesh.first_stage and not ring else mesh.stage_rank((mesh.pp_rank - 1) % mesh.pp)
    nxt = None if mesh.last_stage and not ring else mesh.stage_rank((mesh.pp_rank + 1) % mesh.pp)
    ops = [dist.P2POp(op, t, peer) for op, t, peer in ((dist.isend, send_next, nxt), (dist.isend, send_prev, prv),
                                                      (dist.irecv, recv_prev, prv), (dist.irecv, recv_next, nxt))
           if t is not None and peer is not None]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


# The point-to-point steps of the schedules (and of evaluation), one p2p round each. `shape`
# is the shape of the activations between stages, (B, T, n_embd); a receive on a stage
# without that neighbour returns None.

def recv_forward(mesh, shape):
    inp = None if mesh.first_stage else torch.empty(shape, device=mesh.device)
    p2p(mesh, recv_prev=inp)
    return inp


def send_forward(mesh, out):
    p2p(mesh, send_next=out)


def recv_backward(mesh, shape):
    grad = None if mesh.last_stage else torch.empty(shape, device=mesh.device)
    p2p(mesh, recv_next=grad)
    return grad


def send_backward(mesh, grad_in):
    p2p(mesh, send_prev=grad_in)


def send_forward_recv_backward(mesh, shape, out):
    grad = None if mesh.last_stage else torch.empty(shape, device=mesh.device)
    p2p(mesh, send_next=out, recv_next=grad)
    return grad


def send_backward_recv_forward(mesh, shape, grad_in):
    inp = None if mesh.first_stage else torch.empty(shape, device=mesh.device)
    p2p(mesh, send_prev=grad_in, recv_prev=inp)
    return inp


def stage_forward(stage, mesh, micro, inp, autocast, chunk=None, virtual=1):
    """The stage's forward of one micro-batch (x, y, loss_mask, doc_ids) -> (output, loss).
    Stage 0 reads the tokens x, the others their input from the previous stage; the last
    stage the targets and the mask (it computes the loss); every stage the document ids
    (every stage has attention). chunk (interleaved): which of the stage's `virtual` chunks
    runs; the first is the first stage only in chunk 0, the last the last only in chunk V-1."""
    on = lambda t: None if t is None else t.to(mesh.device)  # noqa: E731
    x, y, loss_mask, doc_ids = micro
    first = mesh.first_stage and not chunk
    last = mesh.last_stage and (chunk is None or chunk == virtual - 1)
    inp = on(x) if first else inp
    y, loss_mask = (on(y), on(loss_mask)) if last else (None, None)
    with autocast:
        if chunk is None:
            return stage(inp, y, loss_mask, on(doc_ids))
        return stage(inp, y, loss_mask, on(doc_ids), chunk=chunk)


@dataclass
class PipelineState:
    """What the steps of one stage's schedule share in one iteration: passed to each step,
    no closures."""
    stage: nn.Module       # the stage, or its DataParallel / FSDP form
    mesh: Mesh
    shape: tuple           # activations between stages: (B, T, n_embd)
    autocast: object
    weights: list          # micro-batch k's backward starts from weights[k] * loss_k
    trace: list            # None, or a list that receives (kind, micro-batch, start, end, chunk) per forward / backward
    loss_sum: torch.Tensor  # sum_k weights[k] * loss_k so far (on the last stage; 0 elsewhere)
    virtual: int = 1       # chunks per rank (interleaved); 1: one stage per rank
    alive: dict = field(default_factory=dict)  # (chunk, k) -> (input, output) of a forward whose backward is to come
    peak: int = 0          # the most micro-batch chunks alive at once


def _clock(st):
    if st.trace is not None and st.mesh.device.type == "cuda":
        torch.cuda.synchronize()  # when tracing: time the kernels, not their launches
    return time.perf_counter()


def forward_step(st, k, micro, inp, chunk=0):
    """Micro-batch k's forward on this stage (on its chunk `chunk`, interleaved); keeps
    (input, output) for its backward and returns the output to send to the next stage."""
    t0 = _clock(st)
    if inp is not None:
        inp.requires_grad_()  # we need the gradient of the stage's input, to send it back
    out, loss = stage_forward(st.stage, st.mesh, micro, inp, st.autocast, chunk if st.virtual > 1 else None,
                              st.virtual)
    if loss is not None:  # the last (virtual) stage
        out = loss * st.weights[k]  # the backward starts here
        st.loss_sum += loss.detach() * st.weights[k]
    st.alive[chunk, k] = (inp, out)
    st.peak = max(st.peak, len(st.alive))
    if st.trace is not None:
        st.trace.append(("F", k, t0, _clock(st), chunk))
    return out.detach()


def backward_step(st, k, grad_out, chunk=0):
    """Micro-batch k's backward on this stage (chunk) from the gradient of its output (None
    on the last stage: its output is the weighted loss); returns the gradient of its input,
    to send to the previous stage (None on stage 0)."""
    t0 = _clock(st)
    inp, out = st.alive.pop((chunk, k))
    # data parallel inside the stage: sync on its very last backward only, micro-batch m-1 of
    # chunk 0 (the backwards run the chunks from the last to the first); the buckets that
    # backward does not complete (other chunks' layers) go in wait()
    set_grad_sync(st.stage, k == len(st.weights) - 1 and chunk == 0)
    torch.autograd.backward(out, grad_out)
    if st.trace is not None:
        st.trace.append(("B", k, t0, _clock(st), chunk))
    return None if inp is None else inp.grad


def gpipe(st, micro_batches):
    """GPipe: all forwards, then all backwards (in the same order)."""
    mesh, shape = st.mesh, st.shape
    for k, micro in enumerate(micro_batches):
        send_forward(mesh, forward_step(st, k, micro, recv_forward(mesh, shape)))
    for k in range(len(micro_batches)):
        send_backward(mesh, backward_step(st, k, recv_backward(mesh, shape)))


def one_f_one_b(st, micro_batches):
    """1F1B: warmup, steady state, cooldown. The steady state pairs forward k with backward
    k - warmup and sends one's output while receiving the other's gradient, in one round."""
    mesh, shape, m = st.mesh, st.shape, len(micro_batches)
    warmup = min(mesh.pp - mesh.pp_rank - 1, m)  # forwards in flight before the first backward
    steady = m - warmup
    for k in range(warmup):  # warmup: forwards only
        send_forward(mesh, forward_step(st, k, micro_batches[k], recv_forward(mesh, shape)))
    inp = recv_forward(mesh, shape) if steady else None
    for i in range(steady):  # steady state: one forward, one backward
        k = warmup + i
        grad = send_forward_recv_backward(mesh, shape, forward_step(st, k, micro_batches[k], inp))
        grad_in = backward_step(st, i, grad)
        if i < steady - 1:
            inp = send_backward_recv_forward(mesh, shape, grad_in)
        else:
            send_backward(mesh, grad_in)
    for k in range(steady, m):  # cooldown: the backwards of the warmup's forwards
        send_backward(mesh, backward_step(st, k, recv_backward(mesh, shape)))


def interleaved_order(pp, rank, virtual, m):
    """The (kind, chunk, micro-batch) ops of `rank` under interleaved 1F1B, in Megatron's
    order: forwards go through the chunks in groups of pp micro-batches (chunk 0 for
    micro-batches 0..pp-1, chunk 1 for the same, ..., then chunk 0 for pp..2pp-1, ...);
    backwards the same way from the last chunk down. Warmup, steady state, cooldown as in
    1F1B, with a longer warmup: the other chunks' forwards must be in flight too."""
    total = virtual * m  # ops of each kind on this rank

    def fwd(i):  # the i-th forward: (chunk, micro-batch)
        group, j = divmod(i, pp * virtual)
        return j // pp, group * pp + j % pp

    def bwd(i):
        chunk, k = fwd(i)
        return virtual - 1 - chunk, k
    warmup = min((pp - rank - 1) * 2 + (virtual - 1) * pp, total)
    ops = [("F", *fwd(i)) for i in range(warmup)]
    for i in range(total - warmup):  # steady state: one forward, one backward
        ops += [("F", *fwd(warmup + i)), ("B", *bwd(i))]
    ops += [("B", *bwd(i)) for i in range(total - warmup, total)]  # cooldown
    return ops


def interleaved_rounds(pp, virtual, m):
    """rounds[rank][t]: the op (kind, chunk, micro-batch) rank runs in round t, or None. Each
    rank runs its ops in interleaved_order, each as early as its input allows (an op per
    round); after every round each rank exchanges with its ring neighbours exactly what they
    produced in it. Every rank computes the same table, so each knows what to receive and
    when, and every send meets its receive in the same round: no deadlock, no mismatched
    pair, on gloo and nccl alike."""
    orders = [interleaved_order(pp, r, virtual, m) for r in range(pp)]
    pos = [0] * pp  # each rank's next op in its order
    done, rounds = {}, [[] for _ in range(pp)]  # done: (kind, virtual stage, k) -> the round it ran in
    last = pp * virtual - 1
    while any(pos[r] < len(orders[r]) for r in range(pp)):
        t = len(rounds[0])
        assert t < 4 * (pp + 1) * virtual * m, "interleaved schedule made no progress"
        for r in range(pp):
            op = orders[r][pos[r]] if pos[r] < len(orders[r]) else None
            if op is not None:
                kind, chunk, k = op
                s = chunk * pp + r  # its virtual stage
                need = (("F", s - 1, k) if s > 0 else None) if kind == "F" else \
                       (("B", s + 1, k) if s < last else None)  # (its own forward ran earlier on this rank)
                if need is not None and done.get(need, t) >= t:  # its input is not here yet: idle this round
                    op = None
            rounds[r].append(op)
        for r in range(pp):
            if rounds[r][t] is not None:
                kind, chunk, k = rounds[r][t]
                done[kind, chunk * pp + r, k] = t
                pos[r] += 1
    return rounds


def interleaved(st, micro_batches):
    """Interleaved 1F1B, played round by round from interleaved_rounds: run this rank's op of
    the round (if any), then one p2p round with the ring neighbours: send what the op
    produced, receive what theirs produced for one of our chunks. Received activations and
    gradients wait in dicts keyed by (chunk, micro-batch) until their op comes."""
    mesh, shape, m, V = st.mesh, st.shape, len(micro_batches), st.virtual
    pp, rank, last = mesh.pp, mesh.pp_rank, mesh.pp * V - 1
    rounds = interleaved_rounds(pp, V, m)
    inputs, grads = {}, {}  # (chunk, k) -> received activation / gradient of the output
    for t in range(len(rounds[0])):
        out = grad_in = None
        op = rounds[rank][t]
        if op is not None and op[0] == "F":
            _, chunk, k = op
            out = forward_step(st, k, micro_batches[k], inputs.pop((chunk, k), None), chunk)
            out = None if chunk * pp + rank == last else out  # the loss: nothing to send
        elif op is not None:
            _, chunk, k = op
            grad_in = backward_step(st, k, grads.pop((chunk, k), None), chunk)
        # what the neighbours ran this round: the previous rank's forward output is our input
        # (virtual stage + 1), the next rank's input gradient our output's (virtual stage - 1)
        prv, nxt = rounds[(rank - 1) % pp][t], rounds[(rank + 1) % pp][t]
        recv_prev = recv_next = None
        if prv is not None and prv[0] == "F" and prv[1] * pp + (rank - 1) % pp < last:
            s = prv[1] * pp + (rank - 1) % pp + 1  # our virtual stage that consumes it
            recv_prev = inputs[s // pp, prv[2]] = torch.empty(shape, device=mesh.device)
        if nxt is not None and nxt[0] == "B" and nxt[1] * pp + (rank + 1) % pp > 0:
            s = nxt[1] * pp + (rank + 1) % pp - 1
            recv_next = grads[s // pp, nxt[2]] = torch.empty(shape, device=mesh.device)
        p2p(mesh, send_next=out, send_prev=grad_in, recv_prev=recv_prev, recv_next=recv_next, ring=True)
    assert not inputs and not grads, "interleaved: a received tensor was never used"


def pipeline_step(schedule, stage, mesh, micro_batches, act_shape, autocast=nullcontext(), trace=None, weights=None,
                  virtual=1):
    """This stage's share of one iteration: the forward and backward of every micro-batch
    (a list of (x, y, loss_mask, doc_ids) tuples, tensors or None: x is used by the first
    stage, y and loss_mask by the last, doc_ids by all) in the order of `schedule` ('1f1b' or
    'gpipe'). `stage` is the stage module, or its DataParallel / FSDP form: then only the
    stage's last backward syncs gradients. weights (m floats, default 1/m each): micro-batch
    k's backward starts from weights[k] * loss_k. `trace`, a list, receives
    (kind, micro-batch, start, end, chunk) per forward / backward. 'interleaved' takes
    `virtual` chunks per stage (make_stage(virtual=V)) and m a multiple of pp. Returns
    (sum_k weights[k] * loss_k on the last stage, 0 elsewhere; the most micro-batch chunks
    alive at once)."""
    m = len(micro_batches)
    weights = [1 / m] * m if weights is None else list(weights)
    assert len(weights) == m, f"{len(weights)} loss weights for {m} micro-batches"
    schedules = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved}
    if schedule not in schedules:
        raise ValueError(f"unknown pipeline schedule {schedule!r}")
    assert (schedule == "interleaved") == (virtual > 1), f"pp_schedule={schedule} with {virtual} chunks per stage"
    assert schedule != "interleaved" or m % mesh.pp == 0, f"interleaved: m={m} micro-batches, not a multiple of pp"
    st = PipelineState(stage, mesh, act_shape, autocast, weights, trace, torch.zeros((), device=mesh.device), virtual)
    schedules[schedule](st, micro_batches)
    assert not st.alive, f"{len(st.alive)} micro-batches were never run backward"
    return st.loss_sum, st.peak


@torch.no_grad()
def pipeline_forward(stage, mesh, micro_batches, act_shape, autocast=nullcontext(), weights=None, virtual=1):
    """Forward only, for evaluation: sum_k weights[k] * loss_k on the last stage (default
    weights 1: the plain sum of the micro-batch losses), 0 elsewhere. With `virtual` chunks
    per stage each micro-batch goes round the ring V times (all ranks in the same order of
    (micro-batch, chunk), so every send meets its receive)."""
    loss_sum = torch.zeros((), device=mesh.device)
    for k, micro in enumerate(micro_batches):
        for c in range(virtual):
            inp = None if mesh.first_stage and c == 0 else torch.empty(act_shape, device=mesh.device)
            p2p(mesh, recv_prev=inp, ring=True)
            out, loss = stage_forward(stage, mesh, micro, inp, autocast, c if virtual > 1 else None, virtual)
            if loss is None:
                p2p(mesh, send_next=out, ring=True)
            else:
                loss_sum += loss * (1.0 if weights is None else weights[k])
    return loss_sum


def pipeline_timeline(traces, m, width=96, virtual=1):
    """An ASCII picture of one pipeline's schedule from each stage's trace (list of
    (kind, micro, start, end, chunk)), and the measured vs the theoretical bubble, both as
    the idle share of the iteration's time: (p-1)/(m+p-1), and (p-1)/(V*m+p-1) with V
    chunks per stage (Narayanan et al.'s (p-1)/(V*m) is the same idle time relative to the
    ideal, bubble-free time instead)."""
    t0 = min(e[2] for tr in traces for e in tr)
    span = max(e[3] for tr in traces for e in tr) - t0
    pp = len(traces)
    lines = [f"pipeline schedule, {pp} stages x {m} micro-batches ({span * 1000:.0f} ms; "
             f"Fk = forward of micro-batch k, Bk = its backward, " +
             ("Fk/c on chunk c (virtual stage c * pp + stage), " if virtual > 1 else "") + ". = idle)"]
    idle = []
    for s, tr in enumerate(traces):
        row = ["."] * width
        for kind, k, a, b, c in tr:
            lo = int((a - t0) / span * width)
            hi = max(lo + 1, int((b - t0) / span * width))
            label = f"{kind}{k}" + (f"/{c}" if virtual > 1 else "") + ("-" if kind == "F" else "=") * width
            row[lo:hi] = label[:hi - lo]
        busy = sum(e[3] - e[2] for e in tr)
        idle.append(1 - busy / span)
        lines.append(f"stage {s} |{''.join(row)}| idle {idle[-1]:4.0%}")
    measured, theory = sum(idle) / pp, (pp - 1) / (virtual * m + pp - 1)
    formula = "(p-1)/(m+p-1)" if virtual == 1 else f"(p-1)/(V*m+p-1), V={virtual},"
    lines.append(f"bubble: measured {measured:.1%} (mean idle share of the stages), theory {formula} = {theory:.1%}")
    return "\n".join(lines), measured


def print_pipeline_timeline(trace, mesh, m, virtual=1):
    """Gathers every rank's trace (a collective: every rank calls it) and prints pipeline 0's
    timeline on rank 0."""
    traces = all_gather_object(trace, mesh)[:mesh.pp * mesh.tp:mesh.tp]  # the stages of pipeline 0 (tp rank 0)
    mesh.print0(pipeline_timeline(traces, m, virtual=virtual)[0])


def clip_grad_norm_(params, max_norm, mesh, sharded=False):
    """Scales the gradients so that the norm over the *whole* model is at most max_norm
    (0: only measure it); returns that norm. Pipeline stages hold different parameters, so
    their squared norms are summed over the pipeline, and so are FSDP's gradient shards over
    the dp ranks and tensor-parallel slices over the tp ranks; what is replicated (plain
    data-parallel replicas, the norm gains on every tp rank) holds the same gradient and is
    counted once. sharded=True: `params` are ZeRO's slices (ZeroOptimizer.params), a
    different part of the gradient on each dp rank, summed like FSDP's shards. (Clipping
    each stage by its own norm would be a different, layout-dependent update.)"""
    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params]
    sq = torch.zeros((), device=mesh.device)
    sq_tp = torch.zeros((), device=mesh.device)  # tp slices: each tp rank holds a different part
    for p in params:
        s = _local(p.grad).float().pow(2).sum()
        if hasattr(p, "_tp_dim"):
            sq_tp += s
        else:
            sq += s
    if mesh.tp > 1:
        dist.all_reduce(sq_tp, group=mesh.tp_group)
    sq += sq_tp
    if sharded or any(isinstance(g, DTensor) for g in grads):  # FSDP, ZeRO: each dp rank holds a different part
        dist.all_reduce(sq, group=mesh.dp_group)
    if mesh.pp > 1:
        dist.all_reduce(sq, group=mesh.pp_group)
    norm = sq.sqrt()
    if max_norm > 0:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            _local(g).mul_(coef)
    return norm
