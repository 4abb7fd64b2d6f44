# Preference alignment after SFT: DPO on pairs in TRL's formats (JSONL or Parquet of {"prompt",
# "chosen", "rejected"}), from the SFT model, whose log-probs over the pairs are the reference
# (computed once before step 1, kept in out_dir: techniques/preference.py).
#   python train.py config/dpo.py init_from=runs/sft dataset=pairs data_source=pairs.jsonl
# AdamW at a rate 10x below config/sft.py's (TRL's default is 1e-6); beta 0.1, TRL's. Measured
# on SmolLM2-135M-Instruct after CPT and SFT (python -m bench.dpo, docs/finetuning.md), 12 steps
# of 4 pairs at 1e-5: held-out rewards/accuracies 0.79, Python's loss unchanged (-0.04%).
optim = "adamw"
learning_rate = 1e-5
min_lr = 1e-6
embed_lr_scale = 1.0
warmup_iters = 5
loss_type = "sigmoid"
beta = 0.1
# whole pairs per micro-batch: 4 pairs (8 rows), chosen and rejected side by side
block_size = 512
batch_size = 8
grad_accum_steps = 2
loss_chunk = 256
loss_recompute = False
max_iters = 100
eval_interval = 25
