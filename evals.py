"""
Scores beside the val loss: bits per byte, and multiple-choice tasks as lm-evaluation-harness
scores them.

Bits per byte = the summed cross-entropy over the val targets / (ln 2 x the UTF-8 bytes those
targets decode to). Unlike the loss per token it does not move when the tokenizer does (new
tokens, another model's), so runs on different vocabularies compare. Document and chat markers
(<|endoftext|>, a BOS, role tokens) decode to no text: they count 0 bytes, their loss still counts.

A task is a JSONL file, one question a line: {"context": "...", "choices": ["...", ...],
"answer": i}. Each choice is scored by the log-likelihood of its tokens after the context,
in the row lm-evaluation-harness (HFLM) builds: context + choice encoded whole, the choice's ids
those after the context's (a space that ends the context moved to the choice), after the first
token the tokenizer itself adds (its BOS where it adds one, as Llama's do; none for SmolLM2's
or Qwen's); an empty context is its prefix token alone (the BOS its config names, else the
EOS); the row cut from the left to block_size + 1. Then, as its multiple_choice tasks score,
    acc       = share of questions whose highest log-likelihood is the answer's
    acc_norm  = the same with each log-likelihood divided by its choice's length in characters
    acc_bytes = the same divided by its choice's UTF-8 bytes
(tests/test_evals.py: lm-evaluation-harness's own numbers, per choice and per task). gold_ll is
the mean log-likelihood of the answers, a smooth number to watch.

train.py scores every eval_interval on any layout: the task's rows go through train.py's own
evaluation in global batches (each dp rank its micro-batches, the pipeline, tp, cp as for the val
loss), and a forward hook on the model (on the last stage) keeps each row's summed
cross-entropy; an all-reduce puts the rows together. sample.py eval=True scores one process.
"""

import json
import math
import os
import sys

import numpy as np
import torch

import data
from common import write_atomic
from parallel import all_reduce_sum, pick_device
from formats import corpora
from guards.guard_config import task_files
from guards.guard_errors import UserError, check, excepthook
from guards.guard_files import check_exports, check_place, loads_json

TASK_EXAMPLE = '{"context": "The sky is", "choices": [" blue", " green"], "answer": 0}'


# ---- bits per byte ----------------------------------------------------------------------------


def byte_lengths(enc):
    """(n_vocab,) the UTF-8 bytes each id decodes to; 0 for the markers, which are no text: the
    special tokens, and added tokens written <|name|> (a chat template's role tokens), not the
    domain words added as tokens."""
    n = enc.n_vocab
    # (a model's tokenizer.json: a SentencePiece '▁' is a space, one byte more than the text
    # has before a document's first word)
    lengths = [_token_length(enc, i) for i in range(n)]
    marked = lambda t: t.startswith("<|") and t.endswith("|>")  # noqa: E731
    extra = {t for t in getattr(enc, "extra_tokens", ()) if not marked(t)}
    markers = {getattr(enc, "eot_token", None), getattr(enc, "bos_token", None)}
    for t in set(getattr(enc, "special_tokens_set", ())) - extra:
        try:
            markers.add(enc.encode_single_token(t))
        except KeyError:
            pass
    lengths = np.asarray(lengths, dtype=np.int64)
    lengths[[i for i in markers if i is not None and 0 <= i < n]] = 0
    return lengths


def _token_length(enc, i):
    try:
        return len(enc.decode_single_token_bytes(i))
    except KeyError:  # an id no token has (cl100k_base's gaps below its specials)
        return 0


def target_bytes(y, mask, lengths):
    """(target tokens, the UTF-8 bytes they decode to) of targets y (any shape; mask: those
    that count)."""
    b = torch.from_numpy(lengths)[y].double()
    if mask is None:
        return y.numel(), int(b.sum())
    return int(mask.sum()), int((b * mask).sum())


def bits_per_byte(loss, tokens, n_bytes):
    """The mean loss (nats) over `tokens` targets that decode to n_bytes, in bits per byte."""
    return loss * tokens / (math.log(2) * n_bytes) if n_bytes else float("nan")


# ---- multiple-choice tasks --------------------------------------------------------------------


class Task:
    """One task file: every choice of every question as a row (ids: the tokenizer's first token,
    the context, the choice, cut from the left to block_size + 1; n: how many end it are the
    choice's), row_question (each row's question), chars and bytes (each choice's), answers."""

    def __init__(self, path, enc, block_size):
        self.path, self.name = path, os.path.basename(path).removesuffix(".jsonl")
        bos = getattr(enc, "bos_token", None)  # what the tokenizer puts first, or None
        first, prefix = [] if bos is None else [bos], prefix_token(enc)
        self.pad, self.block_size = enc.eot_token, block_size
        self.ids, self.n, self.answers, self.row_question = [], [], [], []
        self.chars, self.bytes = [], []
        keep = block_size + 1
        for q, (lineno, context, choices, answer) in enumerate(read_task(path)):
            self.answers.append(answer)
            ctx, conts = encode_choices(enc, context, choices)
            for k, (choice, cont) in enumerate(zip(choices, conts)):
                start = first + ctx[-keep:]
                if not start:  # lm-evaluation-harness: the prefix token, unless it starts one
                    split = cont[:1] == [prefix]
                    start, cont = (cont[:1], cont[1:]) if split else ([prefix], cont)
                # (lm-evaluation-harness asserts a continuation: none would score 0, and win)
                check(len(cont) > 0, f"{path}:{lineno}: choice {k} ({choice[:40]!r}) has no "
                             f"tokens of its own: it merges into the context's last token; "
                             f"start the choices with a space (or end the context with one), "
                             f"as lm-evaluation-harness's tasks do")
                # cut from the left, as lm-evaluation-harness does past max_length
                self.ids.append((start + cont)[-keep:])
                self.n.append(len(cont))
                self.row_question.append(q)
                self.chars.append(len(choice))
                self.bytes.append(len(choice.encode()))
        self.row_question = np.asarray(self.row_question)

    def __len__(self):
        return len(self.ids)

    def rows(self, idx, T=None):
        """(x, y, loss_mask) of rows idx, each (len(idx), T): padded past a row's end (and for
        an index past the last row, all padding), the mask 1 on the choice's targets."""
        T = T or self.block_size
        x = torch.full((len(idx), T), self.pad, dtype=torch.int64)
        y, mask = x.clone(), torch.zeros(len(idx), T)
        for k, r in enumerate(idx):
            if r < len(self.ids):
                t = torch.tensor(self.ids[r])
                L = len(t) - 1
                x[k, :L], y[k, :L] = t[:-1], t[1:]
                mask[k, max(0, L - self.n[r]):L] = 1
        return x, y, mask


def read_task(path):
    """[(line number, context, choices, answer)] of a task file, each line checked."""
    if not os.path.isfile(path):
        raise UserError(f"eval_tasks: {path} is not a file: give JSONL files of {TASK_EXAMPLE}, "
                        f"comma-separated")
    out = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            q = loads_json(raw, where, f"each line must be one JSON object such as {TASK_EXAMPLE}")
            out.append((lineno, *check_question(q, where)))
    if not out:
        raise UserError(f"eval_tasks: {path} has no questions: write one a line, {TASK_EXAMPLE}")
    return out


# Where the context cannot be cut (encode_choices), each choice is encoded after the whole
# context: a line may not ask for many more choices than a benchmark has (MMLU and HellaSwag 4,
# ARC up to 5, PIQA 2); 64 is far past them and keeps a 1 MB line to seconds.
MAX_CHOICES = 64


def check_question(q, where, fix=None):
    """(context, choices, answer) of a task line's JSON value q, or a UserError naming `where`:
    reading a task file and evals.py's converters both check each question here. fix: what to
    do about a question of the wrong shape (None: write one as TASK_EXAMPLE)."""
    choices = q.get("choices") if isinstance(q, dict) else None
    ok = isinstance(choices, list) and len(choices) >= 2
    ok = ok and isinstance(q.get("context"), str)
    ok = ok and all(isinstance(c, str) and c for c in choices)
    ok = ok and type(q.get("answer")) is int and 0 <= q["answer"] < len(choices)
    if not ok:
        raise UserError(f"{where}: not a question: " + (fix or f"write {TASK_EXAMPLE} (a string "
                        f"context, two or more non-empty choices, answer the right one's index)"))
    if len(choices) > MAX_CHOICES:
        raise UserError(f"{where}: {len(choices):,} choices, more than {MAX_CHOICES} (a "
                        f"benchmark's questions have 2 to 5): split the question, or drop choices")
    # JSON's escapes can write half of a surrogate pair, which is no character: refused as the
    # same text in UTF-8 is (malformed JSON), not scored as some other text
    for what, text in [("the context", q["context"])] + [
            (f"choice {k}", c) for k, c in enumerate(choices)]:
        try:
            text.encode()
        except UnicodeEncodeError as e:
            raise UserError(f"{where}: {what} ({text[:40]!r}) is not valid Unicode: a lone "
                            f"surrogate {text[e.start]!r} at character {e.start}: write the "
                            f"character itself, or both halves of its surrogate pair") from None
    return q["context"], choices, q["answer"]


def prefix_token(enc):
    """lm-evaluation-harness's prefix_token_id, the row's start for an empty context: the BOS
    token the tokenizer's config names (added to text or not, as SmolLM2-Instruct's
    <|im_start|>), else its EOS (our eot_token)."""
    if getattr(enc, "bos_token", None) is not None:
        return enc.bos_token
    name = (getattr(enc, "config", None) or {}).get("bos_token")
    name = name.get("content") if isinstance(name, dict) else name  # (an AddedToken's fields)
    try:
        return enc.encode_single_token(name) if isinstance(name, str) else enc.eot_token
    except KeyError:
        return enc.eot_token


def encode(enc, text):
    """Text as prepare.py encodes a document (tokenizer.encode): an added token is its id."""
    allowed = set(getattr(enc, "extra_tokens", ()))
    return enc.encode(text, allowed_special=allowed, disallowed_special=())


def encode_pair(enc, context, choice):
    """(context ids, choice ids) as lm-evaluation-harness's _encode_pair: context + choice
    encoded whole, the choice's ids those past as many as the context alone has (a token may
    join the two across the cut: the row is then the context's own ids and the whole's rest)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, choice = context[:-spaces], context[-spaces:] + choice
    whole, ctx = encode(enc, context + choice), encode(enc, context)
    return ctx, whole[len(ctx):]


# The last TAIL tokens of a long context are encoded again with each choice, the rest once
TAIL = 64


def encode_choices(enc, context, choices):
    """(context ids, [each choice's ids]) of encode_pair, with the context encoded once, not
    once per choice. A tokenizer that splits text into pieces first (words, numbers, runs of
    spaces; tiktoken's regex, a tokenizer.json's pre-tokenizer) gives the text before a piece
    boundary the same ids whatever follows it, so the context is cut at a token boundary TAIL
    tokens from its end that is one for both halves: the whole text's ids are then the ids before
    the cut and those of the context's last TAIL tokens' text encoded with the choice. A choice
    that changes the tail's first half anyway is encoded whole, as is a short context."""
    text = context.rstrip()
    spaces = context[len(text):]
    ctx = encode(enc, text)
    cut = _cut(enc, text, ctx)
    out = []
    for choice in choices:
        tail = None if cut is None else encode(enc, text[cut:] + spaces + choice)
        if tail is None or tail[:TAIL // 2] != ctx[-TAIL:][:TAIL // 2]:
            out.append(encode_pair(enc, context, choice)[1])
        else:  # (the whole text: ctx[:-TAIL] + tail)
            out.append(tail[TAIL:])
    return ctx, out


def _cut(enc, text, ctx):
    """The character where text's last TAIL tokens (of ctx, its ids) begin, if encoding the text
    before it and after it gives ctx's ids apart; None otherwise, or for a shorter text."""
    if len(ctx) <= 2 * TAIL:
        return None
    try:
        last = b"".join(enc.decode_single_token_bytes(i) for i in ctx[-TAIL:])
        raw = text.encode()
        cut = len(raw[:-len(last)].decode()) if raw.endswith(last) else None
    except (KeyError, ValueError):  # an id without bytes; a cut inside a character
        return None
    ok = cut is not None and encode(enc, text[cut:]) == ctx[-TAIL:]
    return cut if ok and encode(enc, text[:cut]) == ctx[:-TAIL] else None


def scores(task, logliks):
    """{"acc", "acc_norm", "acc_bytes", "gold_ll"} of a task from each row's log-likelihood."""
    ll = np.asarray(logliks, dtype=np.float64)
    chars, n_bytes = (np.asarray(v, dtype=np.float64) for v in (task.chars, task.bytes))
    acc = acc_norm = acc_bytes = gold = 0.0
    # a question's rows lie together, in order (Task): where each question's begin
    bounds = np.searchsorted(task.row_question, np.arange(len(task.answers) + 1))
    for q, answer in enumerate(task.answers):
        rows = np.arange(bounds[q], bounds[q + 1])
        acc += int(np.argmax(ll[rows])) == answer
        acc_norm += int(np.argmax(ll[rows] / chars[rows])) == answer
        acc_bytes += int(np.argmax(ll[rows] / n_bytes[rows])) == answer
        gold += ll[rows[answer]]
    n = len(task.answers)
    return {"acc": acc / n, "acc_norm": acc_norm / n, "acc_bytes": acc_bytes / n,
            "gold_ll": gold / n}


@torch.no_grad()
def plain_logliks(model, task, batch_size, device, doc_ids=None, autocast=None):
    """Each row's log-likelihood of its choice, by one whole model (sample.py, tests).
    doc_ids: data.doc_ids-like function of x, for a model trained with doc_mask."""
    out = []
    for s in range(0, len(task), batch_size):
        idx = range(s, min(s + batch_size, len(task)))
        # as long as the batch's longest row: padding after a row changes nothing before it
        longest = max(len(task.ids[r]) - 1 for r in idx)
        x, y, m = (t.to(device) for t in task.rows(idx, longest))
        with autocast or torch.autocast(device.type, enabled=False):
            losses, _ = model(x, y, None, None if doc_ids is None else doc_ids(x))
        out.append(-(losses.double() * m).sum(1).cpu())
    return torch.cat(out).tolist()


def score_tasks(model, eval_tasks, enc, block_size, c, what):
    """sample.py eval=True: one line with the scores of each task of eval_tasks ('a,b.jsonl')."""
    tasks = [Task(p, enc, block_size) for p in task_files(eval_tasks)]
    if not tasks:
        return
    device = pick_device(c["device"])
    model.to(device).eval()
    results = []
    for task in tasks:
        doc_ids = (lambda x: data.doc_ids(x, task.pad)) if c["doc_mask"] else None
        s = scores(task, plain_logliks(model, task, c["batch_size"], device, doc_ids))
        results.append(f"{task.name} acc {s['acc']:.4f} acc_norm {s['acc_norm']:.4f} "
                       f"acc_bytes {s['acc_bytes']:.4f} "
                       f"({len(task.answers):,} questions)")
    print(f"tasks of {what}: " + ", ".join(results) + f"; block_size={block_size}", flush=True)


def split_bytes(data_dir, block_size, enc, split="val"):
    """(target tokens, their UTF-8 bytes) of a split read whole in rows of block_size, as
    sample.py's val loss reads it: every chunk's targets once. enc: the data's tokenizer."""
    loader, lengths = data.Loader(data_dir, split, block_size, 1, 1, seed=0), byte_lengths(enc)
    tokens = n_bytes = 0
    for start in range(0, loader.n_chunks, 256):  # (its rows: whole documents for chat data)
        _, y, mask = loader.rows(np.arange(start, min(start + 256, loader.n_chunks)))
        t, b = target_bytes(y, mask, lengths)
        tokens, n_bytes = tokens + t, n_bytes + b
    return tokens, n_bytes


# ---- task files from the public benchmarks ----------------------------------------------------
# One record of each benchmark as its Hugging Face dataset holds it -> ours, with the prompt
# lm-evaluation-harness's task config writes for it: its doc_to_text, then target_delimiter (a
# space, which scoring moves to the choice, as lm-evaluation-harness joins them), the choices
# its doc_to_choice, so acc_norm counts their characters as it does.


def _hellaswag_text(text):
    """lm-evaluation-harness's preprocess: WikiHow's [title] and [step] marks out."""
    text = text.strip().replace(" [title]", ". ")
    return "\n".join(map(_unbracketed, text.split("\n"))).replace("  ", " ")


def _unbracketed(line):
    r"""re.sub(r"\[.*?\]", "", line) of a line with no newline (`.` matches none: a mark never
    spans lines), in one pass: the regex retries every '[' of '[' * 200000, in quadratic time."""
    out, i = [], 0
    while (start := line.find("[", i)) >= 0 and (end := line.find("]", start)) >= 0:
        out.append(line[i:start])
        i = end + 1
    return "".join(out) + line[i:]


def _label(v):
    """A record's label: an int, or its digits (HellaSwag's "0"); 1.0 or true is none."""
    if type(v) is str and v.isascii() and v.lstrip("-").isdigit():
        return int(v)
    if type(v) is not int:
        raise TypeError(f"label {str(v)[:40]!r} is not an integer")
    return v


def _texts(v):
    """A record's list of strings (a string or a dict of them would be read a character or a
    key at a time)."""
    if not isinstance(v, list) or not all(isinstance(t, str) for t in v):
        raise TypeError(f"{str(v)[:40]!r} is not a list of strings")
    return v


def from_hellaswag(r):  # Rowan/hellaswag (validation: the split lm-evaluation-harness scores)
    context = r["activity_label"] + ": " + r["ctx_a"] + " " + r["ctx_b"].capitalize()
    return {"context": _hellaswag_text(context) + " ", "answer": _label(r["label"]),
            "choices": [_hellaswag_text(e) for e in _texts(r["endings"])]}


def from_arc(r):  # allenai/ai2_arc, ARC-Easy or ARC-Challenge (test)
    choices = r["choices"]  # {"text": [...], "label": ["A", "B", ...]}
    texts, labels = _texts(choices["text"]), _texts(choices["label"])
    if len(texts) != len(labels):
        raise ValueError(f"{len(texts)} choices but {len(labels)} labels")
    return {"context": f"Question: {_texts([r['question']])[0]}\nAnswer: ", "choices": texts,
            "answer": labels.index(r["answerKey"])}


def from_piqa(r):  # ybisk/piqa (validation)
    return {"context": f"Question: {_texts([r['goal']])[0]}\nAnswer: ",
            "answer": _label(r["label"]), "choices": _texts([r["sol1"], r["sol2"]])}


CONVERTERS = {"hellaswag": from_hellaswag, "arc": from_arc, "piqa": from_piqa}
# what each reads of a Parquet file (another column, bad or not, is never read)
COLUMNS = {"hellaswag": ("activity_label", "ctx_a", "ctx_b", "endings", "label"),
           "arc": ("question", "choices", "answerKey"), "piqa": ("goal", "sol1", "sol2", "label")}


def convert(argv):
    """python evals.py hellaswag|arc|piqa IN OUT: the benchmark's records (.jsonl, .jsonl.gz or
    .parquet, as downloaded from the Hugging Face hub) -> a task file for eval_tasks=."""
    if len(argv) != 3 or argv[0] not in CONVERTERS:
        raise UserError(f"usage: python evals.py {'|'.join(CONVERTERS)} IN OUT (IN: the "
                        f"benchmark's .jsonl or .parquet file, OUT: the task file to write)")
    kind, source, out = argv
    if not os.path.isfile(source):
        raise UserError(f"{source} is not a file: give the {kind} file you downloaded (.jsonl or "
                        f".parquet)")
    corpora.check_readers([source])
    check_exports({"OUT": out}, files=("OUT",))
    # (a task file is written whole over what is there: never the benchmark, a dataset or a model)
    check(not os.path.exists(out) or not os.path.samefile(source, out),
          f"OUT={out} is IN: name a new file for the task, e.g. {kind}.jsonl")
    check_place("OUT", os.path.dirname(os.path.abspath(out)), "a folder of task files")
    lines = []
    decode = lambda raw: (raw.decode("utf-8", "replace"), 0)  # noqa: E731
    for row, record, _ in corpora.records(source, COLUMNS[kind], decode):
        try:
            q = CONVERTERS[kind](record)
        except (KeyError, ValueError, TypeError, AttributeError) as e:
            raise UserError(f"{source}:{row}: not a {kind} record ({type(e).__name__}: {e}): "
                            f"give the benchmark's own file, or write {TASK_EXAMPLE}") from None
        # what eval_tasks= will read: an unlabeled split converted was refused only there
        check_question(q, f"{source}:{row}", f"its answer is {q['answer']} of "
                       f"{len(q['choices'])} choices (a question needs two or more, and the "
                       f"right one's index; a test split has no labels, -1): convert the "
                       f"validation split")
        lines.append(json.dumps(q) + "\n")
    try:
        write_atomic(out, lambda f: f.write("".join(lines).encode()))
    except OSError as e:
        raise UserError(f"cannot write {out} ({e.strerror or e}): free disk space, or pick "
                        f"another OUT") from None
    print(f"{out}: {len(lines):,} {kind} questions", flush=True)


# ---- in a training run, on any layout ---------------------------------------------------------


class _Window:
    """Global batches [start, start + n) of a task's rows, as a val Loader hands them out (this
    dp rank's micro-batches), past the last row padded with rows that count nothing. n is
    eval_iters, the batches train.py's evaluate() reads: a task's last window computes up to
    eval_iters - 1 global batches of padding."""

    def __init__(self, task, start, n, like):
        self.task, self.start, self.n, self.like = task, start, n, like

    def rows_of(self, i):
        """The global row indices of this rank's micro-batches of batch i."""
        L = self.like
        first = (self.start + i) * L.global_batch + L.first_micro * L.batch_size
        return torch.arange(first, first + L.micro_steps * L.batch_size)

    def batch(self, i):
        L = self.like
        x, y, m = self.task.rows(self.rows_of(i).tolist())
        shape = (L.micro_steps, L.batch_size, -1)
        return x.view(shape), y.view(shape), m.view(shape)

    @property
    def eot_token(self):  # the id that ends a document: the val loader's
        return self.like.eot_token


class Evaluator:
    """What train.py logs beside each val loss: val_bpb (and val_bpb/<source> for a mixture),
    and task/<name>/{acc, acc_norm, acc_bytes, gold_ll} for each file of eval_tasks."""

    def __init__(self, eval_tasks, val_loaders, lengths, enc_of, model, mesh, eval_iters):
        """lengths: the bytes of each id (the dataset's token_bytes), or None: from the tokenizer
        enc_of() gives (the data's; a mixture's widest: the other sources' ids mean the same),
        which the tasks encode their text with."""
        self.mesh, self.eval_iters, self.like = mesh, eval_iters, next(iter(val_loaders.values()))
        if lengths is None:
            lengths = byte_lengths(enc_of())
        # source -> (target tokens, their bytes) of the eval_iters global batches evaluate() reads
        self.counts = {}
        for name, loader in val_loaders.items():
            tokens = n_bytes = 0
            for i in range(eval_iters):
                G = loader.global_batch
                _, y, mask = loader.rows(np.arange(i * G, (i + 1) * G))
                t, b = target_bytes(y, mask, lengths)
                tokens, n_bytes = tokens + t, n_bytes + b
            self.counts[name] = (tokens, n_bytes)
        paths = task_files(eval_tasks) if eval_tasks else []
        enc = enc_of() if paths else None
        self.tasks = [Task(p, enc, self.like.block_size) for p in paths]
        self.rows = None  # while a task is scored: each forward's per-row cross-entropy sums
        if self.tasks:
            model.register_forward_hook(self.record)

    def record(self, module, args, output):
        losses, loss = output  # with targets: each target's loss (B, T), and their mean
        if self.rows is None or loss is None:
            return
        self.rows.append((losses.detach().double() * args[2].double()).sum(1))

    def logliks(self, task, evaluate):
        """Each row's log-likelihood, the same on every rank and every layout."""
        L = self.like
        n_batches = -(-len(task) // L.global_batch)
        size = (n_batches + self.eval_iters) * L.global_batch  # (the last window's padding too)
        sums = torch.zeros(size, dtype=torch.float64, device=self.mesh.device)
        for start in range(0, n_batches, self.eval_iters):
            window, self.rows = _Window(task, start, self.eval_iters, L), []
            try:
                evaluate(window)
                mine = torch.cat([window.rows_of(i) for i in range(self.eval_iters)])
                if self.rows:  # a stage with the head (all stages but a pipeline's first ones)
                    sums[mine.to(sums.device)] += torch.cat(self.rows)
            finally:
                self.rows = None
        # a tp or cp group's ranks hold the same rows (the loss is gathered); other stages none
        total = all_reduce_sum(sums, self.mesh) / (self.mesh.tp * self.mesh.cp)
        return (-total[:len(task)]).tolist()

    def run(self, val, evaluate, weights=None):
        """(record, text for the log line) from val ({source: val loss}) and train.py's
        evaluate(); weights: a mixture's, as its val loss weighs the sources."""
        bpb = {name: bits_per_byte(loss, *self.counts[name]) for name, loss in val.items()}
        weights = weights or {name: 1.0 for name in bpb}
        record = {"val_bpb": sum(weights[name] * v for name, v in bpb.items())}
        if len(bpb) > 1:
            record.update({f"val_bpb/{name}": v for name, v in bpb.items()})
        line = f", {record['val_bpb']:.4f} bits/byte"
        for task in self.tasks:
            s = scores(task, self.logliks(task, evaluate))
            record.update({f"task/{task.name}/{k}": v for k, v in s.items()})
            line += f"; {task.name} acc {s['acc']:.3f} acc_norm {s['acc_norm']:.3f}"
        return record, line


if __name__ == "__main__":
    sys.excepthook = excepthook
    convert(sys.argv[1:])
