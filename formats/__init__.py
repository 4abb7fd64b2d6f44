"""The formats of the world outside: Hugging Face directories in and out (config, weights,
tokenizer, chat template, rotary fields, MoE tensors) and the corpus files prepare.py reads."""
