"""
Overrides of train.py's defaults from config files and the command line:

    python train.py config/tiny.py n_layer=2 learning_rate=3e-4 --init_from=resume

A config file is plain Python assignments (`batch_size = 8`) and is executed, so it
may compute values (`n_embd = 64 * 4`); it is your own file, like a script you run.
A command-line value is never executed: it goes through ast.literal_eval, and a bare
word that is not a literal stays a string (`init_from=resume`).

Every key must already exist in train.py's defaults (a typo is an error that suggests
the closest key, in a file too), and the new value must have the default's type; an
int is accepted where the default is a float, so `dropout=0` works, and a tuple where the
default is a list (a list key, such as `phases`, is a Python literal on the command line:
`phases='[(0, {"a": 1.0})]'`).
"""

import ast
import difflib
import math
import os
import re
import stat
import traceback

import torch

import common
from common import UserError, check, script_help
from model import ModelConfig


def _unknown(key, defaults, where, script):
    close = difflib.get_close_matches(key, list(defaults), n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'?" if close else f"python {script} --help lists them"
    return UserError(f"unknown config key '{key}' {where}: {hint}")


def _typed(key, value, default, where):
    """Check `value` against the default's type; returns the value to use."""
    if default is None or type(value) is type(default):
        return value
    if type(default) is float and type(value) is int:  # dropout=0
        return float(value)
    if type(default) is list and type(value) is tuple:  # phases = ((0, {...}),)
        return list(value)
    raise UserError(f"{key}={value!r} {where} has type {type(value).__name__}, but {key} needs "
                    f"{type(default).__name__} (default {default!r})")


def _parse_value(raw, default):
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw  # a bare word: a string (init_from=resume), or the type check names the mismatch
    # a string key takes the text as it is, quoted or not: out_dir=runs/a, init_from='resume', tag=1e3
    return raw if isinstance(default, str) and not isinstance(value, str) else value


def configure(defaults, argv, script="train.py"):
    """Returns {key: value} of the overrides in argv (config files and key=value), checked against
    `defaults` (`script`'s). Nothing here executes a command-line value. -h / --help: the keys."""
    overrides = {}
    for arg in argv:
        if "=" not in arg:
            if arg.startswith("-"):  # -h / --help: the keys, their defaults and comments (exit 0)
                raise SystemExit(print(script_help(script, defaults), flush=True)) if arg in ("-h", "--help") else \
                    UserError(f"argument '{arg}' is not key=value: write e.g. --max_iters=100 or max_iters=100")
            overrides.update(_config_file(arg, defaults, overrides, script))
            continue
        key, raw = arg.lstrip("-").split("=", 1)
        if key not in defaults:
            raise _unknown(key, defaults, "on the command line", script)
        overrides[key] = _typed(key, _parse_value(raw, defaults[key]), defaults[key], "on the command line")
    return overrides


def _config_file(path, defaults, overrides, script):
    """The keys a config file assigns: it runs in a namespace that sees the defaults (and the
    overrides before it), and what it changed is kept, type-checked like the command line."""
    try:  # (opened without blocking: a FIFO or /dev/zero is refused, not read forever)
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), encoding="utf-8") as f:
            check(stat.S_ISREG(os.fstat(f.fileno()).st_mode), f"config file '{path}' is not a regular file: pass "
                                                              f"a file such as config/tiny.py, or key=value")
            source = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read config file '{path}' ({getattr(e, 'strerror', None) or e}): pass an existing "
                        f"file such as config/tiny.py, or key=value") from None
    scope = {k: overrides.get(k, v) for k, v in defaults.items()}
    before = dict(scope)
    try:
        exec(compile(source, path, "exec"), scope)
    except Exception as e:  # the user's own file: name the line, not our traceback
        lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == path]
        line = e.lineno if isinstance(e, SyntaxError) else (lines or ["?"])[-1]
        raise UserError(f"config file {path}:{line}: {type(e).__name__}: {e}: fix that line") from None
    assigned = {}
    for key, value in scope.items():
        if key.startswith("_") or type(value).__name__ in ("module", "function", "type"):
            continue
        if key not in defaults:
            raise _unknown(key, defaults, f"in {path}", script)
        if key in before and value is before[key]:
            continue
        assigned[key] = _typed(key, value, defaults[key], f"in {path}")
    return assigned


def script_defaults(path):
    """{key: value} of the literal top-level assignments of a script such as train.py, read
    without running it (bench.py takes the default model and batch from here)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass  # computed, not a default
    return out


# ---- the one validation pass ----------------------------------------------------------
# Every constraint on the config is stated once (here; the model's shape in ModelConfig),
# checked before anything is written or a process group starts. Per key: its choices and
# ranges. Between keys: the layout, and the table of refused combinations (data:
# docs/configuration.md renders it, a test keeps the two in sync); each feature's own rules
# in a function entered only when it is on. What can only be known from a checkpoint or a
# model directory (its shape, its LoRA settings) is checked where that is read, with
# check_layout below for the layout part.

CHOICES = {"nan_action": ("rollback", "stop"), "ddp_impl": ("bucketed", "naive", "torch"),
           "pp_schedule": ("1f1b", "gpipe", "interleaved"), "dtype": ("auto", "float32", "bfloat16", "float16"),
           "optim": ("adamw", "muon"), "lr_schedule": ("cosine", "wsd"), "backend": ("auto", "gloo", "nccl"),
           "moe_score": ("softmax", "sigmoid")}
AT_LEAST_1 = ("n_layer", "n_head", "n_kv_head", "n_embd", "block_size", "batch_size", "grad_accum_steps",
              "eval_interval", "eval_iters", "log_interval", "ckpt_interval", "nan_max_consecutive", "pp", "tp",
              "pp_virtual", "loss_scale_interval", "loss_scale_growth", "cp", "moe_top_k",
              "moe_every", "ep")
NOT_NEGATIVE = ("max_iters", "vocab_size", "ffn_dim", "loss_chunk", "keep_ckpts", "warmup_iters", "lr_decay_iters",
                "min_lr", "weight_decay", "grad_clip", "peak_flops", "export_shard_mb",
                "lora_rank", "n_experts", "moe_ffn_dim", "moe_shared_ffn_dim", "moe_aux_weight", "moe_z_weight", "moe_bias_rate")
# (rates and scales end far past any sane value, where a finite one still overflows float32 in the step;
# sample_tokens where the end-of-run sample would run for hours: sample.py is for long ones)
IN_RANGE = {"dropout": (0, 1), "val_fraction": (0, 1), "beta1": (0, 1), "beta2": (0, 1), "muon_momentum": (0, 1),
            "cooldown_frac": (0, 1.000001), "lora_dropout": (0, 1), "loss_scale_backoff": (0, 1),
            "loss_scale_init": (1, 2.0 ** 64),  # fp16: the scale's floor is 1; loss x scale fits a float32
            "learning_rate": (0, 10 ** 6), "embed_lr_scale": (0, 10 ** 6), "lora_alpha": (0, 10 ** 6),
            "neftune_alpha": (0, 10 ** 6), "sample_tokens": (0, 10 ** 6 + 1)}
POSITIVE = ("dist_timeout_s", "ddp_bucket_mb", "lora_alpha", "mix_temperature")
LORA_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "output")  # the linears an adapter may wrap
# the keys that mean something only for a mixture of experts (n_experts > 0)
MOE_KEYS = ("moe_top_k", "moe_every", "moe_ffn_dim", "moe_score", "moe_norm_topk",
            "moe_shared_ffn_dim", "moe_aux_weight", "moe_z_weight", "moe_bias_rate")
PLAIN_LAYOUT = {"pp": 1, "tp": 1, "pp_virtual": 1, "pp_schedule": "1f1b", "pp_layers": "",  # one process's
                "sp": False, "cp": 1}

# Rules within the config: (refused when (c: the config), the message: what is wrong and the fix).
# A feature's own rules are checked with it, below (FEATURE_CHECKS); the model's shape by ModelConfig.
RULES = [
    (lambda c: c["zero"] not in (0, 1, 2),
     "zero={zero} is not a ZeRO stage we run by hand (0, 1 or 2): for stage 3 use fsdp=True"),
    (lambda c: c["min_lr"] > c["learning_rate"],
     "min_lr={min_lr} is above learning_rate={learning_rate}: the decay would raise the rate; lower min_lr"),
    (lambda c: not 0 <= c["seed"] < 2 ** 32, "seed={seed} is out of range: use an integer in [0, 2**32)"),
    (lambda c: c["device"].split(":")[0] == "mps" and not torch.backends.mps.is_available(),
     "device={device} but Apple's MPS is not available on this machine: use device=cpu or device=auto"),
]


def _check_lora(c, overrides):
    check(c["lora_rank"] <= c["n_embd"], f"lora_rank={c['lora_rank']} is above the width n_embd={c['n_embd']}: an "
                                         f"adapter's rank is at most its layer's width; lower lora_rank")
    lora_targets(c)


def lora_targets(c):
    """The linears c's lora_targets names, sorted (lora.py's `targets`)."""
    targets = sorted({t.strip() for t in c["lora_targets"].split(",") if t.strip()})
    check(targets and not set(targets) - set(LORA_TARGETS),
          f"lora_targets='{c['lora_targets']}': name one or more of {','.join(LORA_TARGETS)}, separated by commas")
    return targets


def _check_profiler(c, overrides):
    check(_window(c["profile_iters"], c["max_iters"]),
          f"profile_iters='{c['profile_iters']}' is not 'a:b' with 0 <= a < b <= max_iters={c['max_iters']}: e.g. "
          f"'5:8' profiles iterations 5, 6 and 7")


def _check_moe(c, overrides):
    check(c["moe_top_k"] <= c["n_experts"], f"moe_top_k={c['moe_top_k']} is more than n_experts={c['n_experts']}: "
                                            f"a token picks top_k of the experts; lower moe_top_k")
    check(c["moe_every"] <= c["n_layer"], f"moe_every={c['moe_every']} is more than n_layer={c['n_layer']}: no layer "
                                          f"would be a mixture of experts; lower moe_every")


def _check_rope(c, overrides):  # long context: hf_rope.py
    import hf_rope
    hf_rope.check_run_rope(c)


# (entered when: the config turns the feature on, or names one of its keys; then its checks)
FEATURE_CHECKS = [
    (lambda c, o: c["lora_rank"] or "lora_targets" in o, _check_lora),
    (lambda c, o: c["profile_iters"], _check_profiler),
    (lambda c, o: c["n_experts"], _check_moe),
    (lambda c, o: c["rope_theta"] or c["rope_scaling"], _check_rope),
]

def _window(spec, max_iters):
    m = re.fullmatch(r"(\d+):(\d+)", spec)
    return m is not None and int(m[1]) < int(m[2]) <= max_iters


# The combinations of options that are refused: (name, refused when (c: the config, o: the
# keys given), the message: what is wrong and the fix; {key} is the config's value).
REFUSALS = [
    ("dataset with datasets", lambda c, o: c["datasets"] and "dataset" in o,
     "dataset={dataset} and datasets={datasets} both given: use datasets= for a mixture, dataset= for one source"),
    ("ddp_impl=torch inside a pipeline", lambda c, o: c["pp"] > 1 and c["ddp_impl"] == "torch",
     "ddp_impl=torch cannot sit inside a pipeline (torch DDP decides in forward whether to sync, and 1F1B "
     "interleaves forwards with backwards): use ddp_impl=bucketed or naive"),
    ("fsdp with ddp_impl", lambda c, o: c["fsdp"] and "ddp_impl" in o,
     "fsdp=True shards with FSDP2, so ddp_impl={ddp_impl} would be ignored: drop one of the two"),
    ("zero with fsdp", lambda c, o: c["zero"] and c["fsdp"],
     "zero={zero} with fsdp=True: fsdp is ZeRO stage 3 and already shards optimizer state and gradients; use one "
     "of the two"),
    ("zero with ddp_impl other than bucketed", lambda c, o: c["zero"] and c["ddp_impl"] != "bucketed",
     "zero={zero} shards along the buckets of ddp_impl=bucketed, so ddp_impl={ddp_impl} cannot carry it: drop "
     "ddp_impl"),
    ("offload without zero or fsdp", lambda c, o: c["offload"] and not (c["zero"] or c["fsdp"]),
     "offload=True moves sharded optimizer state to CPU memory: use it with zero=1, zero=2 or fsdp=True"),
    ("a mixture of experts with tp", lambda c, o: c["n_experts"] and c["tp"] > 1,
     "n_experts={n_experts} with tp={tp}: the experts are not cut into tensor-parallel slices (ep x tp included); "
     "split them over ranks with ep= instead, or drop tp"),
    ("a mixture of experts with cp", lambda c, o: c["n_experts"] and c["cp"] > 1,
     "n_experts={n_experts} with cp={cp}: the balancing loss is taken over a whole micro-batch, which cp splits "
     "over ranks; use dp, ep= or pp with a mixture of experts, or drop cp"),
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
    ("ep with ddp_impl=torch", lambda c, o: c["ep"] > 1 and c["ddp_impl"] == "torch",
     "ep={ep} with ddp_impl=torch: the experts of an ep rank are its own, and torch's DDP averages every parameter "
     "over all dp ranks; use ep with ddp_impl=bucketed or naive (or zero, fsdp)"),
    ("export_lora with a new RoPE",
     lambda c, o: c["export_lora"] and (c["rope_theta"] or c["rope_scaling"]),
     "export_lora={export_lora} with rope_theta={rope_theta}, rope_scaling={rope_scaling!r}: PEFT "
     "puts the adapters on their base as it is, whose RoPE this run changes; export the merged "
     "model with export_hf= instead, or drop export_lora"),
    ("cp with pp, tp or zero", lambda c, o: c["cp"] > 1 and (c["pp"] > 1 or c["tp"] > 1 or c["zero"]),
     "cp={cp} with pp={pp}, tp={tp}, zero={zero}: context parallelism does not yet split the sequences passed "
     "between stages, compose with tensor parallelism (tp=N sp=True without cp splits the sequences over tp) or "
     "average ZeRO's gradient slices; with cp use dp or fsdp=True"),
]


# The mixture keys (datasets=, phases=) are parsed here, in the one pass; mixture.py draws
# from the sources they name.


def parse_mixture(spec, phases=()):
    """{source: weight} from 'stdlib:0.7,notes:0.3' (a source without ':w' weighs 1). A source
    is a dataset name under data/ or a directory; its name in logs and phases is its base name.
    One source is a mixture only with phases (their lr_scale); else it is dataset=, said so."""
    mixture = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            raise UserError(f"datasets={spec!r} has an empty entry: write e.g. datasets=stdlib:0.7,notes:0.3")
        source, _, w = part.rpartition(":") if ":" in part else (part, "", "1")
        try:
            weight = float(w)
        except ValueError:
            raise UserError(f"datasets: weight {w!r} of '{source}' is not a number: write e.g. {source}:0.5") from None
        if not weight > 0 or not math.isfinite(weight):
            raise UserError(f"datasets: '{source}' has weight {w}: weights must be positive (leave a source out "
                            f"to not use it)")
        if source_name(source) in map(source_name, mixture):
            raise UserError(f"datasets: '{source_name(source)}' is listed twice: list each source once")
        mixture[source] = weight
    if len(mixture) == 1 and not phases:
        raise UserError(f"datasets={spec!r} names one source, which is no mixture: write dataset={source} (datasets= "
                        f"takes two or more, e.g. datasets={source}:0.7,stdlib:0.3)")
    return mixture


def source_name(source):
    return os.path.basename(source.rstrip("/\\")) or source


def parse_phases(phases, names, max_iters=None):
    """[(start_iter, {name: weight}, lr_scale)] from `phases`: a list (a config file) or a
    string holding one (the command line), of (start, {name: weight}) or (start, weights,
    lr_scale) tuples, starts strictly increasing and >= 0. Sources a phase leaves out weigh 0.
    With max_iters (the config check): a note names the phases the run ends before."""
    if isinstance(phases, str):
        try:
            phases = ast.literal_eval(phases) if phases.strip() else []
        except (ValueError, SyntaxError):
            raise UserError(f"phases={phases!r} is not a Python literal: write e.g. "
                            f"'[(0, {{\"a\": 1.0}}), (400, {{\"a\": 0.5, \"b\": 0.5}}, 0.5)]'") from None
    example = "(400, {\"a\": 0.5, \"b\": 0.5}, 0.5)"
    if not isinstance(phases, (list, tuple)):
        raise UserError(f"phases must be a list of {example}-like tuples, not {type(phases).__name__}")
    out = []
    for p in phases:
        if not (isinstance(p, (list, tuple)) and len(p) in (2, 3) and isinstance(p[0], int)
                and not isinstance(p[0], bool) and isinstance(p[1], dict)):
            raise UserError(f"phase {p!r} is not (start_iter, {{source: weight}}) or (start_iter, weights, "
                            f"lr_scale): write e.g. {example}")
        start, weights, scale = p[0], p[1], (p[2] if len(p) == 3 else 1.0)
        if start < 0:
            raise UserError(f"phase at iteration {start} starts before 0: phases start at iteration 0 or later")
        if out and start <= out[-1][0]:
            raise UserError(f"phase at iteration {start} comes after the one at {out[-1][0]}: list phases by "
                            f"increasing start iteration, one phase per start")
        for name, w in weights.items():
            if name not in names:
                raise UserError(f"phase at iteration {start} names source '{name}', which is not one of "
                                f"{', '.join(names)}: add it to datasets= or fix the name")
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not w > 0 or not math.isfinite(w):
                raise UserError(f"phase at iteration {start}: '{name}' has weight {w!r}: weights must be positive "
                                f"(leave a source out of a phase to not draw from it)")
        if not weights:
            raise UserError(f"phase at iteration {start} has no sources: give at least one {{source: weight}}")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
            raise UserError(f"phase at iteration {start}: lr_scale {scale!r} must be a positive number")
        out.append((start, {n: float(w) for n, w in weights.items()}, float(scale)))
    late = [start for start, _, _ in out if max_iters is not None and start >= max_iters]
    if late and os.environ.get("RANK", "0") == "0":
        print(f"note: the phases at iteration {', '.join(map(str, late))} start at or after max_iters={max_iters}: "
              f"this run ends before them (raise max_iters, or start them earlier)", flush=True)
    return out


def validate(c, overrides, world):
    """Checks the whole config `c` (`overrides`: the keys the user gave) for `world` processes,
    changing nothing; returns what it derives: {"dp", "layer_counts": pp_layers' list or None,
    "sources": {dataset: weight}, "grad_accum_steps": the one this layout runs}."""
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
    for key, value in c.items():  # 1e999 parses as inf: a rate, eps or alpha of inf trains NaN weights
        check(not isinstance(value, float) or math.isfinite(value), f"{key}={value} is not finite: give a finite one")
    for refused, message in RULES:
        check(not refused(c), message.format(**c))
    for wanted, check_feature in FEATURE_CHECKS:
        if wanted(c, overrides):
            check_feature(c, overrides)
    # a model from a checkpoint or a directory brings its own n_experts (origin.saved_shape)
    moe_asked = c["ep"] > 1 or any(k in overrides for k in MOE_KEYS)
    own = not moe_asked or builds_own_model(c)
    check_refusals({**c, "n_experts": c["n_experts"] if own else None}, overrides)
    sources = mixture_sources(c) if c["datasets"] or c["phases"] else {c["dataset"]: 1.0}
    # ModelConfig checks the shape's rules, and makes ffn_dim (0: n_embd's)
    shape = ("n_embd", "n_head", "n_kv_head", "ffn_dim", "head_dim")
    ffn_dim = ModelConfig(**{k: c[k] for k in shape}).ffn_dim
    dp, layer_counts = 1, None  # one process, one stage, no tensor parallel: no layout to check
    if world > 1 or c["ep"] > 1 or any(c[k] != PLAIN_LAYOUT[k] for k in PLAIN_LAYOUT):
        c = {**c, "grad_accum_steps": batch_for_layout(c, overrides, world)}
        dp, layer_counts = _check_given_layout(c, world, ffn_dim)
    check_memory(c, world, c["n_layer"], c["n_embd"], ffn_dim, c["vocab_size"] or 200_000, c["tie_embeddings"])
    check_files(c)
    return {"dp": dp, "layer_counts": layer_counts, "sources": sources, "grad_accum_steps": c["grad_accum_steps"]}


def mixture_sources(c):
    """A mixture's {source: weight} (mixture.py), its phases checked against them: nothing read yet."""
    sources = parse_mixture(c["datasets"], c["phases"]) if c["datasets"] else {c["dataset"]: 1.0}
    parse_phases(c["phases"], [source_name(s) for s in sources], c["max_iters"])
    return sources


def _check_given_layout(c, world, ffn_dim):
    # a model directory's shape is not read yet: origin.saved_shape checks the layout against it
    shape = [None] * 4 if os.path.isdir(c["init_from"]) else [c["n_layer"], c["n_head"], c["n_kv_head"], ffn_dim]
    return check_layout(c, world, *shape)


def batch_for_layout(c, overrides, world):
    """The grad_accum_steps this layout runs: the default (2) raised to the next multiple of dp
    (of dp x pp with interleaved 1F1B) where the layout needs one, with a note, so that every
    layout runs with the defaults. A value the user gave is kept (and checked, never changed)."""
    pp, tp = c["pp"], c["tp"] * c["cp"]
    if "grad_accum_steps" in overrides or world % (pp * tp):
        return c["grad_accum_steps"]
    unit = world // (pp * tp) * (pp if c["pp_schedule"] == "interleaved" else 1)
    return _raised(c, unit) if c["grad_accum_steps"] % unit else c["grad_accum_steps"]


def _raised(c, unit):
    raised = -(-c["grad_accum_steps"] // unit) * unit
    if os.environ.get("RANK", "0") == "0":
        print(f"note: grad_accum_steps={c['grad_accum_steps']} (the default) raised to {raised}, a multiple of the "
              f"{unit} micro-batch streams of this layout (global batch {c['batch_size'] * raised} sequences); "
              f"set grad_accum_steps= to choose", flush=True)
    return raised


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
    check(world % pp == 0, f"pp={pp} pipeline stages do not divide the {world} ranks: start a multiple of pp "
                           f"processes (torchrun --nproc_per_node=N), or change pp")
    check(world % (pp * tp) == 0, f"pp={pp} x tp={tp} does not divide the {world} ranks: start a multiple of "
                                  f"pp * tp processes (torchrun --nproc_per_node=N), or change tp")
    if c["cp"] > 1:  # context parallel: context_parallel.py
        _check_cp(c, world)
    dp = world // (pp * tp * c["cp"])
    check(c["grad_accum_steps"] % dp == 0,
          f"grad_accum_steps={c['grad_accum_steps']} micro-batches per iteration cannot be shared evenly by {dp} "
          f"data-parallel ranks: use a multiple of {dp} (and lower batch_size to keep the global batch), or start "
          f"fewer ranks")
    # (ep on a dense model is refused; a checkpoint's n_experts comes with it: origin.saved_shape)
    if c["ep"] > 1 and n_experts:  # expert parallel: expert_parallel.py
        _check_ep(c, dp, n_experts, where)
    if tp > 1 and n_head is not None:  # tensor parallel: tensor_parallel.py
        _check_tp(tp, n_head, n_kv_head, ffn_dim, where)
    if c["sp"]:  # sequence parallel: tensor_parallel.py
        _check_sp(c, pp, tp)
    if pp > 1 or c["pp_virtual"] > 1 or c["pp_schedule"] == "interleaved" or c["pp_layers"].strip():
        return dp, _check_pipeline(c, dp, n_layer, where)
    return dp, None


def _check_cp(c, world):
    """2 cp equal chunks of every sequence, on cp x tp x pp ranks that divide the world."""
    cp, pp, tp = c["cp"], c["pp"], c["tp"]
    check(world % (pp * tp * cp) == 0, f"cp={cp} x tp={tp} does not divide the {world} ranks: start a multiple "
                                       f"of cp * tp processes, or change cp")
    check(c["block_size"] % (2 * cp) == 0, f"cp={cp} cuts each sequence in 2 x cp = {2 * cp} equal chunks, but "
                                           f"block_size={c['block_size']} does not divide by {2 * cp}: change "
                                           f"block_size or cp")


def _check_ep(c, dp, n_experts, where):
    check(dp % c["ep"] == 0 and n_experts % c["ep"] == 0,
          f"ep={c['ep']} must divide the {dp} data-parallel ranks (the ep ranks are taken from them) and "
          f"n_experts={n_experts}{where} (each holds as many experts): change ep")


def _check_tp(tp, n_head, n_kv_head, ffn_dim, where):
    """Each tp rank holds whole heads and an equal slice of SwiGLU."""
    for key, n in (("n_head", n_head), ("n_kv_head", n_kv_head), ("ffn_dim", ffn_dim)):
        check(n % tp == 0, f"tp={tp} does not divide {key}={n}{where}: each tp rank needs an equal share of the "
                           f"heads and of the SwiGLU width; use a tp that divides n_head, n_kv_head and ffn_dim")


def _check_sp(c, pp, tp):
    """Each tp rank holds an equal slice of the sequence."""
    check(tp > 1, "sp=True splits the sequence over the tensor-parallel ranks, but tp=1: set tp= (2 or more) "
                  "or drop sp")
    check(pp == 1 and not c["neftune_alpha"],
          f"sp=True with pp={pp}, neftune_alpha={c['neftune_alpha']}: sequence parallelism does not yet pass "
          f"sequence slices between pipeline stages, and NEFTune scales its noise by the sequence length, which a "
          f"rank holding a slice does not see; drop sp, or pp and neftune_alpha")
    check(c["block_size"] % tp == 0, f"sp=True with tp={tp} splits each sequence in tp equal slices, but "
                                     f"block_size={c['block_size']} does not divide by {tp}: change block_size")


def _check_pipeline(c, dp, n_layer, where):
    """The stages and their layers (pipeline.py). Returns pp_layers as a list, or None."""
    pp, v = c["pp"], c["pp_virtual"]
    n = n_layer or pp * v  # (not known yet: nothing refused for it)
    check(pp <= n, f"pp={pp} stages but only n_layer={n_layer} layers{where}: every stage needs at least one")
    check(pp * v <= n, f"pp={pp} x pp_virtual={v} virtual stages but only n_layer={n_layer} layers{where}: "
                       f"every virtual stage needs at least one; lower pp_virtual")
    check((c["pp_schedule"] == "interleaved") == (v > 1) and (v == 1 or pp > 1),
          f"pp_schedule={c['pp_schedule']} with pp_virtual={v} pp={pp}: interleaved 1F1B needs pp > 1 and "
          f"pp_virtual >= 2 (chunks per stage), and pp_virtual > 1 needs pp_schedule=interleaved")
    check(c["pp_schedule"] != "interleaved" or c["grad_accum_steps"] // dp % pp == 0,
          f"pp_schedule=interleaved runs the micro-batches in groups of pp={pp}, but each pipeline gets "
          f"grad_accum_steps / dp = {c['grad_accum_steps'] // dp}: use a multiple of {pp * dp} for grad_accum_steps")
    if not c["pp_layers"].strip():
        return None
    spec = c["pp_layers"]
    check(all(s.strip().isascii() and s.strip().isdigit() for s in spec.split(",")),
          f"pp_layers='{spec}' is not a comma-separated list of layer counts, e.g. pp_layers=3,1")
    counts = [int(s) for s in spec.split(",")]
    check(len(counts) == pp * v and min(counts) >= 1 and sum(counts) == (n_layer or sum(counts)),
          f"pp_layers='{spec}' must give {pp * v} layer counts (one per stage"
          f"{', per virtual stage' if v > 1 else ''}), each at least 1, summing to n_layer={n_layer}{where}")
    return counts


def memory_bytes_available():
    """This machine's memory for one run: RAM (or the address-space limit, if lower) plus the GPUs'."""
    import resource
    ram, limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), resource.getrlimit(resource.RLIMIT_AS)[0]
    gpus = sum(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    return (min(ram, limit) if limit > 0 else ram) + gpus


def check_memory(c, world, n_layer, n_embd, ffn_dim, vocab_size, tie, where=""):
    """A lower estimate of the bytes this run needs, against what the machine holds: weights,
    gradients and AdamW's two moments (16 bytes a parameter, however the ranks shard them),
    one micro-batch's logits (their softmax and gradient; with loss_chunk one chunk's), and the
    eval batches held at once.
    A size that cannot fit is refused here, before any allocation, with the estimate."""
    params = vocab_size * n_embd * (1 if tie else 2) + n_layer * (4 * n_embd * n_embd + 3 * n_embd * ffn_dim)
    rows = c["batch_size"] * c["block_size"]
    logit_rows = min(rows, c["loss_chunk"] or rows)
    need = {"weights and optimizer state": 16 * params, "a micro-batch's logits": 12 * logit_rows * vocab_size * world,
            "the eval batches": 16 * c["eval_iters"] * c["grad_accum_steps"] * rows}
    have = memory_bytes_available()
    check(sum(need.values()) <= have,
          f"this run needs at least {sum(need.values()) / 2 ** 30:,.1f} GiB ("
          + ", ".join(f"{k} {v / 2 ** 30:,.1f}" for k, v in need.items())
          + f") but this machine has {have / 2 ** 30:,.1f} GiB{where}: lower n_layer, n_embd, vocab_size, "
            f"batch_size, block_size or eval_iters (or set loss_chunk= for the logits)")


def check_files(c):
    """Where the weights come from and where the run writes."""
    init_from, out_dir, export_hf = c["init_from"], c["out_dir"], c["export_hf"]
    for key in ("out_dir", "export_hf", "export_lora", "init_from"):  # the file system takes up to 255 bytes a name
        check(max(len(os.fsencode(p)) for p in c[key].split(os.sep)) <= 255, f"{key}= has a name over 255 bytes: shorten it")
    check(init_from in ("auto", "scratch", "resume") or os.path.isdir(init_from),
          f"init_from='{init_from}' is not 'auto', 'scratch', 'resume' or a directory (another run's out_dir, or a "
          f"Hugging Face LLaMA directory)")
    check(out_dir.strip() != "", "out_dir='' names no directory: give one for checkpoints and logs, e.g. out_dir=out")
    common.check_writable("out_dir", out_dir)  # (a directory made and removed: os.access trusts root)
    if export_hf or c["export_lora"]:  # checked now, not after the run has trained
        common.check_exports({"export_hf": export_hf, "export_lora": c["export_lora"]}, runs=[out_dir])


def refusals_markdown():
    """REFUSALS as the Markdown table that docs/configuration.md shows (tests/test_docs.py
    checks that the doc holds exactly this)."""
    rows = ["| refused combination | what the run says (the reason and the fix) |", "|---|---|"]
    rows += [f"| {name} | {message} |" for name, _, message in REFUSALS]
    return "\n".join(rows)
