# Continued pretraining: a trained model on your own text, beside the from-scratch defaults
# (as nanoGPT's config/finetune_shakespeare.py). Measured on SmolLM2-135M-Instruct: docs/benchmarks.md.
#   python train.py config/cpt.py init_from=path/to/hf_model dataset=mine data_source='mine/*.txt'
# The defaults race a fresh model (Muon at 4e-3, the embedding at 10x): on a trained one they
# overwrite what it knows. AdamW, as such bases were trained, at a rate 40x lower, every weight alike.
# Shortened (30 steps of 4 x 256) on Swedish man pages: held-out 4.44 -> 2.94, Python +0.4%;
# at 3e-4 the domain fell further (2.52) but Python rose 8.9%.
optim = "adamw"
learning_rate = 1e-4
min_lr = 1e-5
embed_lr_scale = 1.0
warmup_iters = 10
# the base was trained on long contexts: blocks of 512, 4 x 4 of them (8,192 tokens) a step
block_size = 512
batch_size = 4
grad_accum_steps = 4
# the head and loss 256 rows at a time: a micro-batch's logits over a base's 49k-152k vocabulary
# are 0.4-1.2 GB in float32, kept with their log-softmax (python bench.py real: docs/benchmarks.md)
loss_chunk = 256
max_iters = 200
eval_interval = 50
