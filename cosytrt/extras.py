"""Optional dependencies: import one lazily, or fail with an error naming the pip extra that installs it."""
from __future__ import annotations

import importlib

from cosytrt.engines.errors import CosytrtError

INSTALL = 'pip install -e ".[{extra}]"'


class MissingExtraError(CosytrtError, ImportError):
    """An optional package a command needs is not installed (the message names the extra)."""


def require(module: str, extra: str, what: str):
    """`importlib.import_module(module)`, or MissingExtraError: "<what> needs <package> (<install command>)"."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        missing = getattr(e, "name", None)
        if missing and missing.split(".")[0] != top:  # the package is there but one of ITS imports failed
            raise
        raise MissingExtraError(f"{what} needs the Python package {top!r}, which is not installed: "
                                f"{INSTALL.format(extra=extra)} (the '{extra}' extra)") from None


def available(module: str) -> bool:
    try:
        importlib.import_module(module)
        return True
    except ImportError:
        return False
