"""python -m lightning_titan.bench [flags]: the same as ``titan bench``."""

import os
import sys

# the suite needs no Lightning; its spawned ranks skip it too (see lightning_titan/__init__)
os.environ.setdefault("LIGHTNING_TITAN_ENGINE_ONLY", "1")

from lightning_titan.bench import main  # noqa: E402

main(sys.argv[1:])
