import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import data  # noqa: E402

# a tiny model and batch: a run of 20 iterations takes a few seconds on one core
TINY = ["n_layer=2", "n_head=4", "n_kv_head=2", "n_embd=32", "block_size=32", "batch_size=4",
        "grad_accum_steps=2", "vocab_size=512", "eval_iters=2", "eval_interval=5", "log_interval=1",
        "warmup_iters=2", "learning_rate=1e-2", "min_lr=1e-3", "peak_flops=1e9", "sample_tokens=0"]


def write_corpus(root, n_docs=40, chars=3000):
    """A small .txt corpus cut from the standard library's sources (real text, deterministic)."""
    _, files = data.stdlib_files()
    os.makedirs(root, exist_ok=True)
    for i, path in enumerate(files[:n_docs]):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()[:chars]
        with open(os.path.join(root, f"doc{i:03d}.txt"), "w", encoding="utf-8") as f:
            f.write(text)
    return root


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    return write_corpus(str(tmp_path_factory.mktemp("corpus")))


@pytest.fixture(scope="session")
def dataset(tmp_path_factory, corpus):
    """The tiny corpus prepared with a 512-id tokenizer; val holds about a fifth of the files."""
    out = str(tmp_path_factory.mktemp("data") / "tiny")
    data.prepare(corpus, out, "cl100k_base", 512, val_fraction=0.2, verbose=False)
    return out


def run_train(args, cwd, check=True, timeout=300, script="train.py", env=None):
    """Runs train.py (or another script) as its own process, the way a user does."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", **(env or {})}
    cmd = script.split() if script.startswith("-m ") else [os.path.join(ROOT, script)]
    p = subprocess.run([sys.executable, *cmd, *args], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{script} {' '.join(args)} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def read_metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(rank, world, port, fn, args, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    import torch
    import parallel
    torch.set_num_threads(1)
    mesh = parallel.setup("cpu", dist_timeout_s=120)
    try:
        torch.save(fn(mesh, *args), os.path.join(out_dir, f"{rank}.pt"))
    finally:
        parallel.teardown(mesh)


def spawn(fn, world, *args):
    """Runs fn(mesh, *args) on `world` real gloo processes; returns each rank's result (tensors,
    dicts, lists, numbers). fn must live at module level so the spawned processes can import it."""
    import tempfile
    import torch
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_rank_entry, args=(world, free_port(), fn, args, out_dir), nprocs=world,
                           start_method="spawn")
        return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=True) for r in range(world)]


def torchrun(nproc, args, cwd, check=True, timeout=300):
    """train.py under torchrun --standalone with nproc gloo ranks on CPU."""
    return run_train(["--standalone", f"--nproc_per_node={nproc}", os.path.join(ROOT, "train.py"), *args],
                     cwd, check=check, timeout=timeout, script="-m torch.distributed.run")
