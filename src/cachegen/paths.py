"""Where cachegen keeps its files on this machine."""

from __future__ import annotations

import os
from pathlib import Path


def home(create: bool = True) -> Path:
    """``$CACHEGEN_HOME``, default ``~/.cache/cachegen``; created on first use unless ``create=False``.

    Read-only callers (listing models, reading a config) pass ``create=False`` so
    looking never leaves a directory behind.
    """
    p = Path(os.environ.get("CACHEGEN_HOME") or Path.home() / ".cache" / "cachegen").expanduser()
    if create:
        p.mkdir(parents=True, exist_ok=True)
    return p


def subdir(name: str) -> Path:
    p = home() / name
    p.mkdir(parents=True, exist_ok=True)
    return p
