"""Dataset mixtures and curriculum phases: the shares of the sources, a global batch that is a
pure function of (seed, iteration, phases), resume across a phase boundary, every layout equal
to one process, per-source losses, and the mistakes refused in one line."""

import json
import os

import numpy as np
import pytest
from conftest import TINY, assert_same_curve, read_metrics, run_train, torchrun

import configurator
import data
import prepare
from guards import guard_data
from guards.guard_errors import UserError
from techniques import mixture


@pytest.fixture(scope="module")
def sources(tmp_path_factory, dataset):
    """Three prepared sources with the tiny tokenizer: text (the session's dataset), chat (SFT
    masks), and notes (text again); and one with another vocabulary."""
    root = tmp_path_factory.mktemp("mix")
    chat = root / "chat.jsonl"
    chat.write_text(
        "\n".join(json.dumps({"prompt": f"What is {i} plus {i}?", "response": f"It is {2 * i}."})
                  for i in range(120)) + "\n")
    notes = root / "notes"
    notes.mkdir()
    for i in range(60):
        (notes / f"n{i:02d}.txt").write_text(
            f"note {i}: " + " ".join(f"item{j * i % 97}" for j in range(200)))
    out = {"tiny": dataset}
    for name, src, vocab in (("chat", chat, 512), ("notes", notes, 512), ("wide", notes, 600)):
        out[name] = str(root / name)
        prepare.prepare(str(src), out[name], "cl100k_base", vocab, val_fraction=0.2, verbose=False)
    # a multiple-choice task scored at each evaluation (evals.py):
    # its scores compared on every layout
    out["task"] = str(root / "sums.jsonl")
    with open(out["task"], "w") as f:
        f.writelines(json.dumps({"context": f"What is {i} plus {i}? It is",
                                 "choices": [f" {2 * i + d}" for d in (0, 1, 2)], "answer": 0})
                     + "\n" for i in range(9))
    return out


def mix_loader(sources, names, weights, phases=(), temperature=1.0, batch_size=4,
               grad_accum_steps=2, dp_rank=0, dp=1):
    loaders = [
        data.Loader(sources[n], "train", 32, batch_size, grad_accum_steps, 1337, dp_rank, dp)
        for n in names]
    return mixture.MixtureLoader(loaders, names, weights,
                                 configurator.parse_phases(list(phases), names), temperature)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_shares_follow_the_weights_and_every_stream_is_read_in_order(sources, temperature):
    mix = mix_loader(sources, ["tiny", "notes"], [0.7, 0.3], temperature=temperature)
    src = mix.sources(np.arange(1000))  # 1,000 global batches of 8 slots
    want = np.array([0.7, 0.3]) ** (1 / temperature)
    want /= want.sum()
    share = np.bincount(src.ravel(), minlength=2) / src.size
    assert np.abs(share - want).max() < 0.02, (share, want)
    # each source's stream is consumed in order, no position skipped or taken twice, and an
    # iteration's batch is the same whether computed after its predecessors or alone
    seen = {0: [], 1: []}
    for it in range(40):
        s, sample = mix.global_samples(it)
        for k in (0, 1):
            seen[k] += list(sample[s == k])
    for k in (0, 1):
        assert seen[k] == list(range(len(seen[k])))
    fresh = mix_loader(sources, ["tiny", "notes"], [0.7, 0.3], temperature=temperature)
    for it in (39, 7, 0):
        a, b = fresh.batch(it), mix.batch(it)
        assert all((u == v).all() for u, v in zip(a[:2] + a[3:], b[:2] + b[3:]))


def test_phases_switch_the_weights_and_lr_and_ranks_take_their_slice(sources):
    phases = [(0, {"tiny": 1.0}), (6, {"tiny": 0.5, "chat": 0.5}, 0.5)]
    mix = mix_loader(sources, ["tiny", "chat"], [1.0, 1.0], phases)
    src = mix.sources(np.arange(12))
    assert (src[:6] == 0).all() and (src[6:] == 1).any() and (src[6:] == 0).any()
    assert [mix.lr_scale(i) for i in (0, 5, 6, 100)] == [1.0, 1.0, 0.5, 0.5]
    assert (mix.counts_before(6) == [48, 0]).all()
    # a text source mixed with a chat one: its loss mask is all ones; the chat rows keep theirs
    x, y, mask, s = mix.batch(7)
    assert mask is not None and (mask[s == 0] == 1).all() and (mask[s == 1] == 0).any()
    # two data-parallel ranks: their slices, side by side, are the one-process global batch
    halves = [mix_loader(sources, ["tiny", "chat"], [1.0, 1.0], phases, dp_rank=r, dp=2).batch(7)
              for r in (0, 1)]
    for j in range(4):
        assert (np.concatenate([h[j] for h in halves]) == np.asarray((x, y, mask, s)[j])).all()
    # one source, no phases: exactly the plain Loader's batches
    one, plain = (mix_loader(sources, ["tiny"], [1.0]),
                  data.Loader(sources["tiny"], "train", 32, 4, 2, 1337))
    for it in (0, 3, 500):
        assert all((a == b).all() for a, b in zip(one.batch(it)[:2], plain.batch(it)[:2]))


def test_phases_parse_and_refuse(sources, capsys):
    names = ["a", "b"]
    spec = '[(0, {"a": 1}), (6, {"a": 1}), (9, {"b": 1})]'
    # the config check: a run that ends first is told so
    configurator.parse_phases(spec, names, max_iters=7)
    assert capsys.readouterr().out == ("note: the phases at iteration 9 start at or after "
                                       "max_iters=7: this run ends before them (raise max_iters, "
                                       "or start them earlier)\n")
    configurator.parse_phases(spec, names, max_iters=10)
    assert capsys.readouterr().out == ""
    # one source trained stdlib, silently: now it says dataset=
    for one in ("tinyb", "elsewhere/notes:1"):
        with pytest.raises(UserError,
                           match=r"names one source, which is no mixture: write dataset="):
            configurator.parse_mixture(one)
    # a source listed twice, and two directories of one name (the logs know a source by it)
    twice = r"^datasets: 'dc' is listed twice: list each source once$"
    with pytest.raises(UserError, match=twice):
        configurator.parse_mixture("x/dc:1,x/dc:2")
    with pytest.raises(UserError, match=r"^datasets: /a/dc and /b/dc are both named 'dc': "):
        configurator.parse_mixture("/a/dc:1,/b/dc:1")
    # with phases: their lr_scale
    assert configurator.parse_mixture("a", phases=[(0, {"a": 1.0}, 0.5)]) == {"a": 1.0}
    assert configurator.parse_phases('[(0, {"a": 1}), (6, {"a": 0.5, "b": 0.5}, 0.5)]', names) == \
        [(0, {"a": 1.0}, 1.0), (6, {"a": 0.5, "b": 0.5}, 0.5)]
    for bad, match in (("[(-1, {'a': 1.0})]", "before 0"),
                       ("[(5, {'a': 1.0}), (3, {'b': 1.0})]", "increasing"),
                       ("[(0, {'c': 1.0})]", "'c'"), ("[(0, {'a': 0})]", "positive"),
                       ("[(0, 'a')]", "is not .start_iter"),
                       ("[(0, {'a': 1.0}, -1)]", "lr_scale"), ("[(0,", "literal")):
        with pytest.raises(UserError, match=match):
            configurator.parse_phases(bad, names)
    with pytest.raises(UserError, match="different tokenizers"):
        mixture.check_tokenizers({n: guard_data.read_meta(sources[n]) for n in ("tiny", "wide")})
    # text + chat of one base: the chat vocabulary covers both
    chat_meta = guard_data.read_meta(sources["chat"])
    assert mixture.check_tokenizers(
        {n: guard_data.read_meta(sources[n]) for n in ("tiny", "chat")}) == chat_meta


MIX = [*TINY, "n_layer=4", "grad_accum_steps=4", "max_iters=8", "lr_decay_iters=8",
       "doc_mask=True", "mix_temperature=2.0"]


def mix_args(sources, **extra):
    phases = ('[(0, {"tiny": 1.0, "chat": 1.0}), '
              '(6, {"tiny": 0.5, "chat": 0.5, "notes": 1.0}, 0.5)]')
    return [*MIX, f"datasets={sources['tiny']}:0.7,{sources['chat']}:0.2,{sources['notes']}:0.1",
            f"phases={phases}", f"eval_tasks={sources['task']}",
            *(f"{k}={v}" for k, v in extra.items())]


@pytest.fixture(scope="module")
def mix_run(sources, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("mixrun") / "run")
    p = run_train(mix_args(sources, out_dir=out), cwd=os.path.dirname(out), fork=True)
    return read_metrics(out), p.stdout, out


def test_mixture_run_logs_sources_and_resumes_exactly_across_a_phase(mix_run, sources, tmp_path):
    rows, stdout, _ = mix_run
    train = {r["iter"]: r for r in rows if "loss" in r}
    assert "[tiny " in stdout and "val loss" in stdout
    # per-source losses, each over its own target tokens of the global batch, average to the loss
    mix = mix_loader(sources, ["tiny", "chat", "notes"], [0.7, 0.2, 0.1],
                  [(0, {"tiny": 1.0, "chat": 1.0}),
                   (6, {"tiny": 0.5, "chat": 0.5, "notes": 1.0}, 0.5)], 2.0,
                  grad_accum_steps=4)
    for it, r in train.items():
        _, y, mask, s = mix.batch(it)
        tokens = {n: float(mask[s == k].sum()) for k, n in enumerate(mix.names)}
        assert (set(k for k in r if k.startswith("loss/"))
                == {f"loss/{n}" for n, t in tokens.items() if t > 0})
        mean = sum(r[f"loss/{n}"] * t for n, t in tokens.items() if t > 0) / sum(tokens.values())
        assert abs(mean - r["loss"]) < 1e-5 * abs(r["loss"]), (it, mean, r["loss"])
    # notes enters at the phase boundary
    assert "loss/notes" not in train[5] and "loss/notes" in train[6]
    # the LR of the phase: iteration 6 on runs at half the schedule's rate (cosine to max_iters=8)
    assert abs(train[6]["lr"] / train[5]["lr"]
               - 0.5 * (1e-3 + 0.5 * (1 + np.cos(np.pi * 4 / 6)) * 9e-3) /
               (1e-3 + 0.5 * (1 + np.cos(np.pi * 3 / 6)) * 9e-3)) < 1e-9
    val = [r for r in rows if "val_loss" in r]
    assert val and all({"val_loss/tiny", "val_loss/chat", "val_loss/notes"} <= set(r) for r in val)
    w = np.array([0.7, 0.2, 0.1]) ** 0.5
    w /= w.sum()
    assert abs(val[-1]["val_loss"] - sum(
        wi * val[-1][f"val_loss/{n}"] for wi, n in zip(w, ("tiny", "chat", "notes")))) < 1e-9
    # stopped at 4 and resumed (the boundary at 6 lies ahead): the same run, bit for bit
    half = str(tmp_path / "half")
    run_train(mix_args(sources, out_dir=half, max_iters=4), cwd=tmp_path, fork=True)
    run_train(mix_args(sources, out_dir=half, max_iters=8), cwd=tmp_path, fork=True)
    b = read_metrics(half)
    keys = lambda rows: [{k: v for k, v in r.items()  # noqa: E731
                          if "loss" in k or k in ("iter", "lr", "grad_norm")}
                         for r in rows if r["iter"] != 4 or "val_loss" not in r]
    assert keys(b) == keys(rows)


def assert_same_sources(a, b):
    assert_same_curve(a, b)
    for key in {k for r in a for k in r if "/" in k}:
        la, lb = ({r["iter"]: r[key] for r in rows if key in r} for rows in (a, b))
        assert set(la) <= set(lb) and la, key
        assert all(abs(la[i] - lb[i]) < 1e-5 * max(1.0, abs(la[i])) for i in la), key


# each data-parallel kind train.py accepts with a mixture (per-source losses are summed over dp)
@pytest.mark.parametrize("extra",
                         [{}, {"zero": 2, "offload": True}, {"fsdp": True}, {"ddp_impl": "naive"}],
                         ids=["bucketed", "zero2-offload", "fsdp", "naive"])
def test_mixture_on_two_data_parallel_ranks_equals_one_process(extra, mix_run, sources, tmp_path):
    out = str(tmp_path / "dp2")
    torchrun(2, mix_args(sources, out_dir=out, **extra), cwd=tmp_path)
    assert_same_sources(mix_run[0], read_metrics(out))


def test_mixture_on_two_pipeline_stages_equals_one_process(mix_run, sources, tmp_path):
    out = str(tmp_path / "pp2")  # interleaved: two chunks of one layer per stage
    torchrun(2, mix_args(sources, out_dir=out, pp=2, pp_schedule="interleaved", pp_virtual=2),
             cwd=tmp_path)
    assert_same_sources(mix_run[0], read_metrics(out))


def test_mixture_under_tensor_parallel_equals_one_process(mix_run, sources, tmp_path):
    """tp=2: the per-source losses from the vocabulary-parallel cross-entropy,
    logits never gathered."""
    out = str(tmp_path / "tp2")
    torchrun(2, mix_args(sources, out_dir=out, tp=2), cwd=tmp_path)
    assert_same_sources(mix_run[0], read_metrics(out))


def test_mixture_under_sequence_and_context_parallel_equals_one_process(mix_run, sources,
                                                                        tmp_path):
    """tp=2 sp and cp=2: each target's loss gathered over the sequence, so the per-source sums are
    whole, and so are a task's log-likelihoods (evals.py) and the bits per byte."""
    assert any("task/sums/gold_ll" in r and "val_bpb/chat" in r for r in mix_run[0])
    for name, extra in (("sp", {"tp": 2, "sp": True}), ("cp", {"cp": 2})):
        torchrun(2, mix_args(sources, out_dir=tmp_path / name, **extra), cwd=tmp_path)
        assert_same_sources(mix_run[0], read_metrics(tmp_path / name))


# the options no other run pairs with a mixture, or with each other: Muon with tied embeddings
# (dp=2); LoRA on that tied base (dp=2), and (every target, the head's included) on an untied
# one under the interleaved pipeline
LORA_ALL = ["lora_rank=4", "lora_alpha=8", "lora_targets=wq,wk,wv,wo,w1,w2,w3,output"]


@pytest.mark.parametrize("case", ["tied-dp2", "interleaved"])
def test_mixture_with_muon_lora_and_tied_embeddings_equals_one_process(case, mix_run, sources,
                                                                       tmp_path):
    def same_on_two_ranks(name, options, layout):
        single, sharded = str(tmp_path / name), str(tmp_path / f"{name}_2")
        run_train([*mix_args(sources, out_dir=single), *options], cwd=tmp_path, fork=True)
        torchrun(2, [*mix_args(sources, out_dir=sharded), *options, *layout], cwd=tmp_path)
        assert_same_sources(read_metrics(single), read_metrics(sharded))
        return single
    if case == "tied-dp2":
        base = same_on_two_ranks("muon", ["optim=muon", "tie_embeddings=True"], [])
        # (not the head: it is the embedding, and lora.py refuses an adapter on a tied head)
        same_on_two_ranks(
            "lora", [*LORA_ALL[:2], "lora_targets=wq,wk,wv,wo,w1,w2,w3", f"init_from={base}"], [])
    else:
        same_on_two_ranks("lora", [*LORA_ALL, f"init_from={mix_run[2]}"],
                          ["pp=2", "pp_schedule=interleaved", "pp_virtual=2"])


@pytest.mark.parametrize("args, match", [
    (["datasets={tiny}:0.7,nowhere:0.3"], "dataset 'nowhere' is not prepared"),
    (["datasets={tiny}:0.7,{chat}:0"], "weights must be positive"),
    (["datasets={tiny},{wide}"], "different tokenizers"),
    (["datasets={tiny},{chat}", "phases=[(-1, {{'tiny': 1.0}})]"], "starts before 0"),
    (["datasets={tiny},{chat}", "phases=[(5, {{'tiny': 1.0}}), (2, {{'chat': 1.0}})]"],
     "increasing"),
    (["datasets={tiny},{chat}", "phases=[(0, {{'txt': 1.0}})]"], "names source 'txt'"),
])
def test_bad_mixtures_give_one_clear_line(sources, tmp_path, args, match):
    p = run_train([*TINY, "max_iters=1", f"out_dir={tmp_path / 'out'}",
                   *(a.format(**sources) for a in args)],
                  cwd=tmp_path, check=False, fork=True)
    lines = p.stderr.strip().splitlines()
    assert (p.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: ")
            and match in lines[0]), p.stderr


def test_phases_in_a_config_file_are_a_real_list(sources, tmp_path):
    cfg = tmp_path / "mix.py"
    cfg.write_text(f"datasets = '{sources['tiny']}:1,{sources['notes']}:1'\n"
                   f"phases = [(0, {{'tiny': 1.0}}), (1, {{'notes': 1.0}}, 0.5)]\n")
    out = tmp_path / "out"
    run_train([*TINY, str(cfg), "max_iters=2", "eval_interval=100", f"out_dir={out}"],
              cwd=tmp_path, fork=True)
    rows = [r for r in read_metrics(str(out)) if "loss" in r]
    assert set(rows[0]) >= {"loss/tiny"} and "loss/notes" not in rows[0]
    assert "loss/notes" in rows[1] and "loss/tiny" not in rows[1]
    assert (json.load(open(out / "config.json"))["phases"]
            == [[0, {"tiny": 1.0}], [1, {"notes": 1.0}, 0.5]])


def test_configurator_takes_a_list_key_as_a_literal_or_a_real_list(tmp_path):
    want = [(0, {"a": 1.0}), (6, {"a": 0.5, "b": 0.5}, 0.5)]
    assert configurator.configure(
        {"phases": []}, ['phases=[(0, {"a": 1.0}), (6, {"a": 0.5, "b": 0.5}, 0.5)]']) == \
        {"phases": want}
    cfg = tmp_path / "c.py"
    # a tuple where the default is a list: taken as a list
    cfg.write_text("phases = ((0, {'a': 1.0}),)\n")
    assert configurator.configure({"phases": []}, [str(cfg)]) == {"phases": [(0, {"a": 1.0})]}
    with pytest.raises(UserError, match="needs list"):
        configurator.configure({"phases": []}, ["phases=3"])
