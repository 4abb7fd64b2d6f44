"""The hostile-input table: crafted files and arguments, each numbered by the case of issue 27
it covers (1 segfault, 2 symlinks, 3 manifest, 4 non-finite, 5 Hugging Face types, 6 malformed
small files, 7 data, 8 tracebacks, 9 accepted silently, 10 faults). Every case must end in one
`error:` line (a UserError of one line, in process; a non-zero exit with one error line and no
traceback, for the few that need the whole program), or, for checkpoint damage, in find()
falling back to the previous intact checkpoint with one warning naming why; nothing outside
out_dir changes. One tiny base run is shared; most cases run in this process."""

import contextlib
import json
import math
import os
import re
import shutil
import signal
import socket
from dataclasses import asdict

import numpy as np
import pytest
import torch
from conftest import validate_as_train, CFG, ROOT, RUN, TINY, free_port, run_train

import checkpoint
import configurator
import data
import evals
import origin
import parallel
import plot
import prepare
import rundir
import sample
from formats import hf
from formats import hf_safetensors
from formats import hf_tokenizer
from guards import guard_ckpt
from guards import guard_config
from guards import guard_data
from guards import guard_dist
from guards import guard_env
from guards import guard_files
from techniques import lora
from techniques import mixture
import tokenizer as tokenizer_py
from model import ModelConfig, Transformer
from optim import AdamW
from guards.guard_errors import UserError
from guards.guard_files import check_exports


@pytest.fixture(scope="module")
def base(dataset, tmp_path_factory):
    """A tiny run with checkpoints at iterations 2 and 4,
    a tiny HF directory and a PEFT adapter."""
    root = tmp_path_factory.mktemp("hostile")
    out = str(root / "run")
    run_train([*TINY, f"dataset={dataset}", f"out_dir={out}", "max_iters=4", "ckpt_interval=2",
               "keep_ckpts=0", "eval_interval=100"], cwd=str(root))
    cfg = ModelConfig(vocab_size=512, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
    torch.manual_seed(0)
    model = Transformer(cfg)
    hf.save_hf(str(root / "hf"), model.state_dict(), cfg)
    lora.apply_lora(model, 4, 8.0, 0.0, ["wq", "wv"], seed=0)
    lora.save_peft_lora(str(root / "adapter"), model, {"rank": 4, "alpha": 8.0, "dropout": 0.0,
                                                       "targets": ["wq", "wv"], "base": {}})
    defaults = configurator.script_defaults(os.path.join(ROOT, "train.py"))
    return {"root": str(root), "run": out, "data": dataset, "defaults": defaults,
            "hf": str(root / "hf"), "adapter": str(root / "adapter")}


def copy(src, dst):
    shutil.copytree(src, dst, symlinks=True)
    return dst


def edit_json(path, change):
    with open(path) as f:
        obj = json.load(f)
    obj = change(obj)
    with open(path, "w") as f:
        f.write(obj if isinstance(obj, str) else json.dumps(obj))


def rehash(ckpt):
    """Rewrites the manifest so that checksums alone would accept the crafted files."""
    os.remove(os.path.join(ckpt, "manifest.json"))
    checkpoint._write_manifest(ckpt)


# ---- the cases: (issue case, name, kind, make(base, tmp) -> what to check) -----------------
# kinds: "raises": make returns a callable that must raise a one-line UserError;
# "fallback": make returns a run directory whose newest checkpoint find() must skip;
# "run": make returns (script, args, out_dir): a whole program that must refuse;
# "holds": make returns a callable that must return True (the input is handled soundly).


def bad_dataset(field, value, split=None, content=None):
    def make(b, tmp):
        d = copy(b["data"], os.path.join(tmp, "ds"))
        edit_json(os.path.join(d, "meta.json"), lambda m: {**m, field: value} if field else m)
        if split:
            with open(os.path.join(d, f"{split}.bin"), "wb") as f:
                f.write(content)
        return lambda: data.Loader(d, split or "train", 32, 4, 2, 0)
    return make


def validated(**changes):
    def make(b, tmp):
        return lambda: validate_as_train({**b["defaults"], **changes}, changes, 1)
    return make


def validated_at(world, **changes):
    def make(b, tmp):
        return lambda: validate_as_train({**b["defaults"], **changes}, changes, world)
    return make


def validated_fresh(world, **changes):
    """validate as a new run does: init_from=auto and an out_dir with no checkpoint, so the
    model is the config's shape."""
    def make(b, tmp):
        given = {**changes, "out_dir": os.path.join(tmp, "out")}
        return lambda: validate_as_train({**b["defaults"], **given}, given, world)
    return make


def from_dense_run(world, model=None, **changes):
    """The shape check of a run that starts from the base run's (dense) checkpoint; model: its
    meta.json's model fields changed so (a checkpoint of another shape)."""
    def make(b, tmp):
        ckpt = os.path.join(b["run"], "ckpt", "iter_0000004")
        meta = guard_ckpt.read_meta(ckpt)[0]
        saved = {**meta["model"], **(model or {})}
        src = origin.Source("run", ckpt, meta, saved=saved, where=f"the checkpoint {ckpt}")
        c = {**b["defaults"], "init_from": b["run"], "dataset": b["data"], **changes}
        return lambda: origin.saved_shape(src, changes, 512, c, world)
    return make


def exports_of(out_dir, **exports):
    """The export checks of a run in tmp/out_dir exporting to tmp/<path> for each key=path; True
    when they pass."""
    def make(b, tmp):
        return lambda: check_exports({k: os.path.join(tmp, v) for k, v in exports.items()},
                                     runs=[os.path.join(tmp, out_dir)]) is None
    return make


def lora_on_experts(b, tmp):
    """LoRA settings for a MoE base with lora_targets naming the feed-forward (w1)."""
    src = origin.Source("hf", b["hf"], saved={"n_experts": 4}, where=f"the model in {b['hf']}")
    given = {"lora_rank": 4, "lora_targets": "wq,w1"}
    c = {**b["defaults"], **given, "init_from": b["hf"]}
    return lambda: lora.settings(c, given, src)


def moe_export(bias=0.0, **changes):
    """export_hf of a tiny MoE model (sample.py's export of a checkpoint), its routing bias
    moved by `bias`."""
    def make(b, tmp):
        cfg = ModelConfig(vocab_size=512, block_size=32, n_layer=2, n_head=4, n_kv_head=2,
                          n_embd=32, n_experts=4, **changes)
        model = Transformer(cfg)
        model.layers["1"].feed_forward.expert_bias[0] = bias
        return lambda: hf.save_hf(os.path.join(tmp, "export"), model.state_dict(), cfg)
    return make


def moe_meta_on_dense_tensors(b, tmp):
    """The run's checkpoint whose meta.json says 4 experts a layer: its tensors have none."""
    out = damaged("meta.json",
                  in_place(lambda m: {**m, "model": {**m["model"], "n_experts": 4}}))(b, tmp)
    return lambda: checkpoint.load_whole(os.path.join(out, "ckpt", "iter_0000004"))


def hf_config(**changes):
    def make(b, tmp):
        d = copy(b["hf"], os.path.join(tmp, "hf"))
        edit_json(os.path.join(d, "config.json"), lambda c: {**c, **changes})
        return lambda: hf.hf_index(d)
    return make


def hf_shape_error_in_its_names(b, tmp):
    """A config.json whose heads do not divide its width: the line names config.json's keys."""
    d = copy(b["hf"], os.path.join(tmp, "hf"))
    edit_json(os.path.join(d, "config.json"),
              lambda c: {**{k: v for k, v in c.items() if k != "head_dim"},
                         "num_attention_heads": 7})

    def load():
        return hf.hf_index(d)

    def names():
        with pytest.raises(UserError) as e:
            load()
        return "num_attention_heads=7" in str(e.value) and "hidden_size=" in str(e.value) and \
            not re.search(r"\bn_(embd|head)\b", str(e.value))
    return names


def hf_config_raw(text):
    def make(b, tmp):
        d = copy(b["hf"], os.path.join(tmp, "hf"))
        edit_json(os.path.join(d, "config.json"), lambda c: text)
        return lambda: hf.hf_index(d)
    return make


def hf_weight_map(target):
    def make(b, tmp):
        d = copy(b["hf"], os.path.join(tmp, "hf"))
        names = list(
            hf_safetensors.read_safetensors_header(os.path.join(d, "model.safetensors"))[1])
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            json.dump({"weight_map": {n: target for n in names}}, f)
        return lambda: hf.hf_index(d)
    return make


def hf_relabelled(b, tmp):
    """A tensor of model.safetensors whose header says I32 where it wrote F32 (same byte count)."""
    d = copy(b["hf"], os.path.join(tmp, "hf"))
    with open(os.path.join(d, "model.safetensors"), "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        header = f.read(n)
        f.seek(8)
        f.write(header.replace(b'"F32"', b'"I32"', 1))
    return lambda: hf.hf_index(d)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def adapter(**changes):
    def make(b, tmp):
        d = copy(b["adapter"], os.path.join(tmp, "adapter"))
        edit_json(os.path.join(d, "adapter_config.json"),
                  lambda c: {**c, **changes} if changes else
                  '{"peft_type": "LORA", "r": 4, "lora_alpha": NaN}')
        return lambda: lora.load_peft_lora(d)
    return make


def damaged(file, change):
    """The run's newest checkpoint (iteration 4) with `file` changed by change(path); the
    manifest recomputed unless the change is to the manifest itself."""
    def make(b, tmp):
        out = copy(b["run"], os.path.join(tmp, "run"))
        ckpt = os.path.join(out, "ckpt", "iter_0000004")
        change(os.path.join(ckpt, file))
        if file != "manifest.json":
            rehash(ckpt)
        return out
    return make


def distcp_ff_and_empty_manifest(path):
    ckpt = os.path.dirname(path)
    name = next(n for n in os.listdir(ckpt) if n.endswith(".distcp"))
    with open(os.path.join(ckpt, name), "r+b") as f:
        f.seek(64)
        f.write(b"\xff" * 64)
    with open(path, "w") as f:
        json.dump({"files": {}}, f)


def write(text):
    def change(path):
        with open(path, "w") as f:
            f.write(text)
    return change


def in_place(change):
    return lambda path: edit_json(path, change)


def torch_save(obj):
    return lambda path: torch.save(obj, path)


def nan_weights(b, tmp):
    mesh = parallel.setup("cpu")
    model = Transformer(
        ModelConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_kv_head=2, n_embd=16))
    opt = AdamW(model.parameters())
    with torch.no_grad():
        model.norm.weight.fill_(math.nan)
    meta = {"iter": 1, "model": asdict(model.cfg),
            "config": {"tokenizer": "cl100k_base", "vocab_size": 64}}
    return lambda: checkpoint.save(os.path.join(tmp, "nan"), 1, model, opt,
                                   {"rng_cpu": [torch.get_rng_state()]}, meta, mesh, 0)


def eval_nan_weights(b, tmp):
    """sample.py eval=True on a Hugging Face model of NaN weights (it printed nan, exit 0)."""
    cfg = ModelConfig(vocab_size=512, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
    weights = {k: torch.full_like(v, math.nan) for k, v in Transformer(cfg).state_dict().items()}
    path, src = os.path.join(tmp, "out", "nan_hf"), os.path.join(tmp, "out", "src")
    hf.save_hf(path, weights, cfg, tokenizer_py.get_tokenizer("cl100k_base", 512))
    os.makedirs(src)
    for i in range(4):
        with open(os.path.join(src, f"{i}.txt"), "w") as f:
            f.write(f"document {i} " * 40)
    d = os.path.join(tmp, "out", "d")
    prepare.prepare(os.path.join(src, "*.txt"), d, os.path.join(path, "tokenizer.json"),
                    val_fraction=0.5, verbose=False)
    c = {"dataset": d, "init_from": path, "ckpt": "", "out_dir": "", "block_size": 32,
         "batch_size": 8, "doc_mask": False, "device": "cpu", "revision": ""}
    return lambda: sample.evaluate_checkpoint(c)


def bom_everywhere(b, tmp):
    """A file that starts with a UTF-8 BOM: one rule for a JSONL source, a task file and a
    config.json (the source was refused, the others taken)."""
    os.makedirs(os.path.join(tmp, "out"))
    src, task = os.path.join(tmp, "out", "c.jsonl"), os.path.join(tmp, "out", "t.jsonl")
    with open(src, "w", encoding="utf-8-sig") as f:
        f.write("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(4)))
    with open(task, "w", encoding="utf-8-sig") as f:
        f.write('{"context": "Q", "choices": [" a", " b"], "answer": 0}\n')
    d = copy(b["hf"], os.path.join(tmp, "out", "hf"))
    with open(os.path.join(d, "config.json"), "rb") as f:
        raw = f.read()
    with open(os.path.join(d, "config.json"), "wb") as f:
        f.write(b"\xef\xbb\xbf" + raw)

    def call():
        meta = prep(src, tmp)
        evals.Task(task, tokenizer_py.get_tokenizer("cl100k_base", 512), 32)
        hf.hf_index(d)
        return meta["train_docs"] + meta["val_docs"] == 4
    return call


def cp_by_dp(b, tmp):
    """cp=2 on 4 ranks with grad_accum_steps=2 (dp=2: a dp counted without cp, 4, refused it):
    validation takes it, check_layout returns dp=2, and the default grad_accum_steps (2) is kept
    for that layout, not raised to 4."""
    def call():
        given = {"cp": 2, "grad_accum_steps": 2, "out_dir": os.path.join(tmp, "out")}
        c = validate_as_train({**b["defaults"], **given}, given, 4)
        dp, _ = guard_config.check_layout(c, 4, 4, 4, 2, 512)
        kept = configurator.batch_for_layout({**b["defaults"], "cp": 2}, {"cp": 2}, 4)
        return c["grad_accum_steps"] == 2 and dp == 2 and kept == 2
    return call


def train_on_nan_base(b, tmp):
    """train.py from a Hugging Face model of NaN weights: refused as it loads, naming the model
    (it was refused after iteration 0, the line blaming training)."""
    call = eval_nan_weights(b, tmp)  # (the NaN model and its dataset, in tmp/out)
    del call
    path, d = os.path.join(tmp, "out", "nan_hf"), os.path.join(tmp, "out", "d")

    def run():
        p = run_train([*RUN, f"init_from={path}", f"dataset={d}", "max_iters=1",
                       f"out_dir={os.path.join(tmp, 'out', 'run')}"], tmp, check=False, fork=True)
        errors = [line for line in (p.stdout + p.stderr).splitlines() if line.startswith("error:")]
        return (p.returncode != 0 and "Traceback" not in p.stderr and len(errors) == 1
                and f"{path} holds non-finite weights" in errors[0]), p.stderr[-2000:]
    return lambda: run()[0]


def plot_args(*args, tokens=None):
    """plot.py's main on the base run (its metrics.jsonl copied, with `tokens` on each record
    when given) with these arguments; RUN in an argument is that run directory."""
    def make(b, tmp):
        run = b["run"]
        if tokens is not None:
            run = os.path.join(tmp, "out", "run")
            os.makedirs(run)
            with open(os.path.join(b["run"], "metrics.jsonl")) as src, \
                    open(os.path.join(run, "metrics.jsonl"), "w") as dst:
                dst.writelines(json.dumps({**json.loads(line), "tokens": tokens}) + "\n"
                               for line in src)
        return lambda: plot.main([run, *(a.replace("RUN", run).replace("TMP", tmp) for a in args)])
    return make


def plot_writes_exactly_the_path(b, tmp):
    """--out NAME.png is written whole, at that name, and nothing beside it."""
    out = os.path.join(tmp, "out")
    os.makedirs(out)

    def call():
        plot.main([b["run"], "--out", os.path.join(out, "c.png")])
        with open(os.path.join(out, "c.png"), "rb") as f:
            return os.listdir(out) == ["c.png"] and f.read(4) == b"\x89PNG"
    return call


@contextlib.contextmanager
def environ(**env):
    """os.environ with `env` set (None: unset), restored after."""
    saved = {k: os.environ.get(k) for k in env}
    try:
        for k, v in env.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


TORCHRUN_VARS = dict.fromkeys(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                               "TORCHELASTIC_USE_AGENT_STORE"))


def torchrun_env(**env):
    """train.py's checks of torchrun's variables (guard_env), with only `env` of them set."""
    def make(b, tmp):
        def call():
            with environ(**{**TORCHRUN_VARS, **env}):
                guard_env.world_size()
                guard_env.wait_for_master(1)
        return call
    return make


def a_ranks_own_environment_is_reported(b, tmp):
    """Before the process group only rank 0 prints an error (all meet the same config), but
    rank 1 started by hand without MASTER_* printed nothing: its own environment is its line."""
    def call():
        with environ(**{**TORCHRUN_VARS, "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}):
            try:
                guard_env.world_size()
            except UserError as e:
                return guard_dist.reports(e, e.__traceback__) is True
        return False
    return call


def trace_a_file(b, tmp):
    out = os.path.join(tmp, "run")
    os.makedirs(out)
    with open(os.path.join(out, "trace"), "w") as f:
        f.write("not a directory")
    return validated(profile_iters="1:2", max_iters=4, out_dir=out)(b, tmp)


def linked_outside(kind, name, load):
    """A copy of the base's `kind` directory (hf, adapter) whose `name` is a link to a file
    outside it, read by load(directory)."""
    def make(b, tmp):
        d = copy(b[kind], os.path.join(tmp, kind))
        os.replace(os.path.join(d, name), os.path.join(tmp, "elsewhere"))
        os.symlink(os.path.join(tmp, "elsewhere"), os.path.join(d, name))
        return lambda: load(d)
    return make


def hf_file_outside(name):
    """A Hugging Face directory whose `name` is a link to a file outside it."""
    return linked_outside("hf", name, hf.hf_index)


def hf_cache_links_load(b, tmp):
    """transformers' cache: models--org--name/snapshots/<rev>/file -> ../../blobs/<hash>."""
    repo = os.path.join(tmp, "out", "hub", "models--org--tiny")
    snap = os.path.join(repo, "snapshots", "abc123")
    os.makedirs(os.path.join(repo, "blobs"))
    os.makedirs(snap)
    for i, name in enumerate(os.listdir(b["hf"])):
        shutil.copy(os.path.join(b["hf"], name), os.path.join(repo, "blobs", f"hash{i}"))
        os.symlink(f"../../blobs/hash{i}", os.path.join(snap, name))
    return lambda: hf.hf_index(snap)[0] == hf.hf_index(b["hf"])[0]


def local_dir_links(blob_name, repo="models--org--tiny"):
    """`huggingface-cli download --local-dir` (huggingface_hub before 0.23): each file a link to
    a blob of the cache, models--org--name/blobs/<digest>, read as the directory of real files."""
    def make(b, tmp):
        blobs = os.path.join(tmp, "out", "hub", repo, "blobs")
        local = os.path.join(tmp, "out", "m")
        os.makedirs(blobs)
        os.makedirs(local)
        for i, name in enumerate(sorted(os.listdir(b["hf"]))):
            shutil.copy(os.path.join(b["hf"], name), os.path.join(blobs, blob_name(i)))
            os.symlink(os.path.join(blobs, blob_name(i)), os.path.join(local, name))
        return lambda: hf.hf_index(local)[0] == hf.hf_index(b["hf"])[0]
    return make


def adapter_file_outside(name):
    """A PEFT adapter directory whose `name` is a link to a file outside it."""
    return linked_outside("adapter", name, lora.load_peft_lora)


def tokenizer_linked_outside(name):
    """A tokenizer file of a model directory that links to a valid one outside it."""
    def make(b, tmp):
        os.makedirs(os.path.join(tmp, "tok"))
        with open(os.path.join(tmp, "elsewhere"), "w") as f:
            vocab = {"a": 0, "b": 1, "ab": 2, "x": 3, "<|endoftext|>": 4}
            f.write(json.dumps({**TINY_BPE, "added_tokens": [added(4, "<|endoftext|>")],
                                "model": {**TINY_BPE["model"], "vocab": vocab}})
                    if name.endswith(".json") else "IQ== 0\nIg== 1\n")
        os.symlink(os.path.join(tmp, "elsewhere"), os.path.join(tmp, "tok", name))
        return lambda: hf_tokenizer.load(os.path.join(tmp, "tok", name))
    return make


def nan_checkpoint(b, tmp):
    """A checkpoint whose weights are all NaN, with a manifest that matches: load refuses it."""
    out = copy(b["run"], os.path.join(tmp, "run"))
    path = os.path.join(out, "ckpt", "iter_0000004")
    model, _ = checkpoint.load_whole(path)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(math.nan)
    import torch.distributed.checkpoint as dcp
    md = guard_ckpt.read_dcp_metadata(path)
    state = {"model": checkpoint.trainable_state(model)}
    opt = {k.removeprefix("optim."): torch.zeros(tuple(v.size))
           for k, v in md.state_dict_metadata.items() if k.startswith("optim.")}
    for n in os.listdir(path):
        if n.endswith(".distcp") or n == ".metadata":
            os.remove(os.path.join(path, n))
    dcp.save({**state, "optim": opt}, checkpoint_id=path, no_dist=True)
    rehash(path)
    return lambda: checkpoint.load(path, Transformer(model.cfg), no_dist=True)


def lock_with(kind, name=".lock"):
    """out_dir/name as a symlink to a file outside, a directory or a FIFO."""
    def make(b, tmp):
        out = os.path.join(tmp, "out")
        os.makedirs(out)
        target = os.path.join(tmp, "outside.txt")
        if kind == "symlink":
            os.symlink(target, os.path.join(out, name))
        elif kind == "dir":
            os.makedirs(os.path.join(out, name))
        else:
            os.mkfifo(os.path.join(out, name))
        return lambda: guard_files.lock_out_dir(out)
    return make


def full_disk(b, tmp):
    def enospc(*a, **k):
        raise OSError(28, os.strerror(28))

    def call():
        real = os.open
        os.open = enospc
        try:
            rundir.append_metrics(os.path.join(tmp, "metrics.jsonl"), {"iter": 0})
        finally:
            os.open = real
    return call


def full_disk_save(b, tmp):
    mesh = parallel.setup("cpu")
    model = Transformer(
        ModelConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_kv_head=2, n_embd=16))
    opt = AdamW(model.parameters())

    def call():
        real = os.fsync

        def enospc(fd):
            raise OSError(28, os.strerror(28))
        os.fsync = enospc
        try:
            checkpoint.save(os.path.join(tmp, "s"), 1, model, opt,
                            {"rng_cpu": [torch.get_rng_state()]},
                            {"iter": 1, "model": asdict(model.cfg), "config": {}}, mesh, 0)
        except UserError as e:
            assert "No space left on device" in str(e), e
            raise
        finally:
            os.fsync = real
    return call


def sample_args(*args):
    def make(b, tmp):
        return lambda: sample.main([f"out_dir={b['run']}", *args])
    return make


def sample_export_into(key, rel):
    """sample.py {key}= a path of the run it reads (a copy under tmp/out):
    the run must stay whole."""
    def make(b, tmp):
        run = copy(b["run"], os.path.join(tmp, "out", "run"))

        def call():
            before = snapshot(run, None)
            try:
                sample.main([f"out_dir={run}", f"{key}={os.path.join(run, rel)}"])
            finally:
                assert snapshot(run, None) == before, "the run was changed"
        return call
    return make


def sample_export_over(kind):
    """sample.py export= a FIFO or a link (as /dev/full, which root would replace):
    never replaced."""
    def make(b, tmp):
        os.makedirs(os.path.join(tmp, "out"))
        path = os.path.join(tmp, "out", "w.pt")
        os.mkfifo(path) if kind == "fifo" else os.symlink(os.path.join(tmp, "outside.txt"), path)
        return lambda: sample.main([f"out_dir={b['run']}", f"export={path}"])
    return make


def loop_export(key, below=""):
    def make(b, tmp):
        os.makedirs(os.path.join(tmp, "out"))
        os.symlink("loop", os.path.join(tmp, "out", "loop"))
        return validated(**{key: os.path.join(tmp, "out", "loop", below)})(b, tmp)
    return make


def in_tmp(**paths):
    """validated() with each value a path under tmp ('FILE': the harness's outside.txt)."""
    return lambda b, tmp: validated(**{k: os.path.join(tmp, v.replace("FILE", "outside.txt"))
                                       for k, v in paths.items()})(b, tmp)


def placed_in(key, kind, rel=""):
    """A copy (under tmp, outside out/: it must stay as it was) of the base's run, HF directory
    or dataset, and `key` (train.py's out_dir, prepare.py's --out, evals.py's OUT) at `rel`
    inside it; a row that holds: the call returns True."""
    def make(b, tmp):
        where = os.path.join(copy(b[kind], os.path.join(tmp, kind)), rel)
        if key == "out_dir":
            return lambda: bool(validate_as_train({**b["defaults"], key: where}, {key: where}, 1))
        if key == "--out":
            return lambda: with_argv(prepare.main, "prepare.py", "stdlib", "--out", where)
        task = os.path.join(tmp, "p.jsonl")
        with open(task, "w") as f:
            f.write(json.dumps({"goal": "g", "sol1": "a", "sol2": "b", "label": 0}) + "\n")
        return lambda: evals.convert(["piqa", task, where])
    return make


def written_twice(script):
    """sample.py export= or plot.py --out at the file the same command wrote before: replaced."""
    def make(b, tmp):
        path = os.path.join(tmp, "out", "again.pt" if script == "sample" else "again.png")
        os.makedirs(os.path.dirname(path))
        def twice():
            for _ in range(2):
                if script == "sample":
                    sample.main([f"out_dir={b['run']}", f"export={path}"])
                else:
                    plot.main([b["run"], "--out", path])
            return os.path.isfile(path)
        return twice
    return make


def with_argv(main, *argv):
    """A script's main() that reads sys.argv, as the command line `argv` runs it."""
    import sys
    saved, sys.argv = sys.argv, list(argv)
    try:
        return main()
    finally:
        sys.argv = saved


def prepare_workers(b, tmp):
    return lambda: prepare.prepare("stdlib", os.path.join(tmp, "d"), "cl100k_base", 512,
                                   workers=-3, verbose=False)


def tempered_weights_stay_finite(b, tmp):
    return lambda: bool(np.isfinite(mixture.temper([0.1, 0.9], 0.001)).all() and
                        np.isfinite(mixture.temper([1.0, 1.0], 0.001)).all())


def linked_files_prepared_once(b, tmp):
    """A glob whose files include links to others of it (Debian's common-licenses:
    GPL -> GPL-3)."""
    def call():
        src = os.path.join(tmp, "out", "src")  # (tmp/out: where a case may write)
        os.makedirs(src)
        for i in range(8):
            with open(os.path.join(src, f"doc{i}.txt"), "w") as f:
                f.write(f"text number {i} " * 50)
            os.symlink(f"doc{i}.txt", os.path.join(src, f"link{i}.txt"))
        meta = prepare.prepare(os.path.join(src, "*.txt"), os.path.join(tmp, "out", "d"),
                               "cl100k_base", 512, val_fraction=0.5, verbose=False)
        return meta["train_docs"] + meta["val_docs"] == 8
    return call


def stale_prepare_dir_is_cleaned(b, tmp):
    def call():
        stale = os.path.join(tmp, "d.tmp999999999")  # no such pid
        os.makedirs(stale)
        prepare.remove_half_prepared(os.path.join(tmp, "d"))
        return not os.path.exists(stale)
    return call


def ranks_die_with_launcher(b, tmp):
    """A child that sets the parent-death signal dies when its parent is SIGKILLed."""
    def call():
        import subprocess
        import sys
        import time
        marker = os.path.join(tmp, "alive")
        code = (f"import os, sys, time; sys.path.insert(0, {ROOT!r}); import parallel; "
                "pid = os.fork()\nif pid == 0:\n    parallel.die_with_parent()\n"
                f"    time.sleep(3)\n    open({marker!r}, 'w').close()\n    os._exit(0)\nelse:\n"
                "    print(pid, flush=True); time.sleep(30)")
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        p.stdout.readline()  # the child is forked
        p.kill()
        p.wait()
        time.sleep(4)
        return not os.path.exists(marker)
    return call


def busy_out_dir_under_torchrun(b, tmp):
    out = os.path.join(tmp, "busy")
    # this process holds it: the run's rank 0 refuses, rank 1 must stay silent
    fd = guard_files.lock_out_dir(out)
    guard_files._made.clear()
    return ("torchrun", [*TINY, f"dataset={b['data']}", f"out_dir={out}", "max_iters=2"], out, fd)


def refused_run(b, tmp):
    return ("train.py",
            [*TINY, f"dataset={os.path.join(tmp, 'missing')}",
             f"out_dir={os.path.join(tmp, 'new')}"],
            os.path.join(tmp, "new"), None)


def symlinked_lock_run(b, tmp):
    out = os.path.join(tmp, "out")
    os.makedirs(out)
    os.symlink(os.path.join(tmp, "outside.txt"), os.path.join(out, ".lock"))
    return ("train.py", [*TINY, f"dataset={b['data']}", f"out_dir={out}", "max_iters=1"],
            out, None)


def symlinked_config_run(b, tmp):
    out = os.path.join(tmp, "out")
    os.makedirs(out)
    os.symlink(os.path.join(tmp, "outside.txt"), os.path.join(out, "config.json"))
    return ("train.py", [*TINY, f"dataset={b['data']}", f"out_dir={out}", "max_iters=1"],
            out, None)


U16 = np.array([1, 2, 3], dtype=np.int16).tobytes()
def bad_tokenizer(text, name="tokenizer.json"):
    """A Hugging Face tokenizer file of `text` (hf_tokenizer.load reads it for init_from= a
    model directory)."""
    def make(b, tmp):
        os.makedirs(os.path.join(tmp, "tok"))
        path = os.path.join(tmp, "tok", name)
        with open(path, "w") as f:
            f.write(text)
        return lambda: hf_tokenizer.load(path)
    return make


BPE = {"model": {"type": "BPE", "vocab": {}, "merges": []}, "normalizer": None}


def added(i, content):
    return {"id": i, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": True}


# a tokenizer.json that `tokenizers` reads: 3 vocabulary tokens, "<eos>" added at id 3
TINY_BPE = {**BPE,
            "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2, "<eos>": 3},
                      "merges": ["a b"]},
            "added_tokens": [added(3, "<eos>")]}


def bos_template(ids, defined=True):
    """TINY_BPE with a post-processor that puts <bos> (of `ids`; defined=False: named,
    not defined) first."""
    def side(*seqs):
        return [{"SpecialToken": {"id": "<bos>", "type_id": 0}},
                *({"Sequence": {"id": s, "type_id": 0}} for s in seqs)]
    special = {"<bos>": {"id": "<bos>", "ids": ids, "tokens": ["<bos>"]}} if defined else {}

    def make(b, tmp):
        # (the text it wraps: "x")
        model = {**TINY_BPE["model"], "vocab": {**TINY_BPE["model"]["vocab"], "x": 4}}
        load = bad_tokenizer(json.dumps({**TINY_BPE, "model": model, "post_processor": {
            "type": "TemplateProcessing", "single": side("A"), "pair": side("A", "B"),
            "special_tokens": special}}))(b, tmp)
        with open(os.path.join(tmp, "tok", "tokenizer_config.json"), "w") as f:
            json.dump({"eos_token": "<eos>"}, f)
        return load
    return make


def bad_tokenizer_config_for(tj):
    """The tokenizer.json `tj` with a tokenizer_config.json naming its <eos>."""
    def make(b, tmp):
        load = bad_tokenizer(json.dumps(tj))(b, tmp)
        with open(os.path.join(tmp, "tok", "tokenizer_config.json"), "w") as f:
            json.dump({"eos_token": "<eos>"}, f)
        return load
    return make


def bad_added_tokens(*tokens):
    return bad_tokenizer(json.dumps(
        {**TINY_BPE, "added_tokens": [added(3, "<eos>"), *(added(*t) for t in tokens)]}))


def bad_tokenizer_config(config):
    """TINY_BPE with a crafted tokenizer_config.json beside it."""
    def make(b, tmp):
        load = bad_tokenizer(json.dumps(TINY_BPE))(b, tmp)
        with open(os.path.join(tmp, "tok", "tokenizer_config.json"), "w") as f:
            json.dump({"eos_token": "<eos>", **config}, f)
        # the file alone is fine: the config is the fault
        assert (hf_tokenizer.load(os.path.join(tmp, "tok", "tokenizer.json"))
                if "bos_token" not in config and "add_bos_token" not in config else True)
        return load
    return make


def exported_tokenizer(change, text=None):
    """Our export of a 512-id cl100k_base (a byte-level file that tiktoken can twin), changed by
    change(tokenizer.json dict); loaded, and with `text` also encoded."""
    def make(b, tmp):
        tj, config = hf.hf_tokenizer(tokenizer_py.get_tokenizer("cl100k_base", 512), 64)
        change(tj)
        os.makedirs(os.path.join(tmp, "tok"))
        for name, obj in (("tokenizer.json", tj), ("tokenizer_config.json", config)):
            with open(os.path.join(tmp, "tok", name), "w") as f:
                json.dump(obj, f)
        path = os.path.join(tmp, "tok", "tokenizer.json")
        return (lambda: hf_tokenizer.load(path) if text is None
                else hf_tokenizer.load(path).encode(text))
    return make


def byte_fallback_on_byte_level(b, tmp):
    """transformers 5.17's GGUF tokenizer of SmolLM2: byte_fallback set on a byte-level BPE without
    <0xNN> tokens (every byte is a vocabulary character there, so it never fires): it encodes as
    the file without the flag does."""
    text = "naïve café, 日本語 🙂 \x00\t"
    loads = [exported_tokenizer(change, text)(b, os.path.join(tmp, name)) for name, change in (
        ("plain", lambda tj: None),
        ("flag", lambda tj: tj["model"].update(byte_fallback=True, fuse_unk=True)))]
    return lambda: loads[0]() == loads[1]() != []


def split_regex(regex):
    return lambda tj: tj["pre_tokenizer"]["pretokenizers"][0]["pattern"].update(Regex=regex)


def set_part(part, value):
    return lambda tj: tj.update({part: value})


def twin_keeps_all_text(b, tmp):
    """A Split regex that matches letters only: tiktoken would keep the matches alone, the
    `tokenizers` library keeps the spans between them too: the twin must not be used."""
    load = exported_tokenizer(split_regex("[a-z]+"))(b, tmp)
    text = "hello world, 42!\n"
    return lambda: (lambda enc: enc.twin is None and enc.decode(enc.encode(text)) == text)(load())


def naming(part, make):
    """make's case, whose one line must also name tokenizer.json and `part` (what failed)."""
    def wrapped(b, tmp):
        call = make(b, tmp)

        def named():
            try:
                call()
            except UserError as e:
                assert "tokenizer.json" in str(e) and part in str(e), str(e)
                raise
        return named
    return wrapped


def bad_extra_tokens(raw):
    """An extra-tokens file (train.py extra_tokens=,
    prepare.py --extra_tokens) of the bytes `raw`."""
    def make(b, tmp):
        path = os.path.join(tmp, "words.txt")
        with open(path, "wb") as f:
            f.write(raw)
        return lambda: tokenizer_py.load_extra_tokens(path)
    return make


def ckpt_a_file(b, tmp):
    os.makedirs(os.path.join(tmp, "out"))
    with open(os.path.join(tmp, "out", "ckpt"), "w") as f:
        f.write("not a directory")
    return lambda: guard_files.lock_out_dir(os.path.join(tmp, "out"))


def sample_unverified_ckpt(b, tmp):
    """sample.py ckpt= a checkpoint whose file no longer matches its manifest's hash."""
    run = copy(b["run"], os.path.join(tmp, "out"))
    ckpt = os.path.join(run, "ckpt", "iter_0000004")
    with open(os.path.join(ckpt, next(n for n in os.listdir(ckpt) if n.endswith(".distcp"))),
              "r+b") as f:
        f.seek(100)
        f.write(b"\xff\xfe")
    return lambda: sample.main([f"ckpt={ckpt}", f"export={os.path.join(tmp, 'out', 'w.pt')}"])


def data_asked(**asked):
    """A run that gives val_fraction= or data_source= other than the prepared data's."""
    def make(b, tmp):
        c = {"val_fraction": 0.2, "data_source": "", **asked}
        # train.py's prepared() asks this
        return lambda: guard_data.check_made_as_asked(b["data"], c, asked)
    return make


def latest_unreadable(kind):
    """ckpt/latest holding no name (not UTF-8, or a FIFO, which a read waited on forever): find
    passes it by, as a name of no checkpoint, for the newest intact one."""
    def make(b, tmp):
        run = copy(b["run"], os.path.join(tmp, "out"))
        latest = os.path.join(run, "ckpt", "latest")
        os.remove(latest)
        if kind == "fifo":
            os.mkfifo(latest)
        else:
            with open(latest, "wb") as f:
                f.write(b"\xff\xfe\n")

        def call():
            def hang(*_):  # (not a TimeoutError: that is an OSError, which find took for absent)
                raise AssertionError("find waited on ckpt/latest")
            old = signal.signal(signal.SIGALRM, hang)
            signal.alarm(30)
            try:
                return checkpoint.find(run, None) == os.path.join(run, "ckpt", "iter_0000004")
            finally:
                signal.alarm(0)
                signal.signal(signal.SIGALRM, old)
        return call
    return make


def tiny_temperature_is_greedy(b, tmp):
    """temperature=1e-40 (logits / T overflowed to inf - inf = nan): the greedy tokens."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2,
                                    n_kv_head=1, n_embd=16)).eval()
    idx = torch.randint(0, 64, (3, 4))
    greedy = model.generate(idx, 12, temperature=0)
    return lambda: all(torch.equal(model.generate(idx, 12, 1e-40, top_k), greedy)
                       for top_k in (None, 5))


def wandb_without_login(b, tmp):
    """wandb.init failing as it does with no API key (no network here, so a stand-in)."""
    import wandb

    def init(**kwargs):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    def call():
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(wandb, "init", init)
            rundir.start_wandb({}, os.path.join(tmp, "out"), "trainer", "", None)
    return call


def task_choice_without_tokens(b, tmp):
    """A choice that joins the context's last token ("in" + "g" is one token of this
    vocabulary): no tokens of its own, it scored log-likelihood 0 and always won."""
    path = os.path.join(tmp, "zt.jsonl")
    with open(path, "w") as f:
        f.write('{"context": "x", "choices": [" a", " b"], "answer": 0}\n\n'
                '{"context": "in", "choices": [" y", "g"], "answer": 0}\n')
    return lambda: evals.Task(path, tokenizer_py.get_tokenizer("cl100k_base", 512), 32)


def hellaswag_marks_in_one_pass(b, tmp):
    """_hellaswag_text's marks taken out as re.sub(r"\\[.*?\\]", "", ...) does, line by line
    (the regex took quadratic time on '[' * 200000), then a record of such a line converted."""
    tricky = ["", "[", "]", "[]", "a[b]c", "[a[b]c]d", "[[x]]", "a[b\nc]d", "[\n[x]\n]",
              "[a\n[b]", "x[\r]y", "[ [title] ]", "[[[\n]]]", "a]b[c", "[a][b][", "\n\n[]\n",
              " Cake [title] Mix it. [step] Bake [it\n]. "]
    src, out = os.path.join(tmp, "hs.jsonl"), os.path.join(tmp, "out", "tasks.jsonl")
    with open(src, "w") as f:
        f.write(json.dumps({"activity_label": "a", "ctx_a": "[" * 200000, "ctx_b": "x",
                            "endings": ["a", "b"], "label": "0"}) + "\n")
    os.makedirs(os.path.dirname(out))

    def call():
        for t in tricky:
            assert all(evals._unbracketed(line) == re.sub(r"\[.*?\]", "", line)
                       for line in t.split("\n")), repr(t)
            # (lm-evaluation-harness's preprocess, whole)
            assert evals._hellaswag_text(t) == re.sub(
                r"\[.*?\]", "", t.strip().replace(" [title]", ". ")).replace("  ", " "), repr(t)
        evals.convert(["hellaswag", src, out])
        with open(out) as f:
            return json.loads(f.read())["context"] == "a: " + "[" * 200000 + " X "
    return call


# ---- round seven: files that grow, block or lie ----


def bounded(call, seconds=60):
    """call(), ended by a TimeoutError after `seconds`: a read that blocks (a FIFO) fails its
    case instead of hanging the suite."""
    def run():
        def stop(*_):
            raise TimeoutError(f"still blocked after {seconds} s")
        old = signal.signal(signal.SIGALRM, stop)
        signal.alarm(seconds)
        try:
            return call()
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
    return run


def base_with(name, kind):
    """lora.base_reference of a copy of the base's Hugging Face directory with `name` a regular
    file of junk, a FIFO or a link to /dev/zero: True when it equals the untouched directory's
    (a stray file beside the weights is none of the base)."""
    def make(b, tmp):
        d = copy(b["hf"], os.path.join(tmp, "hf"))
        path = os.path.join(d, name)
        if os.path.exists(path):
            os.remove(path)
        if kind == "file":
            with open(path, "wb") as f:
                f.write(b"junk")
        else:
            os.mkfifo(path) if kind == "fifo" else os.symlink("/dev/zero", path)
        clean = lora.base_reference(b["hf"])["sha256"]
        return bounded(lambda: lora.base_reference(d)["sha256"] == clean)
    return make


def text_files(src, n, words):
    """Directory `src` made with n small text files, 0.txt ... (n-1).txt; returns it."""
    os.makedirs(src)
    for i in range(n):
        with open(os.path.join(src, f"{i}.txt"), "w") as f:
            f.write(f"document {i} " * words)
    return src


def prepare_beside(kind):
    """prepare.py of a directory of good .txt files and a .txt that is a FIFO or a link to a
    device (/dev/null; /dev/zero read whole would fill the memory)."""
    def make(b, tmp):
        src = text_files(os.path.join(tmp, "src"), 4, 50)
        bad = os.path.join(src, "b.txt")
        os.mkfifo(bad) if kind == "fifo" else os.symlink("/dev/null", bad)
        return bounded(lambda: prepare.prepare(src, os.path.join(tmp, "out", "d"), "cl100k_base",
                                               512, val_fraction=0.5, verbose=False))
    return make


def plot_sources(n):
    """plot.py of a metrics.jsonl of one record with n mixture sources' losses."""
    def make(b, tmp):
        os.makedirs(os.path.join(tmp, "run"))
        os.makedirs(os.path.join(tmp, "out"))
        with open(os.path.join(tmp, "run", "metrics.jsonl"), "w") as f:
            f.write(json.dumps({"iter": 0, "tokens": 10, **{f"loss/s{i}": 1 for i in range(n)}})
                    + "\n")
        return lambda: plot.main([os.path.join(tmp, "run"), "--out",
                                  os.path.join(tmp, "out", "c.png")])
    return make


def padded(path, size):
    """The JSON file `path` grown past `size` bytes by trailing whitespace (still valid)."""
    with open(path, "a") as f:
        f.write(" " * (size + 1))


def hf_config_past(size):
    def make(b, tmp):
        d = copy(b["hf"], os.path.join(tmp, "hf"))
        padded(os.path.join(d, "config.json"), size)
        return lambda: hf.hf_index(d)
    return make


def big_tokenizer_json_loads(b, tmp):
    """A tokenizer.json past the small files' 16 MB (a 256k vocabulary's is tens of MB)."""
    load = exported_tokenizer(lambda tj: None)(b, tmp)
    padded(os.path.join(tmp, "tok", "tokenizer.json"), 16 << 20)
    return lambda: isinstance(load(), hf_tokenizer.HFTokenizer)


def big_dataset_meta_loads(b, tmp):
    """A dataset's meta.json past 16 MB (it names every source file: a million of them)."""
    d = copy(b["data"], os.path.join(tmp, "ds"))
    padded(os.path.join(d, "meta.json"), 16 << 20)
    return lambda: guard_data.read_meta(d)["vocab_size"] == 512


def nan_adapter(b, tmp):
    """The base's adapter with one NaN in a lora_B."""
    d = copy(b["adapter"], os.path.join(tmp, "adapter"))
    file = os.path.join(d, "adapter_model.safetensors")
    tensors = hf_safetensors.read_safetensors(file)
    next(t for n, t in tensors.items() if "lora_B" in n)[0, 0] = math.nan
    hf_safetensors.write_safetensors(file, tensors)
    return lambda: lora.load_peft_lora(d)


def export_modes(b, tmp):
    """An export's model.safetensors is as readable as its config.json (the safetensors library
    writes through a temp file of mode 0600)."""
    def call():
        path = os.path.join(tmp, "out", "hf")
        hf.save_hf(path, Transformer(ModelConfig(**{**CFG, "n_layer": 1})).state_dict(),
                   ModelConfig(**{**CFG, "n_layer": 1}))
        modes = {n: os.stat(os.path.join(path, n)).st_mode & 0o777 for n in os.listdir(path)}
        return modes["model.safetensors"] == modes["config.json"]
    return call


# ---- round eight: task files (surrogates, unlabeled records converted, too many choices) ----


def task_line(line):
    """A task file of one line, read as eval_tasks= reads it."""
    def make(b, tmp):
        path = os.path.join(tmp, "t.jsonl")
        with open(path, "w") as f:
            f.write(line + "\n")
        return lambda: evals.Task(path, tokenizer_py.get_tokenizer("cl100k_base", 512), 32)
    return make


def converted(kind, record):
    """evals.py KIND IN OUT of one record that converts to no question (a test split's)."""
    def make(b, tmp):
        src, out = os.path.join(tmp, "in.jsonl"), os.path.join(tmp, "out", "tasks.jsonl")
        with open(src, "w") as f:
            f.write(json.dumps(record) + "\n")
        os.makedirs(os.path.dirname(out))
        return lambda: evals.convert([kind, src, out])
    return make


# ---- round eight: a checkpoint's meta.json config and tokenizer_spec; tool_calls ----


def run_config(**changes):
    """The run's newest checkpoint, keys of its meta.json config changed."""
    return damaged("meta.json",
                   in_place(lambda m: {**m, "config": {**m["config"], **changes}}))


def run_tokenizer_spec(change):
    """The run's newest checkpoint, its meta.json tokenizer_spec changed by change(spec)."""
    return damaged("meta.json",
                   in_place(lambda m: {**m, "tokenizer_spec": change(m["tokenizer_spec"])}))


def sample_damaged(make_run):
    """sample.py ckpt= the damaged checkpoint that make_run made (loaded directly)."""
    def make(b, tmp):
        ckpt = os.path.join(make_run(b, tmp), "ckpt", "iter_0000004")
        return lambda: sample.main([f"ckpt={ckpt}", "max_new_tokens=2"])
    return make


def tool_calls_in_our_template(b, tmp):
    """prepare.py with our template (cl100k_base) of a conversation whose empty assistant
    message carries a tool call (it was dropped: the model learned an empty reply)."""
    src = os.path.join(tmp, "chat.jsonl")
    call = {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    chat = [{"role": "user", "content": "a"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "assistant", "content": "b"}]
    other = [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    with open(src, "w") as f:
        f.write("".join(json.dumps({"messages": m}) + "\n" for m in (chat, other)))
    return lambda: prepare.prepare(src, os.path.join(tmp, "out", "d"), "cl100k_base", 512,
                                   val_fraction=0.5, verbose=False)



# ---- round nine (2026-12-02, issue 71) ----


def resumed(model=None, had=None, **changes):
    """check_same_run of a command that resumes the base run (its newest checkpoint, its
    meta.json's model fields changed by `model`, its config by `had`) with config keys `changes`
    given; True when it continues."""
    def make(b, tmp):
        ckpt = os.path.join(b["run"], "ckpt", "iter_0000004")
        meta = guard_ckpt.read_meta(ckpt)[0]
        meta = {**meta, "config": {**meta["config"], **(had or {})}}
        src = origin.Source("resume", ckpt, meta, saved={**meta["model"], **(model or {})},
                            where=f"the checkpoint in {b['run']}")
        c = {**b["defaults"], **meta["config"], **changes}
        return lambda: guard_config.check_same_run(src, c, changes, b["run"]) is None
    return make


def prepare_block(block_size):
    """prepare.py --block_size N of a chat corpus (its packing note packs rows of N)."""
    def make(b, tmp):
        src = os.path.join(tmp, "chat.jsonl")
        chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
        with open(src, "w") as f:
            f.write("".join(json.dumps({"messages": chat}) + "\n" for _ in range(4)))
        return bounded(lambda: with_argv(
            prepare.main, "prepare.py", src, "--out", os.path.join(tmp, "out", "d"),
            "--val_fraction", "0.5", "--vocab_size", "512", "--block_size", str(block_size)), 20)
    return make


def lora_bounds_agree(b, tmp):
    """LoRA's alpha and dropout: what validation takes, a checkpoint's meta.json keeps and a
    PEFT adapter carries (5e-13, 0.9999995 were taken, then the run's own checkpoint refused),
    and what one refuses the others refuse (alpha 0 or 1e6, dropout 1)."""
    ckpt = os.path.join(b["run"], "ckpt", "iter_0000004")
    meta = guard_ckpt.read_meta(ckpt)[0]

    def takes(alpha, dropout):
        given = {"lora_alpha": alpha, "lora_dropout": dropout}
        ok = [True, True, True]
        try:
            validate_as_train({**b["defaults"], **given}, given, 1)
        except UserError:
            ok[0] = False
        lora_meta = {"rank": 4, "alpha": alpha, "dropout": dropout, "targets": ["wq"],
                     "base": {"kind": "hf", "path": b["hf"], "sha256": "0"}}
        ok[1] = guard_ckpt.check_meta({**meta, "lora": lora_meta}, ckpt) is None
        d = copy(b["adapter"], os.path.join(tmp, "out", f"adapter{alpha}-{dropout}"))
        edit_json(os.path.join(d, "adapter_config.json"),
                  lambda c: {**c, "lora_alpha": alpha, "lora_dropout": dropout})
        try:
            lora.load_peft_lora(d)
        except UserError:
            ok[2] = False
        return ok
    return lambda: (all(takes(a, d) == [True] * 3 for a, d in ((5e-13, 0.9999995), (1e5, 0)))
                    and all(takes(a, d) == [False] * 3 for a, d in ((0, 0), (1e6, 0), (8, 1))))


def prep(src, tmp, name="d"):
    """prepare.prepare of `src` into tmp/out/name, 512 ids, a tenth to val, quiet."""
    return prepare.prepare(src, os.path.join(tmp, "out", name), "cl100k_base", 512,
                           val_fraction=0.1, verbose=False)


def docs_of(tmp, name):
    """The documents of a prepared dataset (both splits) as sorted lists of ids."""
    d = os.path.join(tmp, "out", name)
    meta = guard_data.read_meta(d)
    ids = np.concatenate([np.fromfile(os.path.join(d, f"{s}.bin"), meta["dtype"])
                          for s in ("train", "val")]).tolist()
    docs, doc = [], []
    for i in ids:
        doc.append(i)
        if i == meta["eot_token"]:
            docs, doc = docs + [doc], []
    return sorted(docs)


def parquet_with(column, text=None):
    """A Parquet corpus of 4 documents (text: their texts, str or bytes) beside a column that
    breaks a reader (column: a pyarrow array or None); True when it prepares as the same texts
    written as JSON Lines do (invalid UTF-8: U+FFFD on both) and, for PIQA, converts."""
    def make(b, tmp):
        import pyarrow as pa
        import pyarrow.parquet as pq
        os.makedirs(os.path.join(tmp, "out"))
        texts = text or [f"document {i} " * 20 for i in range(4)]
        raw = [t if isinstance(t, bytes) else t.encode() for t in texts]
        # (from its buffers: a string array whose bytes pyarrow does not check)
        offsets = np.cumsum([0] + [len(t) for t in raw]).astype(np.int32)
        cols = {"text": pa.Array.from_buffers(pa.string(), len(raw), [
            None, pa.py_buffer(offsets.tobytes()), pa.py_buffer(b"".join(raw))])}
        when = column
        if column == "timestamp":  # 10**12 s: the year 33658
            when = cols["when"] = pa.array([10 ** 12] * 4, pa.timestamp("s"))
        src = os.path.join(tmp, "out", "c.parquet")
        pq.write_table(pa.table(cols), src)
        jsonl = os.path.join(tmp, "out", "c.jsonl")
        with open(jsonl, "wb") as f:
            for t in raw:
                f.write(b'{"text": "' + t + b'"}\n')
        piqa = os.path.join(tmp, "out", "p.parquet")
        pq.write_table(pa.table({"goal": ["g"], "sol1": ["a"], "sol2": ["b"], "label": [0],
                                 **({"when": when[:1]} if when is not None else {})}), piqa)

        def call():
            a, _ = prep(src, tmp, "a"), prep(jsonl, tmp, "b")
            same = docs_of(tmp, "a") == docs_of(tmp, "b")
            evals.convert(["piqa", piqa, os.path.join(tmp, "out", "tasks.jsonl")])
            return same and a["train_docs"] + a["val_docs"] == 4
        return call
    return make


def parquet_bomb(b, tmp):
    """A Parquet value longer than JSONL's longest line (MAX_LINE_BYTES, lowered here to 1 MB
    for the test: 300 MB from 27 kB of zstd was a MemoryError at 5.6 GB), in its second row
    group: refused naming its row, counted from 1."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    src = os.path.join(tmp, "big.parquet")
    pq.write_table(pa.table({"text": ["a", "b", "c", "x" * (2 << 20)]}), src, row_group_size=2,
                   compression="zstd")

    def call():
        saved, prepare.corpora.MAX_LINE_BYTES = prepare.corpora.MAX_LINE_BYTES, 1 << 20
        try:
            with pytest.raises(UserError, match=r"big.parquet: row 4: a text of over 1 MB"):
                prep(src, tmp)
            return prep(src, tmp)
        finally:
            prepare.corpora.MAX_LINE_BYTES = saved
    return lambda: os.makedirs(os.path.join(tmp, "out")) or call()


def corpus_dir(*names, link=None):
    """A directory of small documents, one per name: its suffix says how (.txt text; .jsonl,
    .json, .jsonl.xz, .jsonl.bz2, .JSONL JSON Lines; .parquet a Parquet file), link: 'loop' two
    links back up to it, 'hard' a hard link to the first file; prepare.py of it."""
    def make(b, tmp):
        import bz2
        import lzma
        src = os.path.join(tmp, "src")
        os.makedirs(os.path.join(src, "sub"))
        for i, name in enumerate(names):
            text = f"document {i} " * 30
            path = os.path.join(src, name)
            if name.endswith(".parquet"):
                import pyarrow as pa
                import pyarrow.parquet as pq
                pq.write_table(pa.table({"text": [text]}), path)
                continue
            raw = (text if name.endswith(".txt") else json.dumps({"text": text}) + "\n").encode()
            opener = lzma.open if name.endswith(".xz") else bz2.open if name.endswith(".bz2") \
                else open
            with opener(path, "wb") as f:
                f.write(raw)
        if link == "loop":
            os.symlink("..", os.path.join(src, "sub", "up"))
            os.symlink(".", os.path.join(src, "here"))
        if link == "hard":
            os.link(os.path.join(src, names[0]), os.path.join(src, "again" + names[0]))
        os.makedirs(os.path.join(tmp, "out"))
        return bounded(lambda: prep(src, tmp), 30)
    return make


def prepared_docs(n, make_src):
    """make_src's preparation holds n documents, each once."""
    def make(b, tmp):
        call = make_src(b, tmp)
        return lambda: (lambda m: m["train_docs"] + m["val_docs"] == n)(call())
    return make


def globbed(kind):
    """prepare.py of a glob 'src/*.txt' (or 'src/**/*.txt' through a loop of links) beside good
    files: a FIFO or a /dev/zero link, or two links back up."""
    def make(b, tmp):
        src = text_files(os.path.join(tmp, "src"), 4, 30)
        bad = os.path.join(src, "b.txt")
        if kind == "fifo":
            os.mkfifo(bad)
        elif kind == "zero":
            os.symlink("/dev/zero", bad)
        else:
            os.makedirs(os.path.join(src, "sub"))
            os.symlink("..", os.path.join(src, "sub", "up"))
            os.symlink(".", os.path.join(src, "here"))
        os.makedirs(os.path.join(tmp, "out"))
        pattern = os.path.join(src, "**" if kind == "loop" else "", "*.txt")
        return bounded(lambda: prep(pattern, tmp), 30)
    return make


def blaming(part, make):
    """make's case, whose one line must name `part` (the field at fault)."""
    def wrapped(b, tmp):
        call = make(b, tmp)

        def named():
            with pytest.raises(UserError) as e:
                call()
            assert part in str(e.value), str(e.value)
            raise e.value
        return named
    return wrapped


QWEN3_MOE = dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=16, head_dim=8)


HELLASWAG = {"activity_label": "a", "ctx_a": "x", "ctx_b": "y", "endings": ["a", "b", "c", "d"],
             "label": "1"}


def converted_over_its_input(b, tmp):
    """evals.py piqa IN IN: the benchmark file itself as OUT (it was replaced)."""
    src = os.path.join(tmp, "p.jsonl")
    with open(src, "w") as f:
        f.write(json.dumps({"goal": "g", "sol1": "a", "sol2": "b", "label": 0}) + "\n")
    return lambda: evals.convert(["piqa", src, src])


CASES = [
    (1, "dtype object", "raises", bad_dataset("dtype", "object")),
    (2, ".lock symlink", "raises", lock_with("symlink")),
    (2, "config.json symlink", "raises", lock_with("symlink", "config.json")),
    (2, "metrics.jsonl symlink", "raises", lock_with("symlink", "metrics.jsonl")),
    (2, ".lock symlink, whole run", "run", symlinked_lock_run),
    (2, "config.json symlink, whole run", "run", symlinked_config_run),
    (3, "empty manifest and 0xFF in a .distcp", "fallback",
     damaged("manifest.json", distcp_ff_and_empty_manifest)),
    (3, "manifest without sha256", "fallback", damaged("manifest.json", in_place(
        lambda m: {"files": {n: {"bytes": w["bytes"]} for n, w in m["files"].items()}}))),
    (3, "manifest leaves a file out", "fallback", damaged("manifest.json", in_place(
        lambda m: {"files": {n: w for n, w in m["files"].items() if n != "state.pt"}}))),
    (4, "learning_rate=1e999", "raises", validated(learning_rate=float("inf"))),
    (4, "phase lr_scale=1e999", "raises",
     validated(datasets="a:1,b:1", phases=[(0, {"a": 1.0}, float("inf"))])),
    (4, "rms_norm_eps=-1", "raises", hf_config(rms_norm_eps=-1)),
    (4, "rope_theta=0", "raises", hf_config(rope_theta=0)),
    (4, "rope_theta=1e-300", "raises", hf_config(rope_theta=1e-300)),
    (4, "adapter lora_alpha=NaN", "raises", adapter()),
    (4, "a save of NaN weights", "raises", nan_weights),
    (4, "a checkpoint of NaN weights", "raises", nan_checkpoint),
    (5, "tie_word_embeddings 'false'", "raises", hf_config(tie_word_embeddings="false")),
    (5, "rms_norm_eps 'abc'", "raises", hf_config(rms_norm_eps="abc")),
    (5, "rope_parameters a list", "raises", hf_config(rope_parameters=[1, 2])),
    (5, "num_hidden_layers 3000000", "raises", hf_config(num_hidden_layers=3000000)),
    (5, "weight_map ../elsewhere", "raises", hf_weight_map("../elsewhere/x.safetensors")),
    (5, "weight_map /proc/self/environ", "raises", hf_weight_map("/proc/self/environ")),
    (6, "200k-deep manifest", "fallback", damaged("manifest.json", write("[" * 200000))),
    (6, "state.pt of {}", "fallback", damaged("state.pt", torch_save({}))),
    (6, "meta.json without model", "fallback", damaged("meta.json", in_place(
        lambda m: {k: v for k, v in m.items() if k != "model"}))),
    (6, "meta.json with an extra model key", "fallback", damaged("meta.json", in_place(
        lambda m: {**m, "model": {**m["model"], "extra": 1}}))),
    (6, "meta.json iter -7", "fallback",
     damaged("meta.json", in_place(lambda m: {**m, "iter": -7}))),
    # (an OverflowError)
    (6, "meta.json rope_original_len 10**20", "fallback", damaged("meta.json", in_place(
        lambda m: {**m, "model": {**m["model"], "rope_type": "llama3",
                                  "rope_original_len": 10 ** 20}}))),
    (6, "meta.json rope_theta 1e-300", "fallback", damaged("meta.json", in_place(  # (trained NaN)
        lambda m: {**m, "model": {**m["model"], "rope_theta": 1e-300}}))),
    # (NaN rotary tables)
    (6, "meta.json rope_factor 0", "fallback", damaged("meta.json", in_place(
        lambda m: {**m, "model": {**m["model"], "rope_type": "linear", "rope_factor": 0.0}}))),
    (6, "meta.json iter 10**30", "fallback",
     damaged("meta.json", in_place(lambda m: {**m, "iter": 10 ** 30}))),
    (7, "int16 data with -1", "raises",
     bad_dataset("dtype", "int16", "train", np.full(99, -1, np.int16).tobytes())),
    (7, "empty val.bin", "raises", bad_dataset(None, None, "val", b"")),
    (7, "vocab_size '8192'", "raises", bad_dataset("vocab_size", "8192")),
    (7, "float32 data with NaN", "raises", bad_dataset("dtype", "float32", "train",
                                                       np.full(99, np.nan, np.float32).tobytes())),
    (8, "deep JSON in a dataset's meta.json", "raises",
     bad_dataset("extra", json.loads("[" * 100 + "]" * 100))),
    (8, "5000-digit integer in config.json", "raises",
     hf_config_raw('{"vocab_size": ' + "9" * 5000 + "}")),
    (8, "seed=-1", "raises", validated(seed=-1)),
    (8, "seed=2**64", "raises", validated(seed=2 ** 64)),
    (8, "device=mps on Linux", "raises", validated(device="mps")),
    (8, "pp_layers=²,2", "raises", validated(pp_layers="²,2")),
    (8, "prepare.py --workers -3", "raises", prepare_workers),
    (8, "sample.py export= into a missing directory",
     "raises", sample_args("export=/nonexistent/dir/w.pt")),
    (8, ".lock a directory", "raises", lock_with("dir")),
    (8, ".lock a FIFO", "raises", lock_with("fifo")),
    (8, "config.json a directory", "raises", lock_with("dir", "config.json")),
    (8, "config.json a FIFO", "raises", lock_with("fifo", "config.json")),
    (8, "full disk on a metrics append", "raises", full_disk),
    (8, "lora_rank=10**9", "raises", validated(lora_rank=10 ** 9)),
    (8, "vocab_size=10**10", "raises", validated(vocab_size=10 ** 10)),
    (8, "batch_size=10**8", "raises", validated(batch_size=10 ** 8)),
    (8, "n_embd=10**6", "raises", validated(n_embd=2 ** 20, n_head=2 ** 10, n_kv_head=2 ** 10)),
    (8, "eval_iters=10**7", "raises", validated(eval_iters=10 ** 7)),
    (8, "tokenizer.json: deep JSON", "raises", bad_tokenizer("[" * 100000 + "]" * 100000)),
    (8, "tokenizer.json: a 5000-digit integer", "raises",
     bad_tokenizer('{"model": ' + "9" * 5000 + "}")),
    (8, "tokenizer.json: pre_tokenizer not an object", "raises",
     bad_tokenizer(json.dumps({**BPE, "pre_tokenizer": 5}))),
    (8, "tokenizer.json: a template naming no defined token",
     "raises", bos_template([0], defined=False)),  # (a panic)
    # (written into the data)
    (8, "tokenizer.json: a template adding id 5000 of 5", "raises", bos_template([5000])),
    (8, "tokenizer.json: an added token without an id", "raises", bad_tokenizer(json.dumps(
        {**BPE, "pre_tokenizer": {"type": "ByteLevel"},
         "added_tokens": [{"content": "<x>"}, {"content": "<y>"}]}))),
    (8, "tokenizer.model: a 5000-digit rank", "raises",
     bad_tokenizer("IQ== " + "9" * 5000 + "\n", "tokenizer.model")),
    (8, "tokenizer.json: an added token with id -3", "raises", bad_added_tokens((-3, "<x>"))),
    (9, "tokenizer.json: an added token reuses another's id",
     "raises", bad_added_tokens((4, "<x>"), (4, "<y>"))),
    (9, "tokenizer.json: an added token reuses a vocabulary id",
     "raises", bad_added_tokens((2, "<x>"))),
    (9, "tokenizer.json: an added token far past the others",
     "raises", bad_added_tokens((5000, "<x>"))),
    (9, "tokenizer.json: an added token past a gap of ids",
     "raises", bad_added_tokens((9, "<x>"))),
    (9, "tokenizer_config.json: an unknown bos_token",
     "raises", bad_tokenizer_config({"bos_token": "<nope>"})),
    (9, "tokenizer_config.json: add_bos_token \"yes\"", "raises",
     bad_tokenizer_config({"add_bos_token": "yes"})),
    (8, "tokenizer.model: a rank listed twice", "raises",
     bad_tokenizer("IQ== 0\nIg== 0\n", "tokenizer.model")),
    (8, "tokenizer.model: a negative rank", "raises",
     bad_tokenizer("IQ== -1\n", "tokenizer.model")),
    (8, "extra tokens file: invalid UTF-8", "raises", bad_extra_tokens(b"ok\n\xff\xfe bad\n")),
    (8, "extra tokens file: a 1 MB line", "raises", bad_extra_tokens(b"x" * 2 ** 20 + b"\n")),
    (9, "adapter lora_alpha negative", "raises", adapter(lora_alpha=-16)),
    (9, "mix_temperature=0.001 keeps the weights finite", "holds", tempered_weights_stay_finite),
    (9, "min_lr > learning_rate", "raises", validated(min_lr=1.0)),
    (9, "sample.py temperature=-1", "raises", sample_args("temperature=-1")),
    (9, "sample.py max_new_tokens=-3", "raises", sample_args("max_new_tokens=-3")),
    (10, "ranks die with their launcher", "holds", ranks_die_with_launcher),
    (10, "stale data/NAME.tmpPID is cleaned", "holds", stale_prepare_dir_is_cleaned),
    (10, "busy out_dir under torchrun: one line", "run", busy_out_dir_under_torchrun),
    (10, "disk full on a save says so", "raises", full_disk_save),
    (10, "a refused run leaves nothing behind", "run", refused_run),
    # issue 50: round five (numbered 50)
    (50, "safetensors: an F32 tensor relabelled I32", "raises", hf_relabelled),
    (50, "original_max_position_embeddings 8192.5", "raises", hf_config(
        rope_scaling={**LLAMA3_ROPE, "original_max_position_embeddings": 8192.5})),
    (50, "original_max_position_embeddings 8192 holds", "holds", lambda b, tmp: (
        lambda load: lambda: load()[0]["rope_original_len"] == 8192)(
            hf_config(rope_scaling=LLAMA3_ROPE)(b, tmp))),
    (50, "tiktoken twin: a Split regex that does not tile the text", "holds", twin_keeps_all_text),
    (50, "tokenizer.json: byte_fallback without the <0xNN> tokens", "raises",
     bad_tokenizer_config_for(
         {**TINY_BPE,
          "model": {**TINY_BPE["model"], "vocab": {**TINY_BPE["model"]["vocab"], "x": 4},
                    "byte_fallback": True}})),
    (46, "config.json: heads that do not divide the width, in config.json's names", "holds",
     hf_shape_error_in_its_names),
    (46, "tokenizer.json: byte_fallback on a byte-level BPE (no <0xNN> needed)", "holds",
     byte_fallback_on_byte_level),
    (50, "tokenizer.json: a Split regex that backtracks", "raises",
     naming("pre_tokenizer", exported_tokenizer(split_regex("(a+)+b"), "a" * 50))),
    (50, "tokenizer.json: a Replace regex that backtracks on the text", "raises",
     naming("normalizer",
            exported_tokenizer(
                set_part("normalizer",
                         {"type": "Replace", "pattern": {"Regex": "(b+)+c"}, "content": "x"}),
                "b" * 50))),
    (50, "tokenizer.json: a Replace of an empty pattern", "raises",
     naming("normalizer",
            exported_tokenizer(
                set_part("normalizer",
                         {"type": "Replace", "pattern": {"String": ""}, "content": "x"}),
                "hello"))),
    (50, "tokenizer.json: a junk Precompiled charsmap", "raises",
     naming("normalizer", bad_tokenizer_config_for(
         {**TINY_BPE, "normalizer": {"type": "Precompiled", "precompiled_charsmap": "AAAA"}}))),
    (50, "tokenizer.json: a template whose single names $B", "raises",
     naming("post_processor",
            bad_tokenizer_config_for(
                {**TINY_BPE,
                 "post_processor": {"type": "TemplateProcessing",
                                    "single": [{"Sequence": {"id": "B", "type_id": 0}}],
                                    "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
                                    "special_tokens": {}}}))),
    (50, "tokenizer.json: continuing_subword_prefix on a byte-level file", "raises", naming(
        "continuing_subword_prefix",
        exported_tokenizer(lambda tj: tj["model"].update(continuing_subword_prefix="##")))),
    (50, "a glob holding links to its own files: each text prepared once", "holds",
     linked_files_prepared_once),
    (50, "sample.py export= the run's ckpt/latest", "raises",
     sample_export_into("export", "ckpt/latest")),
    (50, "sample.py export= the run's config.json", "raises",
     sample_export_into("export", "config.json")),
    (50, "sample.py export= the run's metrics.jsonl",
     "raises", sample_export_into("export", "metrics.jsonl")),
    (50, "sample.py export= a checkpoint's manifest.json", "raises", sample_export_into(
        "export", "ckpt/iter_0000004/manifest.json")),
    (50, "sample.py export= into the newest checkpoint", "raises", sample_export_into(
        "export", "ckpt/iter_0000004/model.pt")),
    (50, "sample.py export_hf= into the newest checkpoint", "raises", sample_export_into(
        "export_hf", "ckpt/iter_0000004/hf")),
    (50, "sample.py export= a FIFO (as /dev/full)", "raises", sample_export_over("fifo")),
    (50, "sample.py export= a symlink", "raises", sample_export_over("link")),
    (50, "sample.py export=/sys/x.pt", "raises", sample_args("export=/sys/x.pt")),
    (50, "export_hf=/sys/x", "raises", validated(export_hf="/sys/x")),
    (50, "export_lora=/sys/x", "raises", validated(export_lora="/sys/x")),
    (50, "export_lora=FILE/x", "raises", in_tmp(export_lora="FILE/x")),
    (50, "export_hf= a symlink loop", "raises", loop_export("export_hf")),
    (50, "export_lora= below a symlink loop", "raises", loop_export("export_lora", "x")),
    (50, "export_lora= export_hf= the same directory",
     "raises", in_tmp(export_hf="out/x", export_lora="out/x")),
    (50, "export_hf= the out_dir it trains into", "raises",
     in_tmp(out_dir="out/run", export_hf="out/run")),
    (50, "export_hf= inside out_dir/ckpt", "raises",
     in_tmp(out_dir="out/run", export_hf="out/run/ckpt/hf")),
    (50, "train.py /dev/zero (a config file that is a device)", "raises",
     lambda b, tmp: lambda: configurator.configure(b["defaults"], ["/dev/zero"])),
    (50, "prepare.py with no source", "run",
     lambda b, tmp: ("prepare.py", [], os.path.join(tmp, "none"), None)),
    (50, "prepare.py --vocab_size abc", "run",
     lambda b, tmp: ("prepare.py", ["stdlib", "--vocab_size", "abc"],
                     os.path.join(tmp, "none"), None)),
    # issue 41: the last leftovers (numbered 41)
    (41, "learning_rate=1e300", "raises", validated(learning_rate=1e300)),
    (41, "embed_lr_scale=1e300", "raises", validated(embed_lr_scale=1e300)),
    (41, "lora_alpha=1e300", "raises", validated(lora_alpha=1e300)),
    (41, "neftune_alpha=1e300", "raises", validated(neftune_alpha=1e300)),
    (41, "fault_nan_steps=-7: the tests' faults are no key of train.py", "raises",
     lambda b, tmp: lambda: configurator.configure(b["defaults"], ["fault_nan_steps=-7"])),
    (41, "sample_tokens=10**30", "raises", validated(sample_tokens=10 ** 30)),
    (41, "export_hf= a 5,000-character name", "raises", validated(export_hf="x" * 5000)),
    (41, "sample.py num_samples=-1", "raises", sample_args("num_samples=-1")),
    (41, "sample.py max_new_tokens=10**30", "raises", sample_args(f"max_new_tokens={10 ** 30}")),
    (41, "sample.py export= an existing directory", "raises",
     lambda b, tmp: sample_args(f"export={tmp}")(b, tmp)),
    (41, "sample.py ckpt= a checkpoint that does not verify", "raises", sample_unverified_ckpt),
    (41, "prepare.py --out /proc/self/x", "raises", lambda b, tmp: lambda: prepare.prepare(
        "stdlib", "/proc/self/x", "cl100k_base", 512, verbose=False)),
    (41, "out_dir/ckpt a regular file", "raises", ckpt_a_file),
    (41, "val_fraction= other than the prepared data's", "raises", data_asked(val_fraction=0.5)),
    (41, "data_source= other than the prepared data's",
     "raises", data_asked(data_source="elsewhere/*.txt")),
    # issue 48: mixture of experts (numbered 48)
    (48, "moe_top_k=5 of n_experts=4", "raises", validated(n_experts=4, moe_top_k=5)),
    (48, "moe_every=9 past n_layer=4", "raises", validated(n_experts=4, moe_every=9)),
    (48, "ep=2 on one data-parallel rank", "raises", validated(n_experts=4, ep=2)),
    (48, "ep=3 not dividing n_experts=4 (6 ranks)", "raises", validated_at(6, n_experts=4, ep=3)),
    (48, "ep=2 on a dense model", "raises", validated_fresh(2, ep=2, init_from="scratch")),
    (48, "ep=2 with ddp_impl=torch", "raises",
     validated_at(2, n_experts=4, ep=2, ddp_impl="torch")),
    (48, "n_experts=4 with tp=2", "raises", validated_at(2, n_experts=4, tp=2)),
    (48, "ep=2 on a new dense run (init_from=auto)", "raises", validated_fresh(2, ep=2)),
    (48, "ep=2 from a dense run's checkpoint", "raises", from_dense_run(2, ep=2)),
    (48, "moe_top_k=4 on a new dense run", "raises", validated_fresh(1, moe_top_k=4)),
    (48, "moe_aux_weight=0.1 from a dense run's checkpoint", "raises",
     from_dense_run(1, moe_aux_weight=0.1)),
    (48, "lora_targets=wq,w1 on a mixture of experts", "raises", lora_on_experts),
    (48, "export_hf= of a sigmoid router, at the start", "raises",
     validated_fresh(1, n_experts=4, moe_score="sigmoid", export_hf="exported")),
    (48, "export_hf= of a trained routing bias, at the start", "raises",
     validated_fresh(1, n_experts=4, moe_bias_rate=0.01, export_hf="exported")),
    (59, "export_hf= from a sigmoid router's checkpoint, at the start", "raises",
     from_dense_run(1, model=dict(n_experts=4, moe_score="sigmoid"), export_hf="exported")),
    (59, "export_hf= the parent of a new out_dir",
     "raises", exports_of("runs/new", export_hf="runs")),
    (59, "export_lora= inside export_hf=", "raises",
     exports_of("run", export_hf="x", export_lora="x/lora")),
    (59, "export_hf= inside export_lora=", "raises",
     exports_of("run", export_hf="x/hf", export_lora="x")),
    (59, "export_hf=runs/a beside out_dir=runs/ab and export_lora=runs/abc", "holds",
     exports_of("runs/ab", export_hf="runs/a", export_lora="runs/abc")),
    (48, "export of a sigmoid router", "raises", moe_export(moe_score="sigmoid")),
    (48, "export of a trained routing bias", "raises", moe_export(bias=0.01)),
    (48, "meta.json n_experts=4 on a dense checkpoint's tensors",
     "raises", moe_meta_on_dense_tensors),
    (48, "meta.json moe_top_k 9 of 4 experts", "fallback", damaged("meta.json", in_place(
        lambda m: {**m, "model": {**m["model"], "n_experts": 4, "moe_top_k": 9}}))),
    (48, "config.json: Mixtral num_experts_per_tok 9 of 4", "raises", hf_config(
        model_type="mixtral", num_local_experts=4, num_experts_per_tok=9)),
    # issue 59: round six (numbered 59)
    (59, "sample.py eval=True on NaN weights", "raises", eval_nan_weights),
    (59, "plot.py --out /dev/full", "raises", plot_args("--out", "/dev/full")),
    (59, "plot.py --out RUN (the run directory)", "raises", plot_args("--out", "RUN")),
    (59, "plot.py --out RUN/ckpt/latest", "raises", plot_args("--out", "RUN/ckpt/latest")),
    (59, "plot.py --out RUN/ckpt/x.png (a run's own directory)", "raises",
     plot_args("--out", "RUN/ckpt/x.png")),
    (59, "plot.py --out ''", "raises", plot_args("--out", "")),
    (59, "plot.py --out x.jsonl", "raises", plot_args("--out", "TMP/x.jsonl")),
    (59, "plot.py --out into a missing directory", "raises",
     plot_args("--out", "TMP/missing/x.png")),
    (59, "plot.py --smooth abc (an argument error)", "raises", plot_args("--smooth", "abc")),
    (59, "plot.py: tokens given as strings", "raises",
     plot_args("--out", "TMP/out/c.png", tokens="100")),
    (59, "plot.py --out NAME.png writes exactly that", "holds", plot_writes_exactly_the_path),
    (59, "config.json a link out of its model directory", "raises",
     hf_file_outside("config.json")),
    (59, "model.safetensors a link out of its model directory", "raises",
     hf_file_outside("model.safetensors")),
    (59, "Hugging Face's cache: links into blobs/ load", "holds", hf_cache_links_load),
    (71, "--local-dir: links into a cache's blobs/<digest> load", "holds",
     local_dir_links(lambda i: f"{i:064x}")),
    (71, "--local-dir: a link into blobs/ to a file named by no digest", "raises",
     local_dir_links(lambda i: f"hash{i}")),
    (71, "--local-dir: a link into a blobs/ of no models-- repository", "raises",
     local_dir_links(lambda i: f"{i:040x}", repo="org--tiny")),
    (59, "adapter_config.json a link out of its adapter directory", "raises",
     adapter_file_outside("adapter_config.json")),
    (59, "adapter_model.safetensors a link out of its adapter directory", "raises",
     adapter_file_outside("adapter_model.safetensors")),
    (59, "tokenizer.json a link out of its model directory", "raises",
     tokenizer_linked_outside("tokenizer.json")),
    (59, "tokenizer.model a link out of its model directory", "raises",
     tokenizer_linked_outside("tokenizer.model")),
    (59, "WORLD_SIZE=abc", "raises", torchrun_env(WORLD_SIZE="abc")),
    (59, "WORLD_SIZE=-2", "raises", torchrun_env(WORLD_SIZE="-2")),
    (59, "MASTER_PORT=abc", "raises", torchrun_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                                                   MASTER_ADDR="127.0.0.1", MASTER_PORT="abc")),
    (59, "RANK=1 WORLD_SIZE=2 without MASTER_*", "raises", torchrun_env(RANK="1", LOCAL_RANK="1",
                                                                        WORLD_SIZE="2")),
    (59, "RANK=2 of WORLD_SIZE=2", "raises", torchrun_env(
        RANK="2", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")),
    (59, "a master that never comes", "raises", lambda b, tmp: torchrun_env(
        RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()))(b, tmp)),
    (59, "rank 1's own environment is its line", "holds", a_ranks_own_environment_is_reported),
    (59, "out_dir/trace a file under profile_iters", "raises", trace_a_file),
    # ---- round seven (2026-11-29): where a run, a preparation and a conversion write; parser
    # depth, ckpt/latest, temperature, wandb, task files; files that grow, block or lie ----
    (64, "out_dir= a Hugging Face model directory", "raises", placed_in("out_dir", "hf")),
    (64, "out_dir= another run's checkpoint", "raises",
     placed_in("out_dir", "run", "ckpt/iter_0000004")),
    (64, "out_dir= inside another run's ckpt/", "raises", placed_in("out_dir", "run", "ckpt/x")),
    (64, "out_dir= a dataset", "raises", placed_in("out_dir", "data")),
    (64, "out_dir= a new directory inside another run", "holds",
     placed_in("out_dir", "run", "sub")),
    (64, "prepare.py --out another run's checkpoint", "raises",
     placed_in("--out", "run", "ckpt/iter_0000004")),
    (64, "prepare.py --out a run directory", "raises", placed_in("--out", "run")),
    (64, "prepare.py --out a Hugging Face model directory", "raises", placed_in("--out", "hf")),
    (64, "evals.py OUT a checkpoint's meta.json", "raises",
     placed_in("OUT", "run", "ckpt/iter_0000004/meta.json")),
    (64, "evals.py OUT a run's config.json", "raises", placed_in("OUT", "run", "config.json")),
    (64, "evals.py OUT a run's ckpt/latest", "raises", placed_in("OUT", "run", "ckpt/latest")),
    (64, "evals.py OUT a directory", "raises", placed_in("OUT", "run", "ckpt")),
    (64, "evals.py OUT in a missing directory", "raises", placed_in("OUT", "run", "no/t.jsonl")),
    (64, "sample.py export= the file it exported before", "holds", written_twice("sample")),
    (64, "plot.py --out the picture it drew before", "holds", written_twice("plot")),
    (64, "max_new_tokens= '-' * 5000 + '1' (RecursionError in ast)", "raises",
     sample_args("max_new_tokens=" + "-" * 5000 + "1")),
    (64, "max_iters= '-' * 100000 + '1' (MemoryError in ast)", "raises",
     lambda b, tmp: lambda: configurator.configure(b["defaults"],
                                                   ["max_iters=" + "-" * 100000 + "1"])),
    (64, "ckpt/latest not UTF-8", "holds", latest_unreadable("bytes")),
    (64, "ckpt/latest a FIFO", "holds", latest_unreadable("fifo")),
    (64, "temperature=1e-40 samples the greedy tokens", "holds", tiny_temperature_is_greedy),
    (64, "wandb_log=True without a wandb login", "raises", wandb_without_login),
    (64, "a task choice with no tokens after the context", "raises", task_choice_without_tokens),
    (64, "hellaswag: '[' * 200000 in a context", "holds", hellaswag_marks_in_one_pass),
    (64, "adapter_config.json target_modules [[\"q_proj\"]]", "raises",
     adapter(target_modules=[["q_proj"]])),
    (64, "a stray junk .safetensors beside the base's weights: not hashed", "holds",
     base_with("junk.safetensors", "file")),
    (64, "a FIFO .safetensors beside the base's weights: not read", "holds",
     base_with("junk.safetensors", "fifo")),
    (64, "a link to /dev/zero as .safetensors beside the base's: not read", "holds",
     base_with("junk.safetensors", "device")),
    (64, "the base's model.safetensors a FIFO: base_reference refuses", "raises",
     base_with("model.safetensors", "fifo")),
    (64, "prepare.py: a FIFO .txt in the source directory", "raises", prepare_beside("fifo")),
    (64, "prepare.py: a .txt link to /dev/null in the source directory", "raises",
     prepare_beside("device")),
    (64, "plot.py: 65 mixture sources (65 panels)", "raises", plot_sources(65)),
    (64, "config.json past 16 MB", "raises", hf_config_past(16 << 20)),
    (64, "tokenizer.json past 16 MB loads", "holds", big_tokenizer_json_loads),
    (64, "a dataset's meta.json past 16 MB loads", "holds", big_dataset_meta_loads),
    (64, "adapter_model.safetensors with a NaN in lora_B", "raises", nan_adapter),
    (64, "an export's model.safetensors reads like its config.json", "holds", export_modes),
    # ---- round eight (2026-11-29): task files (surrogates, unlabeled records, 65 choices);
    # meta.json config and tokenizer_spec; tool_calls ----
    (64, "a task choice that is a lone surrogate", "raises",
     task_line(r'{"context": "Q: x", "choices": [" \ud800", " b"], "answer": 0}')),
    (64, "a task context with a lone surrogate", "raises",
     task_line(r'{"context": "Q: \udc00", "choices": [" a", " b"], "answer": 0}')),
    (64, "a task question of 65 choices", "raises",
     task_line(json.dumps({"context": "Q", "choices": [f" {i}" for i in range(65)],
                           "answer": 0}))),
    (64, "evals.py piqa: the test split's label -1", "raises",
     converted("piqa", {"goal": "g", "sol1": "a", "sol2": "b", "label": -1})),
    (64, "evals.py hellaswag: label '7' of 4 endings", "raises",
     converted("hellaswag", {"activity_label": "a", "ctx_a": "x", "ctx_b": "y",
                             "endings": ["a", "b", "c", "d"], "label": "7"})),
    (64, "evals.py arc: a question of one choice", "raises",
     converted("arc", {"question": "q", "choices": {"text": ["a"], "label": ["A"]},
                       "answerKey": "A"})),
    (64, "meta.json config tp 0", "fallback", run_config(tp=0)),
    (64, "meta.json config tp 0.5", "fallback", run_config(tp=0.5)),
    (64, "meta.json config block_size -5", "fallback", run_config(block_size=-5)),
    (64, "meta.json config block_size 10**11", "fallback", run_config(block_size=10 ** 11)),
    (64, "meta.json config block_size 'abc'", "fallback", run_config(block_size="abc")),
    (64, "sample.py ckpt= a meta.json config block_size -5", "raises",
     sample_damaged(run_config(block_size=-5))),
    (64, "meta.json tokenizer_spec {}", "fallback", run_tokenizer_spec(lambda s: {})),
    (64, "meta.json tokenizer_spec base_vocab_size 'x'", "fallback",
     run_tokenizer_spec(lambda s: {**s, "base_vocab_size": "x"})),
    (64, "sample.py ckpt= a meta.json tokenizer_spec {}", "raises",
     sample_damaged(run_tokenizer_spec(lambda s: {}))),
    (64, "an assistant's tool_calls with our chat template", "raises",
     tool_calls_in_our_template),
    # ---- round nine (2026-12-02, issue 71): rotary changes on resume, ... ----
    (71, "resume with rope_scaling yarn:2 -> linear:4", "raises",
     resumed(dict(rope_type="yarn", rope_factor=2.0), init_from="resume",
             rope_scaling="linear:4")),
    (71, "resume with rope_scaling none -> yarn:4", "raises",
     resumed(init_from="resume", rope_scaling="yarn:4")),
    (71, "resume with rope_theta 0 -> 500000", "raises",
     resumed(init_from="resume", rope_theta=500000.0)),
    (71, "resume of yarn:2.0 given yarn:2 continues", "holds",
     resumed(dict(rope_type="yarn", rope_factor=2.0), dict(rope_scaling="yarn:2.0"),
             rope_scaling="yarn:2")),
    (71, "prepare.py --block_size -5 (a hang)", "raises", prepare_block(-5)),
    (71, "prepare.py --block_size 10**9 (7.45 GiB)", "raises", prepare_block(10 ** 9)),
    (71, "lora_alpha 5e-13, lora_dropout 0.9999995: one rule for config, checkpoint, PEFT",
     "holds", lora_bounds_agree),
    (71, "evals.py hellaswag: label 1.0", "raises",
     converted("hellaswag", {**HELLASWAG, "label": 1.0})),
    (71, "evals.py hellaswag: label true", "raises",
     converted("hellaswag", {**HELLASWAG, "label": True})),
    (71, "evals.py hellaswag: endings a string", "raises",
     converted("hellaswag", {**HELLASWAG, "endings": "abcd"})),
    (71, "evals.py hellaswag: endings a dict", "raises",
     converted("hellaswag", {**HELLASWAG, "endings": {"a": 1, "b": 2}})),
    (71, "evals.py piqa: label 0.0", "raises",
     converted("piqa", {"goal": "g", "sol1": "a", "sol2": "b", "label": 0.0})),
    (71, "evals.py arc: 4 texts and 3 labels", "raises",
     converted("arc", {"question": "q", "answerKey": "A",
                       "choices": {"text": ["a", "b", "c", "d"], "label": ["A", "B", "C"]}})),
    (71, "evals.py OUT a prepared dataset's meta.json", "raises",
     placed_in("OUT", "data", "meta.json")),
    (71, "evals.py OUT a model's config.json", "raises", placed_in("OUT", "hf", "config.json")),
    (71, "evals.py OUT its own IN", "raises", converted_over_its_input),
    (71, "eval_tasks=','", "raises", validated(eval_tasks=",")),
    (71, "eval_tasks=',,'", "raises", validated(eval_tasks=",,")),
    (71, "eval_tasks= two files of one base name", "raises",
     validated(eval_tasks="a/mc.jsonl,b/mc.jsonl")),
    (71, "Parquet: a timestamp column past year 9999 beside the text (and in PIQA)", "holds",
     parquet_with("timestamp")),
    (71, "Parquet: a text column of invalid UTF-8 reads as JSONL does (U+FFFD)", "holds",
     parquet_with(None, [b"caf\xe9 au lait " * 9, b"ok " * 20, b"\xff\xfe bad " * 9,
                         b"more " * 20])),
    (71, "Parquet: a value past 256 MB (here 1 MB) in row 4", "raises", parquet_bomb),
    (71, "a directory of .txt beside .parquet shards (the shards were left out)", "raises",
     corpus_dir("a.txt", "b.txt", "c.parquet")),
    (71, "a directory of .txt and a .JSONL (skipped)", "raises",
     corpus_dir("a.txt", "b.txt", "c.JSONL")),
    (71, "a directory of .json JSON Lines, .jsonl.xz and .jsonl.bz2 read as records", "holds",
     prepared_docs(4, corpus_dir("a.json", "b.jsonl.xz", "c.jsonl.bz2", "d.jsonl"))),
    (71, "a directory with two links back up to itself (a hang)", "holds",
     prepared_docs(3, corpus_dir("a.txt", "b.txt", "c.txt", link="loop"))),
    (71, "a directory with a file hard-linked under two names (in train and val)", "holds",
     prepared_docs(4, corpus_dir("a.txt", "b.txt", "c.txt", "d.txt", link="hard"))),
    (71, "a glob matching a FIFO .txt (skipped)", "raises", globbed("fifo")),
    (71, "a glob matching a .txt link to /dev/zero (skipped)", "raises", globbed("zero")),
    (71, "a '**' glob through two links back up (a hang)", "holds",
     prepared_docs(4, globbed("loop"))),
    (71, "cp=2 x dp=2 on 4 ranks with grad_accum_steps=2 is valid", "holds", cp_by_dp),
    (71, "train.py from a NaN base: refused as it loads, not after iteration 0", "holds",
     train_on_nan_base),
    (71, "rope_scaling=yarn:1e6 is told the bound", "raises",
     blaming("below 1000000", validated(rope_scaling="yarn:1e6"))),
    (71, "a UTF-8 BOM: taken in a JSONL source as in task files and config.json", "holds",
     bom_everywhere),
    (71, "val_fraction=0 for a dataset prepared with 0.2", "raises", data_asked(val_fraction=0)),
    (71, "data_source= the prepared data's spelled with a trailing slash", "holds",
     lambda b, tmp: lambda: data_asked(data_source=guard_data.read_meta(b["data"])["source"]
                                       + "/")(b, tmp)() is None),
    (71, "config.json: Qwen3 rope_parameters nested by layer type (its yarn dropped)", "raises",
     blaming("a RoPE per layer type", hf_config(model_type="qwen3", head_dim=8, rope_parameters={
         "full_attention": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6}}))),
    (71, "config.json: layer_types of 1 for 2 layers", "raises",
     blaming("1 layer types", hf_config(model_type="qwen3", head_dim=8,
                                        layer_types=["full_attention"]))),
    (71, "config.json: Qwen3-MoE decoder_sparse_step 0", "raises",
     blaming("decoder_sparse_step=0", hf_config(**QWEN3_MOE, decoder_sparse_step=0))),
    (71, "config.json: Qwen3-MoE decoder_sparse_step 3 of 2 layers (no MoE layer)", "raises",
     blaming("no layer of the 2", hf_config(**QWEN3_MOE, decoder_sparse_step=3))),
    (71, "config.json: Qwen3-MoE mlp_only_layers every layer (no MoE layer)", "raises",
     blaming("no layer of the 2", hf_config(**QWEN3_MOE, mlp_only_layers=[0, 1]))),
    (71, "config.json: Qwen3-MoE moe_intermediate_size 0 names itself", "raises",
     blaming("moe_intermediate_size=0", hf_config(**{**QWEN3_MOE, "moe_intermediate_size": 0}))),
]


def snapshot(root, skip):
    """{path: bytes or kind} of everything under root except the tree `skip`."""
    out = {}
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if os.path.join(d, x) != skip]
        for f in files:
            p = os.path.join(d, f)
            out[p] = (os.readlink(p) if os.path.islink(p) else "fifo" if not os.path.isfile(p)
                      else open(p, "rb").read())
    return out


@pytest.mark.parametrize("case", CASES, ids=[f"{n}-{name}" for n, name, _, _ in CASES])
def test_hostile_input(case, base, tmp_path):
    _, name, kind, make = case
    tmp = str(tmp_path)
    with open(os.path.join(tmp, "outside.txt"), "w") as f:
        f.write("the user's file")
    made = make(base, tmp)
    out = made[2] if kind == "run" else os.path.join(tmp, "out")
    before = snapshot(tmp, out)
    if kind == "raises":
        with pytest.raises(UserError) as e:
            made()
        assert "\n" not in str(e.value) and str(e.value).strip(), str(e.value)
    elif kind == "holds":
        assert made() is True
    elif kind == "fallback":
        warnings = []
        found = checkpoint.find(made, None, warn=warnings.append)
        assert found == os.path.join(made, "ckpt", "iter_0000002"), (found, warnings)
        assert len(warnings) == 1 and "iter_0000004 is corrupt (" in warnings[0], warnings
        before = after = None  # the crafted copy itself is what changed
    else:
        script, args, out, fd = made
        if script == "torchrun":
            p = run_train(
                ["--standalone", "--nproc_per_node=2", os.path.join(ROOT, "train.py"), *args], tmp,
                check=False, timeout=120, script="-m torch.distributed.run")
            os.close(fd)
        else:
            p = run_train(args, tmp, check=False, timeout=120, script=script)
        errors = [line for line in (p.stdout + p.stderr).splitlines() if line.startswith("error:")]
        # not torchrun's own
        ranks = p.stderr.split('Traceback (most recent call last):\n  File "<frozen runpy>"')[0]
        assert (p.returncode != 0 and "Traceback" not in ranks
                and len(errors) == 1), p.stderr[-3000:]
        if name == "a refused run leaves nothing behind":
            assert not os.path.exists(out)
    if before is not None:
        after = snapshot(tmp, out)
        assert after == before, sorted(set(after.items()) ^ set(before.items()))[:3]


# ---- issue 50: signals at start-up and while preparing data; --help without torch ----------
# A wrapper runs the script (runpy, as `python script` does) with a signal sent to itself at a
# chosen moment: while `module` is first imported, or at the first batch a preparation encodes,
# or inside the swap that puts a re-prepared dataset in place (the first os.replace of `final`).
SIGNAL_AT = """
import os, runpy, sys
sig, at, script = int(sys.argv[1]), sys.argv[2], sys.argv[3]
sys.path.insert(0, os.path.dirname(script))
def send():
    os.kill(os.getpid(), sig)
if at == "encode" or at == "swap":
    import tokenizer
    real_encode, real_replace = tokenizer.encode_batch, os.replace
    def encode_batch(*a, **k):
        send() if at == "encode" else None
        return real_encode(*a, **k)
    def replace(src, dst):
        if at == "swap" and ".old" in str(dst):
            send()
        return real_replace(src, dst)
    tokenizer.encode_batch, os.replace = encode_batch, replace
else:
    class Finder:
        def find_spec(self, name, path=None, target=None):
            if name == at:
                sys.meta_path.remove(self)
                send()
    sys.meta_path.insert(0, Finder())
sys.argv = sys.argv[3:]
runpy.run_path(script, run_name="__main__")
"""


def signalled(sig, at, script, *args, cwd):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-c", SIGNAL_AT, str(sig),
                           at, os.path.join(ROOT, script), *args],
                          cwd=cwd, capture_output=True, text=True, timeout=120)


def one_line(p, code, line):
    assert (p.returncode == code and "Traceback" not in p.stderr
            and p.stderr.strip().splitlines()[-1].startswith(line)), \
        (p.returncode, p.stderr[-2000:])


def test_signals_at_startup_and_while_preparing_are_one_line_and_128_plus_n(tmp_path):
    """Ctrl-C (SIGINT) or SIGTERM while torch imports: the line and 130 / 143 (the hooks come
    before torch); SIGTERM or Ctrl-C while prepare.py re-prepares a dataset: the line and 143 /
    130, the old dataset unchanged and nothing left beside it; inside the swap:
    the new one, whole."""
    tmp = str(tmp_path)
    for sig, line in ((2, "interrupted (Ctrl-C)"), (15, "stopped by SIGTERM")):
        one_line(signalled(sig, "torch", "train.py", "max_iters=1", f"out_dir={tmp}/out", cwd=tmp),
                 128 + sig, line)
    one_line(signalled(2, "torch", "sample.py", f"out_dir={tmp}/out", cwd=tmp), 130,
             "interrupted (Ctrl-C)")
    src = text_files(os.path.join(tmp, "src"), 12, 20)
    final = os.path.join(tmp, "d")
    old = prepare.prepare(os.path.join(src, "*.txt"), final, "cl100k_base", 512, val_fraction=0.3,
                          verbose=False)
    before = snapshot(final, None)
    for sig, at in ((15, "encode"), (2, "encode"), (2, "swap")):
        p = signalled(sig, at, "prepare.py", os.path.join(src, "[0-5].txt"), "--out", final,
                      "--val_fraction", "0.5", "--vocab_size", "512", cwd=tmp)
        one_line(p, 128 + sig, "interrupted (Ctrl-C)" if sig == 2 else "stopped by SIGTERM")
        assert sorted(os.listdir(tmp)) == ["d", "src"], os.listdir(tmp)
        if at == "encode":
            assert snapshot(final, None) == before
    # the re-prepared dataset, whole: its files as its meta.json counts them
    new = guard_data.read_meta(final)
    assert new["train_docs"] + new["val_docs"] == 6 != old["train_docs"] + old["val_docs"]
    assert os.path.getsize(os.path.join(final, "train.bin")) == 2 * new["train_tokens"]


@pytest.mark.parametrize("script", ["train.py", "sample.py", "prepare.py"])
def test_help_needs_no_torch(script, tmp_path):
    """--help answers before torch imports (30-50 s on a busy machine)."""
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-X", "importtime", os.path.join(ROOT, script), "--help"],
                       cwd=str(tmp_path), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "usage:" in p.stdout, p.stderr[-2000:]
    assert not [line for line in p.stderr.splitlines()
                if line.rstrip().endswith("| torch")], "torch was imported"


def test_stdout_on_a_full_device_is_one_line(tmp_path):
    """`python train.py --help > /dev/full` (or any output there): one error line, exit 1."""
    import subprocess
    import sys
    # (prepare.py's --help is argparse's, which exits 0 by itself)
    for script in ("train.py", "prepare.py"):
        with open("/dev/full", "w") as full:
            p = subprocess.run([sys.executable, os.path.join(ROOT, script), "--help"],
                               cwd=str(tmp_path),
                               stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
        assert p.returncode == 1 and p.stderr.splitlines() == [
            "error: standard output cannot be written (No space left on device): send it "
            "elsewhere"], \
            (script, p.stderr[-2000:])
