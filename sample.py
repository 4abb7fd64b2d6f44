"""
Generate text from the latest checkpoint of a run:

    python sample.py out_dir=out prompt='def fib(n):' max_new_tokens=200
"""

import os
import sys

import torch

import configurator
import data
import parallel
from model import ModelConfig, Transformer

out_dir = "out"             # the run whose ckpt/latest to load (or ckpt=path/to/iter_XXXXXXX)
ckpt = ""
prompt = ""                 # '' : start from <|endoftext|>, i.e. the beginning of a document
num_samples = 2
max_new_tokens = 200
temperature = 0.8           # 0: greedy
top_k = 50                  # 0: sample from the whole distribution
seed = 1337
device = "auto"

sys.excepthook = configurator.excepthook
defaults = {k: v for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, str))}
globals().update(configurator.configure(defaults, sys.argv[1:]))

path = ckpt or parallel.latest_checkpoint(out_dir)
if path is None:
    raise configurator.UserError(f"no checkpoint in {out_dir}/ckpt: train first, or pass ckpt=path/to/iter_XXXXXXX")
loaded = parallel.load_checkpoint(path, ["model"])
cfg = loaded["meta"]["config"]
dev = parallel.pick_device(device)
model = Transformer(ModelConfig(**loaded["meta"]["model"]))
model.load_state_dict(loaded["model"])
model.to(dev).eval()
enc = data.get_tokenizer(cfg["tokenizer"], cfg["vocab_size"])
start = enc.encode(prompt, allowed_special="all") if prompt else [enc.eot_token]
torch.manual_seed(seed)
print(f"{os.path.relpath(path)}: iteration {loaded['meta']['iter']}")
for _ in range(num_samples):
    out = model.generate(torch.tensor([start], device=dev), max_new_tokens, temperature, top_k or None)
    print(enc.decode(out[0].tolist() if prompt else out[0, 1:].tolist()))
    print("-" * 60)
