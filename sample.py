"""
Generate text from the latest checkpoint of a run, or export its weights to one file:

    python sample.py out_dir=out prompt='def fib(n):' max_new_tokens=200
    python sample.py out_dir=out export=model.pt     # {name: tensor}, for torch.load(weights_only=True)
    python sample.py out_dir=out export_hf=hf_model   # a Hugging Face LLaMA directory (config.json + model.safetensors)

Any checkpoint works, whatever layout wrote it (one process, dp, pp, fsdp): it is read
into one whole model here.
"""

import os
import sys

import torch

import checkpoint
import configurator
import data
import parallel
from model import merge_lora

out_dir = "out"             # the run whose ckpt/latest to load (or ckpt=path/to/iter_XXXXXXX)
ckpt = ""
prompt = ""                 # '' : start from <|endoftext|>, i.e. the beginning of a document
num_samples = 2
max_new_tokens = 200
temperature = 0.8           # 0: greedy
top_k = 50                  # 0: sample from the whole distribution
seed = 1337
device = "auto"
export = ""                 # write the checkpoint's weights, consolidated, to this file and exit
export_hf = ""              # write the checkpoint as a Hugging Face LLaMA directory and exit

sys.excepthook = configurator.excepthook
defaults = {k: v for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, str))}
globals().update(configurator.configure(defaults, sys.argv[1:]))

path = ckpt or checkpoint.find(out_dir, None)
if path is None:
    raise configurator.UserError(f"no checkpoint in {out_dir}/ckpt: train first, or pass ckpt=path/to/iter_XXXXXXX")
meta, _ = checkpoint.read_meta(path)
cfg = meta["config"]
dev = parallel.pick_device(device)
model, _ = checkpoint.load_whole(path)  # a LoRA run's: its base (re-read from where it is) with the adapters
merge_lora(model)  # W + (alpha / r) B A; nothing to do without LoRA
if export:
    tmp = export + ".tmp"
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if ".lora_" not in k}  # LoRA: merged above
    torch.save(weights, tmp)
    os.replace(tmp, export)
    print(f"exported {len(weights)} tensors of {path} (iteration {meta['iter']}) to {export}")
if export_hf:
    checkpoint.save_hf_llama(export_hf, model.state_dict(), model.cfg)
    print(f"exported {path} (iteration {meta['iter']}) as a Hugging Face LLaMA to {export_hf}")
if export or export_hf:
    sys.exit(0)
model.to(dev).eval()
enc = data.get_tokenizer(cfg["tokenizer"], cfg["vocab_size"], meta.get("extra_tokens", []))
start = enc.encode(prompt, allowed_special="all") if prompt else [enc.eot_token]
torch.manual_seed(seed)
print(f"{os.path.relpath(path)}: iteration {meta['iter']}")
for _ in range(num_samples):
    out = model.generate(torch.tensor([start], device=dev), max_new_tokens, temperature, top_k or None)
    print(enc.decode(out[0].tolist() if prompt else out[0, 1:].tolist()))
    print("-" * 60)
