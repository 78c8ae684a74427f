"""The dtype a model serves in: bf16 where the CPU computes it natively, else fp32.

bf16 halves the KV and the weights, but a CPU without AVX512-BF16 or AMX
converts every operand to fp32 and back: on an AVX2-only EPYC, a 4K-token
SmolLM2 prefill takes ~76 s in bf16 against ~12 s in fp32, and time to first
token follows. ``"auto"`` (the default everywhere a serving dtype is chosen)
picks by the CPU's flags, so a user never gets the slow path without asking.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

AUTO = "auto"
CHOICES = (AUTO, "bfloat16", "float32")
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@functools.cache
def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo is missing, e.g. macOS)."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def auto_dtype_name(flags: frozenset[str] | None = None) -> str:
    """``"bfloat16"`` on a CPU with native bf16 matrix products, else ``"float32"``."""
    flags = cpu_flags() if flags is None else flags
    return "bfloat16" if flags & NATIVE_BF16_FLAGS else "float32"


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """A torch dtype from a name, a dtype, or ``None`` / ``"auto"`` (chosen by the CPU)."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    name = auto_dtype_name() if dtype in (None, AUTO) else dtype
    out = getattr(torch, str(name), None)
    if not isinstance(out, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}: use one of {', '.join(CHOICES)}")
    if dtype in (None, AUTO):
        log.debug("serving dtype: %s (chosen from the CPU's flags)", name)
    return out


def cast_model(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """``model.to(dtype)`` in place, with the rotary frequencies kept in fp32.

    ``Module.to`` casts every floating buffer, ``inv_freq`` too: in bf16 a
    frequency carries a relative error up to 2**-9, so a key's rotation angle
    drifts with its position (tenths of a radian at 4K tokens), unlike the same
    model loaded in bf16 by ``from_pretrained``, and unlike the fp32 rotation
    the codec undoes before coding keys.
    """
    keep = {n: b for n, b in model.named_buffers() if n.rsplit(".", 1)[-1] in ("inv_freq", "original_inv_freq")}
    model.to(dtype)
    for name, buf in keep.items():
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner)._buffers[attr] = buf
