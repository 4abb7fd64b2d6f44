"""Runs the benchmark tables of bench/: `python bench.py --help` (the same as
`python -m bench`)."""
import os
import sys

# the package bench/ beside this file, from any directory
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

if __name__ == "__main__":
    from bench.__main__ import main
    main()
