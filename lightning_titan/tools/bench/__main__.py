"""python -m lightning_titan.tools.bench [flags]: the same as ``titan bench``."""

import sys

from lightning_titan.tools.bench import main

main(sys.argv[1:])
