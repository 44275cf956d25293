"""Whether NIXL tests run: they skip only when no NIXL package is installed at all. An
installed package that fails to load (a missing shared library, an ABI mismatch) fails them."""
from __future__ import annotations

import importlib
import importlib.metadata

import pytest

from services.kv_transfer.nixl import load_nixl

NIXL_DISTRIBUTIONS = ("nixl-cu12", "nixl-cu13", "nixl")


def nixl_installed() -> str | None:
    """The installed NIXL distribution's name and version, or None."""
    for name in NIXL_DISTRIBUTIONS:
        try:
            return f"{name} {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def require_nixl() -> None:
    """Skip when NIXL is not installed; fail (pytest.fail, naming the package) when it is
    installed but does not load."""
    installed = nixl_installed()
    if installed is None:
        pytest.skip(f"NIXL is not installed (none of {', '.join(NIXL_DISTRIBUTIONS)})")
    try:
        load_nixl()
    except ImportError:
        try:  # the underlying error, which load_nixl() replaces by its hint
            importlib.import_module("nixl_cu12")
            cause = "its module imports, but not as load_nixl() expects"
        except Exception as exc:  # noqa: BLE001 - reported as the cause
            cause = f"{type(exc).__name__}: {exc}"
        pytest.fail(f"{installed} is installed but does not load ({cause})", pytrace=False)
