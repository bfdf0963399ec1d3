"""Benchmarks a person runs as commands: ``titan bench`` (the suite) and ``python -m
lightning_titan.tools.bench.<name>`` (the micro-benchmarks ``dispatch`` and ``data``)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> dict:
    """``titan bench [flags]``; see ``lightning_titan.tools.bench.suite``."""
    from lightning_titan.tools.bench.suite import main as suite_main

    return suite_main(argv)
