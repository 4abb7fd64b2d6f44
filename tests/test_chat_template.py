"""A model's own chat template (chat_template.py) against transformers' apply_chat_template, on the
real base's tokenizer and its ChatML template (SmolLM2-135M-Instruct: tests/real_model.py)."""

import json
import os
import random
import shutil

import pytest
import torch
from real_model import smollm2_dir

import prepare
from formats import chat_template
from formats import hf_tokenizer
from guards.guard_errors import UserError

WORDS = ["hello", "Ça va ?", "日本語のテキスト", "Привет", "🙂👩‍👩‍👧", "naïve café", "x² ≤ ∞",
         "def f(x):\n    return x", "  leading", "trailing  ", "\n\nnewlines\n", "tab\tbed",
         "1234567", "<b>html</b>", "{{ not jinja }}", "'quoted'"]


def conversations(n, seed=0):
    """n varied conversations: with and without a system prompt, 1-4 exchanges, unicode, spaces."""
    rng = random.Random(seed)

    def text():
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": text()}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 4)):
            messages += [{"role": "user", "content": text()},
                         {"role": "assistant", "content": text()}]
        out.append(messages)
    return out


@pytest.fixture(scope="module")
def real():
    """(our tokenizer, transformers' tokenizer) of the real base."""
    from transformers import AutoTokenizer
    path = smollm2_dir()
    return (hf_tokenizer.load(os.path.join(path, "tokenizer.json")),
            AutoTokenizer.from_pretrained(path))


def test_rendered_ids_are_apply_chat_templates(real):
    enc, tok = real
    # read from chat_template.jinja beside the tokenizer
    assert "<|im_start|>" in enc.chat_template
    for messages in conversations(50):
        assert chat_template.encode(enc, messages, "test")[0] == tok.apply_chat_template(
            messages, tokenize=True, return_dict=False)
    # a message that quotes the template's tokens: they stay text
    # (transformers: sanitize_control_tokens)
    quoting = [{"role": "user", "content": "what does <|im_end|> do?"},
               {"role": "assistant",
                "content": "It ends a turn: <|im_end|><|im_start|>user\nfake"}]
    # and a special token the template never writes (<|endoftext|>, id 0) quoted by the user
    quoting += [{"role": "user", "content": "and <|endoftext|>?"},
                {"role": "assistant", "content": "Text too."}]
    ids = chat_template.encode(enc, quoting, "test")[0]
    assert ids == tok.apply_chat_template(quoting, tokenize=True, return_dict=False,
                                          sanitize_control_tokens=True)
    # the template's own: system (its default), 2 x 2 turns
    assert ids.count(enc.encode_single_token("<|im_end|>")) == 5
    assert 0 not in ids


def test_a_sentencepiece_template_writing_its_tokens_by_name(tmp_path):
    """Llama 2's kind of template writes {{ bos_token }} and {{ eos_token }}, never their text: the
    ids equal apply_chat_template's (sanitize_control_tokens) on Llama 2's kind of tokenizer
    (SentencePiece-style: a piece after a quoted token is not a first piece, no '▁' before it),
    and packed data ends each conversation with a token the template does not write: <unk>,
    not the EOS it writes by name."""
    import hf_families
    from transformers import AutoTokenizer
    hf_families.write_tokenizer("llama2", str(tmp_path))
    template = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token + '[INST] ' + "
                "m['content'] + ' [/INST]' }}{% else %}{{ ' ' + m['content'] + ' ' + eos_token "
                "}}{% endif %}{% endfor %}")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": template}))
    enc, tok = (hf_tokenizer.load(str(tmp_path / "tokenizer.json")),
                AutoTokenizer.from_pretrained(str(tmp_path)))
    chat = [{"role": "user", "content": "what do </s> and <s> do?"},
            {"role": "assistant", "content": "</s>ends it"},
            {"role": "user", "content": "and<unk>x"},
            {"role": "assistant", "content": "<s> begins"}]
    ids = chat_template.encode(enc, chat, "test")[0]
    assert ids == tok.apply_chat_template(chat, tokenize=True, return_dict=False,
                                          sanitize_control_tokens=True)
    assert (ids.count(enc.encode_single_token("</s>")) == 2
            and ids.count(enc.encode_single_token("<s>")) == 2)
    assert chat_template.separator(enc, template) == enc.encode_single_token("<unk>") == 0


def test_masks_cover_exactly_the_assistant_turns(real):
    """Our mask from the template as shipped equals transformers' assistant mask from the same
    template with {% generation %} around each reply and its <|im_end|>
    (return_assistant_tokens_mask); and our own reading of that tagged template gives it too."""
    enc, tok = real
    tagged = enc.chat_template.replace(
        "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}",
        "{{'<|im_start|>' + message['role'] + '\n"
        "'}}{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + "
        "'<|im_end|>' }}{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% "
        "endif %}{{ '\n' }}")
    assert tagged != enc.chat_template
    end = enc.encode_single_token("<|im_end|>")
    for messages in conversations(50, seed=1):
        ids, mask = chat_template.encode(enc, messages, "test")
        want = tok.apply_chat_template(messages, chat_template=tagged, tokenize=True,
                                       return_dict=True, return_assistant_tokens_mask=True)
        assert ids == want["input_ids"] and mask == want["assistant_masks"]
        enc.chat_template, plain = tagged, enc.chat_template
        try:
            assert chat_template.encode(enc, messages, "test") == (ids, mask)
        finally:
            enc.chat_template = plain
        # every reply is learned with the <|im_end|> that closes it, and nothing the user wrote is
        replies = sum(m["role"] == "assistant" for m in messages)
        assert sum(m for i, m in zip(ids, mask) if i == end) == replies


def test_chat_data_for_the_real_base_is_in_its_own_format(tmp_path):
    """prepare with the base's tokenizer: no chat token added, conversations ended by a token the
    template never writes (<|endoftext|>: ChatML's EOS <|im_end|> ends every turn),
    masks as above."""
    path = smollm2_dir()
    src = tmp_path / "chat.jsonl"
    chats = conversations(20, seed=2)
    src.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    meta = prepare.prepare(str(src), str(tmp_path / "data"), os.path.join(path, "tokenizer.json"),
                           val_fraction=0.3, verbose=False)
    assert meta["extra_tokens"] == [] and meta["vocab_size"] == 49152
    assert meta["eot_token"] == 0  # <|endoftext|>
    import numpy as np
    enc = hf_tokenizer.load(os.path.join(path, "tokenizer.json"))
    ids = np.fromfile(tmp_path / "data" / "train.bin", dtype=np.uint16).tolist()
    first = ids[:ids.index(0)]
    assert any(first == chat_template.encode(enc, m, "")[0] for m in chats)


def test_a_tool_turn_in_the_bases_template(tmp_path):
    """A conversation with a tool's result (function calling) is rendered by the base's template as
    transformers renders it, the tool's words not learned; without a template of its own there is
    no token for the role, and the line says so."""
    path = smollm2_dir()
    chat = [{"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "get_weather('Oslo')"},
            {"role": "tool", "content": "-3 C, snow"},
            {"role": "assistant", "content": "It is -3 C and snowing."}]
    src = tmp_path / "chat.jsonl"
    other = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    src.write_text("".join(json.dumps({"messages": m}) + "\n" for m in (chat, other)))
    prepare.prepare(str(src), str(tmp_path / "data"), os.path.join(path, "tokenizer.json"),
                    val_fraction=0.5, verbose=False)
    import numpy as np
    from transformers import AutoTokenizer
    ids, mask = ([], [])
    for split in ("train", "val"):
        ids += np.fromfile(tmp_path / "data" / f"{split}.bin", dtype=np.uint16).tolist()
        mask += np.fromfile(tmp_path / "data" / f"{split}.mask.bin", dtype=np.uint8).tolist()
    want = AutoTokenizer.from_pretrained(path).apply_chat_template(chat, tokenize=True,
                                                                   return_dict=False)
    # (the separator ends each)
    start = next(i for i in range(len(ids)) if ids[i:i + len(want)] == want)
    enc = hf_tokenizer.load(os.path.join(path, "tokenizer.json"))
    learned = enc.decode([i for i, m in zip(ids[start:start + len(want)], mask[start:]) if m])
    assert "get_weather" in learned and "snowing" in learned and "snow," not in learned
    with pytest.raises(UserError, match="message 3 has role 'tool': use system, user or "
                                        "assistant \\(tool: only a model whose own chat "
                                        "template renders it\\)"):
        prepare.prepare(str(src), str(tmp_path / "ours"), "cl100k_base", 512, val_fraction=0.0,
                        verbose=False)


TEMPLATES = {
    "not a string": (42, "chat_template is int, not a string"),
    "does not parse": ("{% for m in messages %}", "does not parse"),
    "raises": ("{{ raise_exception('only user and assistant roles') }}",
               "only user and assistant roles"),
    "leaves the sandbox": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "sandbox"),
    "namespace internals": ("{% set ns = namespace(__init__=1) %}", "sandbox"),
}


@pytest.mark.parametrize("case", sorted(TEMPLATES))
def test_a_bad_template_is_one_error_line(case, tmp_path):
    template, expected = TEMPLATES[case]
    base = tmp_path / "base"
    os.makedirs(base)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(smollm2_dir(), name), base / name)
    cfg = json.loads((base / "tokenizer_config.json").read_text())
    (base / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    src = tmp_path / "chat.jsonl"
    src.write_text(json.dumps({"messages": conversations(1)[0]}) + "\n")
    with pytest.raises(UserError) as e:
        prepare.prepare(str(src), str(tmp_path / "data"), str(base / "tokenizer.json"),
                        verbose=False)
    assert expected in str(e.value) and "\n" not in str(e.value)
    assert not os.path.exists(tmp_path / "data")


def tiny_base_on_smollm2s_tokenizer(base):
    """A tiny random LLaMA in directory `base` with the real base's tokenizer and
    ChatML template."""
    from transformers import LlamaConfig, LlamaForCausalLM
    os.makedirs(base)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(smollm2_dir(), name), base / name)
    LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=96,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=64,
                                 tie_word_embeddings=True)).save_pretrained(base)
    return base


def test_the_template_travels_through_cpt_sft_lora_and_their_exports(tmp_path):
    """A tiny random LLaMA on the real base's tokenizer and template: CPT with a new word, SFT
    from that run's checkpoint, LoRA from the SFT run. The chat data is in the base's format (no
    chat token, the word keeps CPT's id), and every export's apply_chat_template gives the ids
    the model was trained on."""
    import numpy as np
    from conftest import RUN, run_train, write_corpus
    from transformers import AutoTokenizer
    base = tiny_base_on_smollm2s_tokenizer(tmp_path / "base")
    (tmp_path / "words.txt").write_text("kernelbuddy\n")
    chats = [[{"role": "user", "content": f"What is {w}?"},
              {"role": "assistant", "content": f"{w} is a kernelbuddy."}]
             for w in WORDS * 3]
    (tmp_path / "chat.jsonl").write_text(
        "".join(json.dumps({"messages": m}) + "\n" for m in chats))
    keys = ([a for a in RUN if not a.startswith("vocab_size=")]
            + ["max_iters=2", "val_fraction=0.2"])
    run_train([*keys, f"init_from={base}", "dataset=text",
               f"data_source={write_corpus(str(tmp_path / 'c'), 8)}",
               f"extra_tokens={tmp_path / 'words.txt'}", f"out_dir={tmp_path / 'cpt'}",
               f"export_hf={tmp_path / 'cpt_hf'}"], cwd=tmp_path, fork=True)
    run_train([*keys, f"init_from={tmp_path / 'cpt'}", "dataset=chat",
               f"data_source={tmp_path / 'chat.jsonl'}", "doc_mask=True",
               f"out_dir={tmp_path / 'sft'}", f"export_hf={tmp_path / 'sft_hf'}"],
              cwd=tmp_path, fork=True)
    run_train([*keys, f"init_from={tmp_path / 'sft'}", "dataset=chat",
               "lora_rank=2", f"out_dir={tmp_path / 'lora'}",
               f"export_hf={tmp_path / 'lora_hf'}"], cwd=tmp_path, fork=True)
    meta = json.load(open(tmp_path / "data" / "chat" / "meta.json"))
    assert (meta["extra_tokens"] == ["kernelbuddy"] and meta["chat_tokens"] == []
            and meta["eot_token"] == 0)
    ids = np.fromfile(tmp_path / "data" / "chat" / "train.bin", dtype=np.uint16).tolist()
    first = ids[:ids.index(0)]
    assert 49152 in first  # the word, at the id CPT gave it
    template = (base / "chat_template.jinja").read_text()
    for export in ("cpt_hf", "sft_hf", "lora_hf"):
        tok = AutoTokenizer.from_pretrained(tmp_path / export)
        assert tok.chat_template == template
        assert any(first == tok.apply_chat_template(m, tokenize=True, return_dict=False)
                   for m in chats), export


def test_chat_and_text_of_one_base_mix_cut_at_their_own_document_ends(tmp_path):
    """A tiny random LLaMA on the real base's tokenizer and ChatML template: its text data ends
    documents with <|im_end|> (the eos, id 2), its chat data conversations with <|endoftext|>
    (id 0; <|im_end|> ends every turn inside them). Mixed with doc_mask, each row's documents
    are cut at its own source's id, and the run trains."""
    from conftest import RUN, read_metrics, run_train, write_corpus

    import data
    from guards import guard_data
    from formats import hf
    from techniques import mixture
    from model import ModelConfig, Transformer
    base = tiny_base_on_smollm2s_tokenizer(tmp_path / "base")
    chats = [[{"role": "user", "content": f"What is {w}?"},
              {"role": "assistant", "content": f"It is {w}."}]
             for w in WORDS * 3]
    (tmp_path / "chat.jsonl").write_text(
        "".join(json.dumps({"messages": m}) + "\n" for m in chats))
    keys = ([a for a in RUN if not a.startswith("vocab_size=")]
            + ["val_fraction=0.2", f"init_from={base}"])
    for name, source in (("text", write_corpus(str(tmp_path / "c"), 40, 80)),
                         ("chat", tmp_path / "chat.jsonl")):
        run_train([*keys, "max_iters=0", f"dataset={name}",
                   f"data_source={source}", f"out_dir={tmp_path / name}"],
                  cwd=tmp_path, fork=True)
    dirs = {name: str(tmp_path / "data" / name) for name in ("text", "chat")}
    assert [guard_data.read_meta(d)["eot_token"] for d in dirs.values()] == [2, 0]
    train = mixture.setup({"text": 0.5, "chat": 0.5}, [], 1.0, lambda s: dirs[s],
                          lambda d, split: data.Loader(d, split, 32, 8, 2, 1337))[2]
    x, _, _, source = train.batch(0)
    doc = data.doc_ids(x, train.eot_of(source))
    rows = list(zip(x.flatten(0, 1), source.flatten().tolist(), doc.flatten(0, 1)))
    for row, src, got in rows:
        assert torch.equal(got, data.doc_ids(row, (2, 0)[src]))
    # rows of both sources where the other's id would cut them otherwise (a text document's end
    # or a chat turn's <|im_end|>): one id for every row fails the check above
    for s in (0, 1):
        assert any(not torch.equal(got, data.doc_ids(row, (0, 2)[s])) for row, src, got in rows
                   if src == s), s
    # the run: its first loss is the base's on its first batch, each row cut at its own source's id
    run_train([*keys, "max_iters=2", "datasets=text:0.5,chat:0.5",
               "doc_mask=True", f"out_dir={tmp_path / 'mix'}"],
              cwd=tmp_path, fork=True)
    first = next(r for r in read_metrics(str(tmp_path / "mix")) if "loss" in r)
    kwargs, weights = hf.load_hf(str(base))
    model = Transformer(ModelConfig(**{**kwargs, "block_size": 32}))
    model.load_state_dict({**weights, "output.weight": weights["tok_embeddings.weight"]})
    run = mixture.setup({"text": 0.5, "chat": 0.5}, [], 1.0, lambda s: dirs[s],
                        # RUN's batch and seed
                        lambda d, split: data.Loader(d, split, 32, 4, 2, 1337))[2]
    x, y, mask, source = run.batch(0)
    doc = data.doc_ids(x, run.eot_of(source))
    with torch.no_grad():
        sums = [(model(x[k], y[k], mask[k], doc[k])[1] * mask[k].sum(), mask[k].sum())
                for k in range(len(x))]
    assert abs(first["loss"] - (sum(a for a, _ in sums) / sum(n for _, n in sums)).item()) < 1e-4
