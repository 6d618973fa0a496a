"""Benchmarks: ratios against a baseline measured in the same run, never pass/fail; one harness (harness.py), how to run each: README.md."""
