"""Tiny tokenizers built like the real ones of the LLaMA families people continue, trained by
the `tokenizers` library inside the test (no downloads), with a tokenizer_config.json like
the hub's. write_tokenizer(family, directory) for family in FAMILIES:

    llama3   byte-level BPE, Llama 3's split regex, 256 reserved specials after the BPE
             vocabulary, <|begin_of_text|> prepended by a TemplateProcessing post-processor
    llama2   SentencePiece-style BPE (Llama 2, TinyLlama): normalizer Prepend('▁') +
             Replace(' ', '▁'), byte_fallback with <0x00>..<0xFF> in the vocabulary,
             <unk> <s> </s> at ids 0, 1, 2, a <s> TemplateProcessing post-processor
    mistral  the same model written as recent conversions do (Mistral v0.3): no normalizer,
             a Metaspace pre-tokenizer (prepend_scheme 'first'), Metaspace decoder, and
             control tokens [INST] [/INST] as added specials
    qwen2    NFC normalizer, byte-level BPE with Qwen2's own split (single digits), no BOS,
             <|endoftext|> <|im_start|> <|im_end|> added as specials
    qwen3    Qwen2's, and <think> </think> added as ordinary (not special) tokens, as Qwen3's
"""

import json
import os

from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                        pre_tokenizers, processors, trainers)

FAMILIES = ("llama3", "llama2", "mistral", "qwen2", "qwen3")
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>",
                   "<|step_id|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
                   *[f"<|reserved_special_token_{i}|>" for i in range(2, 247)]]
assert len(LLAMA3_SPECIALS) == 256


def training_texts():
    """A few hundred kB of code, prose and unicode: what the tiny vocabularies are learned from."""
    from formats import corpora
    _, files = corpora.stdlib_files()
    texts = [open(f, encoding="utf-8", errors="replace").read()[:3000] for f in files[:60]]
    prose = ("The quick brown fox jumps over the lazy dog. It's what they'd said: we'll see, I've "
             "heard, you're right. héllo wörld café naïve 日本語のテキスト 中文文本 "
             "Привет, мир! مرحبا 🙂🚀 ")
    return texts + [prose] * 30


def _bpe_parts(pre_tokenizer, vocab_size, alphabet=()):
    """(vocab, merges) of a BPE trained on training_texts() split by `pre_tokenizer`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=list(alphabet))
    tok.train_from_iterator(training_texts(), trainer)
    state = json.loads(tok.to_str())["model"]
    return state["vocab"], state["merges"]


def _byte_level(split, vocab_size, ignore_merges):
    pre = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    vocab, merges = _bpe_parts(pre, vocab_size, pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab, [tuple(m) for m in merges], ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(vocab_size):
    """Llama 2's layout: <unk> <s> </s>, the 256 byte tokens, then the learned pieces."""
    vocab, merges = _bpe_parts(pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first"),
                               vocab_size)
    ids = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)]]
    ids += [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if t not in ids]
    return Tokenizer(models.BPE({t: i for i, t in enumerate(ids)}, [tuple(m) for m in merges],
                                unk_token="<unk>", byte_fallback=True, fuse_unk=True))


def build(family):
    """(tokenizers.Tokenizer, tokenizer_config.json dict) of a tiny tokenizer of `family`."""
    if family == "llama3":
        tok = _byte_level(LLAMA3_SPLIT, 700, ignore_merges=True)
        tok.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in LLAMA3_SPECIALS])
        bos = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                          pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                                          special_tokens=[("<|begin_of_text|>", bos)])])
        return tok, {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
                     "model_max_length": 131072, "clean_up_tokenization_spaces": True,
                     "tokenizer_class": "PreTrainedTokenizerFast",
                     "model_input_names": ["input_ids", "attention_mask"]}
    if family in ("qwen2", "qwen3"):
        tok = _byte_level(QWEN2_SPLIT, 600, ignore_merges=False)
        tok.normalizer = normalizers.NFC()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
        if family == "qwen3":
            tok.add_tokens(
                [AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
        return tok, {"bos_token": None, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                     "unk_token": None, "model_max_length": 32768,
                     "tokenizer_class": "Qwen2Tokenizer",
                     "add_prefix_space": False, "errors": "replace", "split_special_tokens": False,
                     "clean_up_tokenization_spaces": False}
    if family not in ("llama2", "mistral"):
        raise ValueError(f"unknown family {family!r}: one of {FAMILIES}")
    tok = _sentencepiece(700)
    if family == "llama2":
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first", split=False)
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    if family == "mistral":
        tok.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in ("[INST]", "[/INST]")])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B:1",
                                                       special_tokens=[("<s>", 1)])
    config = {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>",
              "eos_token": "</s>", "unk_token": "<unk>", "pad_token": None,
              "model_max_length": 1000000000000000019884624838656, "legacy": family == "mistral",
              "tokenizer_class": "LlamaTokenizer", "sp_model_kwargs": {},
              "clean_up_tokenization_spaces": False, "use_default_system_prompt": False}
    return tok, config


def write_tokenizer(family, directory):
    """Writes tokenizer.json and tokenizer_config.json of a tiny `family` tokenizer into
    `directory` (made if missing); returns its number of ids (the embedding rows a model of
    it needs)."""
    tok, config = build(family)
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    return 1 + max(max(tok.get_vocab().values()), *tok.get_added_tokens_decoder())
