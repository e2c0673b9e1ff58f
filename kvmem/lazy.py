"""Names a package gives without importing the modules that define them up front
(PEP 562): :func:`lazy_names`."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_names(
    package: str, home: dict[str, str]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` for ``package``, whose names ``home``
    maps to the module that defines each.  A name's module is imported when the name is
    first asked for, and the name is kept in the package from then on; a name not in
    ``home`` is an AttributeError, as for any module."""

    def getattr_(name: str) -> object:
        if name not in home:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home[name]), name)
        setattr(sys.modules[package], name, value)  # looked up once
        return value

    def dir_() -> list[str]:
        return sorted({*vars(sys.modules[package]), *home})

    return getattr_, dir_
