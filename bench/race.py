"""Side by side on the default corpus, one after the other: nanoGPT's own train.py with its
README's CPU recipe (its files in ./nanogpt or $NANOGPT_DIR: train.py, model.py,
configurator.py, config/train_shakespeare_char.py), then the default job launched as the
README's quickstart launches it (`python train.py`, one process), the same in float32 (no bf16
autocast: what dtype=auto's bf16 buys), and under torchrun with 2 processes. Both sides scored
by one evaluator (val_score: every 64-token block of the whole val split): nanoGPT's final model
is the finish line; ours is scored at a checkpoint every 25 iterations, the time to the line
interpolated between two. The ratio of the times, the load average around each side, and apart,
labelled, each side's own estimate (~9 minutes: run it on a quiet machine)."""

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

import checkpoint
import data
import prepare
from guards import guard_data

from bench.base import RUN_KEYS, SMOKE, TRAIN, TRAIN_PY, default_threads_env, nanogpt_dir


# ---- race: wall time to a val loss, nanoGPT's own train.py against the default job ------------
# Each recipe is a whole job (its own schedule ends at its max_iters) on the default corpus,
# launched as the README's quickstart launches the default (`python train.py`: one process with
# the machine's threads, as nanoGPT gets them), and the default job once more under torchrun with
# 2 processes. Both sides are SCORED ALIKE: one function (val_score) computes the mean
# cross-entropy over every 64-token block of the whole val split, in float32, for nanoGPT's final
# model (its own ckpt.pt through its own model.py) and for each of our checkpoints (one every
# RACE_CKPT iterations; their writing counts in our time). Each side's own estimate (a few val
# batches) moves the finish line by 0.03-0.1 on this 79k-token split, so it is printed apart.
RACE_CKPT = 25


RACE_TARGETS = (4.5, 4.25, 4.0)


# name: (processes, the keys it sets); run after nanoGPT
RACE = {"default (python train.py)": (1, {}),
        "default, dtype=float32 (no bf16 autocast)": (1, dict(dtype="float32")),
        "default, torchrun with 2 processes": (2, {})}


# nanoGPT's README "I only have a macbook" CPU recipe, on our default corpus
# (its vocabulary: 8,192);
# always_save_checkpoint: its ckpt.pt is the model it ends with
# (not the one its estimate liked best)
NANOGPT_CPU = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False",
               "--eval_iters=20", "--log_interval=1", "--block_size=64", "--batch_size=12",
               "--n_layer=4", "--n_head=4", "--n_embd=128", "--max_iters=2000",
               "--lr_decay_iters=2000", "--dropout=0.0", "--always_save_checkpoint=True"]


def timed_lines(cmd, patterns, **popen):
    """Runs cmd, timing its output from the launch: {name: [(seconds, *groups)]} for each line
    matching patterns[name], as the line is printed."""
    import re
    # each line when it is printed, not in 8 KB blocks
    env = {**popen.pop("env", os.environ), "PYTHONUNBUFFERED": "1"}
    t0, rows = time.time(), {name: [] for name in patterns}
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, **popen) as p:
        tail = []
        for line in p.stdout:
            tail = (tail + [line])[-20:]
            for name, pattern in patterns.items():
                m = re.search(pattern, line)
                if m:
                    rows[name].append((time.time() - t0, *m.groups()))
    if p.returncode or not all(rows.values()):
        raise SystemExit(f"{' '.join(cmd[:3])} ... failed ({p.returncode}) or printed no "
                         f"{patterns}:\n" + "".join(tail))
    return rows


def val_score(logits_of, tokens, block=64, batch=64):
    """The race's one evaluator: the mean cross-entropy (float32) of every target of every
    `block`-token block of `tokens` (x = tokens[i:i+block], y = the next token of each), for a
    model given as logits_of(x, y) -> (B, T, vocab). The same blocks and
    arithmetic for both sides."""
    n = (len(tokens) - 1) // block
    idx = torch.from_numpy(tokens[:n * block + 1].astype("int64"))
    x, y = idx[:-1].view(n, block), idx[1:].view(n, block)
    total = 0.0
    for i in range(0, n, batch):
        logits = logits_of(x[i:i + batch], y[i:i + batch]).float()
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), y[i:i + batch].flatten(),
                                                   reduction="sum").item()
    return total / (n * block)


def nanogpt_model(src, ckpt_path):
    """nanoGPT's model from its own ckpt.pt, built by its own model.py (imported under another
    name: ours is `model` too). The checkpoint is read with weights_only=True
    (plain types and tensors)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("nanogpt_model", os.path.join(src, "model.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    model = mod.GPT(mod.GPTConfig(**ckpt["model_args"]))
    model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()})
    return model.eval(), ckpt["iter_num"]


def nanogpt_race(data_dir):
    """nanoGPT's own train.py with its README's CPU recipe on the prepared `data_dir`, timed from
    launch, its final model scored by val_score: (seconds to its last evaluation's line,
    iterations, the score, its own last estimate), or None when its files are not in ./nanogpt. It
    gets the machine's threads (torch's default), as it would."""
    import pickle
    src = nanogpt_dir("train.py", "model.py", "configurator.py", NANOGPT_CPU[0])
    if src is None:
        return None
    if not os.path.isfile(os.path.join(data_dir, "meta.json")):
        prepare.prepare("stdlib", data_dir, TRAIN["tokenizer"], TRAIN["vocab_size"],
                        TRAIN["val_fraction"])
    meta = guard_data.read_meta(data_dir)
    if meta["dtype"] != "uint16":
        raise SystemExit(f"nanoGPT reads uint16 tokens; {data_dir} holds {meta['dtype']}")
    # its cwd: nanoGPT reads configurator.py and data/ from there
    work = tempfile.mkdtemp(prefix="nanogpt_race_")
    for f in ("train.py", "model.py", "configurator.py", "config"):
        os.symlink(os.path.join(os.path.abspath(src), f), os.path.join(work, f))
    os.makedirs(os.path.join(work, "data", "race"))
    for split in ("train", "val"):
        os.symlink(os.path.abspath(os.path.join(data_dir, f"{split}.bin")),
                   os.path.join(work, "data", "race", f"{split}.bin"))
    # the one thing nanoGPT reads besides the tokens (written here, read by it)
    with open(os.path.join(work, "data", "race", "meta.pkl"), "wb") as f:
        pickle.dump({"vocab_size": meta["vocab_size"]}, f)
    evals = timed_lines([sys.executable, "train.py", *NANOGPT_CPU,
                         "--dataset=race", "--out_dir=out"],
                        {"eval": r"step (\d+): train loss [\d.]+, val loss ([\d.]+)"}, cwd=work,
                        env=default_threads_env())["eval"]
    model, iters = nanogpt_model(src, os.path.join(work, "out", "ckpt.pt"))
    # with targets, nanoGPT returns every position's logits
    score = val_score(lambda x, y: model(x, y)[0], val_tokens(data_dir))
    shutil.rmtree(work)
    return evals[-1][0], iters, score, float(evals[-1][2])


def val_tokens(data_dir, cache={}):
    """The whole val split of a prepared dataset, as numpy tokens (read once)."""
    import numpy as np
    if data_dir not in cache:
        cache[data_dir] = np.fromfile(os.path.join(data_dir, "val.bin"),
                                      dtype=guard_data.read_meta(data_dir)["dtype"])
    return cache[data_dir]


def our_race(out, procs, keys):
    """The default job (with `keys`) as the quickstart launches it, plus a checkpoint every
    RACE_CKPT iterations (all kept), each scored by val_score: [(seconds to its saved line, iter,
    score)], and the job's own evaluations [(seconds, iter, val loss)]."""
    launch = (["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"]
              if procs > 1 else [])
    # one process: torch's default, as nanoGPT's
    threads = {"OMP_NUM_THREADS": "1"} if procs > 1 else {}
    args = [f"{k}={v}" for k, v in {"ckpt_interval": RACE_CKPT, "keep_ckpts": 0, **keys}.items()]
    lines = timed_lines([sys.executable, *launch, TRAIN_PY, f"out_dir={out}",
                         "init_from=scratch", "sample_tokens=0", *args, *RUN_KEYS],
                        {"ckpt": r"saved checkpoint (\S+)",
                         "eval": r"iter (\d+): val loss ([\d.]+)"},
                        env=default_threads_env(**threads))
    scored = []
    for seconds, path in lines["ckpt"]:
        model, meta = checkpoint.load_whole(path.rstrip(":"))
        model.eval()
        scored.append((seconds, meta["iter"],
                       val_score(lambda x, y: model(x)[0], val_tokens(meta["dataset"]),
                                 block=min(64, model.cfg.block_size))))  # (--smoke: 16)
    return scored, [(s, int(i), float(v)) for s, i, v in lines["eval"]]


def crossing(scored, target):
    """(seconds, iteration) where the scores first reach `target`, linear between the two
    checkpoints around the crossing; None if they never do."""
    prev = None
    for t, it, s in scored:
        if s <= target:
            if prev is None:
                return t, it
            f = (prev[2] - target) / (prev[2] - s)
            return prev[0] + f * (t - prev[0]), prev[1] + f * (it - prev[1])
        prev = (t, it, s)
    return None


def table_race(recipes=None, extra=None):
    """nanoGPT's own train.py (README CPU recipe, when ./nanogpt holds it), then each recipe
    in this trainer, one after the other on the same corpus, all scored by val_score; the finish
    line: nanoGPT's final model's score."""
    recipes = {k: RACE[k] for k in recipes} if recipes else RACE
    root, data_dir = tempfile.mkdtemp(prefix="race_"), os.path.join("data", "stdlib")
    # the recipes' out_dirs, also when a run fails
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    load, loads = os.getloadavg()[0], {}  # the 1-minute load average before and after each side
    # (--smoke: minutes of nanoGPT, and data/ written where it runs)
    nano = None if SMOKE else nanogpt_race(data_dir)
    loads["nanoGPT"] = (load, os.getloadavg()[0])
    targets = RACE_TARGETS + ((nano[2],) if nano else ())
    print("\n## race, scored alike: every side's model scored by one evaluator (mean "
          "cross-entropy over every 64-token block of the whole val split, float32); time from "
          f"launch; ours: a checkpoint every {RACE_CKPT} iterations (writes included), the "
          "crossing interpolated between two")
    if nano:
        print("nanoGPT's own train.py, README CPU recipe (1 process, its default threads): "
              f"{nano[1]} iterations, final model scores {nano[2]:.4f} (its own estimate said "
              f"{nano[3]:.4f}) at {nano[0]:.0f} s: the finish line; load average "
              f"{loads['nanoGPT'][0]:.2f} before, {loads['nanoGPT'][1]:.2f} after")
    else:
        print("(nanoGPT's train.py is not in ./nanogpt or $NANOGPT_DIR: no nanoGPT row, no "
              "finish line)")
    print("| recipe | tokens/iter | iters | " + " | ".join(f"to {t:.4g}" for t in targets)
          + " | final score | total | load before/after |")
    print("|---|---|---|" + "---|" * len(targets) + "---|---|---|")
    results = {}
    for name, (procs, keys) in recipes.items():
        out = os.path.join(root, str(len(os.listdir(root))))
        keys = {**keys, **(extra or {})}
        load = os.getloadavg()[0]
        scored, evals = our_race(out, procs, keys)
        loads[name] = (load, os.getloadavg()[0])
        cfg = {**TRAIN, **keys}
        tpi = cfg["batch_size"] * cfg["grad_accum_steps"] * cfg["block_size"]
        hits = [crossing(scored, t) for t in targets]
        results[name] = (hits[-1], evals)
        print(f"| {name} | {tpi} | {cfg['max_iters']} | " + " | ".join(
            f"{h[0]:.0f} s (iter {h[1]:.0f})" if h else "-" for h in hits)
            + f" | {scored[-1][2]:.4f} | {scored[-1][0]:.0f} s | {loads[name][0]:.2f} / "
              f"{loads[name][1]:.2f} |",
            flush=True)
        shutil.rmtree(out)
    if nano:
        print(f"to nanoGPT's final score {nano[2]:.4f}: nanoGPT {nano[0]:.0f} s; " + "; ".join(
            f"{name} {h[0]:.0f} s, {nano[0] / h[0]:.2f}x faster" if h else f"{name} never"
            for name, (h, _) in results.items()) + " (goal: 4x)")
        print("\nnot comparable, for reference only: each side's OWN estimate (nanoGPT: 20 "
              "random val batches; ours: eval_iters fixed batches), time to the first estimate at "
              f"or below nanoGPT's last estimate {nano[3]:.4f}: " + "; ".join(
                  f"{name} " + next((f"{s:.0f} s (iter {i})" for s, i, v in evals if v <= nano[3]),
                                    "never")
                  for name, (_, evals) in results.items()))
    shutil.rmtree(root, ignore_errors=True)  # the recipes' out_dirs
