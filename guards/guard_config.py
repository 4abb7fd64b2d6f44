"""
The guard of the config: every constraint on it, checked once before anything is written or a
process group starts. Per key: its choices and ranges. Between keys: the layout, and the table
of refused combinations (data: docs/configuration.md renders it, a test keeps the two in sync);
each feature's own rules in a function entered only when it is on. The model's shape rules are
ModelConfig's; what can only be known from a checkpoint or a model directory (its shape, its
LoRA settings) is checked where that is read (origin.py), with check_layout below. The device
and backend are checked where they are picked (parallel.py). Nothing here changes the config.
"""

import math
import os
import re

import torch

import configurator
from model import ModelConfig
from guards import guard_ckpt, guard_env
from guards.guard_errors import UserError, check
from guards.guard_files import (LORA_ALPHA, LORA_DROPOUT, check_exports, check_place,
                                check_writable)

CHOICES = {"nan_action": ("rollback", "stop"), "ddp_impl": ("bucketed", "naive", "torch"),
           "pp_schedule": ("1f1b", "gpipe", "interleaved"),
           "dtype": ("auto", "float32", "bfloat16", "float16"),
           "optim": ("adamw", "muon"), "lr_schedule": ("cosine", "wsd"),
           "backend": ("auto", "gloo", "nccl"),
           "moe_score": ("softmax", "sigmoid"), "doc_attention": ("varlen", "dense"),
           "loss_type": ("sigmoid", "ipo", "simpo")}

AT_LEAST_1 = ("n_layer", "n_head", "n_kv_head", "n_embd", "block_size", "batch_size",
              "grad_accum_steps",
              "eval_interval", "eval_iters", "log_interval", "ckpt_interval",
              "nan_max_consecutive", "pp", "tp",
              "pp_virtual", "loss_scale_interval", "loss_scale_growth", "cp", "moe_top_k",
              "moe_every", "ep")

NOT_NEGATIVE = ("max_iters", "vocab_size", "ffn_dim", "loss_chunk", "keep_ckpts", "warmup_iters",
                "lr_decay_iters",
                "min_lr", "weight_decay", "grad_clip", "peak_flops", "export_shard_mb",
                "lora_rank", "n_experts", "moe_ffn_dim", "moe_shared_ffn_dim", "moe_aux_weight",
                "moe_z_weight", "moe_bias_rate")

# (rates and scales end far past any sane value, where a finite one still overflows float32 in the
# step; sample_tokens where the end-of-run sample would run for hours: sample.py is for long ones)
IN_RANGE = {"dropout": (0, 1), "val_fraction": (0, 1), "beta1": (0, 1), "beta2": (0, 1),
            "muon_momentum": (0, 1),
            "cooldown_frac": (0, 1.000001), "lora_dropout": LORA_DROPOUT,
            "loss_scale_backoff": (0, 1),
            # fp16: the scale's floor is 1; loss x scale fits a float32
            "loss_scale_init": (1, 2.0 ** 64),
            "learning_rate": (0, 10 ** 6), "embed_lr_scale": (0, 10 ** 6),
            "lora_alpha": LORA_ALPHA,
            "neftune_alpha": (0, 10 ** 6), "sample_tokens": (0, 10 ** 6 + 1),
            # preference alignment: cDPO's chance that a label is wrong stays under a coin's
            "beta": (0, 10 ** 6), "label_smoothing": (0, 0.5)}

POSITIVE = ("dist_timeout_s", "ddp_bucket_mb", "lora_alpha", "mix_temperature", "beta")

# the linears an adapter may wrap
LORA_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "output")

# the keys that mean something only for a mixture of experts (n_experts > 0)
MOE_KEYS = ("moe_top_k", "moe_every", "moe_ffn_dim", "moe_score", "moe_norm_topk",
            "moe_shared_ffn_dim", "moe_aux_weight", "moe_z_weight", "moe_bias_rate")

# one process's
PLAIN_LAYOUT = {"pp": 1, "tp": 1, "pp_virtual": 1, "pp_schedule": "1f1b", "pp_layers": "",
                "sp": False, "cp": 1}

# Rules within the config: (refused when (c: the config), the message: what is wrong and the fix).
# A feature's own rules are checked with it, below (FEATURE_CHECKS); the model's shape by
# ModelConfig.
RULES = [
    (lambda c: c["zero"] not in (0, 1, 2),
     "zero={zero} is not a ZeRO stage we run by hand (0, 1 or 2): for stage 3 use fsdp=True"),
    (lambda c: c["min_lr"] > c["learning_rate"],
     "min_lr={min_lr} is above learning_rate={learning_rate}: the decay would raise the rate; "
     "lower min_lr"),
    (lambda c: not 0 <= c["seed"] < 2 ** 32,
     "seed={seed} is out of range: use an integer in [0, 2**32)"),
    (lambda c: c["packing"] not in ("auto", "concat", "bfd"),
     "packing={packing!r} is unknown: use 'concat' (documents end to end, cut into rows), 'bfd' "
     "(whole documents per row, best fit, padded) or 'auto' (bfd for chat data, concat for text)"),
    (lambda c: not re.fullmatch(r"none|full|op|layers:[1-9][0-9]*", c["ac"]),
     "ac={ac!r} is not 'none', 'full', 'op' or 'layers:K' (K at least 1, e.g. 'layers:2': every "
     "other block recomputed)"),
    (lambda c: c["grad_ckpt"] and c["ac"] not in ("none", "full"),
     "grad_ckpt=True is ac='full', but ac={ac!r} is given too: drop grad_ckpt"),
    (lambda c: c["device"].split(":")[0] == "mps" and not torch.backends.mps.is_available(),
     "device={device} but Apple's MPS is not available on this machine: use device=cpu or "
     "device=auto"),
]


def _check_lora(c, overrides):
    check(c["lora_rank"] <= c["n_embd"], f"lora_rank={c['lora_rank']} is above the width "
                                         f"n_embd={c['n_embd']}: an adapter's rank is at most its "
                                         "layer's width; lower lora_rank")
    lora_targets(c)


def lora_targets(c):
    """The linears c's lora_targets names, sorted (lora.py's `targets`)."""
    targets = sorted({t.strip() for t in c["lora_targets"].split(",") if t.strip()})
    check(targets and not set(targets) - set(LORA_TARGETS),
          f"lora_targets='{c['lora_targets']}': name one or more of {','.join(LORA_TARGETS)}, "
          f"separated by commas")
    return targets


def _check_profiler(c, overrides):
    check(_window(c["profile_iters"], c["max_iters"]),
          f"profile_iters='{c['profile_iters']}' is not 'a:b' with 0 <= a < b <= "
          f"max_iters={c['max_iters']}: e.g. '5:8' profiles iterations 5, 6 and 7")
    guard_env.check_trace_dir(c["out_dir"])


def _check_tensorboard(c, overrides):
    try:  # torch's writer, which imports the tensorboard package
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        raise UserError("tensorboard_log=True needs the tensorboard package, which is not "
                        "installed: pip install tensorboard (or tensorboard_log=False)") from None


def _check_rope(c, overrides):  # long context: hf_rope.py
    from formats import hf_rope
    hf_rope.check_run_rope(c)


def _check_moe(c, overrides):
    check(c["moe_top_k"] <= c["n_experts"], f"moe_top_k={c['moe_top_k']} is more than "
                                            f"n_experts={c['n_experts']}: "
                                            f"a token picks top_k of the experts; lower moe_top_k")
    check(c["moe_every"] <= c["n_layer"], f"moe_every={c['moe_every']} is more than "
                                          f"n_layer={c['n_layer']}: no layer "
                                          f"would be a mixture of experts; lower moe_every")


def task_files(eval_tasks):
    """eval_tasks='a.jsonl,b.jsonl' as its paths ('': none), each named in the logs by its base
    name (task/a/acc): an empty name, or two of one base name, would log under nothing or one."""
    paths = eval_tasks.split(",") if eval_tasks else []
    names = [os.path.basename(p).removesuffix(".jsonl") for p in paths]
    check(all(names), f"eval_tasks={eval_tasks!r} names an empty file: give comma-separated "
                      f"task files, e.g. eval_tasks=arc.jsonl,piqa.jsonl")
    twins = sorted({n for n in names if names.count(n) > 1})
    check(not twins, f"eval_tasks={eval_tasks!r}: two files log as "
                     f"task/{twins[0] if twins else ''} (one base name): rename one")
    return paths


# (entered when: the config turns the feature on, or names one of its keys; then its checks)
FEATURE_CHECKS = [
    (lambda c, o: c["eval_tasks"], lambda c, o: task_files(c["eval_tasks"])),
    (lambda c, o: c["lora_rank"] or "lora_targets" in o, _check_lora),
    (lambda c, o: c["profile_iters"], _check_profiler),
    (lambda c, o: c["n_experts"], _check_moe),
    (lambda c, o: c["rope_theta"] or c["rope_scaling"], _check_rope),
    (lambda c, o: c["tensorboard_log"], _check_tensorboard),
]


def _window(spec, max_iters):
    m = re.fullmatch(r"(\d+):(\d+)", spec)
    return m is not None and int(m[1]) < int(m[2]) <= max_iters


# The combinations of options that are refused: (name, refused when (c: the config, o: the
# keys given), the message: what is wrong and the fix; {key} is the config's value).
REFUSALS = [
    ("dataset with datasets", lambda c, o: c["datasets"] and "dataset" in o,
     "dataset={dataset} and datasets={datasets} both given: use datasets= for a mixture, dataset= "
     "for one source"),
    ("ddp_impl=torch inside a pipeline", lambda c, o: c["pp"] > 1 and c["ddp_impl"] == "torch",
     "ddp_impl=torch cannot sit inside a pipeline (torch DDP decides in forward whether to sync, "
     "and 1F1B interleaves forwards with backwards): use ddp_impl=bucketed or naive"),
    ("fsdp with ddp_impl", lambda c, o: c["fsdp"] and "ddp_impl" in o,
     "fsdp=True shards with FSDP2, so ddp_impl={ddp_impl} would be ignored: drop one of the two"),
    ("zero with fsdp", lambda c, o: c["zero"] and c["fsdp"],
     "zero={zero} with fsdp=True: fsdp is ZeRO stage 3 and already shards optimizer state and "
     "gradients; use one of the two"),
    ("zero with ddp_impl other than "
     "bucketed", lambda c, o: c["zero"] and c["ddp_impl"] != "bucketed",
     "zero={zero} shards along the buckets of ddp_impl=bucketed, so ddp_impl={ddp_impl} cannot "
     "carry it: drop ddp_impl"),
    ("offload without zero or fsdp", lambda c, o: c["offload"] and not (c["zero"] or c["fsdp"]),
     "offload=True moves sharded optimizer state to CPU memory: use it with zero=1, zero=2 or "
     "fsdp=True"),
    ("a mixture of experts with tp", lambda c, o: c["n_experts"] and c["tp"] > 1,
     "n_experts={n_experts} with tp={tp}: the experts are not cut into tensor-parallel slices (ep "
     "x tp included); split them over ranks with ep= instead, or drop tp"),
    ("a mixture of experts with cp", lambda c, o: c["n_experts"] and c["cp"] > 1,
     "n_experts={n_experts} with cp={cp}: the balancing loss is taken over a whole micro-batch, "
     "which cp splits over ranks; use dp, ep= or pp with a mixture of experts, or drop cp"),
    # (n_experts: the model's; None while it is not known, from a checkpoint or a model directory)
    ("ep on a dense model", lambda c, o: c["ep"] > 1 and c["n_experts"] == 0,
     "ep={ep} splits the experts of a mixture of experts over ranks, but the model is dense "
     "(n_experts=0): drop ep, or give a new model n_experts= (e.g. 8)"),
    ("a mixture-of-experts key on a dense model",
     lambda c, o: c["n_experts"] == 0 and any(k in o for k in MOE_KEYS),
     "{moe_given}: keys of a mixture of experts, but the model is dense (n_experts=0), where they "
     "do nothing: drop them, or give a new model n_experts= (e.g. 8)"),
    ("export_hf of a sigmoid router or a routing bias",
     lambda c, o: c["export_hf"] and c["n_experts"]
     and (c["moe_score"] != "softmax" or c["moe_bias_rate"]),
     "export_hf={export_hf} with moe_score={moe_score}, moe_bias_rate={moe_bias_rate}: "
     "transformers' Mixtral and Qwen2-MoE route by a softmax and have no routing bias, so the "
     "export could not compute this model; train with moe_score=softmax moe_bias_rate=0, or drop "
     "export_hf (sample.py reads the checkpoints)"),
    ("export_lora with a new RoPE",
     lambda c, o: c["export_lora"] and (c["rope_theta"] or c["rope_scaling"]),
     "export_lora={export_lora} with rope_theta={rope_theta}, rope_scaling={rope_scaling!r}: PEFT "
     "puts the adapters on their base as it is, whose RoPE this run changes; export the merged "
     "model with export_hf= instead, or drop export_lora"),
    ("ep with ddp_impl=torch", lambda c, o: c["ep"] > 1 and c["ddp_impl"] == "torch",
     "ep={ep} with ddp_impl=torch: the experts of an ep rank are its own, and torch's DDP "
     "sums every parameter's gradient over all dp ranks; use ep with ddp_impl=bucketed or naive "
     "(or zero, fsdp)"),
    ("cp with pp, tp or "
     "zero", lambda c, o: c["cp"] > 1 and (c["pp"] > 1 or c["tp"] > 1 or c["zero"]),
     "cp={cp} with pp={pp}, tp={tp}, zero={zero}: context parallelism does not yet split the "
     "sequences passed "
     "between stages, compose with tensor parallelism (tp=N sp=True without cp splits the "
     "sequences over tp) or average ZeRO's gradient slices; with cp use dp or fsdp=True"),
]


# what ModelConfig makes ffn_dim from (0: 8/3 n_embd)
FFN_KEYS = ("n_embd", "n_head", "n_kv_head", "ffn_dim", "head_dim")


def validate(c, overrides, world):
    """Checks the whole config `c` (`overrides`: the keys the user gave; grad_accum_steps as
    configurator.batch_for_layout makes it) for `world` processes, changing nothing."""
    for key, choices in CHOICES.items():
        check(c[key] in choices, f"{key}={c[key]!r} is not one of {', '.join(choices)}")
    for key in AT_LEAST_1:
        check(c[key] >= 1, f"{key}={c[key]} must be at least 1")
    for key in NOT_NEGATIVE:
        check(c[key] >= 0, f"{key}={c[key]} must not be negative")
    for key, (lo, hi) in IN_RANGE.items():
        check(lo <= c[key] < hi, f"{key}={c[key]} must be in [{lo}, {hi})")
    for key in POSITIVE:
        check(c[key] > 0, f"{key}={c[key]} must be positive")
    # 1e999 parses as inf: a rate, eps or alpha of inf trains NaN weights
    for key, value in c.items():
        check(not isinstance(value, float) or math.isfinite(value),
              f"{key}={value} is not finite: give a finite one")
    for refused, message in RULES:
        check(not refused(c), message.format(**c))
    for wanted, check_feature in FEATURE_CHECKS:
        if wanted(c, overrides):
            check_feature(c, overrides)
    # a model from a checkpoint or a directory brings its own n_experts (origin.saved_shape)
    moe_asked = c["ep"] > 1 or any(k in overrides for k in MOE_KEYS)
    own = not moe_asked or builds_own_model(c)
    check_refusals({**c, "n_experts": c["n_experts"] if own else None}, overrides)
    if c["datasets"] or c["phases"]:
        configurator.mixture_sources(c, note=False)
    # ModelConfig checks the shape's rules, and makes ffn_dim (0: n_embd's)
    ffn_dim = ModelConfig(**{k: c[k] for k in FFN_KEYS}).ffn_dim
    if world > 1 or c["ep"] > 1 or any(c[k] != PLAIN_LAYOUT[k] for k in PLAIN_LAYOUT):
        _check_given_layout(c, world, ffn_dim)
    if not c["plan"]:  # (plan=True prints what a run needs, on any machine)
        check_memory(c, world, c["n_layer"], c["n_embd"], ffn_dim, c["vocab_size"] or 200_000,
                     c["tie_embeddings"])
    check_files(c)


def _check_given_layout(c, world, ffn_dim):
    # a model directory's shape is not read yet: origin.saved_shape checks the layout against it
    shape = ([None] * 4 if os.path.isdir(c["init_from"])
             else [c["n_layer"], c["n_head"], c["n_kv_head"], ffn_dim])
    return check_layout(c, world, *shape)


def check_refusals(c, overrides):
    """The REFUSALS, for config `c` (again with a model's own tie_embeddings, n_experts and
    moe_score, once it comes from a checkpoint or a model directory)."""
    given = " ".join(f"{k}={overrides[k]!r}" for k in MOE_KEYS if k in overrides)
    for name, refused, message in REFUSALS:
        check(not refused(c, overrides), message.format(**c, moe_given=given))


def builds_own_model(c):
    """True when the model is the config's shape: init_from auto or scratch, and no checkpoint in
    out_dir to resume (origin.weights_source decides alike once the process group is up)."""
    if c["init_from"] not in ("auto", "scratch"):
        return False
    try:
        names = os.listdir(os.path.join(c["out_dir"], "ckpt"))
    except OSError:  # no ckpt directory: nothing to resume
        return True
    return not any(n.startswith("iter_") for n in names)


def check_layout(c, world, n_layer, n_head, n_kv_head, ffn_dim, where="", n_experts=None):
    """The dp x pp x cp x tp grid over `world` ranks for a model of this shape (`where`: whose
    shape, when it comes from a checkpoint; None: not known yet, only the rest is checked). Returns
    (dp, pp_layers as a list or None)."""
    pp, tp, n_experts = c["pp"], c["tp"], c["n_experts"] if n_experts is None else n_experts
    check(world % pp == 0, f"pp={pp} pipeline stages do not divide the {world} ranks: start a "
                           f"multiple of pp processes (torchrun --nproc_per_node=N), or change pp")
    check(world % (pp * tp) == 0, f"pp={pp} x tp={tp} does not divide the {world} ranks: start a "
                                  f"multiple of "
                                  f"pp * tp processes (torchrun --nproc_per_node=N), or change tp")
    if c["cp"] > 1:  # context parallel: context_parallel.py
        _check_cp(c, world)
    dp = world // (pp * tp * c["cp"])
    check(c["grad_accum_steps"] % dp == 0,
          f"grad_accum_steps={c['grad_accum_steps']} micro-batches per iteration cannot be shared "
          f"evenly by {dp} data-parallel ranks: use a multiple of {dp} (and lower batch_size to "
          "keep the global batch), or start fewer ranks")
    # (ep on a dense model is refused; a checkpoint's n_experts comes with it: origin.saved_shape)
    if c["ep"] > 1 and n_experts:  # expert parallel: expert_parallel.py
        _check_ep(c, dp, n_experts, where)
    if tp > 1 and n_head is not None:  # tensor parallel: tensor_parallel.py
        _check_tp(tp, n_head, n_kv_head, ffn_dim, where)
    if c["sp"]:  # sequence parallel: tensor_parallel.py
        _check_sp(c, pp, tp)
    if (pp > 1 or c["pp_virtual"] > 1 or c["pp_schedule"] == "interleaved"
        or c["pp_layers"].strip()):
        return dp, _check_pipeline(c, dp, n_layer, where)
    return dp, None


def _check_cp(c, world):
    """2 cp equal chunks of every sequence, on cp x tp x pp ranks that divide the world."""
    cp, pp, tp = c["cp"], c["pp"], c["tp"]
    check(world % (pp * tp * cp) == 0, f"cp={cp} x tp={tp} does not divide the {world} ranks: "
                                       f"start a multiple of cp * tp processes, or change cp")
    check(c["block_size"] % (2 * cp) == 0, f"cp={cp} cuts each sequence in 2 x cp = {2 * cp} "
                                           f"equal chunks, but block_size={c['block_size']} does "
                                           f"not divide by {2 * cp}: change block_size or cp")


def _check_ep(c, dp, n_experts, where):
    check(dp % c["ep"] == 0 and n_experts % c["ep"] == 0,
          f"ep={c['ep']} must divide the {dp} data-parallel ranks (the ep ranks are taken from "
          f"them) and n_experts={n_experts}{where} (each holds as many experts): change ep")


def _check_tp(tp, n_head, n_kv_head, ffn_dim, where):
    """Each tp rank holds whole heads and an equal slice of SwiGLU."""
    for key, n in (("n_head", n_head), ("n_kv_head", n_kv_head), ("ffn_dim", ffn_dim)):
        check(n % tp == 0, f"tp={tp} does not divide {key}={n}{where}: each tp rank needs an "
                           "equal share of the heads and of the SwiGLU width; use a tp that "
                           "divides n_head, n_kv_head and ffn_dim")


def _check_sp(c, pp, tp):
    """Each tp rank holds an equal slice of the sequence."""
    check(tp > 1, "sp=True splits the sequence over the tensor-parallel ranks, but tp=1: set tp= "
                  "(2 or more) or drop sp")
    check(pp == 1 and not c["neftune_alpha"],
          f"sp=True with pp={pp}, neftune_alpha={c['neftune_alpha']}: sequence parallelism does "
          f"not yet pass "
          f"sequence slices between pipeline stages, and NEFTune scales its noise by the sequence "
          f"length, which a rank holding a slice does not see; drop sp, or pp and neftune_alpha")
    check(c["block_size"] % tp == 0, f"sp=True with tp={tp} splits each sequence in tp equal "
                                     f"slices, but block_size={c['block_size']} does not divide "
                                     f"by {tp}: change block_size")


def _check_pipeline(c, dp, n_layer, where):
    """The stages and their layers (pipeline.py). Returns pp_layers as a list, or None."""
    pp, v = c["pp"], c["pp_virtual"]
    n = n_layer or pp * v  # (not known yet: nothing refused for it)
    check(pp <= n,
          f"pp={pp} stages but only n_layer={n_layer} layers{where}: every stage needs at least "
          f"one")
    check(pp * v <= n, f"pp={pp} x pp_virtual={v} virtual stages but only n_layer={n_layer} "
                       f"layers{where}: every virtual stage needs at least one; lower pp_virtual")
    check((c["pp_schedule"] == "interleaved") == (v > 1) and (v == 1 or pp > 1),
          f"pp_schedule={c['pp_schedule']} with pp_virtual={v} pp={pp}: interleaved 1F1B needs pp "
          f"> 1 and "
          f"pp_virtual >= 2 (chunks per stage), and pp_virtual > 1 needs pp_schedule=interleaved")
    check(c["pp_schedule"] != "interleaved" or c["grad_accum_steps"] // dp % pp == 0,
          f"pp_schedule=interleaved runs the micro-batches in groups of pp={pp}, but each "
          f"pipeline gets grad_accum_steps / dp = {c['grad_accum_steps'] // dp}: use a multiple "
          f"of {pp * dp} for grad_accum_steps")
    if not c["pp_layers"].strip():
        return None
    spec = c["pp_layers"]
    check(all(s.strip().isascii() and s.strip().isdigit() for s in spec.split(",")),
          f"pp_layers='{spec}' is not a comma-separated list of layer counts, e.g. pp_layers=3,1")
    counts = [int(s) for s in spec.split(",")]
    check(len(counts) == pp * v and min(counts) >= 1 and sum(counts) == (n_layer or sum(counts)),
          f"pp_layers='{spec}' must give {pp * v} layer counts (one per stage"
          f"{', per virtual stage' if v > 1 else ''}), each at least 1, summing to "
          f"n_layer={n_layer}{where}")
    return counts


def memory_bytes_available():
    """This machine's memory for one run: RAM (or the address-space limit, if lower) plus the
    GPUs'."""
    import resource
    ram, limit = (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                  resource.getrlimit(resource.RLIMIT_AS)[0])
    gpus = sum(torch.cuda.get_device_properties(i).total_memory
               for i in range(torch.cuda.device_count()))
    return (min(ram, limit) if limit > 0 else ram) + gpus


def check_memory(c, world, n_layer, n_embd, ffn_dim, vocab_size, tie, where=""):
    """A lower estimate of the bytes this run needs, against what the machine holds: weights,
    gradients and AdamW's two moments (16 bytes a parameter, however the ranks shard them),
    one micro-batch's logits (their softmax and gradient; with loss_chunk one chunk's, and with
    loss_recompute=False the softmax of all), and the eval batches held at once.
    A size that cannot fit is refused here, before any allocation, with the estimate."""
    params = (vocab_size * n_embd * (1 if tie else 2)
              + n_layer * (4 * n_embd * n_embd + 3 * n_embd * ffn_dim))
    rows = c["batch_size"] * c["block_size"]
    logit_rows = min(rows, c["loss_chunk"] or rows)
    kept = 0 if c["loss_recompute"] or not c["loss_chunk"] else 4 * rows  # (the kept softmax)
    need = {"weights and optimizer state": 16 * params,
            "a micro-batch's logits": (12 * logit_rows + kept) * vocab_size * world,
            "the eval batches": 16 * c["eval_iters"] * c["grad_accum_steps"] * rows}
    have = memory_bytes_available()
    check(sum(need.values()) <= have,
          f"this run needs at least {sum(need.values()) / 2 ** 30:,.1f} GiB ("
          + ", ".join(f"{k} {v / 2 ** 30:,.1f}" for k, v in need.items())
          + f") but this machine has {have / 2 ** 30:,.1f} GiB{where}: lower n_layer, n_embd, "
            "vocab_size, batch_size, block_size or eval_iters (or set loss_chunk= for the logits)")


def rank_memory(c, world):
    """The bytes one rank has here: the smallest GPU's, or its share of the machine's."""
    gpus = [torch.cuda.get_device_properties(i).total_memory
            for i in range(torch.cuda.device_count())]
    return min(gpus) if gpus and c["device"] != "cpu" else memory_bytes_available() / world


def may_not_fit(c, world):
    """Whether a generous bound (16 bytes a parameter, 64 a row of each width of each layer in
    flight, and of the vocabulary) passes a rank's memory: then the plan decides (train.py)."""
    saved = c["init_from"] not in ("auto", "scratch") or os.path.isdir(c["out_dir"] + "/ckpt")
    s = model_shape(c) if saved else c  # (a fresh run's shape is its config's)
    C, L, vocab = s["n_embd"], s["n_layer"], s["vocab_size"] or 200_000
    ffn = ModelConfig(**{k: s[k] for k in FFN_KEYS}).ffn_dim
    params = vocab * C * (1 if s["tie_embeddings"] else 2) + L * (4 * C * C + 3 * C * ffn)
    flight = c["grad_accum_steps"] if c["pp"] > 1 else 1  # (micro-batches a stage holds)
    act = 64 * c["batch_size"] * c["block_size"] * (flight * L * (2 * C + ffn) + vocab)
    return 16 * params + act >= rank_memory(c, world)


def model_shape(c):
    """The config `c` with the shape (SHAPE_KEYS) of the model this run trains, read before any
    process group, where origin.weights_source will find it: the checkpoint ckpt/latest names
    (this run's, to resume; or init_from= another run's: its meta.json), a Hugging Face
    directory's config.json (hf.hf_index: the weights' headers, no weights), else the config's
    own. A checkpoint that does not read leaves the config's: origin refuses it, by name."""
    init_from = c["init_from"]
    for run in ([c["out_dir"]] if init_from != "scratch" else []) + [init_from]:
        root = os.path.join(run, "ckpt")
        name = guard_ckpt.read_latest(root) if os.path.isdir(root) else None
        meta = guard_ckpt.read_small(os.path.join(root, name))[0] if name and "/" not in name \
            else None
        if meta:
            return {**c, **{k: v for k, v in meta["model"].items() if k in SHAPE_KEYS}}
    if os.path.isdir(init_from):
        from formats import hf
        return {**c, **{k: v for k, v in hf.hf_index(init_from)[0].items() if k in SHAPE_KEYS}}
    return c


def check_files(c):
    """Where the weights come from and where the run writes."""
    init_from, out_dir, export_hf = c["init_from"], c["out_dir"], c["export_hf"]
    # the file system takes up to 255 bytes a name
    for key in ("out_dir", "export_hf", "export_lora", "init_from"):
        check(max(len(os.fsencode(p)) for p in c[key].split(os.sep)) <= 255,
              f"{key}= has a name over 255 bytes: shorten it")
    check(init_from in ("auto", "scratch", "resume") or os.path.isdir(init_from),
          f"init_from='{init_from}' is not 'auto', 'scratch', 'resume' or a directory (another "
          f"run's out_dir, or a Hugging Face LLaMA directory)")
    check(out_dir.strip() != "",
          "out_dir='' names no directory: give one for checkpoints and logs, e.g. out_dir=out")
    check_writable("out_dir", out_dir)  # (a directory made and removed: os.access trusts root)
    check_place("out_dir", out_dir, "a run directory")
    if export_hf or c["export_lora"]:  # checked now, not after the run has trained
        check_exports({"export_hf": export_hf, "export_lora": c["export_lora"]}, runs=[out_dir])


def refusals_markdown():
    """REFUSALS as the Markdown table that docs/configuration.md shows (tests/test_docs.py
    checks that the doc holds exactly this)."""
    rows = ["| refused combination | what the run says (the reason and the fix) |", "|---|---|"]
    rows += [f"| {name} | {message} |" for name, _, message in REFUSALS]
    return "\n".join(rows)


# ---- a run that continues or starts from a model: its checks against what is saved there

SHAPE_KEYS = ("n_layer", "n_head", "n_kv_head", "n_embd", "ffn_dim", "tie_embeddings",
              "vocab_size", "n_experts",
              "moe_top_k", "moe_every", "moe_ffn_dim", "moe_score", "moe_norm_topk",
              "moe_shared_ffn_dim", "head_dim", "qk_norm")


def check_saved_shape(cfg, src, overrides, base_vocab, c, world):
    """A model from a checkpoint or a directory (`cfg`, its shape from src.saved): an explicit
    shape key that disagrees is a mistake; the layout, memory and refusals are checked against
    this shape."""
    for key in SHAPE_KEYS:
        # (vocab_size= names the tokenizer's base size, already checked against the data: a model
        # grown by chat or extra tokens, here or in an earlier stage, has more rows)
        check(key not in overrides or key not in src.saved or overrides[key] == src.saved[key] or
              (key == "vocab_size" and overrides[key] == base_vocab),
              f"{key}={overrides.get(key)} but {src.where} has {key}={src.saved.get(key)}: drop "
              f"the override, or use a new out_dir")
    check_layout(c, world, cfg.n_layer, cfg.n_head, cfg.n_kv_head, cfg.ffn_dim, f" in {src.where}",
                 cfg.n_experts)
    check_memory(c, world, cfg.n_layer, cfg.n_embd, cfg.ffn_dim, cfg.vocab_size,
                 cfg.tie_embeddings,
                 where=f" for the model in {src.where}")
    # the model's own: a tied model with pp, a mixture of experts with tp, ep on a dense one, ...
    own = {k: getattr(cfg, k) for k in ("tie_embeddings", "n_experts", "moe_score")}
    check_refusals({**c, **own}, overrides)


def check_same_run(src, c, overrides, out_dir):
    """A run that found a checkpoint in its own out_dir continues it only when it is this
    command's run: a UserError when the data, model shape, tokenizer, optimizer or starting
    model differ, which init_from=auto must not continue. init_from=resume continues whatever
    data."""
    had, it = src.meta.get("config") or {}, src.meta["iter"]
    differ = [] if c["init_from"] == "resume" else [
        k for k in ("dataset", "datasets", "tokenizer", "vocab_size", "optim")
        if c[k] != had.get(k, c[k])]
    if (c["init_from"] not in ("auto", "resume", "scratch")
        and c["init_from"] != had.get("init_from")):
        differ.append("init_from")  # (auto continues a run that started from a model too)
    differ += [k for k in SHAPE_KEYS
               if k in overrides and k != "vocab_size" and overrides[k] != src.saved.get(k)]
    # a resume keeps the rotary embedding its checkpoints were trained with, as it keeps the shape
    rope = rope_changes(src.saved, c)
    differ += list(rope)
    if differ:
        what = "datasets" if c["datasets"] else "dataset"
        also = ", ".join(f"{k}={c[k]} (the run has {rope.get(k, had.get(k, src.saved.get(k)))})"
                         for k in differ
                         if k not in ("dataset", "datasets"))
        # (its advice would be this command)
        itself = os.path.realpath(c["init_from"]) == os.path.realpath(out_dir)
        raise UserError(f"{out_dir} holds a run of {had.get('datasets') or had.get('dataset')} at "
                        f"iteration {it}; this command trains {what}={c[what]}"
                        f"{f' with {also}' if also else ''}: " + (
                            "init_from= names out_dir itself: drop init_from= to continue the run "
                            "there, or write the new run to another out_dir" if itself else
                            f"pick a new out_dir, or init_from={out_dir} to start from its "
                            f"weights"))


def rope_changes(saved, c):
    """{key: the model's value} for rope_theta and rope_scaling where the config would change the
    positions of the model `saved` (0 and '' keep its own; 'yarn:2' is 'yarn:2.0')."""
    from formats import hf_rope
    kind, factor = hf_rope.parse_scaling(c["rope_scaling"])
    theta, had = saved.get("rope_theta", 10000.0), saved.get("rope_type", "default")
    had_factor = saved.get("rope_factor", 1.0) if had != "default" else 1.0
    out = {}
    if c["rope_theta"] and float(c["rope_theta"]) != theta:
        out["rope_theta"] = theta
    if kind is not None and (kind, factor) != (had, had_factor):
        out["rope_scaling"] = "none" if had == "default" else f"{had}:{had_factor:g}"
    return out
