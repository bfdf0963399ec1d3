"""Micro-benchmarks a person runs as commands (``python -m lightning_titan.bench.<name>``)."""
