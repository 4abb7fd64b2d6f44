"""The guards, read when needed: each only refuses bad input with one line, or reads a file from
outside and returns what a plain read would. A valid run does the same without them."""
