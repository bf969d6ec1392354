"""Benchmarks: workloads, a runner (`python -m benchmarks.run`) and JSON + PNG reports.

See benchmarks/README.md for what each report means and how to reproduce it; register a new
benchmark in `benchmarks.run.BENCHMARKS`.
"""
