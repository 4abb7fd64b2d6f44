"""Faults: non-finite steps, signals, killed ranks under torchrun restarts, half-written and
corrupted checkpoints, failed saves. Real processes on CPU."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import torch
from conftest import ROOT, TINY, assert_same_curve, read_metrics, run_train, torchrun

FAULTS = os.path.join("tests", "faults.py")  # train.py with the faults its environment asks for

import faults
import rundir

# long enough to be interrupted mid-run (a few seconds), with a checkpoint every 5 iterations
LONG = [*TINY, "max_iters=60", "lr_decay_iters=60", "ckpt_interval=5", "eval_interval=20",
        "keep_ckpts=3"]


def trained(rows):
    """{iter: (loss, grad_norm)} of the steps that updated the weights."""
    return {r["iter"]: (r["loss"], r["grad_norm"]) for r in rows if r.get("loss") is not None}


def skipped(rows):
    return sorted(r["iter"] for r in rows if r.get("skipped"))


def nan_gradients_at_3(rank):
    """before= of torchrun: iteration 3's gradients become NaN just before clipping measures
    them, its loss stays finite (faults.nan_at poisons the loss, and so both)."""
    import parallel
    clip, calls = parallel.clip_grad_norm_, [0]

    def clip_grad_norm_(params, *args, **kw):
        calls[0] += 1
        if calls[0] == 4:
            for p in params:
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
        return clip(params, *args, **kw)
    parallel.clip_grad_norm_ = clip_grad_norm_


def test_nan_step_is_skipped_and_leaves_the_weights_alone(dataset, tmp_path):
    common = [*TINY, f"dataset={dataset}", "lr_decay_iters=8"]
    before, poisoned, grads = (str(tmp_path / "before"), str(tmp_path / "poisoned"),
                               str(tmp_path / "grads"))
    run_train([*common, f"out_dir={before}", "max_iters=3"], cwd=tmp_path, fork=True)
    p = run_train([*common, f"out_dir={poisoned}", "max_iters=8", "ckpt_interval=4"], cwd=tmp_path,
                  script=FAULTS, env=faults.nan_at(3), fork=True)
    assert "iter 3: non-finite" in p.stdout and "step skipped" in p.stdout
    rows = read_metrics(poisoned)
    # and the run went on
    assert skipped(rows) == [3] and sorted(trained(rows)) == [0, 1, 2, 4, 5, 6, 7]
    # only the gradients non-finite, the loss finite: skipped alike (one process,
    # watched from inside)
    p = torchrun(1, [*common, f"out_dir={grads}", "max_iters=4", "ckpt_interval=4"], cwd=tmp_path,
                 before=nan_gradients_at_3)
    assert ("iter 3: non-finite loss" in p.stdout
            and skipped(read_metrics(grads)) == [3]), p.stdout[-2000:]
    # the weights after iterations 0-3 (iteration 3 skipped) are those after 0-2, bit for bit
    import checkpoint
    a, b, c = (checkpoint.load_whole(f"{out}/ckpt/iter_{it:07d}")[0].state_dict()
               for out, it in ((before, 3), (poisoned, 4), (grads, 4)))
    assert set(a) == set(b) == set(c) and all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k])
                                              for k in a)


def test_rollback_after_consecutive_nans_steps_over_the_bad_window(dataset, tmp_path):
    common = [*TINY, f"dataset={dataset}", "max_iters=14", "lr_decay_iters=14", "ckpt_interval=4"]
    nans = dict(script=FAULTS, env=faults.nan_at(5, 3))
    # async saves: the rollback first finishes the save in flight (the checkpoint of iteration 4)
    p = run_train([*common, f"out_dir={tmp_path / 'rollback'}",
                   "nan_max_consecutive=3", "ckpt_async=True"],
                  cwd=tmp_path, **nans, fork=True)
    assert "rolled back to" in p.stdout and "iter_0000004" in p.stdout
    # the same bad window without a rollback (only skips): a rollback must not change the curve
    run_train([*common, f"out_dir={tmp_path / 'skips'}", "nan_max_consecutive=100"], cwd=tmp_path,
              **nans, fork=True)
    a, b = read_metrics(str(tmp_path / "rollback")), read_metrics(str(tmp_path / "skips"))
    assert skipped(a) == skipped(b) == [5, 6, 7]
    assert (trained(a) == trained(b)
            and sorted(trained(a)) == [i for i in range(14) if i not in (5, 6, 7)])
    p = run_train([*common, f"out_dir={tmp_path / 'stop'}",
                   "nan_max_consecutive=2", "nan_action=stop"],
                  cwd=tmp_path, check=False, **nans, fork=True)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith(
        "error: 2 iterations in a row (up to 6) had a non-finite")


def test_a_fault_that_outlives_its_rollback_stops_the_run(dataset, tmp_path):
    """NaNs from iteration 3 on: the rollback lands on the checkpoint of iteration 4, saved
    inside the streak, and the NaNs come back at once: the run stops (non-zero, one line)
    instead of skipping its way to max_iters."""
    p = run_train([*TINY, f"dataset={dataset}", f"out_dir={tmp_path / 'run'}",
                   "max_iters=10", "ckpt_interval=4"],
                  cwd=tmp_path, check=False, script=FAULTS, env=faults.nan_at(3, 100),
                  fork=True)
    assert (p.returncode == 1 and "rolled back to" in p.stdout
            and "Traceback" not in p.stderr), p.stderr[-2000:]
    assert p.stderr.strip().splitlines() == [
        "error: 3 more iterations in a row (up to 8) had a non-finite loss or gradient norm right "
        "after rolling back: the fault outlives a rollback, so it is not a few bad batches; lower "
        "learning_rate, check the data from there on, or resume from an earlier checkpoint"]


def rank_pids(out_dir):
    """pid -> RANK of the train.py processes writing to out_dir."""
    pids = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if any(c.endswith(b"train.py") for c in cmd) and f"out_dir={out_dir}".encode() in cmd:
            ranks = [e[5:] for e in env if e.startswith(b"RANK=")]
            if ranks:
                pids[int(pid)] = int(ranks[0])
    return pids


def start_torchrun(args, cwd, extra=(), faults_env=None):
    """torchrun --standalone with 2 ranks of train.py (of tests/faults.py with faults_env:
    its faults)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(faults_env or {})}
    script = os.path.join(ROOT, FAULTS if faults_env else "train.py")
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc_per_node=2", *extra, script, *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_iter(out_dir, it, proc, timeout=120):
    deadline = time.time() + timeout
    while True:
        path = os.path.join(out_dir, "metrics.jsonl")
        if os.path.exists(path) and any(r.get("iter", -1) >= it and "loss" in r
                                        for r in read_metrics(out_dir)):
            return
        assert (time.time() < deadline
                and proc.poll() is None), ("the run ended or stalled before iteration %d" % it)
        time.sleep(0.05)


def test_sigterm_to_one_rank_checkpoints_and_exits_cleanly(dataset, tmp_path):
    out = str(tmp_path / "run")
    # async saves: the stop waits for the save in flight, then writes (and finishes) the last one
    # the agent looks at its workers once a second (not every 0.1 s): both ranks end within it, so
    # its report lists both, and each must say 143
    proc = start_torchrun([*LONG, f"dataset={dataset}", f"out_dir={out}", "ckpt_async=True"],
                          tmp_path, extra=["--monitor-interval=1"])
    try:
        wait_for_iter(out, 7, proc)
        rank1 = [pid for pid, rank in rank_pids(out).items() if rank == 1]
        assert len(rank1) == 1
        os.kill(rank1[0], signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    # stopped, not finished: 128 + SIGTERM on the rank that got it and on the rank it stopped
    codes = dict(re.findall(r"rank {6}: (\d) \(local_rank: \d\)\n {2}exitcode  : (-?\d+)", err))
    assert proc.returncode != 0 and codes == {"0": "143", "1": "143"}, err[-3000:]
    with open(os.path.join(out, "ckpt", "latest")) as f:
        stopped = int(f.read().strip()[5:])
    assert 7 < stopped < 60 and "got SIGTERM" in err
    # stopped right after that step
    assert max(r["iter"] for r in read_metrics(out) if "loss" in r) == stopped - 1
    # run again: it continues, and the curve is the uninterrupted one
    full = str(tmp_path / "full")
    run_train([*LONG, f"dataset={dataset}", f"out_dir={full}"], cwd=tmp_path, fork=True)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node=2", os.path.join(ROOT, "train.py"),
                        *LONG, f"dataset={dataset}", f"out_dir={out}"],
                       cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"},
                       capture_output=True, text=True)
    assert (p.returncode == 0
            and f"resumed from {out}/ckpt/iter_{stopped:07d}" in p.stdout), p.stderr[-2000:]
    assert_same_curve(read_metrics(full), read_metrics(out))


def test_sigkill_under_torchrun_restarts_resumes_and_completes(dataset, tmp_path):
    out, full = str(tmp_path / "run"), str(tmp_path / "full")
    proc = start_torchrun([*LONG, f"dataset={dataset}", f"out_dir={out}"], tmp_path,
                          extra=["--max-restarts=1"])
    try:
        wait_for_iter(out, 12, proc)  # past the checkpoint at 10
        victim = [pid for pid, rank in rank_pids(out).items() if rank == 1]
        os.kill(victim[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    run_train([*LONG, f"dataset={dataset}", f"out_dir={full}"], cwd=tmp_path, fork=True)
    rows = read_metrics(out)
    assert max(r["iter"] for r in rows if "loss" in r) == 59
    assert_same_curve(read_metrics(full), rows)


def test_partial_and_corrupt_checkpoints_are_skipped(dataset, tmp_path):
    common = [*TINY, f"dataset={dataset}", "lr_decay_iters=12", "ckpt_interval=4", "keep_ckpts=3"]
    full, out = str(tmp_path / "full"), str(tmp_path / "run")
    run_train([*common, f"out_dir={full}", "max_iters=12"], cwd=tmp_path, fork=True)
    run_train([*common, f"out_dir={out}", "max_iters=8"], cwd=tmp_path, fork=True)
    ckpt = os.path.join(out, "ckpt")
    # a save killed half-way: its temporary directory, and a directory without a manifest
    shutil.copytree(os.path.join(ckpt, "iter_0000008"), os.path.join(ckpt, ".tmp_iter_0000012"))
    shutil.copytree(os.path.join(ckpt, "iter_0000008"), os.path.join(ckpt, "iter_0000011"))
    os.remove(os.path.join(ckpt, "iter_0000011", "manifest.json"))
    # and the newest complete one corrupted (same size, one byte flipped)
    shard = os.path.join(ckpt, "iter_0000008", "__0_0.distcp")
    blob = bytearray(open(shard, "rb").read())
    blob[len(blob) // 2] ^= 0xFF
    open(shard, "wb").write(bytes(blob))
    p = run_train([*common, f"out_dir={out}", "max_iters=12"], cwd=tmp_path, fork=True)
    assert "iter_0000008 is corrupt (__0_0.distcp does not match its checksum" in p.stdout
    assert "iter_0000011 is corrupt (manifest.json is missing" in p.stdout
    assert f"resumed from {ckpt}/iter_0000004" in p.stdout
    assert_same_curve(read_metrics(full), read_metrics(out))


def test_a_failed_save_is_reported_and_keeps_the_earlier_checkpoints(dataset, tmp_path):
    out = str(tmp_path / "run")
    common = [*TINY, f"dataset={dataset}", f"out_dir={out}", "lr_decay_iters=8", "ckpt_interval=4"]
    run_train([*common, "max_iters=4"], cwd=tmp_path, fork=True)
    # the temporary directory of the next save cannot be created (a file is in the way; as
    # root, permissions would not stop us, so this stands in for a full or read-only disk)
    open(os.path.join(out, "ckpt", ".tmp_iter_0000008"), "w").close()
    p = run_train([*common, "max_iters=8"], cwd=tmp_path, check=False, fork=True)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith(
        "error: saving checkpoint iter_0000008 failed")
    assert sorted(os.listdir(os.path.join(out, "ckpt"))) == [
        ".tmp_iter_0000008", "iter_0000004", "latest"]
    os.remove(os.path.join(out, "ckpt", ".tmp_iter_0000008"))
    # the earlier checkpoint still resumes
    p = run_train([*common, "max_iters=8"], cwd=tmp_path, fork=True)
    assert f"resumed from {out}/ckpt/iter_0000004" in p.stdout


def test_async_saves_overlap_the_loop_survive_sigkill_mid_write_and_resume_exactly(
        dataset, tmp_path):
    # dropout: the resumed run must restore the RNG states of the saved iteration,
    # not of when its save finished
    common = [*TINY, f"dataset={dataset}", "max_iters=12", "lr_decay_iters=12", "ckpt_interval=4",
              "dropout=0.1", "ckpt_async=True"]
    out = str(tmp_path / "run")
    ckpt = os.path.join(out, "ckpt")

    def latest():
        path = os.path.join(ckpt, "latest")
        return open(path).read().strip() if os.path.exists(path) else None

    # async saves on a slow disk (every write 1.5 s late), 2 ranks, killed while the save of
    # iteration 8 is being written (the loop meanwhile went on to iteration 8 or further)
    proc = start_torchrun([*common, f"out_dir={out}"], tmp_path,
                          faults_env={"FAULT_SAVE_DELAY_S": "1.5"})
    try:
        deadline = time.time() + 120
        while not (latest() == "iter_0000004"
                   and os.path.isdir(os.path.join(ckpt, ".tmp_iter_0000008"))):
            assert (time.time() < deadline
                    and proc.poll() is None), "the run ended or stalled before its second save"
            time.sleep(0.05)
        for pid in rank_pids(out):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        stdout, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    finished = re.search(
        r"saved checkpoint \S+iter_0000004 \(async: finished at iteration (\d+)\)", stdout)
    # the loop went on while iteration 4 was written
    assert finished and int(finished[1]) > 4, stdout[-2000:]
    # the killed save never became latest
    assert latest() == "iter_0000004" and "iter_0000008" not in os.listdir(ckpt)
    # a line torn by the kill is dropped
    killed = rundir.read_metrics(os.path.join(out, "metrics.jsonl"))
    # run again (no save before the end): it resumes from iteration 4, removes the killed save's
    # temporary directory, and repeats the killed run's iterations from 4 on bit for bit
    p = run_train(
        ["--standalone", "--nproc_per_node=2", os.path.join(ROOT, "train.py"), *common,
         f"out_dir={out}", "ckpt_interval=100"], cwd=tmp_path, script="-m torch.distributed.run")
    assert f"resumed from {ckpt}/iter_0000004" in p.stdout
    assert (sorted(os.listdir(ckpt)) == ["iter_0000004", "iter_0000012", "latest"]
            and latest() == "iter_0000012")
    strip = lambda rows: [  # noqa: E731
        {k: r[k] for k in ("iter", "loss", "grad_norm", "lr", "val_loss") if k in r} for r in rows]
    again = strip(read_metrics(out))[:len(killed)]
    # == on floats
    assert [r["iter"] for r in killed if "loss" in r][-1] >= 7 and strip(killed) == again


def test_ctrl_c_saves_and_exits_130_and_at_startup_is_one_line(dataset, corpus, tmp_path):
    """Ctrl-C in the loop: the step ends, a checkpoint is saved, exit 130 (so `train.py &&
    sample.py` stops there). Ctrl-C while the data is being prepared: one line, exit 130, and
    neither a half-prepared dataset nor an out_dir left behind."""
    out = str(tmp_path / "run")
    # a run that cannot end before the signal: LONG's 60 tiny iterations take about a second, and
    # on a loaded machine they ended between the check for iteration 3 and the signal (exit 0)
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"),
                             *LONG, "max_iters=1000000",
                             f"dataset={dataset}", f"out_dir={out}"], cwd=tmp_path,
                            env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_iter(out, 3, proc)
        proc.send_signal(signal.SIGINT)
        stdout, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    with open(os.path.join(out, "ckpt", "latest")) as f:
        stopped = int(f.read().strip()[5:])
    assert f"stopped by SIGINT after iteration {stopped}: checkpoint saved" in stdout
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"),
                             *LONG, "dataset=fresh",
                             "data_source=stdlib", f"out_dir={tmp_path / 'never'}"], cwd=tmp_path,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # the whole standard library takes a while to tokenize
            if line.startswith("preparing data/fresh"):
                time.sleep(0.5)
                proc.send_signal(signal.SIGINT)
                break
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130 and err.splitlines() == [
        "interrupted (Ctrl-C): stopped before finishing; what was written is whole, run the "
        "command again"], err
    assert not os.path.exists(tmp_path / "data") or not os.listdir(tmp_path / "data")
    assert not os.path.exists(tmp_path / "never")
