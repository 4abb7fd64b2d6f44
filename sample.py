"""
Generate text from the latest checkpoint of a run, or export its weights to one file:

    python sample.py out_dir=out prompt='def fib(n):' max_new_tokens=200
    python sample.py out_dir=out export=out/model.pt  # {name: tensor}, torch.load's
    python sample.py out_dir=out export_hf=runs/hf_model  # a Hugging Face directory
    python sample.py init_from=runs/base dataset=papers eval=True  # val loss of any model
    python sample.py out_dir=out eval=True eval_tasks=arc_easy.jsonl  # multiple-choice: evals.py

Any checkpoint works, whatever layout wrote it (one process, dp, pp, fsdp): it is read
into one whole model here. train.py's end-of-run sample and export use the functions below.
"""

import math
import os
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import replace

# first: --help, and a Ctrl-C while torch imports (seconds), need no torch
from guards import guard_errors
if __name__ == "__main__":
    guard_errors.start_command(sys.argv[1:], "sample.py")
import numpy as np
import torch

import checkpoint
import configurator
import data
import origin
import parallel
import tokenizer
from model import ModelConfig, Transformer, grow_vocab
from formats import hf
from formats import hf_tokenizer
from guards import guard_ckpt
from guards import guard_data
from guards import guard_files
from techniques.lora import load_lora_whole, merge_lora, save_peft_lora


def load_model(path):
    """(whole model on CPU, checkpoint meta) of the checkpoint directory `path`, whatever
    layout wrote it, read by this process alone. A LoRA run's adapters are merged into its
    base (re-read from where it is): W + (alpha / r) B A."""
    model, meta = load_lora_whole(path)
    merge_lora(model)  # nothing to do without LoRA
    return model, meta


def sample_text(model, enc, prompt="", max_new_tokens=200, temperature=0.8, top_k=50,
                autocast=None):
    """One sample from `model` (on its device, in eval mode) as text. An empty prompt starts
    from <|endoftext|>, i.e. the beginning of a document, which is not printed."""
    bos = getattr(enc, "bos_token", None)  # a model's tokenizer that starts documents with one
    start = (enc.encode(prompt, allowed_special="all") if prompt
             else [enc.eot_token if bos is None else bos])
    idx = torch.tensor([start], device=next(model.parameters()).device)
    with autocast or nullcontext():
        out = model.generate(idx, max_new_tokens, temperature, top_k or None)
    ids = out[0].tolist() if prompt else out[0, 1:].tolist()
    # a padded embedding's rows past the ids: no text
    return enc.decode([i for i in ids if i < enc.n_vocab])


def end_of_run(model, out_dir, lora, cfg, meta, export_hf, export_lora, shard_mb, sample_tokens,
               autocast, device):
    """train.py's end on rank 0: the trained model (`model`, or None where this rank held only a
    part of it: read back whole from the checkpoint just written) exported as PEFT adapters
    (export_lora) and as a Hugging Face LLaMA (export_hf), merged when LoRA, then a sample."""
    if model is None:
        # LoRA: the adapters onto their base
        load = load_lora_whole if lora else checkpoint.load_whole
        model = load(checkpoint.find(out_dir, None))[0].to(device)
    model.eval()
    if export_lora and lora:
        named = save_peft_lora(export_lora, model, lora)
        print(f"exported the LoRA adapters in PEFT's format to {export_lora}, on the base "
              + (named or "(unnamed: the base run made no export_hf; start LoRA from its export "
                          "for AutoPeftModelForCausalLM)"), flush=True)
    if lora:  # W + (alpha / r) B A, which export_hf writes and sampling runs
        merge_lora(model)
    if export_hf:
        hf.save_hf(export_hf, {k: v.cpu() for k, v in model.state_dict().items()}, cfg,
                         tokenizer.tokenizer_from_meta(meta), shard_mb)
        print(f"exported the model as a Hugging Face LLaMA to {export_hf}", flush=True)
    if sample_tokens > 0:
        final_sample(model, tokenizer.tokenizer_from_meta(meta), sample_tokens, autocast, out_dir)


def final_sample(model, enc, max_new_tokens, autocast, out_dir):
    """The end-of-run sample, once the run is over and saved: a line first (a big model samples for
    minutes on a CPU), and Ctrl-C ends it at once (not the loop's "finish the step, then save")."""
    print(f"sampling {max_new_tokens} tokens from the final model (Ctrl-C skips it: the run is "
          f"saved) ...",
          flush=True)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        text = sample_text(model, enc, "", max_new_tokens, 0.8, 50, autocast)
    except KeyboardInterrupt:
        print(f"sample skipped (Ctrl-C): the run is finished and saved; `python sample.py "
              f"out_dir={out_dir}` samples it", flush=True)
        return
    print("-" * 30 + " sample " + "-" * 30 + "\n" + text + "\n" + "-" * 68, flush=True)


def load_from(init_from):
    """(whole model on CPU, its tokenizer spec, the run's config or {}) of init_from: a Hugging
    Face LLaMA directory (a base, an export) or a run's out_dir (its newest intact checkpoint)."""
    if os.path.isdir(os.path.join(init_from, "ckpt")):
        path = checkpoint.find(init_from, None)
        guard_errors.check(path is not None,
                           f"init_from={init_from} has no checkpoint in ckpt/: train it first")
        model, meta = load_model(path)
        return model, tokenizer.checkpoint_spec(meta), meta.get("config") or {}
    saved, index = hf.hf_index(init_from)
    guard_errors.check(hf_tokenizer.find(init_from) is not None,
                       f"{init_from} has no tokenizer.json (or tokenizer.model): "
                       f"put the model's beside its config.json, so its ids are known")
    src = origin.Source("hf", init_from, saved=saved,
                        where=f"the Hugging Face model in {init_from}", hf_index=index)
    spec = tokenizer.model_spec(src, "cl100k_base", 0)
    model = Transformer(ModelConfig(**saved))
    origin.load_whole_into(model, src)
    return model, spec, {}


@torch.no_grad()
def val_loss(model, data_dir, block_size, batch_size, doc_mask, autocast=None):
    """(loss, target tokens): the mean cross-entropy over every target token of the whole val
    split of data_dir, in sequences of block_size (the loader's chunks, each once), weighted by
    tokens as training's loss and its evaluation are: each target token counts once, the loss
    masks (chat: the assistant's tokens) deciding which count."""
    loader = data.Loader(data_dir, "val", block_size, batch_size, 1, seed=0)
    eot, device = guard_data.read_meta(data_dir)["eot_token"], next(model.parameters()).device
    loss_sum, count = torch.zeros((), dtype=torch.float64), 0
    for start in range(0, loader.n_chunks, batch_size):
        x, y, mask = loader.rows(np.arange(start, min(start + batch_size, loader.n_chunks)))
        mask = torch.ones(y.shape) if mask is None else mask
        with autocast or nullcontext():
            losses, _ = model(x.to(device), y.to(device), None,
                              data.doc_ids(x, eot).to(device) if doc_mask else None)
        loss_sum += (losses.double().cpu() * mask).sum()
        count += int(mask.sum())
    return loss_sum.item() / max(count, 1), count


def pair_metrics(model, data_dir, block, c, run, what):
    """eval=True on preference pairs: the loss and TRL's metrics on the whole val split, against
    ref_from= (or the run's starting model; neither: reference-free, each log-prob per token)."""
    from techniques import preference
    start = run.get("init_from", "auto")
    where = c["ref_from"] or ("" if start in ("auto", "resume", "scratch") else start)
    ref = None
    if where:
        ref = load_from(where)[0]
        ref.cfg = replace(ref.cfg, block_size=block)
        ref.init_rope()
        if ref.cfg.vocab_size < model.cfg.vocab_size:  # as the model's own first evaluation
            grow_vocab(ref, model.cfg.vocab_size)
        ref.to(next(model.parameters()).device).eval()
    keys = ("loss_type", "beta", "label_smoothing", "simpo_gamma")
    m = preference.val_metrics(model, data_dir, {"block_size": block, "batch_size": c[
        "batch_size"], "preference": {k: run[k] for k in keys if k in run}}, ref)
    return (f"preference pairs of {data_dir} (val) for {what}, against "
            f"{where or 'no reference'}: " + ", ".join(f"{k} {v:.4f}" for k, v in m.items()))


def evaluate_checkpoint(c):
    """eval=True: one line with the val loss (and bits per byte) of the model on each dataset of
    c["dataset"], one with its scores on each task of c["eval_tasks"]."""
    guard_errors.check(c["dataset"] or c["eval_tasks"],
                       "eval=True needs dataset= (a prepared dataset, or several: "
                       "dataset=a,b) or eval_tasks= (JSONL multiple-choice tasks)")
    if "/" in c["init_from"]:  # ORG/NAME: the model in the local hub cache (hf_cache.py)
        from formats import hf_cache
        c = {**c, "init_from": hf_cache.snapshot("init_from", c["init_from"], c["revision"])}
    what = c["init_from"] or c["ckpt"] or c["out_dir"]
    if c["init_from"]:
        model, spec, run = load_from(c["init_from"])
    else:
        path = c["ckpt"] or checkpoint.find(c["out_dir"], None)
        guard_errors.check(path is not None,
                           f"no checkpoint in {c['out_dir']}/ckpt: train first, or pass "
                           f"init_from=")
        model, meta = load_model(path)
        spec, run = tokenizer.checkpoint_spec(meta), meta.get("config") or {}
    block = c["block_size"] or run.get("block_size") or min(model.cfg.max_position or 1024, 1024)
    model.cfg = replace(model.cfg, block_size=block)  # the rotary tables for this length
    model.init_rope()
    results, t0 = [], time.time()
    import evals  # bits per byte, multiple-choice tasks: evals.py
    for name in filter(None, c["dataset"].split(",")):
        data_dir = data.dataset_dir(name)
        meta = guard_data.read_meta(data_dir)
        tokenizer.check_model_tokenizer(meta, data_dir, spec, what)
        # tokens the model has never seen: as training's first eval
        if model.cfg.vocab_size < meta["vocab_size"]:
            print(f"note: {data_dir} has {meta['vocab_size'] - model.cfg.vocab_size} "
                  f"tokens {what} lacks: their rows "
                  f"start as the mean row, as a run's first evaluation does")
            grow_vocab(model, meta["vocab_size"])
        model.to(parallel.pick_device(c["device"])).eval()
        if meta.get("format") == "preference":  # pairs: preference.py (TRL's metrics)
            print(pair_metrics(model, data_dir, block, c, run, what), flush=True)
            continue
        print(f"evaluating {what} ({model.num_params() / 1e6:.1f}M parameters) on the whole val "
              f"split of "
              f"{data_dir}: {meta.get('val_tokens', 0):,} tokens in sequences of {block} ...",
              flush=True)
        loss, n = val_loss(model, data_dir, block, c["batch_size"], c["doc_mask"])
        guard_errors.check(math.isfinite(loss),
                           f"the val loss of {what} on {data_dir} is {loss}: its "
                           f"weights hold non-finite values (NaN or inf); load an intact model")
        # evals.py
        counted = evals.split_bytes(data_dir, block, tokenizer.tokenizer_from_meta(meta))
        bpb = evals.bits_per_byte(loss, *counted)
        results.append(f"{name} {loss:.4f} ({n:,} target tokens, {bpb:.4f} bits/byte)")
    if results:
        print(f"val loss of {what}: " + ", ".join(results) + f"; block_size={block}, "
                                                    f"doc_mask={c['doc_mask']} "
              f"({time.time() - t0:.0f} s)", flush=True)
    evals.score_tasks(model, c["eval_tasks"], tokenizer.tokenizer_from_meta(spec), block, c, what)


def main(argv):
    out_dir = "out"             # the run whose ckpt/latest to load (or ckpt=path/to/iter_XXXXXXX)
    ckpt = ""                   # a checkpoint directory to load instead of out_dir's latest
    prompt = ""                 # '' : start from <|endoftext|>, i.e. the beginning of a document
    num_samples = 2             # samples to print, each from the same prompt
    max_new_tokens = 200        # tokens generated per sample
    temperature = 0.8           # 0: greedy
    top_k = 50                  # 0: sample from the whole distribution
    seed = 1337                 # the samples' random draws
    device = "auto"             # 'auto': cuda if available, else cpu
    export = ""                 # write the checkpoint's weights, consolidated, to this file and
                                # exit
    export_hf = ""              # write the checkpoint as a Hugging Face LLaMA directory and exit
    export_shard_mb = 5000.0    # export_hf: shards + model.safetensors.index.json past this many
                                # MB (0: one file)
    init_from = ""              # eval=True: a Hugging Face LLaMA directory (a base, an export;
                                # or its hub name ORG/NAME[@REV] in the local cache) or a run's
                                # out_dir
    revision = ""               # init_from=ORG/NAME: the snapshot's branch, tag or commit
    eval = False                # print the val loss of the model on dataset= (the whole val split)
                                # and exit
    dataset = ""                # eval=True: a prepared dataset (a name under data/, or a
                                # directory), or several: a,b
    block_size = 0              # eval=True: tokens per sequence (0: the run's; a Hugging Face
                                # model: 1024 at most)
    batch_size = 8              # eval=True: sequences per forward
    doc_mask = False            # eval=True: attention stays inside each document, as a run with
                                # doc_mask=True
    eval_tasks = ""             # eval=True: multiple-choice tasks (JSONL) to score,
                                # 'a.jsonl,b.jsonl'
    ref_from = ""               # eval=True on preference pairs: the reference model (as init_from;
                                # '': the run's starting model, if any)
    defaults = dict(locals())
    cfg = {**defaults, **configurator.configure(defaults, argv, "sample.py")}

    check = guard_errors.check
    check(math.isfinite(cfg["temperature"]) and cfg["temperature"] >= 0,
          f"temperature={cfg['temperature']} must be a finite number >= 0 (0: greedy)")
    for key in ("max_new_tokens", "num_samples", "top_k"):
        check(0 <= cfg[key] <= 10 ** 6, f"{key}={cfg[key]} must be in [0, 10**6]")
    check(0 <= cfg["seed"] < 2 ** 32,
          f"seed={cfg['seed']} is out of range: use an integer in [0, 2**32)")
    check(math.isfinite(cfg["export_shard_mb"]),
          f"export_shard_mb={cfg['export_shard_mb']} is not finite")
    # checked before the checkpoint is read: never into a run's own files or a checkpoint, nor over
    # a device
    guard_files.check_exports({"export": cfg["export"], "export_hf": cfg["export_hf"]},
                              files=("export",))
    check(0 <= cfg["block_size"] <= 2 ** 20 and 1 <= cfg["batch_size"] <= 2 ** 16,
          f"block_size={cfg['block_size']} and batch_size={cfg['batch_size']} must be in [0, "
          f"2**20] and [1, 2**16]")
    if cfg["eval"]:
        return evaluate_checkpoint(cfg)
    check(not cfg["init_from"],
          "init_from= names the model for eval=True; to sample or export a run, use out_dir=")
    # (find verifies, and falls back to an intact one)
    path = cfg["ckpt"] or checkpoint.find(cfg["out_dir"], None)
    check(not cfg["ckpt"] or os.path.isdir(path),
          f"ckpt={path} is not a directory: give a checkpoint's directory, "
          f"e.g. {cfg['out_dir']}/ckpt/iter_0000350, or drop ckpt= for out_dir's latest")
    problem = guard_ckpt.verify(path) if cfg["ckpt"] else None
    check(problem is None, f"ckpt={path} does not verify ({problem}): pick another checkpoint, or "
                           f"drop ckpt= to use the newest intact one of out_dir")
    if path is None:
        raise guard_errors.UserError(f"no checkpoint in {cfg['out_dir']}/ckpt: train first, or "
                                     f"pass ckpt=path/to/iter_XXXXXXX")
    if cfg["export_shard_mb"] < 0:
        raise guard_errors.UserError(f"export_shard_mb={cfg['export_shard_mb']} must not be "
                                     f"negative (0: one file)")
    model, meta = load_model(path)
    enc = tokenizer.tokenizer_from_meta(tokenizer.checkpoint_spec(meta))
    if cfg["export"]:
        tmp = cfg["export"] + ".tmp"
        # merged above
        weights = {k: v.contiguous() for k, v in model.state_dict().items() if ".lora_" not in k}
        if os.path.lexists(tmp):
            os.remove(tmp)
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644),
                       "wb") as f:
            torch.save(weights, f)  # a new file, never through a link
        os.replace(tmp, cfg["export"])
        print(f"exported {len(weights)} tensors of {path} (iteration {meta['iter']}) "
              f"to {cfg['export']}")
    if cfg["export_hf"]:
        hf.save_hf(cfg["export_hf"], model.state_dict(), model.cfg, enc, cfg["export_shard_mb"])
        print(f"exported {path} (iteration {meta['iter']}) as a Hugging Face LLaMA (with its "
              f"tokenizer) to {cfg['export_hf']}")
    if cfg["export"] or cfg["export_hf"]:
        return
    model.to(parallel.pick_device(cfg["device"])).eval()
    torch.manual_seed(cfg["seed"])
    print(f"{os.path.relpath(path)}: iteration {meta['iter']}")
    for _ in range(cfg["num_samples"]):
        print(sample_text(model, enc, cfg["prompt"], cfg["max_new_tokens"], cfg["temperature"],
                          cfg["top_k"]))
        print("-" * 60)


if __name__ == "__main__":
    main(sys.argv[1:])
