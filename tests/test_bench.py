"""bench.py's tables run: `python bench.py --smoke` runs every one of them at a tiny size in
one launch (their numbers mean nothing here; docs/benchmarks.md holds the real runs)."""

import ast
import os

from conftest import ROOT, run_train

# the heading each table prints first (gpu: its line for a machine without CUDA)
HEADINGS = {"single": "## single process", "dp": "## data parallel", "pp": "## pipeline parallel",
            "tp": "## tensor parallel", "memory": "## memory and speed per layout",
            "memory2d": "## Muon per step", "lora": "## full fine-tuning vs LoRA",
            "sample": "## sampling", "build": "## building and importing",
            "checkpoint": "## checkpoint saves", "race": "| default (python train.py) | 64 | 2 |",
            "reading": "to the first optimizer step", "head": "## head + loss", "gpu": "## gpu",
            "mfu": "## mfu", "profile": "## profile", "long": "## long sequences",
            "tokenize": "## encoding", "moe": "## mixture of experts", "real": "ours at",
            "docmask": "## doc_mask", "activations": "## activation memory at long rows"}


def test_every_table_runs_at_a_tiny_size(tmp_path):
    """As docs/benchmarks.md runs it, with no dataset=: the smoke prepares a tiny one of its own in
    /tmp (after the quickstart, data/stdlib holds another vocabulary) and leaves nothing behind."""
    tree = ast.parse(open(os.path.join(ROOT, "bench", "__main__.py")).read())
    tables = next(n.value for n in tree.body
                  if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "TABLES")
    # a new table gets a heading here
    assert sorted(ast.literal_eval(k) for k in tables.keys) == sorted(HEADINGS)
    p = run_train(["--smoke"], cwd=tmp_path, script="bench.py", timeout=600)
    missing = [name for name, heading in HEADINGS.items() if heading not in p.stdout]
    assert not missing, (f"tables that printed nothing: {missing}\n{p.stdout[-3000:]}\n"
                         f"{p.stderr[-3000:]}")
    # and nothing written where it ran
    assert "Traceback" not in p.stderr and not os.listdir(tmp_path)


def test_options_it_does_not_know_start_nothing(tmp_path):
    """`--help` prints the tables' descriptions; a typo such as `--smok` is one error line (it
    started the full-size tables, minutes of them)."""
    p = run_train(["--help"], cwd=tmp_path, script="bench.py", timeout=120)
    assert "python bench.py --smoke" in p.stdout and "## " not in p.stdout and p.stderr == ""
    for args, error in ((["--smok"], "unknown option --smok: the options are"),
                        # (any option with '=')
                        (["--smoke=1"], "unknown option --smoke=1: the options are"),
                        # (not a table's name)
                        (["reading=1"], "reading=1: key=value goes with --smoke"),
                        (["--row"], "--row takes a row"),
                        (["--row", "nope", "{}"], "--row takes a row")):
        p = run_train(args, cwd=tmp_path, script="bench.py", check=False, timeout=120)
        lines = p.stderr.strip().splitlines()
        assert (p.returncode == 1 and p.stdout == "" and len(lines) == 1
                and lines[0].startswith(f"error: {error}")), \
            (args, p.stdout[-1000:], p.stderr[-2000:])
