"""
The run directory, out_dir: one run owns it (a lock), it holds the run's metrics.jsonl,
config.json and checkpoints (checkpoint.py), and it decides where a run's weights come from:
its own newest checkpoint (resume), another run of ours, a Hugging Face LLaMA directory, or
fresh ones. Also each rank's random streams, which checkpoints carry so that a resumed run
draws the same dropout masks as the uninterrupted one.
"""

import errno
import fcntl
import json
import os
import shutil
import socket
from dataclasses import dataclass

import torch

import checkpoint
from configurator import UserError, check, check_layout
from model import ModelConfig
from parallel import gather_to_master


def clean_stale(out_dir):
    """Removes ckpt/.tmp_iter_* directories: saves killed half-way. Only for the run that holds
    out_dir's lock (lock_out_dir): a running save's directory looks the same."""
    root = os.path.join(out_dir, "ckpt")
    for n in os.listdir(root) if os.path.isdir(root) else []:
        if n.startswith(".tmp_") and os.path.isdir(os.path.join(root, n)):
            shutil.rmtree(os.path.join(root, n), ignore_errors=True)


_held_locks = {}  # the lock files' descriptors: open until the process exits


def lock_out_dir(out_dir):
    """Makes this process the only run writing to out_dir (two at once would interleave
    metrics and overwrite each other's checkpoints): an exclusive flock on out_dir/.lock, held
    until the process exits; the kernel releases it when the process dies, however it dies.
    The file names the holder (host, pid) for the message another run gets. Then removes the
    temporary directories of killed saves. Rank 0 calls it. Returns the descriptor."""
    path = os.path.join(out_dir, ".lock")
    if path in _held_locks:  # this process holds it already
        return _held_locks[path]
    os.makedirs(out_dir, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = os.read(fd, 4096).decode(errors="replace")
        os.close(fd)
        if e.errno not in (errno.EAGAIN, errno.EACCES):
            raise UserError(f"cannot lock {path} ({checkpoint.describe_error(e)}): put out_dir on a filesystem with file locks") from None
        try:
            who = json.loads(holder)
            pid, host = who["pid"], who["host"]
        except (ValueError, KeyError, TypeError):
            pid, host = "?", "?"
        raise UserError(f"out_dir {out_dir} is in use by pid {pid} on host {host} (another run): wait for it, "
                        f"or use another out_dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode(), 0)
    _held_locks[path] = fd
    clean_stale(out_dir)
    return fd


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


def truncate_metrics(path, upto):
    """Keep exactly the history up to a checkpoint at iteration `upto`: lines written after it
    (by a run that crashed, or before a rollback) are dropped, because those iterations are
    computed and logged again. (A train line's "iter" k is step k, the (k+1)-th; a val
    line's "iter" k comes after k steps.) Rank 0 calls it."""
    old = []
    if upto and os.path.exists(path):
        old = read_metrics(path)  # a torn last line (killed mid-append) is dropped
        old = [r for r in old if r["iter"] < upto or ("val_loss" in r and r["iter"] == upto)]
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in old)
    os.replace(path + ".tmp", path)


def rng_states(mesh):
    """Every rank's random streams (dropout, NEFTune) on rank 0, as checkpoints keep them:
    {"rng_cpu": [rank 0's, rank 1's, ...], "rng_cuda": [...]} (None on the other ranks)."""
    mine = {"cpu": torch.get_rng_state(), **({"cuda": torch.cuda.get_rng_state()} if mesh.device.type == "cuda" else {})}
    every = gather_to_master(mine, mesh)
    return None if every is None else {f"rng_{k}": [r[k] for r in every] for k in every[0]}


def set_rng_states(state, mesh):
    """Restores this rank's streams from a checkpoint's state.pt (one entry per rank that saved it)."""
    r = (mesh.rank - mesh.tp_rank) % len(state["rng_cpu"])  # a tp group shares one stream (its replicated dropout)
    torch.set_rng_state(state["rng_cpu"][r])
    if mesh.device.type == "cuda" and "rng_cuda" in state:
        torch.cuda.set_rng_state(state["rng_cuda"][r])


def roll_back(out_dir, model, optimizer, mesh, skip_iters, streak, it, nan_action):
    """The NaN guard's last resort after `streak` bad iterations up to `it`: the latest
    checkpoint back into the model, the optimizer and the random streams, metrics.jsonl cut
    back to it; returns its iteration. Its known bad iterations join skip_iters, so this time
    their batches are stepped over. With nan_action=stop, or nothing to go back to, an error."""
    path = checkpoint.find(out_dir, mesh, warn=mesh.print0)
    if nan_action == "stop" or path is None:
        raise UserError(f"{streak} iterations in a row (up to {it}) had a non-finite loss or gradient norm"
                        f"{'' if path else ' and there is no checkpoint to roll back to'}: lower learning_rate, "
                        f"check the data around these iterations, or raise nan_max_consecutive")
    meta, state = checkpoint.read_meta(path)
    checkpoint.load(path, model, optimizer)
    set_rng_states(state, mesh)
    skip_iters.update(meta.get("skip_iters", []))
    if mesh.master:
        truncate_metrics(os.path.join(out_dir, "metrics.jsonl"), meta["iter"])
    mesh.print0(f"rolled back to {path}: continuing from iteration {meta['iter']}, stepping over "
                f"{sorted(i for i in skip_iters if i >= meta['iter'])}")
    return meta["iter"]


# ---- where the weights come from ------------------------------------------------------


@dataclass
class Source:
    """Where this run's weights come from. kind: "resume" (this run's own newest intact
    checkpoint: weights, optimizer state, RNG and iteration), "run" (another run's newest
    checkpoint: its weights), "hf" (a Hugging Face LLaMA directory) or "fresh"."""
    kind: str
    path: str = None        # the checkpoint (resume, run) or the directory (hf)
    meta: dict = None       # resume, run: the checkpoint's meta.json; resume: state, its state.pt
    state: dict = None
    saved: dict = None      # the model's shape there (ModelConfig fields), None when fresh
    where: str = ""         # for messages
    hf_index: object = None  # hf: the weight files' index (hf.hf_llama_index)
    lora: dict = None       # resume of a LoRA run: its settings (meta.json's "lora")


def weights_source(out_dir, init_from, mesh):
    """The Source of this run's weights, first match wins: (1) out_dir's own newest intact
    checkpoint (corrupt ones are reported and skipped); (2) init_from= another run of ours;
    (3) init_from= a Hugging Face LLaMA directory (its files checked, no weights read yet);
    (4) fresh."""
    ckpt = checkpoint.find(out_dir, mesh, warn=mesh.print0)
    check(not (init_from == "resume" and ckpt is None), f"init_from=resume but {out_dir}/ckpt has no checkpoint: use "
                                                        f"init_from=auto (or scratch), or the out_dir of the run to "
                                                        f"continue")
    check(not (init_from == "scratch" and ckpt), f"init_from=scratch but {out_dir} holds checkpoints of an earlier "
                                                 f"run: continue it with init_from=auto, or pick a new out_dir (or "
                                                 f"delete {out_dir}/ckpt)")
    if ckpt:                                                                # (1)
        meta, state = checkpoint.read_meta(ckpt)
        return Source("resume", ckpt, meta, state, meta["model"], f"the checkpoint in {out_dir}", lora=meta.get("lora"))
    if init_from in ("auto", "scratch", "resume"):                          # (4)
        return Source("fresh")
    return start_from(init_from, mesh)


def start_from(init_from, mesh):
    """(2) or (3): the Source of a run that starts from another model's weights."""
    if os.path.isdir(os.path.join(init_from, "ckpt")):                      # (2)
        ckpt = checkpoint.find(init_from, mesh, warn=mesh.print0)
        check(ckpt is not None, f"init_from={init_from} is a run directory with no checkpoint in ckpt/: train it "
                                f"first, or point at another run or a Hugging Face model")
        meta = checkpoint.read_meta(ckpt)[0]
        check(not meta.get("lora"), f"init_from={init_from} is a LoRA run: start from its merged model (export_hf= of "
                                    f"train.py or sample.py), or its base with lora_from= its export_lora")
        return Source("run", ckpt, meta, saved=meta["model"], where=f"the checkpoint {ckpt}")
    import hf                                                               # (3)
    saved, index = hf.hf_llama_index(init_from)
    return Source("hf", init_from, saved=saved, where=f"the Hugging Face model in {init_from}", hf_index=index)


def finished_or_other(src, c, overrides, out_dir, mesh):
    """For a run that found a checkpoint in its own out_dir: True (after one line saying so)
    when that run is finished, so this one exits without touching anything; a UserError when
    it is another run than this command's (other data, model shape, tokenizer or starting
    model), which init_from=auto must not continue. init_from=resume continues whatever data."""
    had, it = src.meta.get("config") or {}, src.meta["iter"]
    differ = [] if c["init_from"] == "resume" else [
        k for k in ("dataset", "datasets", "tokenizer", "vocab_size") if c[k] != had.get(k, c[k])]
    if c["init_from"] not in ("auto", "resume", "scratch") and c["init_from"] != had.get("init_from"):
        differ.append("init_from")  # (auto continues a run that started from a model too)
    differ += [k for k in SHAPE_KEYS if k in overrides and k != "vocab_size" and overrides[k] != src.saved.get(k)]
    if differ:
        what = "datasets" if c["datasets"] else "dataset"
        also = ", ".join(f"{k}={c[k]} (the run has {had.get(k, src.saved.get(k))})" for k in differ
                         if k not in ("dataset", "datasets"))
        raise UserError(f"{out_dir} holds a run of {had.get('datasets') or had.get('dataset')} at iteration {it}; "
                        f"this command trains {what}={c[what]}{f' with {also}' if also else ''}: pick a new out_dir, "
                        f"or init_from={out_dir} to start from its weights")
    if it >= c["max_iters"]:
        mesh.print0(f"{out_dir} holds a finished run (iteration {it}, max_iters={c['max_iters']}): nothing to do; "
                    f"raise max_iters= to train further, or pick a new out_dir")
        return True
    return False


SHAPE_KEYS = ("n_layer", "n_head", "n_kv_head", "n_embd", "ffn_dim", "tie_embeddings", "vocab_size")


def saved_shape(src, overrides, base_vocab, c, world):
    """The ModelConfig of a model that comes from a checkpoint or a model directory: its shape
    from there, the run's own keys (block_size, dropout, ...) from the config `c`. An explicit
    shape key that disagrees is a mistake; the layout is checked against this shape."""
    for key in SHAPE_KEYS:
        # (vocab_size= names the tokenizer's base size, already checked against the data: a model
        # grown by chat or extra tokens, here or in an earlier stage, has more rows)
        check(key not in overrides or key not in src.saved or overrides[key] == src.saved[key] or
              (key == "vocab_size" and overrides[key] == base_vocab),
              f"{key}={overrides.get(key)} but {src.where} has {key}={src.saved.get(key)}: drop the override, or "
              f"use a new out_dir")
    run_keys = {k: c[k] for k in ("block_size", "dropout", "grad_ckpt", "neftune_alpha")}
    cfg = ModelConfig(**{**src.saved, **run_keys})
    check_layout(c, world, cfg.n_layer, cfg.n_head, cfg.n_kv_head, cfg.ffn_dim, where=f" in {src.where}")
    return cfg


def load_whole_into(model, src):
    """(2) or (3) into a model built whole: every rank reads all of it."""
    if src.kind == "hf":
        import hf
        weights = hf.load_hf_llama(src.path)[1]
        if model.cfg.tie_embeddings:  # one tensor under two names
            weights.setdefault("output.weight", weights["tok_embeddings.weight"])
        model.load_state_dict(weights)
    else:
        checkpoint.load(src.path, model, no_dist=True)
