"""Benchmarks: they print ratios against a baseline measured in the same run; never pass/fail."""
