"""The guards (guard_*.py) are apart from the ideas: each function in them only refuses bad
input with one line, or reads an outside file and returns what a plain read would. So a valid
run does exactly the same without them: every guard function that returns nothing, replaced
by one that does nothing, and every one that returns a value, replaced by the plain read (or
the plain answer) it stands for, leaves its losses and checkpoints as they were."""

import ast
import hashlib
import importlib
import json
import os
import sys

import numpy as np
import torch

import checkpoint
from conftest import ROOT, TINY, module_of, project_files, read_metrics, torchrun


def guard_functions():
    """{module: {name: True if it returns a value}} of the guard functions (module level,
    public: what the ideas call; a private one is a part of those)."""
    out = {}
    for path in project_files():
        if not (os.path.basename(path).startswith("guard_") or path.startswith("guard")):
            continue
        tree = ast.parse(open(os.path.join(ROOT, path)).read())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                out.setdefault(module_of(path), {})[node.name] = any(
                    isinstance(n, (ast.Return, ast.Yield, ast.YieldFrom))
                    and getattr(n, "value", None) is not None for n in ast.walk(node))
    return out


def returns_nothing():
    """{module: [names]} of the guard functions whose body returns no value."""
    return {m: [n for n, value in fs.items() if not value]
            for m, fs in guard_functions().items() if not all(fs.values())}


def _load_json(path):
    with open(path, "rb") as f:
        return json.load(f)


def _state(path):
    return torch.load(os.path.join(path, "state.pt"), weights_only=True)


def _dcp_metadata(path):
    from torch.distributed.checkpoint import FileSystemReader
    return FileSystemReader(path).read_metadata()


def _latest(root):
    path = os.path.join(root, "latest")
    return open(path).read().strip() if os.path.isfile(path) else None


def _token_bytes(data_dir, vocab_size):
    path = os.path.join(data_dir, "token_bytes.npy")
    return np.load(path).astype(np.int64) if os.path.exists(path) else None


def _layout(c, world, *shape, **kw):  # (the run below has one stage: no layers to split)
    return world // (c["pp"] * c["tp"] * c["cp"]), None


# What each guard that returns a value stands for: the plain read of its file, or the answer a
# valid input gets ("module.name": its stand-in)
PLAIN = {
    "guards.guard_chat.read_template": lambda path: open(path, encoding="utf-8").read(),
    "guards.guard_ckpt.read_manifest": lambda path: (
        _load_json(os.path.join(path, "manifest.json"))["files"], None),
    "guards.guard_ckpt.check_meta": lambda meta, path: None,
    "guards.guard_ckpt.check_state": lambda state: None,
    "guards.guard_ckpt.read_small": lambda path: (
        _load_json(os.path.join(path, "meta.json")), _state(path), None),
    "guards.guard_ckpt.dcp_metadata": lambda path: (_dcp_metadata(path), None),
    "guards.guard_ckpt.check_file": lambda *a, **kw: None,
    "guards.guard_ckpt.verify": lambda path, mesh=None: None,
    "guards.guard_ckpt.all_finite": lambda model, collective=False: True,
    "guards.guard_ckpt.read_latest": _latest,
    "guards.guard_ckpt.read_meta": lambda path: (
        _load_json(os.path.join(path, "meta.json")), _state(path)),
    "guards.guard_ckpt.read_dcp_metadata": _dcp_metadata,
    "guards.guard_config.lora_targets": lambda c: sorted(
        {t.strip() for t in c["lora_targets"].split(",") if t.strip()}),
    "guards.guard_config.task_files": lambda eval_tasks: eval_tasks.split(",") if eval_tasks
    else [],
    "guards.guard_config.check_layout": _layout,
    "guards.guard_config.memory_bytes_available": lambda: float("inf"),
    "guards.guard_config.rope_changes": lambda saved, c: {},
    # (the run fits: the memory plan is not asked; a fresh run's shape is its config's)
    "guards.guard_config.may_not_fit": lambda c, world: False,
    "guards.guard_config.model_shape": lambda c: c,
    "guards.guard_config.rank_memory": lambda c, world: float("inf"),
    "guards.guard_data.read_meta": lambda d: _load_json(os.path.join(d, "meta.json")),
    "guards.guard_data.map_tokens": lambda path, dtype, vocab_size: np.memmap(
        path, dtype=dtype, mode="r"),
    "guards.guard_data.chat_mask": lambda path, n: np.memmap(
        path[:-len(".bin")] + ".mask.bin", dtype=np.uint8, mode="r"),
    "guards.guard_data.read_token_bytes": _token_bytes,
    "guards.guard_env.world_size": lambda: int(os.environ.get("WORLD_SIZE", "1")),
    "guards.guard_errors.flush_stdout": lambda probe=True: sys.stdout.flush() or False,
    "guards.guard_files.lora_in_range": lambda alpha, dropout: True,
    "guards.guard_files.loads_json": lambda text, where, fix: json.loads(text),
    "guards.guard_files.read_json": lambda path, fix, kind=dict, limit=None: _load_json(path),
    "guards.guard_files.json_field": lambda obj, key, *a, **kw: obj.get(key),
    "guards.guard_files.sha256_file": lambda path: hashlib.sha256(
        open(path, "rb").read()).hexdigest(),
    "guards.guard_files.lock_out_dir": lambda out_dir: os.makedirs(out_dir, exist_ok=True),
}
# guards whose value is no read and no answer a run uses: the words of an error line, whether
# this rank prints it, the docs' table, which refusals apply (all of them replaced too)
KEPT = {"guards.guard_errors.describe_error", "guards.guard_dist.reports",
        "guards.guard_config.refusals_markdown", "guards.guard_config.builds_own_model"}


def disarm_guards(rank):
    """In a rank of torchrun(before=): every guard function that returns nothing becomes one
    that does nothing, and each that returns a value its PLAIN stand-in, wherever a project
    module holds it (`from guard_errors import check`)."""
    ours = set(project_files())
    for module, functions in guard_functions().items():
        mod = importlib.import_module(module)
        for name, value in functions.items():
            if value and f"{module}.{name}" in KEPT:
                continue
            real = getattr(mod, name)
            stub = PLAIN[f"{module}.{name}"] if value else lambda *a, **kw: None
            for m in list(sys.modules.values()):
                if os.path.relpath(os.path.abspath(getattr(m, "__file__", None) or "/"),
                                   ROOT) in ours:
                    for k, v in list(vars(m).items()):
                        if v is real:
                            setattr(m, k, stub)


TIMINGS = ("dt_ms", "tok_per_s", "mfu", "elapsed_s")


def test_the_guards_return_nothing_a_valid_run_needs(dataset, tmp_path):
    guards = returns_nothing()
    # the one-line refusals and the config's whole check are among those replaced
    assert {"check", "validate"} <= {n for m, v in guards.items() for n in v
                                     if m.endswith(("guard_errors", "guard_config"))}, guards
    # every guard that returns a value has its plain stand-in (or is kept, saying why)
    valued = {f"{m}.{n}" for m, fs in guard_functions().items() for n, v in fs.items() if v}
    assert valued == set(PLAIN) | KEPT, valued ^ (set(PLAIN) | KEPT)
    args = [*TINY, f"dataset={dataset}", "max_iters=6", "ckpt_interval=3", "eval_interval=3"]
    runs = {}
    for name, before in (("guarded", None), ("bare", disarm_guards)):
        out = str(tmp_path / name)
        torchrun(1, [*args, "max_iters=3", f"out_dir={out}"], tmp_path, plain=True,
                 before=before)
        # resumed: the checkpoint read back through the guards' reads, or their stand-ins
        torchrun(1, [*args, f"out_dir={out}"], tmp_path, plain=True, before=before)
        weights = checkpoint.load_whole(checkpoint.find(out, None))[0].state_dict()
        # every number the run logs but its timings (val_bpb: the token bytes' read too)
        runs[name] = ([{k: v for k, v in r.items() if k not in TIMINGS}
                       for r in read_metrics(out)], weights)
    (losses, weights), (bare_losses, bare_weights) = runs["guarded"], runs["bare"]
    assert losses == bare_losses and len(losses) >= 8
    for k in weights:
        torch.testing.assert_close(bare_weights[k], weights[k], rtol=0, atol=0, msg=k)
