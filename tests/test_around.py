"""Around the run: two torchrun agents as two nodes (and one of them killed), plot.py's
picture of real runs' metrics, the evaluation command, small corpora."""

import json
import os
import signal
import struct
import subprocess
import sys
import time

import pytest
from conftest import REFERENCE, ROOT, assert_same_curve, free_port, read_metrics, run_train

# the kill case: long enough that the kill (at its first checkpoint) lands mid-run
KILLED = [*REFERENCE, "max_iters=30", "ckpt_interval=5", "keep_ckpts=0", "dist_timeout_s=15"]


def start_nodes(args, cwd, port):
    """Two torchrun agents as on two hosts (here one machine): one process each, a c10d
    rendezvous on 127.0.0.1:port, each agent in a session of its own so a test can kill a
    whole "node" (the agent and its worker, which torchrun starts in a session of its own too)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    return [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                              "--nproc_per_node=1", f"--node-rank={n}", "--rdzv-backend=c10d",
                              f"--rdzv-endpoint=127.0.0.1:{port}", os.path.join(ROOT, "train.py"),
                              *args], cwd=cwd, env=env, start_new_session=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for n in range(2)]


def finish(procs, timeout=300):
    out = [p.communicate(timeout=timeout) for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o + e for o, e in out)[-4000:]
    return out


def kill_node(agent):
    """SIGKILL to an agent and its worker: a host that lost power."""
    workers = [int(pid) for task in os.listdir(f"/proc/{agent.pid}/task")
               for pid in open(f"/proc/{agent.pid}/task/{task}/children").read().split()]
    for pid in [*workers, agent.pid]:
        os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def two_nodes(dataset, tmp_path_factory):
    """REFERENCE trained by two torchrun agents sharing out_dir: (out_dir, stdout of node 0)."""
    out = str(tmp_path_factory.mktemp("nodes") / "run")
    procs = start_nodes([*REFERENCE, f"dataset={dataset}", f"out_dir={out}"], os.path.dirname(out),
                        free_port())
    return out, finish(procs)[0][0]


def test_two_torchrun_agents_train_as_one_process(two_nodes, reference_run):
    out, stdout = two_nodes
    assert "dp=2" in stdout
    assert_same_curve(reference_run, read_metrics(out))
    # one checkpoint, written by both nodes into the shared out_dir (each its own part)
    assert sorted(os.listdir(os.path.join(out, "ckpt"))) == ["iter_0000008", "latest"]


def test_a_killed_node_ends_the_other_with_one_line_and_the_run_resumes(dataset, tmp_path):
    """Node 1 dies mid-run (agent and worker SIGKILLed after the first checkpoint): node 0
    ends with one error line within dist_timeout_s; the same two commands again continue from
    the checkpoint to the single-process curve of the whole run."""
    out, args = str(tmp_path / "run"), [*KILLED, f"dataset={dataset}"]
    procs = start_nodes([*args, f"out_dir={out}"], tmp_path, free_port())
    try:
        deadline = time.time() + 180
        while not os.path.exists(os.path.join(out, "ckpt", "latest")):
            assert (time.time() < deadline
                    and procs[0].poll() is None), "the run did not reach its first checkpoint"
            time.sleep(0.02)
        kill_node(procs[1])
        t0 = time.time()
        _, err = procs[0].communicate(timeout=120)
        waited = time.time() - t0
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert procs[0].returncode != 0 and waited < 15 + 30, waited
    done = [r["iter"] for r in read_metrics(out) if "loss" in r]
    assert max(done) < 29, "the run finished before the kill: nothing was tested"
    lines = err.splitlines()
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1 and "dist_timeout_s" in errors[0], err[-3000:]
    stdout, _ = finish(start_nodes([*args, f"out_dir={out}"], tmp_path, free_port()))[0]
    assert "resumed from" in stdout
    single = str(tmp_path / "single")
    run_train([*args, f"out_dir={single}"], cwd=tmp_path, fork=True)
    assert_same_curve(read_metrics(single), read_metrics(out))


def png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_plot_draws_two_real_runs(two_nodes, reference_run, tmp_path):
    pytest.importorskip("matplotlib",
                        reason="plot.py's picture needs matplotlib (requirements-test.txt has it)")
    single = tmp_path / "single"
    single.mkdir()
    (single / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reference_run))
    png = tmp_path / "curves.png"
    p = run_train([str(single), two_nodes[0], "--out", str(png)], cwd=tmp_path, script="plot.py")
    assert png_size(png) == (550, 400) and "2 run(s)" in p.stdout  # one panel: no mixture
    p = run_train([two_nodes[0], "--x", "time", "--out", str(tmp_path / "t.png")], cwd=tmp_path,
                  script="plot.py")
    assert png_size(tmp_path / "t.png") == (550, 400)


@pytest.mark.parametrize("content", ["", '{"iter": 0, "loss": 9.0}\n{"iter": 1, "lo'])
def test_plot_refuses_an_empty_or_torn_log_in_one_line(content, tmp_path):
    (tmp_path / "metrics.jsonl").write_text(content)
    p = run_train([str(tmp_path)], cwd=tmp_path, script="plot.py", check=False)
    assert (p.returncode == 1 and p.stderr.count("\n") == 1
            and p.stderr.startswith("error: ")), p.stderr
    assert ("is empty" if not content else "line 2") in p.stderr


def test_a_small_corpus_gets_a_val_document_and_meta_lists_the_files(tmp_path, capsys):
    """17 files at the default val_fraction=0.01: none falls to val by its hash, so the one
    nearest moves there (with a note); train and val hold exactly their documents' tokens."""
    import numpy as np

    import prepare
    import tokenizer
    from conftest import write_corpus
    root = write_corpus(str(tmp_path / "corpus"), n_docs=17, chars=400)
    names = sorted(os.listdir(root))
    # the case: the hash alone gives val nothing
    assert not any(prepare.is_val(n, 0.01) for n in names)
    meta = prepare.prepare(root, str(tmp_path / "d"), "cl100k_base", 512)
    note = capsys.readouterr().out
    moved = min(names, key=prepare.val_score)
    assert f"put none of the 17 documents in val, so {moved} went there" in note
    assert (meta["train_docs"], meta["val_docs"]) == (16, 1)
    assert meta["val_files"] == [moved] and meta["train_files"] == [n for n in names if n != moved]
    enc = tokenizer.get_tokenizer("cl100k_base", 512)
    ids = {n: tokenizer.encode(enc, open(os.path.join(root, n)).read()) + [enc.eot_token]
           for n in names}
    read = {s: np.fromfile(tmp_path / "d" / f"{s}.bin", dtype=np.uint16).tolist()
            for s in ("train", "val")}
    assert (read["val"] == ids[moved]
            and read["train"] == sum((ids[n] for n in names if n != moved), []))
    one = write_corpus(str(tmp_path / "one"), n_docs=1)
    with pytest.raises(prepare.UserError, match="has one document"):
        prepare.prepare(one, str(tmp_path / "d1"), "cl100k_base", 512, verbose=False)


def test_a_small_chat_corpus_moves_the_masks_along(tmp_path):
    import numpy as np

    import prepare
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"Add {i} and {i}.", "response": f"{2 * i}."})
                           + "\n" for i in range(3)))
    meta = prepare.prepare(str(src), str(tmp_path / "d"), "cl100k_base", 512, val_fraction=0.001,
                           verbose=False)
    assert meta["val_docs"] == 1 and meta["train_files"] == meta["val_files"] == ["chat.jsonl"]
    for split in ("train", "val"):
        tokens = np.fromfile(tmp_path / "d" / f"{split}.bin", dtype=np.uint16)
        mask = np.fromfile(tmp_path / "d" / f"{split}.mask.bin", dtype=np.uint8)
        assert (len(tokens) == len(mask) == meta[f"{split}_tokens"]
                and mask.sum() == meta[f"{split}_loss_tokens"] > 0)


def test_the_evaluation_command_on_a_run_and_its_export_against_transformers(
        two_nodes, corpus, dataset, tmp_path):
    """`python sample.py out_dir=RUN eval=True dataset=D` (a run), and init_from= its Hugging
    Face export on D prepared for it: the same val loss, which transformers' model computes
    alike over the whole val split (every chunk once, each target token counted once)."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from transformers import LlamaForCausalLM

    def val_line(args):
        p = run_train([*args, "eval=True", "block_size=32"], cwd=tmp_path, script="sample.py")
        # said before it runs
        assert "evaluating " in p.stdout and "M parameters) on the whole val split" in p.stdout
        loss, tokens = p.stdout.splitlines()[-1].split(": ", 1)[1].split(" ")[1:3]
        return float(loss), int(tokens.strip("(").replace(",", ""))

    run = val_line([f"out_dir={two_nodes[0]}", f"dataset={dataset}"])
    export, data_dir = str(tmp_path / "hf"), str(tmp_path / "for_hf")
    run_train([f"out_dir={two_nodes[0]}", f"export_hf={export}"], cwd=tmp_path, script="sample.py")
    run_train([corpus, "--out", data_dir, "--init_from", export, "--val_fraction", "0.2"],
              cwd=tmp_path, script="prepare.py")
    exported = val_line([f"init_from={export}", f"dataset={data_dir}"])
    tokens = torch.from_numpy(
        np.fromfile(os.path.join(data_dir, "val.bin"), dtype=np.uint16).astype(np.int64))
    n = (len(tokens) - 1) // 32
    x, y = tokens[:n * 32].view(n, 32), tokens[1:n * 32 + 1].view(n, 32)
    with torch.no_grad():
        logits = LlamaForCausalLM.from_pretrained(export).eval()(x).logits
    want = F.cross_entropy(logits.flatten(0, 1).double(), y.flatten()).item()
    assert run[1] == exported[1] == y.numel()
    assert (abs(run[0] - want) < 1e-5 * want
            and abs(exported[0] - want) < 1e-5 * want), (run, exported, want)


@pytest.fixture(scope="module")
def profiled(dataset, tmp_path_factory):
    """REFERENCE on 2 ranks with the profiler over iterations 3-5: (out_dir, the run's stdout)."""
    from conftest import torchrun
    out = str(tmp_path_factory.mktemp("profiled") / "run")
    p = torchrun(2, [*REFERENCE, f"dataset={dataset}", f"out_dir={out}", "profile_iters=3:6"],
                 cwd=os.path.dirname(out))
    return out, p.stdout


def test_the_profiler_writes_a_labelled_trace_per_rank_and_changes_nothing(
        profiled, reference_run):
    out, stdout = profiled
    assert_same_curve(reference_run, read_metrics(out))
    assert sorted(os.listdir(os.path.join(out, "trace"))) == ["rank0.json", "rank1.json"]
    for rank in range(2):
        with open(os.path.join(out, "trace", f"rank{rank}.json")) as f:
            names = {e.get("name") for e in json.load(f)["traceEvents"]}
        assert ({"forward", "backward", "grad sync", "clip grad norm", "optimizer step"}
                <= names), rank
        # the window: 3, 4, 5 (2 warms up)
        assert "ProfilerStep#4" in names and "ProfilerStep#2" not in names
    # the top operators' table
    assert "profiler: iterations 3-5 traced" in stdout and "Self CPU" in stdout


def summary_shape():
    """docs/checkpoints.md's summary block as regular expressions, one per line: a word with a
    digit or a / in it (a number, a path) stands for any such, and the command after the
    colon for any that runs train.py."""
    import re
    head = "```text\n" + "-" * 30 + " run summary "
    block = head[8:] + open(
        os.path.join(ROOT, "docs", "checkpoints.md")).read().split(head, 1)[1].split("```")[0]
    shapes = []
    for line in block.strip().splitlines():
        line, command = line.split(": ", 1) if " train.py " in line else (line, None)
        words = [r"\S+" if re.search(r"[\d/]", w) else re.escape(w) for w in line.split(" ")]
        shapes.append(" ".join(words) + (r": .*\btrain\.py .*" if command else ""))
    return shapes


def test_the_summary_reads_as_the_docs_show_it(profiled):
    """The block that ends a run (2 ranks), line by line as docs/checkpoints.md shows it, with
    this run's numbers: its last losses, tokens, checkpoint and the torchrun that continues it."""
    import re
    out, stdout = profiled
    lines = stdout[stdout.index("-" * 30 + " run summary "):].strip().splitlines()
    shape = summary_shape()
    assert (len(lines) == len(shape)
            and all(re.fullmatch(s, line) for s, line in zip(shape, lines))), (shape, lines)
    rows = read_metrics(out)
    last, val = [r for r in rows if "loss" in r][-1], [r for r in rows if "val_loss" in r][-1]
    assert (lines[1] == f"train loss {last['loss']:.4f} (iteration 7), val loss "
                        f"{val['val_loss']:.4f} (after 8)")
    assert lines[2].startswith(f"{8 * 4 * 4 * 32:,} tokens trained, ")
    assert lines[3] == f"checkpoint {out}/ckpt/iter_0000008"
    assert (lines[4].startswith("continue (twice as long, the decay kept where it ended): "
                                "torchrun --standalone --nproc_per_node=2 train.py ")
            and lines[4].endswith(" max_iters=16 lr_decay_iters=8"))


def test_quiet_phases_say_what_they_do_and_ctrl_c_skips_the_sample(dataset, tmp_path):
    """At a low peak_flops the first evaluation would take minutes: a line says so before it.
    The end-of-run sample says it samples; Ctrl-C there ends it at once, with a line that fits."""
    out = str(tmp_path / "run")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"),
                          *REFERENCE, "max_iters=2", f"dataset={dataset}",
                          f"out_dir={out}", "peak_flops=1e3", "sample_tokens=1000000"],
                         cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        seen = []
        for line in p.stdout:
            seen.append(line)
            if line.startswith("sampling 1000000 tokens"):
                break
        time.sleep(1)  # inside generate
        p.send_signal(signal.SIGINT)
        t0 = time.time()
        rest, err = p.communicate(timeout=60)
        waited = time.time() - t0
    finally:
        p.kill()
        p.wait()
    text = "".join(seen) + rest
    first_eval = text.index("iter 0: evaluating the 0.0")  # REFERENCE's model: 0.0x M parameters
    assert text[first_eval:].split("\n", 1)[0].endswith("M-parameter model ...")
    assert first_eval < text.index("iter 0: val loss")
    # at once: the million tokens would take an hour;
    # 30 s is the interpreter's exit on a loaded machine
    # (measured: 10 s on the 2-core machine at a load average of 25)
    assert p.returncode == 0 and waited < 30, (p.returncode, waited, err)
    assert ("sample skipped (Ctrl-C): the run is finished and saved" in rest
            and "finishing this step" not in err)
    assert "-" * 30 + " run summary " in rest
