"""Test inputs the codec tests share (imported as ``codec.samples``, see tests/conftest.py)."""

from __future__ import annotations

from cachegen.bench.fuzz import planted_sensitivity  # the fuzzer's profile is calibrated on the same

__all__ = ["planted_sensitivity"]
