"""What the tables share: train.py's default model and batch, the sizes they measure at (tiny under
--smoke), timing a training step, running a row in a fresh process or a worker on spawned ranks."""

import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

import configurator
import workarounds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_PY = os.path.join(ROOT, "train.py")
BENCH_PY = os.path.join(ROOT, "bench.py")

# --smoke: each table at a tiny model and a row or two of each kind, so that a test runs them all
# in one launch (tests/test_bench.py): what breaks shows, the numbers mean nothing. The ranks and
# rows it starts import this file again and read BENCH_SMOKE: tiny there too.
SMOKE = "--smoke" in sys.argv or os.environ.get("BENCH_SMOKE") == "1"
SMOKE_KEYS = dict(vocab_size=512, n_layer=8, n_head=4, n_kv_head=2, n_embd=32, block_size=16,
                  batch_size=2, grad_accum_steps=2, eval_iters=1)
if SMOKE:
    os.environ["BENCH_SMOKE"] = "1"


def sized(shape):
    """A model shape as the tables give it, or (--smoke) cut to the tiny model's size."""
    if SMOKE:
        shape.update({k: SMOKE_KEYS[k] for k in ("vocab_size", "block_size", "n_layer", "n_embd")})
    return shape


def default_threads_env(**extra):
    """os.environ without OMP_NUM_THREADS (torch's default: the machine's threads),
    plus `extra`."""
    return {**{k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}, **extra}


# the default model and batch of train.py, read from its defaults block
TRAIN = configurator.script_defaults(TRAIN_PY)
if SMOKE:
    TRAIN.update(SMOKE_KEYS)
# the tables were measured on 128-token sequences (the default job trains 64)
MODEL = sized({**{k: TRAIN[k] for k in ("vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd")},
               "block_size": 128})
# 4096 tokens/iter, as the tables were measured (the default job trains 1536)
BATCH, ACCUM = 2 if SMOKE else 16, 2
WARMUP, ITERS = (0, 1) if SMOKE else (3, 10)
# key=value for the train.py runs of race, mfu and reading (--smoke: a tiny model's,
# then the command's)
RUN_KEYS = ([f"{k}={v}" for k, v in SMOKE_KEYS.items()] + [a for a in sys.argv[1:] if "=" in a]
            if SMOKE else [])


def peak_memory_mb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def vm_kb(field):
    """This process's VmRSS or VmHWM (peak RSS) from /proc/self/status, in KiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def peak_and_median(step, device):
    """A fresh process's first step()'s peak memory above what it held before, in MB (CUDA: max
    allocated; CPU: max RSS, which later steps may hide in memory the heap kept), then the
    median ms of ITERS steps after WARMUP: {"ms", "peak_mb"}."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        peak = (torch.cuda.max_memory_allocated() - before) / 2 ** 20
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM, the peak RSS, to the current RSS (Linux)
        before = vm_kb("VmRSS")
        step()
        peak = (vm_kb("VmHWM") - before) / 1024
    times = []
    for _ in range(WARMUP + ITERS):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return {"ms": sorted(times[WARMUP:])[ITERS // 2] * 1000, "peak_mb": peak}


def median_step_time(model, opt, x, autocast, keep_grads=False):
    """Seconds per training step (ACCUM micro-steps of x, then AdamW), the median of ITERS after
    WARMUP: robust to a noisy neighbour. keep_grads: the last step's gradients stay,
    to be counted."""
    times = []
    for i in range(WARMUP + ITERS):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for k in range(ACCUM):
            with autocast:
                _, loss = model(x[k, :, :-1], x[k, :, 1:])
            (loss / ACCUM).backward()
        opt.step()
        loss.item()
        times.append(time.perf_counter() - t0)
    if not keep_grads:
        opt.zero_grad(set_to_none=True)
    return sorted(times[WARMUP:])[ITERS // 2]


def in_subprocess(table, **kw):
    """Runs one row in a fresh interpreter (own peak memory) and returns its dict."""
    if SMOKE:  # a tiny row: its peak memory means nothing anyway
        from bench.__main__ import ROWS
        return ROWS[table](**kw)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count()))}
    out = subprocess.run([sys.executable, BENCH_PY, "--row", table, json.dumps(kw)], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_ranks(worker, world, *args):
    """Runs worker(*args) on `world` spawned ranks (gloo on CPU, nccl on GPUs) and returns what
    rank 0's call returned (JSON-able)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        # smoke on a CPU: forked ranks start at once (no interpreter to start, no imports again)
        how = "fork" if SMOKE and not torch.cuda.is_available() else "spawn"
        mp.start_processes(_rank_main, args=(world, port, worker, args, out), nprocs=world,
                           start_method=how)
        with open(out) as f:
            return json.load(f)


def _rank_main(rank, world, port, worker, args, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # the cores, shared out
    result = worker(*args)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    workarounds.exit_now()  # skip the interpreter's shutdown, where gloo's threads can abort


def nanogpt_dir(*files):
    """./nanogpt or $NANOGPT_DIR when it holds nanoGPT's `files` (git-ignored:
    fetched by hand), else None."""
    src = os.environ.get("NANOGPT_DIR", os.path.join(ROOT, "nanogpt"))
    return src if all(os.path.isfile(os.path.join(src, f)) for f in files) else None
