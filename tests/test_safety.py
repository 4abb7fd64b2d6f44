"""Untrusted and damaged files: crafted checkpoints never run code, damaged logs and datasets
are reported in one line, nothing the user has is lost (pruning, re-prepare, two runs on one
out_dir), failed saves and loads name the real cause."""

import errno
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict

import numpy as np
import pytest
import torch
from conftest import ROOT, TINY, read_metrics, run_train

import checkpoint
import data
import rundir
from guards import guard_ckpt
from guards import guard_data
from guards import guard_files
from techniques import ckpt_async
import faults
import parallel
import prepare
from model import ModelConfig, Transformer
from optim import AdamW
from formats import hf
from formats import hf_safetensors
from guards.guard_errors import UserError
from techniques import fsdp


class Payload:
    """A pickle that, when loaded by plain pickle, creates the file `marker`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant(path, name, marker):
    """Replaces checkpoint file `name` by a code-running pickle and recomputes the manifest,
    so that checksum verification alone would accept it."""
    with open(os.path.join(path, name), "wb") as f:
        pickle.dump(Payload(marker), f)
    os.remove(os.path.join(path, "manifest.json"))
    checkpoint._write_manifest(path)


RNG = {"rng_cpu": [torch.get_rng_state()]}  # what state.pt must hold


def meta(it):
    """The least meta.json a checkpoint must hold: its iteration, its model's shape,
    its tokenizer."""
    return {"iter": it,
            "model": asdict(ModelConfig(vocab_size=64, block_size=16, n_layer=2,
                                        n_head=4, n_kv_head=2, n_embd=32)),
            "config": {"tokenizer": "cl100k_base", "vocab_size": 64}}


def last_line(p):
    return p.stderr.strip().splitlines()[-1]


def test_crafted_checkpoint_files_never_run_code(dataset, tmp_path):
    common = [*TINY, f"dataset={dataset}", "lr_decay_iters=12", "ckpt_interval=4", "keep_ckpts=0"]
    a = str(tmp_path / "a")
    run_train([*common, f"out_dir={a}", "max_iters=8"], cwd=tmp_path, fork=True)
    ckpt = os.path.join(a, "ckpt")
    marker = str(tmp_path / "PWNED")
    plant(os.path.join(ckpt, "iter_0000008"), ".metadata", marker)
    # sample.py pointed at the crafted checkpoint: refused, by name
    p = run_train([f"ckpt={ckpt}/iter_0000008", f"export={tmp_path}/w.pt"], cwd=tmp_path,
                  check=False, script="sample.py")
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert last_line(p).startswith(f"error: ckpt={ckpt}/iter_0000008 does not verify (") and \
        "does not verify (.metadata " in last_line(p) and "refused" in last_line(p)
    # a ckpt= that is no directory (a typo): said so, not blamed on a save that did not finish
    p = run_train([f"ckpt={ckpt}/iter_0000009"], cwd=tmp_path, check=False, script="sample.py")
    assert (p.returncode != 0
            and last_line(p).startswith(f"error: ckpt={ckpt}/iter_0000009 is not a directory: "))
    # sample.py on the run: the crafted one is skipped as corrupt, the older one is used
    p = run_train([f"out_dir={a}", f"export={tmp_path}/w.pt"], cwd=tmp_path, script="sample.py")
    assert (f"checkpoint {ckpt}/iter_0000008 is corrupt (" in p.stdout
            and "iter_0000004" in p.stdout)
    # init_from= that run: the same
    p = run_train([*common, f"out_dir={tmp_path / 'c'}", "max_iters=1", f"init_from={a}"],
                  cwd=tmp_path, fork=True)
    assert f"checkpoint {ckpt}/iter_0000008 is corrupt (" in p.stdout
    # auto-resume: falls back to iteration 4
    p = run_train([*common, f"out_dir={a}", "max_iters=10"], cwd=tmp_path, fork=True)
    assert f"resumed from {ckpt}/iter_0000004" in p.stdout
    assert not os.path.exists(marker)
    # a state.pt that weights_only refuses: reported by name, skipped on resume
    plant(os.path.join(ckpt, "iter_0000010"), "state.pt", marker)
    p = run_train([f"ckpt={ckpt}/iter_0000010"], cwd=tmp_path, check=False, script="sample.py")
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert (last_line(p).startswith(f"error: ckpt={ckpt}/iter_0000010 does not verify (state.pt")
            and "plain data" in last_line(p))
    p = run_train([*common, f"out_dir={a}", "max_iters=11"], cwd=tmp_path, fork=True)
    assert f"checkpoint {ckpt}/iter_0000010 is corrupt (state.pt" in p.stdout
    assert f"resumed from {ckpt}/iter_0000008" in p.stdout
    assert not os.path.exists(marker)


def test_dcp_metadata_reader_allows_what_dcp_writes_only(tmp_path):
    mesh = parallel.setup("cpu")
    model = tiny_model()
    opt = AdamW(model.parameters())
    path = checkpoint.save(str(tmp_path), 3, model, opt, RNG, meta(3), mesh, 0)
    md = guard_ckpt.read_dcp_metadata(path)
    assert ("model.norm.weight" in md.state_dict_metadata
            and "optim.norm.weight.exp_avg" in md.state_dict_metadata)
    # a storage entry that points outside the checkpoint directory
    _, info = next(iter(md.storage_data.items()))
    info.relative_path = "../../etc/passwd"
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(UserError, match=r"\.metadata .*refused"):
        guard_ckpt.read_dcp_metadata(path)


def tiny_model(n_embd=32, seed=0):
    return Transformer(
        ModelConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=n_embd),
        seed)


def test_safetensors_overlapping_or_gapped_offsets_are_refused(tmp_path):
    path = str(tmp_path / "m.safetensors")
    hf_safetensors.write_safetensors(path, {"a": torch.ones(4), "b": torch.zeros(4)})
    assert set(hf_safetensors.read_safetensors(path)) == {"a", "b"}

    def rewrite(header, extra=b""):
        raw = json.dumps(header).encode()
        with open(path, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw + bytes(32) + extra)

    f32 = lambda begin: {"dtype": "F32", "shape": [4],  # noqa: E731
                         "data_offsets": [begin, begin + 16]}
    # b aliases a (and 16 bytes at the end are nobody's)
    rewrite({"a": f32(0), "b": f32(0)}, bytes(0))
    with pytest.raises(UserError, match="invalid offset"):
        hf_safetensors.read_safetensors(path)
    rewrite({"a": f32(0), "b": f32(8)})  # overlapping
    with pytest.raises(UserError, match="invalid offset"):
        hf_safetensors.read_safetensors(path)
    rewrite({"a": f32(0), "b": f32(16)}, bytes(8))  # trailing bytes nobody owns
    with pytest.raises(UserError, match="not fully covered"):
        hf_safetensors.read_safetensors(path)


def test_pruning_keeps_the_resumed_checkpoint_and_counts_intact_ones_by_number(tmp_path):
    mesh = parallel.setup("cpu")
    model = tiny_model()
    opt = AdamW(model.parameters())
    out, root = str(tmp_path), os.path.join(str(tmp_path), "ckpt")
    save = lambda it, keep, resumed=None: checkpoint.save(out, it, model, opt, RNG,  # noqa: E731
                                                          meta(it), mesh, keep,
                                                          resumed_from=resumed)
    save(4, 0)
    save(8, 0)
    shutil.copytree(os.path.join(root, "iter_0000008"), os.path.join(root, "iter_0000012"))
    os.remove(os.path.join(root, "iter_0000012", "manifest.json"))  # a corrupt newer one
    resumed = checkpoint.find(out, None)
    assert resumed == os.path.join(root, "iter_0000008")
    # keep 1 intact: 9; the resumed-from 8 stays too; the corrupt one is left alone
    save(9, 1, resumed)
    assert sorted(os.listdir(root)) == ["iter_0000008", "iter_0000009", "iter_0000012", "latest"]
    # an async save (ckpt_async.py) prunes as a plain one does: 9 goes, 8 stays
    saves = ckpt_async.AsyncSaves(out, model, opt, mesh, 1, resumed)
    saves.save(10, RNG, meta(10))
    saves.finish(10)
    assert sorted(os.listdir(root)) == ["iter_0000008", "iter_0000010", "iter_0000012", "latest"]
    # 8-digit iterations sort by number, are found and prune the older ones
    save(12345678, 2)
    assert checkpoint.find(out, None) == os.path.join(root, "iter_12345678")
    assert sorted(d for d in os.listdir(root) if d.startswith("iter")) == [
        "iter_0000010", "iter_0000012", "iter_12345678"]
    # a killed save's temporary directory is removed by the next run that locks out_dir
    os.makedirs(os.path.join(root, ".tmp_iter_0000010"))
    fd = guard_files.lock_out_dir(out)
    try:
        assert not os.path.exists(os.path.join(root, ".tmp_iter_0000010"))
    finally:
        os.close(fd)


def test_checkpoint_before_any_step_loads_and_materialized_state_is_exact(tmp_path):
    mesh = parallel.setup("cpu")
    model = tiny_model()
    opt = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    path = checkpoint.save(str(tmp_path), 0, model, opt, RNG, meta(0), mesh, 0)  # no step yet
    fresh_model = tiny_model(seed=1)
    fresh_opt = AdamW(fresh_model.parameters(), lr=1e-2, weight_decay=0.1)
    checkpoint.load(path, fresh_model, fresh_opt)
    # AdamW with the materialized zero state steps exactly like AdamW creating it at its first step
    ref_model = tiny_model()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1)
    x = torch.randint(0, 64, (2, 16))
    for m, o in ((model, opt), (fresh_model, fresh_opt), (ref_model, ref_opt)):
        for _ in range(2):
            m(x, x)[1].backward()
            o.step()
            o.zero_grad()
    for m in (model, fresh_model):
        for a, b in zip(m.parameters(), ref_model.parameters()):
            assert torch.equal(a, b)


def test_shape_mismatch_and_disk_full_name_the_cause(tmp_path, monkeypatch):
    mesh = parallel.setup("cpu")
    model = tiny_model()
    opt = AdamW(model.parameters())
    path = checkpoint.save(str(tmp_path), 1, model, opt, RNG, meta(1), mesh, 0)
    with pytest.raises(UserError, match=r"tok_embeddings.weight.*\(64, 32\).*\(64, 48\)"):
        checkpoint.load(path, tiny_model(n_embd=48), no_dist=True)
    import torch.distributed.checkpoint.filesystem as fs

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(fs, "_write_item", full)
    with pytest.raises(UserError, match="No space left on device") as e:
        checkpoint.save(str(tmp_path), 2, model, opt, RNG, meta(2), mesh, 0)
    assert "CheckpointException" not in str(e.value)


def test_async_save_writes_the_state_of_its_start_and_fails_at_the_finish(tmp_path, monkeypatch):
    mesh = parallel.setup("cpu")
    model = tiny_model()
    opt = AdamW(model.parameters())
    want = {k: v.clone() for k, v in model.state_dict().items()}
    out, ckpt = str(tmp_path), os.path.join(str(tmp_path), "ckpt")
    monkeypatch.setattr(checkpoint, "FileSystemWriter", faults.slow_writer(0.5))
    saves = ckpt_async.AsyncSaves(out, model, opt, mesh, 0)
    saves.save(1, RNG, meta(1))
    # the write sleeps (faults.slow_writer) while "training" goes on:
    assert not saves.written()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    assert not os.path.exists(os.path.join(ckpt, "latest"))
    saves.finish(1)
    path = os.path.join(ckpt, "iter_0000001")
    assert open(os.path.join(ckpt, "latest")).read().strip() == "iter_0000001"
    loaded = tiny_model(seed=1)
    checkpoint.load(path, loaded, no_dist=True)  # the weights of the start, not the zeros
    assert all(torch.equal(loaded.state_dict()[k], want[k]) for k in want)
    # a background write that fails (disk full): the plain save's one-line error, at the finish,
    # and the earlier checkpoint stays the latest
    import torch.distributed.checkpoint.filesystem as fs

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(fs, "_write_item", full)
    saves.save(2, RNG, meta(2))
    with pytest.raises(UserError,
                       match="saving checkpoint iter_0000002 failed .*No space left on device"):
        saves.finish(2)
    assert sorted(os.listdir(ckpt)) == ["iter_0000001", "latest"]
    assert open(os.path.join(ckpt, "latest")).read().strip() == "iter_0000001"


def test_an_async_save_is_finished_only_once_every_rank_has_written(tmp_path):
    """finish_if_written makes the save in flight the latest only when every rank's write is done:
    with a second rank counted that has not written, this rank's finished write alone (a sum of
    1 of 2) finishes nothing; counted alone, it does."""
    import dataclasses
    mesh = parallel.setup("cpu")
    model = tiny_model()
    opt = AdamW(model.parameters())
    saves = ckpt_async.AsyncSaves(str(tmp_path), model, opt, mesh, 0)
    saves.save(1, RNG, meta(1))
    while not saves.written():
        time.sleep(0.01)
    latest = os.path.join(str(tmp_path), "ckpt", "latest")
    saves.mesh = dataclasses.replace(mesh, world=2)  # another rank, still writing
    saves.finish_if_written(2)
    assert not os.path.exists(latest) and saves.pending is not None
    saves.mesh = mesh
    saves.finish_if_written(2)
    assert open(latest).read().strip() == "iter_0000001" and saves.pending is None


def test_hf_config_with_non_positive_sizes_is_refused():
    cfg = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 0, "head_dim": 8}
    with pytest.raises(UserError, match="num_attention_heads=0"):
        hf.hf_config_to_ours(cfg)
    with pytest.raises(UserError, match="hidden_size=-32"):
        hf.hf_config_to_ours({**cfg, "num_attention_heads": 4, "hidden_size": -32})


def test_a_lock_file_that_cannot_be_opened_is_one_line(tmp_path, monkeypatch):
    """out_dir/.lock that cannot be opened (a read-only filesystem, say) is a UserError that
    says so, not a traceback, and not a claim that another run holds it."""
    real_open = os.open

    def refusing(path, *args, **kw):
        if str(path).endswith(".lock"):
            raise OSError(errno.EROFS, "Read-only file system")
        return real_open(path, *args, **kw)
    monkeypatch.setattr(os, "open", refusing)
    for out in (tmp_path / "new", tmp_path / "old"):  # made by this run, and one that was there
        if out.name == "old":
            out.mkdir()
        with pytest.raises(UserError, match="cannot open .*Read-only file system.*remove it"):
            guard_files.lock_out_dir(str(out))


def test_torn_metrics_line_is_dropped(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    with open(path, "w") as f:
        f.write('{"iter": 0, "loss": 1.0}\n{"iter": 1, "loss": 0.9}\n{"iter": 2, "lo')
    assert rundir.read_metrics(path) == [{"iter": 0, "loss": 1.0}, {"iter": 1, "loss": 0.9}]
    assert rundir.read_metrics(str(tmp_path / "absent.jsonl")) == []


def test_torn_metrics_do_not_block_resume_and_out_dir_is_locked(dataset, tmp_path):
    out = str(tmp_path / "run")
    common = [*TINY, f"dataset={dataset}", f"out_dir={out}", "lr_decay_iters=400",
              "ckpt_interval=4"]
    run_train([*common, "max_iters=4"], cwd=tmp_path, fork=True)
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        f.write('{"iter": 4, "lo')  # a kill in the middle of an append
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "train.py"), *common, "max_iters=400"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not any(r["iter"] >= 5 and "loss" in r
                      for r in rundir.read_metrics(os.path.join(out, "metrics.jsonl"))):
            assert first.poll() is None and time.time() < deadline, first.communicate()[1][-2000:]
            time.sleep(0.1)
        t0 = time.time()
        p = run_train([*common, "max_iters=400"], cwd=tmp_path, check=False, fork=True)
        assert p.returncode != 0 and "Traceback" not in p.stderr and time.time() - t0 < 60
        assert last_line(p).startswith(f"error: out_dir {out} is in use by pid {first.pid} "
                                       "on host ")
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    finally:
        first.kill()
    latest = int(open(os.path.join(out, "ckpt", "latest")).read().strip().rsplit("_", 1)[1])
    # the kernel dropped the dead run's lock
    p = run_train([*common, f"max_iters={latest + 2}"], cwd=tmp_path, fork=True)
    resumed = int(re.search(r"resumed from .* at iteration (\d+)", p.stdout)[1])
    # 2 steps on
    assert resumed >= 4 and max(r["iter"] for r in read_metrics(out) if "loss" in r) == resumed + 1


# ---- data ------------------------------------------------------------------------------


def test_failed_reprepare_keeps_the_existing_dataset(dataset, tmp_path):
    target = str(tmp_path / "ds")
    shutil.copytree(dataset, target)
    before = {n: open(os.path.join(target, n), "rb").read() for n in os.listdir(target)}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": broken\n')
    with pytest.raises(UserError, match="malformed JSON"):
        prepare.prepare(str(bad), target, "cl100k_base", 512, verbose=False)
    assert {n: open(os.path.join(target, n), "rb").read() for n in os.listdir(target)} == before
    # no temp dir left
    assert [n for n in os.listdir(tmp_path) if n not in ("ds", "bad.jsonl")] == []
    # and a successful re-prepare replaces it whole
    good = tmp_path / "good.jsonl"
    good.write_text(
        "".join(json.dumps({"text": f"document number {i} " * 20}) + "\n" for i in range(30)))
    prepare.prepare(str(good), target, "cl100k_base", 512, val_fraction=0.2, verbose=False)
    assert guard_data.read_meta(target)["source"] == str(good)
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "ds", "good.jsonl"]


def test_damaged_dataset_files_are_one_line_errors(dataset, tmp_path):
    def broken(change):
        d = str(tmp_path / f"ds{len(os.listdir(tmp_path))}")
        shutil.copytree(dataset, d)
        change(d)
        return d

    def loader(d):
        return data.Loader(d, "val", 8, 2, 2, 0)

    dtype = np.dtype(guard_data.read_meta(dataset)["dtype"])
    d = broken(lambda d: os.remove(os.path.join(d, "val.bin")))
    with pytest.raises(UserError, match="val.bin is missing"):
        loader(d)
    d = broken(
        lambda d: open(os.path.join(d, "val.bin"), "ab").write(b"\0" * (dtype.itemsize + 1)))
    with pytest.raises(UserError, match=f"not a multiple of {dtype.itemsize}"):
        loader(d)
    d = broken(lambda d: open(os.path.join(d, "meta.json"), "w").write("{not json"))
    with pytest.raises(UserError, match="meta.json: malformed JSON"):
        loader(d)
    d = broken(
        lambda d: open(os.path.join(d, "meta.json"), "w").write('{"tokenizer": "cl100k_base"}'))
    with pytest.raises(UserError, match="meta.json lacks"):
        loader(d)

    def big_id(d):
        # id 600 >= vocab 512
        np.array([600], dtype=dtype).tofile(open(os.path.join(d, "val.bin"), "r+b"))
    d = broken(big_id)
    with pytest.raises(UserError, match="token id 600.*vocab_size 512"):
        loader(d)


def _save_and_find_with_a_corrupt_share(mesh, out):
    hashed = []  # (what, file name) this rank hashed
    # a save hashes in checkpoint.py, a find's verify in guard_ckpt.py
    sha256 = checkpoint.sha256_file
    checkpoint.sha256_file = guard_ckpt.sha256_file = (
        lambda path: hashed.append(os.path.basename(path)) or sha256(path))
    model = tiny_model()
    fsdp.fully_shard_model(model, mesh)
    opt = AdamW(model.parameters())
    for it in (1, 2):
        checkpoint.save(out, it, model, opt, RNG, meta(it), mesh, 0)
    saving, hashed[:] = list(hashed), []
    path = os.path.join(out, "ckpt", "iter_0000002")
    listed = sorted(json.load(open(os.path.join(path, "manifest.json")))["files"])
    parallel.barrier(mesh)
    if mesh.rank == 1:  # a file that rank 1 checks (every second one of the sorted list)
        victim = os.path.join(path, listed[1])
        blob = bytearray(open(victim, "rb").read())
        blob[0] ^= 0xFF
        open(victim, "wb").write(bytes(blob))
    parallel.barrier(mesh)
    warnings = []
    found = checkpoint.find(out, mesh, warn=warnings.append)
    return {"listed": listed, "found": found, "warnings": warnings, "saving": saving,
            "finding": hashed}


def test_hashing_is_shared_by_the_ranks(tmp_path):
    from conftest import spawn
    r0, r1 = spawn(_save_and_find_with_a_corrupt_share, 2, str(tmp_path))
    # the manifest lists both ranks' shards (each hashed by its writer) and rank 0's files
    assert ({"__0_0.distcp", "__1_0.distcp", ".metadata", "meta.json", "state.pt"}
            <= set(r0["listed"]))
    assert r0["found"] == r1["found"] == os.path.join(str(tmp_path), "ckpt", "iter_0000001")
    assert (len(r0["warnings"]) == 1
            and f"{r0['listed'][1]} does not match its checksum" in r0["warnings"][0])
    assert r1["warnings"] == []
    # who hashed what: at a save each rank its own shards; at find, every second file each
    assert sorted(r1["saving"]) == ["__1_0.distcp"] * 2 and "__1_0.distcp" not in r0["saving"]
    assert (set(r1["finding"]) == set(r0["listed"][1::2])
            and not set(r0["finding"]) & set(r1["finding"]))


def _begin_with_a_nan_on_rank_1(mesh, out_dir):
    """checkpoint.begin on a model whose rank 1 holds a NaN (as an FSDP shard or a replica that
    went wrong alone would): what each rank did."""
    model = tiny_model()
    if mesh.rank == 1:
        with torch.no_grad():
            next(model.parameters())[0] = float("nan")
    try:
        checkpoint.begin(out_dir, 3, model, mesh)
    except UserError:
        return "refused"
    return "began"


def test_a_nan_on_one_rank_refuses_the_save_on_every_rank(tmp_path):
    """The finite check before a save is agreed by all ranks: a NaN on rank 1 alone refuses the
    save on rank 0 too (which, checking alone, began it while rank 1 refused: a real run hung),
    and nothing of it is left."""
    from conftest import spawn
    assert spawn(_begin_with_a_nan_on_rank_1, 2, str(tmp_path), timeout=120) == ["refused"] * 2
    assert os.listdir(os.path.join(str(tmp_path), "ckpt")) == []
