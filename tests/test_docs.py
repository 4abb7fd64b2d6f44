"""The docs stay true: every config key of train.py and sample.py with its default in
docs/configuration.md, the compatibility matrix rendered from guard_config.REFUSALS, the
README's file map naming every .py file, the README as a map of at most 200 lines, the
floors the files stand on (no import circle) as the README gives them; and the count behind
bench.py reading's reading cost."""

import ast
import os
import re

import pytest

import configurator
from guards import guard_config
from conftest import ROOT, module_of, project_files


def read(path):
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def inside_scripts(source):
    """The line numbers inside a multi-line string that is not a docstring: a script that a test
    or a benchmark runs in a subprocess, whose lines are its own."""
    import io
    import tokenize
    lines, docstrings = set(), set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant):
            docstrings.add(body[0].lineno)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.STRING and tok.end[0] > tok.start[0] \
                and tok.start[0] not in docstrings:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return lines


def test_files_and_lines_stay_short():
    """Every file of the project (tests and bench aside) at most 650 lines; every line of it, of
    bench/ and of tests/ under 100 characters (a subprocess's script held in a string aside);
    and the README's map names each file in one row."""
    files = project_files()
    long_files = {f: n for f in files if (n := len(read(f).splitlines())) > 650}
    assert not long_files, f"files over 650 lines: {long_files}"
    everything = files + [os.path.join(d, f) for d in ("bench", "tests")
                          for f in sorted(os.listdir(os.path.join(ROOT, d))) if f.endswith(".py")]
    long_lines = [f"{f}:{i}" for f in everything
                  for i, line in enumerate(read(f).splitlines(), 1)
                  if len(line) > 99 and i not in inside_scripts(read(f))]
    assert not long_lines, f"lines of 100 characters or more: {long_lines}"
    rows = [f for f in files if len(re.findall(rf"^\| `{re.escape(f)}` \|", read("README.md"),
                                               flags=re.M)) > 1]
    assert not rows, f"README.md's map gives these files two rows: {rows}"


def test_blank_lines_and_continuation_indents():
    """pycodestyle's blank-line rules (E30x) and visual-indent continuations (E128) on every
    project file and bench/ (the tests aside, like the 650-line cap)."""
    import subprocess
    import sys
    files = project_files() + ["bench.py"] + [f"bench/{f}" for f in
                                              sorted(os.listdir(os.path.join(ROOT, "bench")))
                                              if f.endswith(".py")]
    p = subprocess.run([sys.executable, "-m", "pycodestyle", "--select=E30,E128", *files],
                       cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0 and not p.stderr, p.stdout + p.stderr


def keys_of(source, stop):
    """{key: default} of the literal assignments of `source`'s statements up to the first
    statement that `stop` accepts: train.py's commented globals, sample.py's main() locals."""
    out = {}
    for node in source:
        if stop(node):
            break
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            out[node.targets[0].id] = ast.literal_eval(node.value)
    return out


def train_keys():
    body = ast.parse(read("train.py")).body
    is_setup = lambda n: (isinstance(n, ast.Assign)  # noqa: E731
                          and ast.unparse(n.targets[0]) == "sys.excepthook")
    return keys_of([n for n in body if not isinstance(n, (ast.Import, ast.ImportFrom, ast.Expr))],
                   is_setup)


def sample_keys():
    main = next(n for n in ast.parse(read("sample.py")).body
                if isinstance(n, ast.FunctionDef) and n.name == "main")
    return keys_of(main.body,
                   lambda n: isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "defaults")


def test_every_key_of_train_py_has_its_comment():
    """README says every key is a commented global: each default of train.py's block carries a
    comment on its line (a continuation line below it counts with it)."""
    lines = read("train.py").splitlines()
    body = ast.parse(read("train.py")).body
    keys = train_keys()
    bare = [n.targets[0].id for n in body if isinstance(n, ast.Assign)
            and isinstance(n.targets[0], ast.Name) and n.targets[0].id in keys
            and "#" not in lines[n.lineno - 1]]
    assert len(keys) > 60 and not bare, f"keys of train.py without a comment: {bare}"


def doc_table(text, heading):
    """{key: default text} of the `| key | default | what it does |` rows under `heading` (up to
    the next ## heading)."""
    section = text.split(heading, 1)[1]
    section = re.split(r"\n## ", section, maxsplit=1)[0]
    rows = re.findall(r"^\| *`?([a-z_0-9]+)`? *\| *`([^`]*)` *\|", section, flags=re.M)
    return dict(rows)


@pytest.mark.parametrize("which", ["train.py", "sample.py"])
def test_every_key_is_documented_with_its_default(which):
    keys = train_keys() if which == "train.py" else sample_keys()
    assert len(keys) > (60 if which == "train.py" else 8)  # the parse found the defaults
    doc = read("docs/configuration.md")
    heading = "## train.py" if which == "train.py" else "## sample.py"
    assert heading in doc, f"docs/configuration.md needs a '{heading}' section"
    documented = doc_table(doc, heading)
    missing = sorted(set(keys) - set(documented))
    assert not missing, f"keys of {which} without a row in docs/configuration.md: {missing}"
    extra = sorted(set(documented) - set(keys))
    assert not extra, f"docs/configuration.md documents keys {which} does not have: {extra}"
    wrong = {k: (documented[k], repr(v)) for k, v in keys.items() if documented[k] != repr(v)}
    assert not wrong, (f"defaults in docs/configuration.md that differ from {which} (doc, code): "
                       f"{wrong}")


def test_the_compatibility_matrix_is_the_refusal_table():
    doc = read("docs/configuration.md")
    table = guard_config.refusals_markdown()
    assert table in doc, ("docs/configuration.md's '## Refused combinations' must hold "
                          "guard_config.refusals_markdown():\n" + table)
    names = [name for name, _, _ in guard_config.REFUSALS]
    assert len(names) == len(set(names)) and all(f"| {n} |" in doc for n in names)


def test_readme_is_a_map_that_names_every_file():
    readme = read("README.md")
    assert len(readme.splitlines()) <= 200
    files = project_files() + ["bench.py"]
    missing = [f for f in files if f"`{f}`" not in readme]
    assert not missing, f"README.md's file map lacks {missing}"
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert os.path.isfile(os.path.join(ROOT, link)), \
            f"README.md links to {link}, which does not exist"


def anchors(text):
    """The #anchors GitHub gives a markdown file's headings: lowercased, punctuation dropped
    (letters, digits, '-', '_' and spaces stay), spaces to '-', a repeat numbered -1, -2, ..."""
    seen, out = {}, set()
    for line in re.sub(r"^```.*?^```", "", text, flags=re.M | re.S).splitlines():
        if m := re.match(r"#{1,6} +(.+?) *#*$", line):
            slug = re.sub(r"[^\w\- ]", "", m[1].lower()).replace(" ", "-")
            out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return out


def test_every_link_of_the_docs_resolves():
    """Each relative link of README.md and docs/*.md names a file that exists and, with a
    #part, a heading of that file (as GitHub renders it): a section that moves takes its
    links along."""
    pages = ["README.md"] + [os.path.join("docs", f)
                             for f in sorted(os.listdir(os.path.join(ROOT, "docs")))
                             if f.endswith(".md")]
    broken = []
    for page in pages:
        text = read(page)
        prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, part = target.partition("#")
            file = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(os.path.join(ROOT, file)):
                broken.append(f"{page}: ({target}): no file {file}")
            elif part and file.endswith(".md") and part not in anchors(read(file)):
                broken.append(f"{page}: ({target}): {file} has no heading #{part}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def project_imports():
    """{module: the project modules it imports}, counting imports anywhere in it (inside functions
    too), as ../shared/tools/import_layers.py counts them; a wing's file is 'techniques.zero',
    reached by `from techniques import zero` or `import techniques.zero`; bench.py and the tests
    sit on top."""
    mods = {module_of(f): f for f in project_files()}
    wings = {m.split(".")[0] for m in mods if "." in m}

    def reached(name):
        return {name} if name in mods else set()
    deps = {}
    for m, f in mods.items():
        names = set()
        for node in ast.walk(ast.parse(read(f))):
            if isinstance(node, ast.Import):
                names |= {x for a in node.names for x in reached(a.name)}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names |= reached(node.module)
                if node.module in wings:
                    names |= {x for a in node.names for x in reached(f"{node.module}.{a.name}")}
        deps[m] = names - {m}
    return deps


def test_the_files_stand_on_floors_as_the_readme_says():
    """No import circle, at most 8 floors (floor 1 imports no project file; a file stands one
    above the highest it imports), each file on the floor README's "How the files stand" gives
    it; the foundation imports nothing, checkpoint.py no technique."""
    deps, floor = project_imports(), {}

    def floor_of(m, path=()):
        assert m not in path, "import circle: " + " -> ".join(path[path.index(m):] + (m,))
        if m not in floor:
            floor[m] = 1 + max((floor_of(d, path + (m,)) for d in deps[m]), default=0)
        return floor[m]
    for m in sorted(deps):
        floor_of(m)
    assert max(floor.values()) <= 8, floor
    techniques = {"zero", "lora", "tensor_parallel", "fsdp", "pipeline"}
    assert (not deps["common"]
            and not {d.split(".")[-1] for d in deps["checkpoint"]} & techniques)
    section = read("README.md").split("### How the files stand")[1].split("\n## ")[0]
    said = {module_of(f + ".py"): int(row[0])
            for row in re.findall(r"^\| (\d+) \| (.*?) \|", section, re.M)
            for f in re.findall(r"`([\w/]+)\.py`", row[1])}
    wrong = {f: (said.get(f), floor.get(f)) for f in set(said) | set(floor)
             if said.get(f) != floor.get(f)}
    assert not wrong, ("README.md's 'How the files stand' puts files on other floors (README's, "
                       f"the real): {wrong}")


def test_the_reading_cost_counts_each_line_once():
    """bench/reading.py's count (the reading cost the README and STYLE keep under a bound):
    train.py's lines up to the point reached, plus each function's span elsewhere, once; a
    function nested in a counted one of the same file (a closure) adds nothing, one at the same
    lines of another file does, train.py's own
    functions are inside its lines already, and one seen twice counts once."""
    from bench.reading import reading_count
    funcs = [("model.py", "forward", 10, 29), ("model.py", "inner", 12, 15),
             ("model.py", "forward", 10, 29), ("optim.py", "step", 40, 40),
             ("train.py", "evaluate", 300, 310), ("model.py", "other", 40, 41)]
    total, per_file = reading_count(100, funcs)
    assert total == 100 + 20 + 2 + 1
    assert per_file == {"model.py": [("forward", 10, 29), ("other", 40, 41)],
                        "optim.py": [("step", 40, 40)]}


def test_every_python_block_of_the_docs_runs():
    """The docs' Python blocks all sit on docs/finetuning.md, whose workflow test runs each as
    written (tests/test_tokenizer.py); a block on another page needs a test that runs it."""
    pages = ["README.md"] + [f"docs/{f}" for f in sorted(os.listdir(os.path.join(ROOT, "docs")))
                             if f.endswith(".md")]
    counts = {page: read(page).count("```python") for page in pages}
    assert {p: n for p, n in counts.items() if n} == {"docs/finetuning.md": 3}, counts


def test_what_the_docs_commands_write_is_git_ignored():
    """Every path a command of the README, the docs, a config file or a script's docstring writes
    (out_dir=, export_hf=, export_lora=, export=, --out) is ignored by git: a user who follows
    them keeps a clean checkout."""
    import subprocess
    texts = [read(p) for p in ["README.md",
                               *(f"docs/{f}" for f in os.listdir(os.path.join(ROOT, "docs"))
                                 if f.endswith(".md")),
                               *(f"config/{f}" for f in os.listdir(os.path.join(ROOT, "config"))
                                 if f.endswith(".py"))]]
    texts += [ast.get_docstring(ast.parse(read(f))) or "" for f in project_files() + ["bench.py"]]
    written = r"(out_dir|export_hf|export_lora|export|--out)(?:=| = |(?<=--out) )(['\"]?[\w./-]+)"
    found = {(k, v.strip("'\"")) for t in texts for k, v in re.findall(written, t)}
    # directories, but export='s file
    paths = sorted(v + ("" if k == "export" else "/") for k, v in found
                   if v not in ("DIR", "D", "x") and not v.startswith(("/", "{")))
    # the scan works
    assert {"out/", "runs/sft_hf/", "runs/lora_adapter/", "out/model.pt"} <= set(paths), paths
    p = subprocess.run(
        ["git", "check-ignore", "--no-index", "--verbose", "--non-matching", *paths], cwd=ROOT,
        capture_output=True, text=True)
    missing = [line.split("\t")[1] for line in p.stdout.splitlines() if line.startswith("::")]
    assert p.returncode in (0, 1) and not missing, f"not git-ignored: {missing}"


def test_the_hostile_tables_count_is_the_tables():
    """docs/tests.md says how many cases the hostile-input table holds and which issues they
    come from: the table's own count, so that a row added there is counted here."""
    import test_hostile
    row = next(line for line in read("docs/tests.md").splitlines()
               if line.startswith("| `test_hostile.py` |"))
    assert f" {len(test_hostile.CASES)} crafted files and arguments" in row, \
        len(test_hostile.CASES)
    for issue in sorted({n for n, *_ in test_hostile.CASES if n > 10}):
        assert f"Numbered {issue}," in row, issue
