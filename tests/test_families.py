"""The bases people continue, each built tiny and random by transformers: Llama 3.2 (rotary
scaling llama3, tied embeddings), Llama 2 / TinyLlama (plain), Mistral (a sliding window shorter
than the sequences), Qwen2 (q/k/v biases, its window), Qwen3 (q/k norms, heads wider than
hidden_size / heads, YaRN x4 over 32 positions, tied embeddings). Each one: load -> logits equal
transformers' -> continual pretraining with extra tokens -> SFT -> LoRA -> export (HF + PEFT) ->
transformers and peft load the exports and their logits equal ours."""

import json
import os

import pytest
import torch
from conftest import HF, RUN, assert_same_curve, read_metrics, run_train, torchrun

import checkpoint
from model import ModelConfig, Transformer
from formats import hf
from formats import hf_tokenizer
from guards import guard_ckpt
from guards.guard_errors import UserError
from techniques import lora

SIZE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)
# (transformers config class, its keys). Llama 3.2's scaling with original_max_position_embeddings
# 64, half the positions the load test compares, and wavelengths (2 pi 10000^(2j/8): 6, 63, 628,
# 6283) on every branch of it: kept (< 64 / 4), blended, divided (> 64 / 1). The windows are
# shorter than RUN's block_size=32.
FAMILIES = {
    "llama3.2": ("LlamaConfig", dict(tie_word_embeddings=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "llama2": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "mistral": ("MistralConfig", dict(sliding_window=8)),
    "qwen2": ("Qwen2Config",
              dict(use_sliding_window=True, sliding_window=12, max_window_layers=0)),
    "qwen3": ("Qwen3Config", dict(head_dim=16, tie_word_embeddings=True, rope_parameters={
        "rope_type": "yarn", "factor": 4.0,
        "original_max_position_embeddings": 32, "rope_theta": 1e6})),
}


def write_tokenizer(family, directory):
    """Writes `family`'s own kind of tokenizer into `directory` (tests/hf_families.py: Llama 3's
    split and reserved specials, Llama 2's and Mistral's SentencePiece-style BPE with byte
    fallback, Qwen2's NFC byte-level BPE); returns (its number of ids, its BOS id, its EOS id)."""
    from tokenizers import Tokenizer

    import hf_families
    vocab = hf_families.write_tokenizer("llama3" if family == "llama3.2" else family, directory)
    tok = Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), encoding="utf-8") as f:
        config = json.load(f)
    ids = [tok.token_to_id(config[k]) if config.get(k) else None
           for k in ("bos_token", "eos_token")]
    return vocab, *ids


def make_base(family, path, **more):
    """A random tiny model of `family` saved into `path` by transformers, with its tokenizer;
    biases and Qwen3's q/k norm gains random (transformers starts them at 0 and 1, which would
    test nothing)."""
    import transformers
    config_class, keys = FAMILIES[family]
    vocab, bos, eos = write_tokenizer(family, path)
    # Qwen pads its embedding past the ids
    rows = -(-vocab // 64) * 64 if family.startswith("qwen") else vocab
    config = getattr(transformers, config_class)(vocab_size=rows, bos_token_id=bos,
                                                 eos_token_id=eos, **{**SIZE, **keys, **more})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith((".bias", "q_norm.weight", "k_norm.weight")):
                p.normal_(name.endswith(".weight"), 0.5)
    model.eval().save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=list(FAMILIES))
def base(request, tmp_path_factory):
    """(family, its base's directory)."""
    return request.param, make_base(request.param,
                                    str(tmp_path_factory.mktemp(request.param) / "base"))


def hf_logits(path, x, adapter=None):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path)
    if adapter:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        return model.eval()(x).logits


def ours_from(out_dir):
    """Our model of a run's newest checkpoint (a LoRA run's merged), for inference."""
    model, _ = lora.load_lora_whole(checkpoint.find(out_dir, None))
    lora.merge_lora(model)
    return model.eval()


def test_loads_with_transformers_logits(base):
    """Logits equal transformers' over 128 positions: 16 sliding windows, twice the original
    context of Llama 3.2's scaling, 4 times Qwen3's; with the KV cache,
    generation equals the plain one."""
    family, path = base
    kwargs, weights = hf.load_hf(path)
    cfg = ModelConfig(**kwargs, block_size=128)
    assert (cfg.rope_type, cfg.tie_embeddings, cfg.qkv_bias,
            cfg.sliding_window, cfg.qk_norm, cfg.head_dim) == {
                "llama3.2": ("llama3", True, False, 0, False, 8),
                "llama2": ("default", False, False, 0, False, 8),
                "mistral": ("default", False, False, 8, False, 8),
                "qwen2": ("default", False, True, 12, False, 8),
                "qwen3": ("yarn", True, False, 0, True, 16)}[family]
    model = Transformer(cfg).eval()
    weights.setdefault("output.weight", weights["tok_embeddings.weight"])  # (tied: one tensor)
    model.load_state_dict(weights)
    x = torch.randint(0, cfg.vocab_size, (2, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(x)[0], hf_logits(path, x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.generate(x[:, :4], 30, temperature=0),
                               model.generate(x[:, :4], 30, temperature=0, kv_cache=False),
                               rtol=0, atol=0)


def test_config_forms_and_refusals(tmp_path):
    """The rotary scaling as the hub's files write it (rope_scaling beside rope_theta, "type" in
    older ones) and as transformers 5 does (rope_parameters); Qwen2's window by its switch and
    layer types; each thing not implemented is one line. And `linear` scaling's logits equal
    transformers'."""
    llama, qwen2 = {**HF, "model_type": "llama"}, {**HF, "model_type": "qwen2"}

    def ours(hf_config, *keys):
        cfg = ModelConfig(**hf.hf_config_to_ours(hf_config))
        return tuple(getattr(cfg, k) for k in keys)

    rope = ("rope_type", "rope_factor", "rope_theta", "rope_low_freq", "rope_high_freq",
            "rope_original_len")
    assert ours({**llama, "rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 5e5},
                *rope) == ("linear", 2.0, 5e5, 1.0, 4.0, 8192)
    llama3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0}
    assert ours({**llama,
                 "rope_parameters": {**llama3, "rope_theta": 5e5,
                                     "original_max_position_embeddings": 8192}},
                *rope) == ("llama3", 32.0, 5e5, 1.0, 4.0, 8192)
    # (as HF)
    assert ours({**llama, "rope_scaling": llama3}, "rope_original_len", "max_position") == (64, 64)
    # every form as transformers reads the same dict: a dict's own rope_theta
    # before the top-level one
    from transformers import AutoConfig
    for form in [{**llama, "rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 5e5},
                 {**llama,
                  "rope_parameters": {**llama3, "rope_theta": 5e5,
                                      "original_max_position_embeddings": 8192}},
                 {**llama, "rope_theta": 5e5,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 2e4}},
                 {**llama, "rope_theta": 5e5,
                  "rope_parameters": {"rope_type": "linear", "factor": 2.0}},
                 # two that agree
                 {**llama, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0},
                  "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}}]:
        theirs = AutoConfig.for_model(**form).rope_parameters
        assert ours(form, "rope_type", "rope_theta", "rope_factor") == (
            theirs["rope_type"], theirs["rope_theta"], theirs.get("factor", 1.0)), form
    assert (ours({**qwen2, "sliding_window": 4096}, "qkv_bias", "sliding_window", "hf_model_type")
            == (True, 0, "qwen2"))
    assert ours({**qwen2, "use_sliding_window": True,
                 "sliding_window": 16, "max_window_layers": 0},
                "sliding_window") == (16,)
    assert (ours({**llama, "model_type": "mistral", "sliding_window": None}, "sliding_window")
            == (0,))
    for bad, field in [
            ({**llama, "rope_scaling": {**llama3, "low_freq_factor": 4.0}}, "rope_scaling"),
            ({**llama, "rope_scaling": {"rope_type": "linear", "factor": True}}, "rope_scaling"),
            ({**llama, "rope_parameters": {"rope_type": "longrope"}}, "rope_parameters"),
            ({**qwen2, "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
             "layer_types"),
            ({**qwen2, "use_sliding_window": True,
              "sliding_window": 16, "layer_types": [[1], "x"]},
             "layer_types"),
            ({**llama, "model_type": "mistral", "sliding_window": -4}, "sliding_window"),
            ({**llama, "rope_theta": 1e-300}, "rope_theta"),  # (trained NaN)
            ({**llama, "rope_parameters": {"rope_type": "linear", "factor": 0.5}},
             "rope_parameters"),
            ({**llama, "rope_scaling": {**llama3, "original_max_position_embeddings": 1e29}},
             "rope_scaling"),  # (an OverflowError in the rotary tables)
            # two that differ: which?
            ({**llama, "rope_scaling": {"type": "linear", "factor": 4.0},
              "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "rope_scaling"),
            # in theta
            ({**llama, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0},
              "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 2e4}},
             "rope_scaling")]:
        with pytest.raises(UserError, match=f"config.json: {field}="):
            hf.hf_config_to_ours(bad)
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        **HF, rope_scaling={"rope_type": "linear", "factor": 4.0})).save_pretrained(tmp_path)
    kwargs, weights = hf.load_hf(tmp_path)
    model = Transformer(ModelConfig(**kwargs, block_size=64)).eval()
    model.load_state_dict(weights)
    x = torch.randint(0, 512, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(x)[0], hf_logits(tmp_path, x), rtol=1e-5, atol=1e-5)


def test_cpt_sft_lora_export(base, corpus, tmp_path):
    """The workflow: continual pretraining from the base with extra tokens, SFT from that run
    (exported: the LoRA's base), LoRA from it, exported merged and as PEFT adapters. Each export
    loads in transformers (the family's class, its context length and rotary scaling) and peft,
    with our logits."""
    family, path = base
    words = tmp_path / "domain.txt"
    words.write_text("def __init__(self\nreturn None\n")
    cpt, sft, lora = (str(tmp_path / name) for name in ("cpt", "sft", "lora"))
    # (the base's vocabulary)
    run = [a for a in RUN if not a.startswith("vocab_size=")] + ["max_iters=2"]
    p = run_train(
        [*run, "dataset=domain", f"data_source={corpus}", f"extra_tokens={words}",
         "val_fraction=0.2", f"init_from={path}", f"out_dir={cpt}"], cwd=tmp_path, fork=True)
    rows, ids = (hf.load_hf(path)[0]["vocab_size"],
                 write_tokenizer(family, str(tmp_path / "tok"))[0])
    if rows < ids + 2:  # the two new tokens get rows of their own
        assert f"growing the vocabulary from {rows} to {ids + 2}" in p.stdout
    else:  # Qwen2's padded embedding has rows for them already (its ids stay below the rows)
        assert "growing the vocabulary" not in p.stdout and rows > ids
    # the config line shows what the run uses: the base's shape and tokenizer
    # (its file and size), marked
    line = next(line for line in p.stdout.splitlines() if line.startswith("config: "))
    assert " n_layer=2* n_head=4* n_kv_head=2* n_embd=32* ffn_dim=64* " in line, line
    assert (f" tokenizer='{os.path.abspath(hf_tokenizer.find(path))}'* "
            f"vocab_size={ids}* ") in line, line
    assert (line.endswith(f"(*: the model's, from the Hugging Face model in {path})")
            and " dropout=0.0 " in line)
    chats = tmp_path / "chat.jsonl"
    chats.write_text(
        "".join(json.dumps({"prompt": f"What is {i} times 2?", "response": f"It is {2 * i}."})
                + "\n" for i in range(40)))
    run_train(
        [*run, "dataset=chat", f"data_source={chats}", "val_fraction=0.2", "doc_mask=True",
         f"init_from={cpt}", f"out_dir={sft}", f"export_hf={sft}/hf"], cwd=tmp_path, fork=True)
    run_train(
        [*run, "dataset=chat", f"init_from={sft}", "lora_rank=4", "lora_targets=wq,wk,wv,wo,w1",
         f"out_dir={lora}", f"export_hf={lora}/hf", f"export_lora={lora}/peft"],
        cwd=tmp_path, fork=True)
    x = torch.randint(0, ids + 6, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        mine_sft, mine_lora = ours_from(sft)(x)[0], ours_from(lora)(x)[0]
    torch.testing.assert_close(hf_logits(f"{sft}/hf", x), mine_sft, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hf_logits(f"{lora}/hf", x), mine_lora, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hf_logits(f"{sft}/hf", x, adapter=f"{lora}/peft"), mine_lora,
                               rtol=1e-5, atol=1e-5)
    # the adapters learned something the checks would see
    assert (mine_lora - mine_sft).abs().max() > 1e-3
    base_config, config = (json.load(open(f"{d}/config.json")) for d in (path, f"{lora}/hf"))
    for key in ("model_type", "architectures", "max_position_embeddings", "sliding_window",
                "use_sliding_window", "tie_word_embeddings"):
        # (max_position_embeddings: the base's 128, not 32)
        assert config.get(key) == base_config.get(key), key
    tokenizer_configs = (json.load(open(f"{d}/tokenizer_config.json"))
                         for d in (path, f"{lora}/hf"))
    # the base tokenizer's, kept
    assert len({c.get("model_max_length") for c in tokenizer_configs}) == 1
    from transformers import AutoConfig
    assert (AutoConfig.from_pretrained(f"{lora}/hf").rope_parameters
            == AutoConfig.from_pretrained(path).rope_parameters)


def test_qwen_on_layouts(corpus, tmp_path):
    """Qwen3's q/k norms (replicated under tp, each rank's heads a part of their gradient) and its
    heads wider than hidden_size / heads, on the layouts, with Muon (norm gains: AdamW): one
    out_dir whose legs resume each other, fsdp (dp=2, the meta-device build importing the base's
    shards) -> tp=2 (the checkpoint's slices gathered again on save) -> pp=2 -> cp=2 (its YaRN
    tables at the tokens' global positions) -> zero=2 (dp=2), is the single-process curve, and
    its last checkpoint holds the single-process weights. LoRA on
    Qwen2's biased linears (the biases frozen with the base, cut with their rows) under its
    sliding window (12 < block_size) at tp=2 is its single-process curve too."""
    # 603 ids, 640 rows: tp=2 splits the padded embedding; untied: pp=2 refuses a tied head
    path = make_base("qwen3", str(tmp_path / "base"), tie_word_embeddings=False)
    common = [a for a in RUN if not a.startswith(("vocab_size=", "optim="))] + [
        "optim=muon", "dataset=domain", f"data_source={corpus}",
        "val_fraction=0.2", f"init_from={path}", "keep_ckpts=0", "eval_interval=2",
        "lr_decay_iters=6"]  # (the schedule of the whole run in each leg)
    single, chain = ([*common, f"out_dir={tmp_path / 'single'}"],
                     [*common, f"out_dir={tmp_path / 'chain'}"])
    run_train([*single, "max_iters=6"], cwd=tmp_path, fork=True)
    torchrun(2, [*chain, "max_iters=2", "fsdp=True"], cwd=tmp_path)
    torchrun(2, [*chain, "max_iters=3", "tp=2"], cwd=tmp_path)
    torchrun(2, [*chain, "max_iters=4", "pp=2"], cwd=tmp_path)
    torchrun(2, [*chain, "max_iters=5", "cp=2"], cwd=tmp_path)
    torchrun(2, [*chain, "max_iters=6", "zero=2"], cwd=tmp_path)
    assert_same_curve(read_metrics(tmp_path / "single"), read_metrics(tmp_path / "chain"))
    a, b = (
        checkpoint.load_whole(os.path.join(tmp_path, run, "ckpt", "iter_0000006"))[0].state_dict()
        for run in ("chain", "single"))
    assert set(a) == set(b) and "layers.1.attention.k_norm.weight" in a
    for k in a:  # (atol: see test_fsdp.py's test_one_run_moves_through_every_layout)
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=5e-5, msg=k)
    gains = hf.load_hf(path)[1]["layers.1.attention.k_norm.weight"]
    # trained: the comparison sees them
    assert (a["layers.1.attention.k_norm.weight"] - gains).abs().max() > 1e-4
    path = make_base("qwen2", str(tmp_path / "qwen2"))
    # (its own data: the domain text as Qwen2's tokenizer, without Qwen3's <think> tokens, cuts it)
    common = [{"init_from": f"init_from={path}",
               "dataset": "dataset=qwen2_domain"}.get(a.split("=")[0], a)
              for a in common]
    lora = [*common, "max_iters=3", "lora_rank=4", "lora_targets=wq,wk,wv,w1"]
    run_train([*lora, f"out_dir={tmp_path / 'lora_single'}"], cwd=tmp_path, fork=True)
    torchrun(2, [*lora, f"out_dir={tmp_path / 'lora_tp'}", "tp=2"], cwd=tmp_path)
    assert_same_curve(read_metrics(tmp_path / "lora_single"), read_metrics(tmp_path / "lora_tp"))
    adapted = ours_from(str(tmp_path / "lora_tp")).state_dict()
    biases = {n: t for n, t in hf.load_hf(path)[1].items() if n.endswith(".bias")}
    # frozen: as they were
    assert len(biases) == 6 and all(torch.equal(adapted[n], t) for n, t in biases.items())


def test_rope_scalings_as_transformers(tmp_path):
    """A run's rope_theta and each rope_scaling (linear, llama3, yarn; YaRN's attention factor from
    DeepSeek's mscale pair, truncate off) over a base trained on 32 positions: our tables equal
    transformers' (inv_freq and attention factor) for the config.json an export writes, and a run
    that asks for none keeps the base's own scaling."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from formats import hf_rope
    from model import rope_tables
    base = dict(
        ModelConfig(vocab_size=64, n_embd=64, n_head=4, max_position=32, block_size=32).__dict__)
    for theta, scaling, deepseek in [(0, "linear:4", False), (5e5, "llama3:4", False),
                                     (0, "yarn:4", False), (0, "yarn:8", True)]:
        cfg = ModelConfig(**hf_rope.with_run_rope(base, theta, scaling, 128))
        scaling_out = hf_rope.rope_scaling_out(cfg)
        if deepseek:  # its form of the attention factor, read back as transformers reads it
            scaling_out = {**{k: v for k, v in scaling_out.items() if k != "attention_factor"},
                           "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False}
            cfg = ModelConfig(**hf.hf_config_to_ours(
                {**HF, "hidden_size": 64, "model_type": "llama",
                 "max_position_embeddings": 256, "rope_scaling": scaling_out}),
                              block_size=128)
            assert cfg.rope_attn_factor != hf_rope._mscale(8.0) and not cfg.rope_truncate
        assert (cfg.rope_original_len, cfg.max_position) == (32, 32 * int(scaling[-1]))
        theirs = AutoConfig.for_model("llama", hidden_size=64, num_attention_heads=4,
                                      rope_theta=cfg.rope_theta,
                                      max_position_embeddings=cfg.max_position,
                                      rope_scaling=scaling_out)
        inv_freq, attention = ROPE_INIT_FUNCTIONS[cfg.rope_type](theirs, "cpu")
        angles = torch.outer(torch.arange(128, dtype=torch.float32), inv_freq)
        cos, sin = rope_tables(16, 128, cfg.rope_theta, cfg)
        torch.testing.assert_close(cos, torch.cat([angles, angles], -1).cos() * attention,
                                   rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(sin, torch.cat([angles, angles], -1).sin() * attention,
                                   rtol=1e-5, atol=1e-6)
        assert (attention != 1.0) == (cfg.rope_type == "yarn") and cfg.rope_theta == (theta or 1e4)
    kept = hf_rope.with_run_rope({**base, "rope_type": "yarn", "rope_factor": 4.0}, 0, "", 128)
    assert kept["rope_type"] == "yarn" and kept["rope_factor"] == 4.0
    assert (hf_rope.with_run_rope({**base, "rope_type": "yarn"}, 0, "none", 128)["rope_type"]
            == "default")
    for bad in ("yarn", "yarn:0.5", "dynamic:2", "4"):
        with pytest.raises(UserError, match="rope_scaling="):
            hf_rope.parse_scaling(bad)


def test_an_export_declares_the_length_it_trained_at_yarn_without_a_factor_and_qk_norms(tmp_path):
    """What an export declares: max_position at least the block_size trained at, after a scaling
    too small for it or after a new rope_theta alone; YaRN's factor from a DeepSeek-style file
    that gives none (max_position_embeddings / original: 40, not 1/40); a from-scratch model
    with q/k norms as Qwen3, whose class loads them (a LLaMA's would drop them)."""
    from formats import hf_rope
    base = dict(
        ModelConfig(vocab_size=64, n_embd=64, n_head=4, max_position=32, block_size=32).__dict__)
    for theta, scaling in ((0, "linear:2"), (5e5, "")):
        assert hf_rope.with_run_rope(base, theta, scaling, 256)["max_position"] == 256, scaling
    read = hf.hf_config_to_ours({**HF, "hidden_size": 64, "model_type": "llama",
                                 "max_position_embeddings": 40 * 32, "rope_scaling": {
                                     "rope_type": "yarn", "original_max_position_embeddings": 32}})
    assert (read["rope_factor"], read["rope_original_len"]) == (40.0, 32)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, n_embd=64, n_head=4, n_kv_head=2, n_layer=1, block_size=32,
                      qk_norm=True)
    hf.save_hf(str(tmp_path / "e"), Transformer(cfg).state_dict(), cfg)
    with open(tmp_path / "e" / "config.json") as f:
        assert json.load(f)["model_type"] == "qwen3"


def test_long_context_from_a_base(corpus, tmp_path):
    """Long-context continued pretraining: from a base trained on 32 positions, a run at 128 (4x)
    with a raised rope_theta and YaRN x4, interrupted and resumed (the checkpoint's RoPE kept), is
    exported; transformers reads the new RoPE from config.json and its logits at 128 positions
    equal ours."""
    path = make_base("llama2", str(tmp_path / "base"), max_position_embeddings=32)
    run = [a for a in RUN if not a.startswith(("vocab_size=", "block_size="))] + [
        "block_size=128", "dataset=domain", f"data_source={corpus}", "val_fraction=0.2",
        f"init_from={path}", "rope_theta=40000.0", "rope_scaling=yarn:4",
        f"out_dir={tmp_path / 'long'}", "lr_decay_iters=3"]
    run_train([*run, "max_iters=2"], cwd=tmp_path, fork=True)
    run_train([*run, "max_iters=3", f"export_hf={tmp_path / 'hf'}"], cwd=tmp_path, fork=True)
    meta = guard_ckpt.read_meta(checkpoint.find(str(tmp_path / "long"), None))[0]["model"]
    assert ((meta["rope_type"], meta["rope_factor"], meta["rope_theta"], meta["rope_original_len"])
            == ("yarn", 4.0, 40000.0, 32))
    config = json.load(open(tmp_path / "hf" / "config.json"))
    assert config["max_position_embeddings"] == 128 and config["rope_theta"] == 40000.0
    assert config["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0,
                                      "original_max_position_embeddings": 32}
    x = torch.randint(0, 500, (1, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(tmp_path / "hf", x),
                                   ours_from(str(tmp_path / "long"))(x)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type, rope", [
    ("qwen3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    ("qwen3", {"rope_type": "yarn", "factor": 4.0}),
    ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64})])
def test_a_top_level_original_length_is_read_as_transformers_models_read_it(
        tmp_path, model_type, rope):
    """original_max_position_embeddings at config.json's top level, beside the rope dict's or
    instead of it: transformers 5.24's config object shows the dict's, but its models build the
    rotary embedding from the top-level one (standardize_rope_params, Phi-3's habit). Ours
    reads it so: the logits and the iteration-0 loss over 128 positions equal transformers'."""
    import transformers
    keys = dict(SIZE, vocab_size=256, model_type=model_type, rope_theta=1e4,
                original_max_position_embeddings=16, rope_scaling={**rope, "rope_theta": 1e4},
                **({"head_dim": 16} if model_type == "qwen3" else {}))
    path = tmp_path / "m"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(keys))
    config = transformers.AutoConfig.from_pretrained(path)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(path)
    (path / "config.json").write_text(json.dumps(keys))  # the file as given, whatever it saved
    kwargs, weights = hf.load_hf(str(path))
    assert kwargs["rope_original_len"] == 16
    model = Transformer(ModelConfig(**kwargs, block_size=128)).eval()
    model.load_state_dict(weights, strict=False)
    x = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(0))
    theirs = hf_logits(path, x)
    with torch.no_grad():
        ours = model(x)[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    loss = [torch.nn.functional.cross_entropy(z[:, :-1].flatten(0, 1), x[:, 1:].flatten())
            for z in (ours, theirs)]
    assert abs(loss[0].item() - loss[1].item()) < 1e-6 * loss[1].item()
