# Continued pretraining: a trained model on your own text, beside the from-scratch defaults
# (as nanoGPT's config/finetune_shakespeare.py). Measured on SmolLM2-135M-Instruct:
# docs/benchmarks.md.
#   python train.py config/cpt.py init_from=path/to/hf_model dataset=mine data_source='mine/*.txt'
# The defaults race a fresh model (Muon at 4e-3, the embedding at 10x): on a trained one they
# overwrite what it knows. AdamW, as such bases were trained, at a rate ~130x lower, every weight
# alike. On man pages in four languages, 200 steps at 1e-4 halved the held-out domain's loss but
# Python (what the base knew) rose 7% (steps of 8,192 tokens) or 5% (1,024), past a 2% bound; 200
# steps of 1,024 at 3e-5: domain -37%, Python -1%. Shortened to 30 steps of 4 x 256: -15%, -2%.
optim = "adamw"
learning_rate = 3e-5
min_lr = 3e-6
embed_lr_scale = 1.0
warmup_iters = 10
# the base was trained on long contexts: blocks of 512, 4 x 4 of them (8,192 tokens) a step
block_size = 512
batch_size = 4
grad_accum_steps = 4
# the head and loss 256 rows at a time, each row's softmax kept for backward: a micro-batch's
# logits over a base's 49k-152k vocabulary are 0.4-1.2 GB in float32, which the whole path keeps
# with their log-softmax and gradient (2.2-2.9x them at peak), this once (1.3x) at the whole
# path's speed; recomputing them (loss_recompute=True) keeps nothing, at 1.4-1.5x the head's time
# (python bench.py head and real: docs/benchmarks.md)
loss_chunk = 256
loss_recompute = False
max_iters = 200
eval_interval = 50
# torch.compile: the step 1.15-1.18x faster on both CPU kinds measured (AVX2 float32, AVX512-BF16
# bf16) for 1.5-2 minutes of compiling in the first step (python bench.py real:
# docs/benchmarks.md); it pays after ~100 of the 200 steps. compile=False for a short run
compile = True
