import ast
import re

import pytest

from configurator import configure
from guards.guard_errors import UserError

DEFAULTS = {"n_layer": 4, "dropout": 0.1, "learning_rate": 3e-4, "compile": False,
            "out_dir": "out", "init_from": "scratch", "n_embd": 128}


def test_types_and_forms():
    got = configure(DEFAULTS, ["n_layer=6", "--dropout=0", "learning_rate=1e-3", "compile=True",
                               "out_dir=runs/a b", "init_from='resume'"])
    assert got == {"n_layer": 6, "dropout": 0.0, "learning_rate": 1e-3, "compile": True,
                   "out_dir": "runs/a b", "init_from": "resume"}
    assert type(got["dropout"]) is float  # dropout=0 is accepted and becomes a float
    # a string key keeps the text
    assert configure(DEFAULTS, ["out_dir=123"]) == {"out_dir": "123"}


@pytest.mark.parametrize("arg, message", [
    ("n_layer=2.5", "n_layer=2.5 on the command line has type float, but n_layer needs int"),
    ("compile=1", "compile=1 on the command line has type int, but compile needs bool"),
    ("n_layer=True", "has type bool, but n_layer needs int"),
    ("dropout=high", "dropout='high' on the command line has type str"),
])
def test_wrong_types_are_errors(arg, message):
    with pytest.raises(UserError, match=message):
        configure(DEFAULTS, [arg])


def test_unknown_key_suggests_the_closest():
    with pytest.raises(UserError, match="unknown config key 'n_layers' on the command line: did "
                                        "you mean 'n_layer'"):
        configure(DEFAULTS, ["n_layers=3"])
    with pytest.raises(UserError,
                       match="unknown config key 'zzz'.*python train.py --help lists them"):
        configure(DEFAULTS, ["--zzz=3"])
    with pytest.raises(UserError, match="is not key=value"):
        configure(DEFAULTS, ["--n_layer"])
    with pytest.raises(UserError, match="unknown config key 'zzz'.*python sample.py --help"):
        configure(DEFAULTS, ["zzz=3"], "sample.py")


@pytest.mark.parametrize("script", ["train.py", "sample.py", "prepare.py"])
def test_help_lists_every_key_with_its_default_and_comment(script, capsys, monkeypatch):
    """-h / --help: each key, its default and the comment beside it, read from the file that
    owns them (train.py's globals, sample.py's main(); prepare.py: its argparse options)."""
    import sys

    import prepare
    import sample
    from test_docs import sample_keys, train_keys
    for flag in ("-h", "--help"):
        with pytest.raises(SystemExit) as stop:
            if script == "prepare.py":
                monkeypatch.setattr(sys, "argv", ["prepare.py", flag])
                prepare.main()
            else:
                (sample.main([flag]) if script == "sample.py"
                 else configure(train_keys(), ["n_layer=2", flag]))
        out = capsys.readouterr().out
        assert stop.value.code in (0, None)  # exit status 0
        if script == "prepare.py":
            assert ("--val_fraction VAL_FRACTION" in out
                    and "share of documents that go to val (default: 0.01)" in out)
            continue
        keys = train_keys() if script == "train.py" else sample_keys()
        rows = [re.fullmatch(r"  (\w+) = (.+?)(?: {2,}(.*))?", line) for line in out.splitlines()
                if line[:2] == "  "]
        # every key, its default as the file has it
        assert {m[1]: ast.literal_eval(m[2]) for m in rows} == keys
        comments = {m[1]: m[3] for m in rows}
        assert ({"train.py": "'scratch' (must not); or where to start from: a Hugging Face",
                 "sample.py": "0: greedy"}[script]
                in comments["init_from" if script == "train.py" else "temperature"])


def test_help_into_a_closed_pipe_says_nothing_more():
    """`python train.py --help | head`: the reader went away, which is no error to report (no
    BrokenPipeError traceback, nor Python's "Exception ignored" at exit). The pipe's read end is
    closed before the script starts, so the first write fails every time."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for script in ("train.py", "sample.py", "prepare.py"):
        r, w = os.pipe()
        os.close(r)
        p = subprocess.run([sys.executable, os.path.join(root, script), "--help"],
                           stdout=w, stderr=subprocess.PIPE,
                           text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
        os.close(w)
        assert p.stderr == "", f"{script} --help into a closed pipe printed:\n{p.stderr[-2000:]}"


def test_config_file(tmp_path):
    good = tmp_path / "good.py"
    good.write_text("# a config\nimport math\nn_layer = 2\nn_embd = 16 * n_layer\ndropout = 0\n"
                    "_private = 5\n")
    # the command line comes after the file and wins
    got = configure(DEFAULTS, [str(good), "n_layer=3"])
    assert got == {"n_layer": 3, "n_embd": 32, "dropout": 0.0}
    typo = tmp_path / "typo.py"
    typo.write_text("learning_rte = 1e-3\n")
    with pytest.raises(
            UserError,
            match=r"unknown config key 'learning_rte' in .*typo.py: did you mean 'learning_rate'"):
        configure(DEFAULTS, [str(typo)])
    with pytest.raises(UserError, match="cannot read config file"):
        configure(DEFAULTS, [str(tmp_path / "missing.py")])


def test_command_line_values_are_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    payload = f"__import__('os').system('touch {marker}')"
    assert configure(DEFAULTS, [f"out_dir={payload}"]) == {"out_dir": payload}  # just a string
    with pytest.raises(UserError, match="has type str"):
        configure(DEFAULTS, [f"n_layer={payload}"])
    with pytest.raises(UserError):
        configure(DEFAULTS, ["n_layer=(lambda: 1)()"])
    assert not marker.exists()


def test_script_defaults_reads_literals_without_running_the_script(tmp_path):
    import os

    from conftest import ROOT

    from configurator import script_defaults
    script = tmp_path / "s.py"
    script.write_text("import sys\na = 1\nb = 'x'  # note\nc = a * 2\nsys.exit(3)\n")
    assert script_defaults(str(script)) == {"a": 1, "b": "x"}
    d = script_defaults(os.path.join(ROOT, "train.py"))
    assert {"n_layer", "batch_size", "grad_accum_steps", "vocab_size", "out_dir"} <= set(d)


def test_the_default_batch_is_raised_for_the_layout_and_a_given_one_is_checked(capsys, tmp_path):
    """grad_accum_steps left at its default (2) on 4 data-parallel ranks: raised to 4 with a
    note; interleaved 1F1B on dp=2 x pp=2: to 4 (each pipeline's micro-batches in groups of pp).
    Given explicitly, the same value is an error, not changed."""
    from conftest import validate_as_train as validate
    c = dict(_train_defaults(), out_dir=str(tmp_path / "out"))
    assert validate(c, {}, 4)["grad_accum_steps"] == 4
    assert "grad_accum_steps=2 (the default) raised to 4" in capsys.readouterr().out
    # the derivation makes a new config: the given one is unchanged
    assert c["grad_accum_steps"] == 2
    c = dict(_train_defaults(), out_dir=str(tmp_path / "out"), pp=2, n_layer=4, pp_virtual=2,
             pp_schedule="interleaved")
    assert validate(c, {"pp": 2}, 4)["grad_accum_steps"] == 4
    with pytest.raises(UserError, match="grad_accum_steps=2 micro-batches per iteration cannot be "
                                        "shared evenly by 4"):
        validate(dict(_train_defaults(), out_dir=str(tmp_path / "out")),
                 {"grad_accum_steps": 2}, 4)


def _train_defaults():
    import os

    from configurator import script_defaults
    return script_defaults(
        os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train.py"))


@pytest.mark.parametrize("recipe", ["config/cpt.py", "config/sft.py"])
def test_the_continuation_recipes_load_and_are_not_from_scratch_rates(recipe):
    """config/cpt.py and config/sft.py set only train.py's keys, with the right types, and a
    rate below the one train.py warns about on a trained model (its 1e-3, from optim.py)."""
    import os

    from conftest import ROOT

    from configurator import script_defaults
    defaults = script_defaults(os.path.join(ROOT, "train.py"))
    got = configure(defaults, [os.path.join(ROOT, recipe)])
    assert got["optim"] == "adamw" and got["learning_rate"] < 1e-3 <= defaults["learning_rate"]
    assert got["min_lr"] < got["learning_rate"] and got["embed_lr_scale"] == 1.0


def test_a_long_mistyped_value_is_cut_in_its_line():
    """A value of 100,000 characters (here one nested past Python's parser) is named by its first
    80, not repeated whole in the error line."""
    with pytest.raises(UserError) as e:
        configure({"max_iters": 3}, ["max_iters=" + "-" * 100000 + "1"])
    assert str(e.value).startswith("max_iters='---") and len(str(e.value)) < 200
