"""Structural type of a section's transform (kept apart to avoid an import cycle)."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class SectionLike(Protocol):
    mean: np.ndarray
    basis: np.ndarray | None
    rope: object | None  # a cachegen.codec.rope.RopeSpec (keys), or None
