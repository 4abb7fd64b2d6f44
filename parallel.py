"""
Everything that knows about processes: setup from the torchrun environment, the rank grid
(one explicit Mesh object, passed to whoever needs it: no hidden global), hand-written data
parallelism (naive and bucketed all-reduce, no_sync), small collectives for logging, and
checkpoint files (atomic directories, `latest`, pruning).

Works as a plain single process (`python train.py`) and under torchrun.
"""

import json
import os
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

from configurator import UserError


# ---------------------------------------------------------------------------------------
# process setup and the rank grid


@dataclass
class Mesh:
    rank: int          # global rank, 0 .. world - 1
    local_rank: int    # rank on this node: picks the GPU
    world: int
    dp: int            # data-parallel ranks
    dp_rank: int
    device: torch.device
    backend: str       # "gloo" | "nccl" | "" for a single process

    @property
    def master(self):
        return self.rank == 0

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


def setup(device="auto", dist_timeout_s=300, backend="auto"):
    """Reads RANK / LOCAL_RANK / WORLD_SIZE from torchrun (absent: one process) and starts
    the process group: nccl with one GPU per local rank, gloo on CPU. A collective that
    waits longer than dist_timeout_s (a dead or hung peer) raises instead of hanging."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dev = pick_device(device)
    if backend not in ("auto", "gloo", "nccl"):
        raise UserError(f"backend={backend} is not one of auto, gloo, nccl")
    if backend == "nccl" and dev.type != "cuda":
        raise UserError(f"backend=nccl needs CUDA tensors but device is {dev.type}: use backend=gloo (or auto)")
    if world == 1 and "RANK" not in os.environ:
        return Mesh(rank=0, local_rank=0, world=1, dp=1, dp_rank=0, device=dev, backend="")
    if dev.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise UserError(f"LOCAL_RANK={local_rank} but this node has {torch.cuda.device_count()} GPUs: "
                            f"start at most that many processes per node (--nproc_per_node)")
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=dist_timeout_s), rank=rank, world_size=world,
                            device_id=dev if backend == "nccl" else None)
    return Mesh(rank=rank, local_rank=local_rank, world=world, dp=world, dp_rank=rank, device=dev, backend=backend)


def teardown(mesh):
    if mesh.backend:
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


def all_reduce_mean(x, mesh):
    """Mean of a float (or tensor) over all ranks, for logging."""
    if not mesh.backend:
        return x
    t = torch.as_tensor(x, dtype=torch.float64 if mesh.device.type == "cpu" else torch.float32,
                        device=mesh.device).clone()
    dist.all_reduce(t)
    t /= mesh.world
    return t.item() if t.dim() == 0 else t


# ---------------------------------------------------------------------------------------
# data parallel, by hand
#
# Every dp rank holds the whole model and runs its own micro-batches; before the optimizer
# step the gradients are averaged over the ranks, so every rank takes the same step and the
# weights stay identical. Two ways to average, side by side:
#   naive:    after backward, one all-reduce per parameter. Simple, and the test oracle.
#   bucketed: parameters are grouped into buckets of ~bucket_mb, in reverse order of use
#             (backward produces the last layer's gradients first). A hook on each
#             parameter fires when its gradient is final; when a bucket's last gradient
#             arrives, the bucket is copied into one flat buffer and all-reduced
#             asynchronously while backward goes on computing earlier layers. wait()
#             collects everything before the optimizer step.


class DataParallel(nn.Module):
    """Wraps a model for data parallelism over mesh.dp ranks (naive or bucketed all-reduce).

    Gradient accumulation: set `require_backward_grad_sync = False` (or use `no_sync()`) for
    every micro-step but the last, so that only the last backward communicates. Then call
    wait() before clipping and the optimizer step."""

    def __init__(self, module, mesh, bucket_mb=25.0, naive=False):
        super().__init__()
        self.module, self.mesh, self.naive = module, mesh, naive
        self.require_backward_grad_sync = True
        self.launches = 0  # all-reduce launches since the last wait(): the tests count them
        with torch.no_grad():  # every rank starts from rank 0's weights
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t, src=0)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.buckets, self.pending = [], []
        if naive:
            return
        # buckets in reverse registration order, which is roughly the order backward finishes them
        cap = bucket_mb * 2 ** 20
        current = []
        for p in reversed(self.params):
            current.append(p)
            if sum(q.numel() * q.element_size() for q in current) >= cap:
                self.buckets.append(Bucket(current))
                current = []
        if current:
            self.buckets.append(Bucket(current))
        for bucket in self.buckets:
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(lambda p, bucket=bucket: self._grad_ready(bucket, p))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """No communication inside: gradients only accumulate locally in .grad."""
        before, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before

    def _grad_ready(self, bucket, p):
        # runs inside backward, right after p.grad received this micro-step's gradient. With
        # sync off it does nothing; so the flag has to be right *before* the last backward
        # starts: set after it, the hooks have already fired and nothing was sent.
        if not self.require_backward_grad_sync:
            return
        if bucket.ready == len(bucket.params):
            raise RuntimeError("gradient sync ran twice in one step: use no_sync() (require_backward_grad_sync=False) "
                               "on every micro-step but the last, and call wait() before the optimizer step")
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket):
        offset = 0
        for p in bucket.params:  # p.grad holds the sum over all micro-steps of this iteration
            n = p.numel()
            if p.grad is None:
                bucket.flat[offset:offset + n].zero_()
            else:
                bucket.flat[offset:offset + n].copy_(p.grad.reshape(-1))
            offset += n
        self.pending.append((bucket, dist.all_reduce(bucket.flat, async_op=True)))
        self.launches += 1

    def wait(self):
        """Finishes the gradient average: after this every rank holds the same mean gradient."""
        if self.naive:
            for p in self.params:
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= self.mesh.dp
                    self.launches += 1
            return
        for bucket in self.buckets:  # a bucket whose parameters got no gradient this step
            if bucket.ready < len(bucket.params):
                self._launch(bucket)
        for bucket, work in self.pending:
            work.wait()
            bucket.flat /= self.mesh.dp  # all_reduce summed; we want the mean (gloo has no AVG)
            offset = 0
            for p in bucket.params:
                n = p.numel()
                if p.grad is None:
                    p.grad = torch.empty_like(p)
                p.grad.copy_(bucket.flat[offset:offset + n].view_as(p))
                offset += n
            bucket.ready = 0
        self.pending = []


class Bucket:
    def __init__(self, params):
        self.params = params
        self.ready = 0  # parameters whose gradient is final in this backward
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)


# ---------------------------------------------------------------------------------------
# checkpoints: out_dir/ckpt/iter_XXXXXXX/ is complete or absent, ckpt/latest names the newest


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path, write):
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(out_dir, it, tensors, meta, keep):
    """Writes {name}.pt for each entry of `tensors` (state dicts for torch.save) and meta.json
    into ckpt/.tmp_iter_XXXXXXX, renames it to ckpt/iter_XXXXXXX, then points ckpt/latest at
    it and deletes all but the newest `keep`. A crash at any point leaves `latest` naming a
    complete checkpoint. Returns the checkpoint's path."""
    root = os.path.join(out_dir, "ckpt")
    name = f"iter_{it:07d}"
    tmp, final = os.path.join(root, ".tmp_" + name), os.path.join(root, name)
    shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a save that died half-way
    os.makedirs(tmp)
    for key, obj in tensors.items():
        _write_atomic(os.path.join(tmp, f"{key}.pt"), lambda f: torch.save(obj, f))
    _write_atomic(os.path.join(tmp, "meta.json"), lambda f: f.write(json.dumps(meta, indent=1).encode()))
    _fsync_dir(tmp)
    if os.path.exists(final):  # saved at this iteration before (a resumed run): replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    _write_atomic(os.path.join(root, "latest"), lambda f: f.write(name.encode() + b"\n"))
    _fsync_dir(root)
    done = sorted(d for d in os.listdir(root) if re.fullmatch(r"iter_\d{7}", d))
    for old in done[:-keep] if keep > 0 else []:
        if old != name:
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    return final


def latest_checkpoint(out_dir):
    """Path of the checkpoint ckpt/latest names, or None when there is none."""
    path = os.path.join(out_dir, "ckpt", "latest")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        name = f.read().strip()
    ckpt = os.path.join(out_dir, "ckpt", name)
    if not re.fullmatch(r"iter_\d{7}", name) or not os.path.isdir(ckpt):
        raise UserError(f"{path} names '{name}', which is not a checkpoint directory: "
                        f"write the name of a complete ckpt/iter_XXXXXXX into it, or use init_from=scratch")
    return ckpt


def load_checkpoint(path, names, device="cpu"):
    """meta.json and the {name}.pt files of a checkpoint directory. weights_only=True: a
    checkpoint is data, never code."""
    try:
        with open(os.path.join(path, "meta.json")) as f:
            out = {"meta": json.load(f)}
        for name in names:
            out[name] = torch.load(os.path.join(path, f"{name}.pt"), map_location=device, weights_only=True)
    except (OSError, ValueError, RuntimeError) as e:
        raise UserError(f"checkpoint {path} is unreadable ({type(e).__name__}: {str(e).splitlines()[0][:120]}): "
                        f"point ckpt/latest at an intact checkpoint, or use init_from=scratch") from None
    return out
