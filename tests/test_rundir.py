"""A run directory knows what it is: init_from=auto continues only the same run, a finished
run is left alone, a refused run leaves nothing behind, and a schedule cut short says so."""

import os

from conftest import TINY, run_train


def snapshot(out):
    """Every file under out with its bytes and mtime (but the lock: who holds the run now)."""
    files = {}
    for root, _, names in os.walk(out):
        for n in set(names) - {".lock"}:
            p = os.path.join(root, n)
            files[p] = (open(p, "rb").read(), os.stat(p).st_mtime_ns)
    return files


def test_a_run_directory_knows_what_it_is(dataset, chat_dataset, tmp_path):
    out = str(tmp_path / "out")
    # max_iters below warmup_iters: the schedule says what it will do
    p = run_train([*TINY, f"dataset={dataset}", f"out_dir={out}", "max_iters=1", "warmup_iters=4"],
                  cwd=tmp_path, fork=True)
    assert ("note: max_iters=1 < warmup_iters=4: the learning rate only warms up, to "
            "2.50e-03") in p.stdout
    # the same command again: a finished run, said in one line, exit 0, nothing rewritten
    before = snapshot(out)
    p = run_train([*TINY, f"dataset={dataset}", f"out_dir={out}", "max_iters=1", "warmup_iters=4"],
                  cwd=tmp_path, fork=True)
    assert f"{out} holds a finished run (iteration 1, max_iters=1): nothing to do" in p.stdout
    assert "val loss" not in p.stdout and snapshot(out) == before
    # another dataset on the same out_dir: not continued, refused in one line
    p = run_train([*TINY, f"dataset={chat_dataset}", f"out_dir={out}", "max_iters=3"],
                  cwd=tmp_path, check=False, fork=True)
    assert p.returncode == 1 and p.stderr.count("\n") == 1, p.stderr
    assert (f"error: {out} holds a run of {dataset} at iteration 1; this command trains "
            f"dataset={chat_dataset}: pick a new out_dir, or init_from={out} to start from its "
            "weights") in p.stderr
    assert snapshot(out) == before
    # only the tokenizer changed (the data re-prepared with it under the same name, say): another
    # run too, refused before the data is read, not taken for the finished one (max_iters=1)
    for key, value, had in (("tokenizer", "gpt2", "cl100k_base"), ("vocab_size", 256, 512),
                            ("optim", "muon", "adamw")):
        p = run_train([*TINY, f"dataset={dataset}", f"out_dir={out}", "max_iters=1",
                       "warmup_iters=4", f"{key}={value}"], cwd=tmp_path, check=False, fork=True)
        assert p.returncode == 1 and p.stderr.count("\n") == 1, p.stderr
        assert (f"error: {out} holds a run of {dataset} at iteration 1; this command trains "
                f"dataset={dataset} with {key}={value} (the run has {had}): pick a new "
                "out_dir") in p.stderr, p.stderr
    assert snapshot(out) == before
    # init_from= the out_dir itself: the advice is not the command just refused; an export asked of
    # a finished run is not skipped in silence
    for extra, says in (
            (f"init_from={out}",
             "init_from= names out_dir itself: drop init_from= to continue the run"),
            (f"export_hf={tmp_path / 'hf'}",
             f"and export_hf= is written when a run ends: `python sample.py out_dir={out} "
             f"export_hf={tmp_path / 'hf'}`"),
            (f"export_lora={tmp_path / 'ad'}", "and export_lora= is written when a run ends")):
        p = run_train([*TINY, f"dataset={dataset}", f"out_dir={out}",
                       "max_iters=1", "warmup_iters=4", extra],
                      cwd=tmp_path, check=False, fork=True)
        assert p.returncode == 1 and p.stderr.count("\n") == 1 and says in p.stderr, p.stderr
    assert snapshot(out) == before and not os.path.exists(tmp_path / "hf")
    # init_from=resume with nothing there: refused, and no directory left behind
    p = run_train(
        [*TINY, f"dataset={dataset}", f"out_dir={tmp_path / 'nothing'}", "init_from=resume"],
        cwd=tmp_path, check=False, fork=True)
    assert (p.returncode == 1 and "init_from=resume but" in p.stderr
            and not os.path.exists(tmp_path / "nothing"))


def test_one_error_line_per_run_under_torchrun(tmp_path):
    """A config error (every rank meets it: rank 0 tells it) and an error only rank 0 meets
    (preparing data from a missing source, while rank 1 waits at a barrier): each is one line,
    the last before torchrun's report, and the exit code is non-zero."""
    import re

    from conftest import torchrun
    for args, match in ((["max_iters=-1"], "error: max_iters=-1 must not be negative"),
                        (["dataset=nope", "data_source=/nonexistent/x",
                          f"out_dir={tmp_path / 'o'}"],
                         "error: data source '/nonexistent/x' not found")):
        p = torchrun(2, [*TINY, *args], cwd=tmp_path, check=False, agent=True)
        lines = p.stderr.splitlines()
        # torchrun's first line
        report = next(i for i, line in enumerate(lines) if re.match(r"[EWI]\d{4} ", line))
        assert p.returncode != 0 and sum("error" in line for line in lines[:report]) == 1, p.stderr
        assert lines[report - 1].startswith(match), p.stderr
    assert not os.path.exists(tmp_path / "o")


def test_a_stopped_run_exits_as_a_shell_reports_its_signal():
    """128 + the signal a rank got (143: SIGTERM, 130: Ctrl-C, 138: SIGUSR1), and SIGTERM's on a
    rank that stopped because another rank got one
    (test_resilience watches both under torchrun)."""
    import signal

    import rundir as saves
    received = ([signal.SIGTERM], [signal.SIGINT], [signal.SIGUSR1], [])
    assert [saves.exit_code(r) for r in received] == [143, 130, 138, 143]


def tensorboard_scalars(path):
    """{tag: [(step, value)]} of the event files in path, read by TensorBoard's own reader
    (which hides what a purge_step drops, as the TensorBoard page does)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(path, size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def test_tensorboard_holds_metrics_jsonl_numbers_on_a_resumed_run_too(dataset, tmp_path):
    """tensorboard_log=True: rank 0's records as event files in out_dir/tb, read back by
    TensorBoard's event reader, are metrics.jsonl's numbers, each at its iteration (train lines,
    evaluations with bits per byte and a task's scores). A run that went on past its last
    checkpoint (iterations 4-5 logged, then lost) and is resumed from it: its steps from the
    checkpoint on are replaced, not doubled (purge_step), and the evaluation the checkpoint was
    saved after is kept, as metrics.jsonl keeps it."""
    import json
    import shutil

    from conftest import read_metrics
    task = tmp_path / "t.jsonl"
    task.write_text(json.dumps({"context": "import ", "choices": ["os", "sys"], "answer": 0}))
    out = str(tmp_path / "run")
    args = [*TINY, f"dataset={dataset}", f"out_dir={out}", "max_iters=6", "ckpt_interval=3",
            "eval_interval=3", f"eval_tasks={task}", "keep_ckpts=0", "tensorboard_log=True"]
    run_train(args, cwd=tmp_path, fork=True)
    first = read_metrics(out)
    # the run died after iteration 5 with its last checkpoint at 3: events 3-5 are stale
    shutil.rmtree(os.path.join(out, "ckpt", "iter_0000006"))
    with open(os.path.join(out, "ckpt", "latest"), "w") as f:
        f.write("iter_0000003\n")
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in first if r["iter"] < 6)
    run_train([*args, "init_from=resume"], cwd=tmp_path, fork=True)
    rows = read_metrics(out)
    want = {}
    for r in rows:
        for k, v in r.items():
            if k != "iter" and isinstance(v, (int, float)):
                want.setdefault(k, []).append((r["iter"], v))
    got = tensorboard_scalars(os.path.join(out, "tb"))
    assert set(got) == set(want) and {"loss", "lr", "grad_norm", "tok_per_s", "mfu", "val_loss",
                                      "val_bpb", "task/t/acc", "task/t/acc_norm"} <= set(got)
    for k in want:  # (float32 in the event file)
        assert [s for s, _ in got[k]] == [s for s, _ in want[k]], k
        assert all(abs(a - b) <= 1e-6 * abs(b) + 1e-30 for (_, a), (_, b) in zip(got[k], want[k]))
    assert [s for s, _ in got["val_loss"]] == [0, 3, 6] and len(got["loss"]) == 6


def test_tensorboard_missing_is_one_line_naming_the_install(monkeypatch):
    """tensorboard_log=True without the tensorboard package: the config check (before anything
    touches the disk) says which package to install."""
    import sys

    import pytest

    from guards import guard_config
    from guards.guard_errors import UserError
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # (import tensorboard: ImportError)
    wanted, checked = next(f for f in guard_config.FEATURE_CHECKS
                           if f[1] is guard_config._check_tensorboard)
    assert wanted({"tensorboard_log": True}, {})
    with pytest.raises(UserError, match=r"tensorboard_log=True needs the tensorboard package, "
                                        r"which is not installed: pip install tensorboard"):
        checked({}, {})


def test_tensorboard_reopens_its_stream_where_a_rollback_goes_back(tmp_path):
    """The NaN guard's rollback in the same process: a step lower than the last one written
    reopens the stream there (purge_step), keeping metrics.jsonl's evaluation at it."""
    import json

    import rundir
    out = tmp_path / "run"
    out.mkdir()
    tb = rundir.TensorBoard(str(out), "", 0)
    for it in range(6):
        tb.log({"loss": 10.0 - it}, it)
        if it == 3:
            tb.log({"val_loss": 7.5}, 3)
    # rolled back to the checkpoint at 3: metrics.jsonl cut there, its evaluation at 3 kept
    (out / "metrics.jsonl").write_text(json.dumps({"iter": 3, "val_loss": 7.5}) + "\n")
    for it in range(3, 5):
        tb.log({"loss": 20.0 - it}, it)
    tb.finish()
    got = tensorboard_scalars(str(out / "tb"))
    assert got["loss"] == [(0, 10.0), (1, 9.0), (2, 8.0), (3, 17.0), (4, 16.0)]
    assert got["val_loss"] == [(3, 7.5)]
