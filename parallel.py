"""
Everything that knows about processes and that every layout shares: the dp x pp x cp x tp rank
grid (one explicit Mesh object, passed to whoever needs it: no hidden global), process setup and
teardown from the torchrun environment (a dead peer turned into one line is guard_dist.py's),
small collectives, the gradient-sync toggle that accumulation uses, global-norm gradient clipping
across every kind of shard, the dtype and peak FLOP/s a machine gives, and memory accounting.

Each technique lives in a file of its own in techniques/ and is applied to a built model from
outside: data_parallel.py, zero.py, fsdp.py, tensor_parallel.py, context_parallel.py,
pipeline.py, expert_parallel.py (meta_build.py gives a model built on the meta device its storage
and weights). A single process (`python train.py`) gets a Mesh of one and never starts a
process group.
"""

import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from guards.guard_errors import UserError

# ---------------------------------------------------------------------------------------
# process setup and the rank grid


@dataclass
class Mesh:
    """Who this process is in the dp x pp x cp x tp rank grid. The grid is
    torch.arange(world).view(dp, pp, cp, tp):
    rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank.
    tp is innermost: the tensor-parallel ranks, which all-reduce inside every block, are
    consecutive (the same node, its fastest link); then the context-parallel ranks (each
    holds part of every sequence: keys and values pass between them in every attention);
    then the stages of one pipeline (point-to-point, once per micro-batch per stage
    boundary); a stage's data-parallel replicas are pp * cp * tp ranks apart (one all-reduce
    per step). cp = 1 except under context parallelism (context_parallel.py)."""
    rank: int          # global rank, 0 .. world - 1
    local_rank: int    # rank on this node: picks the GPU
    world: int
    dp: int            # data-parallel replicas of the whole pipeline
    pp: int            # pipeline stages
    dp_rank: int
    pp_rank: int       # this rank's stage
    device: torch.device
    backend: str       # "gloo" | "nccl" | "" for a single process
    # the ranks with the same stage and tp slice: gradients are averaged here (None: all)
    dp_group: object = None
    pp_group: object = None  # the stages of this rank's pipeline (same dp_rank, same tp_rank)
    dp_mesh: object = None   # dp_group as a DeviceMesh, for FSDP2
    tp: int = 1        # tensor-parallel ranks: each holds a slice of every block's matmuls
    tp_rank: int = 0
    tp_group: object = None  # the ranks that share one stage's matmuls (consecutive ranks)
    # tp_group as a DeviceMesh (the peer test against torch's tensor parallel)
    tp_mesh: object = None
    # context-parallel ranks: each holds a part of every sequence, the weights replicated
    cp: int = 1
    cp_rank: int = 0
    cp_group: object = None  # the ranks that share one sequence (same dp_rank, stage and tp_rank)

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
        return ((self.dp_rank * self.pp + stage) * self.cp + self.cp_rank) * self.tp + self.tp_rank

    def print0(self, *args, **kwargs):
        if self.master:
            print(*args, **kwargs, flush=True)


def pick_device(device):
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device={device} but CUDA is not available here: use device=cpu or "
                        f"device=auto")
    if device.split(":")[0] not in ("cpu", "cuda", "mps"):
        raise UserError(f"device={device} is not one of auto, cpu, cuda, mps")
    return torch.device(device)


def setup(device="auto", dist_timeout_s=300, backend="auto", pp=1, tp=1, cp=1):
    """The Mesh of this process: one process (no torchrun) is a grid of one and starts no
    process group; under torchrun, start_process_group."""
    dev = pick_device(device)
    if backend == "nccl" and dev.type != "cuda":
        raise UserError(f"backend=nccl needs CUDA tensors but device is {dev.type}: use "
                        f"backend=gloo (or auto)")
    if "RANK" not in os.environ:
        return Mesh(rank=0, local_rank=0, world=1, dp=1, pp=1, dp_rank=0, pp_rank=0, device=dev,
                    backend="")
    return start_process_group(dev, dist_timeout_s, backend, pp, tp, cp)


def start_process_group(dev, dist_timeout_s, backend, pp, tp, cp=1):
    """Reads RANK / LOCAL_RANK / WORLD_SIZE from torchrun, starts the process group (nccl with
    one GPU per local rank, gloo on CPU) and builds the dp x pp x cp x tp grid. A collective that
    waits longer than dist_timeout_s (a dead or hung peer) raises instead of hanging."""
    world, rank, local_rank = (int(os.environ[k]) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"))
    die_with_parent()
    assert world % (pp * cp * tp) == 0, (
        f"pp={pp} x cp={cp} x tp={tp} does not divide the world of {world}")
    if dev.type == "cuda":
        dev = _local_gpu(local_rank)
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    store = None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # under torchrun the store outlives a restart of the workers (--max-restarts): prefix
        # our keys with the attempt, or the new workers can read the dead ones' addresses
        store = dist.PrefixStore(
            f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                timeout=timedelta(seconds=dist_timeout_s)))
    dist.init_process_group(backend, store=store, timeout=timedelta(seconds=dist_timeout_s),
                            rank=rank,
                            world_size=world, device_id=dev if backend == "nccl" else None)
    dp = world // (pp * cp * tp)
    # the grid torch.arange(world).view(dp, pp, cp, tp), row-major as Mesh's docstring says:
    # grid[:, s, c, t] is a dp group, grid[d, :, c, t] a pipeline, grid[d, s, :, t] a cp group,
    # grid[d, s, c, :] a tp group
    grid = init_device_mesh(dev.type, (dp, pp, cp, tp), mesh_dim_names=("dp", "pp", "cp", "tp"))
    return Mesh(rank=rank, local_rank=local_rank, world=world, dp=dp, pp=pp,
                dp_rank=rank // (pp * cp * tp),
                pp_rank=rank // (cp * tp) % pp, device=dev, backend=backend,
                dp_group=grid.get_group("dp"),
                pp_group=grid.get_group("pp"), dp_mesh=grid["dp"], tp=tp, tp_rank=rank % tp,
                tp_group=grid.get_group("tp"), tp_mesh=grid["tp"], cp=cp, cp_rank=rank // tp % cp,
                cp_group=grid.get_group("cp"))


def _local_gpu(local_rank):
    """This rank's GPU: one per local rank."""
    if local_rank >= torch.cuda.device_count():
        raise UserError(f"LOCAL_RANK={local_rank} but this node has {torch.cuda.device_count()} "
                        f"GPUs: start at most that many processes per node (--nproc_per_node)")
    dev = torch.device("cuda", local_rank)
    torch.cuda.set_device(dev)
    return dev


def die_with_parent():
    """A rank ends when its launcher does (torchrun killed with SIGKILL cannot stop its
    workers, which would train on and hold out_dir's lock): Linux's parent-death signal,
    elsewhere a thread that watches the parent's pid."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes
        import signal
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the prctl
            os._exit(1)
    else:
        _watch_parent(parent)


def _watch_parent(parent):
    import threading

    def watch():
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="parent_watch").start()


def teardown(mesh):
    if mesh.backend:
        # every rank gets here before any destroys its groups: a rank that tears down while a
        # peer is still finishing (rank 0 sampling, say) can abort in gloo's worker threads
        dist.barrier()
        dist.destroy_process_group()


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


# A tensor-parallel slice knows its split: tensor_parallel.py marks it with `_split_dim` (the
# dimension it is cut along) and `_split_group`, and from those marks alone its whole tensor is
# gathered, or a whole tensor cut to this rank's slice (checkpoints, Muon and ZeRO use them).


def tp_gather(t, p):
    """The full tensor of which `t` is this rank's slice, cut like parameter `p` (a collective over
    p's tp group)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(p._split_group))]
    dist.all_gather(parts, t.contiguous(), group=p._split_group)
    return torch.cat(parts, dim=p._split_dim)


def tp_slice(full, p):
    """This rank's slice of the full tensor `full`, cut like parameter `p`."""
    return full.chunk(dist.get_world_size(p._split_group),
                      p._split_dim)[dist.get_rank(p._split_group)]


def set_grad_sync(model, sync):
    """Gradient accumulation without communication: with sync=False a backward only adds
    into the local gradients. Our data-parallel wrappers and torch DDP take a flag, FSDP2 a
    method."""
    model = getattr(model, "_orig_mod", model)  # under torch.compile
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)
    elif hasattr(model, "require_backward_grad_sync"):  # ours (data_parallel.py) and torch DDP
        model.require_backward_grad_sync = sync


def wait_grad_sync(model):
    """Data parallel: the last buckets' all-reduces may still be in flight after backward; once
    this returns every rank holds the mean gradient (ours only: DDP and FSDP wait in backward)."""
    if hasattr(model, "wait"):
        model.wait()


# The logged loss: every rank's weighted loss (train.py's token_weights) summed over the world is
# the global batch's mean, counted once per rank of a tp or cp group (which all hold the same).
def global_mean(total, mesh):
    return total.item() / (mesh.tp * mesh.cp)


def all_reduce_named(values, mesh):
    """{name: sum over all ranks} for {name: a number, bool or tensor}: one all-reduce (float64)
    for all of them: one collective per step for the loss and the stop flag."""
    parts = {k: torch.as_tensor(v, dtype=torch.float64).to(mesh.device).reshape(-1)
             for k, v in values.items()}
    flat = all_reduce_sum(torch.cat(list(parts.values())), mesh)
    sums = flat.split([part.numel() for part in parts.values()])
    return {k: s.view(torch.as_tensor(v).shape) for (k, v), s in zip(values.items(), sums)}


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def memory_bytes(model, optimizer):
    """Bytes this rank holds of parameters, gradients and optimizer state (shards under FSDP;
    under ZeRO the state of this rank's slices, and with stage 2 the gradient chunks
    instead of whole gradients. Stage 1's slice gradients are views of the whole ones.)"""
    size = lambda ts: sum(_local(t).numel() * _local(t).element_size() for t in ts)  # noqa: E731
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if hasattr(optimizer, "shards"):  # zero.ZeroOptimizer
        grads += [b.grad_chunk for b in optimizer.model.buckets if b.grad_chunk is not None]
    return {"params": size(model.parameters()), "grads": size(grads),
            "optimizer": size(v for st in optimizer.state.values() for v in st.values()
                              if torch.is_tensor(v))}


def memory_line(model, optimizer, mesh, zero, fsdp, offload):
    """'memory per rank: params .. MB, grads .. MB, optimizer .. MB' and what is sharded."""
    mem = memory_bytes(model, optimizer)
    split = _what_is_split(mesh, zero, fsdp, offload) if zero or fsdp or mesh.tp > 1 else ""
    return ("memory per "
            "rank: " + ", ".join(f"{k} {v / 2 ** 20:.2f} MB" for k, v in mem.items()) + split)


def _what_is_split(mesh, zero, fsdp, offload):
    split = (f" (fsdp: 1/{mesh.dp} of each)" if fsdp else
             f" (zero={zero}: 1/{mesh.dp} of the "
             f"optimizer{' and grads' if zero == 2 else ''})" if zero else "")
    if mesh.tp > 1:
        split += (f" (tp: the matrices' 1/{mesh.tp} "
                  f"slices{', sharded over dp' if zero or fsdp else ''})")
    if offload and (zero or fsdp) and mesh.device.type == "cuda":
        split += " (optimizer in CPU memory)"
    return split


def auto_dtype(device_type):
    """dtype='auto': autocast's dtype where the matmuls run it natively, bf16 on CUDA (T4 and V100
    only emulate it: fp16) and on AVX512-BF16 CPUs, else float32 (emulated bf16 on an AVX2 CPU
    made a step of the real model ~30x slower)."""
    if device_type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported(False) else "float16"
    return "bfloat16" if torch.cpu._is_avx512_bf16_supported() else "float32"


# Datasheet dense (no sparsity) bf16/fp16 tensor-core peaks, FLOP/s: what nanoGPT's and
# nanochat's MFU divide by (a 1024^2 matmul probe runs far below an H100's). Matched in order
# against torch.cuda.get_device_name(), the longer names first ("H100 NVL" before "H100").
GPU_PEAKS = [("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("GH200", 989e12), ("H100", 989e12),
             ("H200", 989e12), ("H800", 989e12), ("B200", 2250e12), ("B100", 1750e12),
             ("A100", 312e12), ("A800", 312e12), ("A10G", 125e12), ("A10", 125e12),
             ("L40S", 362e12), ("L40", 181e12), ("L4", 121e12), ("RTX 4090", 165e12),
             ("RTX 3090", 71e12), ("V100", 125e12), ("T4", 65e12), ("MI300X", 1307e12)]


def peak_flops(device, dtype, n=1024, seconds=0.5):
    """(FLOP/s, whence) for MFU: a known GPU's datasheet bf16/fp16 peak, else the fastest (load
    slows some) square matmul in `seconds`, in groups >= 5 ms (past a GPU's launch latency)."""
    name = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else ""
    for key, flops in GPU_PEAKS if dtype in (torch.bfloat16, torch.float16) else []:
        if key in name:
            return flops, f"the {key}'s datasheet, dense {str(dtype)[6:]}"
    g = torch.Generator(device).manual_seed(0)  # its own: the run's RNG stream is untouched
    a, b = (torch.rand(n, n, device=device, dtype=dtype, generator=g) for _ in range(2))
    sync = torch.cuda.synchronize if name else (lambda: None)
    a @ b  # warm up
    sync()
    best, group, end = float("inf"), 1, time.perf_counter() + seconds
    while best == float("inf") or time.perf_counter() < end:
        t0 = time.perf_counter()
        for _ in range(group):
            a @ b
        sync()
        dt = time.perf_counter() - t0
        best = min(best, dt / group)
        if dt < 0.005:  # mostly launch latency (a GPU): time more at once (a CPU's take ~10 ms)
            group *= 2
    return 2 * n ** 3 / best, "a measured matmul"


def clip_grad_norm_(params, max_norm, mesh, sharded=False):
    """Scales the gradients so that the norm over the *whole* model is at most max_norm
    (0: only measure it); returns that norm, the same on every rank. (Clipping each stage or
    shard by its own norm would be a different, layout-dependent update.)"""
    params = [p for p in params if p.grad is not None]
    # plain data-parallel (and cp) replicas hold the same, whole gradient: their own norm is the
    # model's
    spread = sharded or mesh.pp > 1 or mesh.tp > 1 or any(isinstance(p.grad, DTensor)
                                                          or hasattr(p, "_ep")
                                                          for p in params)
    if spread:  # the parts of the gradient other ranks hold
        sq = global_grad_squared_norm(params, mesh, sharded)
    else:
        sq = sum((squared_norm(p.grad) for p in params), torch.zeros((), device=mesh.device))
    norm = sq.sqrt()
    if max_norm > 0:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # never scales a gradient up
        for p in params:
            _local(p.grad).mul_(coef)
    return norm


def squared_norm(g):
    """|g|^2 of one tensor, in float32, in one pass over g (g.pow(2).sum() writes a g-sized
    temporary first: at 135M parameters on a CPU, ~8x slower)."""
    return torch.linalg.vector_norm(g, dtype=torch.float32).square()


def global_grad_squared_norm(params, mesh, sharded=False):
    """The squared norm of the whole model's gradient, from this rank's `params`. Pipeline
    stages hold different parameters, so their squared norms are summed over the pipeline, and
    so are FSDP's gradient shards over the dp ranks and tensor-parallel slices over the tp
    ranks; what is replicated (plain data-parallel replicas, the norm gains on every tp rank)
    holds the same gradient and is counted once. sharded=True: `params` are ZeRO's slices
    (ZeroOptimizer.params), a different part of the gradient on each dp rank, summed like
    FSDP's shards."""
    sq = torch.zeros((), device=mesh.device)
    sq_tp = torch.zeros((), device=mesh.device)  # tp slices: each tp rank holds a different part
    # expert_parallel.py: each rank of an ep group its own experts
    experts = torch.zeros((), device=mesh.device)
    for p in params:
        s = squared_norm(_local(p.grad))
        # a ZeRO piece: its marks are its parameter's, as for Muon's whole_shape
        whole = getattr(p, "_whole", p)
        # tied across stages: the embedding's gradient again
        if getattr(whole, "_tied_copy", False):
            continue
        # an ep rank's own experts (the same on the ranks holding the same experts): counted once,
        # after dp's sum; under fsdp a shard like the others
        if hasattr(whole, "_ep") and not isinstance(p.grad, DTensor):
            experts += s
        elif hasattr(whole, "_split_dim"):
            sq_tp += s
        else:
            sq += s
    if mesh.tp > 1:
        dist.all_reduce(sq_tp, group=mesh.tp_group)
    sq += sq_tp
    # FSDP, ZeRO: each dp rank holds a different part
    if sharded or any(isinstance(p.grad, DTensor) for p in params):
        dist.all_reduce(sq, group=mesh.dp_group)
    ep_group = next((w._split_group for w in (getattr(p, "_whole", p) for p in params)
                     if hasattr(w, "_ep")), None)
    if ep_group is not None:
        dist.all_reduce(experts, group=ep_group)
        sq += experts
    if mesh.pp > 1:
        dist.all_reduce(sq, group=mesh.pp_group)
    return sq
