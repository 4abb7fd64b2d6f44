"""The default job's own step, as train.py times it and logs it (`python train.py`, one process,
the machine's threads): the median ms/iter and tokens/s of metrics.jsonl's iterations after the
first 20, eager and with compile=True, two runs of each alternated, and MFU against the best
matmul rate the runs measured; each run's wall time."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from bench.base import RUN_KEYS, TRAIN_PY, default_threads_env


def table_mfu(iters=80, skip=20, rounds=2, modes=(False, True)):
    """The default job's own numbers: `python train.py` in one process (the machine's threads),
    logging every iteration; the median over iterations skip.. of metrics.jsonl's dt_ms, eager
    and with compile=True, alternated for `rounds` (a neighbour's load comes and goes), and MFU
    against the best matmul rate that the runs measured (each train.py measures its own)."""
    import re
    print(f"\n## mfu: the default job's step as train.py times it (python train.py, one process, "
          f"{os.cpu_count()} CPU threads; dtype=auto: bf16 autocast on CUDA and AVX512-BF16 CPUs, "
          "else float32), the median of iterations "
          f"{skip}-{iters - 1}; eager and compiled runs alternated, {rounds} of each")
    rows = []
    for _ in range(rounds):
        for compile_ in modes:
            out = os.path.join(tempfile.mkdtemp(prefix="mfu_"), "out")
            t0 = time.time()
            p = subprocess.run([sys.executable, TRAIN_PY, f"out_dir={out}", f"max_iters={iters}",
                                "log_interval=1", "eval_iters=1", "sample_tokens=0",
                                "init_from=scratch", f"compile={compile_}", *RUN_KEYS],
                               env=default_threads_env(), capture_output=True, text=True)
            if p.returncode == 0:
                with open(os.path.join(out, "metrics.jsonl")) as f:
                    logs = [r for r in map(json.loads, f) if "dt_ms" in r and r["iter"] >= skip]
            shutil.rmtree(os.path.dirname(out))
            if p.returncode:
                raise SystemExit(f"train.py compile={compile_} failed ({p.returncode}):\n"
                                 f"{p.stderr[-2000:]}")
            mid = sorted(logs, key=lambda r: r["dt_ms"])[len(logs) // 2]
            peak = float(re.search(r"peak ([\d.]+) GFLOP/s", p.stdout)[1]) * 1e9
            rows.append((compile_, mid["dt_ms"], mid["tok_per_s"],
                         mid["mfu"] * peak / mid["tok_per_s"], peak, time.time() - t0))
    peak = max(r[4] for r in rows)  # the machine's matmul rate: the best any run measured
    print(f"{'compile':>7} | {'ms/iter':>8} | {'tokens/s':>9} | {'MFU':>6} | {'its own peak':>12} "
          f"| {'whole run':>9}")
    print("-" * 74)
    for compile_, ms, tok_s, flops_per_token, own_peak, wall in rows:
        print(
            f"{str(compile_):>7} | {ms:8.1f} | {tok_s:9,.0f} | "
            f"{flops_per_token * tok_s / peak:6.1%} | {own_peak / 1e9:7.1f} GF/s | {wall:7.1f} s")
    best = {c: max(r[3] * r[2] for r in rows if r[0] == c) / peak for c in modes}
    print(f"MFU against {peak / 1e9:.1f} GFLOP/s, the best matmul rate the runs measured "
          "(train.py's own line divides by the rate its run measured); the fastest run: "
          + ", ".join(f"{'compiled' if c else 'eager'} {m:.1%}" for c, m in best.items())
          + f" (goal: 45%)."
          " FLOPs: 6 per parameter per token plus attention. whole run: launch to exit (imports, "
          f"two evaluations, a checkpoint, and compile=True's compiling, which a run pays once)")
