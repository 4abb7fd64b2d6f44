"""
A model's tokenizer, from a Hugging Face directory, as a tiktoken Encoding (the reverse of
hf.hf_tokenizer): a byte-level BPE tokenizer.json (GPT-2 style: GPT-2, Llama 3, SmolLM) or a
tiktoken rank file (tokenizer.model in Meta's Llama 3 release format: one "base64-token rank"
per line). What tiktoken cannot reproduce exactly is refused by name: SentencePiece
(Metaspace, byte fallback: Llama 1/2, Mistral), WordPiece, unigram, a normalizer.

tiktoken's BPE joins, inside each regex piece, the adjacent pair whose concatenation has the
lowest rank (its id); Hugging Face's joins the pair listed first in `merges`. The two agree
when the merges, in order, make tokens of non-decreasing id and every multi-byte token is made
by some merge (what a BPE trainer writes, and what our own export writes), so that is checked.
"""

import base64
import os

import tiktoken

from common import UserError, read_json, sha256_file
from hf import bytes_to_unicode

# the tokenizers library's ByteLevel(use_regex=True) split: GPT-2's pattern
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Meta's Llama 3 tokenizer.py: its split and its 256 special tokens after the 128,000 ranks
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                  r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                  "<|reserved_special_token_1|>", "<|reserved_special_token_2|>", "<|reserved_special_token_3|>",
                  "<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>",
                  *[f"<|reserved_special_token_{i}|>" for i in range(5, 251)]]


def find(model_dir):
    """The tokenizer file of a Hugging Face model directory (tokenizer.json first), or None."""
    for name in ("tokenizer.json", "tokenizer.model"):
        if os.path.isfile(os.path.join(model_dir, name)):
            return os.path.join(model_dir, name)
    return None


def sha256(path):
    return sha256_file(path)  # the file hash that checkpoints' manifests use


def _json(path):
    return read_json(path, "copy the model's tokenizer files again")  # bounded: depth, numbers, size


def _token_name(value):
    return value.get("content") if isinstance(value, dict) else value


def _config_tokens(path):
    """(bos, eos) token strings from tokenizer_config.json beside `path` (None where absent)."""
    cfg = os.path.join(os.path.dirname(path), "tokenizer_config.json")
    cfg = _json(cfg) if os.path.isfile(cfg) else {}
    return _token_name(cfg.get("bos_token")), _token_name(cfg.get("eos_token")), cfg


class Encoding(tiktoken.Encoding):
    """tiktoken's Encoding with the model's own document markers: eot_token (what ends a
    document: the EOS token, not necessarily <|endoftext|>), bos_token (what starts one, or
    None) and extra_tokens (the added tokens that text may produce, see data.encode)."""
    eot_token = None  # a plain attribute here (tiktoken's is a property reading <|endoftext|>)
    bos_token = None
    extra_tokens = ()


def _finish(name, pat, ranks, special, extra, bos, eos, path):
    eos = eos if eos is not None or "<|endoftext|>" not in special else "<|endoftext|>"  # GPT-2's, if no config
    if eos is None or eos not in special:
        raise UserError(f"{path}: no end-of-sequence token (eos_token in tokenizer_config.json, one of the special "
                        f"tokens) to separate documents: add eos_token to tokenizer_config.json")
    enc = Encoding(name=name, pat_str=pat, mergeable_ranks=ranks, special_tokens=special)
    enc.extra_tokens = tuple(extra)
    enc.eot_token = special[eos]
    enc.bos_token = special.get(bos) if bos else None
    return enc


def _refuse(path, kind, fix="use a model with a byte-level BPE tokenizer (GPT-2, Llama 3, SmolLM style), or "
                            "train with tokenizer= on data of your own"):
    return UserError(f"{path} is {kind}, which this trainer cannot reproduce exactly through tiktoken: {fix}")


def load_tokenizer_json(path):
    """A byte-level BPE tokenizer.json as a tiktoken Encoding (see the module docstring)."""
    tj = _json(path)
    model = tj.get("model") or {}
    kind = model.get("type")
    if kind == "WordPiece":
        raise _refuse(path, "a WordPiece tokenizer (BERT style)")
    if kind == "Unigram":
        raise _refuse(path, "a unigram tokenizer (SentencePiece unigram: T5, ALBERT style)")
    if kind != "BPE":
        raise _refuse(path, f"a {kind or 'model-less'} tokenizer")
    pre = tj.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    types = [s.get("type") for s in steps]
    normalizer = (tj.get("normalizer") or {}).get("type")
    if "Metaspace" in types or model.get("byte_fallback") or normalizer in ("Prepend", "Replace"):
        raise _refuse(path, "a SentencePiece-style BPE (Metaspace / byte fallback: Llama 1-2, Mistral style)")
    if normalizer is not None:
        raise _refuse(path, f"a BPE with a {normalizer} normalizer", "tiktoken has no normalizer; use a model "
                                                                      "whose tokenizer.json has \"normalizer\": null")
    if "ByteLevel" not in types or types.count("ByteLevel") > 1 or any(t not in ("ByteLevel", "Split") for t in types):
        raise _refuse(path, f"a BPE with pre-tokenizers {types or 'none'} (not byte-level)")
    byte_level = next(s for s in steps if s["type"] == "ByteLevel")
    if byte_level.get("add_prefix_space"):
        raise _refuse(path, "a byte-level BPE with add_prefix_space", "set add_prefix_space to false")
    splits = [s for s in steps if s["type"] == "Split"]
    if len(splits) + bool(byte_level.get("use_regex", True)) != 1 or types[-1] != "ByteLevel":
        raise _refuse(path, f"a byte-level BPE split by {types} with use_regex={byte_level.get('use_regex', True)}",
                      "only one regex split (a Split, or ByteLevel's own) before the byte mapping is supported")
    if splits:
        s = splits[0]
        if s.get("behavior") != "Isolated" or s.get("invert") or "Regex" not in (s.get("pattern") or {}):
            raise _refuse(path, f"a byte-level BPE whose Split is {s.get('behavior')}/invert={s.get('invert')}")
        pat = s["pattern"]["Regex"]
    else:
        pat = GPT2_PATTERN
    char_byte = {c: b for b, c in bytes_to_unicode().items()}
    added = sorted(tj.get("added_tokens") or [], key=lambda a: a["id"])
    for a in added:
        if a.get("lstrip") or a.get("rstrip") or a.get("single_word"):
            raise _refuse(path, f"a tokenizer whose added token {a['content']!r} strips or matches whole words only",
                          "set lstrip, rstrip and single_word to false")
    added_names = {a["content"] for a in added}
    ranks = {}
    for text, i in model.get("vocab", {}).items():
        if text in added_names:
            continue  # an added token: matched in text before the BPE, never a BPE result
        if any(c not in char_byte for c in text):
            raise _refuse(path, f"a BPE whose vocabulary entry {text!r} is not in the byte-to-unicode map (not "
                                f"byte-level)")
        ranks[bytes(char_byte[c] for c in text)] = i
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise _refuse(path, f"a byte-level BPE without tokens for {len(missing)} of the 256 bytes",
                      "train it with initial_alphabet=ByteLevel.alphabet()")
    made, last = set(), -1
    for m in model.get("merges", []):
        left, right = m.split(" ", 1) if isinstance(m, str) else m
        token = bytes(char_byte[c] for c in left + right)
        if token not in ranks or ranks[token] < last:
            raise _refuse(path, f"a BPE whose merges are not in the order of their tokens' ids (at {left!r} + "
                                f"{right!r})", "such a merge list has no tiktoken equivalent")
        last = ranks[token]
        made.add(token)
    unmade = [t for t in ranks if len(t) > 1 and t not in made]
    if unmade:
        raise _refuse(path, f"a BPE with {len(unmade)} tokens that no merge makes (e.g. {unmade[0]!r})")
    bos, eos, cfg = _config_tokens(path)
    special = {a["content"]: a["id"] for a in added}
    extra = [a["content"] for a in added if not a.get("special")]  # text produces them, as it does ours
    return _finish(f"hf:{os.path.basename(os.path.dirname(os.path.abspath(path)))}", pat, ranks, special, extra,
                   bos if _adds_bos(tj, cfg) else None, eos, path)


def _adds_bos(tj, cfg):
    """Whether encoding prepends the BOS token (a TemplateProcessing post-processor that starts
    with a special token, as Llama 3's, or add_bos_token in tokenizer_config.json)."""
    post = tj.get("post_processor") or {}
    posts = post.get("processors", []) if post.get("type") == "Sequence" else [post]
    for p in posts:
        if p.get("type") == "TemplateProcessing" and p.get("single") and "SpecialToken" in p["single"][0]:
            return True
    return bool(cfg.get("add_bos_token"))


def load_rank_file(path):
    """A tiktoken rank file (Meta's Llama 3 tokenizer.model) as an Encoding: Meta's split and
    special tokens. A SentencePiece tokenizer.model (a protobuf) is refused by name."""
    ranks = {}
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError:
                raise _refuse(path, "a SentencePiece model (not a tiktoken rank file of base64-token rank lines)",
                              "convert the model to a byte-level BPE tokenizer.json, or use one that has "
                              "one") from None
    special = {t: len(ranks) + i for i, t in enumerate(LLAMA3_SPECIAL)}
    return _finish("llama3", LLAMA3_PATTERN, ranks, special, [], "<|begin_of_text|>", "<|end_of_text|>", path)


def load(path):
    """The Encoding of a tokenizer file (tokenizer.json, or a tiktoken rank file)."""
    if not os.path.isfile(path):
        raise UserError(f"tokenizer file {path} not found: copy the model's tokenizer.json (or tokenizer.model) back")
    try:
        return load_tokenizer_json(path) if path.endswith(".json") else load_rank_file(path)
    except UserError:
        raise
    except (AttributeError, KeyError, TypeError, ValueError, IndexError, StopIteration) as e:
        # a field missing or of the wrong type (a file from outside: one line, not a traceback)
        raise UserError(f"{path} is malformed ({type(e).__name__}: {str(e)[:80]}): copy the model's "
                        f"tokenizer files again") from None
