"""
Dataset preparation: a corpus -> data/NAME/{train.bin, val.bin, meta.json}.

    python prepare.py stdlib                       # the embedded default corpus -> data/stdlib
    python prepare.py 'notes/*.txt' --name notes   # a directory or glob of .txt files
    python prepare.py docs.jsonl --name docs --text_field text
    python prepare.py 'fineweb/*.parquet' --name fineweb  # Parquet, .jsonl.gz/.zst: corpora.py
    python prepare.py sft.jsonl --name sft --extra_tokens tokens.txt   # chat records: SFT data

(`python prepare.py ...` is the same command.) Every document's tokens followed by
<|endoftext|>, packed end to end, stored as uint16 when the vocabulary fits and uint32
otherwise. A chat dataset (JSONL conversations) also writes {train,val}.mask.bin: one byte
per token, 1 where the loss counts (the assistant's words). A dataset is built in a
directory beside its target and swapped in when complete (meta.json last), so a dataset
directory with a meta.json is complete, and a failed re-prepare leaves the old one as it
was. Nothing here reads train.py's config: everything is an argument.
"""

import argparse
import json
import os
import re
import shutil
import time
import zlib

import common
from guards import guard_errors

# Ctrl-C and SIGTERM as the run's own from here (guard_errors.start_command)
if __name__ == "__main__":
    guard_errors.start_command()
import numpy as np

import evals
from formats import chat_template
from formats import corpora
from formats import preference
from guards import guard_chat
from guards import guard_files
from guards.guard_errors import UserError
from techniques import packing
from tokenizer import (
    CHAT_TOKENS,
    ROLES,
    encode_batch,
    encode_chat_contents,
    encode_documents,
    get_tokenizer,
    load_extra_tokens,
    render_chat,
    split_known,
)

# ---------------------------------------------------------------------------------------
# sources: each yields (doc_id, text, n_replaced) for every document


def _decode(raw):
    """UTF-8 text and the number of undecodable bytes replaced by U+FFFD."""
    try:
        return raw.decode("utf-8"), 0
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
        return text, text.count("\ufffd") - raw.decode("utf-8", errors="ignore").count("\ufffd")


def _is_chat(record):
    return (isinstance(record, dict)
            and ("messages" in record or "prompt" in record or "response" in record))


def detect_format(kind, files, text_field="text", format="auto"):
    """'chat' or 'text': `format`, or with 'auto' what the first non-blank JSONL record is."""
    if format not in ("auto", "text", "chat", "preference"):
        raise UserError(f"format='{format}' is unknown: use auto, text, chat or preference")
    if kind == "text":
        if format == "chat":
            raise UserError("format=chat needs .jsonl or .parquet files of {\"messages\": [...]} "
                            "or {\"prompt\", \"response\"} records: convert the data or use "
                            "format=text")
        return "text"
    if format != "auto":
        return format
    for path in files:
        for _, record, _ in corpora.records(path, text_field, _decode):
            if preference.is_pair(record):  # TRL's preference formats: formats/preference.py
                return "preference"
            return "chat" if _is_chat(record) and text_field not in record else "text"
    return "text"


CHAT_EXAMPLE = ('{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", '
                '"content": "..."}]}')


def chat_messages(record, where, roles=ROLES):
    """The checked message list of one chat record ({"messages": [...]} or {"prompt",
    "response"})."""
    if not _is_chat(record):
        raise UserError(f"{where}: not a chat record (the source's first record is one): write "
                        f"every line as {CHAT_EXAMPLE} or {{\"prompt\": \"...\", \"response\": "
                        f"\"...\"}}, or prepare text separately")
    if "messages" not in record:
        if (not isinstance(record.get("prompt"), str)
            or not isinstance(record.get("response"), str)):
            raise UserError(f"{where}: 'prompt' and 'response' must both be strings: write "
                            f"{{\"prompt\": \"...\", \"response\": \"...\"}}")
        return [{"role": "user", "content": record["prompt"]},
                {"role": "assistant", "content": record["response"]}]
    messages = record["messages"]
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise UserError(f"{where}: 'messages' is not a list of {{\"role\", \"content\"}} objects: "
                        f"write {CHAT_EXAMPLE}")
    if not messages:
        raise UserError(f"{where}: empty conversation: give at least a user and an assistant "
                        f"message, or drop the line")
    for i, m in enumerate(messages, 1):
        if m.get("role") not in roles:
            tool = ("" if "tool" in roles else " (tool: only a model whose own chat template "
                                               "renders it)")
            raise UserError(f"{where}: message {i} has role {m.get('role')!r}: "
                            f"use {', '.join(roles[:-1])} or {roles[-1]}{tool}")
        # our template writes a message's content only: the call would be dropped unsaid
        if m.get("tool_calls") and "tool" not in roles:
            raise UserError(f"{where}: message {i} has tool_calls (only a model whose own chat "
                            f"template renders them): write the call into its content, or "
                            f"start from such a model")
        if not isinstance(m.get("content"), str):
            raise UserError(f"{where}: message {i}'s content "
                            f"is {type(m.get('content')).__name__}, not a string: "
                            f"write the text as \"content\": \"...\"")
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where}: no assistant message, so nothing to learn (the loss only "
                        f"counts assistant replies): add one or drop the line")
    return messages


def iter_documents(kind, root, files, text_field="text", format="text", roles=ROLES):
    """(doc_id, text, n_replaced) for each document; with format='chat', (doc_id, messages,
    n_replaced) for each conversation instead, their roles among `roles`."""
    for path in files:
        rel = os.path.relpath(path, root)
        if kind == "text":
            with open(path, "rb") as f:
                text, bad = _decode(f.read())
            yield rel, text, bad
            continue
        for lineno, record, bad in corpora.records(path, text_field, _decode):
            if format == "preference":
                yield f"{rel}:{lineno}", preference.split_pair(record, f"{path}:{lineno}"), bad
                continue
            if format == "chat":
                yield f"{rel}:{lineno}", chat_messages(record, f"{path}:{lineno}", roles), bad
                continue
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                if _is_chat(record):
                    raise UserError(f"{path}:{lineno}: a chat record in a text source (its first "
                                    f"record is text): prepare chat and text files separately")
                raise UserError(f"{path}:{lineno}: no string field '{text_field}': each line "
                                f"needs one (or pass --text_field NAME)")
            yield f"{rel}:{lineno}", record[text_field], bad


def val_score(doc_id):
    """A document's split is a function of its id (path, or path:line) alone, so adding files
    to a corpus never moves an existing document between train and val: it goes to val when
    this score is below val_fraction * 10,000."""
    return zlib.crc32(doc_id.encode()) % 10_000


def is_val(doc_id, val_fraction):
    return val_score(doc_id) < val_fraction * 10_000


def move_to_val(work, chat, dtype, doc):
    """A corpus too small for val_fraction to pick any document: the train document `doc` (its
    tokens at doc["start"], doc["n"] of them, in train.bin) moves to the empty val split."""
    for suffix, dt in ((".bin", dtype), (".mask.bin", np.uint8))[:1 + chat]:
        path = os.path.join(work, f"train{suffix}")
        train = np.memmap(path, dtype=dt, mode="r")
        train[doc["start"]:doc["start"] + doc["n"]].tofile(os.path.join(work, f"val{suffix}"))
        with open(path + ".cut", "wb") as f:
            train[:doc["start"]].tofile(f)
            train[doc["start"] + doc["n"]:].tofile(f)
        del train
        os.replace(path + ".cut", path)


# ---------------------------------------------------------------------------------------
# prepare


def remove_half_prepared(final):
    """Removes NAME.tmpPID / NAME.oldPID beside dataset `final` whose process is gone: a
    preparation that was killed half-way (like the .tmp_iter_* directories of
    guard_files.clean_stale); an
    .oldPID without NAME (killed inside the swap) is the dataset, put back."""
    parent, base = os.path.split(final)
    for n in os.listdir(parent or ".") if os.path.isdir(parent or ".") else []:
        m = re.fullmatch(re.escape(base) + r"\.(tmp|old)(\d+)", n)
        if m and not _alive(int(m[2])) and m[1] == "old" and not os.path.exists(final):
            # killed between the swap's two renames: the old one back
            os.replace(os.path.join(parent, n), final)
        elif m and not _alive(int(m[2])):
            shutil.rmtree(os.path.join(parent, n), ignore_errors=True)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


def prepare(source, out_dir, tokenizer="cl100k_base", vocab_size=0, val_fraction=0.01,
            text_field="text", workers=0, batch_mb=4, verbose=True, extra_tokens=(), format="auto",
            model_tokens=(), block_size=0):
    """Tokenize `source` into out_dir/{train.bin, val.bin, meta.json}; returns the meta dict.

    A JSONL source of conversations (format='chat', or 'auto' when its first record is one)
    also writes {train,val}.mask.bin. It is rendered in the model's own chat template when the
    tokenizer has one (chat_template.py: no token added, each conversation ended by a token the
    template never writes), else with render_chat, the tokenizer then getting CHAT_TOKENS before
    `extra_tokens` (a list, or the path of a file of them).
    `model_tokens` are the tokens a model (that the data is prepared for) has already added to
    the same base: they keep their ids, and only the tokens it lacks come after them.
    block_size: chat data's line also says how its conversations pack into rows of that length
    (packing.py, the loader's default for chat data).

    Streams: documents are read and encoded a batch (~batch_mb of text) at a time, and only
    that batch's tokens exist as Python ints. The encoding runs on `workers` threads through
    tiktoken's batch API: its Rust core releases the GIL, so threads use every core without
    pickling text to worker processes."""
    if isinstance(extra_tokens, str):
        extra_tokens = load_extra_tokens(extra_tokens)
    kind, root, files, skipped = corpora.resolve_source(source)
    if skipped and verbose:
        print(f"prepare: {skipped} files of {source} are links to others of it: each text is "
              f"prepared once", flush=True)
    fmt = detect_format(kind, files, text_field, format)
    chat, pairs = fmt in ("chat", "preference"), fmt == "preference"
    # pairs of messages are rendered as chats are; plain-text pairs as TRL does: no template
    templated = chat and not (pairs and preference.text_pairs(files, text_field, _decode))
    base = get_tokenizer(tokenizer, vocab_size)
    # the model's own chat format, unless an earlier stage taught it ours (its tokens are the
    # model's)
    own = (templated and getattr(base, "chat_template", None) is not None
           and not set(CHAT_TOKENS) & set(model_tokens))
    first = (list(model_tokens)
             + [t for t in (CHAT_TOKENS if templated and not own else [])
                if t not in model_tokens])
    asked = [t for t in extra_tokens
             if t not in first and t not in getattr(base, "extra_tokens", ())]
    new, known = split_known(base, asked)
    if known and verbose:
        print(f"prepare: {len(known)} of the {len(asked)} extra tokens are already tokens "
              f"of {tokenizer} and are not "
              f"added again: {', '.join(map(repr, known[:8]))}{' ...' if len(known) > 8 else ''}",
              flush=True)
    extra_tokens = first + new
    enc = get_tokenizer(tokenizer, vocab_size, extra_tokens)
    # a model's tokenizer may start documents
    bos = [enc.bos_token] if getattr(enc, "bos_token", None) is not None else []
    eot = enc.eot_token
    if own:  # the template writes the BOS it wants
        bos, eot = [], chat_template.separator(enc, enc.chat_template)
    vocab = enc.n_vocab
    dtype = np.uint16 if vocab <= 2 ** 16 else np.uint32
    if type(workers) is not int or workers < 0:
        raise UserError(f"workers={workers} must be a whole number >= 0 (0: one thread per core)")
    workers = workers or os.cpu_count() or 1
    # (the note packs real rows of it: 2**24 tokens is past any model's context)
    if type(block_size) is not int or not 0 <= block_size <= 1 << 24:
        raise UserError(f"block_size={block_size} must be a whole number from 0 (no packing note) "
                        f"to 16777216 (e.g. 2048, the length the run will train at)")
    # built in a directory beside the target and swapped in when complete: a failure half-way
    # leaves an existing dataset as it was
    final = os.path.normpath(out_dir)
    work = f"{final}.tmp{os.getpid()}"
    remove_half_prepared(final)
    shutil.rmtree(work, ignore_errors=True)
    try:
        os.makedirs(work)
    except OSError as e:
        raise UserError(f"cannot create {work} beside the dataset {final} ({e.strerror or e}): "
                        f"pick another output directory (--out, or dataset=)") from None
    names = [f"{split}{suffix}" for suffix in (".bin", ".mask.bin")[:1 + chat]
             for split in ("train", "val")]
    out = {name: open(os.path.join(work, name), "wb") for name in names}
    tokens = {"train": 0, "val": 0}
    learned = {"train": 0, "val": 0}  # tokens with mask 1
    docs = {"train": 0, "val": 0}
    # source file -> its documents in each split (meta.json lists the files)
    per_file = {"train": {}, "val": {}}
    # the train document nearest to val: it moves there if val gets none
    nearest = {"score": 10_000}
    n_chars = n_replaced = files_with_replaced = 0
    t0 = last_print = time.time()

    def write(doc_id, ids, mask=None):
        split = "val" if is_val(doc_id, val_fraction) else "train"
        name = doc_id if kind == "text" else doc_id.rpartition(":")[0]
        per_file[split][name] = per_file[split].get(name, 0) + 1
        if split == "train" and val_score(doc_id) < nearest["score"]:
            nearest.update(score=val_score(doc_id), doc=doc_id, file=name, start=tokens["train"],
                           n=len(bos) + len(ids) + 1, learned=sum(mask) if mask else 0)
        if own and eot in ids:  # (only the template can write it: in a message it is text)
            raise UserError(f"{doc_id}: the chat template wrote {enc.decode([eot])!r}, the token "
                            f"that ends conversations in packed data: remove it from the template")
        for part in (bos, ids, [eot]):  # (ids: a list, or encode_long's array, not copied)
            np.asarray(part, dtype=dtype).tofile(out[f"{split}.bin"])
        if mask is not None:
            np.asarray([0] * len(bos) + mask + [0],
                       dtype=np.uint8).tofile(out[f"{split}.mask.bin"])
            learned[split] += sum(mask)
        tokens[split] += len(bos) + len(ids) + 1
        docs[split] += 1

    # preference pairs: formats/preference.py (each pair two sequences in one split, indexed)
    index, dropped = {"train": [], "val": []}, {"same": 0, "empty": 0, "prompt": 0, "cut": 0}

    def write_pair(doc_id, pair):
        kind, prompt, *completions = pair
        if (kind == "text") == templated:
            raise UserError(f"{doc_id}: the source mixes plain-text and conversational pairs: "
                            f"prepare them separately")
        seqs = []
        for completion in completions:
            if kind == "text":  # as TRL: prompt + completion + EOS, the prompt the shared prefix
                ids, mask = encode_batch(enc, [prompt + completion])[0], None
                ids += [enc.eot_token]
            else:
                messages = chat_messages({"messages": prompt + completion}, doc_id, roles)
                ids, mask = (chat_template.encode(enc, messages, doc_id) if own else render_chat(
                    enc, messages, encode_chat_contents(enc, [messages], num_threads=1)[0]))
                replies = sum(m["role"] == "assistant" for m in prompt)
                mask = preference.completion_mask(mask, replies)
            seqs.append([ids, mask])
        if kind == "text":
            p_ids = encode_batch(enc, [prompt])[0]
            n = min(len(os.path.commonprefix([p_ids, ids])) for ids, _ in seqs)
            for s in seqs:
                s[1] = [0] * n + [1] * (len(s[0]) - n)
        n_prompt = min(m.index(1) if 1 in m else len(m) for _, m in seqs) + len(bos)
        why = ("same" if seqs[0] == seqs[1] else "empty" if not all(1 in m for _, m in seqs)
               else "prompt" if block_size and n_prompt >= block_size + 1 else None)
        if why:
            dropped[why] += 1
            return
        longest = max(len(bos) + len(ids) for ids, _ in seqs)
        dropped["cut"] += bool(block_size) and longest > block_size + 1
        split, row = "val" if is_val(doc_id, val_fraction) else "train", []
        for ids, mask in seqs:
            row += [tokens[split], len(bos) + len(ids)]
            write(doc_id, ids, mask)
        index[split].append(row)

    def flush(batch):
        if pairs:
            for doc_id, pair in batch:
                write_pair(doc_id, pair)
        elif own:
            for doc_id, messages in batch:
                write(doc_id, *chat_template.encode(enc, messages, doc_id))
        elif chat:
            contents = encode_chat_contents(enc, [messages for _, messages in batch],
                                            num_threads=workers)
            for (doc_id, messages), content in zip(batch, contents):
                write(doc_id, *render_chat(enc, messages, content))
        else:
            for (doc_id, _), ids in zip(batch,
                                        encode_documents(enc, [t for _, t in batch],
                                                         num_threads=workers)):
                write(doc_id, ids)

    def discard():
        for f in out.values():
            f.close()
        shutil.rmtree(work, ignore_errors=True)

    try:
        batch, batch_bytes = [], 0
        # a tool's results (function calling) have no token of ours; a model's template has
        roles = ROLES + ("tool",) if own else ROLES
        for doc_id, doc, bad in iter_documents(kind, root, files, text_field, fmt, roles):
            if not doc:
                continue  # an empty document would be a lone <|endoftext|>
            size = (sum(len(str(part)) for part in doc[1:]) if pairs
                    else sum(len(m["content"]) for m in doc) if chat else len(doc))
            n_replaced += bad
            files_with_replaced += bad > 0
            batch.append((doc_id, doc))
            batch_bytes += size
            n_chars += size
            if batch_bytes >= batch_mb * 2 ** 20:
                flush(batch)
                batch, batch_bytes = [], 0
                if verbose and time.time() - last_print > 2:
                    last_print = time.time()
                    n = tokens["train"] + tokens["val"]
                    print(f"prepare: {docs['train'] + docs['val']} docs, {n_chars / 1e6:.1f}M "
                          f"chars, "
                          f"{n / 1e6:.2f}M tokens, {n / (last_print - t0) / 1e3:.0f}k tokens/s",
                          flush=True)
        flush(batch)
        guard_chat.check_learned(chat, learned, source)
    except BaseException:
        discard()  # a bad record halfway: leave no partial files behind
        raise
    for f in out.values():
        f.close()
    if tokens["train"] == 0:
        discard()
        raise UserError(f"data source '{source}' has no "
                        f"documents{' for train' if docs['val'] else ''}: "
                        f"add non-empty files or lower val_fraction")
    # a small corpus: val gets one document all the same
    if tokens["val"] == 0 and docs["train"] >= 2 and not pairs:
        move_to_val(work, chat, dtype, nearest)
        for split, sign in (("train", -1), ("val", 1)):
            tokens[split] += sign * nearest["n"]
            learned[split] += sign * nearest["learned"]
            docs[split] += sign
            per_file[split][nearest["file"]] = per_file[split].get(nearest["file"], 0) + sign
        print(f"prepare: note: val_fraction={val_fraction} put none of the {docs['train'] + 1} "
              f"documents in val, "
              f"so {nearest['doc']} went there (a function of its name, like every split)",
              flush=True)
    if tokens["val"] == 0:
        discard()
        raise UserError(f"data source '{source}' has one document, and val needs one of its own "
                        f"beside train's: add a document (or split the file in two)" if not pairs
                        else f"data source '{source}' puts no pair in val: raise val_fraction "
                        f"(now {val_fraction}) or add pairs")
    meta = {"tokenizer": tokenizer, "vocab_size": vocab, "base_vocab_size": base.n_vocab,
            "extra_tokens": list(extra_tokens), "eot_token": eot, "format": fmt,
            "chat_tokens": [t for t in extra_tokens if t in CHAT_TOKENS],
            "dtype": np.dtype(dtype).name, "source": source, "val_fraction": val_fraction,
            "train_tokens": tokens["train"], "val_tokens": tokens["val"],
            "train_docs": docs["train"], "val_docs": docs["val"],
            **{f"{split}_files": sorted(f for f, n in per_file[split].items() if n)
               for split in ("train", "val")},
            "text_chars": n_chars, "replaced_bytes": n_replaced}
    # a model's tokenizer file (hf_tokenizer.py): checked when read again
    if "eot_token" in vars(base):
        from formats import hf_tokenizer
        meta.update(tokenizer_sha256=hf_tokenizer.sha256(tokenizer))
    if chat:
        meta.update(train_loss_tokens=learned["train"], val_loss_tokens=learned["val"])
    if pairs:  # each split's (start, length) of chosen and rejected: formats/preference.py
        for split in index:
            np.save(os.path.join(work, f"{split}.pairs.npy"), np.asarray(index[split], np.int64))
        meta.update(train_pairs=len(index["train"]), val_pairs=len(index["val"]),
                    pairs_dropped=dropped)
    # the bytes each id decodes to: bits per byte beside a val loss (evals.py) without a tokenizer
    np.save(os.path.join(work, "token_bytes.npy"), evals.byte_lengths(enc).astype(np.int32))
    with open(os.path.join(work, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    # a Ctrl-C or SIGTERM now waits: the old dataset or the new one, whole
    with common.uninterrupted():
        # the old dataset: its files other than ours move along, the rest goes
        if os.path.isdir(final):
            for name in os.listdir(final):
                if (name not in names
                    + ["meta.json", "train.mask.bin", "val.mask.bin", "token_bytes.npy",
                       "train.pairs.npy", "val.pairs.npy"]):
                    os.replace(os.path.join(final, name), os.path.join(work, name))
            old = f"{final}.old{os.getpid()}"
            os.replace(final, old)
            os.replace(work, final)
            shutil.rmtree(old)
        else:
            os.replace(work, final)
    if verbose:
        dt = time.time() - t0
        n = tokens["train"] + tokens["val"]
        print(f"prepare: {final}: {docs['train']}/{docs['val']} train/val "
              f"{'sequences' if pairs else 'conversations' if chat else 'docs'}, "
              f"{tokens['train']:,}/{tokens['val']:,} "
              f"tokens ({meta['dtype']}), {n_chars / 1e6:.1f}M chars in {dt:.1f}s "
              f"({n / dt / 1e3:.0f}k tokens/s, {workers} threads)", flush=True)
        if pairs:
            print(f"prepare: {len(index['train'])}/{len(index['val'])} train/val preference "
                  f"pairs; left out: {dropped['same']} with chosen = rejected, "
                  f"{dropped['empty']} with an empty completion, {dropped['prompt']} whose "
                  f"prompt fills a row of block_size + 1 = {block_size + 1} (as TRL drops "
                  f"them); {dropped['cut']} cut to the row (TRL's keep_start)", flush=True)
        elif chat:
            print(f"prepare: chat in {'the model' if own else 'the project'}'s chat template: "
                  f"{learned['train']:,}/{learned['val']:,} train/val tokens are assistant "
                  "replies (the loss counts only those)", flush=True)
            if block_size:
                print(f"prepare: packed at block_size={block_size}: "
                      + packing_note(final, block_size, meta), flush=True)
        if n_replaced:
            print(f"prepare: warning: {n_replaced} undecodable bytes in {files_with_replaced} "
                  f"{'documents' if kind == 'text' else 'lines'} were replaced by U+FFFD",
                  flush=True)
    return meta


def packing_note(data_dir, block_size, meta):
    """How a chat dataset's train split packs into rows of block_size + 1 tokens (packing.py)."""
    tokens = np.memmap(os.path.join(data_dir, "train.bin"), dtype=meta["dtype"], mode="r")
    mask = np.memmap(os.path.join(data_dir, "train.mask.bin"), dtype=np.uint8, mode="r")
    return packing.Packed(tokens, mask, meta["eot_token"], block_size + 1).note("train")


def prepare_missing(source, data_dir, prep, tokenizer, vocab_size, val_fraction, extra_tokens,
                    mesh, spec=None, block_size=0):
    """A training run's dataset `source` is not prepared yet: rank 0 prepares it into data_dir
    from `prep` ('stdlib' for the default corpus), the others wait. With `spec`
    (tokenizer.model_spec: the run starts from a model) it is tokenized with that model's
    tokenizer, new tokens after its last id."""
    prep = prep or ("stdlib" if source == "stdlib" else "")
    if not prep:
        raise UserError(f"dataset '{source}' is not prepared ({data_dir}/meta.json missing): set "
                        "data_source= to a directory, glob, .jsonl or .parquet file to prepare "
                        f"it from (or run `python prepare.py SOURCE --out {data_dir}`)")
    if mesh.master:
        mesh.print0(f"preparing {data_dir} from {prep} (once)")
        if spec:
            tokenizer, vocab_size = spec["tokenizer"], spec["base_vocab_size"]
        prepare(prep, data_dir, tokenizer, vocab_size, val_fraction,
                extra_tokens=extra_tokens or (),
                model_tokens=spec["extra_tokens"] if spec else (), block_size=block_size)
    if mesh.backend:
        import torch.distributed
        torch.distributed.barrier()


# ---------------------------------------------------------------------------------------

class _Arguments(argparse.ArgumentParser):
    # one line, as train.py and sample.py say it (not a usage block and exit 2)
    def error(self, message):
        raise UserError(f"{message}: `python prepare.py --help` lists the arguments")

    def exit(self, status=0, message=None):  # after --help: output that never arrived is a failure
        super().exit(1 if status == 0 and guard_errors.flush_stdout() else status, message)


def main():
    ap = _Arguments(description="Tokenize a corpus into data/NAME/{train,val}.bin + meta.json",
                    # --help: the defaults too
                    formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("source", help="'stdlib', a directory of .txt files, a glob, or .jsonl, "
                    ".jsonl.gz, .jsonl.zst or .parquet files (of text, or of chat conversations "
                    "for SFT)")
    ap.add_argument("--name", help="dataset name (None: stdlib, or the source's base name)")
    ap.add_argument("--out", help="output directory (None: data/NAME)")
    ap.add_argument("--tokenizer", default="cl100k_base", help="any tiktoken encoding name")
    ap.add_argument("--vocab_size", type=int, default=8192,
                    help="truncate the BPE to N ids (0: keep it whole)")
    ap.add_argument("--val_fraction", type=float, default=0.01,
                    help="share of documents that go to val")
    ap.add_argument("--text_field", default="text", help="the JSONL field that holds the text")
    ap.add_argument("--workers", type=int, default=0, help="encoding threads (0: one per core)")
    ap.add_argument("--extra_tokens", metavar="FILE",
                    help="new tokens, one per line, added after the vocabulary")
    ap.add_argument("--init_from", metavar="MODEL",
                    help="tokenize for this model (a run's out_dir or a Hugging Face "
                    "directory): its tokenizer, with its added tokens at their ids "
                    "(--tokenizer/--vocab_size unused)")
    ap.add_argument("--block_size", type=int, default=512,
                    help="chat data: say how its conversations pack into rows of this length "
                         "(config/sft.py's; 0: do not)")
    ap.add_argument("--format", default="auto", choices=("auto", "text", "chat", "preference"),
                    help="JSONL records: text, chat conversations, preference pairs (TRL's "
                         "formats), or auto (from the first record)")
    args = ap.parse_args()
    if args.out:
        guard_files.check_place("--out", args.out, "a dataset")
    name = args.name or corpora.stem(args.source.rstrip("/*")) or "data"
    model_tokens = ()
    # the model's tokenizer (tokenizer.model_spec), as train.py's init_from= prepares it
    if args.init_from:
        import parallel
        import origin
        from tokenizer import model_spec
        spec = model_spec(origin.start_from(args.init_from, parallel.setup("cpu")), args.tokenizer,
                          args.vocab_size)
        if spec:
            args.tokenizer, args.vocab_size, model_tokens = (
                spec["tokenizer"], spec["base_vocab_size"], spec["extra_tokens"])
    prepare(args.source, args.out or os.path.join("data", name), args.tokenizer, args.vocab_size,
            args.val_fraction, args.text_field, args.workers,
            extra_tokens=load_extra_tokens(args.extra_tokens) if args.extra_tokens else (),
            format=args.format,
            model_tokens=model_tokens, block_size=args.block_size)


if __name__ == "__main__":
    main()
