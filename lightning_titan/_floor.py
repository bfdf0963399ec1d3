"""The oldest torch this package runs on: the oldest its test suite has passed on (pyproject.toml
says the same). Imported first, so an older torch fails with this message, not deep in an import."""

import torch

TORCH_FLOOR = (2, 13)


def check_torch(version: str) -> None:
    found = tuple(int(p) for p in version.split("+")[0].split(".")[:2])
    if found < TORCH_FLOOR:
        floor = ".".join(map(str, TORCH_FLOOR))
        raise ImportError(
            f"lightning_titan needs torch >= {floor} (the oldest its tests pass on) but found "
            f"torch {version}: pip install 'torch>={floor}'"
        )


check_torch(torch.__version__)
