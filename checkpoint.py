"""
Our checkpoints: out_dir/ckpt/iter_XXXXXXX/ written by every rank through
torch.distributed.checkpoint (DCP), keyed by global parameter names so that any layout can
load any other; atomic (a temp directory renamed into place), a manifest of sizes and
sha256 sums, `latest`, pruning, and a reader that never runs code from the files. A save is
begin, the write, complete (ckpt_async.py writes in the background between the two ends).

The foreign formats are in formats/: hf.py (Hugging Face model directories: safetensors, the
LLaMA family), hf_moe.py (their experts), hf_tokenizer.py (their tokenizers); and
techniques/lora.py reads PEFT adapters.

A LoRA run's checkpoints hold only what trains (the adapters and their AdamW state); the
frozen base is referenced (meta.json's "lora" -> "base": its path and a sha256), not copied,
and read again from there by lora.py.

This module knows no loop: it takes a model, an optimizer, paths and the Mesh.
"""

import json
import os
import shutil
import warnings
import zlib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from guards.guard_ckpt import (
    CKPT_NAME,
    check_file,
    _SafeReader,
    all_finite,
    read_dcp_metadata,
    read_latest,
    read_manifest,
    read_meta,
    verify,
)
from common import write_atomic
from model import ModelConfig, Transformer
from guards.guard_errors import UserError, describe_error
from guards.guard_files import sha256_file
from parallel import (
    broadcast_object,
    all_reduce_sum,
    gather_to_master,
    tp_gather,
    tp_slice,
)

# one process saves without a process group on purpose (no_dist): DCP's warning about it at
# every save would only be noise in the quickstart's output
warnings.filterwarnings("ignore",
                        message="torch.distributed is disabled, unavailable or uninitialized")

# ---------------------------------------------------------------------------------------
# checkpoints: out_dir/ckpt/iter_XXXXXXX/ is complete or absent, ckpt/latest names the newest


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def train_state(model, optimizer):
    """What a checkpoint stores of the training state, keyed by global parameter names:
    {"model": name -> weight, "optim": "name.exp_avg" -> ...}. Under FSDP the values are
    DTensor shards; torch.distributed.checkpoint writes each rank's shards and can read them
    back into any other sharding. The optimizer hands over its whole state by names itself
    (optimizer.full_state: optim.py's, or ZeRO's slices gathered whole). Frozen parameters
    (LoRA's base) are left out: they never change, and the run's meta.json says where they
    come from. Tensor-parallel slices are gathered into full tensors (see below)."""
    # first: FSDP's state_dict() hook puts gathered weights back to shards
    weights = trainable_state(model)
    names = param_names(model)
    state = {"model": weights, "optim": optimizer.full_state(names)}
    return _tp_gathered(state, model) if any(hasattr(p, "_split_dim") for p in names) else state


# ---- tensor parallel (tp): checkpoints hold full tensors ------------------------------
# A tp-sharded parameter (tensor_parallel.py marks it with _split_dim) is saved whole:
# its slices are gathered over the tp group, so every tp rank offers DCP the same full
# tensor under its global name (DCP writes a replicated tensor once), and any layout reads
# it. Loading reads the full tensor and keeps this rank's slice. The price: a save or load
# briefly holds the full tensors of this rank's stage (and AdamW's two moments) once more.


def param_names(model):
    """parameter -> its global name, the name one process gives it. A tied head is the
    embedding: on the last pipeline stage, which holds the head without the embedding, it
    is still tok_embeddings.weight, so its optimizer state is one entry whatever the layout."""
    names = {p: n for n, p in model.named_parameters()}
    if model.cfg.tie_embeddings and model.tok_embeddings is None and model.output is not None:
        names[model.output.weight] = "tok_embeddings.weight"
    return names


def _tp_params(model):
    """{name: parameter} of the tp-sharded parameters (a tied head under both names)."""
    tp = {n: p for n, p in model.named_parameters(remove_duplicate=False)
          if hasattr(p, "_split_dim")}
    return {**tp, **{n: p for p, n in param_names(model).items() if hasattr(p, "_split_dim")}}


# the optimizer state shaped like its parameter
TP_STATE = ("exp_avg", "exp_avg_sq", "momentum_buffer")


def _tp_gathered(state, model):
    """state with every tp slice (model weights and their optimizer state) replaced by the full
    tensor (under fsdp x tp a slice is itself sharded over dp: gathered over dp first)."""
    for name, p in _tp_params(model).items():
        for part, key in [("model", name)] + [("optim", f"{name}.{k}") for k in TP_STATE]:
            if key in state.get(part, {}):
                t = state[part][key]
                state[part][key] = tp_gather(t.full_tensor() if isinstance(t, DTensor) else t, p)
    return state


def _tp_local(full, p):
    """This rank's part of a full tensor cut like p: its tp slice (under fsdp x tp, its dp shard of
    that)."""
    t = tp_slice(full, p)
    return (distribute_tensor(t, p.device_mesh, p.placements, src_data_rank=None)
            if isinstance(p, DTensor) else t)


def _tp_scatter(state, model):
    """After loading full tensors into state: this rank's parts into state (the optimizer takes
    its own from there: load_full_state)."""
    for name, p in _tp_params(model).items():
        if name in state["model"]:
            state["model"][name] = _tp_local(state["model"][name], p)
        for k in TP_STATE:
            if f"{name}.{k}" in state.get("optim", {}):
                state["optim"][f"{name}.{k}"] = _tp_local(state["optim"][f"{name}.{k}"], p)


def trainable_state(model):
    """model.state_dict() without the frozen parameters (all of it when nothing is frozen;
    a tied head stays under both names, as state_dict has it)."""
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {n: t for n, t in model.state_dict().items() if n not in frozen}


def cause(e):
    """The exception behind DCP's CheckpointException, whose own text is only
    'CheckpointException ranks:dict_keys([0])': the lowest failing rank's."""
    if isinstance(e, CheckpointException) and e.failures:
        failure = e.failures[min(e.failures)]
        return failure[0] if isinstance(failure, tuple) else failure
    return e


def _checkpoints(root):
    """{iteration: directory name} of the ckpt/iter_N directories under root."""
    names = os.listdir(root) if os.path.isdir(root) else []
    return {int(m[1]): n for n in names
            if (m := CKPT_NAME.fullmatch(n)) and os.path.isdir(os.path.join(root, n))}


def _hash_files(path, names):
    return {n: {"bytes": os.path.getsize(os.path.join(path, n)),
                "sha256": sha256_file(os.path.join(path, n))}
            for n in names}


def _write_manifest(path, known=None):
    """manifest.json: the size and sha256 of every file of the checkpoint, written last.
    `known`: entries other ranks already computed for their own files."""
    known = known or {}
    files = {**_hash_files(path, [n for n in os.listdir(path) if n not in known]), **known}
    files = {n: files[n] for n in sorted(files)}
    write_atomic(os.path.join(path, "manifest.json"),
                 lambda f: f.write(json.dumps({"files": files}, indent=1).encode()))


def _agree(ok, mesh):
    """True on every rank iff ok is True on every rank."""
    flag = all_reduce_sum(torch.tensor(0.0 if ok else 1.0), mesh)
    return flag.item() == 0


def _prune(root, keep, protect):
    """Deletes all but the newest `keep` complete checkpoints (by iteration number), never one
    in `protect` (the one just written, the one this run resumed from). Incomplete or damaged
    directories are neither counted nor deleted: find() reports them, the user decides.
    Complete = every file of the manifest there with its size (no hashing: this runs at
    every save)."""
    names = [n for _, n in sorted(_checkpoints(root).items())]
    if 0 < keep < len(names):  # (no more directories than `keep`: none can go, none is read)
        _delete_old(root, names, keep, protect)


def _delete_old(root, names, keep, protect):
    complete = []
    for n in names:
        files, problem = read_manifest(os.path.join(root, n))
        if problem is None and not any(check_file(os.path.join(root, n), f, w, checksum=False)
                                       for f, w in files.items()):
            complete.append(n)
    for old in complete[:-keep]:
        if old not in protect:
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)


# ---- saving: every rank writes its part, rank 0 makes the checkpoint complete ---------------
# begin makes ckpt/.tmp_iter_X; DCP writes each rank's part into it and each rank hashes its own
# files; complete gathers the hashes on rank 0, which adds state.pt, meta.json and, last, the
# manifest, renames the directory into place, moves `latest` and prunes. A crash at any point
# leaves `latest` naming a complete checkpoint. (ckpt_async.py: the same two ends, the write
# between them in the background.)


def save(out_dir, it, model, optimizer, rng_states, meta, mesh, keep, resumed_from=None):
    """Called by every rank: writes checkpoint ckpt/iter_XXXXXXX of iteration `it` and returns
    its path. Every rank writes its part (weights and optimizer state under global names: the
    whole model once, whatever the layout, so any layout resumes it); rank 0 adds rng_states
    (every rank's random streams: state.pt) and `meta`, the run's metadata (meta.json)."""
    tmp = begin(out_dir, it, model, mesh)
    state, hashes, error = train_state(model, optimizer), {}, None
    try:
        dcp.save(state, storage_writer=FileSystemWriter(tmp), no_dist=not mesh.backend)
        hashes = own_hashes(tmp, mesh.rank)
    except (Exception, CheckpointException) as e:  # DCP's exception derives from BaseException
        error = cause(e)
    return complete(tmp, hashes, error, rng_states, meta, mesh, keep, resumed_from)


def begin(out_dir, it, model, mesh):
    """Every rank: ckpt/.tmp_iter_XXXXXXX made empty by rank 0 (a leftover of a save that died
    half-way goes) and the weights checked finite (never a checkpoint that a rollback or a
    resume could not use). Returns its path."""
    root, name = os.path.join(out_dir, "ckpt"), f"iter_{it:07d}"
    tmp, error = os.path.join(root, ".tmp_" + name), None
    if mesh.master:
        try:
            if os.path.isdir(tmp):
                shutil.rmtree(tmp)
            os.makedirs(tmp)
        except OSError as e:
            error = e
    if not _agree(error is None, mesh):
        _refuse_failed(error, tmp, root, name, mesh)
    if not all_finite(model, bool(mesh.backend)):
        _refuse_not_finite(tmp, name, it, mesh)
    return tmp


def own_hashes(path, rank):
    """{file: bytes and sha256} of this rank's files in `path` (DCP's __RANK_*.distcp). Each rank
    hashes its own: one rank hashing a large model's files would keep the others waiting past
    dist_timeout_s."""
    return _hash_files(path, [n for n in os.listdir(path) if n.startswith(f"__{rank}_")])


def complete(tmp, hashes, error, rng_states, meta, mesh, keep, resumed_from=None):
    """Every rank, once its part is written (`hashes`: its files'; `error`: why it is not): rank 0
    adds state.pt, meta.json and, last, manifest.json (size and sha256 of every file), renames the
    directory to ckpt/iter_XXXXXXX, points ckpt/latest at it and deletes all but the newest `keep`
    complete checkpoints (never `resumed_from`, the one this run started from). A failed save
    (disk full, permissions) raises on every rank, here, and leaves the earlier checkpoints as
    they were. Several nodes need out_dir on a shared filesystem."""
    root, name = os.path.dirname(tmp), os.path.basename(tmp)[len(".tmp_"):]
    final = os.path.join(root, name)
    hashes = gather_to_master(hashes, mesh)
    if error is None and mesh.master:
        try:
            write_atomic(os.path.join(tmp, "state.pt"), lambda f: torch.save(rng_states, f))
            write_atomic(os.path.join(tmp, "meta.json"),
                         lambda f: f.write(json.dumps(meta, indent=1).encode()))
            _write_manifest(tmp, {k: v for h in hashes for k, v in h.items()})
            _fsync_dir(tmp)
            if os.path.exists(final):  # saved at this iteration before (a resumed run): replace it
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(root)
            write_atomic(os.path.join(root, "latest"), lambda f: f.write(name.encode() + b"\n"))
            _fsync_dir(root)
        except OSError as e:
            error = e
    if not _agree(error is None, mesh):
        _refuse_failed(error, tmp, root, name, mesh)
    if mesh.master:
        _prune(root, keep,
               {name, os.path.basename(os.path.normpath(resumed_from)) if resumed_from else name})
    return final


def _refuse_not_finite(tmp, name, it, mesh):
    if mesh.master:
        shutil.rmtree(tmp, ignore_errors=True)
    raise UserError(f"the weights are not finite at iteration {it}: checkpoint {name} is not "
                    "saved, the earlier ones are kept; lower learning_rate (or the phase's "
                    "lr_scale), check the data, or resume from the last checkpoint")


def _refuse_failed(error, tmp, root, name, mesh):
    if mesh.master:
        shutil.rmtree(tmp, ignore_errors=True)
    why = describe_error(error) if error else "on another rank"
    raise UserError(f"saving checkpoint {name} failed ({why}); the earlier checkpoints in {root} "
                    "are untouched: free disk space or fix the permissions of "
                    f"{os.path.dirname(root)}, then restart (init_from=auto resumes)")


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
        latest = read_latest(root)
        if latest in names:  # latest first, then the others, newest first
            names.remove(latest)
            names.insert(0, latest)
    if mesh is not None:
        names = broadcast_object(names, mesh)
    problems = []
    for n in names:
        problem = verify(os.path.join(root, n), mesh)
        if problem is None:
            return os.path.join(root, n)
        problems.append(f"{n}: {problem}")
        if master:
            warn(f"warning: checkpoint {os.path.join(root, n)} is corrupt ({problem}); trying an "
                 f"older one")
    if names:
        raise UserError(f"no intact checkpoint in {root} ({'; '.join(problems)}): restore one, or "
                        f"start over with init_from=scratch and a new out_dir")
    return None


def load(path, model, optimizer=None, no_dist=False):
    """Reads a checkpoint's weights (and optimizer state) into `model` in place, whatever
    layout it was saved from and whatever layout `model` is in now: whole, a pipeline stage
    (it takes its own names), FSDP shards or tensor-parallel slices. Every rank calls it, unless
    no_dist: then one process reads on its own (a whole model, for sampling or export)."""
    md = read_dcp_metadata(path)
    # its own state tensors (zeros before a first step), or ZeRO's gathered
    if optimizer is not None:
        state = train_state(model, optimizer)
    else:
        state = _tp_gathered({"model": trainable_state(model)}, model)
    # the shapes, checked here: DCP's own message names neither the tensor nor the shapes
    for group, tensors in state.items():
        for name, t in tensors.items():
            saved = md.state_dict_metadata.get(f"{group}.{name}")
            if saved is None:
                raise UserError(f"checkpoint {path} has no {group}.{name}: it was written by "
                                "another model or version; start from its weights with "
                                "init_from= (a fresh optimizer)")
            if tuple(saved.size) != tuple(t.shape):
                raise UserError(f"checkpoint {path} holds {group}.{name} of "
                                f"shape {tuple(saved.size)}, but the model "
                                f"has {tuple(t.shape)}: build the model with the checkpoint's "
                                f"shape (n_layer, n_embd, ...), or use a new out_dir")
    try:
        dcp.load(state, storage_reader=_SafeReader(path, md),
                 no_dist=no_dist or not dist.is_initialized())
    except (Exception, CheckpointException) as e:  # DCP's exception derives from BaseException
        why = cause(e)
        if isinstance(why, UserError):
            raise why from None
        raise UserError(f"checkpoint {path} is unreadable ({describe_error(why)}): point "
                        f"ckpt/latest at an intact checkpoint, or use init_from=scratch") from None
    _tp_scatter(state, model)
    missing, unexpected = model.load_state_dict(state["model"], strict=False)
    frozen = set(model.state_dict()) - set(state["model"])
    assert not unexpected and set(missing) == frozen, (
        f"checkpoint load: missing {missing}, unexpected {unexpected}")
    if not all_finite(model, not no_dist and dist.is_initialized()):
        raise UserError(f"checkpoint {path} holds non-finite weights: resume from an earlier "
                        "checkpoint (point ckpt/latest at it), or start over with "
                        "init_from=scratch and a new out_dir")
    # every rank read the whole state: the optimizer takes its part (ZeRO: its slices)
    if optimizer is not None:
        optimizer.load_full_state(state["optim"], param_names(model))


def load_whole(path):
    """(whole model on CPU, meta) from checkpoint `path`, whatever layout wrote it. A LoRA
    run's checkpoint holds only the adapters: lora.load_lora_whole reads it onto its base."""
    meta, _ = read_meta(path)
    assert not meta.get("lora"), (
        f"{path} is a LoRA run's checkpoint: lora.load_lora_whole reads it onto its base")
    model = Transformer(ModelConfig(**meta["model"]))
    load(path, model, no_dist=True)
    return model, meta


# ---- what a checkpoint carries beside the weights: each rank's random streams, so that a
# resumed run draws the same dropout masks as the uninterrupted one, and fp16's loss scale


def rng_states(mesh):
    """Every rank's random streams (dropout, NEFTune) on rank 0, as checkpoints keep them:
    {"rng_cpu": [rank 0's, rank 1's, ...], "rng_cuda": [...]} (None on the other ranks)."""
    mine = {"cpu": torch.get_rng_state(),
            **({"cuda": torch.cuda.get_rng_state()} if mesh.device.type == "cuda" else {})}
    every = gather_to_master(mine, mesh)
    return None if every is None else {f"rng_{k}": [r[k] for r in every] for k in every[0]}


def set_rng_states(state, mesh, meta):
    """Restores this rank's streams from a checkpoint's state.pt (one entry per rank that saved
    it; meta: its meta.json). A tp group shares one stream (its replicated dropout), so the
    saved run had world / tp distinct streams, entry k * tp being stream k; this rank's is
    stream rank // tp. A rank with no saved stream (resumed into more dp ranks or stages than
    the checkpoint had) starts a fresh one from (seed, its stream, the iteration): never one
    that another rank continues, which would repeat its dropout and NEFTune draws."""
    saved_tp = meta["config"].get("tp", 1)
    k, n = mesh.rank // mesh.tp, len(state["rng_cpu"]) // saved_tp
    if k >= n:
        torch.manual_seed(zlib.crc32(f"rng/{meta['config']['seed']}/{k}/{meta['iter']}".encode()))
        return
    torch.set_rng_state(state["rng_cpu"][k * saved_tp])
    if mesh.device.type == "cuda" and "rng_cuda" in state:
        torch.cuda.set_rng_state(state["rng_cuda"][k * saved_tp])


def restore_streams(state, meta, mesh, scaler=None):
    """A checkpoint's random streams (set_rng_states), and fp16's loss scale: what a resume and
    a rollback (nan_guard.py) take back beside the weights."""
    set_rng_states(state, mesh, meta)
    # (a checkpoint of a run that was not fp16: none)
    if scaler is not None and meta.get("loss_scale"):
        scaler.load_state_dict(meta["loss_scale"])


def resume_state(src, mesh, scaler=None):
    """(1) Where the run in out_dir stopped: (its iteration, its wandb run id, its known bad
    iterations), and this rank's random streams restored from src's checkpoint (fp16: and the
    loss scaler's state, loss_scale.py)."""
    restore_streams(src.state, src.meta, mesh, scaler)
    mesh.print0(f"resumed from {src.path} at iteration {src.meta['iter']}")
    return src.meta["iter"], src.meta.get("wandb_id"), set(src.meta.get("skip_iters", []))
