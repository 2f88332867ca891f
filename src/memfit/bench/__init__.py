"""Benchmarks shared by the CLI and the benchmarks/ scripts."""
