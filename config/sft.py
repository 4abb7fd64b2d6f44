# Fine-tuning on conversations (JSONL of {"messages": [...]}), from a trained model: the loss on the
# assistant's words only. Measured on SmolLM2-135M-Instruct: docs/benchmarks.md.
#   python train.py config/sft.py init_from=path/to/model dataset=chat data_source=chat.jsonl
# AdamW at a rate 40x below the from-scratch defaults', every weight alike (LoRA, lora_rank=8:
# adapters start at zero and take ~10x this rate). config/cpt.py went 3x lower when 200 steps of
# new text at 1e-4 made the base forget Python; 200 steps of SFT at 1e-4 on a set big enough for
# them were not measured (on a small one, they overfit: below). Shortened to 30 steps of 4 x 256 on man-page Q&A in SmolLM2's ChatML: held-out replies
# 3.478 -> 2.996, Python -1% (an H100's full-length runs: docs/benchmarks.md).
# (the numbers above were measured with rows cut end to end, packing=concat, before chat data
# became whole conversations per row by default: packing=concat gives those rows back)
optim = "adamw"
learning_rate = 1e-4
min_lr = 1e-5
embed_lr_scale = 1.0
warmup_iters = 10
# each conversation attends only to itself in a packed block
doc_mask = True
block_size = 512
batch_size = 4
grad_accum_steps = 4
# the head and loss 256 rows at a time, each row's softmax kept for backward, as config/cpt.py
# (the whole logits would be 0.4-1.2 GB in float32, kept with their log-softmax and gradient)
loss_chunk = 256
loss_recompute = False
# 200 steps of 8,192 tokens fit ~0.5M tokens of conversations or more (at most 3 passes); a
# trained model passing a small set more often learns it by heart: on 116k tokens, held-out
# replies 3.38 -> 2.51 at 50 steps (3.5 passes), 3.42 at 200. train.py warns past 3 passes.
max_iters = 200
eval_interval = 50
