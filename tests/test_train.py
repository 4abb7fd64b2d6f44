"""End to end: train.py and sample.py run as separate processes, the way a user runs them."""

import json
import os

import pytest

from conftest import TINY, read_metrics, run_train

TRAIN_KEYS = {"iter", "loss", "lr", "grad_norm", "tokens", "dt_ms", "tok_per_s", "mfu"}


def test_tiny_run_learns_logs_and_checkpoints(dataset, tmp_path):
    out = str(tmp_path / "run")
    p = run_train([*TINY, f"dataset={dataset}", f"out_dir={out}", "max_iters=30", "ckpt_interval=10",
                   "keep_ckpts=2", "sample_tokens=20"], cwd=tmp_path)
    rows = read_metrics(out)
    train = [r for r in rows if "loss" in r]
    val = [r for r in rows if "val_loss" in r]
    assert [r["iter"] for r in train] == list(range(30))
    assert all(set(r) == TRAIN_KEYS for r in train)
    assert [r["iter"] for r in val] == [0, 5, 10, 15, 20, 25, 30] and all(set(r) == {"iter", "val_loss"} for r in val)
    assert train[-1]["loss"] < train[0]["loss"] - 0.5, "the loss did not fall"
    assert val[-1]["val_loss"] < val[0]["val_loss"] - 0.3
    assert train[-1]["tokens"] == 30 * 4 * 2 * 32
    ckpt = os.path.join(out, "ckpt")
    assert sorted(os.listdir(ckpt)) == ["iter_0000020", "iter_0000030", "latest"]  # keep_ckpts=2 pruned iter 10
    assert open(os.path.join(ckpt, "latest")).read().strip() == "iter_0000030"
    assert sorted(os.listdir(os.path.join(ckpt, "iter_0000030"))) == [".metadata", "__0_0.distcp", "manifest.json",
                                                                   "meta.json", "state.pt"]
    assert json.load(open(os.path.join(out, "config.json")))["max_iters"] == 30
    assert "sample" in p.stdout
    s = run_train([f"out_dir={out}", "max_new_tokens=8", "num_samples=1"], cwd=tmp_path, script="sample.py")
    assert "iteration 30" in s.stdout


def test_resume_is_bit_exact(dataset, tmp_path):
    # dropout > 0, so the RNG state must be restored too, not only weights and optimizer
    common = [*TINY, f"dataset={dataset}", "dropout=0.1", "lr_decay_iters=20", "ckpt_interval=100"]
    full, half = str(tmp_path / "full"), str(tmp_path / "half")
    run_train([*common, f"out_dir={full}", "max_iters=20"], cwd=tmp_path)
    run_train([*common, f"out_dir={half}", "max_iters=10"], cwd=tmp_path)
    # a crashed run may have logged past its checkpoint: those lines must be replaced, not kept
    with open(os.path.join(half, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"iter": 10, "loss": -1.0}) + "\n")
    p = run_train([*common, f"out_dir={half}", "max_iters=20", "init_from=resume"], cwd=tmp_path)
    assert "resumed from" in p.stdout
    a, b = read_metrics(full), read_metrics(half)
    strip = lambda rows: [{k: r[k] for k in ("iter", "loss", "grad_norm", "lr", "val_loss") if k in r} for r in rows]  # noqa: E731
    assert strip(b) == strip(a)  # == on floats: bit for bit


def test_config_file_and_resume_keeps_the_model_shape(dataset, tmp_path):
    cfg = tmp_path / "cfg.py"
    cfg.write_text("n_layer = 1\nn_embd = 16 * 2\nmax_iters = 3\n")
    out = str(tmp_path / "run")
    run_train([*TINY, str(cfg), f"dataset={dataset}", f"out_dir={out}"], cwd=tmp_path)
    meta = json.load(open(os.path.join(out, "ckpt", "iter_0000003", "meta.json")))
    assert meta["model"]["n_layer"] == 1 and meta["config"]["n_layer"] == 1
    # resuming without the config file: the shape comes from the checkpoint
    rest = [a for a in TINY if not a.startswith(("n_layer=", "n_embd="))]
    run_train([*rest, f"dataset={dataset}", f"out_dir={out}", "init_from=resume", "max_iters=5"], cwd=tmp_path)
    assert read_metrics(out)[-2]["iter"] == 4


@pytest.fixture(scope="module")
def saved_run(dataset, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("saved") / "run")
    run_train([*TINY, f"dataset={dataset}", f"out_dir={out}", "max_iters=2"], cwd=os.path.dirname(out))
    return out


def snapshot(out):
    files = {}
    for root, _, names in os.walk(out):
        for n in names:
            if n != ".lock":  # who holds out_dir (host, pid): rewritten by every run, not saved data
                files[os.path.join(root, n)] = open(os.path.join(root, n), "rb").read()
    return files


BAD = {
    "unknown key": (["n_layers=3"], "unknown config key 'n_layers' on the command line: did you mean 'n_layer'"),
    "wrong type": (["max_iters=1.5"], "max_iters=1.5 on the command line has type float"),
    "bad init_from": (["init_from=pretrained"], "init_from='pretrained' is not"),
    "scratch over a run": (["init_from=scratch", "@saved"], "init_from=scratch but"),
    "bad nan_action": (["nan_action=ignore"], "nan_action='ignore' is not"),
    "bad dtype": (["dtype=float16"], "dtype='float16' is not one of"),
    "no gpu": (["device=cuda"], "CUDA is not available here"),
    "nccl on cpu": (["device=cpu", "backend=nccl"], "backend=nccl needs CUDA tensors but device is cpu"),
    "dataset not prepared": (["dataset=nope"], "dataset 'nope' is not prepared"),
    "missing source": (["dataset=nope", "data_source=/no/such/dir"], "data source '/no/such/dir' not found"),
    "vocab mismatch": (["vocab_size=1024"], "was prepared with tokenizer=cl100k_base vocab_size=512"),
    "block too long": (["block_size=100000"], "fewer than block_size + 1"),
    "resume nothing": (["init_from=resume", "out_dir=empty"], "empty/ckpt has no checkpoint"),
    "resume other shape": (["init_from=resume", "n_layer=3", "@saved"], "n_layer=3 but the checkpoint in"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_gives_one_clear_line(case, dataset, saved_run, tmp_path):
    args, message = BAD[case]
    args = [a for a in args if a != "@saved"] + ([f"out_dir={saved_run}"] if "@saved" in args else [])
    before = snapshot(saved_run)
    p = run_train([*TINY, f"dataset={dataset}", "max_iters=2", *args], cwd=tmp_path, check=False)
    assert p.returncode != 0
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last, p.stderr
    assert "Traceback" not in p.stderr
    assert snapshot(saved_run) == before  # nothing already saved was touched


def test_malformed_jsonl_names_file_and_line(tmp_path):
    src = tmp_path / "c.jsonl"
    src.write_text('{"text": "a"}\n' * 5 + '{"text": oops}\n')
    p = run_train([*TINY, "dataset=chat", f"data_source={src}"], cwd=tmp_path, check=False)
    assert p.returncode != 0 and "c.jsonl:6: malformed JSON" in p.stderr and "Traceback" not in p.stderr
    assert not os.path.exists(tmp_path / "data" / "chat" / "meta.json")


def test_corrupt_checkpoint_is_reported_by_name(dataset, tmp_path):
    out = str(tmp_path / "run")
    run_train([*TINY, f"dataset={dataset}", f"out_dir={out}", "max_iters=2"], cwd=tmp_path)
    shard = os.path.join(out, "ckpt", "iter_0000002", "__0_0.distcp")
    data_ = open(shard, "rb").read()
    open(shard, "wb").write(data_[: len(data_) // 2])
    p = run_train([*TINY, f"dataset={dataset}", f"out_dir={out}", "init_from=resume", "max_iters=4"],
                  cwd=tmp_path, check=False)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert "no intact checkpoint" in p.stderr and "iter_0000002: __0_0.distcp has" in p.stderr


def test_wandb_offline(dataset, tmp_path):
    out = str(tmp_path / "run")
    run_train([*TINY, f"dataset={dataset}", f"out_dir={out}", "max_iters=2", "wandb_log=True"], cwd=tmp_path,
              env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    runs = [d for d in os.listdir(os.path.join(out, "wandb")) if d.startswith("offline-run-")]
    assert len(runs) == 1
    run_id = runs[0].rsplit("-", 1)[1]
    meta = json.load(open(os.path.join(out, "ckpt", "iter_0000002", "meta.json")))
    assert meta["wandb_id"] == run_id  # a resumed run continues this wandb run
