"""Where megac finds the files that are not Python: the device headers
(``opcodes/``), the Jinja templates (``templates/``), the wave orders (``schedules/``) and the
user cache. The one place that resolves them.

In a checkout they are the top-level directories of the repository. An
installed wheel carries copies under ``megac/_data/`` (``setup.py`` copies
them at build time), so ``megac compile`` and ``megac serve`` work from any
directory without the repository.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
_NAMES = ("opcodes", "templates", "schedules")


@lru_cache(maxsize=None)
def _dir(name: str) -> Path:
    installed = _PACKAGE / "_data" / name
    if installed.is_dir():
        return installed
    checkout = _PACKAGE.parent / name
    if checkout.is_dir():
        return checkout
    raise FileNotFoundError(f"megac's {name}/ directory is missing (looked in {installed} and {checkout}); "
                            f"reinstall megac")


def opcodes_dir() -> Path:
    """Device headers: ``opcodes/*.cuh`` (and ``opcodes/generated/``)."""
    return _dir("opcodes")


def templates_dir() -> Path:
    """Jinja templates of the generated C++."""
    return _dir("templates")


def schedules_dir() -> Path:
    """Wave orders: ``schedules/<order>.yaml``."""
    return _dir("schedules")


def cache_dir() -> Path:
    """The user cache directory of megac: ``$MEGAC_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/megac``, else ``~/.cache/megac`` (compiled artifacts,
    cubins of an installed megac, converted weights)."""
    env = os.environ.get("MEGAC_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "megac"


def repo_root() -> Path | None:
    """The checkout megac runs from, or None when installed (tools and tests
    that only make sense in a checkout use it)."""
    root = _PACKAGE.parent
    return root if (root / "pyproject.toml").is_file() and (root / "opcodes").is_dir() else None


__all__ = ["cache_dir", "opcodes_dir", "repo_root", "schedules_dir", "templates_dir"]
