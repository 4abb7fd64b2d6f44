"""A model's tokenizer travels with it: Hugging Face tokenizers in (hf_tokenizer.py), built like
the real ones of each family (hf_families.py), with AutoTokenizer's ids; the refusals by kind, a
tiktoken rank file, and data prepared for a model with its ids."""

import base64
import copy
import json
import os

import numpy as np
import pytest
import torch
from conftest import ROOT, run_train

import hf_families
import prepare
from formats import corpora
from formats import hf_tokenizer
import tokenizer as tokenizer_py
from guards.guard_errors import UserError

SPECIALS = ["<|endoftext|>", "<|begin|>"]


def varied_lines():
    """Hundreds of lines: code from the standard library, unicode, whitespace runs, and the
    tokenizer's special and added tokens written in text."""
    _, files = corpora.stdlib_files()
    code = []
    for path in files[200:260]:
        with open(path, encoding="utf-8", errors="replace") as f:
            code += [line.rstrip("\n") for line in f][:6]
    unicode = ["héllo wörld", "naïve café", "日本語のテキスト", "中文 文本 123", "Привет, мир!",
               "مرحبا بالعالم", "emoji 🙂🚀 and 👩‍👩‍👧", "math: ∑ x² ≤ ∞", "tab\there",
               "ｆｕｌｌ ｗｉｄｔｈ", "ß ẞ Σς", "\u200bzero width", "'s 'll 'VE 'Re",
               "it's don't we'll they're I've I'm he'd", "1234567890 3.14159 1e-10", "a\r\nb\rc\n",
               "e\u0301 é"]
    spaces = ["    indented", "\t\t  mixed\t ", "trailing   ",
              "   ", "a  b   c    d", "\n\n\nx", "x\n\n", " \n \n",
              "if x:\n        return  y\n\n\n", "  ", "\u00a0nbsp\u3000ideographic"]
    specials = ["a <|endoftext|> b", "<|begin|>start", "call <|tool|> now", "<|tool|><|tool|>",
                "x<|endoftext|>", "<|endoftext", "|> <| tool |>"]
    return code + unicode * 4 + spaces * 4 + specials * 4


@pytest.fixture(scope="module")
def hf_bpe(tmp_path_factory):
    """A byte-level BPE trained with the `tokenizers` library (a BOS-adding post-processor as
    Llama 3's, an added non-special token) and a random LLaMA built by transformers on its
    vocabulary: the test peer. Returns (directory, AutoTokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    path = str(tmp_path_factory.mktemp("hf_bpe") / "llama")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    _, files = corpora.stdlib_files()
    texts = [open(f, encoding="utf-8", errors="replace").read()[:4000] for f in files[:80]]
    tok.train_from_iterator(
        texts + ["héllo wörld café naïve 日本語 Привет it's don't we'll they're I've"] * 20, trainer)
    tok.add_tokens(["<|tool|>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin|> $A", pair="<|begin|> $A $B:1", special_tokens=[("<|begin|>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin|>",
                                   eos_token="<|endoftext|>")
    fast.save_pretrained(path)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=tok.get_vocab_size(),
                                 hidden_size=32, intermediate_size=96,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=64, bos_token_id=1, eos_token_id=0,
                                 tie_word_embeddings=False)).save_pretrained(path)
    return path, AutoTokenizer.from_pretrained(path)


def compare(enc, auto, lines):
    """How many lines give different ids: tokenizer_py.encode (added non-special tokens become ids,
    special ones stay text) against AutoTokenizer with split_special_tokens, and tiktoken's
    encode with every special against AutoTokenizer's default; both with the BOS."""
    bos = [enc.bos_token] if enc.bos_token is not None else []
    differ = 0
    for line in lines:
        ours = bos + tokenizer_py.encode(enc, line)
        theirs = auto(line, split_special_tokens=True).input_ids
        ours_all = bos + enc.encode(line, allowed_special="all")
        differ += ours != theirs or ours_all != auto(line).input_ids
    return differ


def test_hf_byte_level_bpe_gives_autotokenizers_ids(hf_bpe):
    path, auto = hf_bpe
    enc = hf_tokenizer.load(os.path.join(path, "tokenizer.json"))
    lines = varied_lines()
    assert len(lines) >= 400 and compare(enc, auto, lines) == 0
    assert enc.n_vocab == len(auto) and enc.eot_token == 0 and enc.bos_token == 1
    assert enc.extra_tokens == ("<|tool|>",)
    assert enc.decode(tokenizer_py.encode(enc, lines[0])) == lines[0]


@pytest.mark.parametrize("family", hf_families.FAMILIES)
def test_family_tokenizers_give_autotokenizers_ids(tmp_path, family):
    """Each family's tokenizer (Llama 3, Llama 2 / TinyLlama, Mistral, Qwen2 built as the hub's
    are) read by hf_tokenizer.py gives AutoTokenizer's ids on varied text, its specials written in
    the text included (as text through tokenizer_py.encode, as ids through allowed_special="all"),
    the same BOS and EOS, and decodes as AutoTokenizer does; grown by extra tokens, the new ones
    take the ids after the last."""
    from transformers import AutoTokenizer
    n = hf_families.write_tokenizer(family, str(tmp_path))
    enc, auto = (hf_tokenizer.load(str(tmp_path / "tokenizer.json")),
                 AutoTokenizer.from_pretrained(tmp_path))
    specials = ["<s>hi</s> [INST] x [/INST]", "<|im_start|>user\nhi<|im_end|>",
                "<|begin_of_text|>a<|eot_id|>", "<unk> <0x41> ▁x", " leading", "  two\r\n\r\n"]
    lines = varied_lines() + specials * 4
    assert enc.n_vocab == len(auto) == n and compare(enc, auto, lines) == 0
    # tiktoken encodes Llama 3's layout, exactly
    assert (enc.twin is not None) == (family == "llama3")
    if enc.twin is not None:  # and `tokenizers` alone gives the same ids
        slow = copy.copy(enc)
        slow.twin = None
        assert compare(slow, auto, lines) == 0
    assert (enc.bos_token, enc.eot_token) == (auto.bos_token_id if family != "qwen2" else None,
                                              auto.eos_token_id)
    assert all(enc.decode(tokenizer_py.encode(enc, line)) == auto.decode(
        auto(line, split_special_tokens=True, add_special_tokens=False).input_ids)
               for line in lines)
    big = tokenizer_py.get_tokenizer(str(tmp_path / "tokenizer.json"), 0,
                                     ["<|tool|>", "return None"])
    assert [big.encode_single_token(t) for t in ("<|tool|>", "return None")] == [n, n + 1]
    assert tokenizer_py.encode(big, "a<|tool|>b")[1:-1] == [n]
    # specials stay text
    assert tokenizer_py.encode(big, "<|im_end|>") == tokenizer_py.encode(enc, "<|im_end|>")
    # a lone surrogate (JSON's "\ud800" in a document) reads as U+FFFD, as tiktoken reads it
    for e in (enc, copy.copy(enc)):
        e.twin = None if e is not enc else e.twin
        assert tokenizer_py.encode(e, "a \ud800 b") == tokenizer_py.encode(e, "a \ufffd b")
        assert tokenizer_py.encode_batch(e, ["x\udc00"]) == [tokenizer_py.encode(e, "x\ufffd")]


@pytest.mark.parametrize("family", hf_families.FAMILIES)
def test_family_export_keeps_the_bases_tokenizer(tmp_path, family):
    """hf.save_hf with a family's tokenizer grown by extra tokens writes the base's
    tokenizer.json as `tokenizers` serializes it (the added tokens at their ids): AutoTokenizer
    gives our ids, one per embedding row, and the base's BOS (none for Qwen2: not its EOS), EOS
    and model_max_length, in tokenizer_config.json, special_tokens_map.json and config.json."""
    from formats import hf
    from model import ModelConfig, Transformer
    from transformers import AutoTokenizer
    hf_families.write_tokenizer(family, str(tmp_path / "base"))
    base = AutoTokenizer.from_pretrained(tmp_path / "base")
    enc = tokenizer_py.get_tokenizer(str(tmp_path / "base" / "tokenizer.json"), 0,
                                     [*tokenizer_py.CHAT_TOKENS, "<|tool|>"])
    cfg = ModelConfig(vocab_size=enc.n_vocab, block_size=16, n_layer=1, n_head=2, n_kv_head=1,
                      n_embd=16)
    hf.save_hf(str(tmp_path / "hf"), Transformer(cfg).state_dict(), cfg, enc)
    tok, config = (AutoTokenizer.from_pretrained(tmp_path / "hf"),
                   json.load(open(tmp_path / "hf" / "config.json")))
    assert len(tok) == enc.n_vocab == len(base) + 5 and config["vocab_size"] == enc.n_vocab
    assert (tok.bos_token_id, tok.eos_token_id, tok.model_max_length) == (
        base.bos_token_id, base.eos_token_id, base.model_max_length)
    assert ((config["bos_token_id"], config["eos_token_id"])
            == (base.bos_token_id, base.eos_token_id))
    special = json.load(open(tmp_path / "hf" / "special_tokens_map.json"))
    assert special.get("bos_token") == base.bos_token and special["eos_token"] == base.eos_token
    bos = [enc.bos_token] if enc.bos_token is not None else []
    lines = varied_lines()[::3] + ["<|user|>hi<|end|><|assistant|>", "a<|tool|>b"]
    assert all(tok(line, split_special_tokens=True).input_ids
               == bos + tokenizer_py.encode(enc, line) for line in lines)
    chat = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."}]
    # the template starts with the BOS as prepare starts every document
    ids = tok.apply_chat_template(chat)
    assert ((ids if isinstance(ids, list) else ids["input_ids"])
            == bos + tokenizer_py.render_chat(enc, chat)[0])


def test_the_default_tokenizer_walks_no_hugging_face_machinery():
    """The default job's tokenizer (cl100k_base cut to 8192, through tiktoken) encodes, grows and
    exports without importing `tokenizers`, transformers or hf_tokenizer.py: only a model's
    tokenizer file takes that path."""
    import subprocess
    import sys
    code = ("import sys, tokenizer; from formats import hf; "
            "e = tokenizer.get_tokenizer('cl100k_base', 8192, ['<|x|>']); "
            "tokenizer.encode(e, 'a <|x|>'); hf.hf_tokenizer(e, 8); print(sorted({'tokenizers', "
            "'formats.hf_tokenizer', 'transformers'} & set(sys.modules)))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout + p.stderr[-2000:]


def test_extra_tokens_that_start_one_another(llama3_dir):
    """`tokenizers` matches the longest added token (the twin steps aside), tiktoken tries its
    special tokens in no fixed order, so there such a list is refused in one line."""
    path = os.path.join(llama3_dir, "tokenizer.json")
    big = tokenizer_py.get_tokenizer(path, 0, ["return", "return None"])
    assert (big.twin is None and tokenizer_py.encode(big, "return None")[-1]
            == big.encode_single_token("return None"))
    with pytest.raises(UserError,
                       match="extra token 'return None' starts with the token 'return'"):
        tokenizer_py.get_tokenizer("cl100k_base", 512, ["return", "return None"])


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama3"))
    hf_families.write_tokenizer("llama3", path)
    return path


def test_a_changed_tokenizer_config_is_a_changed_tokenizer(tmp_path, corpus):
    """Data prepared with a tokenizer.json records its hash and its tokenizer_config.json's
    (legacy and add_bos_token change Llama 2's ids): either file changed since is refused."""
    hf_families.write_tokenizer("llama2", str(tmp_path / "tok"))
    path = str(tmp_path / "tok" / "tokenizer.json")
    meta = prepare.prepare(corpus, str(tmp_path / "data"), path, 0, 0.2, verbose=False)
    enc = tokenizer_py.tokenizer_from_meta(meta)
    assert (enc.bos_token == 1
            and np.fromfile(tmp_path / "data" / "train.bin", dtype=np.uint16)[0] == 1)
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({**config, "legacy": True}))
    with pytest.raises(UserError, match="is gone or changed since"):
        tokenizer_py.tokenizer_from_meta(meta)


def test_tiktoken_rank_file_is_read(tmp_path):
    """Meta's Llama 3 format: base64 token and rank a line; the specials follow the ranks."""
    base = tokenizer_py.get_tokenizer("cl100k_base", 2048)
    path = tmp_path / "tokenizer.model"
    path.write_bytes(
        b"".join(base64.b64encode(t) + b" %d\n" % r for t, r in base._mergeable_ranks.items()))
    enc = hf_tokenizer.load(str(path))
    assert enc.n_vocab == 2047 + 256 and enc.bos_token == 2047 and enc.eot_token == 2048
    for line in varied_lines()[:100]:
        # the same pattern and ranks here
        assert enc.encode_ordinary(line) == [i for i in base.encode_ordinary(line)]


def hf_dir_with(tmp_path, tokenizer_json=None, vocab_size=512, model_file=None):
    from conftest import HF
    from transformers import LlamaConfig, LlamaForCausalLM
    path = tmp_path / "m"
    LlamaForCausalLM(LlamaConfig(**{**HF, "vocab_size": vocab_size})).save_pretrained(path)
    if tokenizer_json is not None:
        (path / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    if model_file is not None:
        (path / "tokenizer.model").write_bytes(model_file)
    return str(path)


def spec_of_dir(path):
    import origin
    from parallel import setup
    return tokenizer_py.model_spec(origin.start_from(path, setup("cpu")), "cl100k_base", 512)


@pytest.mark.parametrize("tj, model_file, match", [
    ({"model": {"type": "WordPiece", "vocab": {}}}, None, "is a WordPiece tokenizer"),
    ({"model": {"type": "Unigram", "vocab": []}}, None, "is a unigram tokenizer"),
    (None, b"\n\x0b\n\x05<unk>\x15\x00\x00\x00\x00", "is a SentencePiece model"),
])
def test_tokenizers_we_do_not_read_are_refused_by_kind(tmp_path, tj, model_file, match):
    with pytest.raises(UserError, match=match):
        spec_of_dir(hf_dir_with(tmp_path, tj, 512, model_file))


def test_vocab_that_disagrees_with_the_weights_is_refused(tmp_path, hf_bpe):
    path = hf_dir_with(tmp_path, vocab_size=32000)
    p = run_train(["sample_tokens=0", "max_iters=1", "vocab_size=512", f"init_from={path}",
                   f"out_dir={tmp_path / 'run'}"], cwd=tmp_path, check=False, fork=True)
    # one line, and nothing left behind
    assert p.returncode == 1 and p.stderr.count("\n") == 1, p.stderr[-2000:]
    assert ("has no tokenizer.json or tokenizer.model, and its vocab_size 32,000 is not the 512 "
            "ids") in p.stderr
    assert not os.path.exists(tmp_path / "run")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.link(os.path.join(hf_bpe[0], name), os.path.join(path, name))
    with pytest.raises(UserError, match="has 701 ids but the weights in .* have 32,000 rows"):
        spec_of_dir(path)
    # a few rows past the ids load (an embedding padded to a round size, as Qwen2's);
    # an id without a row does not
    for rows in (704, 700):
        path = hf_dir_with(tmp_path / str(rows), vocab_size=rows)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            os.link(os.path.join(hf_bpe[0], name), os.path.join(path, name))
        if rows > 701:
            assert spec_of_dir(path)["vocab_size"] == 701
        else:
            with pytest.raises(UserError, match="has 701 ids but the weights in .* have 700 rows"):
                spec_of_dir(path)


def test_data_for_a_model_keeps_its_ids(tmp_path, corpus):
    """A dataset prepared for a model extends the model's tokenizer: its added tokens keep
    their ids, the chat tokens come after them; data with other ids is refused."""
    words = ["sublicense", "licensee"]
    spec = tokenizer_py.spec_of({"tokenizer": "cl100k_base", "vocab_size": 514,
                                 "base_vocab_size": 512, "extra_tokens": words})
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"prompt": f"q{i} sublicense", "response": f"a{i}"}) + "\n"
                            for i in range(30)))
    meta = prepare.prepare(str(chat), str(tmp_path / "chat"), "cl100k_base", 512, 0.2,
                           verbose=False, model_tokens=words)
    assert meta["extra_tokens"] == words + tokenizer_py.CHAT_TOKENS and meta["vocab_size"] == 518
    tokenizer_py.check_model_tokenizer(meta, "data/chat", spec, "the model")
    alone = prepare.prepare(str(chat), str(tmp_path / "alone"), "cl100k_base", 512, 0.2,
                            verbose=False)
    with pytest.raises(
            UserError,
            match=r"data/alone was tokenized as cl100k_base/512 \+ \['<\|system\|>'.*re-prepare|"
                                        r"prepare it for the model"):
        tokenizer_py.check_model_tokenizer(alone, "data/alone", spec, "the model")
    # a model's tokenizer file is known by its bytes: the same file elsewhere (a copied base) is
    # the same tokenizer, another file under the same path is not
    file = tokenizer_py.spec_of(
        {"tokenizer": "/a/base/tokenizer.json", "vocab_size": 512, "tokenizer_sha256": "ab" * 32})
    tokenizer_py.check_model_tokenizer({**file, "tokenizer": "/copy/of/base/tokenizer.json"},
                                       "data/d", file, "the model")
    # only the bytes differ: the line names the two hashes, not the same description twice
    with pytest.raises(
            UserError,
            match=r"tokenizer.json/512 \+ \[\] \(sha256 cdcdcdcdcdcd\), but the model uses "
            r"tokenizer.json/512 \+ \[\] \(sha256 abababababab\): its ids mean other"):
        tokenizer_py.check_model_tokenizer({**file, "tokenizer_sha256": "cd" * 32}, "data/d", file,
                                           "the model")


def doc_commands(path, heading, script="train.py"):
    """The arguments of each `python train.py ...` (or `torchrun ... train.py`) command of the
    first bash block after `heading` in a doc (`script`: sample.py's instead)."""
    import shlex
    text = open(os.path.join(ROOT, path), encoding="utf-8").read()
    block = (text[text.index(heading):].split("```bash\n", 1)[1].split("```", 1)[0]
             .replace("\\\n", " "))
    commands = [shlex.split(line, comments=True) for line in block.splitlines()]
    return [c[c.index(script) + 1:] for c in commands
            if c[:1] in (["python"], ["torchrun"]) and script in c]


def doc_python(path):
    """The Python blocks of a doc, in order."""
    text = open(os.path.join(ROOT, path), encoding="utf-8").read()
    return [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]


def test_the_docs_workflow_base_cpt_sft_lora_export(hf_bpe, tmp_path, monkeypatch):
    """docs/finetuning.md's workflow as written (tiny model keys and max_iters=2 appended): a
    Hugging Face base with its own BPE tokenizer, CPT with extra tokens, SFT on chat data from
    it, LoRA on that, exports loaded by transformers and peft. A string keeps its id through
    every step, and each export's tokenizer is exactly the model's vocabulary."""
    import shutil

    from conftest import RUN, write_corpus
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    steps = doc_commands("docs/finetuning.md", "## The workflow, end to end")
    assert len(steps) == 4 and steps == doc_commands("README.md", "## Fine-tuning in brief")
    shutil.copytree(hf_bpe[0], tmp_path / "runs" / "base")
    shutil.copytree(os.path.join(ROOT, "config"), tmp_path / "config")  # (step 4's recipe)
    write_corpus(str(tmp_path / "papers"))
    (tmp_path / "domain_words.txt").write_text("return None\nself.assert\n")
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(
        {"messages": [{"role": "user", "content": f"What is {i} times 2? return None"},
                      {"role": "assistant", "content": f"It is {2 * i}."}]})
                                                 + "\n" for i in range(60)))
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(  # TRL's explicit-prompt format
        {"prompt": [{"role": "user", "content": f"What is {i} times 2?"}],
         "chosen": [{"role": "assistant", "content": f"It is {2 * i}."}],
         "rejected": [{"role": "assistant", "content": f"It is {2 * i + 1}."}]})
                                                  + "\n" for i in range(40)))
    shrink = [a for a in RUN if not a.startswith("vocab_size=")] + [
        "max_iters=2", "val_fraction=0.2", "sample_tokens=8"]
    for args in steps:
        keys = {a.split("=")[0] for a in args}
        run_train([*args, *(a for a in shrink if a.split("=")[0] not in keys)], cwd=tmp_path,
                  fork=True)
    # one id per string: the words got 701, 702 in step 1 and keep them; the chat tokens follow
    base = len(hf_bpe[1])
    words, chat = ["return None", "self.assert"], tokenizer_py.CHAT_TOKENS
    specs = [json.load(open(tmp_path / "runs" / run / "ckpt" / "iter_0000002"
                            / "meta.json"))["tokenizer_spec"]
             for run in ("cpt", "sft", "lora", "dpo")]
    assert [s["extra_tokens"] for s in specs] == [words, words + chat, words + chat, words + chat]
    assert all(s["tokenizer"] == str(tmp_path / "runs" / "base" / "tokenizer.json")
               and s["base_vocab_size"] == base for s in specs)
    enc = tokenizer_py.tokenizer_from_meta(specs[-1])
    assert [enc.encode_single_token(t) for t in words + chat] == list(range(base, base + 6))
    lines = varied_lines() + ["x = f() ; return None", "<|user|>hi<|end|><|assistant|>"]
    for export in ("sft_hf", "lora_merged", "dpo_hf"):
        tok = AutoTokenizer.from_pretrained(tmp_path / "runs" / export)
        assert (json.load(open(tmp_path / "runs" / export / "config.json"))["vocab_size"]
                == len(tok) == base + 6)
        assert all(tok(line, split_special_tokens=True).input_ids
                   == [enc.bos_token, *tokenizer_py.encode(enc, line)] for line in lines)
    # the DPO run's export: transformers gives the checkpoint's logits
    import sample
    ours, _ = sample.load_model(str(tmp_path / "runs" / "dpo" / "ckpt" / "iter_0000002"))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "runs" / "dpo_hf").eval()
    probe = torch.tensor([[enc.bos_token, *tokenizer_py.encode(enc, lines[-1])]])
    with torch.no_grad():
        torch.testing.assert_close(theirs(probe).logits, ours.eval()(probe)[0], rtol=1e-4,
                                   atol=1e-4)
    # transformers generates from the merged export,
    # and peft's adapter on the SFT export is the same model
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 3 times 2?"}],
                                  add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "runs" / "lora_merged").eval()
    adapted = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tmp_path / "runs" / "sft_hf"),
        tmp_path / "runs" / "lora_adapter").eval()
    out = merged.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 8 and isinstance(tok.decode(out[0]), str)
    # the adapter names its base (the SFT run's export), so PEFT's Auto class finds it alone
    from peft import AutoPeftModelForCausalLM
    auto = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "runs" / "lora_adapter").eval()
    assert auto.peft_config["default"].base_model_name_or_path == str(tmp_path / "runs" / "sft_hf")
    with torch.no_grad():
        torch.testing.assert_close(adapted(out).logits, merged(out).logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(auto(out).logits, merged(out).logits, rtol=1e-4, atol=1e-4)
    # the page's export and LoRA-on-the-base commands (that one in one process), then its Python
    # blocks as written, in the directory the commands made
    run_train(doc_commands("docs/finetuning.md", "### Exporting to Hugging Face", "sample.py")[0],
              cwd=tmp_path, script="sample.py")
    lora_base = doc_commands("docs/finetuning.md", "## LoRA")[0]
    run_train([*lora_base,
               *(a for a in shrink
                 if a.split("=")[0] not in {a.split("=")[0] for a in lora_base})],
              cwd=tmp_path, fork=True)
    adapter = json.load(open(tmp_path / "runs" / "lora_base_adapter" / "adapter_config.json"))
    # a Hugging Face base: itself
    assert adapter["base_model_name_or_path"] == str(tmp_path / "runs" / "base")
    monkeypatch.chdir(tmp_path)
    blocks = doc_python("docs/finetuning.md")
    assert len(blocks) == 3
    for block in blocks:
        exec(compile(block, "docs/finetuning.md", "exec"), {})


@pytest.mark.parametrize("family", ["cl100k_base", *hf_families.FAMILIES])
def test_a_long_document_encoded_in_pieces_gives_the_whole_documents_ids(
        tmp_path, monkeypatch, family):
    """encode_long (prepare.py's way with a document past PIECE_CHARS, here 2,000 characters)
    gives the ids of the whole text encoded at once: tiktoken with added tokens written in the
    text, and each family's tokenizer.json (a BOS-adding post-processor, SentencePiece's prefix
    and byte fallback, NFC); the regex tokenizers by pieces (their encoder never sees more than
    about PIECE_CHARS), the others whole once their cuts fail the check."""
    if family == "cl100k_base":
        enc = tokenizer_py.get_tokenizer(family, 0, ["<|tool|>", "<|begin|>"])
    else:
        hf_families.write_tokenizer(family, str(tmp_path))
        enc = tokenizer_py.get_tokenizer(str(tmp_path / "tokenizer.json"))
    text = "\n".join(varied_lines() * 3)
    assert len(text) > 20_000
    seen, real = [], tokenizer_py.encode
    monkeypatch.setattr(tokenizer_py, "encode", lambda e, t: seen.append(len(t)) or real(e, t))
    monkeypatch.setattr(tokenizer_py, "PIECE_CHARS", 2000)
    got = tokenizer_py.encode_long(enc, text)
    assert got.dtype == np.uint32 and got.tolist() == real(enc, text), family
    pieces = family in ("cl100k_base", "llama3", "qwen2", "qwen3")
    assert (max(seen) < 4000) == pieces, (family, max(seen))


def test_prepare_encodes_a_long_document_in_pieces_to_the_same_tokens(tmp_path, monkeypatch):
    """prepare.py with a document of 100,000 characters among short ones: the train and val
    files of PIECE_CHARS=2,000 (the encoder never given more than about that) equal the
    default's, byte for byte."""
    _, files = corpora.stdlib_files()
    src = tmp_path / "src"
    src.mkdir()
    long = "".join(open(f, encoding="utf-8", errors="replace").read() for f in files[:40])
    (src / "long.txt").write_text(long[:100_000], encoding="utf-8")
    for i in range(12):
        (src / f"short{i}.txt").write_text(f"document {i}\n" * (i + 3), encoding="utf-8")
    prepare.prepare(str(src), str(tmp_path / "whole"), "cl100k_base", 4096, 0.2, verbose=False)
    seen, real = [], tokenizer_py._encode_batch
    monkeypatch.setattr(tokenizer_py, "_encode_batch", lambda e, texts, *a, **k: seen.extend(
        map(len, texts)) or real(e, texts, *a, **k))
    monkeypatch.setattr(tokenizer_py, "encode", lambda e, t: seen.append(len(t)) or (
        e.encode_ordinary(t)))
    monkeypatch.setattr(tokenizer_py, "PIECE_CHARS", 2000)
    prepare.prepare(str(src), str(tmp_path / "pieces"), "cl100k_base", 4096, 0.2, verbose=False)
    assert 0 < max(seen) < 4000, max(seen)
    for name in ("train.bin", "val.bin"):
        pieces, whole = (tmp_path / "pieces" / name), (tmp_path / "whole" / name)
        assert pieces.read_bytes() == whole.read_bytes(), name
