"""
Files: our own checkpoints and the foreign formats, in one place.

Our checkpoints: out_dir/ckpt/iter_XXXXXXX/ written by every rank through
torch.distributed.checkpoint (DCP), keyed by global parameter names so that any layout can
load any other; atomic (a temp directory renamed into place), a manifest of sizes and
sha256 sums, `latest`, pruning, and a reader that never runs code from the files. A save is
start_save + finish_save; with ckpt_async the write runs in the background between the two.

Foreign formats: safetensors (read and written by hand), Hugging Face LLaMA directories
(config.json + model.safetensors, name table, config mapping), for continual pretraining,
and PEFT LoRA adapters (adapter_config.json + adapter_model.safetensors).

A LoRA run's checkpoints hold only what trains (the adapters and their AdamW state); the
frozen base is referenced (meta.json's "lora" -> "base": its path and a sha256), not copied,
and read again from there on resume.

This module knows no loop: it takes a model, an optimizer, paths and the Mesh.
"""

import errno
import fcntl
import hashlib
import json
import math
import os
import pickle
import re
import shutil
import socket
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from configurator import UserError
from model import LORA_TARGETS, LoRALinear, ModelConfig, Transformer, apply_lora
from parallel import (ZeroOptimizer, all_gather_object, all_reduce_sum, broadcast_object, gather_to_master, reshard,
                      tp_gather, tp_slice)


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


def train_state(model, optimizer):
    """What a checkpoint stores of the training state, keyed by global parameter names:
    {"model": name -> weight, "optim": "name.exp_avg" -> ...}. Under FSDP the values are
    DTensor shards; torch.distributed.checkpoint writes each rank's shards and can read them
    back into any other sharding. Positions in the optimizer (what optimizer.state_dict()
    uses) would differ between pipeline stages; names do not. Frozen parameters (LoRA's
    base) are left out: they never change, and the run's meta.json says where they come from.
    Tensor-parallel slices are gathered into full tensors (see below)."""
    reshard(model)
    names = {p: n for n, p in model.named_parameters()}
    if isinstance(optimizer, ZeroOptimizer):  # ZeRO: the ranks' slices, gathered into whole tensors
        return {"model": trainable_state(model), "optim": optimizer.full_state(names)}
    optim = {f"{names[p]}.{k}": v for p, st in optimizer.state.items() for k, v in st.items()}
    return _tp_gathered({"model": trainable_state(model), "optim": optim}, model)


# ---- tensor parallel (tp): checkpoints hold full tensors ------------------------------
# A tp-sharded parameter (parallel.tensor_parallel marks it with _tp_dim) is saved whole:
# its slices are gathered over the tp group, so every tp rank offers DCP the same full
# tensor under its global name (DCP writes a replicated tensor once), and any layout reads
# it. Loading reads the full tensor and keeps this rank's slice. The price: a save or load
# briefly holds the full tensors of this rank's stage (and AdamW's two moments) once more.


def _tp_params(model):
    """{name: parameter} of the tp-sharded parameters (a tied head under both names)."""
    return {n: p for n, p in model.named_parameters(remove_duplicate=False) if hasattr(p, "_tp_dim")}


def _tp_gathered(state, model):
    """state with every tp slice (model weights and their AdamW moments) replaced by the full tensor."""
    for name, p in _tp_params(model).items():
        for part, key in (("model", name), ("optim", f"{name}.exp_avg"), ("optim", f"{name}.exp_avg_sq")):
            if key in state.get(part, {}):
                state[part][key] = tp_gather(state[part][key], p)
    return state


def _tp_scatter(state, model, optimizer):
    """After loading full tensors into state: this rank's slices into the model's state and the optimizer."""
    for name, p in _tp_params(model).items():
        if name in state["model"]:
            state["model"][name] = tp_slice(state["model"][name], p)
        for k in ("exp_avg", "exp_avg_sq"):
            if optimizer is not None and f"{name}.{k}" in state.get("optim", {}):
                optimizer.state[p][k].copy_(tp_slice(state["optim"][f"{name}.{k}"], p))


def trainable_state(model):
    """model.state_dict() without the frozen parameters (all of it when nothing is frozen;
    a tied head stays under both names, as state_dict has it)."""
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {n: t for n, t in model.state_dict().items() if n not in frozen}


def init_adamw_state(model, optimizer):
    """Zero optimizer state (step 0) for every parameter that has none yet: exactly what the
    optimizer creates lazily at a parameter's first step (AdamW's moments; Muon's momentum
    for a muon=True group), so it steps the same with it. Loading needs it (DCP reads into
    existing tensors), and so does saving: a checkpoint written before any step succeeded
    must still hold the optim.* entries a load asks for."""
    if isinstance(optimizer, ZeroOptimizer):
        return  # ZeRO: full_state() holds every parameter's state already (zeros before the first step)
    for group in optimizer.param_groups:  # only what trains (LoRA's frozen base is in no group)
        for p in group["params"]:
            if optimizer.state.get(p):
                continue
            if group.get("muon"):
                optimizer.state[p] = {"momentum_buffer": torch.zeros_like(p)}
                continue
            step_device = p.device if optimizer.defaults.get("fused") else "cpu"
            optimizer.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=step_device),
                                  "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}


def _why(e):
    """An exception in a few words: its type and the first line of its message."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:160]}" if lines else type(e).__name__


def _cause(e):
    """The exception behind DCP's CheckpointException, whose own text is only
    'CheckpointException ranks:dict_keys([0])': the lowest failing rank's."""
    if isinstance(e, CheckpointException) and e.failures:
        failure = e.failures[min(e.failures)]
        return failure[0] if isinstance(failure, tuple) else failure
    return e


CKPT_NAME = re.compile(r"iter_(\d{7,})")  # 7 digits, more from iteration 10,000,000 on


def _checkpoints(root):
    """{iteration: directory name} of the ckpt/iter_N directories under root."""
    names = os.listdir(root) if os.path.isdir(root) else []
    return {int(m[1]): n for n in names if (m := CKPT_NAME.fullmatch(n)) and os.path.isdir(os.path.join(root, n))}


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _hash_files(path, names):
    return {n: {"bytes": os.path.getsize(os.path.join(path, n)), "sha256": _sha256(os.path.join(path, n))}
            for n in names}


def _write_manifest(path, known=None):
    """manifest.json: the size and sha256 of every file of the checkpoint, written last.
    `known`: entries other ranks already computed for their own files."""
    known = known or {}
    files = {**_hash_files(path, [n for n in os.listdir(path) if n not in known]), **known}
    files = {n: files[n] for n in sorted(files)}
    _write_atomic(os.path.join(path, "manifest.json"), lambda f: f.write(json.dumps({"files": files}, indent=1).encode()))


def _read_manifest(path):
    """(files, None) or (None, what is wrong)."""
    try:
        with open(os.path.join(path, "manifest.json")) as f:
            files = json.load(f)["files"]
        if not all(isinstance(w, dict) and type(w.get("bytes")) is int for w in files.values()):
            raise TypeError("malformed entry")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None, "manifest.json is missing or unreadable (a save that did not finish?)"
    return files, None


def _check_file(path, name, want, checksum=True):
    p = os.path.join(path, name)
    if os.path.basename(name) != name or not os.path.isfile(p):
        return f"{name} is missing"
    if os.path.getsize(p) != want["bytes"]:
        return f"{name} has {os.path.getsize(p)} bytes, the manifest says {want['bytes']} (truncated?)"
    if checksum and _sha256(p) != want.get("sha256"):
        return f"{name} does not match its checksum (corrupted)"
    return None


def _check_contents(path):
    """None if meta.json, state.pt and .metadata load safely, else what is wrong. A manifest
    proves only that the files are those that were written; a crafted checkpoint comes with
    a matching one."""
    problem = _read_small(path)[2]
    return problem or _dcp_metadata(path)[1]


def verify(path, mesh=None):
    """None if every file the manifest lists is there with its size and checksum and the
    small files load safely, else what is wrong, in a few words. With a mesh of several
    ranks every rank hashes its share of the files (a large checkpoint is too much for one
    rank while the others wait in a collective); all ranks get the same answer."""
    world, rank = (mesh.world, mesh.rank) if mesh is not None and mesh.backend else (1, 0)
    files, problem = _read_manifest(path) if rank == 0 else (None, None)
    if world > 1:
        files, problem = broadcast_object((files, problem), mesh)
    if problem:
        return problem
    names = sorted(files)
    problems = [_check_file(path, n, files[n]) for n in names[rank::world]]
    if rank == 0 and not any(problems):
        problems.append(_check_contents(path))
    problems = [p for p in problems if p]
    if world > 1:
        problems = [p for ps in all_gather_object(problems, mesh) for p in ps]
    return problems[0] if problems else None


def _agree(ok, mesh):
    """True on every rank iff ok is True on every rank."""
    flag = all_reduce_sum(torch.tensor(0.0 if ok else 1.0), mesh)
    return flag.item() == 0


def clean_stale(out_dir):
    """Removes ckpt/.tmp_iter_* directories: saves killed half-way. Only for the run that holds
    out_dir's lock (lock_out_dir): a running save's directory looks the same."""
    root = os.path.join(out_dir, "ckpt")
    for n in os.listdir(root) if os.path.isdir(root) else []:
        if n.startswith(".tmp_") and os.path.isdir(os.path.join(root, n)):
            shutil.rmtree(os.path.join(root, n), ignore_errors=True)


_held_locks = []  # the lock files' descriptors: open until the process exits


def lock_out_dir(out_dir):
    """Makes this process the only run writing to out_dir (two at once would interleave
    metrics and overwrite each other's checkpoints): an exclusive flock on out_dir/.lock, held
    until the process exits; the kernel releases it when the process dies, however it dies.
    The file names the holder (host, pid) for the message another run gets. Then removes the
    temporary directories of killed saves. Rank 0 calls it. Returns the descriptor."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, ".lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = os.read(fd, 4096).decode(errors="replace")
        os.close(fd)
        if e.errno not in (errno.EAGAIN, errno.EACCES):
            raise UserError(f"cannot lock {path} ({_why(e)}): put out_dir on a filesystem with file locks") from None
        try:
            who = json.loads(holder)
            pid, host = who["pid"], who["host"]
        except (ValueError, KeyError, TypeError):
            pid, host = "?", "?"
        raise UserError(f"out_dir {out_dir} is in use by pid {pid} on host {host} (another run): wait for it, "
                        f"or use another out_dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode(), 0)
    _held_locks.append(fd)
    clean_stale(out_dir)
    return fd


def _prune(root, keep, protect):
    """Deletes all but the newest `keep` complete checkpoints (by iteration number), never one
    in `protect` (the one just written, the one this run resumed from). Incomplete or damaged
    directories are neither counted nor deleted: find() reports them, the user decides.
    Complete = every file of the manifest there with its size (no hashing: this runs at
    every save)."""
    if keep <= 0:
        return
    complete = []
    for it, n in sorted(_checkpoints(root).items()):
        files, problem = _read_manifest(os.path.join(root, n))
        if problem is None and not any(_check_file(os.path.join(root, n), f, w, checksum=False)
                                       for f, w in files.items()):
            complete.append(n)
    for old in complete[:-keep]:
        if old not in protect:
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)


# ---- saving: start (every rank writes its part) and finish (rank 0 makes it complete) -----
# A save is two halves. start_save makes ckpt/.tmp_iter_X and has DCP write this rank's part
# into it; finish_save collects every rank's file sums and, on rank 0, adds state.pt,
# meta.json and the manifest, renames the directory into place, moves `latest` and prunes.
# A plain save runs the two back to back. An async save (ckpt_async) copies the state to CPU
# memory in start_save (so training may change the weights at once), writes and hashes the
# files in a background thread, and the loop calls finish_save once every rank has written.
# Until then `latest` names the previous checkpoint: a crash mid-write loses only the new one.


class _Writer(FileSystemWriter):
    """DCP's file writer, with fault_save_delay_s: each write starts this many seconds late
    (a slow disk, for the tests of async saves)."""

    def __init__(self, path, delay_s=0.0):
        super().__init__(path)
        self.delay_s = delay_s

    def write_data(self, plan, planner):
        time.sleep(self.delay_s)
        return super().write_data(plan, planner)


@dataclass
class PendingSave:
    """A save between start_save and finish_save. run_state and meta were taken when it
    started: they belong to the saved iteration, whenever the save finishes."""
    root: str             # out_dir/ckpt
    name: str             # iter_XXXXXXX
    mesh: object
    run_state: dict       # rank 0: every rank's RNG states (state.pt)
    meta: dict            # rank 0: meta.json
    work: Future = None   # this rank's write: its result is {file: bytes and sha256}; None: nothing started
    error: Exception = None


def save_group(mesh):
    """The process group of async saves (every rank calls it once, before the first save):
    the background write runs DCP's collectives while the loop runs its own, and two threads
    must not share a group; DCP's async save also needs a CPU backend (gloo), even on nccl."""
    return dist.new_group(backend="gloo") if mesh.backend else None


def _write_and_hash(write, path, rank):
    """Runs write() (DCP writing this rank's shards, __RANK_*.distcp), then hashes those files.
    Each rank hashes its own: one rank hashing a large model's files would keep the others
    waiting past dist_timeout_s."""
    write()
    return _hash_files(path, [n for n in os.listdir(path) if n.startswith(f"__{rank}_")])


def _done(fn):
    """fn() run now, as a finished Future (the plain save's write, shaped like an async one's)."""
    f = Future()
    try:
        f.set_result(fn())
    except (Exception, CheckpointException) as e:  # DCP's exception derives from BaseException
        f.set_exception(e)
    return f


def start_save(out_dir, it, model, optimizer, run_state, meta, mesh, asynchronous=False, group=None, delay_s=0.0):
    """Called by every rank: starts checkpoint ckpt/iter_XXXXXXX of iteration `it` and returns
    its PendingSave for finish_save. Plain: DCP writes this rank's part of the model and
    optimizer (replicated tensors once, shards by their owners) into ckpt/.tmp_iter_XXXXXXX
    before this returns. asynchronous: DCP's async_save copies the state to CPU memory, returns,
    and writes in a background thread over `group` (save_group). run_state (RNG states) and
    meta matter on rank 0 only."""
    root = os.path.join(out_dir, "ckpt")
    name = f"iter_{it:07d}"
    tmp = os.path.join(root, ".tmp_" + name)
    pending = PendingSave(root, name, mesh, run_state, meta)
    if mesh.master:
        try:
            if os.path.isdir(tmp):
                shutil.rmtree(tmp)  # a leftover of a save that died half-way
            os.makedirs(tmp)
        except OSError as e:
            pending.error = e
    if not _agree(pending.error is None, mesh):
        return pending  # nothing started on any rank; finish_save reports it
    init_adamw_state(model, optimizer)  # no step succeeded yet: save the state a load will ask for
    state, writer, no_dist = train_state(model, optimizer), _Writer(tmp, delay_s), not mesh.backend
    if asynchronous:
        try:
            written = dcp.async_save(state, storage_writer=writer, process_group=group, no_dist=no_dist)
        except (Exception, CheckpointException) as e:  # staging failed (out of CPU memory): report it at the finish
            pending.work = Future()
            pending.work.set_exception(e)
            return pending
        # the hashing waits for the write in a thread of its own, so the loop waits for neither
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt_hash")
        pending.work = pool.submit(_write_and_hash, written.result, tmp, mesh.rank)
        pool.shutdown(wait=False)  # the thread ends when its one job is done
    else:
        pending.work = _done(lambda: _write_and_hash(lambda: dcp.save(state, storage_writer=writer, no_dist=no_dist),
                                                     tmp, mesh.rank))
    return pending


def written(pending):
    """True once this rank's part of the save is on disk (at once for a plain save). Each rank
    answers for itself; the loop sums the answers in its all-reduce, so that every rank calls
    finish_save at the same iteration."""
    return pending.work is None or pending.work.done()


def finish_save(pending, keep, resumed_from=None):
    """Called by every rank: waits until this rank's part is written, gathers every rank's file
    sums on rank 0, which adds state.pt, meta.json and, last, manifest.json (size and sha256 of
    every file), renames the directory to ckpt/iter_XXXXXXX, points ckpt/latest at it and
    deletes all but the newest `keep` complete checkpoints (never `resumed_from`, the one this
    run started from). A crash at any point leaves `latest` naming a complete checkpoint; a
    failed save (disk full, permissions) raises on every rank, here, and leaves the earlier
    checkpoints as they were. Several nodes need out_dir on a shared filesystem."""
    root, name, mesh = pending.root, pending.name, pending.mesh
    tmp, final = os.path.join(root, ".tmp_" + name), os.path.join(root, name)
    error = pending.error
    if pending.work is not None:  # on every rank or on none (start_save agreed)
        mine = {}
        try:
            mine = pending.work.result()
        except (Exception, CheckpointException) as e:  # collective: every rank raises if one failed
            error = _cause(e)
        hashes = gather_to_master(mine, mesh)
    if error is None and mesh.master:
        try:
            _write_atomic(os.path.join(tmp, "state.pt"), lambda f: torch.save(pending.run_state, f))
            _write_atomic(os.path.join(tmp, "meta.json"),
                          lambda f: f.write(json.dumps(pending.meta, indent=1).encode()))
            _write_manifest(tmp, {k: v for h in hashes for k, v in h.items()})
            _fsync_dir(tmp)
            if os.path.exists(final):  # saved at this iteration before (a resumed run): replace it
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(root)
            _write_atomic(os.path.join(root, "latest"), lambda f: f.write(name.encode() + b"\n"))
            _fsync_dir(root)
        except OSError as e:
            error = e
    if not _agree(error is None, mesh):
        if mesh.master:
            shutil.rmtree(tmp, ignore_errors=True)
        why = _why(error) if error else "on another rank"
        out_dir = os.path.dirname(root)
        raise UserError(f"saving checkpoint {name} failed ({why}); the earlier checkpoints in {root} are untouched: "
                        f"free disk space or fix the permissions of {out_dir}, then restart (init_from=auto resumes)")
    if mesh.master:
        _prune(root, keep, {name, os.path.basename(os.path.normpath(resumed_from)) if resumed_from else name})
    return final


def save(out_dir, it, model, optimizer, run_state, meta, mesh, keep, resumed_from=None):
    """A plain (blocking) save: start_save, then finish_save."""
    pending = start_save(out_dir, it, model, optimizer, run_state, meta, mesh)
    return finish_save(pending, keep, resumed_from)


def find(out_dir, mesh, warn=print):
    """The checkpoint to resume from: the one ckpt/latest names if it verifies (manifest,
    checksums, and its small files load safely), else the newest ckpt/iter_N that does. None
    when out_dir has no checkpoint at all. A checkpoint that fails verification is reported
    by name and skipped; if none is intact that is an error (starting over would overwrite
    the run). Every rank of `mesh` checks a share of the files and all get the same answer;
    mesh None: a lone process (sample.py)."""
    root = os.path.join(out_dir, "ckpt")
    master = mesh is None or mesh.master
    names = None
    if master:
        names = [n for _, n in sorted(_checkpoints(root).items(), reverse=True)]
        try:
            with open(os.path.join(root, "latest")) as f:
                latest = f.read().strip()
            if latest in names:  # latest first, then the others, newest first
                names.remove(latest)
                names.insert(0, latest)
        except OSError:
            pass
    if mesh is not None:
        names = broadcast_object(names, mesh)
    problems = []
    for n in names:
        problem = verify(os.path.join(root, n), mesh)
        if problem is None:
            return os.path.join(root, n)
        problems.append(f"{n}: {problem}")
        if master:
            warn(f"warning: checkpoint {os.path.join(root, n)} is corrupt ({problem}); trying an older one")
    if names:
        raise UserError(f"no intact checkpoint in {root} ({'; '.join(problems)}): restore one, or start "
                        f"over with init_from=scratch and a new out_dir")
    return None


def _read_small(path):
    """(meta, state, None): meta.json (iteration, config, model shape) and state.pt (RNG
    states) of a checkpoint; or (None, None, what is wrong). weights_only=True: a checkpoint
    is data, never code."""
    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        return None, None, f"meta.json: {_why(e)}"
    if not isinstance(meta, dict) or type(meta.get("iter")) is not int:
        return None, None, "meta.json has no iteration number"
    try:
        with warnings.catch_warnings():  # a crafted file's pickle protocol draws a warning first
            warnings.simplefilter("ignore")
            state = torch.load(os.path.join(path, "state.pt"), map_location="cpu", weights_only=True)
    except Exception as e:  # weights_only refuses any class but tensors and plain containers
        # torch's message starts with a paragraph on the weights_only default; the cause is further down
        cause = re.search(r"WeightsUnpickler error:\s*([^\n]{1,160})", str(e))
        return None, None, f"state.pt is not plain data ({cause[1].strip()})" if cause else f"state.pt: {_why(e)}"
    return meta, state, None


def read_meta(path):
    """meta.json and state.pt of a checkpoint (see _read_small); a UserError naming the file
    if either is unreadable or not plain data."""
    meta, state, problem = _read_small(path)
    if problem:
        raise UserError(f"checkpoint {path} is unreadable ({problem}): point ckpt/latest at an intact "
                        f"checkpoint, or use init_from=scratch")
    return meta, state


def read_metrics(path):
    """The records of a run's metrics.jsonl ([] if it is absent). A line that does not parse
    (the tail of an append cut short by a kill or a full disk) is dropped: the log must never
    block a resume."""
    rows = []
    if os.path.exists(path):
        with open(path, "rb") as f:
            for line in f:
                try:
                    r = json.loads(line)
                except ValueError:  # a torn line (UnicodeDecodeError is a ValueError too)
                    continue
                if isinstance(r, dict) and type(r.get("iter")) is int:
                    rows.append(r)
    return rows


# torch.distributed.checkpoint reads .metadata with plain pickle.load, which runs whatever a
# crafted file asks for. We unpickle it ourselves with only the classes a Metadata of our
# checkpoints is made of (listed from real ones, with and without FSDP shards) and hand DCP
# the result. BytesStorageMetadata is left out on purpose: DCP reads such entries with
# torch.load(weights_only=False), and our checkpoints hold tensors only.
_METADATA_CLASSES = {("torch.distributed.checkpoint.metadata", n) for n in (
    "Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
    "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # torch.strided, by its name
    ("pathlib", "PosixPath")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _METADATA_CLASSES or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                   torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}")


def _dcp_metadata(path):
    """(DCP's Metadata of the checkpoint, None), or (None, what is wrong)."""
    try:
        with open(os.path.join(path, ".metadata"), "rb") as f:
            md = _MetadataUnpickler(f).load()
    except Exception as e:  # anything a damaged or crafted pickle raises
        return None, (f".metadata is refused ({_why(e)}): not a checkpoint index this trainer writes, and "
                      f"unpickling it as DCP does could run code")
    if not (isinstance(md, Metadata) and isinstance(md.state_dict_metadata, dict)
            and isinstance(md.storage_data, dict)):
        return None, ".metadata is refused (not a DCP Metadata)"
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            return None, f".metadata is refused (entry {str(key)[:80]!r} is not a tensor)"
    for info in md.storage_data.values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or os.path.basename(rel) != rel or rel in ("", ".", ".."):
            return None, f".metadata is refused (data at {str(rel)[:80]!r}, outside the checkpoint)"
    return md, None


def read_dcp_metadata(path):
    """DCP's Metadata of a checkpoint, read without running code; a UserError naming the file
    if it holds anything but what DCP writes for our tensors."""
    md, problem = _dcp_metadata(path)
    if problem:
        raise UserError(f"{os.path.join(path, problem)}; point ckpt/latest at an intact checkpoint, or use "
                        f"init_from=scratch")
    return md


class _SafeReader(FileSystemReader):
    """DCP's file reader, given the Metadata read_dcp_metadata read (instead of pickle.load)."""

    def __init__(self, path, metadata):
        super().__init__(path)
        self.metadata = metadata

    def read_metadata(self, *args, **kwargs):
        if getattr(self.metadata, "storage_meta", None) is None:
            self.metadata.storage_meta = StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id  # what FileSystemReader.read_metadata sets
        return self.metadata


def load(path, model, optimizer=None, no_dist=False):
    """Reads a checkpoint's weights (and optimizer state) into `model` in place, whatever
    layout it was saved from and whatever layout `model` is in now: whole, a pipeline stage
    (it takes its own names), FSDP shards or tensor-parallel slices. Every rank calls it, unless no_dist: then one
    process reads on its own (a whole model, for sampling or export)."""
    md = read_dcp_metadata(path)
    if optimizer is not None:
        init_adamw_state(model, optimizer)
        state = train_state(model, optimizer)
    else:
        state = _tp_gathered({"model": trainable_state(model)}, model)
    # the shapes, checked here: DCP's own message names neither the tensor nor the shapes
    for group, tensors in state.items():
        for name, t in tensors.items():
            saved = md.state_dict_metadata.get(f"{group}.{name}")
            if saved is None:
                raise UserError(f"checkpoint {path} has no {group}.{name}: it was written by another model or "
                                f"version; start from its weights with init_from= (a fresh optimizer)")
            if tuple(saved.size) != tuple(t.shape):
                raise UserError(f"checkpoint {path} holds {group}.{name} of shape {tuple(saved.size)}, but the model "
                                f"has {tuple(t.shape)}: build the model with the checkpoint's shape (n_layer, "
                                f"n_embd, ...), or use a new out_dir")
    try:
        dcp.load(state, storage_reader=_SafeReader(path, md), no_dist=no_dist or not dist.is_initialized())
    except (Exception, CheckpointException) as e:  # DCP's exception derives from BaseException
        cause = _cause(e)
        if isinstance(cause, UserError):
            raise cause from None
        raise UserError(f"checkpoint {path} is unreadable ({_why(cause)}): point ckpt/latest at an intact "
                        f"checkpoint, or use init_from=scratch") from None
    _tp_scatter(state, model, optimizer)
    missing, unexpected = model.load_state_dict(state["model"], strict=False)
    frozen = set(model.state_dict()) - set(state["model"])
    assert not unexpected and set(missing) == frozen, f"checkpoint load: missing {missing}, unexpected {unexpected}"
    if isinstance(optimizer, ZeroOptimizer):  # ZeRO: every rank read the whole state; it keeps its slices
        optimizer.load_full_state(state["optim"], {p: n for n, p in model.named_parameters()})


# ---------------------------------------------------------------------------------------------
# safetensors, by hand: 8 bytes little-endian header length N, N bytes of JSON
# {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}, then the
# raw little-endian bytes, offsets relative to the start of that data. No pickle: loading a
# file cannot run code.

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # a header is kilobytes; more is a corrupt length, not a file to parse


def _corrupt(path, problem):
    return UserError(f"{path}: {problem}; the file is truncated, damaged or not safetensors: copy or download it again")


def read_safetensors_header(path):
    """(data_start, {name: (begin, end, dtype, shape)}) of a .safetensors file: where each
    tensor's bytes are, relative to data_start, after checking the header (sizes, dtypes,
    shapes, and that the tensors tile the data exactly). A malformed file is a UserError
    naming the file and the problem. Reads the header only."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size < 8:
            raise _corrupt(path, f"only {size} bytes, too short for the 8-byte header length")
        n = int.from_bytes(f.read(8), "little")
        if n > size - 8:
            raise _corrupt(path, f"header length {n} is larger than the file ({size} bytes)")
        if n > MAX_HEADER_BYTES:
            raise _corrupt(path, f"header length {n} is above the 100 MB limit")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _corrupt(path, f"header is not valid UTF-8 JSON ({e})") from None
    if not isinstance(header, dict):
        raise _corrupt(path, f"header is a JSON {type(header).__name__}, not an object")
    header.pop("__metadata__", None)
    data_size = size - 8 - n
    entries = []  # (begin, end, name, dtype, shape)
    for name, info in header.items():
        if not isinstance(info, dict):
            raise _corrupt(path, f"tensor '{name}' has no dtype/shape/data_offsets entry")
        dtype = SAFETENSORS_DTYPES.get(str(info.get("dtype")))
        if dtype is None:
            raise UserError(f"{path}: tensor '{name}' has dtype {info.get('dtype')!r}, which this reader "
                            f"does not support ({', '.join(SAFETENSORS_DTYPES)}): convert it to one of those")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise _corrupt(path, f"tensor '{name}' has shape {shape!r}, not a list of non-negative ints")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data_size):
            raise _corrupt(path, f"tensor '{name}' has data_offsets {offsets!r}, not [begin, end] within the "
                                 f"{data_size} data bytes")
        nbytes = math.prod(shape) * dtype.itemsize
        if offsets[1] - offsets[0] != nbytes:
            raise _corrupt(path, f"tensor '{name}' spans {offsets[1] - offsets[0]} bytes, but {info['dtype']} "
                                 f"{shape} needs {nbytes}")
        entries.append((offsets[0], offsets[1], name, dtype, shape))
    # like the reference implementation: sorted by offset, the tensors tile the data
    # exactly, from byte 0 to the end of the file (no two share bytes, none is hidden)
    entries.sort(key=lambda e: e[:2])
    end = 0
    for begin, stop, name, _, _ in entries:
        if begin != end:
            raise _corrupt(path, f"tensor '{name}' starts at data byte {begin}, but the previous tensor ends at {end} "
                                 f"({'overlapping' if begin < end else 'a gap between'} data_offsets)")
        end = stop
    if end != data_size:
        raise _corrupt(path, f"the tensors end at data byte {end}, but the file has {data_size} data bytes")
    return 8 + n, {name: (begin, stop, dtype, shape) for begin, stop, name, dtype, shape in entries}


def read_safetensors_part(f, path, data_start, name, entry, dim=None, start=0, stop=0):
    """Tensor `name` of the open safetensors file f (its header entry from
    read_safetensors_header), or only rows [start, stop) of it along dim: along dim 0 those
    are one contiguous byte range, and only it is read; along another dim the tensor is read
    whole and sliced (a transient of one tensor)."""
    begin, end, dtype, shape = entry
    if dim == 0:
        row = math.prod(shape[1:]) * dtype.itemsize
        begin, end, shape = begin + start * row, begin + stop * row, [stop - start, *shape[1:]]
    buf = torch.empty(end - begin, dtype=torch.uint8)
    f.seek(data_start + begin)
    if f.readinto(buf.numpy()) != end - begin:  # the file shrank since its header was read
        raise _corrupt(path, f"tensor '{name}' ends early")
    t = buf.view(dtype).reshape(shape)
    return t if dim in (None, 0) else t.narrow(dim, start, stop - start)


def read_safetensors(path):
    """{name: tensor} of a .safetensors file, on CPU. A malformed file is a UserError naming
    the file and the problem; nothing is read beyond what the header describes. Assumes a
    little-endian machine, like every GPU host."""
    data_start, entries = read_safetensors_header(path)
    with open(path, "rb") as f:
        return {name: read_safetensors_part(f, path, data_start, name, entry) for name, entry in entries.items()}


def write_safetensors(path, tensors, metadata=None):
    """Writes {name: tensor} as a .safetensors file that the reference implementation (and
    read_safetensors) loads: names sorted, data contiguous, the header padded with spaces to a
    multiple of 8 so the data starts aligned. Atomic: a temp file renamed into place, so a
    crash never leaves half a file under `path`."""
    names = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
    header = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}} if metadata else {}
    data, offset = [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        if t.dtype not in names:
            raise ValueError(f"write_safetensors: tensor '{name}' has dtype {t.dtype}, which safetensors "
                             f"here does not support")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        data.append(t.reshape(-1).view(torch.uint8))  # its raw bytes, no copy
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
            for b in data:
                f.write(b.numpy())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# ---------------------------------------------------------------------------------------------
# Hugging Face LLaMA checkpoints (LlamaForCausalLM, save_pretrained's directory layout).
# Hugging Face name -> ours; {i} is the layer index. Our RoPE uses HF's rotate-half layout
# (see rope_tables), so q_proj/k_proj load as they are: no permutation of their rows (that
# permutation is what converting Meta's original interleaved checkpoints to HF needs).
HF_LLAMA_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.layers.{i}.input_layernorm.weight": "layers.{i}.attention_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "layers.{i}.attention.wq.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "layers.{i}.attention.wk.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "layers.{i}.attention.wv.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "layers.{i}.attention.wo.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.ffn_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "layers.{i}.feed_forward.w1.weight",
    "model.layers.{i}.mlp.up_proj.weight": "layers.{i}.feed_forward.w3.weight",
    "model.layers.{i}.mlp.down_proj.weight": "layers.{i}.feed_forward.w2.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",  # absent from HF files with tie_word_embeddings
}


def rename(name, table):
    """`name` through a table like HF_LLAMA_NAMES (or its inverse); None if it has no entry."""
    m = re.fullmatch(r"(.*layers\.)(\d+)(\..*)", name)
    key = f"{m[1]}{{i}}{m[3]}" if m else name
    return table[key].format(i=m[2] if m else None) if key in table else None


def hf_config_to_ours(hf):
    """ModelConfig kwargs (all but block_size) from a Hugging Face LLaMA config.json dict.
    Refuses what this model does not implement rather than load it and compute something else."""
    def refuse(field, why):
        return UserError(f"config.json: {field}={hf.get(field)!r}: {why}; only plain LLaMA models "
                         f"(LlamaForCausalLM without those variants) can be loaded")

    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if type(hf.get(field)) is not int:
            raise refuse(field, "missing or not an int")
        if hf[field] <= 0:
            raise refuse(field, "a size must be positive")
    kv = hf.get("num_key_value_heads")
    if kv is not None and (type(kv) is not int or kv <= 0):
        raise refuse("num_key_value_heads", "a size must be a positive int")
    if hf.get("model_type") != "llama":
        raise refuse("model_type", "not a LLaMA model")
    if hf.get("rope_scaling") is not None:
        raise refuse("rope_scaling", "scaled rotary positions are not implemented")
    # transformers >= 5 writes rope_theta (and rope_type, its rope_scaling) under rope_parameters
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise refuse("rope_parameters", "scaled rotary positions are not implemented")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise refuse("attention_bias" if hf.get("attention_bias") else "mlp_bias", "biases are not implemented")
    if hf.get("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", "only silu (SwiGLU) is implemented")
    n_embd, n_head = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") is not None and hf["head_dim"] != n_embd // n_head:
        raise refuse("head_dim", f"only head_dim = hidden_size // num_attention_heads = {n_embd // n_head} "
                                 f"is implemented")
    return dict(vocab_size=hf["vocab_size"], n_layer=hf["num_hidden_layers"], n_head=n_head,
                n_kv_head=hf.get("num_key_value_heads") or n_head, n_embd=n_embd,
                ffn_dim=hf["intermediate_size"], norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


def expected_shapes(cfg):
    """{our name: shape} of every weight a checkpoint of this config holds (a tied head is the
    embedding, not a weight of its own). Built on the meta device: no memory, no init."""
    with torch.device("meta"):
        model = Transformer(cfg)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if cfg.tie_embeddings:
        del shapes["output.weight"]
    return shapes


def hf_llama_index(path):
    """(ModelConfig kwargs, {our name: (HF name, file, data_start, header entry)}) of the Hugging Face
    LLaMA model that save_pretrained wrote into directory `path`: config.json and
    model.safetensors, or model.safetensors.index.json and the shards its weight_map names.
    Reads config.json and the safetensors headers only, and checks that the tensors are
    exactly the model's, of the right shapes; load_hf_llama or load_hf_parts read the data."""
    def read_json(file):
        try:
            with open(os.path.join(path, file)) as f:
                obj = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"{path}/{file} is not valid JSON ({e}): copy or download it again") from None
        if not isinstance(obj, dict):
            raise UserError(f"{path}/{file} holds a JSON {type(obj).__name__}, not an object: "
                            f"copy or download it again")
        return obj

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UserError(f"{path}: no config.json; point at a Hugging Face model directory "
                        f"(what save_pretrained writes)")
    kwargs = hf_config_to_ours(read_json("config.json"))
    if os.path.isfile(os.path.join(path, "model.safetensors.index.json")):
        weight_map = read_json("model.safetensors.index.json").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise UserError(f"{path}/model.safetensors.index.json has no weight_map of file names: "
                            f"copy or download it again")
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise UserError(f"{path}: no model.safetensors or model.safetensors.index.json; only safetensors weights "
                        f"are read: re-save the model with save_pretrained(..., safe_serialization=True)")
    hf_tensors = {}  # HF name -> (file, data_start, header entry)
    for file in files:
        if not os.path.isfile(os.path.join(path, file)):
            raise UserError(f"{path}: the shard {file} that model.safetensors.index.json names is missing: "
                            f"copy or download it")
        data_start, entries = read_safetensors_header(os.path.join(path, file))
        hf_tensors.update({name: (os.path.join(path, file), data_start, e) for name, e in entries.items()})

    try:
        cfg = ModelConfig(**kwargs)
    except ValueError as e:
        raise UserError(f"{path}/config.json: {e}") from None
    expected = expected_shapes(cfg)
    sd = {}
    for name, t in hf_tensors.items():
        ours = rename(name, HF_LLAMA_NAMES)
        if ours == "output.weight" and cfg.tie_embeddings:
            continue  # a tied head that was saved anyway: it is the embedding
        if ours not in expected:
            raise UserError(f"{path}: unknown tensor '{name}' for a {cfg.n_layer}-layer LLaMA; the checkpoint is "
                            f"not a plain LlamaForCausalLM, or config.json does not match its weights")
        file, data_start, entry = t
        if tuple(entry[3]) != expected[ours]:  # entry: (begin, end, dtype, shape)
            raise UserError(f"{path}: tensor '{name}' has shape {tuple(entry[3])}, but config.json implies "
                            f"{expected[ours]}; config.json does not match the weights")
        sd[ours] = (name, file, data_start, entry)
    missing = [rename(n, {v: k for k, v in HF_LLAMA_NAMES.items()}) for n in expected if n not in sd]
    if missing:
        raise UserError(f"{path}: missing tensors {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}; "
                        f"the checkpoint is incomplete (a shard missing from weight_map?): copy or download it again")
    return kwargs, sd


@torch.no_grad()
def load_hf_parts(index, parts):
    """Reads into each (name, local, full_shape, dim, start, stop) of `parts` (see
    parallel.local_parts) its slice of the tensor that `index` (hf_llama_index) maps that name
    to, converted to local's dtype: a rank reads only the bytes of what it holds (whole rows
    of an FSDP shard: one byte range per tensor)."""
    files = {}
    try:
        for name, local, _, dim, start, stop in parts:
            hf_name, file, data_start, entry = index[name]
            f = files.get(file) or files.setdefault(file, open(file, "rb"))
            local.copy_(read_safetensors_part(f, file, data_start, hf_name, entry, dim, start, stop))
    finally:
        for f in files.values():
            f.close()


def load_hf_llama(path):
    """(ModelConfig kwargs, state dict in our names) of the Hugging Face LLaMA model in
    directory `path` (see hf_llama_index), read whole. Tensors keep the dtype of the file;
    load_state_dict converts them to the model's."""
    kwargs, index = hf_llama_index(path)
    sd = {}
    for ours, shape in expected_shapes(ModelConfig(**kwargs)).items():
        sd[ours] = torch.empty(shape, dtype=index[ours][3][2])
    load_hf_parts(index, [(name, t, tuple(t.shape), None, 0, 0) for name, t in sd.items()])
    return kwargs, sd


def save_hf_llama(path, state_dict, cfg, enc=None, shard_mb=5000.0):
    """Writes our state dict (plain tensors, our names, a whole model) as a Hugging Face
    LLaMA directory that LlamaForCausalLM.from_pretrained loads: config.json and
    model.safetensors (float32; no lm_head when the embeddings are tied), or, past shard_mb
    megabytes (10**6 bytes, as HF counts them) of weights, shards model-0000i-of-0000N.safetensors
    and model.safetensors.index.json, as save_pretrained writes them. With `enc` (the run's
    tiktoken encoding) also tokenizer.json and tokenizer_config.json (see hf_tokenizer), so
    that AutoTokenizer.from_pretrained loads the same directory. Written into a temp
    directory renamed into place at the end; `path` must not exist or be empty, so nothing
    of the user's is ever overwritten."""
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise UserError(f"{path} already exists and is not an empty directory: remove it or export elsewhere")
    expected, to_hf = expected_shapes(cfg), {v: k for k, v in HF_LLAMA_NAMES.items()}
    missing = sorted(set(expected) - set(state_dict))
    if missing:
        raise ValueError(f"save_hf_llama: state dict lacks {', '.join(missing[:5])}: it must hold a whole model")
    tensors = {rename(name, to_hf): state_dict[name].detach().to("cpu", torch.float32) for name in expected}
    hf_config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.n_embd, "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head, "head_dim": cfg.n_embd // cfg.n_head,
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": None,
        "max_position_embeddings": cfg.block_size, "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu", "torch_dtype": "float32", "attention_bias": False, "mlp_bias": False,
    }
    more = {}
    if enc is not None:
        if enc.n_vocab > cfg.vocab_size:
            raise ValueError(f"save_hf_llama: tokenizer {enc.name} has ids up to {enc.n_vocab - 1}, beyond the "
                             f"model's vocab_size={cfg.vocab_size}")
        more["tokenizer.json"], more["tokenizer_config.json"] = hf_tokenizer(enc, cfg.block_size)
        # <|endoftext|> closes every packed document, so it is also what the next one follows
        hf_config["bos_token_id"] = hf_config["eos_token_id"] = enc.eot_token
    write_export_dir(path, "config.json", hf_config, "model.safetensors", tensors,
                     shard_bytes=int(shard_mb * 10 ** 6), more_files=more)


def write_export_dir(path, config_name, config, weights_name, tensors, shard_bytes=0, more_files=None):
    """A directory of one JSON config and one safetensors file (what save_pretrained writes),
    built under a temp name and renamed into place (replacing an empty directory), so a crash
    never leaves half an export under `path`. more_files: {file name: JSON object} written
    beside them. shard_bytes > 0 and weights larger than that: shards instead of one file
    (see shard_names)."""
    tmp = f"{os.path.normpath(path)}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        for name, obj in {config_name: config, **(more_files or {})}.items():
            with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                json.dump(obj, f, indent=2, ensure_ascii=False)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map = shard_names(tensors, shard_bytes, weights_name) if 0 < shard_bytes < total else {}
        if not weight_map:
            write_safetensors(os.path.join(tmp, weights_name), tensors, {"format": "pt"})
        else:
            for file in sorted(set(weight_map.values())):
                write_safetensors(os.path.join(tmp, file), {n: t for n, t in tensors.items() if weight_map[n] == file},
                                  {"format": "pt"})
            with open(os.path.join(tmp, f"{weights_name}.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def shard_names(tensors, shard_bytes, weights_name="model.safetensors"):
    """{tensor name: shard file} as save_pretrained splits weights: whole tensors, greedily in
    name order, a new shard when the next tensor would take this one past shard_bytes (a
    tensor larger than that gets a shard of its own); files model-00001-of-00003.safetensors ..."""
    shards, size = [[]], 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    stem, ext = weights_name.rsplit(".", 1)
    return {name: f"{stem}-{i + 1:05d}-of-{len(shards):05d}.{ext}" for i, shard in enumerate(shards) for name in shard}


# ---------------------------------------------------------------------------------------------
# The tokenizer, for Hugging Face: our tiktoken encoding as the tokenizer.json that the
# `tokenizers` library (AutoTokenizer's fast tokenizers) reads, written by hand from the ranks.
#
# tiktoken's BPE: split text with the pattern pat_str, then in each piece repeatedly join the
# adjacent pair whose concatenation has the lowest rank (a piece that is a token as a whole is
# that token). HF's byte-level BPE does the same given (1) the same split (a Split
# pre-tokenizer on pat_str), (2) vocabulary strings in GPT-2's byte -> printable-character map,
# (3) merges ordered so that "lowest merge index first" is "lowest rank of the result first",
# and (4) ignore_merges, the whole-piece shortcut. For (3) we list, for every token, every
# split of it into two tokens, ordered by the token's rank (transformers' TikTokenConverter
# does the same): the usual one merge per token (the pair its own bytes' BPE ends with) would
# miss the pairs that reach a token by another route inside a longer piece.


def bytes_to_unicode():
    """GPT-2's map from the 256 bytes to printable characters: printable Latin-1 bytes are
    themselves, the rest (controls, space, ...) are shifted to U+0100 and up."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(shifted)}}


def hf_tokenizer(enc, max_length):
    """(tokenizer.json, tokenizer_config.json) as dicts for the tiktoken encoding `enc` (see
    data.get_tokenizer: a possibly truncated BPE, its special tokens, extra tokens).

    Special tokens in text behave as data.encode treats them: <|endoftext|> (and tiktoken's
    other special tokens) written in a text is ordinary text, split into byte-level tokens
    (tokenizer_config's split_special_tokens), while the extra tokens (the chat template's
    among them) become their ids; they are added tokens that are not "special" to HF, which is
    also why decode(..., skip_special_tokens=True) keeps them and drops only <|endoftext|>."""
    ranks = enc._mergeable_ranks
    byte_char = bytes_to_unicode()

    def text(token):
        return "".join(byte_char[b] for b in token)

    merges = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], text(left), text(right)))
    merges.sort()
    # Oniguruma (the tokenizers library's regex engine) reads "{1,3}+" as "({1,3})+", any
    # number of digits, not as fancy-regex's (tiktoken's) possessive "{1,3}"; alone at the end
    # of its alternative a bounded repeat needs no possessive, so the plain one is the same
    pattern = re.sub(r"(\{\d+,\d+\})\+", r"\1", enc._pat_str)
    extra = set(getattr(enc, "extra_tokens", ()))
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": t not in extra} for t, i in sorted(enc._special_tokens.items(), key=lambda kv: kv[1])]
    vocab = {text(token): rank for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])}
    # the added tokens are in the vocabulary too: `tokenizers` numbers an added token that is
    # not, whatever its "id" says, after the vocabulary (wrong past a gap: cl100k_base has no
    # id 100256). The BPE never produces them: the extra tokens are matched before it, and
    # pat_str splits the special ones ("<|" from "endoftext" from "|>")
    vocab.update({a["content"]: a["id"] for a in added})
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": vocab,
                  "merges": [[m[3], m[4]] for m in merges]},
    }
    eot = "<|endoftext|>"
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
        "bos_token": eot, "eos_token": eot, "pad_token": eot, "unk_token": None,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "split_special_tokens": True,
        "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added},
    }
    roles = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")  # data.CHAT_TOKENS: data.render_chat's template
    if all(t in extra for t in roles):
        config["chat_template"] = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}"
                                   "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
    return tokenizer, config


# ---------------------------------------------------------------------------------------------
# LoRA: the frozen base a run adapts, and adapters in PEFT's format.
#
# Our checkpoints of a LoRA run hold the adapters and their AdamW state only; meta.json's
# "lora" entry references the base: {"kind": "hf" | "ckpt", "path", "sha256"}. Copying a
# multi-GB base into every checkpoint (or even once) would cost what LoRA saves; the price is
# that the base must stay where it was, and the sha256 makes a changed or swapped base an
# error instead of adapters silently applied to the wrong weights.


def base_reference(path, mesh=None):
    """{"kind", "path", "sha256"} of a base model: a Hugging Face LLaMA directory (kind "hf":
    the sha256 covers config.json and the weight files) or one checkpoint ckpt/iter_X of a run
    of ours (kind "ckpt": its manifest.json, which holds the sha256 of every file). Rank 0
    reads the files (once, not once per rank) and tells the others."""
    ref = None
    if mesh is None or mesh.master:
        path = os.path.abspath(path)
        if os.path.isfile(os.path.join(path, "config.json")):
            kind = "hf"
            files = sorted(f for f in os.listdir(path) if f == "config.json" or f.endswith(".safetensors")
                           or f == "model.safetensors.index.json")
        else:
            kind, files = "ckpt", ["manifest.json"]
        h = hashlib.sha256()
        for f in files:
            h.update(f"{f}:{_sha256(os.path.join(path, f))}\n".encode())
        ref = {"kind": kind, "path": path, "sha256": h.hexdigest()}
    return ref if mesh is None else broadcast_object(ref, mesh)


def load_base(model, ref, mesh=None):
    """Reads the base that `ref` (see base_reference) names into `model` (whole, before
    apply_lora), after checking that it is still there and still the same."""
    path = ref["path"]
    if not os.path.isfile(os.path.join(path, "config.json" if ref["kind"] == "hf" else "manifest.json")):
        raise UserError(f"the base model of this LoRA run, {path}, is gone: the run's checkpoints hold only the "
                        f"adapters and reference the base; put it back there, or start a new out_dir")
    now = base_reference(path, mesh)
    if now["sha256"] != ref["sha256"]:
        raise UserError(f"the base model {path} has changed since this LoRA run started (sha256 {now['sha256'][:12]}, "
                        f"was {ref['sha256'][:12]}): the adapters were trained on the old weights; restore them, or "
                        f"start a new out_dir")
    if ref["kind"] == "hf":
        _, sd = load_hf_llama(path)
        if model.cfg.tie_embeddings:
            sd.setdefault("output.weight", sd["tok_embeddings.weight"])
        model.load_state_dict(sd)
    else:
        load(path, model, no_dist=True)
    return model


def load_whole(path):
    """(whole model on CPU, meta) from checkpoint `path`, whatever layout wrote it. A LoRA
    run's checkpoint gives its base with the adapters on (not merged: see merge_lora)."""
    meta, _ = read_meta(path)
    model = Transformer(ModelConfig(**meta["model"]))
    lora = meta.get("lora")
    if lora:
        load_base(model, lora["base"])
        apply_lora(model, lora["rank"], lora["alpha"], lora["dropout"], lora["targets"], seed=0)  # A is loaded next
    load(path, model, no_dist=True)
    return model, meta


# PEFT's LoRA on a LlamaForCausalLM: the adapter of module M is saved as
# base_model.model.<M>.lora_A.weight / .lora_B.weight (PeftModel -> LoraModel -> the HF model;
# get_peft_model_state_dict drops the adapter name, ".default"), beside adapter_config.json
# with r, lora_alpha, lora_dropout and target_modules (module names: q_proj, ..., lm_head).
# scaling = lora_alpha / r unless use_rslora; forward y = base(x) + B(A(dropout(x))) * scaling.
PEFT_PREFIX = "base_model.model."
PEFT_TARGETS = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj",
                "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj", "output": "lm_head"}
assert set(PEFT_TARGETS) == set(LORA_TARGETS)


def _peft_name(name, to_hf):
    """Ours -> PEFT's: layers.0.attention.wq.lora_A.weight -> base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"""
    module, ab, _ = name.rsplit(".", 2)
    return f"{PEFT_PREFIX}{rename(module + '.weight', to_hf).removesuffix('.weight')}.{ab}.weight"


def save_peft_lora(path, model, lora):
    """Writes the adapters of `model` (whole, adapters not merged) as a PEFT LoRA directory:
    adapter_config.json + adapter_model.safetensors, which
    peft.PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base), path) loads.
    `lora`: the run's {"rank", "alpha", "dropout", "targets", "base"}. Atomic like save_hf_llama."""
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise UserError(f"{path} already exists and is not an empty directory: remove it or export elsewhere")
    assert not any(isinstance(m, LoRALinear) and m.merged for m in model.modules()), "save_peft_lora: unmerge first"
    to_hf = {v: k for k, v in HF_LLAMA_NAMES.items()}
    tensors = {_peft_name(n, to_hf): t.detach().to("cpu", torch.float32)
               for n, t in model.state_dict().items() if ".lora_A." in n or ".lora_B." in n}
    base = lora.get("base") or {}
    config = {  # the keys of peft.LoraConfig that change what the adapter computes, at their meaning here
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "inference_mode": True,
        "base_model_name_or_path": base.get("path") if base.get("kind") == "hf" else None,
        "r": lora["rank"], "lora_alpha": lora["alpha"], "lora_dropout": lora["dropout"],
        "target_modules": sorted(PEFT_TARGETS[t] for t in lora["targets"]),
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "modules_to_save": None, "layers_to_transform": None,
        "rank_pattern": {}, "alpha_pattern": {},
    }
    write_export_dir(path, "adapter_config.json", config, "adapter_model.safetensors", tensors)


def load_peft_lora(path):
    """({"rank", "alpha", "dropout", "targets"}, {our name: tensor}) of a PEFT LoRA adapter
    directory (what save_pretrained / save_peft_lora write). Refuses the LoRA variants that
    would compute something else here (DoRA, rsLoRA, per-layer ranks, biases, ...)."""
    def bad(problem, fix="only plain LoRA adapters of a LlamaForCausalLM can be loaded"):
        return UserError(f"{path}: {problem}; {fix}")

    try:
        with open(os.path.join(path, "adapter_config.json")) as f:
            cfg = json.load(f)
    except OSError:
        raise bad("no adapter_config.json", "point lora_from at a PEFT adapter directory (what save_pretrained "
                                            "or export_lora writes)") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"adapter_config.json is not valid JSON ({e})", "copy or export it again") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type") != "LORA":
        raise bad(f"peft_type={cfg.get('peft_type') if isinstance(cfg, dict) else None!r}, not 'LORA'")
    for key, plain in (("use_dora", False), ("use_rslora", False), ("fan_in_fan_out", False), ("bias", "none"),
                       ("rank_pattern", {}), ("alpha_pattern", {}), ("layers_to_transform", None),
                       ("modules_to_save", None), ("lora_bias", False)):
        if cfg.get(key, plain) not in (plain, None):
            raise bad(f"{key}={cfg[key]!r} is a LoRA variant that is not implemented here")
    r, alpha, drop = cfg.get("r"), cfg.get("lora_alpha"), cfg.get("lora_dropout", 0.0)
    if type(r) is not int or r < 1 or not isinstance(alpha, (int, float)) or not isinstance(drop, (int, float)):
        raise bad(f"r={r!r}, lora_alpha={alpha!r}, lora_dropout={drop!r} are not a positive int and two numbers",
                  "fix adapter_config.json")
    modules = cfg.get("target_modules")
    from_hf = {v: k for k, v in PEFT_TARGETS.items()}
    if not isinstance(modules, list) or not modules or not all(m in from_hf for m in modules):
        raise bad(f"target_modules={modules!r} is not a list of {', '.join(from_hf)}")
    targets = sorted(from_hf[m] for m in modules)
    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(file):
        raise bad("no adapter_model.safetensors (only safetensors adapters are read)",
                  "re-save the adapter with save_pretrained(..., safe_serialization=True)")
    sd = {}
    for name, t in read_safetensors(file).items():
        m = re.fullmatch(re.escape(PEFT_PREFIX) + r"(.*)\.(lora_[AB])\.weight", name)
        module = m and rename(m[1] + ".weight", HF_LLAMA_NAMES)
        if not module or module.split(".")[-2] not in targets:
            raise bad(f"unexpected tensor '{name}' (base weights saved beside the adapter, e.g. PEFT's "
                      f"save_embedding_layers, or a module outside target_modules)",
                      "save the adapter alone (save_embedding_layers=False)")
        sd[f"{module.removesuffix('.weight')}.{m[2]}.weight"] = t
    return {"rank": r, "alpha": float(alpha), "dropout": float(drop), "targets": targets}, sd


def load_lora_adapter(model, adapter, path):
    """Puts the adapter tensors that load_peft_lora read from `path` into `model` (whole, with
    apply_lora's adapters of the same rank and targets). Every adapter must be there: one
    left at its fresh init would be a silently different model."""
    ours = {n for n in model.state_dict() if ".lora_A." in n or ".lora_B." in n}
    missing, extra = sorted(ours - set(adapter)), sorted(set(adapter) - ours)
    if missing or extra:
        raise UserError(f"{path}: the adapter {'lacks ' + ', '.join(missing[:3]) if missing else ''}"
                        f"{'; ' if missing and extra else ''}{'has extra ' + ', '.join(extra[:3]) if extra else ''} "
                        f"for this {model.cfg.n_layer}-layer base: is it the adapter of this base model?")
    shapes = model.state_dict()
    for n, t in adapter.items():
        if tuple(t.shape) != tuple(shapes[n].shape):
            raise UserError(f"{path}: {n} has shape {tuple(t.shape)}, this base needs {tuple(shapes[n].shape)}: "
                            f"is it the adapter of this base model?")
    model.load_state_dict(adapter, strict=False)
