"""
The files of one of our checkpoints, read as hostile: manifest.json (it must list every
file with its size and sha256), meta.json and state.pt (each field checked: types, ranges,
the iteration that of the directory), and torch.distributed.checkpoint's .metadata (unpickled
with only the classes DCP writes for our tensors). Each reader answers (value, None) or
(None, what is wrong, in a few words): checkpoint.find skips a checkpoint that fails and
falls back to the previous intact one. Also a checkpoint verified against its manifest
(verify), its weights checked finite, and DCP's reader given the checked metadata. Nothing here
writes.
"""

import os
import pickle
import re
import stat
import warnings

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from model import MODEL_TYPES, ROPE_TYPES, ModelConfig
from parallel import all_gather_object, broadcast_object
from guards.guard_errors import UserError, describe_error
from guards.guard_files import MAX_SIZES, json_field, lora_in_range, read_json, sha256_file


CKPT_NAME = re.compile(r"iter_(\d{7,})")  # 7 digits, more from iteration 10,000,000 on


SHA256 = re.compile(r"[0-9a-f]{64}")
REQUIRED_FILES = ("meta.json", "state.pt", ".metadata")  # and DCP's __R_N.distcp data files


def read_manifest(path):
    """(files, None) or (None, what is wrong). A checkpoint is trusted only with a manifest
    that lists every file it holds, each with its size and sha256: a manifest that leaves a
    file out would leave that file unchecked."""
    try:
        files = json_field(read_json(os.path.join(path, "manifest.json"),
                                     "a save that did not finish?"), "files",
                           dict, "manifest.json", "a save that did not finish?")
    except UserError as e:
        return (None,
                f"manifest.json is missing or unreadable "
                f"({str(e).removeprefix(path + os.sep)[:200]})")
    for name, want in files.items():
        if not (isinstance(want, dict) and type(want.get("bytes")) is int and want["bytes"] >= 0
                and isinstance(want.get("sha256"), str) and SHA256.fullmatch(want["sha256"])):
            return None, f"manifest.json: the entry of {name[:80]!r} is not {{bytes, sha256}}"
    try:
        present = set(os.listdir(path)) - {"manifest.json"}
    except OSError as e:
        return None, describe_error(e)
    unlisted = sorted((present | set(REQUIRED_FILES)) - set(files))
    if unlisted:
        return None, f"manifest.json does not list {', '.join(n[:80] for n in unlisted[:3])}"
    return files, None


MAX_ITER = 10 ** 12


def check_meta(meta, path):
    """None if a checkpoint's meta.json (a dict) holds what resuming and loading use, with the
    right types and ranges, else what is wrong. The iteration must be the directory's."""
    fix = "not a checkpoint this trainer wrote"
    try:
        it = json_field(meta, "iter", int, "meta.json", fix, 0, MAX_ITER)
        m = CKPT_NAME.fullmatch(os.path.basename(os.path.normpath(path)))
        if m and int(m[1]) != it:
            return f"meta.json says iteration {it}, but the directory is {m[0]}"
        model = json_field(meta, "model", dict, "meta.json", fix)
        fields = ModelConfig.__dataclass_fields__
        if set(model) - set(fields):
            return f"meta.json: model has unknown keys {sorted(set(model) - set(fields))[:3]}"
        for key, f in fields.items():
            kind = {int: int, float: float, bool: bool, str: str}[type(f.default)]
            json_field(model, key, kind, "meta.json model", fix,
                       0 if kind in (int, float) else None,
                       MAX_SIZES.get(key),
                       required=key in ("vocab_size", "n_layer", "n_head", "n_embd"))
        if (model.get("rope_type") not in (None, *ROPE_TYPES)
                or model.get("hf_model_type") not in (None, *MODEL_TYPES)
                or (model.get("rope_low_freq") or 1.0) >= (model.get("rope_high_freq") or 4.0)):
            return ("meta.json: model has a rope_type, rope_low_freq/high_freq or hf_model_type "
                    "not implemented here")
        if (not all(model.get(k, 1) > 0
                    for k in ("vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd",
                              "block_size", "norm_eps"))
                or not all(model.get(k, 1) >= 1
                           for k in ("rope_theta", "rope_factor", "rope_original_len"))):
            return ("meta.json: a model size or norm_eps is not positive, or rope_theta, "
                    "rope_factor or rope_original_len is below 1")
        if (model.get("moe_score", "softmax") not in ("softmax", "sigmoid")
                or model.get("moe_every", 1) < 1
                or model.get("n_experts")
                and not 1 <= model.get("moe_top_k", 2) <= model["n_experts"]):
            return ("meta.json: model has a moe_score, moe_every or moe_top_k (1 to n_experts) "
                    "not implemented here")
        ModelConfig(**model)
        # the run's keys that are read back: its tokenizer (sample.py), tp and seed (a resume's
        # random streams), block_size (sample.py's), the keys a resume compares (check_same_run)
        config = json_field(meta, "config", dict, "meta.json", fix)
        json_field(config, "tokenizer", str, "meta.json config", fix)
        json_field(config, "vocab_size", int, "meta.json config", fix, 0, MAX_SIZES["vocab_size"])
        # (tp splits the heads)
        json_field(config, "tp", int, "meta.json config", fix, 1, MAX_SIZES["n_head"],
                   required=False)
        json_field(config, "seed", int, "meta.json config", fix, 0, 2 ** 32 - 1, required=False)
        json_field(config, "block_size", int, "meta.json config", fix, 1, MAX_SIZES["block_size"],
                   required=False)
        json_field(config, "rope_theta", float, "meta.json config", fix, 0, required=False)
        for key in ("dataset", "datasets", "optim", "rope_scaling", "init_from", "export_hf"):
            json_field(config, key, str, "meta.json config", fix, required=False)
        # the model's tokenizer (tokenizer.checkpoint_spec): what sample.py and a run from it read
        spec = json_field(meta, "tokenizer_spec", dict, "meta.json", fix, required=False)
        if spec is not None:
            where = "meta.json tokenizer_spec"
            json_field(spec, "tokenizer", str, where, fix)
            vocab = json_field(spec, "vocab_size", int, where, fix, 1, MAX_SIZES["vocab_size"])
            json_field(spec, "base_vocab_size", int, where, fix, 1, vocab, required=False)
            json_field(spec, "tokenizer_sha256", str, where, fix, required=False)
            for key in ("extra_tokens", "chat_tokens"):
                tokens = json_field(spec, key, list, where, fix, required=key == "extra_tokens")
                if not all(isinstance(t, str) for t in tokens or []):
                    return f"meta.json: tokenizer_spec {key} holds the wrong type"
        skip = json_field(meta, "skip_iters", list, "meta.json", fix, required=False) or []
        extra = json_field(meta, "extra_tokens", list, "meta.json", fix, required=False) or []
        if not all(type(i) is int for i in skip) or not all(isinstance(t, str) for t in extra):
            return "meta.json: skip_iters or extra_tokens holds the wrong type"
        scaler = json_field(meta, "loss_scale", dict, "meta.json", fix, required=False)
        # fp16: loss_scale.py (a float32 scale, at least its floor of 1; a count of clean steps)
        if scaler:
            json_field(scaler, "scale", float, "meta.json loss_scale", fix, 1.0, 3.4e38)
            json_field(scaler, "growth_tracker", int, "meta.json loss_scale", fix, 0, MAX_ITER)
        lora = json_field(meta, "lora", dict, "meta.json", fix, required=False)
        if lora:
            json_field(lora, "rank", int, "meta.json lora", fix, 1, MAX_SIZES["n_embd"])
            if not lora_in_range(json_field(lora, "alpha", float, "meta.json lora", fix),
                                 json_field(lora, "dropout", float, "meta.json lora", fix)):
                return "meta.json: lora alpha is not in (0, 1e6) or dropout not in [0, 1)"
            base = json_field(lora, "base", dict, "meta.json lora", fix)
            json_field(base, "path", str, "meta.json lora base", fix)
            json_field(base, "sha256", str, "meta.json lora base", fix)
            if base.get("kind") not in ("hf", "ckpt"):
                return "meta.json: lora base kind is not hf or ckpt"
            if (not isinstance(lora.get("targets"), list)
                or not all(isinstance(t, str) for t in lora["targets"])):
                return "meta.json: lora targets are not a list"
    except (UserError, ValueError) as e:
        return str(e)[:200]
    return None


def check_state(state):
    """None if a checkpoint's state.pt holds one CPU random state per saving rank (and
    optionally CUDA ones), else what is wrong."""
    if not isinstance(state, dict) or set(state) - {"rng_cpu", "rng_cuda"}:
        return "state.pt is not {rng_cpu, rng_cuda}"
    cpu_size = torch.get_rng_state().numel()
    for key, streams in state.items():
        if not isinstance(streams, list) or (key == "rng_cpu" and not streams) or not all(
                isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1
                and (key != "rng_cpu" or t.numel() == cpu_size) for t in streams):
            return f"state.pt: {key} is not a list of random states"
    return None if "rng_cpu" in state else "state.pt has no rng_cpu"


def read_small(path):
    """(meta, state, None): meta.json (iteration, config, model shape) and state.pt (RNG
    states) of a checkpoint, checked (check_meta, check_state); or (None, None, what is
    wrong). weights_only=True: a checkpoint is data, never code."""
    try:
        meta = read_json(os.path.join(path, "meta.json"), "not a checkpoint this trainer wrote")
    except UserError as e:
        return None, None, f"meta.json: {str(e)[:200]}"
    # checkpoints written before the ac key kept grad_ckpt among the model's fields: how a run
    # trained, not the model's shape (the run's config still has it), so it is not the model's
    if isinstance(meta, dict) and isinstance(meta.get("model"), dict):
        meta["model"].pop("grad_ckpt", None)
    problem = check_meta(meta, path)
    if problem:
        return None, None, problem
    try:
        with warnings.catch_warnings():  # a crafted file's pickle protocol draws a warning first
            warnings.simplefilter("ignore")
            state = torch.load(os.path.join(path, "state.pt"), map_location="cpu",
                               weights_only=True)
    except Exception as e:  # weights_only refuses any class but tensors and plain containers
        # torch's message opens with a paragraph on the weights_only default; the cause follows
        cause = re.search(r"WeightsUnpickler error:\s*([^\n]{1,160})", str(e))
        return (None, None,
                f"state.pt is not plain data "
                f"({cause[1].strip()})" if cause else f"state.pt: {describe_error(e)}")
    problem = check_state(state)
    return (None, None, problem) if problem else (meta, state, None)


# torch.distributed.checkpoint reads .metadata with plain pickle.load, which runs whatever a
# crafted file asks for. We unpickle it ourselves with only the classes a Metadata of our
# checkpoints is made of (listed from real ones, with and without FSDP shards) and hand DCP
# the result. BytesStorageMetadata is left out on purpose: DCP reads such entries with
# torch.load(weights_only=False), and our checkpoints hold tensors only.
_METADATA_CLASSES = {("torch.distributed.checkpoint.metadata", n) for n in (
    "Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
    "MetadataIndex",
    "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # torch.strided, by its name
    ("pathlib", "PosixPath")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _METADATA_CLASSES or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}")


def dcp_metadata(path):
    """(DCP's Metadata of the checkpoint, None), or (None, what is wrong)."""
    try:
        with open(os.path.join(path, ".metadata"), "rb") as f:
            md = _MetadataUnpickler(f).load()
    except Exception as e:  # anything a damaged or crafted pickle raises
        return None, (f".metadata is refused ({describe_error(e)}): not a checkpoint index this "
                      f"trainer writes, and unpickling it as DCP does could run code")
    if not (isinstance(md, Metadata) and isinstance(md.state_dict_metadata, dict)
            and isinstance(md.storage_data, dict)):
        return None, ".metadata is refused (not a DCP Metadata)"
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            return None, f".metadata is refused (entry {str(key)[:80]!r} is not a tensor)"
    for info in md.storage_data.values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or os.path.basename(rel) != rel or rel in ("", ".", ".."):
            return (None,
                    f".metadata is refused (data at {str(rel)[:80]!r}, outside the checkpoint)")
    return md, None


def check_file(path, name, want, checksum=True):
    p = os.path.join(path, name)
    if os.path.basename(name) != name or name in ("", ".", "..") or not os.path.isfile(p):
        return f"{name[:80]} is missing"
    if os.path.islink(p):
        return f"{name} is a symbolic link, not a file of the checkpoint"
    if os.path.getsize(p) != want["bytes"]:
        return (f"{name} has {os.path.getsize(p)} bytes, the manifest says {want['bytes']} "
                f"(truncated?)")
    if checksum and sha256_file(p) != want.get("sha256"):
        return f"{name} does not match its checksum (corrupted)"
    return None


def _check_contents(path):
    """None if meta.json, state.pt and .metadata load safely, else what is wrong. A manifest
    proves only that the files are those that were written; a crafted checkpoint comes with
    a matching one."""
    problem = read_small(path)[2]
    return problem or dcp_metadata(path)[1]


def verify(path, mesh=None):
    """None if every file the manifest lists is there with its size and checksum and the
    small files load safely, else what is wrong, in a few words. With a mesh of several
    ranks every rank hashes its share of the files (a large checkpoint is too much for one
    rank while the others wait in a collective); all ranks get the same answer."""
    world, rank = (mesh.world, mesh.rank) if mesh is not None and mesh.backend else (1, 0)
    files, problem = read_manifest(path) if rank == 0 else (None, None)
    if world > 1:
        files, problem = broadcast_object((files, problem), mesh)
    if problem:
        return problem
    names = sorted(files)
    problems = [check_file(path, n, files[n]) for n in names[rank::world]]
    if rank == 0 and not any(problems):
        problems.append(_check_contents(path))
    problems = [p for p in problems if p]
    if world > 1:
        problems = [p for ps in all_gather_object(problems, mesh) for p in ps]
    return problems[0] if problems else None


def all_finite(model, collective=False):
    """True on every rank iff every weight of the model, on every rank (collective: all
    ranks of the default group call it), is finite. A NaN guard that rolls back must find
    finite weights there: saves and loads check."""
    bad = torch.tensor(float(sum(int(not torch.isfinite(p.to_local() if hasattr(p, "to_local")
                                                        else p).all())
                                 for p in model.parameters())))
    if collective:
        bad = bad.cuda() if dist.get_backend() == "nccl" else bad
        dist.all_reduce(bad)
    return bad.item() == 0


def read_latest(root):
    """The name root/latest holds, or None when it holds no readable name (absent, a FIFO or
    directory someone put there, not UTF-8): like a name of no checkpoint, find passes it by."""
    try:  # (opened without blocking: a FIFO is refused, not waited on)
        with os.fdopen(os.open(os.path.join(root, "latest"), os.O_RDONLY | os.O_NONBLOCK),
                       "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None
            return f.read(4096).decode("utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None


def check_finite(tensors, path, fix):
    """Each of {name: tensor} (read from the file `path`) holds finite values only: a NaN read
    in would train on NaN, and the run would blame its data."""
    for name, t in tensors.items():
        if not torch.isfinite(t).all():
            raise UserError(f"{path}: tensor '{name}' holds non-finite values (NaN or inf): {fix}")


def read_meta(path):
    """meta.json and state.pt of a checkpoint (see read_small); a UserError naming the file
    if either is unreadable or not plain data."""
    meta, state, problem = read_small(path)
    if problem:
        raise UserError(f"checkpoint {path} is unreadable ({problem}): point ckpt/latest at an "
                        f"intact checkpoint, or use init_from=scratch")
    return meta, state


def read_dcp_metadata(path):
    """DCP's Metadata of a checkpoint, read without running code; a UserError naming the file
    if it holds anything but what DCP writes for our tensors."""
    md, problem = dcp_metadata(path)
    if problem:
        raise UserError(f"{os.path.join(path, problem)}; point ckpt/latest at an intact "
                        f"checkpoint, or use init_from=scratch")
    return md


class _SafeReader(FileSystemReader):
    """DCP's file reader, given the Metadata read_dcp_metadata read (instead of pickle.load)."""

    def __init__(self, path, metadata):
        super().__init__(path)
        self.metadata = metadata

    def read_metadata(self, *args, **kwargs):
        if getattr(self.metadata, "storage_meta", None) is None:
            self.metadata.storage_meta = StorageMeta()
        # what FileSystemReader.read_metadata sets
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata
