"""Where cachegen keeps its files on this machine."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """``$CACHEGEN_HOME``, default ``~/.cache/cachegen``; created on first use."""
    p = Path(os.environ.get("CACHEGEN_HOME") or Path.home() / ".cache" / "cachegen")
    p.mkdir(parents=True, exist_ok=True)
    return p


def subdir(name: str) -> Path:
    p = home() / name
    p.mkdir(parents=True, exist_ok=True)
    return p
