"""evals.py: bits per byte beside the val loss, multiple-choice tasks scored as
lm-evaluation-harness scores them (the layouts: tests/test_matrix.py compares every cell's
task scores and bits per byte with the single process)."""

import json
import math
import os
import re

import numpy as np
import pytest
import torch
from conftest import HF, TINY, read_metrics, run_train

import data
import evals
from guards import guard_data
import tokenizer as tokenizer_py
from model import ModelConfig, Transformer
from guards.guard_errors import UserError


def write_task(path, questions):
    path.write_text("".join(json.dumps(q) + "\n" for q in questions), encoding="utf-8")
    return str(path)


QUESTIONS = [
    {"context": "def square(x):\n    return ", "choices": ["x * x", "x + x", "None"], "answer": 0},
    # the space moves to the choice; a choice of more bytes than characters
    {"context": "import ", "choices": ["os", "os.path as p", "héllo wörld"], "answer": 1},
    # cut from the left
    {"context": "for i in range(10):\n" * 6 + "    print(",
     "choices": ["i)", "'done')"], "answer": 0},
    {"context": "", "choices": [" the end", " a beginning"], "answer": 1},
]


def test_choice_logliks_equal_transformers_on_the_export(tmp_path):
    """Each choice's log-likelihood given its context, ours and transformers' on our Hugging
    Face export of the same model, to 1e-4; the row is the context, the choice (as
    lm-evaluation-harness splits the text; this tokenizer adds no BOS), cut from the left past
    block_size; an empty context is <|endoftext|> (lm-evaluation-harness's prefix token)."""
    from transformers import LlamaForCausalLM

    from formats import hf
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=300, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=64)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    enc = tokenizer_py.get_tokenizer("cl100k_base", 300)
    task = evals.Task(write_task(tmp_path / "made.jsonl", QUESTIONS), enc, 32)
    assert task.name == "made" and len(task) == 10 and task.answers == [0, 1, 0, 1]
    x, y, mask = task.rows(range(len(task)))
    # "import " + "os": the space goes with the choice, whose ids follow the context's
    whole, context = enc.encode_ordinary("import os"), enc.encode_ordinary("import")
    row = 3
    assert x[row, 0] == whole[0] and x[-1, 0] == x[-2, 0] == enc.eot_token
    assert y[row][mask[row] == 1].tolist() == whole[len(context):]
    assert x[row, :len(whole) - 1].tolist() == whole[:-1]
    long_row = 6  # 6 lines of context: cut from the left to block_size + 1 tokens
    assert mask[long_row, -1] == 1 and len(task.ids[long_row]) == 33
    ours = evals.plain_logliks(model, task, 3, torch.device("cpu"))

    hf.save_hf(str(tmp_path / "hf"), model.state_dict(), cfg, enc)
    theirs = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    for r in range(len(task)):
        n = int(mask[r].nonzero().max()) + 1  # the row's length before padding
        with torch.no_grad():
            logp = torch.log_softmax(theirs(x[r:r + 1, :n]).logits[0].double(), -1)
        want = (logp.gather(1, y[r, :n, None])[:, 0] * mask[r, :n]).sum().item()
        assert abs(ours[r] - want) < 1e-4, (r, ours[r], want)
    assert all(ll < 0 for ll in ours)



@pytest.mark.parametrize("tail", [2, None])
def test_a_context_encoded_once_gives_each_choice_the_ids_of_the_whole_text(monkeypatch, tail):
    """encode_choices (the context encoded once, each choice after its last TAIL tokens) gives
    encode_pair's ids (context + choice encoded whole, the choice's those past the context's
    count): choices that join the context's last word or number, without a leading space, of
    several bytes a character, after spaces moved from the context; and takes the shortcut on a
    long context."""
    if tail:  # (None: evals.TAIL)
        monkeypatch.setattr(evals, "TAIL", tail)
    enc = tokenizer_py.get_tokenizer("cl100k_base", 300)
    body = "def square(x):\n    return x * x  # héllo 日本 123\n\n" * 12
    ends = ["", "Hello wor", "12345", "it", "word  ", "a\n\n ", "日", "x = (", "🚀"]
    choices = ["ld", " world", "6", "'s", "s", "😀", "é", "\n\tx", "  two", "<|endoftext|>", "本"]
    whole, pair = [], evals.encode_pair  # the choices encoded whole: no shortcut
    monkeypatch.setattr(evals, "encode_pair", lambda *a: whole.append(1) or pair(*a))
    for end in ends:
        context = body + end
        ctx, got = evals.encode_choices(enc, context, choices)
        assert [(ctx, c) for c in got] == [pair(enc, context, c) for c in choices], repr(end)
    assert len(whole) < len(ends) * len(choices) // 2


def test_acc_and_acc_norm_are_the_definitions_worked_by_hand(tmp_path):
    """acc: the highest log-likelihood is the answer's; acc_norm: the highest per character of
    the choice; acc_bytes: per UTF-8 byte (lm-evaluation-harness's three). Log-likelihoods set by
    hand, the scores worked out here."""
    enc = tokenizer_py.get_tokenizer("cl100k_base", 512)
    task = evals.Task(write_task(tmp_path / "t.jsonl", [
        {"context": "q0", "choices": [" a", " bbbbbbbbbb"], "answer": 1},
        {"context": "q1", "choices": ["é", "e"], "answer": 0},
        {"context": "q2", "choices": ["x", "y", "z"], "answer": 2}]), enc, 16)
    assert task.bytes == [2, 11, 2, 1, 1, 1, 1] and task.chars == [2, 11, 1, 1, 1, 1, 1]
    lls = [-2.0, -5.0, -3.0, -2.0, -1.0, -1.0, -0.5]
    # q0: acc picks " a" (-2 > -5), wrong; by length -2/2 = -1 < -5/11 = -0.45:
    # " bbbbbbbbbb", right (characters and bytes alike).
    # q1: acc picks "e" (-2 > -3), wrong; acc_norm too ("é" is 1 character: -3 < -2), wrong;
    # acc_bytes: "é" is 2 bytes, -1.5 > -2, right.
    # q2: all pick "z" (-0.5), right.
    s = evals.scores(task, lls)
    assert s == {"acc": 1 / 3, "acc_norm": 2 / 3, "acc_bytes": 1.0,
                 "gold_ll": (-5.0 - 3.0 - 0.5) / 3}
    # ties go to the first choice, as numpy's argmax: q0 wrong, q1 right, q2 wrong
    assert evals.scores(task, [-1.0, -1.0, -2.0, -2.0, -1.0, -1.0, -1.0])["acc"] == 1 / 3


@pytest.mark.parametrize("line, match", [
    ('{"context": "a", "choices": ["b"], "answer": 0}', "not a question"),
    ('{"context": "a", "choices": ["b", "c"], "answer": 2}', "not a question"),
    ('{"context": "a", "choices": ["b", ""], "answer": 0}', "not a question"),
    ('{"context": 1, "choices": ["b", "c"], "answer": 0}', "not a question"),
    ('{"context": "a", "choices": ["b", "c"], "answer": true}', "not a question"),
    ('{"context": "a", "choices": ["b", "c"], "answer": 0', "malformed JSON"),
    ("", "has no questions"),
])
def test_a_bad_task_file_is_one_line_naming_it(tmp_path, line, match):
    enc = tokenizer_py.get_tokenizer("cl100k_base", 512)
    good = '{"context": "ok", "choices": ["a", "b"], "answer": 0}\n'
    (tmp_path / "t.jsonl").write_text(good * bool(line) + line)
    with pytest.raises(UserError, match=match) as e:
        evals.Task(str(tmp_path / "t.jsonl"), enc, 16)
    assert "\n" not in str(e.value) and "t.jsonl" in str(e.value)
    with pytest.raises(UserError, match="is not a file"):
        evals.Task(str(tmp_path / "missing.jsonl"), enc, 16)


def test_the_run_logs_bits_per_byte_and_task_scores_and_sample_py_agrees(dataset, tmp_path):
    """A run with eval_tasks logs val_bpb = val_loss x target tokens / (ln 2 x their UTF-8 bytes),
    counted here from the eval batches' decoded text, and each task's scores; sample.py eval=True
    scores the final checkpoint as the run's last evaluation did."""
    task = write_task(tmp_path / "made.jsonl", QUESTIONS * 2)
    out = str(tmp_path / "run")
    p = run_train([*TINY, f"dataset={dataset}", f"out_dir={out}", "max_iters=4", "eval_interval=2",
                   f"eval_tasks={task}"], cwd=tmp_path, fork=True)
    assert "iter 4: val loss " in p.stdout and " bits/byte; made acc " in p.stdout
    evals_ = [r for r in read_metrics(out) if "val_loss" in r]
    assert [r["iter"] for r in evals_] == [0, 2, 4]
    meta = guard_data.read_meta(dataset)
    enc = tokenizer_py.tokenizer_from_meta(meta)
    loader = data.Loader(dataset, "val", 32, 4, 2, seed=1337)
    _, y, _ = loader.rows(np.arange(2 * loader.global_batch))  # eval_iters=2 global batches
    text = enc.decode_bytes([t for t in y.flatten().tolist() if t != meta["eot_token"]])
    for r in evals_:
        want = r["val_loss"] * y.numel() / (math.log(2) * len(text))
        assert abs(r["val_bpb"] - want) < 1e-9 * want, (r, want)
        assert 0 <= r["task/made/acc"] <= 1 and 0 <= r["task/made/acc_norm"] <= 1
        assert r["task/made/gold_ll"] < 0
    # each evaluation scores the weights of its iteration
    assert evals_[-1]["task/made/gold_ll"] != evals_[0]["task/made/gold_ll"]
    # gold_ll: the mean over questions of the answer's log-likelihood summed over its tokens,
    # by hand from the last checkpoint (a row's mean per token passed the acc checks)
    import checkpoint
    model = checkpoint.load_whole(checkpoint.find(out, None))[0].eval()
    t, gold = evals.Task(task, enc, 32), []
    for q, answer in enumerate(t.answers):
        r = t.row_question.tolist().index(q) + answer
        x, y, m = t.rows([r])
        with torch.no_grad():
            logp = torch.log_softmax(model(x)[0].double(), -1)
        gold.append((logp[0].gather(1, y[0, :, None])[:, 0] * m[0]).sum().item())
    assert abs(evals_[-1]["task/made/gold_ll"] - sum(gold) / len(gold)) < 1e-6, gold
    p = run_train([f"out_dir={out}", "eval=True", f"eval_tasks={task}", f"dataset={dataset}"],
                  cwd=tmp_path, script="sample.py")
    val_line, task_line = p.stdout.splitlines()[-2:]
    last = evals_[-1]
    want = (f"made acc {last['task/made/acc']:.4f} acc_norm {last['task/made/acc_norm']:.4f} "
            f"acc_bytes {last['task/made/acc_bytes']:.4f} (8 questions)")
    assert want in task_line, (want, task_line)
    assert " bits/byte)" in val_line
    found = re.search(r" (\S+) \(\S+ target tokens, (\S+) bits/byte\)", val_line)
    loss, bpb = float(found[1]), float(found[2])
    n_tokens, n_bytes = evals.split_bytes(dataset, 32, enc)
    assert abs(bpb - loss * n_tokens / (math.log(2) * n_bytes)) < 1e-3


def test_bytes_are_the_decoded_text_of_the_targets_markers_none(dataset):
    """split_bytes: every target of the val split read whole, <|endoftext|> 0 bytes, the rest
    the UTF-8 bytes of their text (each token's, tiktoken's exact bytes)."""
    meta = guard_data.read_meta(dataset)
    enc = tokenizer_py.tokenizer_from_meta(meta)
    tokens = np.fromfile(os.path.join(dataset, "val.bin"), dtype=meta["dtype"])
    n = (len(tokens) - 1) // 32
    targets = tokens[1:n * 32 + 1].tolist()
    assert meta["eot_token"] in targets
    text = enc.decode_bytes([t for t in targets if t != meta["eot_token"]])
    assert evals.split_bytes(dataset, 32, enc) == (len(targets), len(text))
    lengths = evals.byte_lengths(
        tokenizer_py.get_tokenizer("cl100k_base", 512, ["<|user|>", "kubernetes"]))
    # <|endoftext|> and a role token are no text; a domain word added as a token is
    assert lengths[511] == 0 and lengths[512] == 0 and lengths[513] == len("kubernetes")
    # ids between its tokens: none
    full = evals.byte_lengths(tokenizer_py.get_tokenizer("cl100k_base"))
    assert (len(full) == 100277 and full[100256] == full[100257] == 0
            and full[:256].tolist() == [1] * 256)


def lm_eval_questions(config, source):
    """The questions lm-evaluation-harness's own task config (its yaml in lm_eval/tasks, its
    process_docs) asks of a benchmark file: doc_to_text, then target_delimiter, before each of
    doc_to_choice, the answer doc_to_target; the file read as its split."""
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._yaml_loader import load_yaml
    cfg = load_yaml(os.path.join(os.path.dirname(lm_eval.tasks.__file__), config))
    split = cfg.get("test_split") or cfg["validation_split"]
    cfg.update(dataset_path="parquet" if source.endswith(".parquet") else "json",
               dataset_name=None, dataset_kwargs={"data_files": {split: source}},
               **{k: None for k in ("training_split", "validation_split") if cfg.get(k) != split})
    (task,) = TaskManager(include_defaults=False).load([cfg])["tasks"].values()
    delimiter = task.config.target_delimiter
    return [{"context": task.doc_to_text(d), "choices": [delimiter + c for c in
                                                        task.doc_to_choice(d)],
             "answer": task.doc_to_target(d)} for d in task.eval_docs]
@pytest.mark.parametrize("packing", ["concat", "bfd"])
def test_bits_per_byte_counts_only_the_targets_that_train_on_chat_data(chat_dataset, packing):
    """On chat data (end to end, or packed whole with padding), the bytes and tokens of bits per
    byte are those of the targets the loss counts, the replies: the prompt's tokens and the
    padding are masked out of both, as of the loss (worked from the decoded text here)."""
    meta = guard_data.read_meta(chat_dataset)
    enc = tokenizer_py.tokenizer_from_meta(meta)
    lengths = evals.byte_lengths(enc)
    loader = data.Loader(chat_dataset, "val", 32, 4, 2, 0, packing=packing)
    _, y, mask = loader.rows(np.arange(8))
    kept = y[mask == 1].tolist()
    assert 0 < len(kept) < y.numel()
    markers = {i for i in set(y.flatten().tolist()) if lengths[i] == 0}
    text = enc.decode_bytes([t for t in kept if t not in markers])
    assert evals.target_bytes(y, mask, lengths) == (len(kept), len(text))
    # what the run divides by: the Evaluator's counts over eval_iters=1 global batch (8 rows)
    scorer = evals.Evaluator("", {"chat": loader}, lengths, None, None, None, 1)
    assert scorer.counts["chat"] == (len(kept), len(text))


def test_a_mixtures_bits_per_byte_weighs_its_sources_as_its_val_loss_does(dataset):
    """val_bpb of a mixture: the sources' bits per byte weighed by the mixture's weights (as
    mixture.val_losses weighs val_loss), each source's own beside it."""
    enc = tokenizer_py.tokenizer_from_meta(guard_data.read_meta(dataset))
    loaders = {"a": data.Loader(dataset, "val", 32, 4, 2, 0),
               "b": data.Loader(dataset, "val", 16, 2, 2, 0)}
    scorer = evals.Evaluator("", loaders, evals.byte_lengths(enc), None, None, None, 2)
    record, _ = scorer.run({"a": 2.0, "b": 1.0}, None, {"a": 0.75, "b": 0.25})
    bpb = {k: evals.bits_per_byte(v, *scorer.counts[k]) for k, v in (("a", 2.0), ("b", 1.0))}
    assert record == {"val_bpb": 0.75 * bpb["a"] + 0.25 * bpb["b"], "val_bpb/a": bpb["a"],
                      "val_bpb/b": bpb["b"]}


def test_sample_py_scores_tasks_with_the_document_mask_exactly_when_the_run_had_one(
        tmp_path, monkeypatch, capsys):
    """sample.py eval=True (score_tasks): a model trained with doc_mask is scored with the
    documents' mask, one trained without with none (the scores alone rarely tell)."""
    seen = []
    monkeypatch.setattr(evals, "plain_logliks", lambda model, task, bs, device, doc_ids=None:
                        seen.append(doc_ids) or [-1.0] * len(task))
    enc = tokenizer_py.get_tokenizer("cl100k_base", 512)
    path = write_task(tmp_path / "t.jsonl", QUESTIONS)
    for doc_mask in (False, True):
        evals.score_tasks(torch.nn.Linear(1, 1), str(path), enc, 32,
                          {"device": "cpu", "batch_size": 2, "doc_mask": doc_mask}, "m")
    assert seen[0] is None and callable(seen[1])


def test_the_benchmarks_convert_to_task_files_with_lm_evaluation_harness_prompts(tmp_path, capsys):
    """`python evals.py hellaswag|arc|piqa IN OUT`: a record of each as its Hugging Face dataset
    holds it (JSONL, or Parquet with ARC's struct of choices) -> the question
    lm-evaluation-harness's own task config asks of it (hellaswag.yaml, arc_easy.yaml, piqa.yaml:
    the same prompt, choices and answer; the space between them at the context's end, so
    acc_norm counts the choice's characters as it does); a file of another benchmark is one line
    naming the row."""
    import pyarrow
    import pyarrow.parquet as pq
    hellaswag = {"activity_label": "Making a cake", "ctx_a": "She mixes the flour.",
                 "ctx_b": "then she", "endings": ["bakes it [title] Enjoy.", "eats  the bowl."],
                 "label": "0", "split": "val"}
    (tmp_path / "h.jsonl").write_text(json.dumps(hellaswag) + "\n")
    arc = {"id": "x", "question": "Which is a gas?", "answerKey": "C",
           "choices": {"text": ["rock", "water", "steam"], "label": ["A", "B", "C"]}}
    pq.write_table(pyarrow.Table.from_pylist([arc, arc]), tmp_path / "arc.parquet")
    (tmp_path / "p.jsonl").write_text(
        json.dumps({"goal": "Open a jar", "sol1": "twist", "sol2": "sing", "label": 0}) + "\n")
    for kind, src, config in (("hellaswag", "h.jsonl", "hellaswag/hellaswag.yaml"),
                              ("arc", "arc.parquet", "arc/arc_easy.yaml"),
                              ("piqa", "p.jsonl", "piqa/piqa.yaml")):
        evals.convert([kind, str(tmp_path / src), str(tmp_path / f"{kind}.jsonl")])
        ours = [json.loads(line)
                for line in (tmp_path / f"{kind}.jsonl").read_text().splitlines()]
        theirs = lm_eval_questions(config, str(tmp_path / src))
        # ours: the space that ends the context, which scoring moves to each choice
        assert [{**q, "context": q["context"][:-1], "choices": [" " + c for c in q["choices"]]}
                for q in ours] == theirs, kind
        assert all(q["context"].endswith(" ") for q in ours)
    assert theirs == [{"context": "Question: Open a jar\nAnswer:", "choices": [" twist", " sing"],
                       "answer": 0}]
    assert "arc.jsonl: 2 arc questions" in capsys.readouterr().out
    # a valid task
    evals.Task(str(tmp_path / "arc.jsonl"), tokenizer_py.get_tokenizer("cl100k_base", 512), 16)
    with pytest.raises(UserError, match=r"h.jsonl:1: not a piqa record \(KeyError: 'goal'\)"):
        evals.convert(["piqa", str(tmp_path / "h.jsonl"), str(tmp_path / "x.jsonl")])
    with pytest.raises(UserError,
                       match=re.escape("usage: python evals.py hellaswag|arc|piqa IN OUT")):
        evals.convert(["mmlu", "a", "b"])
    with pytest.raises(UserError, match="missing.jsonl is not a file: give the arc file"):
        evals.convert(["arc", str(tmp_path / "missing.jsonl"), str(tmp_path / "x.jsonl")])


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_a_model_tokenizers_token_bytes_are_its_texts(tmp_path, family):
    """bits per byte under a model's tokenizer.json: each id's bytes (HFTokenizer's
    decode_single_token_bytes) joined are the text's UTF-8, byte-level (Qwen2) or SentencePiece
    with byte fallback (Mistral: its '▁' a space, so one more before the first word)."""
    import hf_families
    hf_families.write_tokenizer(family, str(tmp_path))
    enc = tokenizer_py.get_tokenizer(str(tmp_path / "tokenizer.json"))
    lengths = evals.byte_lengths(enc)
    for text in ["Héllo wörld, 日本語 🚀 code:\n\tx = 1  # ü", "plain ascii words"]:
        ids = tokenizer_py.encode(enc, text)
        want = (" " if family == "mistral" else "") + text
        assert (b"".join(enc.decode_single_token_bytes(i) for i in ids)
                == want.encode()), (family, text)
        assert lengths[ids].sum() == len(want.encode())
    assert lengths[enc.eot_token] == 0


def test_a_datasets_token_bytes_are_its_tokenizers_and_hostile_ones_are_one_line(
        dataset, chat_dataset, tmp_path):
    """prepare.py writes token_bytes.npy (what train.py's bits per byte reads without building a
    tokenizer): equal to byte_lengths of the tokenizer the data was made with, chat tokens
    included; a damaged or foreign one is one line, and an older dataset without it is None."""
    for d in (dataset, chat_dataset):
        meta = guard_data.read_meta(d)
        want = evals.byte_lengths(tokenizer_py.tokenizer_from_meta(meta))
        assert guard_data.read_token_bytes(d, meta["vocab_size"]).tolist() == want.tolist()
    assert guard_data.read_token_bytes(str(tmp_path), 512) is None
    for bad, match in ((np.ones(7, np.int32), "not 512 byte counts"),
                       (np.full(512, -1), "not 512 byte counts"),
                       (np.array([{"a": 1}], dtype=object), "cannot be read")):
        np.save(tmp_path / "token_bytes.npy", bad)
        with pytest.raises(UserError, match=match):
            guard_data.read_token_bytes(str(tmp_path), 512)


# ---- the peer: lm-evaluation-harness -----------------------------------------------------------

# the row's start in every case: an empty context (the prefix token), one cut from the left past
# block_size, a space moved to the choice, choices that differ in characters and in bytes
PEER_QUESTIONS = [
    {"context": "The capital of France is", "choices": [" Paris", " Rome", " a city"],
     "answer": 0},
    {"context": "", "choices": [" the end", " a beginning"], "answer": 1},
    {"context": "def square(x):\n    return ", "choices": ["x * x", "x + x", "None"], "answer": 0},
    {"context": "Question: Which is warmer, the sun or the moon?\nAnswer:",
     "choices": [" the sun", " the moon, café crème"], "answer": 0},
    {"context": "for i in range(10):\n" * 8 + "    print(", "choices": ["i)", "'done')"],
     "answer": 0},
    {"context": "She opened the jar and", "choices": [" ate the pickles", " sang", " éé"],
     "answer": 0},
]


def lm_eval_scores(tmp_path, model_dir, task_path, block_size, batch_size=4):
    """(scores, each row's log-likelihood) of task_path scored by lm-evaluation-harness itself:
    HFLM on the Hugging Face directory, the file as a local task of its own (the choices carry
    their space: target_delimiter ""), truncated past block_size as its max_length."""
    from lm_eval.evaluator import evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    tasks = tmp_path / "lm_eval_tasks"
    tasks.mkdir(exist_ok=True)
    (tasks / "peer.yaml").write_text(
        "task: peer\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {task_path}\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: '{{context}}'\ndoc_to_choice: choices\n"
        "doc_to_target: answer\ntarget_delimiter: ''\nmetric_list:\n  - metric: acc\n"
        "  - metric: acc_norm\n  - metric: acc_bytes\n")
    # (simple_evaluate less its environment report, and only this task indexed: seconds)
    lm = HFLM(pretrained=model_dir, dtype="float32", max_length=block_size,
              batch_size=batch_size, device="cpu")
    manager = TaskManager(include_path=str(tasks), include_defaults=False)
    out = evaluate(lm, manager.load(["peer"]), bootstrap_iters=0, verbosity="ERROR")
    res = out["results"]["peer"]
    lls = [resp[0] for s in sorted(out["samples"]["peer"], key=lambda s: s["doc_id"])
           for resp in s["filtered_resps"]]
    return {k: res[f"{k},none"] for k in ("acc", "acc_norm", "acc_bytes")}, lls


def ours_on(model_dir, task_path, block_size, batch_size=4):
    """(scores, each row's log-likelihood) of the task by evals.py on our import of model_dir,
    with its own tokenizer."""
    from formats import hf
    kwargs, weights = hf.load_hf(model_dir)
    model = Transformer(ModelConfig(**{**kwargs, "block_size": block_size}))
    weights.setdefault("output.weight", weights["tok_embeddings.weight"])  # tied
    model.load_state_dict(weights)
    enc = tokenizer_py.get_tokenizer(os.path.join(model_dir, "tokenizer.json"))
    task = evals.Task(task_path, enc, block_size)
    lls = evals.plain_logliks(model.eval(), task, batch_size, torch.device("cpu"))
    return evals.scores(task, lls), lls, task


def assert_peer_agrees(tmp_path, model_dir, task_path, block_size, batch_size=4):
    ours, ours_ll, task = ours_on(model_dir, task_path, block_size, batch_size)
    theirs, their_ll = lm_eval_scores(tmp_path, model_dir, task_path, block_size, batch_size)
    assert len(ours_ll) == len(their_ll) == len(task)
    gap = max(abs(a - b) for a, b in zip(ours_ll, their_ll))
    assert gap < 1e-4, (model_dir, gap, ours_ll, their_ll)
    assert {k: ours[k] for k in theirs} == theirs, (ours, theirs)
    return task


@pytest.mark.parametrize("family", ["llama3", "llama2", "qwen2"])
def test_scores_equal_lm_evaluation_harness_on_each_kind_of_tokenizer(tmp_path, family):
    """A tokenizer that adds a BOS (Llama 3's byte-level), a SentencePiece one that adds <s>
    (Llama 2's), one that adds none (Qwen2's, SmolLM2's): each choice's log-likelihood equals
    lm-evaluation-harness's (HFLM, float32) to 1e-4 on a tiny random model of that tokenizer,
    acc, acc_norm and acc_bytes its numbers; the row starts with what the tokenizer adds, an
    empty context with the prefix token, a long one cut from the left."""
    import hf_families
    from transformers import LlamaConfig, LlamaForCausalLM
    d = tmp_path / family
    n_vocab = hf_families.write_tokenizer(family, str(d))
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**HF, "vocab_size": n_vocab})).save_pretrained(d)
    task_path = write_task(tmp_path / "peer.jsonl", PEER_QUESTIONS)
    task = assert_peer_agrees(tmp_path, str(d), task_path, 32)
    enc = tokenizer_py.get_tokenizer(str(d / "tokenizer.json"))
    adds = {"llama3": "<|begin_of_text|>", "llama2": "<s>", "qwen2": None}[family]
    context = evals.encode(enc, PEER_QUESTIONS[0]["context"])
    want = ([enc.encode_single_token(adds)] if adds else []) + context
    assert all(row[:len(want)] == want for row in task.ids[:3]), (want, task.ids[:3])
    empty = task.ids[3]  # no context: lm-evaluation-harness's prefix token (the EOS for Qwen2)
    assert empty[0] == enc.encode_single_token(adds or "<|endoftext|>")
    assert len(task.ids[-4]) == 33  # cut from the left to block_size + 1


def test_scores_equal_lm_evaluation_harness_on_the_real_model(tmp_path):
    """SmolLM2-135M-Instruct (its tokenizer adds no BOS; its config names <|im_start|> the BOS,
    lm-evaluation-harness's prefix token): evals.py and lm-evaluation-harness score the same
    task alike, per choice to 1e-4 and in acc / acc_norm / acc_bytes. (Four of the questions,
    one batch: its 30 layers are costly on 2 cores.)"""
    from real_model import smollm2_dir
    task_path = write_task(tmp_path / "peer.jsonl", [PEER_QUESTIONS[i] for i in (0, 1, 3, 4)])
    task = assert_peer_agrees(tmp_path, smollm2_dir(), task_path, 40, batch_size=9)
    assert len(task) == 9 and len(task.ids[-1]) == 41
