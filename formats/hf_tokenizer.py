"""
A model's tokenizer, from a Hugging Face directory (the reverse of hf.hf_tokenizer):

- tokenizer.json, any BPE that models ship (byte-level: GPT-2, Llama 3, Qwen2, SmolLM;
  SentencePiece-style with byte fallback: Llama 2, TinyLlama, Mistral), read by the `tokenizers`
  library (transformers' fast tokenizers are that library), after the checks below: it is JSON,
  read bounded, and nothing in it runs code;
- a tiktoken rank file (tokenizer.model in Meta's Llama 3 release format: one "base64-token rank"
  per line), as a tiktoken Encoding with Meta's split and special tokens.

Ids equal transformers' AutoTokenizer on the same directory, which reads tokenizer_config.json
too: its bos/eos tokens and add_bos_token (transformers 5 rebuilds the post-processor from
them when given), and for tokenizer_class LlamaTokenizer its legacy/add_prefix_space (transformers
5 rebuilds that class's normalizer, pre-tokenizer and decoder from those, whatever the file
says): both are mirrored here, so the tokenizer we train with is the one AutoTokenizer gives.

HFTokenizer has the few methods of tiktoken's Encoding this trainer calls (encode_ordinary,
encode with allowed_special, the batch forms, decode, encode_single_token, n_vocab,
special_tokens_set), so tokenizer.encode and friends take either. Where tiktoken provably encodes a
tokenizer.json alike (tiktoken_twin: Llama 3's layout, our own exports'), it does the encoding,
3-6x faster than `tokenizers` (`python bench.py tokenize`).
"""

import base64
import functools
import hashlib
import json
import os
import re

import tiktoken

from guards import guard_chat
from guards.guard_errors import UserError
from guards.guard_files import (MAX_JSON_BYTES, MAX_LIST_JSON_BYTES, MAX_SIZES, read_json,
                                sha256_file)

# Meta's Llama 3 tokenizer.py: its split and its 256 special tokens after the 128,000 ranks
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| "
                  r"?[^\s\p{L}\p{N}]+[\r\n]*|"
                  r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                  "<|reserved_special_token_1|>", "<|reserved_special_token_2|>",
                  "<|reserved_special_token_3|>",
                  "<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>",
                  "<|eot_id|>",
                  *[f"<|reserved_special_token_{i}|>" for i in range(5, 251)]]
# unused ids between a tokenizer's tokens: a real one has none or a few (cl100k_base: 1)
MAX_ID_GAP = 1024
# where transformers 5 saves a tokenizer's chat template (before: tokenizer_config.json's)
CHAT_TEMPLATE_FILE = "chat_template.jinja"


def find(model_dir):
    """The tokenizer file of a Hugging Face model directory (tokenizer.json first), or None."""
    for name in ("tokenizer.json", "tokenizer.model"):
        if os.path.isfile(os.path.join(model_dir, name)):
            return os.path.join(model_dir, name)
    return None


def sha256(path, template=True):
    """The hash a model's tokenizer is recorded with (tokenizer.spec_of): its file's, and for a
    tokenizer.json also the tokenizer_config.json beside it (its special tokens and flags
    change ids too) and the chat_template.jinja beside that, when there is one (the chat
    format's ids and loss masks come from it)."""
    digest, config = (sha256_file(path),
                      os.path.join(os.path.dirname(path), "tokenizer_config.json"))
    if path.endswith(".json") and os.path.isfile(config):
        digest = hashlib.sha256(f"{digest} {sha256_file(config)}".encode()).hexdigest()
    jinja = os.path.join(os.path.dirname(path), CHAT_TEMPLATE_FILE)
    if template and path.endswith(".json") and os.path.isfile(jinja):
        digest = hashlib.sha256(f"{digest} {sha256_file(jinja)}".encode()).hexdigest()
    return digest


def unchanged(path, recorded):
    """Whether the tokenizer file `path` is still the one recorded with hash `recorded` (by
    sha256, or as recorded before: without the template file, or without the config)."""
    return (os.path.isfile(path)
            and recorded in (sha256(path), sha256(path, template=False), sha256_file(path)))


FIX = "copy the model's tokenizer files again"


def _json(path, limit=MAX_JSON_BYTES):
    guard_chat.check_in_model_dir(path, FIX)
    return read_json(path, FIX, limit=limit)  # bounded: depth, numbers, size


def _bad(path, problem):
    return UserError(f"{path}: {problem}: {FIX}")


def _token_name(value):
    return value.get("content") if isinstance(value, dict) else value


# ---------------------------------------------------------------------------------------
# tokenizer.json, checked, then read by `tokenizers`


def check_tokenizer_json(tj, path):
    """What `tokenizers` would accept or number otherwise than the file says, refused in one
    line: a model other than BPE, vocabulary ids that are not distinct non-negative ints,
    added tokens with a negative id, an id of another added token or of another vocabulary
    token, or far past the others. Returns {id: token} of the vocabulary and added tokens."""
    model = tj.get("model")
    kind = model.get("type") if isinstance(model, dict) else None
    if kind != "BPE":
        what = {"WordPiece": "a WordPiece tokenizer (BERT style)",
                "Unigram": "a unigram tokenizer (T5, ALBERT "
                "style)"}.get(kind, f"a {str(kind)[:40] if kind else 'model-less'} tokenizer")
        raise UserError(f"{path} is {what}; only BPE tokenizers (what LLaMA-family models ship: "
                        "byte-level or SentencePiece-style) are read: use such a model, or train "
                        "with tokenizer= of your own")
    # (`tokenizers` panics on its merges, or drops the text)
    if model.get("continuing_subword_prefix"):
        raise _bad(path, f"its BPE has continuing_subword_prefix "
                         f"{str(model['continuing_subword_prefix'])[:20]!r}, a WordPiece-style "
                         f"marker that no LLaMA-family tokenizer uses; set it to null")
    vocab, added = model.get("vocab"), tj.get("added_tokens") or []
    if (not isinstance(vocab, dict) or not isinstance(added, list)
        or not isinstance(model.get("merges", []), list)):
        raise _bad(path, "model.vocab is not an object, or model.merges / added_tokens not a list")
    tokens = {}
    for text, i in vocab.items():
        if type(i) is not int or not 0 <= i < MAX_SIZES["vocab_size"]:
            raise _bad(path,
                       f"the vocabulary id of {text[:40]!r} is {str(i)[:40]}, not an int in [0, "
                       f"2**31)")
        if tokens.setdefault(i, text) != text:
            raise _bad(path, f"vocabulary id {i} is both {tokens[i][:40]!r} and {text[:40]!r}")
    seen, contents = {}, set()
    for a in added:
        i, text = (a.get("id") if isinstance(a, dict) else None,
                   a.get("content") if isinstance(a, dict) else None)
        if type(i) is not int or not isinstance(text, str) or not text:
            raise _bad(path,
                       f"added token {str(a)[:60]} has no int id and non-empty string content")
        if not 0 <= i < MAX_SIZES["vocab_size"]:
            raise _bad(path, f"added token {text[:40]!r} has id {i}, not in [0, 2**31)")
        if i in seen or text in contents:
            raise _bad(path,
                       f"added token {text[:40]!r} (id {i}) reuses an id or a content of another "
                       f"added token")
        seen[i] = text
        contents.add(text)
        if tokens.get(i, text) != text:
            raise _bad(path,
                       f"added token {text[:40]!r} has id {i}, the vocabulary's id "
                       f"of {tokens[i][:40]!r}")
        if vocab.get(text, i) != i:
            raise _bad(path,
                       f"added token {text[:40]!r} has id {i}, but the vocabulary gives "
                       f"it {vocab[text]}")
    tokens.update(seen)
    if tokens and max(tokens) >= len(tokens) + MAX_ID_GAP:
        raise _bad(path,
                   f"ids run to {max(tokens)} for {len(tokens)} tokens: more than {MAX_ID_GAP} "
                   f"unused ids")
    return tokens


def _config(path, tokens):
    """tokenizer_config.json beside `path`, its fields that change ids checked ({} if absent)."""
    cfg_path = os.path.join(os.path.dirname(path), "tokenizer_config.json")
    cfg = _json(cfg_path) if os.path.isfile(cfg_path) else {}
    names = set(tokens.values())
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        name = _token_name(cfg.get(key))
        if name is not None and (not isinstance(name, str) or name not in names):
            raise _bad(cfg_path,
                       f"{key} {str(name)[:40]!r} is not a token of {os.path.basename(path)}")
    for key in ("add_bos_token", "add_eos_token", "legacy", "add_prefix_space"):
        if key in cfg and not isinstance(cfg[key], bool) and cfg[key] is not None:
            raise _bad(cfg_path, f"{key} is {str(cfg[key])[:40]!r}, not true or false")
    jinja = os.path.join(os.path.dirname(path), CHAT_TEMPLATE_FILE)
    guard_chat.check_config_template(cfg.get("chat_template"), cfg_path)
    if "chat_template" not in cfg and os.path.lexists(jinja):  # transformers 5's place
        cfg["chat_template"] = guard_chat.read_template(jinja)
    return cfg


def _as_transformers_reads(tj, cfg):
    """tokenizer.json as transformers 5's AutoTokenizer uses it (see the module docstring):
    LlamaTokenizer's rebuilt normalizer / pre-tokenizer / decoder / BPE flags."""
    if cfg.get("tokenizer_class") not in ("LlamaTokenizer", "LlamaTokenizerFast"):
        return tj
    prefix = cfg.get("add_prefix_space") is not False  # transformers' _get_prepend_scheme
    scheme = ("always" if cfg.get("legacy") else "first") if prefix else "never"
    strip = [{"type": "Strip", "content": " ", "start": 1, "stop": 0}] if prefix else []
    return {**tj, "normalizer": None,
            "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": scheme,
                              "split": False},
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"}, *strip]},
            "model": {**tj["model"], "fuse_unk": True, "byte_fallback": True, "dropout": None,
                      "ignore_merges": False, "unk_token": None}}


def _tokenizer(tj, path):
    try:
        return guarded(path, tj)
    except UserError:
        raise
    except Exception as e:  # the library's parse error, whatever its kind: one line
        raise _bad(path,
                   f"the tokenizers library cannot read it "
                   f"({str(e).splitlines()[0][:120] if str(e) else e!r})")


def _panic(e):  # pyo3's PanicException derives from BaseException, not Exception
    return type(e).__name__ == "PanicException"


def _call(source, method, args, kwargs):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_str(json.dumps(source)) if isinstance(source, dict) else source
    return getattr(tok, method)(*args, **kwargs) if method else tok


def _whole(text):
    """text with each lone surrogate (half a UTF-16 pair: JSON's escapes can write one) made
    U+FFFD, as tiktoken reads it; the tokenizers library takes only whole characters. (ASCII
    text, known without a scan, is never copied.)"""
    if text.isascii():
        return text
    try:
        text.encode()
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def guarded(path, source, method=None, *args, **kwargs):
    """source.method(*args) of the `tokenizers` library, where source is a Tokenizer or a
    tokenizer.json dict (read first; no method: the Tokenizer). A Rust panic (a regex that
    backtracks too long, a Replace of an empty pattern, a junk charsmap) is one line naming the
    file and the parts without which the call works; the panic's own report to stderr is
    silenced."""
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        return _call(source, method, args, kwargs)
    except BaseException as e:
        if not _panic(e):
            raise
        tj, parts = source if isinstance(source, dict) else json.loads(source.to_str()), []
        for part in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
            try:
                if tj.get(part):
                    _call({**tj, part: None}, method, args, kwargs)
                    parts.append(f"{part} {json.dumps(tj[part])[:100]}")
            except BaseException as again:
                if not _panic(again) and not isinstance(again, Exception):
                    raise
        raise UserError(f"{path}: the tokenizers library fails on "
                        f"its {' or '.join(parts) or 'model'} ("
                        f"{str(e).splitlines()[0][:80] if str(e) else 'a panic'}): fix or remove "
                        f"that part, or {FIX}") from None
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


@functools.cache
def _char_bytes():
    """ByteLevel's alphabet: the byte each of its 256 characters stands for."""
    from formats.hf import bytes_to_unicode
    return {c: b for b, c in bytes_to_unicode().items()}


def _byte_level(tj):
    """Whether a ByteLevel pre-tokenizer maps text to characters that stand for bytes. There the
    BPE's byte_fallback, without <0xNN> tokens, changes only the bytes whose character the
    vocabulary lacks (SmolLM2: 21, control bytes and ones UTF-8 never uses), as the same file
    without the flag does, and as transformers reads it (transformers 5.17 sets the flag on
    SmolLM2's GGUF tokenizer)."""
    pre = tj.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    return any(step.get("type") == "ByteLevel" for step in steps)


def load_tokenizer_json(path):
    """The HFTokenizer of a tokenizer.json (and the tokenizer_config.json beside it)."""
    tj = _json(path, MAX_LIST_JSON_BYTES)  # (a vocabulary and its merges: tens of MB)
    tokens = check_tokenizer_json(tj, path)
    cfg = _config(path, tokens)
    tj = _as_transformers_reads(tj, cfg)
    missing = [f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" not in tj["model"]["vocab"]]
    if tj["model"].get("byte_fallback") and missing and not _byte_level(tj):
        raise _bad(path, f"its BPE has byte_fallback but lacks {len(missing)} of the 256 byte "
                         f"tokens (e.g. "
                         f"{missing[0]}): every character outside its vocabulary would be dropped")
    tok = _tokenizer(tj, path)
    from tokenizers import AddedToken, processors
    # transformers adds the named special tokens that the file did not, and rebuilds the
    # post-processor from add_bos_token / add_eos_token when the config gives one of them
    named = [_token_name(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")]
    have = {a.content for a in tok.get_added_tokens_decoder().values()}
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in named
                            if t not in (None, *have)])
    if "add_bos_token" in cfg or "add_eos_token" in cfg or tok.post_processor is None:
        bos, eos = (named[0] if cfg.get("add_bos_token") else None,
                    named[1] if cfg.get("add_eos_token") else None)
        single = " ".join(t for t in (bos and f"{bos}:0", "$A:0", eos and f"{eos}:0") if t)
        pair = " ".join(t for t in (single, bos and f"{bos}:1", "$B:1", eos and f"{eos}:1") if t)
        try:
            tok.post_processor = processors.TemplateProcessing(
                single=single, pair=pair,
                special_tokens=[(t, tok.token_to_id(t)) for t in (bos, eos) if t])
        except Exception as e:
            raise _bad(path, f"its bos/eos tokens make no template ({str(e)[:80]})") from None
    for i, text in tokens.items():
        # `tokenizers` numbers an added token past a gap its own way
        if tok.token_to_id(text) != i:
            raise _bad(path, f"token {text[:40]!r} has id {i} in the file but "
                             f"{tok.token_to_id(text)} in the tokenizers library (an added "
                             "token's id must follow the vocabulary's without a gap)")
    # GPT-2's, if the config names none
    eos = named[1] if named[1] is not None else "<|endoftext|>"
    if tok.token_to_id(eos) is None:
        raise UserError(f"{path}: no end-of-sequence token (eos_token in tokenizer_config.json) "
                        f"to separate documents: add eos_token to tokenizer_config.json")
    name = f"hf:{os.path.basename(os.path.dirname(os.path.abspath(path)))}"
    return HFTokenizer(name, tok, cfg, tok.token_to_id(eos), path)


# text of every kind a corpus holds: tiktoken_twin's encodings must equal the library's on it
PROBE = ("Hello, world! It's 2026: naïve café, 日本語のテキスト, Привет мир, مرحبا, ꙮ 🙂👩‍👩‍👧 ∑x² ≤ ∞\n\n"
         "\tdef f(x):\n        return x**2  # 1234567 3.14e-10\r\n   trailing  \u00a0nbsp\u3000 "
         "e\u0301 ｆｕｌｌ "
         "'S 'll I'M aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa {}[]()<>|~`^$@ \x00\x1f\x7f\u200b ")


def tiktoken_twin(tj):
    """tiktoken's Encoding of the tokenizer.json `tj` when it provably encodes alike, else None:
    tiktoken encodes a corpus ~6x faster (`python bench.py tokenize`). Alike when text is split
    by one regex and byte-mapped (no normalizer, no byte fallback: Llama 3's and our own
    exports' layout), every byte is a token and every longer one comes from a merge, the merges
    make tokens in id order (tiktoken joins the lowest-ranked pair, `tokenizers` the first
    listed merge), a piece that is a token is that token (ignore_merges, tiktoken's shortcut),
    and no added token starts another (tiktoken tries them in no fixed order, `tokenizers` the
    longest first)."""
    from formats.hf import bytes_to_unicode
    model, pre, added = tj["model"], tj.get("pre_tokenizer") or {}, tj.get("added_tokens") or []
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if (tj.get("normalizer") or model.get("byte_fallback") or not model.get("ignore_merges")
        or len(steps) != 2):
        return None
    split, byte_level = steps
    names = sorted(a["content"] for a in added)
    if (split.get("type") != "Split" or split.get("behavior") != "Isolated" or split.get("invert")
            or not isinstance((split.get("pattern") or {}).get("Regex"), str)
        or byte_level.get("type") != "ByteLevel"
            or byte_level.get("add_prefix_space") or byte_level.get("use_regex", True)
            or any(a.get("lstrip") or a.get("rstrip") or a.get("single_word") for a in added)
            # sorted: a prefix sorts right before
            or any(b.startswith(a) for a, b in zip(names, names[1:]))):
        return None
    char_byte = {c: b for b, c in bytes_to_unicode().items()}
    ranks = {}
    for text, i in model["vocab"].items():
        if text not in names:  # an added token is matched before the BPE, never its result
            if any(c not in char_byte for c in text):
                return None
            ranks[bytes(char_byte[c] for c in text)] = i
    made, last = set(), -1
    for m in model.get("merges", []):
        left, right = m.split(" ", 1) if isinstance(m, str) else m
        token = bytes(char_byte.get(c, 0) for c in left + right)
        if ranks.get(token, -1) < last:
            return None
        last = ranks[token]
        made.add(token)
    if (any(bytes([b]) not in ranks for b in range(256))
        or any(len(t) > 1 and t not in made for t in ranks)):
        return None
    try:
        return tiktoken.Encoding(name="twin", pat_str=split["pattern"]["Regex"],
                                 mergeable_ranks=ranks,
                                 special_tokens={a["content"]: a["id"] for a in added})
    except ValueError:  # a pattern tiktoken's regex engine reads otherwise: `tokenizers` alone
        return None


def _set(allowed_special):
    return allowed_special if allowed_special == "all" else set(allowed_special)


class HFTokenizer:
    """A `tokenizers` Tokenizer with tiktoken's Encoding interface (the part this trainer uses)
    and the model's document markers: eot_token (the EOS that ends a document), bos_token (what
    the post-processor puts first, or None), extra_tokens (the added tokens that are not special:
    text produces them, see tokenizer.encode). Special tokens written in text read as text, as
    transformers' split_special_tokens=True reads them (encode_special_tokens here)."""

    def __init__(self, name, tok, config, eot_token, path):
        self.name, self._tok, self.config, self.eot_token, self._path = (
            name, tok, config, eot_token, path)
        added = tok.get_added_tokens_decoder()  # {id: AddedToken}
        self.n_vocab = 1 + max([*tok.get_vocab(with_added_tokens=False).values(), *added])
        self.max_token_value = self.n_vocab - 1
        self.special_tokens_set = {a.content for a in added.values()}
        self._added = set(added)
        self.extra_tokens = tuple(a.content for _, a in sorted(added.items()) if not a.special)
        tj = json.loads(tok.to_str())
        self._byte_level = _byte_level(tj)
        for pp in ((tj.get("post_processor") or {}).get("processors")
                   or [tj.get("post_processor") or {}]):
            named = {piece["SpecialToken"]["id"] for side in ("single", "pair")
                     for piece in pp.get(side) or []
                     if pp.get("type") == "TemplateProcessing" and "SpecialToken" in piece}
            # (`tokenizers` would panic in Rust)
            if missing := sorted(named - set(pp.get("special_tokens") or {})):
                raise UserError(f"{path}: its post-processor's template names {missing} but "
                                f"defines no such special "
                                f"token: add it to special_tokens, or remove it")
        plain = guarded(path, tok, "encode", "x", add_special_tokens=False).ids
        marked = guarded(path, tok, "encode", "x").ids
        if any(not 0 <= i < self.n_vocab for i in marked):
            raise UserError(f"{path}: its post-processor adds id {max(marked)}, past "
                            f"the {self.n_vocab:,} ids of the "
                            f"tokenizer: fix the ids in post_processor's special_tokens")
        start = next((k for k in range(len(marked)) if marked[k:k + len(plain)] == plain), None)
        if start is None or start > 1 or marked[start + len(plain):] not in ([], [eot_token]):
            raise UserError(f"{path}: its post-processor wraps text as {marked} (text alone: "
                            f"{plain}); only a BOS before and an EOS after are supported: edit "
                            "post_processor or add_bos_token")
        self.bos_token = marked[0] if start else None
        # the model's chat format (chat_template.py renders it), or None: the project's own then
        self.chat_template = config.get("chat_template")
        # named templates (transformers: "default" unless one is named; a name listed twice is
        # its last, as transformers builds a dict of them)
        if isinstance(self.chat_template, list):
            named = [t.get("template") for t in self.chat_template
                     if isinstance(t, dict) and t.get("name") == "default"]
            self.chat_template = named[-1] if named else self.chat_template
        self._variants = {}
        # the fast path where it is exact (and encodes a probe text alike), else None
        twin, probe = (tiktoken_twin(tj),
                       guarded(path, tok, "encode", PROBE, add_special_tokens=False).ids)
        self.twin = twin if twin and twin.encode_ordinary(PROBE) == probe else None

    def _variant(self, allowed, inner=False):
        """The tokenizer that turns exactly the added tokens in `allowed` ("all": every one)
        into their ids and reads the others as text; inner: for text that follows a token in a
        longer text (see encode_inner_batch)."""
        key = ("all" if allowed == "all" else frozenset(allowed), inner)
        if key not in self._variants:
            tj = json.loads(self._tok.to_str())
            for a in tj["added_tokens"]:
                a["special"] = key[0] != "all" and a["content"] not in key[0]
            pre = tj.get("pre_tokenizer") or {}
            for p in pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]:
                if inner and p.get("type") == "Metaspace" and p.get("prepend_scheme") == "first":
                    p["prepend_scheme"] = "never"
            self._variants[key] = _tokenizer(tj, self._path)
            self._variants[key].encode_special_tokens = key[0] != "all"
        return self._variants[key]

    def encode(self, text, allowed_special=(), disallowed_special=()):
        if self.twin:
            return self.twin.encode(text, allowed_special=_set(allowed_special),
                                    disallowed_special=())
        return guarded(self._path, self._variant(allowed_special), "encode", _whole(text),
                       add_special_tokens=False).ids

    def encode_batch(self, texts, num_threads=8, allowed_special=(), disallowed_special=()):
        if self.twin:
            return self.twin.encode_batch(texts, num_threads=num_threads,
                                          allowed_special=_set(allowed_special),
                                          disallowed_special=())
        # num_threads: the library's own pool (RAYON_NUM_THREADS, one thread per core) does it
        return [e.ids
                for e in guarded(self._path, self._variant(allowed_special), "encode_batch_fast",
                                 [_whole(t) for t in texts], add_special_tokens=False)]

    def encode_inner_batch(self, texts, allowed_special=()):
        """encode_batch of texts that each follow a token in a longer text (a chat message after
        its role token), as the longer text's encoding has them: a Metaspace pre-tokenizer with
        prepend_scheme 'first' (transformers' Llama default) puts '▁' before the text's first
        piece only, not after a token."""
        if self.twin:  # (a byte-level split has no first piece of its own)
            return self.encode_batch(texts, allowed_special=allowed_special)
        return [e.ids
                for e in guarded(self._path, self._variant(allowed_special, True),
                                 "encode_batch_fast", [_whole(t) for t in texts],
                                 add_special_tokens=False)]

    def encode_with_offsets(self, text, as_text=False, first=True):
        """(ids, each token's character span) of a piece of a rendered chat, as transformers
        encodes one (apply_chat_template: every added token matched; as_text: none, a quoted
        control token). A piece after the first is encoded after a newline, then dropped, as
        transformers' encode_marked_chat does (so a SentencePiece-style split adds no '▁')."""
        tok = self._variant(()) if as_text else self._tok
        if not first:
            newline = guarded(self._path, self._tok, "encode", "\n", add_special_tokens=False).ids
            e = guarded(self._path, tok, "encode", "\n" + text, add_special_tokens=False)
            if e.ids[:len(newline)] == newline:
                return e.ids[len(newline):], [(a - 1, b - 1) for a, b in e.offsets[len(newline):]]
        e = guarded(self._path, tok, "encode", text, add_special_tokens=False)
        return e.ids, e.offsets

    def encode_ordinary(self, text):
        return self.encode(text)

    def encode_ordinary_batch(self, texts, num_threads=8):
        return self.encode_batch(texts, num_threads)

    def decode(self, ids):
        return guarded(self._path, self._tok, "decode", list(ids), skip_special_tokens=False)

    def decode_single_token_bytes(self, i):
        """The bytes id i stands for (tiktoken's method; evals.py counts them): a byte-level
        token's bytes, a SentencePiece piece with '▁' as a space and <0xNN> as its byte, an
        added token's text."""
        token = self._tok.id_to_token(i)
        if token is None or i in self._added:
            return (token or "").encode()
        if self._byte_level:
            char_byte = _char_bytes()
            return b"".join(bytes([char_byte[c]]) if c in char_byte else c.encode() for c in token)
        byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", token)
        return bytes([int(byte[1], 16)]) if byte else token.replace("\u2581", " ").encode()

    def encode_single_token(self, token):
        i = self._tok.token_to_id(token)
        if i is None:
            raise KeyError(token)
        return i

    def expanded(self, tokens):
        """This tokenizer with `tokens` added (not special: text produces them), at the ids
        after the largest, in order (see tokenizer.get_tokenizer)."""
        from tokenizers import AddedToken
        tok = _tokenizer(json.loads(self._tok.to_str()), self._path)  # a copy
        for i, t in enumerate(tokens):
            if tok.token_to_id(t) is not None:
                raise UserError(f"extra token {t!r} is already a token of {self.name}: drop it "
                                f"from the list")
            tok.add_tokens([AddedToken(t, special=False, normalized=False)])
            if tok.token_to_id(t) != self.n_vocab + i:
                raise UserError(f"extra token {t!r} got id {tok.token_to_id(t)}, not "
                                f"{self.n_vocab + i}: {self.name} has ids past its vocabulary "
                                "that are not added tokens; add tokens to it by hand")
        return HFTokenizer(f"{self.name}+{len(tokens)}", tok, self.config, self.eot_token,
                           self._path)

    def export(self, max_length):
        """(tokenizer.json, tokenizer_config.json) as dicts for hf.hf_tokenizer: this tokenizer as
        the library serializes it (added tokens included), and the base's config with its
        special tokens and model_max_length (`max_length` where it has none); added_tokens_decoder
        follows the tokenizer; code (auto_map) stays behind."""
        tj = json.loads(self._tok.to_str())
        config = {k: v for k, v in self.config.items()
                  if k not in ("auto_map", "added_tokens_decoder", "name_or_path",
                               "tokenizer_file")}
        config.setdefault("model_max_length", max_length)
        config["added_tokens_decoder"] = {str(a["id"]): {k: v for k, v in a.items() if k != "id"}
                                          for a in tj["added_tokens"]}
        if "eos_token" not in config:
            config["eos_token"] = self._tok.id_to_token(self.eot_token)
        return tj, config


# ---------------------------------------------------------------------------------------
# a tiktoken rank file


class Encoding(tiktoken.Encoding):
    """tiktoken's Encoding with the model's own document markers, as HFTokenizer's."""
    eot_token = None  # a plain attribute here (tiktoken's is a property reading <|endoftext|>)
    bos_token = None
    extra_tokens = ()


def load_rank_file(path):
    """A tiktoken rank file (Meta's Llama 3 tokenizer.model) as an Encoding: Meta's split and
    special tokens. A SentencePiece tokenizer.model (a protobuf) is refused by name."""
    ranks, seen = {}, set()
    guard_chat.check_in_model_dir(path, FIX)
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            try:
                token, rank = line.split()
                token = base64.b64decode(token, validate=True)
            except ValueError:
                raise UserError(f"{path} is a SentencePiece model (not a tiktoken rank file of "
                                "base64-token rank lines), which this trainer does not read: use "
                                "the model's tokenizer.json") from None
            if not rank.isdigit() or len(rank) > 10 or int(rank) in seen or token in ranks:
                raise _bad(path, f"line {n}: rank {rank[:20].decode(errors='replace')!r} is not a "
                                 f"non-negative integer, or it or its token is listed twice")
            ranks[token] = int(rank)
            seen.add(int(rank))
    if seen != set(range(len(ranks))):
        raise _bad(path, f"its {len(ranks)} ranks are not 0 .. {len(ranks) - 1}")
    special = {t: len(ranks) + i for i, t in enumerate(LLAMA3_SPECIAL)}
    try:
        enc = Encoding(name="llama3", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                       special_tokens=special)
    except ValueError as e:
        raise _bad(path, f"tiktoken refuses its ranks ({str(e)[:80]})") from None
    enc.eot_token, enc.bos_token = special["<|end_of_text|>"], special["<|begin_of_text|>"]
    return enc


def load(path):
    """The tokenizer of a tokenizer file (tokenizer.json: an HFTokenizer; a tiktoken rank file:
    a tiktoken Encoding)."""
    if not os.path.isfile(path):
        raise UserError(f"tokenizer file {path} not found: copy the model's tokenizer.json (or "
                        f"tokenizer.model) back")
    try:
        return load_tokenizer_json(path) if path.endswith(".json") else load_rank_file(path)
    except UserError:
        raise
    except (AttributeError, KeyError, TypeError, ValueError, IndexError, StopIteration) as e:
        # a field missing or of the wrong type (a file from outside: one line, not a traceback)
        raise UserError(f"{path} is malformed "
                        f"({type(e).__name__}: {str(e)[:80]}): {FIX}") from None
