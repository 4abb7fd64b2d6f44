"""The layout matrix: every pair of option values (data parallel kind, pipeline schedule, tp,
optimizer, full or LoRA, one source or a mixture) appears in at least one cell of a covering
set generated greedily below, and each cell, run by train.py on real gloo processes (4 at
most), reproduces the single-process run of the same options to 1e-5 relative, loss, grad
norm, val loss and per-source losses at every one of 8 iterations, with clipping active, and
the evaluations' bits per byte and multiple-choice scores (evals.py: the log-likelihood of
the right answers to 1e-5, acc and acc_norm exactly).
Every odd cell also computes its head and loss in chunks (loss_chunk=24: 128 rows per
micro-batch in 6 chunks, the last short) against the single process's whole logits, so the
chunked loss meets every layout, tp's vocabulary slices, LoRA's head, and the mixture's
per-source sums; every other one of those keeps the softmax for backward (loss_recompute=False).
Plus one checkpoint carried through the new layouts,
and a check that the comparison fails for a run that differs.

`pytest -s tests/test_matrix.py -n 0` prints the cells and each one's worst relative difference."""

import fcntl
import itertools
import json
import os

import pytest
from conftest import REFERENCE, read_metrics, run_train, torchrun

import prepare

OPTIONS = {
    "data_parallel": ["dp", "zero1", "zero2", "fsdp"],
    "pipeline": ["none", "1f1b", "gpipe", "interleaved"],
    "tp": [1, 2],
    "optim": ["adamw", "muon"],
    "weights": ["full", "lora"],
    "data": ["one", "mixture"],
}
KEYS = list(OPTIONS)

# The run each cell repeats: REFERENCE's 4 layers and 4 micro-batches, 8 iterations on a
# fixed schedule, a clip that clips every step (asserted on each single-process run),
# evaluation at 0 and 8. The learning rate is REFERENCE's / 3: at 1e-2 the tiny model's grad
# norm jumps 4x at iteration 7, where tp=2 x pp=2's rounding (1e-7 elsewhere) reached 1.03e-5.
RUN = [a for a in REFERENCE
       if not a.startswith(("max_iters=", "grad_clip=", "learning_rate=", "min_lr="))] + [
    "max_iters=8", "lr_decay_iters=8", "learning_rate=3e-3", "min_lr=3e-4", "grad_clip=0.05",
    "eval_interval=1000", "ckpt_interval=1000", "ddp_bucket_mb=0.01"]
RTOL = 1e-5
# Muon: the same tolerance. Its Newton-Schulz iteration is a fixed polynomial of the (clipped)
# gradient, in fp32 on CPU, so it carries a layout's rounding (another summation order) through
# without amplifying it more than AdamW's division by sqrt(v) does: measured, Muon cells
# 7.9e-8 to 1.2e-7, AdamW cells 7.8e-8 to 1.6e-7 (a 1% change of the learning rate: 1.1e-3).
RTOL_MUON = 1e-5


def dp_degree(cell):
    """2 data-parallel ranks, except tp=2 with a pipeline: 2 x 2 ranks already, kept at 4."""
    return 1 if cell["pipeline"] != "none" and cell["tp"] == 2 else 2


def world(cell):
    return dp_degree(cell) * (1 if cell["pipeline"] == "none" else 2) * cell["tp"]


def pairs(cell):
    """The (key, value) pairs a cell covers; with one dp rank its data-parallel
    kind covers none."""
    items = [(k, cell[k]) for k in KEYS if k != "data_parallel" or dp_degree(cell) > 1]
    return set(itertools.combinations(items, 2))


def triples(cell):
    items = [(k, cell[k]) for k in KEYS if k != "data_parallel" or dp_degree(cell) > 1]
    return set(itertools.combinations(items, 3))


def covering_cells():
    """Greedy: from every cell (those with one dp rank only as plain "dp"), take the one that
    covers the most pairs not covered yet (ties: the one that runs on this branch, then fewer
    ranks, then the most triples not covered yet, so the options the pairs leave free vary;
    then the first), until every pair is covered."""
    all_cells = [dict(zip(KEYS, values)) for values in itertools.product(*OPTIONS.values())]
    candidates = [c for c in all_cells if dp_degree(c) > 1 or c["data_parallel"] == "dp"]
    todo = set().union(*(pairs(c) for c in candidates))
    todo3 = set().union(*(triples(c) for c in candidates))
    chosen = []
    while todo:
        best = max(candidates, key=lambda c: (len(pairs(c) & todo), -world(c),
                                              len(triples(c) & todo3)))
        chosen.append(best)
        todo -= pairs(best)
        todo3 -= triples(best)
    return chosen


CELLS = covering_cells()


def name(cell):
    return "-".join(str(cell[k]) if k != "tp" else f"tp{cell[k]}" for k in KEYS)


def options_args(cell, ctx):
    """The keys of a cell's options that a single process runs too (optimizer, LoRA, data)."""
    args = [f"optim={cell['optim']}", f"eval_tasks={ctx['task']}"]
    if cell["weights"] == "lora":
        args += [f"init_from={ctx['base']}", "lora_rank=4", "lora_alpha=8",
                 "lora_targets=wq,wk,wv,wo,w1,w2,w3,output"]
    if cell["data"] == "mixture":
        args += [f"datasets={ctx['dataset']}:0.7,{ctx['notes']}:0.3"]
    else:
        args += [f"dataset={ctx['dataset']}"]
    return args


def layout_args(cell):
    args = {"dp": [], "zero1": ["zero=1"], "zero2": ["zero=2"],
            "fsdp": ["fsdp=True"]}[cell["data_parallel"]]
    args += {"none": [], "1f1b": ["pp=2"], "gpipe": ["pp=2", "pp_schedule=gpipe"],
             "interleaved": ["pp=2", "pp_schedule=interleaved", "pp_virtual=2",
                             "pp_layers=1,1,1,1"]}[cell["pipeline"]]
    return args + (["tp=2"] if cell["tp"] == 2 else [])


def worst_relative_difference(a, b):
    """The largest |b - a| / |a| over every logged number of run a (loss, grad norm, val loss,
    per-source losses, bits per byte, tasks' gold_ll) at every iteration; b must log each of
    them, and the tasks' acc, acc_norm and acc_bytes equal."""
    worst = 0.0
    # shares of questions: equal, or a choice's order changed
    counts = ("/acc", "/acc_norm", "/acc_bytes")
    for key in sorted({k for r in a for k in r if k.endswith(counts)}):
        # (at a's evaluations: a resumed chain also evaluates where each leg ends)
        at = {r["iter"]: r.get(key) for r in b if "val_loss" in r}
        assert ([r.get(key) for r in a if "val_loss" in r]
                == [at.get(r["iter"]) for r in a if "val_loss" in r]), key
    compared = ("loss", "grad_norm", "val_loss", "val_bpb")
    scores = ("val_bpb/", "task/")
    for key in sorted({k for r in a for k in r if k in compared or "loss/" in k
                       or k.startswith(scores) and not k.endswith(counts)}):
        la, lb = ({(r["iter"], "val" in r): r[key] for r in rows if r.get(key) is not None}
                  for rows in (a, b))
        assert la and set(la) <= set(lb), (key, sorted(la), sorted(lb))
        worst = max(worst, *(abs(lb[i] - la[i]) / abs(la[i]) for i in la))
    return worst


@pytest.fixture(scope="module")
def ctx(dataset, tmp_path_factory):
    """The data and the LoRA base (a short full run of ours), and a directory that every test
    process (pytest-xdist worker) shares for the single-process runs."""
    shared = tmp_path_factory.getbasetemp()  # this session's: under xdist each worker's parent
    shared = (shared.parent if os.environ.get("PYTEST_XDIST_WORKER") else shared) / "matrix-single"
    shared.mkdir(exist_ok=True)
    root = tmp_path_factory.mktemp("matrix")
    notes = root / "notes_txt"
    notes.mkdir()
    for i in range(40):
        (notes / f"n{i:02d}.txt").write_text(
            f"note {i}: " + " ".join(f"item{j * i % 97}" for j in range(200)))
    prepare.prepare(str(notes), str(root / "notes"), "cl100k_base", 512, val_fraction=0.2,
                    verbose=False)
    task = root / "task.jsonl"  # multiple-choice questions on the notes: evals.py
    questions = [
        {"context": f"note {i}: item{i}", "choices": [f" item{j}" for j in range(i, i + 3)],
         "answer": i % 3} for i in range(9)]
    task.write_text("".join(json.dumps(q) + "\n" for q in questions))
    base = str(root / "base")
    run_train([*RUN, f"dataset={dataset}", f"out_dir={base}", "max_iters=2"], cwd=root, fork=True)
    return {"dataset": dataset, "notes": str(root / "notes"), "base": base, "shared": shared,
            "root": root, "task": str(task)}


def single_run(cell, ctx, extra=()):
    """metrics of one process with the cell's options, computed once per distinct option set
    (and `extra`) by whichever test process gets there first; the others wait on a lock."""
    key = "-".join([cell["optim"], cell["weights"], cell["data"], *extra]).replace("=", "_")
    path = ctx["shared"] / key
    with open(ctx["shared"] / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / "done.json").exists():
            out = ctx["root"] / f"single-{key}"
            run_train([*RUN, *options_args(cell, ctx), *extra, f"out_dir={out}"], cwd=ctx["root"],
                      fork=True)
            rows = read_metrics(str(out))
            path.mkdir(exist_ok=True)
            (path / "done.json").write_text(json.dumps(rows))
    return json.loads((path / "done.json").read_text())


def test_the_cells_cover_every_pair():
    print(f"\nlayout matrix: {len(CELLS)} cells cover every pair of option values")
    for i, c in enumerate(CELLS):
        print(f"  cell {i:2d}: {name(c):45s} {world(c)} ranks")
    covered = set().union(*(pairs(c) for c in CELLS))
    for (k1, vs1), (k2, vs2) in itertools.combinations(OPTIONS.items(), 2):
        for v1, v2 in itertools.product(vs1, vs2):
            assert ((k1, v1), (k2, v2)) in covered, (k1, v1, k2, v2)
    assert all(world(c) <= 4 for c in CELLS)


@pytest.mark.parametrize("i", range(len(CELLS)), ids=[name(c) for c in CELLS])
def test_cell_equals_the_single_process(i, ctx, tmp_path):
    cell = CELLS[i]
    want = single_run(cell, ctx)
    assert any(r.get("grad_norm", 0) > 0.05 for r in want), "the clip must clip"
    assert any("val_bpb" in r and "task/task/gold_ll" in r for r in want), "the evaluations score"
    out = str(tmp_path / "run")
    chunked = ["loss_chunk=24", f"loss_recompute={i % 4 == 1}"] if i % 2 else []
    torchrun(world(cell),
             [*RUN, *options_args(cell, ctx), *layout_args(cell), *chunked, f"out_dir={out}"],
             cwd=tmp_path)
    worst = worst_relative_difference(want, read_metrics(out))
    print(f"\ncell {i:2d}: {name(cell) + ('-chunked' if chunked else ''):53s} {world(cell)} "
          f"ranks: worst relative difference {worst:.1e}")
    assert worst <= (RTOL_MUON if cell["optim"] == "muon" else RTOL), (name(cell), worst)


def test_the_comparison_fails_for_a_different_run(ctx):
    """A run that differs a little (learning rate 1% higher) is caught."""
    cell = {"optim": "adamw", "weights": "full", "data": "one"}
    worst = worst_relative_difference(single_run(cell, ctx),
                                      single_run(cell, ctx, ["learning_rate=3.03e-3"]))
    print(f"\nlearning_rate 3e-3 vs 3.03e-3: worst relative difference {worst:.1e}")
    assert worst > 10 * RTOL


def test_one_checkpoint_through_the_new_layouts(ctx, tmp_path):
    """One out_dir, a mixture with tied embeddings: interleaved pp=2 x fsdp over 2 ranks ->
    tp=2 x pp=2 -> one process, each leg resuming the last; the chain is the single process."""
    cell = {"optim": "adamw", "weights": "full", "data": "mixture"}
    tied = ["tie_embeddings=True", "keep_ckpts=0"]
    want = single_run(cell, ctx, tied)
    out = str(tmp_path / "run")
    chain = [*RUN, *options_args(cell, ctx), *tied, f"out_dir={out}"]
    torchrun(4,
             [*chain, "max_iters=3",
              *layout_args({"data_parallel": "fsdp", "pipeline": "interleaved", "tp": 1})],
             cwd=tmp_path)
    torchrun(4, [*chain, "max_iters=6", "pp=2", "tp=2"], cwd=tmp_path)
    run_train(chain, cwd=tmp_path, fork=True)
    worst = worst_relative_difference(want, read_metrics(out))
    print("\nreshard chain fsdp x interleaved -> tp2 x pp2 -> 1: worst relative difference "
          f"{worst:.1e}")
    assert worst <= RTOL
