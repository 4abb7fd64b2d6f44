"""
Generate text from the latest checkpoint of a run, or export its weights to one file:

    python sample.py out_dir=out prompt='def fib(n):' max_new_tokens=200
    python sample.py out_dir=out export=out/model.pt # {name: tensor}, for torch.load(weights_only=True)
    python sample.py out_dir=out export_hf=runs/hf_model # a Hugging Face LLaMA directory, weights and tokenizer

Any checkpoint works, whatever layout wrote it (one process, dp, pp, fsdp): it is read
into one whole model here. train.py's end-of-run sample and export use the functions below.
"""

import math
import os
import sys
from contextlib import nullcontext

import torch

import checkpoint
import common
import configurator
import hf
import parallel
import tokenizer
from lora import load_whole, merge_lora


def load_model(path):
    """(whole model on CPU, checkpoint meta) of the checkpoint directory `path`, whatever
    layout wrote it, read by this process alone. A LoRA run's adapters are merged into its
    base (re-read from where it is): W + (alpha / r) B A."""
    model, meta = load_whole(path)
    merge_lora(model)  # nothing to do without LoRA
    return model, meta


def sample_text(model, enc, prompt="", max_new_tokens=200, temperature=0.8, top_k=50, autocast=None):
    """One sample from `model` (on its device, in eval mode) as text. An empty prompt starts
    from <|endoftext|>, i.e. the beginning of a document, which is not printed."""
    bos = getattr(enc, "bos_token", None)  # a model's tokenizer that starts documents with one
    start = enc.encode(prompt, allowed_special="all") if prompt else [enc.eot_token if bos is None else bos]
    idx = torch.tensor([start], device=next(model.parameters()).device)
    with autocast or nullcontext():
        out = model.generate(idx, max_new_tokens, temperature, top_k or None)
    ids = out[0].tolist() if prompt else out[0, 1:].tolist()
    return enc.decode([i for i in ids if i < enc.n_vocab])  # a padded embedding's rows past the ids: no text


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
    export = ""                 # write the checkpoint's weights, consolidated, to this file and exit
    export_hf = ""              # write the checkpoint as a Hugging Face LLaMA directory and exit
    export_shard_mb = 5000.0    # export_hf: shards + model.safetensors.index.json past this many MB (0: one file)
    defaults = dict(locals())
    cfg = {**defaults, **configurator.configure(defaults, argv, "sample.py")}

    check = common.check
    check(math.isfinite(cfg["temperature"]) and cfg["temperature"] >= 0,
          f"temperature={cfg['temperature']} must be a finite number >= 0 (0: greedy)")
    for key in ("max_new_tokens", "num_samples", "top_k"):
        check(0 <= cfg[key] <= 10 ** 6, f"{key}={cfg[key]} must be in [0, 10**6]")
    check(0 <= cfg["seed"] < 2 ** 32, f"seed={cfg['seed']} is out of range: use an integer in [0, 2**32)")
    check(math.isfinite(cfg["export_shard_mb"]), f"export_shard_mb={cfg['export_shard_mb']} is not finite")
    export_dir = os.path.dirname(os.path.abspath(cfg["export"])) if cfg["export"] else "."
    check(os.path.isdir(export_dir), f"export={cfg['export']}: the directory {export_dir} does not exist: create it "
                                     f"or export elsewhere")
    check(not os.path.isdir(cfg["export"]), f"export={cfg['export']} is a directory: name the file to write, e.g. "
                                            f"export={os.path.join(cfg['export'], 'model.pt')}")
    path = cfg["ckpt"] or checkpoint.find(cfg["out_dir"], None)  # (find verifies, and falls back to an intact one)
    check(not cfg["ckpt"] or os.path.isdir(path), f"ckpt={path} is not a directory: give a checkpoint's directory, "
          f"e.g. {cfg['out_dir']}/ckpt/iter_0000350, or drop ckpt= for out_dir's latest")
    problem = checkpoint.verify(path) if cfg["ckpt"] else None
    check(problem is None, f"ckpt={path} does not verify ({problem}): pick another checkpoint, or drop ckpt= to "
                           f"use the newest intact one of out_dir")
    if path is None:
        raise common.UserError(f"no checkpoint in {cfg['out_dir']}/ckpt: train first, or pass "
                               f"ckpt=path/to/iter_XXXXXXX")
    if cfg["export_shard_mb"] < 0:
        raise common.UserError(f"export_shard_mb={cfg['export_shard_mb']} must not be negative (0: one file)")
    model, meta = load_model(path)
    enc = tokenizer.tokenizer_from_meta(tokenizer.checkpoint_spec(meta))
    if cfg["export"]:
        tmp = cfg["export"] + ".tmp"
        weights = {k: v.contiguous() for k, v in model.state_dict().items() if ".lora_" not in k}  # merged above
        if os.path.lexists(tmp):
            os.remove(tmp)
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), "wb") as f:
            torch.save(weights, f)  # a new file, never through a link
        os.replace(tmp, cfg["export"])
        print(f"exported {len(weights)} tensors of {path} (iteration {meta['iter']}) to {cfg['export']}")
    if cfg["export_hf"]:
        hf.save_hf_llama(cfg["export_hf"], model.state_dict(), model.cfg, enc, cfg["export_shard_mb"])
        print(f"exported {path} (iteration {meta['iter']}) as a Hugging Face LLaMA (with its tokenizer) to "
              f"{cfg['export_hf']}")
    if cfg["export"] or cfg["export_hf"]:
        return
    model.to(parallel.pick_device(cfg["device"])).eval()
    torch.manual_seed(cfg["seed"])
    print(f"{os.path.relpath(path)}: iteration {meta['iter']}")
    for _ in range(cfg["num_samples"]):
        print(sample_text(model, enc, cfg["prompt"], cfg["max_new_tokens"], cfg["temperature"], cfg["top_k"]))
        print("-" * 60)


if __name__ == "__main__":
    sys.excepthook = common.excepthook
    main(sys.argv[1:])
