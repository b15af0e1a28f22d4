"""Throughput benchmarks. Each prints figures measured side by side in one run, and their ratios."""
