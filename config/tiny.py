# a model small enough to train in about a minute on a laptop CPU
n_layer = 2
n_head = 4
n_kv_head = 2
n_embd = 64
block_size = 64
batch_size = 8
grad_accum_steps = 2
max_iters = 200
eval_interval = 50
warmup_iters = 20
learning_rate = 3e-3
out_dir = "out-tiny"
