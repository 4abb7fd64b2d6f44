"""
Everything that knows about processes: setup from the torchrun environment, the rank grid
(one explicit Mesh object, passed to whoever needs it: no hidden global), small
collectives for logging, and checkpoint files (atomic directories, `latest`, pruning).

Works as a plain single process (`python train.py`) and under torchrun.
"""

import json
import os
import re
import shutil
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

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


def setup(device="auto", dist_timeout_s=300):
    """Reads RANK / LOCAL_RANK / WORLD_SIZE from torchrun (absent: one process) and starts
    the process group: nccl with one GPU per local rank, gloo on CPU. A collective that
    waits longer than dist_timeout_s (a dead or hung peer) raises instead of hanging."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dev = pick_device(device)
    backend = ""
    if world > 1 or "RANK" in os.environ:
        if dev.type == "cuda":
            dev = torch.device("cuda", local_rank)
            torch.cuda.set_device(dev)
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=dist_timeout_s),
                                rank=rank, world_size=world, device_id=dev if dev.type == "cuda" else None)
    return Mesh(rank=rank, local_rank=local_rank, world=world, dp=world, dp_rank=rank, device=dev, backend=backend)


def teardown(mesh):
    if mesh.backend:
        dist.destroy_process_group()


def barrier(mesh):
    if mesh.backend:
        dist.barrier()


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
