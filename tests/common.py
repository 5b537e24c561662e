"""Helpers that tests of more than one package share: the shared recordings corpus and the check
that a module's ``__all__`` lists what it defines."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

# The corpus lives in ../shared next to the checkout, or in shared/ inside it.
_ROOT = Path(__file__).resolve().parents[1]
SHARED_RECORDINGS = next(
    (
        p
        for p in (_ROOT.parent / "shared" / "recordings", _ROOT / "shared" / "recordings")
        if p.is_dir()
    ),
    _ROOT.parent / "shared" / "recordings",
)
needs_shared_recordings = pytest.mark.skipif(
    not SHARED_RECORDINGS.is_dir(), reason="../shared/recordings is not present"
)


def assert_exports_complete(module: ModuleType) -> None:
    """Every public name ``module`` defines is in its ``__all__``, and every name there exists."""
    defined = {
        name
        for name, obj in vars(module).items()
        if not name.startswith("_") and getattr(obj, "__module__", None) == module.__name__
    }
    assert defined <= set(module.__all__)
    assert all(hasattr(module, name) for name in module.__all__)
