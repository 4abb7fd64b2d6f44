"""
Benchmarks, printed as tables. Not tests: timings on shared machines are noisy, so each
table compares rows measured in the same run. One file per table in bench/, named as the table.

    python bench.py                  # every table (or: python -m bench)
    python bench.py single           # one table by name
    python bench.py --smoke          # every table at a tiny size, to check that it runs
                                     # (numbers mean nothing); key=value after it go to its
                                     # train.py runs, e.g. dataset=data/mine
    python bench.py real model=DIR dtype=auto rounds=2   # the real model's table, and its keys
"""

import atexit
import json
import os
import shutil
import sys
import tempfile

ROW_NAMES = ("single", "lora", "head", "real", "docmask", "activations")


def check_options(argv):
    """Refuses a typo before torch and the tables are imported (seconds of a launch): --smok
    must not start the full-size tables, minutes of them."""
    if argv[:1] == ["--row"]:  # one row in a process of its own (base.py runs it so)
        if len(argv) != 3 or argv[1] not in ROW_NAMES or not argv[2].startswith("{"):
            sys.exit(f"error: --row takes a row ({', '.join(ROW_NAMES)}) and its arguments "
                     "as a JSON object")
        return
    if {"-h", "--help"} & set(argv):
        return
    unknown = sorted({a for a in argv if a.startswith("-")} - {"--smoke", "--functions"})
    if unknown:
        sys.exit(f"error: unknown option {unknown[0]}: the options are --smoke, "
                 "--functions (reading) and --help")


check_options(sys.argv[1:])

import torch  # after the options are checked

import prepare

from bench import (activations, build, checkpoint, docmask, dp, gpu, head, long, lora, memory,
                   memory2d, mfu, moe, pp, profile, race, reading, real, sample, single, tokenize,
                   tp)
from bench.base import ROOT, RUN_KEYS, SMOKE, SMOKE_KEYS, TRAIN

TABLES = {"single": single.table_single, "dp": dp.table_dp,
          "pp": pp.table_pp_both, "tp": tp.table_tp, "long": long.table_long,
          "memory": memory.table_memory, "memory2d": memory2d.table_memory2d,
          "lora": lora.table_lora, "sample": sample.table_sample, "build": build.table_build,
          "checkpoint": checkpoint.table_checkpoint, "race": race.table_race,
          "reading": reading.table_reading, "head": head.table_head,
          "gpu": gpu.table_gpu, "mfu": mfu.table_mfu, "profile": profile.table_profile,
          "tokenize": tokenize.table_tokenize, "moe": moe.table_moe, "real": real.table_real,
          "docmask": docmask.table_docmask, "activations": activations.table_activations}
ROWS = dict(zip(ROW_NAMES, (single.single_row, lora.lora_row, head.head_row, real.real_row,
                            docmask.docmask_row, activations.activations_row)))

# --smoke: a row or two of each kind
SMOKE_ARGS = {"dp": dict(bucket_sizes=(1.0,)),
              "pp": dict(stages=(4,), ms=(4,), deep_ms=()), "tp": dict(worlds=(2,)),
              "memory": dict(layouts=(("zero2+offload", 2), ("fsdp", 2), ("pp", 2))),
              "memory2d": dict(layouts=(("tp=2 x zero=2", "tp2+zero2", 4),),
                               muon_layouts=(("tp=2 x fsdp=2", "tp2+fsdp", 4),)),
              "sample": dict(batches=(1,), repeats=1),
              "build": dict(layouts=(("fsdp", 2), ("pp", 2))),
              "checkpoint": dict(worlds=(2,), saves=1, models=(checkpoint.MODEL,)),
              "head": dict(vocabs=(512,)),
              "race": dict(recipes=("default (python train.py)",),
                           extra=dict(max_iters=2, eval_interval=1)),
              "profile": dict(steps=1), "long": dict(lengths=(64,)),
              "tokenize": dict(max_mb=0.2, repeats=1, long_mb=0.5),
              "mfu": dict(iters=3, skip=1, rounds=1, modes=(False,)), "moe": dict(max_iters=3),
              "real": dict(rounds=1, compile_at=((1, 16, True),)), "docmask": dict(lengths=(64,)),
              "activations": dict(batch=2, T=16, long=(32,))}


def describe():
    """The usage, then each table's docstring (its file's)."""
    mods = {name: sys.modules[fn.__module__] for name, fn in TABLES.items()}
    return __doc__.strip() + "\n\n" + "\n\n".join(
        f"{name}: {mod.__doc__}" for name, mod in mods.items())


def main():
    if sys.argv[1:2] == ["--row"]:  # (checked on import, by check_options)
        print(json.dumps(ROWS[sys.argv[2]](**json.loads(sys.argv[3]))))
        sys.exit(0)
    if {"-h", "--help"} & set(sys.argv[1:]):
        sys.exit(print(describe()))
    names = [a for a in sys.argv[1:] if not a.startswith("-") and "=" not in a] or list(TABLES)
    for a in (a for a in sys.argv[1:] if "=" in a):  # key=value: the --smoke runs' train.py keys
        if a.split("=")[0] in real.KEYS and "real" in names:  # and real's: model=, dtype=, rounds=
            continue
        if not SMOKE or a.split("=")[0] not in TRAIN:
            sys.exit(f"error: {a}: key=value goes with --smoke, to its train.py runs, and names a "
                     f"train.py key (a table is named alone: python bench.py {a.split('=')[0]}), "
                     f"or with real: {', '.join(k + '=' for k in real.KEYS)}")
    for name in names:
        if name not in TABLES:
            sys.exit(f"error: unknown table '{name}': choose from {', '.join(TABLES)}")
    # a tiny dataset of its own, in /tmp:
    if SMOKE and not any(a.startswith("dataset=") for a in sys.argv[1:]):
        # data/stdlib may hold another vocabulary
        smoke_data = os.path.join(tempfile.mkdtemp(prefix="smoke_"), "docs")
        # (also when a table fails)
        atexit.register(shutil.rmtree, os.path.dirname(smoke_data), ignore_errors=True)
        prepare.prepare(os.path.join(ROOT, "docs", "*.md"), smoke_data,
                        "cl100k_base", SMOKE_KEYS["vocab_size"], val_fraction=0.2, verbose=False)
        RUN_KEYS.append(f"dataset={smoke_data}")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU cores"
          + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""))
    for name in names:
        TABLES[name](**(SMOKE_ARGS.get(name, {}) if SMOKE else {}),
                     **({"functions": True} if name == "reading" and "--functions" in sys.argv
                        else {}))


if __name__ == "__main__":
    main()
