"""python -m lightning_titan.bench [flags]: the same as ``titan bench``."""

import sys

from lightning_titan.bench import main

main(sys.argv[1:])
