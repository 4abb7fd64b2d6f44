"""Mixture of experts (moe.py, expert_parallel.py, hf_moe.py): the layer against transformers'
Mixtral and Qwen2-MoE blocks, both families in and out of Hugging Face directories (either
on-disk layout), the balancing losses and the bias in a run, the layouts against one process (with
fp16, grad_ckpt and LoRA too), and an ep=2 checkpoint handed to one process bit for bit."""

import json
import os
import shutil
import types
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from conftest import RUN, TINY, assert_same_curve, read_metrics, run_train, torchrun

from model import ModelConfig, Transformer
from formats import hf
from techniques import moe

# the tiny MoE model of the run tests: 4 experts, 2 a token, in both layers
MOE = [*TINY, "n_experts=4", "moe_top_k=2", "moe_ffn_dim=48"]


def hf_moe_model(family, seed=0):
    """A tiny random Mixtral, Qwen2-MoE or Qwen3-MoE built by transformers (eager experts: the
    CPU's), its router randomised (Qwen2-MoE's starts at zero: every token would tie), and
    Qwen3's q/k norm gains; its aux coefficient is what our export of it writes (the run's
    moe_aux_weight / top_k)."""
    from transformers import (MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig,
                              Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)
    torch.manual_seed(seed)
    shape = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2,
                 num_experts_per_tok=2, max_position_embeddings=64, router_aux_loss_coef=0.005)
    if family == "mixtral":
        model = MixtralForCausalLM(
            MixtralConfig(**shape, intermediate_size=48, num_local_experts=4))
    elif family == "qwen3_moe":  # layer 0 dense by mlp_only_layers, heads of 16 on a width of 32
        model = Qwen3MoeForCausalLM(
            Qwen3MoeConfig(**{**shape, "router_aux_loss_coef": 0.02}, intermediate_size=40,
                           moe_intermediate_size=24, num_experts=4, norm_topk_prob=True,
                           mlp_only_layers=[0], head_dim=16))
    else:
        model = Qwen2MoeForCausalLM(
            Qwen2MoeConfig(**shape, intermediate_size=40, moe_intermediate_size=24,
                           shared_expert_intermediate_size=36, num_experts=4,
                           decoder_sparse_step=2 if family == "qwen2_moe_sparse" else 1))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "bias", "q_norm.weight", "k_norm.weight")):
                p.normal_(name.endswith("norm.weight"), 0.5)
    (model.set_experts_implementation("eager") if hasattr(model, "set_experts_implementation")
     else None)
    return model.eval()


def hf_logits(path, x):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager").eval()
    with torch.no_grad():
        return model(x).logits


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen2_moe_sparse", "qwen3_moe"])
def test_hf_moe_in_and_out_equal_transformers(family, tmp_path):
    """A Mixtral, a Qwen2-MoE (shared expert, q/k/v biases; every other layer dense) and a
    Qwen3-MoE (no shared expert, top-k renormalised, layer 0 dense by mlp_only_layers, q/k norms)
    that transformers saved, read from its per-expert files and from transformers 5's fused
    gate_up_proj / down_proj: our logits equal transformers'; exported, transformers reads
    ours to the same logits and config, and the files hold the names and shapes its own save
    writes."""
    model = hf_moe_model(family)
    saved, fused = str(tmp_path / "saved"), str(tmp_path / "fused")
    model.save_pretrained(saved)
    # the in-memory names: mlp.experts.gate_up_proj (E, 2F, D), mlp.experts.down_proj (E, D, F)
    os.makedirs(fused)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              os.path.join(fused, "model.safetensors"))
    config = json.load(open(os.path.join(saved, "config.json")))
    json.dump(config, open(os.path.join(fused, "config.json"), "w"))
    assert any("gate_up_proj" in k
               for k in model.state_dict()), "transformers no longer fuses: test the layout"
    x = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(x).logits
    for path in (saved, fused):
        kwargs, weights = hf.load_hf(path)
        cfg = ModelConfig(**kwargs, block_size=64)
        assert (cfg.n_experts, cfg.moe_top_k, cfg.moe_norm_topk, bool(cfg.moe_shared_ffn_dim)) == (
            4, 2, family in ("mixtral", "qwen3_moe"), family.startswith("qwen2"))
        # the file's coefficient x top_k: theirs counts a token's k slots (hf_moe.config_out)
        assert ((cfg.moe_dense_layers, cfg.moe_aux_weight)
                == (("0", 0.04) if family == "qwen3_moe" else ("", 0.01)))
        ours = Transformer(cfg).eval()
        ours.load_state_dict(weights)
        with torch.no_grad():
            torch.testing.assert_close(ours(x)[0], want, rtol=1e-5, atol=1e-5)
        # an ep rank reads only its experts (build.fill): experts 2, 3 of a layer,
        # from either layout
        _, index = hf.hf_index(path)
        for name in ("layers.1.feed_forward.experts.w1", "layers.1.feed_forward.experts.w2"):
            part = torch.empty(2, *weights[name].shape[1:])
            hf.load_hf_parts(index, [(name, part, tuple(weights[name].shape), 0, 2, 4)])
            assert torch.equal(part, weights[name][2:4])
    out = str(tmp_path / "export")
    hf.save_hf(out, ours.state_dict(), cfg)
    torch.testing.assert_close(hf_logits(out, x), want, rtol=1e-5, atol=1e-5)
    from safetensors import safe_open
    shapes = [{k: tuple(f.get_slice(k).get_shape()) for k in f.keys()} for f in
              (safe_open(os.path.join(d, "model.safetensors"), "pt") for d in (saved, out))]
    assert shapes[0] == shapes[1]
    # the whole config as transformers reads it, but for what names no setting: where each was
    # saved, head_dim (None: hidden_size / heads, which we write), max_window_layers
    # (no window here)
    from transformers import AutoConfig
    got, want = (AutoConfig.from_pretrained(d).to_dict() for d in (out, saved))
    # (and layer_types, which transformers derives from our max_window_layers:
    # every layer full attention)
    assert set(got.get("layer_types") or ["full_attention"]) == {"full_attention"}
    assert {k for k in {*got, *want} if got.get(k) != want.get(k)} <= {
        "_name_or_path", "head_dim", "max_window_layers", "layer_types"}
    assert got["head_dim"] in (want.get("head_dim"), 32 // 4) and not got.get("use_sliding_window")


@pytest.mark.parametrize("family",
                         ["llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe",
                          "qwen3_moe"])
def test_hf_config_omitting_a_key_reads_as_transformers_reads_it(family):
    """A config.json without one of its keys (each in turn, then all it can do without) is read
    as transformers reads it: its defaults of that family (Mistral's num_key_value_heads 8 and
    sliding window 4,096, Qwen2's and Qwen3's 32 kv heads, Qwen2-MoE's num_experts_per_tok 4,
    norm_topk_prob False, Mixtral's rms_norm_eps and rope_theta, ...). The sizes it cannot
    do without are refused in one line naming the key."""
    from transformers import AutoConfig
    # (every value off its default, so that a wrong default shows)
    shape = dict(vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-4,
                 max_position_embeddings=64, rope_theta=5e4, tie_word_embeddings=True)
    shape.update({"mixtral": dict(num_local_experts=6, num_experts_per_tok=3),
                  "qwen2_moe": dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
                                    shared_expert_intermediate_size=36, decoder_sparse_step=2,
                                    norm_topk_prob=True, qkv_bias=False),
                  "qwen3_moe": dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
                                    decoder_sparse_step=2,
                                    norm_topk_prob=True, mlp_only_layers=[0]),
                  "mistral": dict(sliding_window=16), "qwen3": dict(head_dim=16)}.get(family, {}))

    def read(config):
        try:
            return hf.hf_config_to_ours(config)
        except hf.UserError as e:
            return str(e)

    def kind(**kw):
        return AutoConfig.for_model(family, **{k: v for k, v in kw.items() if k != "model_type"})
    full = kind(**shape).to_dict()
    needed = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "model_type")
    for key in full:
        omitted = {k: v for k, v in full.items() if k != key}
        if key in needed:
            with pytest.raises(hf.UserError, match=f"config.json: {key}="):
                hf.hf_config_to_ours(omitted)
        else:  # the same model, or the same refusal (Qwen3-MoE's 8 experts a token of our 6)
            assert read(omitted) == read(kind(**omitted).to_dict()), key
    least = {k: full[k] for k in needed}
    assert hf.hf_config_to_ours(least) == hf.hf_config_to_ours(kind(**least).to_dict())


def test_layer_equals_transformers_blocks_and_routes_by_the_bias():
    """Our MoE layer against MixtralSparseMoeBlock and Qwen2MoeSparseMoeBlock on the same
    weights, forward and the gradient of the input; the bias chooses but never weighs: a
    large bias on one expert puts it in every token's top-k with its unbiased score."""
    for family in ("mixtral", "qwen2_moe"):
        hf_model = hf_moe_model(family)
        block = hf_model.model.layers[0].mlp
        kwargs, _ = hf.hf_config_to_ours(hf_model.config.to_dict()), None
        cfg = ModelConfig(**kwargs, block_size=64)
        layer = moe.MoE(cfg)
        sd = {k: v for k, v in hf_model.state_dict().items()
              if k.startswith("model.layers.0.mlp.")}
        F = cfg.moe_ffn_dim
        with torch.no_grad():
            layer.router.weight.copy_(sd["model.layers.0.mlp.gate.weight"])
            gate_up = sd["model.layers.0.mlp.experts.gate_up_proj"]
            layer.experts.w1.copy_(gate_up[:, :F]), layer.experts.w3.copy_(gate_up[:, F:])
            layer.experts.w2.copy_(sd["model.layers.0.mlp.experts.down_proj"])
            if cfg.moe_shared_ffn_dim:
                for ours, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                    theirs = sd[f"model.layers.0.mlp.shared_expert.{theirs}.weight"]
                    getattr(layer.shared_expert, ours).weight.copy_(theirs)
                layer.shared_gate.weight.copy_(sd["model.layers.0.mlp.shared_expert_gate.weight"])
        x = torch.randn(3, 10, 32, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        y, y2 = layer(x), block(x2)
        torch.testing.assert_close(y, y2, rtol=1e-5, atol=1e-6)
        y.square().sum().backward(), y2.square().sum().backward()
        torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        layer.expert_bias[3] = 100.0
        chosen, weights, _, scores = layer.route(x.reshape(-1, 32))
    assert (chosen == 3).any(-1).all()
    torch.testing.assert_close(weights, scores.gather(1, chosen))  # (qwen2_moe: not renormalised)


def test_a_moe_run_logs_its_losses_and_load_and_resumes_exactly(dataset, tmp_path):
    """One process: the aux and z-losses and each layer's load go to metrics.jsonl and the log
    line, the logged loss stays the plain cross-entropy (moe_aux_weight changes the gradient,
    not the first loss), the bias moves and is saved, and a resumed run repeats the curve."""
    base = [*MOE, f"dataset={dataset}", "max_iters=6", "ckpt_interval=3", "moe_z_weight=1e-3",
            "moe_bias_rate=1e-2"]
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    log = run_train([*base, f"out_dir={full}"], cwd=str(tmp_path), fork=True).stdout
    assert "moe aux " in log and " load " in log
    rows = [r for r in read_metrics(full) if "loss" in r]
    assert all(0.5 < r["moe_aux"] < 4 and r["moe_z"] > 0
               and r["moe_load/0"] >= 1 and r["moe_load/1"] >= 1
               for r in rows)  # (the aux loss is 1 at a perfect balance, at most n_experts)
    no_aux = str(tmp_path / "no_aux")
    run_train([*base, "max_iters=2", "moe_aux_weight=0", "moe_z_weight=0", f"out_dir={no_aux}"],
              cwd=str(tmp_path), fork=True)
    first = [r for r in read_metrics(no_aux) if "loss" in r]
    assert first[0]["loss"] == rows[0]["loss"] and first[1]["loss"] != rows[1]["loss"]
    run_train([*base, "max_iters=3", f"out_dir={part}"], cwd=str(tmp_path), fork=True)
    run_train([*base, f"out_dir={part}"], cwd=str(tmp_path), fork=True)
    assert_same_curve(read_metrics(full), read_metrics(part), exact=True)
    import checkpoint
    model, _ = checkpoint.load_whole(checkpoint.find(full, None))
    assert model.layers["0"].feed_forward.expert_bias.abs().sum() > 0


# ---- expert parallel and the layouts ---------------------------------------------------------

def _ep_grads(mesh):
    """On each of 8 ranks, 8 experts: the gradients of one process over the whole batch (every
    rank computes them) beside ep's over this rank's share of it, for ep=2 and ep=4 (an ep group
    of 2 and replica groups of 4, and the other way round: a reduction over the wrong one or a
    send split on the wrong axis shows), ep=2 under FSDP (sharded over the replicas), and ep=4
    with the experts of ep rank 1 starved (the bias keeps every token off them: they receive no
    row and must still join the exchanges). Per case {name: (ep's gradient, one process's)}."""
    from techniques import data_parallel
    from techniques import expert_parallel
    from techniques import fsdp
    cfg = ModelConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                      n_experts=8, moe_ffn_dim=24, moe_aux_weight=0.01, moe_z_weight=0.01)
    x = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(0))

    def build(starve):
        torch.manual_seed(0)
        model = moe.attach(Transformer(cfg), cfg)
        for layer in moe.moe_layers(model).values():
            layer.expert_bias[2:4] = -100.0 if starve else 0.0
        return model
    one = {}
    for starve in (False, True):
        model = build(starve)
        # one process: the mean over 8 micro-batches (the loop's token weights, no mask)
        for k in range(8):
            (model(x[2 * k:2 * k + 2], x[2 * k:2 * k + 2])[1] / 8).backward()
        one[starve] = {name: p.grad for name, p in model.named_parameters()}
    out = {}
    for ep, layout, starve in ((2, "dp", False), (4, "dp", False), (2, "fsdp", False),
                               (4, "dp", True)):
        ours = expert_parallel.expert_parallel(build(starve), mesh, ep, moe.moe_layers)
        wrap = (fsdp.fully_shard_model if layout == "fsdp"
                else partial(data_parallel.wrap, impl="bucketed", bucket_mb=0.01))
        run = wrap(ours, mesh)
        k = mesh.dp_rank  # (one micro-batch a rank, of weight 1 / micro-batches)
        (run(x[2 * k:2 * k + 2], x[2 * k:2 * k + 2])[1] / 8).backward()
        run.wait() if layout == "dp" else None
        expert_parallel.sync_grads(ours)
        r, n = mesh.dp_rank % ep, 8 // ep
        want = {name: g[r * n:(r + 1) * n] if "experts." in name else g
                for name, g in one[starve].items()}
        got = {name: p.grad.full_tensor() if layout == "fsdp" else p.grad
               for name, p in ours.named_parameters()}
        out[f"ep{ep}{layout}{'starved' if starve else ''}"] = {name: (got[name], want[name])
                                                               for name in got}
    return out


def test_ep_gradients_equal_one_process_where_the_groups_differ():
    """8 experts on 8 ranks (dp=8): ep=2, ep=4, ep=2 x fsdp and ep=4 with an expert rank starved
    give every gradient of one process, the experts' own included (summed over the ranks holding
    them; not ep or dp / ep times too large), and the starved rank does not hang."""
    from conftest import spawn
    ranks = spawn(_ep_grads, 8)
    for rank in ranks:
        for case, grads in rank.items():
            for name, (got, want) in grads.items():
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=f"{case} {name}")
    # (tokens came)
    assert ranks[0]["ep4dp"]["layers.0.feed_forward.experts.w1"][0].abs().sum() > 0
    # (none came)
    assert ranks[1]["ep4dpstarved"]["layers.0.feed_forward.experts.w1"][0].abs().sum() == 0


# the run every MoE layout must reproduce: Muon (each expert's matrices orthogonalized), the
# balancing losses and the bias on, 4 micro-batches
MOE_REF = [*MOE, "grad_accum_steps=4", "max_iters=4", "optim=muon", "moe_z_weight=1e-3",
           "moe_bias_rate=1e-2", "eval_interval=2", "ckpt_interval=2"]


def _bias(path):
    """The routing bias of each MoE layer in a run's latest checkpoint, or in checkpoint `path`."""
    import checkpoint
    model, _ = checkpoint.load_whole(path if "/ckpt/" in path else checkpoint.find(path, None))
    return torch.stack([m.expert_bias for m in moe.moe_layers(model).values()])


def test_moe_layouts_equal_one_process(dataset, tmp_path):
    """A Qwen3-MoE's shape (no shared expert, q/k norms, heads of 16 on a width of 32): ep=2 in
    dp=4 (with grad_ckpt: the recomputed forwards repeat the exchanges), ep=2 x pp=2, ep=2 x
    zero=2 and ep=2 x fsdp=4 (the experts sharded over the ranks that hold the same ones)
    give the single-process curve, and the same bias. At accumulation 1 and 2 (the same global
    batch, no balancing loss: its unit is the micro-batch) the bias is the same too."""
    base = [*MOE_REF, "qk_norm=True", "head_dim=16", f"dataset={dataset}"]
    ref = str(tmp_path / "ref")
    run_train([*base, f"out_dir={ref}"], cwd=str(tmp_path), fork=True)
    runs = {"ep2dp4": (4, ["ep=2", "grad_ckpt=True"]), "ep2pp2": (4, ["ep=2", "pp=2"]),
            "ep2zero2": (2, ["ep=2", "zero=2"]), "ep2fsdp4": (4, ["ep=2", "fsdp=True"])}
    for name, (n, extra) in runs.items():
        torchrun(n, [*base, *extra, f"out_dir={tmp_path / name}"], cwd=str(tmp_path))
        assert_same_curve(read_metrics(ref), read_metrics(str(tmp_path / name)))
        torch.testing.assert_close(_bias(str(tmp_path / name)), _bias(ref), rtol=0, atol=0)
    # every other layer MoE (moe_every=2): pipeline stage 0 holds only the dense layer 0
    every2 = [*base, "moe_every=2"]
    for name, n, extra in (("every2", 1, []), ("every2ep2pp2", 4, ["ep=2", "pp=2"])):
        torchrun(n, [*every2, *extra, f"out_dir={tmp_path / name}"], cwd=str(tmp_path))
    rows = [read_metrics(str(tmp_path / name)) for name in ("every2", "every2ep2pp2")]
    assert_same_curve(*rows)
    first = next(r for r in rows[0] if "loss" in r)
    assert "moe_load/1" in first and "moe_load/0" not in first
    torch.testing.assert_close(_bias(str(tmp_path / "every2ep2pp2")),
                               _bias(str(tmp_path / "every2")), rtol=0, atol=0)
    accum = {}
    for steps, batch in ((1, 8), (2, 4)):
        out = str(tmp_path / f"accum{steps}")
        run_train([*base, "moe_aux_weight=0", "moe_z_weight=0",
                   "max_iters=3", f"grad_accum_steps={steps}",
                   f"batch_size={batch}", f"out_dir={out}"], cwd=str(tmp_path), fork=True)
        accum[steps] = _bias(out)
    assert accum[1].abs().sum() > 0
    torch.testing.assert_close(accum[1], accum[2], rtol=0, atol=0)


# ---- resume from ep=2 into one process, exactly ----------------------------------------------
# An ep=2 run and one process round differently (dp sums the gradients in another order, an
# expert's matmul runs over both ranks' rows), so an ep=2 checkpoint resumed by one process
# cannot reproduce the one-process run from iteration 0 bit for bit. What is exact is the hand-
# over: the global state the ep=2 ranks hold, and one process going on from it.


def keep_state(rank):
    """before= of torchrun: writes what this rank holds to $MOE_STATE/save_{iteration}_{rank}.pt
    at each save and to load_{rank}.pt after a resume's load: its weights and buffers (an ep
    rank: its own experts), its optimizer state by parameter name. With $MOE_STATE_FROM, the
    load is then replaced, in place, by the state in that file: a continuation from the ranks'
    memory that bypasses the checkpoint."""
    import checkpoint
    save, load = checkpoint.save, checkpoint.load
    where = os.environ["MOE_STATE"]

    def held(model, optimizer):
        names = checkpoint.param_names(model)
        return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "optim": {f"{names[p]}.{k}": v.clone() for p, st in optimizer.state.items()
                          for k, v in st.items()}}

    def save_and_keep(out_dir, it, model, optimizer, *args, **kw):
        torch.save(held(model, optimizer), os.path.join(where, f"save_{it}_{rank}.pt"))
        return save(out_dir, it, model, optimizer, *args, **kw)

    def load_then_keep(path, model, optimizer=None, no_dist=False):
        load(path, model, optimizer, no_dist)
        if optimizer is None:
            return
        torch.save(held(model, optimizer), os.path.join(where, f"load_{rank}.pt"))
        if os.environ.get("MOE_STATE_FROM"):
            state, names = torch.load(os.environ["MOE_STATE_FROM"]), checkpoint.param_names(model)
            with torch.no_grad():
                model.load_state_dict(state["model"])
                for p, st in optimizer.state.items():
                    for k, v in st.items():
                        v.copy_(state["optim"][f"{names[p]}.{k}"])
    checkpoint.save, checkpoint.load = save_and_keep, load_then_keep


def _global_state(files):
    """The global state of ep ranks (their keep_state files, in rank order): the experts of each
    layer concatenated by global index (rank r holds [r E/ep, (r+1) E/ep)), the rest replicated."""
    ranks = [torch.load(f) for f in files]
    out = {}
    for part in ("model", "optim"):
        out[part] = {}
        for k, v in ranks[0][part].items():
            if ".experts." in k:
                out[part][k] = torch.cat([r[part][k] for r in ranks])
            else:  # (replicated: the same on every rank)
                assert all(torch.equal(r[part][k], v) for r in ranks), k
                out[part][k] = v
    return out


def _assert_equal_states(got, want, what):
    for part in ("model", "optim"):
        assert set(got[part]) == set(want[part]), (what, part, set(got[part]) ^ set(want[part]))
        for k, v in want[part].items():
            assert got[part][k].dtype == v.dtype and torch.equal(got[part][k], v), (what, part, k)


def _from(rows, first, last=None):
    return [r for r in rows if first <= r["iter"] <= (last if last is not None else r["iter"])]


def test_resume_from_ep2_into_one_process_is_exact(dataset, tmp_path):
    """An ep=2 run's checkpoint (iteration 3) resumed by one process holds, bit for bit, the
    global state the two ranks held at the save: every weight, each expert by its global index,
    Muon's momentum and AdamW's moments and steps, the routing bias. The iterations that follow
    equal, exactly, one process continuing from the ranks' own state (put in place of the load,
    no checkpoint in between). The same checkpoint resumed on dp=2 without ep gives both ranks
    that state too, and goes on along the one-process curve."""
    base, cwd = [*MOE_REF, f"dataset={dataset}"], str(tmp_path)
    ep2, kept = str(tmp_path / "ep2"), {}
    for name in ("ep2", "oracle", "dp2"):
        kept[name] = str(tmp_path / f"kept_{name}")
        os.makedirs(kept[name])
    # (iteration 3: the sign-driven bias, back at zero after two steps here, has moved)
    torchrun(2, [*base, "ep=2", "max_iters=3", f"out_dir={ep2}"], cwd=cwd, before=keep_state,
             env={"MOE_STATE": kept["ep2"]})
    held = _global_state([os.path.join(kept["ep2"], f"save_3_{r}.pt") for r in range(2)])
    assert held["model"]["layers.0.feed_forward.experts.w1"].shape[0] == 4
    assert held["model"]["layers.0.feed_forward.expert_bias"].abs().sum() > 0
    torch.save(held, os.path.join(kept["ep2"], "global.pt"))
    oracle, dp2 = (shutil.copytree(ep2, str(tmp_path / name)) for name in ("oracle", "dp2"))
    # resumed by one process, as a user does; and one process from the ranks' own state
    run_train([*base, "max_iters=5", f"out_dir={ep2}"], cwd=cwd, fork=True)
    torchrun(1, [*base, "max_iters=5", f"out_dir={oracle}"], cwd=cwd, before=keep_state,
             env={"MOE_STATE": kept["oracle"],
                  "MOE_STATE_FROM": os.path.join(kept["ep2"], "global.pt")})
    loaded = torch.load(os.path.join(kept["oracle"], "load_0.pt"))
    _assert_equal_states(loaded, held, "one process")
    resumed, continued = read_metrics(ep2), read_metrics(oracle)
    assert [r["iter"] for r in resumed if "loss" in r] == [0, 1, 2, 3, 4]
    assert_same_curve(_from(continued, 3), _from(resumed, 3), exact=True)
    import checkpoint
    a, b = (checkpoint.load_whole(f"{d}/ckpt/iter_0000005")[0] for d in (ep2, oracle))
    assert all(torch.equal(t, b.state_dict()[k]) for k, t in a.state_dict().items())
    # ep=1 x dp=2: each rank holds every expert, as loaded
    torchrun(2, [*base, "max_iters=4", f"out_dir={dp2}"], cwd=cwd, before=keep_state,
             env={"MOE_STATE": kept["dp2"]})
    for r in range(2):
        loaded = torch.load(os.path.join(kept["dp2"], f"load_{r}.pt"))
        _assert_equal_states(loaded, held, f"dp rank {r}")
    assert_same_curve(_from(continued, 3, 3), _from(read_metrics(dp2), 3, 3))


def test_ep_composes_with_fp16_grad_ckpt_and_lora(dataset, tmp_path):
    """ep=2 with dtype=float16 and grad_ckpt (the experts' gradients unscaled and checked for
    overflow with the rest; the recomputed forwards repeat the exchanges) gives the single fp16
    process's loss scales and skipped iterations exactly and its curve to one fp16 rounding,
    2**-11 (test_fp16.py derives it; at its learning rate, 5e-4). LoRA on attention from that
    run's checkpoint (the experts frozen: no expert gradient to sync) gives one process's curve
    on ep=2. The two skipped iterations leave the routing bias where it was (at zero)."""
    from test_fp16 import RTOL_FP16, fp16_rows, worst
    fp16 = [*MOE_REF, f"dataset={dataset}", "dtype=float16", "learning_rate=5e-4", "min_lr=5e-5",
            "loss_scale_init=1099511627776.0", "loss_scale_backoff=0.00048828125", "max_iters=6",
            "keep_ckpts=0"]
    single, ep2 = str(tmp_path / "fp16"), str(tmp_path / "fp16_ep2")
    run_train([*fp16, f"out_dir={single}"], cwd=str(tmp_path), fork=True)
    torchrun(2, [*fp16, "ep=2", "grad_ckpt=True", f"out_dir={ep2}"], cwd=str(tmp_path))
    (want, scales, skipped), (got, got_scales, got_skipped) = fp16_rows(single), fp16_rows(ep2)
    # (the scales 2**40 and 2**29 overflow, 2**18 does not: 8x below this model's threshold)
    assert skipped == [0, 1] and (got_scales, got_skipped) == (scales, skipped)
    # (the two skipped steps left it at zero)
    biases = [_bias(f"{single}/ckpt/iter_{it:07d}") for it in (2, 6)]
    assert biases[0].abs().sum() == 0 and biases[1].abs().sum() > 0
    print(f"\nfp16 ep=2 vs one process: worst relative difference {worst(want, got):.1e}")
    trained = [[r for r in rows if "skipped" not in r] for rows in (want, got)]
    assert_same_curve(*trained, rtol=RTOL_FP16)
    lora = [*MOE_REF, f"dataset={dataset}", f"init_from={single}", "lora_rank=4", "max_iters=3"]
    one, ep2 = str(tmp_path / "lora"), str(tmp_path / "lora_ep2")
    run_train([*lora, f"out_dir={one}"], cwd=str(tmp_path), fork=True)
    torchrun(2, [*lora, "ep=2", f"out_dir={ep2}"], cwd=str(tmp_path))
    assert_same_curve(read_metrics(one), read_metrics(ep2))


# ---- the balancing losses and the bias against their definitions ----------------------------

def _router(layers=1, skew=0.0):
    """A tiny all-MoE model (4 experts, 2 a token) with its balancing hook and fixed tokens; skew:
    the routers' row of expert 0 leans this far along the mean of the inputs it sees."""
    cfg = ModelConfig(vocab_size=64, block_size=16, n_layer=layers, n_head=4, n_kv_head=2,
                      n_embd=32, n_experts=4, moe_top_k=2, moe_ffn_dim=24, moe_bias_rate=0.01)
    torch.manual_seed(0)
    model = moe.attach(Transformer(cfg), cfg)
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    if skew:
        seen = []
        for layer in moe.moe_layers(model).values():
            hook = layer.register_forward_pre_hook(
                lambda m, a: seen.append(a[0].reshape(-1, 32).mean(0)))
            model(x, x)
            hook.remove()
            with torch.no_grad():
                layer.router.weight[0] += skew * seen[-1] / seen[-1].norm()
        model.moe_stats.__init__(model.moe_stats.names, 4)
    return model, x


def test_balancing_losses_equal_transformers_and_st_moe():
    """On fixed logits (a router's on fixed inputs), the aux loss is transformers' Mixtral /
    Qwen2-MoE load_balancing_loss_func / top_k (theirs counts a token's k slots as k, ours as 1:
    hf_moe.config_out exports the weight / top_k), value and gradient through the scores; the
    z-loss is ST-MoE's mean over tokens of logsumexp(logits)^2, value and gradient. The logged
    moe_aux and moe_z are these losses' means over a step's forwards and layers."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    for E, k in ((4, 2), (8, 3)):
        layer = moe.MoE(
            ModelConfig(n_embd=32, n_head=4, n_experts=E, moe_top_k=k, moe_ffn_dim=24)).train()
        x = torch.randn(40, 32, generator=torch.Generator().manual_seed(E + k)).unsqueeze(0)
        torch.nn.init.normal_(layer.router.weight, std=0.3)
        layer(x)
        counts, aux, z = layer.last
        logits = F.linear(x[0], layer.router.weight)  # (N, E), the same in float32
        want = load_balancing_loss_func((logits,), E, k) / k
        want_z = torch.log(logits.exp().sum(-1)).square().sum() / logits.shape[0]
        # (float32: the 40 tokens' terms summed in another order)
        eps = 40 * torch.finfo(torch.float32).eps
        torch.testing.assert_close(aux, want, rtol=eps, atol=0)
        torch.testing.assert_close(z, want_z, rtol=eps, atol=0)
        for got, ref in ((aux, want), (z, want_z)):
            g, = torch.autograd.grad(got, layer.router.weight, retain_graph=True)
            g_ref, = torch.autograd.grad(ref, layer.router.weight, retain_graph=True)
            assert g.abs().sum() > 0
            torch.testing.assert_close(g, g_ref, rtol=eps, atol=eps * g_ref.abs().max().item())
    (model, x), seen = _router(layers=2), []
    for m in moe.moe_layers(model).values():
        m.register_forward_pre_hook(
            lambda m, a: seen.append(F.linear(a[0].reshape(-1, 32), m.router.weight)))
    for k in range(2):  # two forwards of one step: the metric is their mean, not their sum
        model(x[2 * k:2 * k + 2], x[2 * k:2 * k + 2])
    metrics = moe.after_step(model, types.SimpleNamespace(backend=None), stepped=False)
    lse = [torch.logsumexp(s, -1).square().mean() for s in seen]
    torch.testing.assert_close(metrics["moe_aux"], torch.stack(
        [load_balancing_loss_func((s,), 4, 2) / 2 for s in seen]).mean().item(), rtol=1e-6, atol=0)
    torch.testing.assert_close(metrics["moe_z"], torch.stack(lse).mean().item(), rtol=1e-6, atol=0)


def test_the_bias_balances_the_load_and_a_skipped_step_leaves_it():
    """DeepSeek-V3's bias on a router skewed towards expert 0: over the steps the most loaded
    expert's share of the slots falls (from 0.42 to about 0.3; 0.25 is balanced), the bias stays
    centred (it sums to 0), and a step not taken (stepped=False) leaves it where it was."""
    model, x = _router(skew=0.5)
    layer = moe.moe_layers(model)["0"]
    mesh, shares = types.SimpleNamespace(backend=None), []
    for step in range(40):
        model(x, x)
        shares.append(model.moe_stats.counts.max().item() / model.moe_stats.counts.sum().item())
        before = layer.expert_bias.clone()
        moe.after_step(model, mesh, stepped=step % 5 != 4)
        if step % 5 == 4:
            assert torch.equal(layer.expert_bias, before), step
        assert abs(layer.expert_bias.sum().item()) < 1e-6
    # (sign steps overshoot: the share flips between two values at the end)
    late = sum(shares[-10:]) / 10
    print(f"\nmost loaded expert's share of the slots: {shares[0]:.2f} -> {late:.2f}")
    # (2 slots a token: 1/2 at most, 1/4 balanced)
    assert shares[0] > 0.35 and late < shares[0] - 0.08


def test_every_expert_a_token_and_every_other_layer_trains(tmp_path):
    """moe_top_k == n_experts is accepted, and its layer is the dense mixture sum_e p_e expert_e(x)
    (p: the softmax, every expert chosen). moe_every=2 on 4 layers makes layers 1 and 3 MoE, as
    Qwen2-MoE's decoder_sparse_step does, and trains:
    both report their loads and move their bias."""
    import configurator
    from guards import guard_config
    from conftest import ROOT
    defaults = configurator.script_defaults(os.path.join(ROOT, "train.py"))
    given = {"n_experts": 4, "moe_top_k": 4, "out_dir": str(tmp_path / "out")}
    guard_config.validate({**defaults, **given}, given, 1)
    layer = moe.MoE(ModelConfig(n_embd=32, n_head=4, n_experts=4, moe_top_k=4, moe_ffn_dim=24))
    torch.nn.init.normal_(layer.router.weight, std=0.3)
    for w in layer.experts.parameters():
        torch.nn.init.normal_(w, std=0.2)
    x = torch.randn(1, 10, 32, generator=torch.Generator().manual_seed(0))
    p = F.linear(x[0], layer.router.weight).softmax(-1)
    e = layer.experts
    dense = sum(p[:, i:i + 1] * ((F.silu(x[0] @ e.w1[i].T) * (x[0] @ e.w3[i].T)) @ e.w2[i].T)
                for i in range(4))
    torch.testing.assert_close(layer(x)[0], dense, rtol=1e-5, atol=1e-6)
    from transformers import Qwen2MoeConfig
    cfg = ModelConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_kv_head=2, n_embd=32,
                      n_experts=4, moe_ffn_dim=24, moe_every=2, moe_bias_rate=0.01)
    sparse = Qwen2MoeConfig(num_hidden_layers=4, decoder_sparse_step=2, num_experts=4)
    # (transformers' rule)
    want = [str(i) for i in range(4) if (i + 1) % sparse.decoder_sparse_step == 0]
    torch.manual_seed(0)
    model = moe.attach(Transformer(cfg), cfg)
    assert list(moe.moe_layers(model)) == model.moe_stats.names == want == ["1", "3"]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        model(x, x)[1].backward()
        optimizer.step()
        optimizer.zero_grad()
        metrics = moe.after_step(model, types.SimpleNamespace(backend=None), stepped=True)
        assert (sorted(k for k in metrics if k.startswith("moe_load/"))
                == ["moe_load/1", "moe_load/3"])
    assert all(m.expert_bias.abs().sum() > 0 for m in moe.moe_layers(model).values())
