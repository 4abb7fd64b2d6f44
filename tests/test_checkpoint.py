"""The Hugging Face formats (hf.py, hf_safetensors.py): LLaMA-family import/export against the
real peer (transformers), and our safetensors reading and writing against the reference."""

import json
import os

import pytest
# a dependency of transformers: the reference implementation of the format
import safetensors.torch
import tiktoken
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
)

from formats import corpora
import tokenizer as tokenizer_py
from model import ModelConfig, Transformer
from formats.hf import hf_config_to_ours, hf_tokenizer, load_hf, save_hf
from formats.hf_safetensors import read_safetensors, write_safetensors
from guards.guard_errors import UserError

HF = dict(vocab_size=512, hidden_size=64, intermediate_size=160,
          num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0)
CASES = {"gqa": {}, "tied": dict(tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5)}


def hf_llama(**kw):
    """A tiny random LlamaForCausalLM. Norm gains are randomised too (HF starts them at 1),
    so that mixing up the two norms of a layer shows in the logits."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**HF, **kw})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
    return model


def ids(B=2, T=24, seed=1):
    return torch.randint(0, 512, (B, T), generator=torch.Generator().manual_seed(seed))


def ours_from(path):
    cfg, sd = load_hf(path)
    model = Transformer(ModelConfig(**cfg, block_size=64)).eval()
    # tied: output.weight is the embedding
    model.load_state_dict(sd, strict=not cfg["tie_embeddings"])
    return model


@pytest.mark.parametrize("case", CASES)
def test_hf_checkpoint_gives_the_same_logits(tmp_path, case):
    hf = hf_llama(**CASES[case])
    hf.save_pretrained(tmp_path)
    cfg, sd = load_hf(tmp_path)
    assert (cfg["n_kv_head"] == 2 and cfg["ffn_dim"] == 160
            and cfg["tie_embeddings"] == (case == "tied"))
    assert cfg["rope_theta"] == CASES[case].get("rope_theta", 10000.0)
    assert ("output.weight" in sd) == (case != "tied")
    model = ours_from(tmp_path)
    if case == "tied":
        assert model.output.weight is model.tok_embeddings.weight
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(model(x)[0], hf(x).logits)
    if case == "tied":  # a tied head saved anyway (some exporters do) is the embedding: skipped
        weights = tmp_path / "model.safetensors"
        write_safetensors(weights,
                          {**read_safetensors(weights), "lm_head.weight": torch.zeros(512, 64)})
        assert "output.weight" not in load_hf(tmp_path)[1]


def test_sharded_checkpoint_loads_through_the_index(tmp_path):
    hf = hf_llama()
    hf.save_pretrained(tmp_path / "one")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    shards = [f for f in os.listdir(tmp_path / "sharded") if f.endswith(".safetensors")]
    assert len(shards) > 1 and "model.safetensors" not in shards
    _, one = load_hf(tmp_path / "one")
    _, sharded = load_hf(tmp_path / "sharded")
    assert sharded.keys() == one.keys()
    for name in one:
        torch.testing.assert_close(sharded[name], one[name], rtol=0, atol=0, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(ours_from(tmp_path / "sharded")(ids())[0], hf(ids()).logits)
    os.remove(tmp_path / "sharded" / shards[0])
    with pytest.raises(UserError, match=f"shard {shards[0]} .* is missing"):
        load_hf(tmp_path / "sharded")


@pytest.mark.parametrize("tied", [False, True])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, tied):
    """The export (sharded when tied: a tiny export_shard_mb) loads in AutoModelForCausalLM with
    our logits, and with AutoTokenizer generates what our model generates."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=300, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
                      rope_theta=20000.0, norm_eps=1e-6, tie_embeddings=tied)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    # <|endoftext|> = 298, <|tool|> = 299
    enc = tokenizer_py.get_tokenizer("cl100k_base", 299, ["<|tool|>"])
    shard_mb = 0.03 if tied else 5000.0  # tied: 77 kB of weights -> 3 shards
    save_hf(str(tmp_path / "hf"), model.state_dict(), cfg, enc, shard_mb)
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # the temp directory is gone
    files = sorted(os.listdir(tmp_path / "hf"))
    if tied:
        index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert (len(shards) >= 2
                and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"), shards
        assert files == sorted(["config.json", "model.safetensors.index.json",
                                "special_tokens_map.json",
                                "tokenizer.json", "tokenizer_config.json", *shards])
        weights = {n: t for s in shards for n, t in read_safetensors(tmp_path / "hf" / s).items()}
        assert sorted(weights) == sorted(index["weight_map"])
        assert index["metadata"]["total_size"] == sum(
            t.numel() * t.element_size() for t in weights.values())
        for s in shards:  # each shard holds at most 0.03 MB unless one tensor alone is larger
            held = [t.numel() * t.element_size()
                    for t in read_safetensors(tmp_path / "hf" / s).values()]
            assert sum(held) <= 30_000 or len(held) == 1, (s, held)
        _, ours = load_hf(tmp_path / "hf")  # our reader reads our index
        torch.testing.assert_close(ours["layers.1.attention.wk.weight"],
                                   model.layers["1"].attention.wk.weight)
    else:
        assert files == ["config.json", "model.safetensors", "special_tokens_map.json",
                         "tokenizer.json", "tokenizer_config.json"]
        weights = read_safetensors(tmp_path / "hf" / "model.safetensors")
    assert ("lm_head.weight" in weights) == (not tied)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.num_key_value_heads == 2 and hf.config.max_position_embeddings == 32
    x = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x)[0])
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok.eos_token_id == 298 and tok.convert_tokens_to_ids("<|tool|>") == 299
    prompt = "def f(x):<|tool|>"
    start = tok(prompt, return_tensors="pt").input_ids
    assert start[0].tolist() == tokenizer_py.encode(enc, prompt) and start[0, -1] == 299
    # min: no stop at <|endoftext|>
    out = hf.generate(start, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert out.tolist() == model.generate(start, 6, temperature=0).tolist()
    assert tok.decode(out[0, :start.shape[1]]) == prompt
    with pytest.raises(UserError, match="already exists"):  # never overwrites
        save_hf(str(tmp_path / "hf"), model.state_dict(), cfg)


def stdlib_lines(n=1000, per_file=20):
    """n non-empty lines of the default corpus, the same ones on every run: the first per_file
    lines of files spread over the sorted standard library (every 2n / per_file-th file, as
    some are short), indentation kept."""
    _, files = corpora.stdlib_files()
    lines = []
    for path in files[::max(1, len(files) // (2 * n // per_file))]:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines += [line for line in f.read().splitlines() if line.strip()][:per_file]
        if len(lines) >= n:
            break
    assert len(lines) >= n, f"only {len(lines)} lines in the standard library"
    return lines[:n]


def test_an_export_keeps_padding_rows_and_refuses_an_id_without_a_row(tmp_path):
    """An embedding padded past its tokenizer's ids (Qwen2's 151,936 rows for 151,665 ids)
    exports every row beside the tokenizer; a tokenizer with more ids than rows is refused."""
    enc = tokenizer_py.get_tokenizer("cl100k_base", 299, ["<|tool|>"])  # 300 ids
    for rows in (304, 299):
        cfg = ModelConfig(vocab_size=rows, block_size=8, n_layer=1, n_head=2, n_kv_head=2,
                          n_embd=16)
        if rows < enc.n_vocab:
            with pytest.raises(ValueError, match="has 300 ids but the model has vocab_size=299"):
                save_hf(str(tmp_path / str(rows)), Transformer(cfg).state_dict(), cfg, enc)
            continue
        save_hf(str(tmp_path / str(rows)), Transformer(cfg).state_dict(), cfg, enc)
        assert json.loads((tmp_path / str(rows) / "config.json").read_text())["vocab_size"] == rows
        assert load_hf(tmp_path / str(rows))[1]["tok_embeddings.weight"].shape == (rows, 16)


@pytest.mark.parametrize("gap", [False, True])
def test_exported_tokenizer_matches_ours(tmp_path, gap):
    """tokenizer.json from the tiktoken ranks gives our ids through AutoTokenizer, and decodes
    back, on 1,000 lines of the default corpus and a few awkward strings; extra tokens in text
    become their ids, <|endoftext|> in text stays text (tokenizer_py.encode's rule); the chat
    template renders tokenizer_py.render_chat's format. gap: ids missing between the ranks and the
    special tokens, as in the whole cl100k_base (no id 100256; that one, checked by hand,
    takes 10 s)."""
    extra = [*tokenizer_py.CHAT_TOKENS, "<|tool|>"]
    enc = tokenizer_py.get_tokenizer("cl100k_base", 8192, extra)  # the default vocabulary
    if gap:  # <|endoftext|> at 8200, not 8191
        special = {"<|endoftext|>": 8200, **{t: 8201 + i for i, t in enumerate(extra)}}
        enc = tiktoken.Encoding("gap", pat_str=enc._pat_str, mergeable_ranks=enc._mergeable_ranks,
                                special_tokens=special)
        enc.extra_tokens = tuple(extra)
    tokenizer, config = hf_tokenizer(enc, 256)
    for name, obj in (("tokenizer.json", tokenizer), ("tokenizer_config.json", config)):
        (tmp_path / name).write_text(json.dumps(obj, ensure_ascii=False), encoding="utf-8")
    tok = AutoTokenizer.from_pretrained(tmp_path)
    odd = ["héllo wörld 你好 🤖  \n\n  x", "MAX = 99999999999 + 1234567", "x\r\n\r\n  y\t",
           "   trailing   ", "it's they'LL I'M", "a <|endoftext|> b", "call <|tool|>x<|end|> done"]
    lines = stdlib_lines() + odd
    got = tok(lines).input_ids
    for line, ids in zip(lines, got):
        assert ids == tokenizer_py.encode(enc, line), line
        assert tok.decode(ids) == line
    assert tok.eos_token_id == enc.eot_token == (8200 if gap else 8191)
    tool, end = enc.encode_single_token("<|tool|>"), enc.encode_single_token("<|end|>")
    assert tool == (8205 if gap else 8196) and tok.convert_tokens_to_ids("<|tool|>") == tool
    assert enc.eot_token not in got[-2] and got[-1].count(tool) == got[-1].count(end) == 1
    # only <|endoftext|> is special
    assert tok.decode([enc.eot_token, *got[0]], skip_special_tokens=True) == lines[0]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello."}]
    assert (tok.apply_chat_template(chat, tokenize=False)
            == tok.decode(tokenizer_py.render_chat(enc, chat)[0]))


@pytest.mark.parametrize("field, value", [("rope_scaling", {"rope_type": "llama3", "factor": 8.0}),
                                          ("rope_parameters",
                                           {"rope_type": "yarn", "rope_theta": 1e4}),
                                          ("attention_bias", True), ("mlp_bias", True),
                                          ("hidden_act", "gelu"), ("head_dim", 0),
                                          ("model_type", "gemma"), ("vocab_size", None),
                                          ("rope_scaling",
                                           {"rope_type": "dynamic", "factor": 2.0}),
                                          ("rope_scaling",
                                           {"rope_type": "linear", "factor": -1.0}),
                                          ("max_position_embeddings", "4k")])
def test_unsupported_hf_configs_are_refused(field, value):
    hf = {**HF, "model_type": "llama", field: value}
    with pytest.raises(UserError, match=f"config.json: {field}="):
        hf_config_to_ours(hf)
    # the implied one is fine
    assert hf_config_to_ours({**HF, "model_type": "llama", "head_dim": 16})["n_embd"] == 64
    # (wider heads)
    assert hf_config_to_ours({**HF, "model_type": "llama", "head_dim": 32})["head_dim"] == 32


def test_broken_hf_directories_are_named(tmp_path):
    with pytest.raises(UserError, match="no config.json"):
        load_hf(tmp_path)
    hf_llama().save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    good = read_safetensors(weights)

    def broken(tensors, match):
        write_safetensors(weights, tensors)
        with pytest.raises(UserError, match=match):
            load_hf(tmp_path)

    broken({**good, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)},
           r"unknown tensor 'model\.layers\.0\.self_attn\.rotary_emb\.inv_freq'")
    broken({**good, "model.layers.2.mlp.up_proj.weight": torch.ones(160, 64)},
           r"unknown tensor 'model\.layers\.2\.")
    broken({k: v for k, v in good.items() if k != "model.layers.1.mlp.up_proj.weight"},
           r"missing tensors model\.layers\.1\.mlp\.up_proj\.weight")
    broken({**good, "model.norm.weight": torch.ones(32)},
           r"'model\.norm\.weight' has shape \(32,\), .* \(64,\)")
    os.remove(weights)
    with pytest.raises(UserError, match="no model.safetensors"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(UserError, match="config.json holds a JSON list, not an object"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(UserError, match="config.json: malformed JSON"):
        load_hf(tmp_path)


# ------------------------------------------------------------------------- safetensors

SAMPLE = {"f32": torch.randn(3, 5), "bf16": torch.randn(4, 2).bfloat16(),
          "f16": torch.randn(7).half(), "f64": torch.randn(2, 2).double(),
          "i64": torch.arange(6).view(2, 3), "i32": torch.arange(3).int(),
          "i16": torch.arange(3).short(), "i8": torch.tensor([-1, 2], dtype=torch.int8),
          "u8": torch.tensor([255, 0], dtype=torch.uint8),
          "bool": torch.tensor([True, False, True]), "scalar": torch.tensor(2.5),
          "empty": torch.zeros(0, 4), "strided": torch.randn(4, 6).t()}


def test_safetensors_round_trip_with_the_reference_implementation(tmp_path):
    ours, theirs = str(tmp_path / "ours.safetensors"), str(tmp_path / "theirs.safetensors")
    write_safetensors(ours, SAMPLE, {"format": "pt"})
    header_len = int.from_bytes(open(ours, "rb").read(8), "little")
    assert header_len % 8 == 0
    loaded = safetensors.torch.load_file(ours)
    safetensors.torch.save_file({k: v.contiguous() for k, v in SAMPLE.items()}, theirs,
                                {"format": "pt"})
    back = read_safetensors(theirs)
    assert loaded.keys() == back.keys() == SAMPLE.keys()
    for name, t in SAMPLE.items():
        for got in (loaded[name], back[name], read_safetensors(ours)[name]):
            assert got.dtype == t.dtype and got.shape == t.shape, name
            torch.testing.assert_close(got, t, rtol=0, atol=0, msg=name)
    raw = open(ours, "rb").read()
    assert json.loads(raw[8:8 + header_len])["__metadata__"] == {"format": "pt"}
    # no temp file left
    assert sorted(os.listdir(tmp_path)) == ["ours.safetensors", "theirs.safetensors"]


def raw_file(path, header, data=b"", header_len=None):
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write((len(raw) if header_len is None else header_len).to_bytes(8, "little")
                + raw + data)
    return path


def huge_header(path):
    with open(path, "wb") as f:
        f.write((100 * 2 ** 20 + 8).to_bytes(8, "little"))
        f.truncate(101 * 2 ** 20)  # sparse: a 101 MB file that takes no disk


@pytest.mark.parametrize("make, match", [
    (lambda p: open(p, "wb").write(b"\x10\x00\x00"), "header too small"),
    (lambda p: raw_file(p, {}, header_len=10 ** 6), "invalid header length"),
    (lambda p: raw_file(p, {}, header_len=2 ** 63), "header too large"),
    (lambda p: huge_header(p), "header too large"),
    (lambda p: raw_file(p, {"w": {"dtype": ["F32"], "shape": [], "data_offsets": [0, 4]}},
                        b"\0" * 4),
     r"invalid JSON in header: invalid type: sequence"),
    (lambda p: open(p, "wb").write((4).to_bytes(8, "little") + b"{x: "), "invalid JSON in header"),
    (lambda p: raw_file(p, [1, 2]), "invalid JSON in header: invalid type: sequence"),
    (lambda p: raw_file(p, {"w": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}},
                        b"\0\0"),
     "tensor 'w' has dtype 'F8_E4M3', which this reader does not support"),
    (lambda p: raw_file(p, {"w": {"dtype": "F32", "shape": [2, -1], "data_offsets": [0, 8]}},
                        b"\0" * 8),
     r"invalid value: integer `-1`"),
    (lambda p: raw_file(p, {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
                        b"\0" * 8),
     r"file not fully covered|invalid offset"),
    (lambda p: raw_file(p, {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, "8"]}},
                        b"\0" * 8),
     r'invalid type: string "8"'),
    (lambda p: raw_file(p, {"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
                        b"\0" * 8),
     r"invalid shape, data type, or offset"),
])
def test_malformed_safetensors_are_one_line_errors(tmp_path, make, match):
    path = str(tmp_path / "bad.safetensors")
    make(path)
    with pytest.raises(UserError, match=match) as err:
        read_safetensors(path)
    assert str(err.value).startswith(path) and "\n" not in str(err.value)
