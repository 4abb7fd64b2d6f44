"""End to end: train.py and sample.py run as separate processes, the way a user runs them."""

import hashlib
import json
import os
import runpy
import sys

import pytest
import torch
from conftest import ROOT, TINY, assert_same_curve, read_metrics, run_train, torchrun

from guards import guard_errors
from guards.guard_errors import UserError

TRAIN_KEYS = {"iter", "loss", "lr", "grad_norm", "tokens", "dt_ms", "tok_per_s", "mfu",
              "elapsed_s"}


def test_the_curve_comparison_can_fail():
    """conftest.assert_same_curve, which every layout test leans on: a curve equals itself,
    rounding passes unless exact=True, and 1% on one loss, grad norm or val loss, a lost
    iteration or a lost evaluation fails, and so does a train line only in the second curve
    (a val line only there is allowed: a run stopped early evaluates at its end)."""
    a = [{"iter": 0, "loss": 5.0, "grad_norm": 1.0}, {"iter": 0, "val_loss": 5.5},
         {"iter": 1, "loss": 4.0, "grad_norm": 0.8}, {"iter": 2, "val_loss": 4.5}]
    assert_same_curve(a, [*a, {"iter": 1, "val_loss": 4.7}], exact=True)
    rounded = [{k: v * (1 + 1e-6) if k != "iter" else v for k, v in r.items()} for r in a]
    assert_same_curve(a, rounded)
    with pytest.raises(AssertionError):
        assert_same_curve(a, rounded, exact=True)
    for i, key in ((2, "loss"), (0, "grad_norm"), (3, "val_loss")):
        off = [dict(r) for r in a]
        off[i][key] *= 1.01
        with pytest.raises(AssertionError):
            assert_same_curve(a, off)
    for lost in (2, 3):
        with pytest.raises(AssertionError):
            assert_same_curve(a, a[:lost] + a[lost + 1:])
    with pytest.raises(AssertionError):
        assert_same_curve(a, [*a, {"iter": 2, "loss": 3.5, "grad_norm": 0.7}])


def killed_on_rank_1(rank):
    """before= of torchrun: rank 1 dies of SIGKILL before train.py starts (the OOM killer, say)."""
    import signal
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)


def test_torchrun_reports_a_rank_killed_by_a_signal(dataset, tmp_path):
    """conftest.torchrun, which every multi-process test runs: a rank that dies of a signal
    (a negative exit code) fails the call, naming it, and the waiting rank is not left behind."""
    with pytest.raises(AssertionError, match="rank 1 exited with -9"):
        torchrun(2, [*TINY, f"dataset={dataset}", f"out_dir={tmp_path / 'run'}", "max_iters=1"],
                 cwd=tmp_path, before=killed_on_rank_1, timeout=60)


def test_tiny_run_learns_logs_and_checkpoints(dataset, tmp_path):
    out = str(tmp_path / "run")
    p = run_train(
        [*TINY, f"dataset={dataset}", f"out_dir={out}", "max_iters=30", "ckpt_interval=10",
         "keep_ckpts=2", "sample_tokens=20"], cwd=tmp_path, fork=True)
    rows = read_metrics(out)
    train = [r for r in rows if "loss" in r]
    val = [r for r in rows if "val_loss" in r]
    assert [r["iter"] for r in train] == list(range(30))
    assert all(set(r) == TRAIN_KEYS for r in train)
    assert [r["iter"] for r in val] == [0, 5, 10, 15, 20, 25, 30]
    assert all(set(r) == {"iter", "val_loss", "val_bpb", "tokens", "elapsed_s"}
               and r["tokens"] == r["iter"] * 4 * 2 * 32 for r in val)
    # wall time since launch: what bench.py race reads
    assert 0 < val[0]["elapsed_s"] < val[-1]["elapsed_s"]
    assert train[-1]["loss"] < train[0]["loss"] - 0.5, "the loss did not fall"
    assert val[-1]["val_loss"] < val[0]["val_loss"] - 0.3
    assert train[-1]["tokens"] == 30 * 4 * 2 * 32
    ckpt = os.path.join(out, "ckpt")
    # keep_ckpts=2 pruned iter 10
    assert sorted(os.listdir(ckpt)) == ["iter_0000020", "iter_0000030", "latest"]
    assert open(os.path.join(ckpt, "latest")).read().strip() == "iter_0000030"
    assert sorted(os.listdir(os.path.join(ckpt, "iter_0000030"))) == [
        ".metadata", "__0_0.distcp", "manifest.json", "meta.json", "state.pt"]
    assert json.load(open(os.path.join(out, "config.json")))["max_iters"] == 30
    assert "sample" in p.stdout
    assert next(ln for ln in p.stdout.splitlines()
                if ln.startswith("model: ")).endswith("; float32")
    s = run_train([f"out_dir={out}", "max_new_tokens=8", "num_samples=1"], cwd=tmp_path,
                  script="sample.py")
    assert "iteration 30" in s.stdout


def test_the_model_line_says_what_dtype_auto_picked(dataset, tmp_path):
    """dtype=auto (the default): the model line names the dtype this machine got, bf16 only where
    its matmuls are native (parallel.auto_dtype), and that auto picked it; an explicit dtype is
    named alone (the test above)."""
    import parallel
    p = run_train([*TINY, f"dataset={dataset}", f"out_dir={tmp_path / 'run'}", "max_iters=1",
                   "dtype=auto"], cwd=tmp_path, fork=True)
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("model: "))
    assert line.endswith(f"; {parallel.auto_dtype('cpu')} (dtype=auto)"), line


def test_embed_lr_scale_sets_the_embeddings_rate_alone(dataset, tmp_path):
    """embed_lr_scale multiplies the token embedding's learning rate and no other: at 0 the
    embedding (weight decay included) stays at its initial value while the rest trains, under
    Muon and under AdamW."""
    import checkpoint
    from model import init_tensor
    for opt in ("muon", "adamw"):
        out = str(tmp_path / opt)
        run_train([*TINY, f"dataset={dataset}", f"out_dir={out}",
                   "max_iters=3", "embed_lr_scale=0", f"optim={opt}"],
                  cwd=tmp_path, fork=True)
        model, _ = checkpoint.load_whole(checkpoint.find(out, None))
        emb, head = model.tok_embeddings.weight, model.output.weight
        assert torch.equal(emb, init_tensor("tok_embeddings.weight", emb.shape, 2, 1337)), opt
        assert not torch.equal(head, init_tensor("output.weight", head.shape, 2, 1337)), opt


def test_resume_is_bit_exact(dataset, tmp_path):
    # dropout > 0, so the RNG state must be restored too, not only weights and optimizer
    common = [*TINY, f"dataset={dataset}", "dropout=0.1", "lr_decay_iters=20", "ckpt_interval=100"]
    full, half = str(tmp_path / "full"), str(tmp_path / "half")
    run_train([*common, f"out_dir={full}", "max_iters=20"], cwd=tmp_path, fork=True)
    run_train([*common, f"out_dir={half}", "max_iters=10"], cwd=tmp_path, fork=True)
    # a crashed run may have logged past its checkpoint: those lines must be replaced, not kept
    with open(os.path.join(half, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"iter": 10, "loss": -1.0}) + "\n")
    # a checkpoint written before the ac key (issue 69) kept grad_ckpt among the model's fields:
    # it still resumes (its manifest made true again, as that run wrote it)
    ckpt = os.path.join(half, "ckpt", "iter_0000010")
    meta = json.load(open(os.path.join(ckpt, "meta.json")))
    meta["model"]["grad_ckpt"] = False
    blob = json.dumps(meta).encode()
    open(os.path.join(ckpt, "meta.json"), "wb").write(blob)
    manifest = json.load(open(os.path.join(ckpt, "manifest.json")))
    manifest["files"]["meta.json"] = {"bytes": len(blob),
                                      "sha256": hashlib.sha256(blob).hexdigest()}
    json.dump(manifest, open(os.path.join(ckpt, "manifest.json"), "w"))
    p = run_train([*common, f"out_dir={half}", "max_iters=20", "init_from=resume"], cwd=tmp_path,
                  fork=True)
    assert "resumed from" in p.stdout
    a, b = read_metrics(full), read_metrics(half)
    strip = lambda rows: [  # noqa: E731
        {k: r[k] for k in ("iter", "loss", "grad_norm", "lr", "val_loss") if k in r} for r in rows]
    assert strip(b) == strip(a)  # == on floats: bit for bit


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: on CUDA dropout draws from the GPU's "
                    "generator, whose state per rank this checks is saved and restored (CPU: the "
                    "test above)")
def test_resume_is_exact_on_gpu_with_dropout_on_two_ranks(dataset, tmp_path):
    # two ranks on one GPU (gloo over CUDA tensors would need nccl: one process per GPU is the
    # usual setup, so this runs dp=1 when there is one GPU and dp=2 when there are two)
    nproc = min(2, torch.cuda.device_count())
    common = [*TINY, f"dataset={dataset}", "device=cuda", "dtype=float32", "dropout=0.1",
              "neftune_alpha=5", "lr_decay_iters=20", "ckpt_interval=100"]
    full, half = str(tmp_path / "full"), str(tmp_path / "half")
    torchrun(nproc, [*common, f"out_dir={full}", "max_iters=20"], cwd=tmp_path)
    torchrun(nproc, [*common, f"out_dir={half}", "max_iters=10"], cwd=tmp_path)
    torchrun(nproc, [*common, f"out_dir={half}", "max_iters=20"], cwd=tmp_path)
    strip = lambda rows: [  # noqa: E731
        {k: r[k] for k in ("iter", "loss", "grad_norm", "val_loss") if k in r} for r in rows]
    assert strip(read_metrics(half)) == strip(read_metrics(full))
    state = torch.load(os.path.join(half, "ckpt", "iter_0000020", "state.pt"), weights_only=True)
    assert len(state["rng_cuda"]) == nproc


def test_config_file_and_resume_keeps_the_model_shape(dataset, tmp_path):
    cfg = tmp_path / "cfg.py"
    cfg.write_text("n_layer = 1\nn_embd = 16 * 2\nmax_iters = 3\n")
    out = str(tmp_path / "run")
    run_train([*TINY, str(cfg), f"dataset={dataset}", f"out_dir={out}"], cwd=tmp_path, fork=True)
    meta = json.load(open(os.path.join(out, "ckpt", "iter_0000003", "meta.json")))
    assert meta["model"]["n_layer"] == 1 and meta["config"]["n_layer"] == 1
    # resuming without the config file: the shape comes from the checkpoint
    rest = [a for a in TINY if not a.startswith(("n_layer=", "n_embd="))]
    run_train([*rest, f"dataset={dataset}", f"out_dir={out}", "init_from=resume", "max_iters=5"],
              cwd=tmp_path, fork=True)
    assert read_metrics(out)[-2]["iter"] == 4


@pytest.fixture(scope="module")
def saved_run(dataset, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("saved") / "run")
    run_train([*TINY, f"dataset={dataset}", f"out_dir={out}", "max_iters=2"],
              cwd=os.path.dirname(out), fork=True)
    return out


def snapshot(out):
    files = {}
    for root, _, names in os.walk(out):
        for n in names:
            # who holds out_dir (host, pid): rewritten by every run, not saved data
            if n != ".lock":
                files[os.path.join(root, n)] = open(os.path.join(root, n), "rb").read()
    return files


BAD = {
    "unknown key": (["n_layers=3"],
                    "unknown config key 'n_layers' on the command line: did you mean 'n_layer'"),
    "wrong type": (["max_iters=1.5"], "max_iters=1.5 on the command line has type float"),
    "bad init_from": (["init_from=pretrained"], "init_from='pretrained' is not"),
    "scratch over a run": (["init_from=scratch", "@saved"], "init_from=scratch but"),
    "bad nan_action": (["nan_action=ignore"], "nan_action='ignore' is not"),
    "bad dtype": (["dtype=half"], "dtype='half' is not one of auto, float32, bfloat16, float16"),
    "no gpu": (["device=cuda"], "CUDA is not available here"),
    "nccl on cpu": (["device=cpu", "backend=nccl"],
                    "backend=nccl needs CUDA tensors but device is cpu"),
    "dataset not prepared": (["dataset=nope"], "dataset 'nope' is not prepared"),
    "missing source": (["dataset=nope", "data_source=/no/such/dir"],
                       "data source '/no/such/dir' not found"),
    "vocab mismatch": (["vocab_size=1024"],
                       "was prepared with tokenizer=cl100k_base vocab_size=512"),
    "block too long": (["block_size=100000"], "fewer than block_size + 1"),
    "resume nothing": (["init_from=resume", "out_dir=empty"], "empty/ckpt has no checkpoint"),
    "resume other shape": (["init_from=resume", "n_layer=3", "@saved"],
                           "with n_layer=3 (the run has 2): pick a new out_dir"),
    "rejected key on a run": (["log_interval=0", "@saved"], "log_interval=0 must be at least 1"),
    "config file syntax": (["@badcfg"], "bad.py:2: SyntaxError"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_gives_one_clear_line(case, dataset, saved_run, tmp_path):
    args, message = BAD[case]
    if case == "no gpu" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the case checks the message where there is none")
    (tmp_path / "bad.py").write_text("n_layer = 2\nn_embd = (\n")
    args = [str(tmp_path / "bad.py") if a == "@badcfg" else a for a in args if a != "@saved"]
    args += [f"out_dir={saved_run}"] if "@saved" in BAD[case][0] else []
    before = snapshot(saved_run)
    p = run_train([*TINY, f"dataset={dataset}", "max_iters=2", *args], cwd=tmp_path, check=False,
                  fork=True)
    assert p.returncode != 0
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last, p.stderr
    assert "Traceback" not in p.stderr
    assert snapshot(saved_run) == before  # nothing already saved was touched


def test_malformed_jsonl_names_file_and_line(tmp_path):
    src = tmp_path / "c.jsonl"
    src.write_text('{"text": "a"}\n' * 5 + '{"text": oops}\n')
    p = run_train([*TINY, "dataset=chat", f"data_source={src}"], cwd=tmp_path, check=False,
                  fork=True)
    assert (p.returncode != 0 and "c.jsonl:6: malformed JSON" in p.stderr
            and "Traceback" not in p.stderr)
    assert not os.path.exists(tmp_path / "data" / "chat" / "meta.json")


def test_corrupt_checkpoint_is_reported_by_name(dataset, tmp_path):
    out = str(tmp_path / "run")
    run_train([*TINY, f"dataset={dataset}", f"out_dir={out}", "max_iters=2"], cwd=tmp_path,
              fork=True)
    shard = os.path.join(out, "ckpt", "iter_0000002", "__0_0.distcp")
    data_ = open(shard, "rb").read()
    open(shard, "wb").write(data_[: len(data_) // 2])
    p = run_train([*TINY, f"dataset={dataset}", f"out_dir={out}",
                   "init_from=resume", "max_iters=4"],
                  cwd=tmp_path, check=False, fork=True)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert "no intact checkpoint" in p.stderr and "iter_0000002: __0_0.distcp has" in p.stderr


def test_wandb_offline(dataset, tmp_path):
    out = str(tmp_path / "run")
    run_train([*TINY, f"dataset={dataset}", f"out_dir={out}", "max_iters=2", "wandb_log=True"],
              cwd=tmp_path, env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"}, fork=True)
    runs = [d for d in os.listdir(os.path.join(out, "wandb")) if d.startswith("offline-run-")]
    assert len(runs) == 1
    run_id = runs[0].rsplit("-", 1)[1]
    meta = json.load(open(os.path.join(out, "ckpt", "iter_0000002", "meta.json")))
    assert meta["wandb_id"] == run_id  # a resumed run continues this wandb run


# config mistakes caught by train.py's check pass, before the process group, the data or
# out_dir: run in this process (runpy) because there are many and each fails in milliseconds
MISTAKES = {
    "n_embd=30": "n_embd=30 is not divisible by n_head=4",
    "n_kv_head=3": "n_head=4 is not divisible by n_kv_head=3",
    "n_head=0": "n_head=0 must be at least 1",
    "block_size=0": "block_size=0 must be at least 1",
    "batch_size=-2": "batch_size=-2 must be at least 1",
    "eval_interval=0": "eval_interval=0 must be at least 1",
    "profile_iters=5-8": "profile_iters='5-8' is not 'a:b' with 0 <= a < b <= max_iters=",
    "profile_iters=8:8": "profile_iters='8:8' is not 'a:b' with 0 <= a < b",
    "log_interval=0": "log_interval=0 must be at least 1",
    "eval_iters=0": "eval_iters=0 must be at least 1",
    "dropout=1.0": "dropout=1.0 must be in [0, 1)",
    "dropout=-0.1": "dropout=-0.1 must be in [0, 1)",
    "max_iters=-1": "max_iters=-1 must not be negative",
    "out_dir=''": "out_dir='' names no directory",
    "out_dir=@file": "is a file, not a directory",
    # /sys refuses a new directory even to root, whose os.access says yes
    "out_dir=/sys/trainer_out": "out_dir=/sys/trainer_out is not writable (/sys: ",
    "fsdp=True ddp_impl=torch": "fsdp=True shards with FSDP2, so ddp_impl=torch would be ignored",
    "pp=3": "pp=3 pipeline stages do not divide the 1 ranks",
    "zero=3": "zero=3 is not a ZeRO stage we run by hand (0, 1 or 2): for stage 3 use fsdp=True",
    "zero=1 fsdp=True": "zero=1 with fsdp=True: fsdp is ZeRO stage 3",
    "zero=2 ddp_impl=naive": "zero=2 shards along the buckets of ddp_impl=bucketed",
    "offload=True": "offload=True moves sharded optimizer state to CPU memory: use it with zero=1",
    # under torchrun with 2 processes (WORLD_SIZE=2):
    # the layout is checked before the process group
    "2: pp=3": "pp=3 pipeline stages do not divide the 2 ranks",
    "2: pp=2 n_layer=1": "pp=2 stages but only n_layer=1 layers",
    "2: pp=2 pp_schedule=zb": "pp_schedule='zb' is not one of 1f1b, gpipe, interleaved",
    "2: pp=2 pp_schedule=interleaved": "interleaved 1F1B needs pp > 1 and pp_virtual >= 2",
    "2: pp=2 pp_virtual=2 pp_schedule=interleaved":
        "pp=2 x pp_virtual=2 virtual stages but only n_layer=2 layers",
    "4: pp=2 n_layer=4 pp_virtual=2 pp_schedule=interleaved grad_accum_steps=2":
        "each pipeline gets grad_accum_steps / dp = 1",
    "2: pp=2 pp_layers=2,1":
        "pp_layers='2,1' must give 2 layer counts (one per stage), each at least 1, summing to",
    "2: pp=2 n_layer=4 pp_virtual=2 pp_schedule=interleaved pp_layers=3,1":
        "pp_layers='3,1' must give 4 layer counts (one per stage, per virtual stage)",
    "2: pp=2 pp_layers=one,one":
        "pp_layers='one,one' is not a comma-separated list of layer counts",
    "2: grad_accum_steps=3":
        "grad_accum_steps=3 micro-batches per iteration cannot be shared evenly by 2",
    "4: pp=2 ddp_impl=torch": "ddp_impl=torch cannot sit inside a pipeline",
    "2: tp=4": "pp=1 x tp=4 does not divide the 2 ranks",
    "4: tp=4 n_head=2 n_kv_head=2": "tp=4 does not divide n_head=2",
    "2: tp=2 n_kv_head=1": "tp=2 does not divide n_kv_head=1",
    "2: tp=2 ffn_dim=33": "tp=2 does not divide ffn_dim=33",
    "export_hf=@full": "already exists and is not an empty directory",
    "optim=sgd": "optim='sgd' is not one of adamw, muon",
    "loss_scale_backoff=1.0": "loss_scale_backoff=1.0 must be in [0, 1)",
    "loss_scale_growth=0.5": "loss_scale_growth=0.5 must be at least 1",
    "loss_scale_init=0.5": "loss_scale_init=0.5 must be in [1, 1.8446744073709552e+19)",
    "loss_scale_interval=0": "loss_scale_interval=0 must be at least 1",
    "lr_schedule=step": "lr_schedule='step' is not one of cosine, wsd",
    "rope_scaling=yarn": "rope_scaling='yarn': write TYPE:FACTOR",
    "rope_scaling=dynamic:2": "rope_scaling='dynamic:2': write TYPE:FACTOR",
    "rope_theta=0.5": "rope_theta=0.5: give a base of at least 1",
    "head_dim=7": "head_dim=7 (n_embd / n_head = 32 / 4 unless given) is odd",
    "lora_rank=4 export_lora=adapter rope_scaling=yarn:4":
        "export_lora=adapter with rope_theta=0.0, rope_scaling='yarn:4': PEFT puts the adapters",
}


@pytest.mark.parametrize("case", list(MISTAKES))
def test_config_mistakes_are_refused_before_anything_is_touched(case, dataset, saved_run, tmp_path,
                                                                monkeypatch):
    (tmp_path / "file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    world, _, args = case.rpartition(": ")
    monkeypatch.setenv("WORLD_SIZE", world or "1")
    args = [a.replace("@file", str(tmp_path / "file")).replace("@full", str(tmp_path / "full"))
            for a in args.split()]
    monkeypatch.setattr(sys, "argv",
                        ["train.py", *TINY, f"dataset={dataset}", f"out_dir={saved_run}", *args])
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # train.py installs its own
    # (and its signal handlers: not in pytest's process)
    monkeypatch.setattr(guard_errors, "start_command", lambda *a: None)
    before = snapshot(saved_run)
    with pytest.raises(UserError) as e:
        runpy.run_path(os.path.join(ROOT, "train.py"), run_name="__main__")
    assert MISTAKES[case] in str(e.value)
    assert snapshot(saved_run) == before and (tmp_path / "full" / "keep.txt").read_text() == "mine"


def test_a_dead_peer_is_one_line_that_keeps_the_cause(capfd):
    from guards import guard_dist
    cause = "Connection reset by peer [127.0.0.1]:45678"
    err = RuntimeError(
        f"[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error: {cause}"
        f"{' while waiting for the peer of the all-reduce in process group 0' * 4}\nmore lines")
    guard_dist.run_excepthook(RuntimeError, err, None)
    line = capfd.readouterr().err.strip()
    assert line.startswith("error: a collective failed") and cause in line and "\n" not in line


def test_a_slow_end_of_run_sample_does_not_time_out_the_other_ranks(dataset, tmp_path):
    # rank 0 samples (and exports) after the process group is gone: the other rank does not
    # wait for it inside a collective, so a sample far longer than dist_timeout_s is fine
    out = str(tmp_path / "run")
    p = torchrun(2, [*TINY, f"dataset={dataset}", f"out_dir={out}", "max_iters=2",
                     "dist_timeout_s=4", "sample_tokens=4000", f"export_hf={tmp_path / 'hf'}"],
                 cwd=tmp_path, agent=True)
    assert "sample" in p.stdout and os.path.isfile(tmp_path / "hf" / "model.safetensors")
