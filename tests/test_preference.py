"""Preference alignment (techniques/preference.py): TRL's three formats prepared, the loss at
step 0 and against TRL's DPOTrainer, every layout against the single process, LoRA, resume, the
refusals, TRL's cut of a pair too long for a row."""

import json
import math
import os

import numpy as np
import pytest
from conftest import TINY, assert_same_curve, read_metrics, run_train, torchrun

import prepare
import tokenizer
from guards.guard_errors import UserError

# 4 micro-batches of 2 pairs (dp=2: 2 each), whole pairs per micro-batch
PREF = [*TINY, "grad_accum_steps=4", "max_iters=6", "lr_decay_iters=6"]
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")


def chat_pairs(n=60):
    """Pairs in TRL's two conversational formats (explicit and implicit prompt), alternating;
    every third one has chosen = rejected (left out)."""
    lines = []
    for i in range(n):
        q = [{"role": "user", "content": f"What is {i} plus {i}?"}]
        good = [{"role": "assistant", "content": f"It is {2 * i}."}]
        bad = [{"role": "assistant", "content": f"It is {2 * i + 3}, I think." if i % 3 else
                f"It is {2 * i}."}]
        lines.append({"prompt": q, "chosen": good, "rejected": bad} if i % 2 else
                     {"chosen": q + good, "rejected": q + bad})
    return lines


def write_jsonl(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def pairs_dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    out = str(root / "data")
    prepare.prepare(write_jsonl(root / "pairs.jsonl", chat_pairs()), out, "cl100k_base", 512,
                    val_fraction=0.2, verbose=False, block_size=32)
    return out


def sequences(data_dir, split="train"):
    """[(ids, mask)] of each pair's chosen then rejected sequence."""
    meta = json.load(open(os.path.join(data_dir, "meta.json")))
    tokens = np.fromfile(os.path.join(data_dir, f"{split}.bin"), dtype=meta["dtype"])
    mask = np.fromfile(os.path.join(data_dir, f"{split}.mask.bin"), dtype=np.uint8)
    index = np.load(os.path.join(data_dir, f"{split}.pairs.npy"))
    return [[(tokens[s:s + n].tolist(), mask[s:s + n].tolist()) for s, n in row.reshape(2, 2)]
            for row in index], meta


def test_trls_three_formats_are_prepared_with_masks_on_the_completions(tmp_path, pairs_dataset):
    pairs, meta = sequences(pairs_dataset)
    assert meta["format"] == "preference" and meta["pairs_dropped"]["same"] == 20
    assert meta["train_pairs"] + meta["val_pairs"] == 40
    enc = tokenizer.tokenizer_from_meta(meta)
    for (c_ids, c_mask), (r_ids, r_mask) in pairs:
        learned = [enc.decode([i for i, m in zip(ids, mask) if m])
                   for ids, mask in ((c_ids, c_mask), (r_ids, r_mask))]
        # the loss counts the completion (its end of turn too), never the prompt
        assert learned[0].startswith("It is ") and learned[0].endswith("<|end|>")
        assert learned[1] != learned[0] and "plus" not in learned[0] + learned[1]
        n = c_mask.index(1)
        assert c_ids[:n] == r_ids[:n] and enc.decode(c_ids[:n]).endswith("<|assistant|>")
    # an implicit prompt is the turns both share: the same tokens as the explicit one
    a, b = tmp_path / "a", tmp_path / "b"
    for path, lines in ((a, chat_pairs(12)[1::2]), (b, [{"chosen": p["prompt"] + p["chosen"],
                                                        "rejected": p["prompt"] + p["rejected"]}
                                                       for p in chat_pairs(12)[1::2]])):
        path.mkdir()  # (the same file name: a pair's split is a function of its file and line)
        prepare.prepare(write_jsonl(path / "p.jsonl", lines), str(path / "data"),
                        "cl100k_base", 512, val_fraction=0.3, verbose=False)
    assert sequences(str(a / "data"))[0] == sequences(str(b / "data"))[0]
    # plain text, as TRL: prompt + completion + EOS, the EOS learned; no chat tokens; a prompt that
    # fills a row dropped, a sequence longer than a row counted as cut
    text = [{"prompt": f"Q: {i} + {i} =", "chosen": f" {2 * i}", "rejected": f" {2 * i + 1}"}
            for i in range(20)] + [{"prompt": "long " * 40, "chosen": " a", "rejected": " b"},
                                   {"prompt": "Q:", "chosen": " x" * 40, "rejected": " y"}]
    meta = prepare.prepare(write_jsonl(tmp_path / "t.jsonl", text), str(tmp_path / "t"),
                           "cl100k_base", 512, val_fraction=0.2, verbose=False, block_size=16)
    assert meta["extra_tokens"] == [] and meta["pairs_dropped"] == {"same": 0, "empty": 0,
                                                                   "prompt": 1, "cut": 1}
    (c_ids, c_mask), _ = sequences(str(tmp_path / "t"))[0][0]
    enc = tokenizer.tokenizer_from_meta(meta)
    assert c_ids[-1] == enc.eot_token and c_mask[-1] == 1 and enc.decode(c_ids).startswith("Q: ")


@pytest.mark.parametrize("records, match", [
    ([{"prompt": "q", "chosen": "a", "rejected": [{"role": "assistant", "content": "b"}]}],
     "must both be strings or both lists"),
    ([{"chosen": "a", "rejected": "b"}], "needs a string 'prompt'"),
    ([{"prompt": "q", "chosen": "a", "rejected": "b"},
      {"prompt": [], "chosen": [{"role": "assistant", "content": "a"}],
       "rejected": [{"role": "assistant", "content": "b"}]}], "mixes plain-text and conversa"),
    ([{"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "robot", "content": "a"}],
       "rejected": [{"role": "assistant", "content": "b"}]}], "has role 'robot'"),
])
def test_bad_pairs_are_one_line_and_leave_nothing(tmp_path, records, match):
    out = tmp_path / "data"
    with pytest.raises(UserError, match=match):
        prepare.prepare(write_jsonl(tmp_path / "bad.jsonl", records * 4), str(out),
                        "cl100k_base", 512, verbose=False)
    assert not os.path.exists(out) and os.listdir(tmp_path) == ["bad.jsonl"]


def train_lines(rows):
    return {r["iter"]: r for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def single(pairs_dataset, tmp_path_factory):
    """The full fine-tuning run of PREF by one process: its out_dir."""
    out = str(tmp_path_factory.mktemp("single") / "run")
    run_train([*PREF, f"dataset={pairs_dataset}", f"out_dir={out}"], cwd=os.path.dirname(out),
              fork=True)
    return out


def test_step_0_is_ln2_and_every_layout_gives_the_single_process_curve(tmp_path, pairs_dataset,
                                                                      single):
    ref = read_metrics(single)
    first = train_lines(ref)[0]
    # policy = reference: each pair's loss is -log sigmoid(0) = ln 2, its rewards 0
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["rewards/margins"] == pytest.approx(0, abs=1e-6)
    last = train_lines(ref)[5]
    assert last["loss"] < 0.6 and last["rewards/accuracies"] > 0.5 and last["rewards/margins"] > 0
    # the same curve and the same metrics: tp=2 with sp (the vocabulary-parallel loss's rows),
    # pp=2 (the last stage forms the pairs' sums, and the reference's), cp=2 (each rank holds
    # part of every row: the rows' losses gathered)
    for name, layout in (("tp2", ["tp=2", "sp=True"]), ("pp2", ["pp=2"]), ("cp2", ["cp=2"])):
        out = str(tmp_path / name)
        torchrun(2, [*PREF, f"dataset={pairs_dataset}", f"out_dir={out}", *layout], tmp_path)
        got = read_metrics(out)
        assert_same_curve(ref, got)
        for it, r in train_lines(ref).items():
            for k in METRICS:
                assert train_lines(got)[it][k] == pytest.approx(r[k], rel=1e-4, abs=1e-5), (
                    name, it, k)
        # the reference's tables as out_dir keeps them (rank 0 writes them: pp's first stage)
        for f in sorted(f for f in os.listdir(single) if f.endswith(".npy")):
            np.testing.assert_allclose(np.load(os.path.join(out, f)),
                                       np.load(os.path.join(single, f)), rtol=1e-5)
    # LoRA on that run: the reference is the base with the adapters off; dp=2 with ZeRO-1 (each
    # rank 2 micro-batches) gives its curve
    lora = ["lora_rank=4", "learning_rate=3e-3", f"init_from={single}", "max_iters=4"]
    one, two = str(tmp_path / "lora1"), str(tmp_path / "lora2")
    run_train([*PREF, f"dataset={pairs_dataset}", f"out_dir={one}", *lora], tmp_path, fork=True)
    torchrun(2, [*PREF, f"dataset={pairs_dataset}", f"out_dir={two}", *lora, "zero=1"], tmp_path)
    assert train_lines(read_metrics(one))[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert_same_curve(read_metrics(one), read_metrics(two))
    # sample.py eval=True on pairs: TRL's metrics on the whole val split, against the run's start
    p = run_train([f"out_dir={one}", "eval=True", f"dataset={pairs_dataset}"], tmp_path,
                  script="sample.py")
    line = p.stdout.strip().splitlines()[-1]
    assert f"against {single}: loss " in line and "rewards/accuracies" in line, line


def test_a_resume_is_exact_and_reads_the_kept_reference(tmp_path, pairs_dataset, single):
    out = str(tmp_path / "run")
    run_train([*PREF, f"dataset={pairs_dataset}", f"out_dir={out}", "max_iters=3"], tmp_path,
              fork=True)
    tables = sorted(f for f in os.listdir(out) if f.startswith("ref_logps"))
    p = run_train([*PREF, f"dataset={pairs_dataset}", f"out_dir={out}"], tmp_path, fork=True)
    assert "reference:" not in p.stdout  # read again, not recomputed from trained weights
    a, b = train_lines(read_metrics(single)), train_lines(read_metrics(out))
    assert a.keys() == b.keys()
    for it in a:
        assert [a[it][k] for k in ("loss", "grad_norm", *METRICS)] == [
            b[it][k] for k in ("loss", "grad_norm", *METRICS)]
    # without its reference a resume is refused (the checkpoints hold trained weights)
    for f in tables:
        os.remove(os.path.join(out, f))
    p = run_train([*PREF, f"dataset={pairs_dataset}", f"out_dir={out}", "max_iters=8"], tmp_path,
                  fork=True, check=False)
    assert p.returncode != 0 and "are gone (never recomputed from trained weights)" in p.stderr


def test_two_steps_equal_trls_dpo_trainer(tmp_path):
    """From a tiny LLaMA that transformers builds (Llama 3's kind of tokenizer) and the same
    plain-text pairs, two steps of DPO (AdamW, a constant rate, clipping at 1): each step's
    loss, rewards, log-probs and gradient norm equal TRL's DPOTrainer's (its reference a copy of
    the model; ours the log-probs computed once). Step 0 is exactly ln 2, rewards 0."""
    import torch
    from datasets import Dataset
    from test_families import make_base
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer
    base = make_base("llama3.2", str(tmp_path / "base"))
    pairs = [{"prompt": f"Question {i}: what is {i} and {i}?", "chosen": f" It is {2 * i}.",
              "rejected": f" Maybe {i * 3 + 1}, maybe not."} for i in range(6)]
    source = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    train = [p for i, p in enumerate(pairs, 1) if not prepare.is_val(f"pairs.jsonl:{i}", 0.3)]
    assert len(train) == 4  # one global batch: both take every pair each step
    out = str(tmp_path / "ours")
    run_train([f"init_from={base}", f"dataset={tmp_path / 'data'}", f"data_source={source}",
               "val_fraction=0.3", "batch_size=8", "grad_accum_steps=1", "max_iters=2",
               "learning_rate=1e-2", "min_lr=1e-2", "warmup_iters=0", "weight_decay=0",
               "beta2=0.999", "embed_lr_scale=1", "optim=adamw", "grad_clip=1.0",
               "block_size=64", "dtype=float32", "sample_tokens=0", "log_interval=1",
               "eval_iters=1", "peak_flops=1e9", f"out_dir={out}"], tmp_path, fork=True)
    ours = train_lines(read_metrics(out))
    args = DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, max_steps=2,
                     learning_rate=1e-2, lr_scheduler_type="constant", warmup_steps=0,
                     weight_decay=0.0, max_grad_norm=1.0, adam_beta2=0.999, bf16=False,
                     logging_steps=1, report_to=[], use_cpu=True, beta=0.1, save_strategy="no")
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                         args=args, train_dataset=Dataset.from_list(train),
                         processing_class=AutoTokenizer.from_pretrained(base))
    trainer.train()
    theirs = trainer.state.log_history[:2]
    assert ours[0]["loss"] == theirs[0]["loss"] == pytest.approx(math.log(2), abs=1e-7)
    assert ours[0]["rewards/margins"] == theirs[0]["rewards/margins"] == 0.0
    for it in (0, 1):
        for k in ("loss", "grad_norm", *METRICS):
            assert ours[it][k] == pytest.approx(theirs[it][k], rel=1e-5, abs=1e-6), (it, k)
    assert theirs[1]["rewards/margins"] > 0.1  # the second step compares trained weights


def test_ipo_simpo_and_cdpo_are_trls():
    """The losses and rewards of one micro-batch: SimPO and cDPO-style smoothing against TRL's own
    CPOTrainer.cpo_loss (called on a stand-in trainer), IPO and the smoothed sigmoid as TRL's
    DPOTrainer writes them (its loss is one long method, transcribed here term by term)."""
    import types

    import torch
    import torch.nn.functional as F
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    from techniques import preference
    torch.manual_seed(0)
    losses, mask = torch.rand(6, 7) * 3, (torch.rand(6, 7) > 0.3).float()
    mask[:, 0] = 1
    ref = -torch.rand(6) * 10
    pi_c, pi_r = (-(losses * mask).sum(-1)).chunk(2)
    n_c, n_r = mask.sum(-1).chunk(2)
    ref_c, ref_r = ref.chunk(2)
    base = {"datasets": "", "phases": [], "beta": 0.3, "label_smoothing": 0.1,
            "simpo_gamma": 0.5}
    simpo = preference.PairLoss({**base, "loss_type": "simpo"}, None)
    trainer = types.SimpleNamespace(alpha=0.0, loss_type="simpo", simpo_gamma=0.5, beta=0.3,
                                    label_smoothing=0.1,
                                    accelerator=types.SimpleNamespace(device="cpu"))
    want, reward_c, reward_r = CPOTrainer.cpo_loss(trainer, pi_c / n_c, pi_r / n_r)
    assert simpo(losses, mask, ref).item() == pytest.approx(want.mean().item(), rel=1e-6)
    got = simpo.metrics(simpo.take(), 3)
    assert got["rewards/chosen"] == pytest.approx(reward_c.mean().item(), rel=1e-6)
    assert got["rewards/margins"] == pytest.approx((reward_c - reward_r).mean().item(), rel=1e-6)
    d = (pi_c - ref_c) - (pi_r - ref_r)
    for loss_type, want in (
            ("sigmoid", -F.logsigmoid(0.3 * d) * 0.9 - F.logsigmoid(-0.3 * d) * 0.1),
            ("ipo", ((pi_c - ref_c) / n_c - (pi_r - ref_r) / n_r - 1 / (2 * 0.3)) ** 2)):
        loss = preference.PairLoss({**base, "loss_type": loss_type}, None)
        assert loss(losses, mask, ref).item() == pytest.approx(want.mean().item(), rel=1e-6)
        got = loss.metrics(loss.take(), 3)
        assert got["rewards/chosen"] == pytest.approx(0.3 * (pi_c - ref_c).mean().item(), rel=1e-6)
        assert got["logps/rejected"] == pytest.approx(pi_r.mean().item(), rel=1e-6)


def test_pairs_from_arrow_are_the_pairs_from_jsonl(tmp_path):
    """The same pairs as an .arrow file (Arrow IPC, as datasets writes it) give the same
    sequences as the .jsonl (issue 68: TRL's formats from JSONL, Parquet or Arrow)."""
    import pyarrow as pa
    records = chat_pairs(12)[1::2]
    prepared = []
    for name in ("jsonl", "arrow"):
        path = tmp_path / name
        path.mkdir()
        if name == "jsonl":
            source = write_jsonl(path / "p.jsonl", records)
        else:
            source = str(path / "p.arrow")
            with pa.OSFile(source, "wb") as f, pa.ipc.new_stream(
                    f, pa.Table.from_pylist(records).schema) as w:
                w.write_table(pa.Table.from_pylist(records))
        prepare.prepare(source, str(path / "data"), "cl100k_base", 512, val_fraction=0.3,
                        verbose=False)
        prepared.append(sorted(sequences(str(path / "data"), "train")[0]
                               + sequences(str(path / "data"), "val")[0]))
    assert prepared[0] == prepared[1] and len(prepared[0]) == 4  # (2 with chosen = rejected)


def test_a_pair_too_long_for_its_row_is_cut_as_trls_collator_cuts_it(tmp_path):
    """TRL 1.16's DPO cuts each sequence (prompt + completion) to its first max_length tokens
    (DataCollatorForPreference, truncation_mode='keep_start', its only mode not deprecated; no
    max_prompt_length any more) and drops a pair whose prompt alone fills max_length. A row of
    ours holds block_size + 1 tokens: the same rows and masks as that collator at max_length =
    block_size + 1, from the same ids; a prompt of block_size + 1 tokens is dropped."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from techniques import preference
    text = [{"prompt": f"Q{i}: " + "why " * (3 * i), "chosen": " yes" * (2 + 3 * i),
             "rejected": " no" * (12 - i)} for i in range(10)]  # (line 10 goes to val)
    meta = prepare.prepare(write_jsonl(tmp_path / "t.jsonl", text), str(tmp_path / "t"),
                           "cl100k_base", 512, val_fraction=0.3, verbose=False)  # uncut
    c = {"block_size": 16, "batch_size": 2, "grad_accum_steps": 1, "seed": 0}
    loader = preference.PairLoader(str(tmp_path / "t"), "train", c)
    x, y, mask = loader.pair_rows(np.arange(loader.n_chunks))
    ours = torch_cat_ids(x, y)
    examples = []
    for (c_ids, c_mask), (r_ids, r_mask) in sequences(str(tmp_path / "t"))[0]:
        n = c_mask.index(1)
        examples.append({"prompt_ids": c_ids[:n], "chosen_ids": c_ids[n:],
                         "rejected_ids": r_ids[n:]})
    assert max(len(e["prompt_ids"]) + len(e["chosen_ids"]) for e in examples) > 17  # some cut
    batch = DataCollatorForPreference(pad_token_id=meta["eot_token"], max_length=17)(examples)
    # (both lay the rows out alike: every chosen, then every rejected)
    theirs, their_mask = batch["input_ids"], batch["completion_mask"]
    assert theirs.shape[1] == 17 and ours.tolist() == theirs.tolist()
    assert mask.tolist() == their_mask[:, 1:].float().tolist()
    # the drop: TRL keeps a pair while len(prompt_ids) < max_length
    long = [{"prompt": "a" + " b" * k, "chosen": " yes", "rejected": " no"} for k in (15, 16)]
    short = [{"prompt": f"Q{i}:", "chosen": " yes", "rejected": " no"} for i in range(10)]
    meta = prepare.prepare(write_jsonl(tmp_path / "l.jsonl", long + short), str(tmp_path / "l"),
                           "cl100k_base", 512, val_fraction=0.3, verbose=False, block_size=16)
    enc = tokenizer.tokenizer_from_meta(meta)
    assert [len(enc.encode(p["prompt"])) for p in long] == [16, 17]
    assert meta["pairs_dropped"]["prompt"] == 1


def torch_cat_ids(x, y):
    """The whole rows back from inputs and targets (B, T) each: (B, T + 1)."""
    import torch
    return torch.cat([x, y[:, -1:]], dim=1)
