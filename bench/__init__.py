"""Benchmark tables, one file per table (bench/dp.py prints the dp table); bench/base.py holds
what they share and bench/__main__.py runs them: `python bench.py --help`."""
