"""The Hugging Face families we load and export: every module of this folder defines ``FAMILY`` (a
``hf.family.Family``), found here, so that a family is one file (docs/architecture.md, "Adding a
model family")."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from types import MappingProxyType

from lightning_titan.hf.family import Family


def _found() -> dict[str, Family]:
    out = {}
    for module in pkgutil.iter_modules(__path__):
        family = importlib.import_module(f"{__name__}.{module.name}").FAMILY
        if not isinstance(family, Family):
            raise TypeError(f"{__name__}.{module.name}.FAMILY is not a hf.family.Family")
        out[family.model_type] = family
    return dict(sorted(out.items()))


# model_type -> family, in model_type order
FAMILIES: Mapping[str, Family] = MappingProxyType(_found())
