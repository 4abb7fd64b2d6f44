"""The techniques: one file each, each applied to a built model (or the loop) from outside and
entered from a line of train.py marked with its file. Delete a file and its marked lines, and
the trainer runs without it."""
