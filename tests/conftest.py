"""Fixtures and helpers shared by the tests, and the suite's two rules.

1. Every layout, resumed or not, reproduces the single-process run of the same config
   (assert_same_curve), with real gloo processes on CPU (torchrun, spawn).
2. Every hand-written piece is checked at least once against an implementation that shares
   none of our code (torch's DDP, ZeroRedundancyOptimizer, clip_grad_norm_, lr_scheduler,
   pipelining and parallelize_module; transformers, peft, safetensors): rule 1 compares our
   code with itself, and a mistake in a function both sides call passes it. docs/tests.md
   lists each piece with its peer, and each combination of options train.py accepts with its run.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import prepare
from formats import corpora
import workarounds

# folders beside the project's files that are not wings of it: the tests, the benchmarks (they
# sit on top of everything), configs, docs, datasets and runs
NOT_WINGS = {"tests", "bench", "config", "docs", "data", "out", "runs", "wandb", "nanogpt"}


def project_files():
    """The project's .py files as paths from ROOT: the root's ('train.py') and each wing's
    ('techniques/zero.py': a folder of them beside the root's), bench.py and __init__.py aside.
    Every check that knows "a project file" asks here: a file moved into a wing stays checked."""
    def py(folder):
        return sorted(f for f in os.listdir(os.path.join(ROOT, folder))
                      if f.endswith(".py") and f not in ("bench.py", "__init__.py"))
    wings = sorted(d for d in os.listdir(ROOT) if os.path.isdir(os.path.join(ROOT, d))
                   and d not in NOT_WINGS and not d.startswith(".") and py(d))
    return py("") + [f"{w}/{f}" for w in wings for f in py(w)]


def module_of(path):
    """'techniques/zero.py' -> 'techniques.zero', the name an import gives it."""
    return path[:-3].replace("/", ".")


# a tiny model and batch: a run of 20 iterations takes a few seconds on one core
TINY = ["n_layer=2", "n_head=4", "n_kv_head=2", "n_embd=32", "block_size=32", "batch_size=4",
        "grad_accum_steps=2", "vocab_size=512", "eval_iters=2", "eval_interval=5",
        "log_interval=1", "warmup_iters=2", "learning_rate=1e-2", "min_lr=1e-3", "peak_flops=1e9",
        "sample_tokens=0", "optim=adamw", "dtype=float32", "beta2=0.95"]
# float32 on every CPU (dtype=auto picks bf16 on AVX512-BF16 ones, and layouts compare to float
# rounding); beta2=0.95 (the default is 0.99): REFERENCE's grad norms then reach 0.87,
# so its clip clips


# the run every layout must reproduce: 4 layers (so pp=4 has one per stage), 4 micro-batches,
# a clip that clips (its grad norms reach 0.87)
REFERENCE = [*TINY, "n_layer=4", "grad_accum_steps=4", "max_iters=8", "grad_clip=0.5"]

# two pipeline stages, each two chunks of one of REFERENCE's layers (interleaved 1F1B)
INTERLEAVED = ["pp=2", "pp_schedule=interleaved", "pp_virtual=2", "pp_layers=1,1,1,1"]

# the model that in-process and spawned tests build directly (ModelConfig keyword arguments)
CFG = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)

# a tiny Hugging Face LLaMA (the continual-pretraining and LoRA tests start from it), and the run
# keys of TINY without the model's shape, which comes from the HF directory
HF = dict(vocab_size=512, hidden_size=32, intermediate_size=96, num_hidden_layers=2,
          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
          rms_norm_eps=1e-5, tie_word_embeddings=False)
RUN = [a for a in TINY if not a.startswith(("n_layer=", "n_head=", "n_kv_head=", "n_embd="))]

# SFT on the chat dataset below: 4 layers, 4 micro-batches, document masking
SFT = [*TINY, "n_layer=4", "grad_accum_steps=4", "max_iters=6", "doc_mask=True",
       "learning_rate=3e-3"]


def tiny_model(**kw):
    """A small model in eval mode, the same weights every time (seed 0);
    kw overrides CFG-like fields."""
    torch.manual_seed(0)
    cfg = dict(vocab_size=97, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
    from model import ModelConfig, Transformer
    return Transformer(ModelConfig(**{**cfg, **kw})).eval()


def write_corpus(root, n_docs=40, chars=3000):
    """A small .txt corpus cut from the standard library's sources (real text, deterministic)."""
    _, files = corpora.stdlib_files()
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
    prepare.prepare(corpus, out, "cl100k_base", 512, val_fraction=0.2, verbose=False)
    return out


def run_train(args, cwd, check=True, timeout=300, script="train.py", env=None, fork=False):
    """Runs train.py (or another script) as its own process, the way a user does. fork=True:
    train.py as one plain process (no RANK) forked from torchrun's forkserver below, which has
    imported torch and the project once (~2.5 s of CPU a launch), for the many launches of a
    test that is not about a fresh interpreter (startup, signals, what is imported)."""
    if fork:
        # tests/faults.py too: the fork installs the faults its environment asks for, as that
        # script does
        assert script in ("train.py", os.path.join("tests", "faults.py")), script
        return torchrun(1, args, cwd, check=check, timeout=timeout, env=env, plain=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", **(env or {})}
    cmd = script.split() if script.startswith("-m ") else [os.path.join(ROOT, script)]
    p = subprocess.run([sys.executable, *cmd, *args], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{script} {' '.join(args)} failed ({p.returncode}):\n"
                             f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def read_metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


_ports = []


def free_port():
    """A port for a test's rendezvous, below the kernel's ephemeral range: a port the OS hands
    out (bind to 0) can be handed out again, to another xdist worker or to one of gloo's own
    outgoing connections, between this check and the store's bind (EADDRINUSE, seen on CI).
    Each xdist worker walks its own slice of 10000-32399 from a random start."""
    import random
    import socket
    if not _ports:
        worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
        base, width = 10000 + (worker % 8) * 2800, 2800
        start = random.Random(os.getpid()).randrange(width)
        _ports.extend(base + (start + i) % width for i in range(width))
    while _ports:
        port = _ports.pop(0)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port left below the ephemeral range")


def _rank_entry(rank, world, port, fn, args, out_dir, pp, tp):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    import torch

    import parallel
    torch.set_num_threads(1)
    mesh = parallel.setup("cpu", dist_timeout_s=120, pp=pp, tp=tp)
    try:
        torch.save(fn(mesh, *args), os.path.join(out_dir, f"{rank}.pt"))
    finally:
        parallel.teardown(mesh)
    # not through the interpreter's shutdown, where gloo's threads can abort
    workarounds.exit_now()


def spawn(fn, world, *args, pp=1, tp=1, timeout=300):
    """Runs fn(mesh, *args) on `world` real gloo processes (a dp x pp x tp grid); returns each
    rank's result (tensors, dicts, lists, numbers). fn must live at module level so the spawned
    processes can import it. Ranks still running after `timeout` seconds are killed and the test
    fails: ranks of all_to_all exchanges whose splits disagree once waited 18 minutes, past gloo's
    timeout."""
    import tempfile
    import time

    import torch
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as out_dir:
        ranks = mp.start_processes(_rank_entry,
                                   args=(world, free_port(), fn, args, out_dir, pp, tp),
                                   nprocs=world, start_method="spawn", join=False)
        deadline = time.monotonic() + timeout
        while not ranks.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                for p in ranks.processes:
                    p.kill()
                raise TimeoutError(f"spawn: {fn.__name__} on {world} ranks still running after "
                                   f"{timeout} s (a hang)")
        return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=True)
                for r in range(world)]


# what every rank of a train.py run imports (torch, torch._dynamo through the optimizers, DCP,
# the project): ~4.5 s of CPU per process on this machine, against well under a second of
# training in a tiny test run. A forkserver imports them once; each rank is a fork of it.
PRELOAD = ["torch", "torch._dynamo", "torch.distributed.checkpoint", "numpy", "tiktoken",
           *(module_of(f) for f in project_files() if f not in ("train.py", "plot.py"))]


def _rank_main(rank, env, args, cwd, out_path, err_path, before=None):
    """One rank of torchrun(agent=False), in a fork of the forkserver: what `python train.py
    args` does in a worker of torchrun, with stdout and stderr to files (before: torchrun's),
    and the faults its environment asks for (tests/faults.py). rank None: a plain process."""
    import runpy

    import torch

    import faults
    for fd, path in ((1, out_path), (2, err_path)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    os.environ.update(env, **({} if rank is None else dict(RANK=str(rank), LOCAL_RANK=str(rank))))
    # OMP_NUM_THREADS=1 (torch read the variable when the forkserver imported it)
    torch.set_num_threads(1)
    os.chdir(cwd)
    faults.install()
    if before is not None:
        before(rank)
    sys.argv = [os.path.join(ROOT, "train.py"), *args]
    code = 0
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:  # as the interpreter ends on one
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except BaseException:
        # as the interpreter: the excepthook (train.py's: one error line), exit 1
        sys.excepthook(*sys.exc_info())
        code = 1
    workarounds.exit_now(code)


def torchrun(nproc, args, cwd, check=True, timeout=300, agent=False, before=None, env=None,
             plain=False):
    """train.py on nproc gloo ranks on CPU. Each rank is a fork of a process that has imported
    torch and the project once (PRELOAD) and runs train.py top to bottom given RANK,
    LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, as srun or mpirun would (rank 0 hosts
    the store: the env:// path; torchrun's agent store is not there). agent=True: under
    `torchrun --standalone` itself, a fresh interpreter per rank, for the tests of what a user
    sees from torchrun (its error lines, its exit, its restarts) and of its agent's store.
    before (agent=False): a module-level function called as before(rank) in each rank, in cwd,
    before train.py starts: a test that watches a run from inside wraps a function of a module
    train.py imports (what every tp rank holds at a save, say). env: added to every rank's
    environment (FAULT_*: the faults of tests/faults.py). plain: one process without RANK and
    the rest (run_train(fork=True))."""
    if agent:
        script = (os.path.join(ROOT, "tests", "faults.py") if env
                  else os.path.join(ROOT, "train.py"))
        return run_train(["--standalone", f"--nproc_per_node={nproc}", script, *args],
                         cwd, check=check, timeout=timeout, script="-m torch.distributed.run",
                         env=env)
    import multiprocessing
    import tempfile
    import time
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    dist_env = {} if plain else {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                                 "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc)}
    env = {"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", **dist_env, **(env or {})}
    with tempfile.TemporaryDirectory() as logs:
        files = [(os.path.join(logs, f"{r}.out"), os.path.join(logs, f"{r}.err"))
                 for r in range(nproc)]
        procs = [ctx.Process(target=_rank_main,
                             args=(None if plain else r, env, args, str(cwd), *files[r], before))
                 for r in range(nproc)]
        deadline, code, why = time.time() + timeout, 0, ""
        try:
            for p in procs:
                p.start()
            # like torchrun: one rank failing ends the others
            while any(p.exitcode is None for p in procs):
                failed = [p for p in procs if p.exitcode]
                if (failed or time.time() > deadline) and not code:
                    code, why = ((failed[0].exitcode, f"rank {procs.index(failed[0])} exited with "
                                  f"{failed[0].exitcode}")
                                 if failed else (-9, f"timed out after {timeout} s"))
                    break
                time.sleep(0.05)
        finally:  # a failure, a timeout or an interrupted test: no rank outlives the call
            for p in (p for p in procs if p.pid is not None):
                if p.exitcode is None:
                    p.kill()
                p.join()
        code = code or next((p.exitcode for p in procs if p.exitcode), 0)
        why = why or (f"exit code {code}" if code else "")
        # a rank killed before it opened its files (the others' failure came first) wrote nothing
        texts = [tuple(open(f, errors="replace").read() if os.path.exists(f) else "" for f in pair)
                 for pair in files]
    result = subprocess.CompletedProcess(["train.py", *args], code, "".join(o for o, _ in texts),
                                         "".join(e for _, e in texts))
    if check and code != 0:
        raise AssertionError(f"train.py {' '.join(args)} on {nproc} ranks failed ({why}):\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


@pytest.fixture(scope="session")
def reference_run(dataset, tmp_path_factory):
    """metrics.jsonl of the REFERENCE config trained by one plain process."""
    out = str(tmp_path_factory.mktemp("reference") / "run")
    run_train([*REFERENCE, f"dataset={dataset}", f"out_dir={out}"], cwd=os.path.dirname(out),
              fork=True)
    return read_metrics(out)


def assert_same_curve(a, b, exact=False, rtol=3e-4):
    """b reproduces a: every train line (loss, grad norm) and every val loss that a logged. b may
    hold extra val lines: a run stopped early evaluates at its end, which is kept on resume.
    A compiled run against an eager one needs rtol=1e-3: inductor fuses kernels and rounds
    differently (measured: 1.3e-4 on one grad norm of REFERENCE, compiled vs eager,
    one process)."""
    for key in ("loss", "grad_norm", "val_loss"):
        la, lb = ({r["iter"]: r[key] for r in rows if key in r} for rows in (a, b))
        assert la and (set(la) <= set(lb) if key == "val_loss"
                       else set(la) == set(lb)), (key, sorted(la), sorted(lb))
        va, vb = [la[i] for i in sorted(la)], [lb[i] for i in sorted(la)]
        if exact:
            assert va == vb, key
        else:
            # rounding: a layout sums the same numbers in another order (an all-reduce, a
            # pipeline); over 8 steps at a high learning rate with clipping that grows to ~1e-4
            # relative (measured: 1.1e-4 on one grad norm of REFERENCE at fsdp=4), while a real
            # mistake (a wrong average, a lost micro-batch) is 1e-2 or more
            torch.testing.assert_close(vb, va, rtol=rtol, atol=1e-5, msg=key)


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory):
    """A random tiny LlamaForCausalLM saved by transformers (config.json + model.safetensors)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("hf") / "llama")
    LlamaForCausalLM(LlamaConfig(**HF)).eval().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def chat_dataset(tmp_path_factory):
    """Chat JSONL prepared with the chat template: loss masks on assistant tokens."""
    root = tmp_path_factory.mktemp("chat")
    lines = []
    for i in range(80):
        if i % 2:
            lines.append({"prompt": f"What is {i} plus {i}?", "response": f"It is {2 * i}."})
        else:
            lines.append({"messages": [{"role": "system", "content": "You add numbers."},
                                       {"role": "user", "content": f"Add {i} and {i + 1}."},
                                       {"role": "assistant", "content": f"{2 * i + 1}."}]})
    src = root / "chat.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    out = str(root / "data")
    prepare.prepare(str(src), out, "cl100k_base", 512, val_fraction=0.2, verbose=False)
    return out


def validate_as_train(config, given, world):
    """The config checked as train.py checks it: the layout's batch derived
    (configurator.batch_for_layout), then guard_config.validate's one pass."""
    import configurator
    from guards import guard_config
    config = {**config, "grad_accum_steps": configurator.batch_for_layout(config, given, world)}
    guard_config.validate(config, given, world)
    return config
