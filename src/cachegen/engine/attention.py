"""Grouped-query attention that reads the cache's key/value heads in place.

Why: for a step of more than one query token under a mask (every prompt tail after a loaded
cache, every chunk of a chunked prefill), transformers' ``sdpa`` attention copies each key and
value head once per query head that shares it (``repeat_kv``): a copy of the whole cache, three
times over for SmolLM2, in every layer of every such step. Torch's CPU kernel takes grouped heads
as they are (``enable_gqa``), which gives the same logits. On SmolLM2 with a 4,096-token
cache the 16-token step's median went from 0.52 s to 0.40 s (``cachegen bench attention``).

Everything else (one query token, no grouping, a device other than the CPU, soft-capping or a
position bias) goes to transformers' own ``sdpa`` function unchanged.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from cachegen.errors import ConfigError

log = logging.getLogger(__name__)

NAME = "cachegen_sdpa"
ENV = "CACHEGEN_ATTENTION"  # sdpa: keep transformers' attention


def gqa_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """An attention function for transformers' ``AttentionInterface`` (``(batch, heads, q, dim)`` in,
    ``(batch, q, heads, dim)`` out), identical to ``sdpa`` but for not repeating grouped heads."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q_len = query.shape[2]
    if (
        q_len == 1  # transformers already folds the groups into the query for one token
        or attention_mask is None  # ... and passes enable_gqa itself without a mask
        or getattr(module, "num_key_value_groups", 1) == 1
        or query.device.type != "cpu"
        or kwargs.get("softcap") is not None
        or kwargs.get("position_bias") is not None
        or kwargs.get("output_attentions", False)
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=False, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def configured() -> str:
    """The attention ``$CACHEGEN_ATTENTION`` asks for: :data:`NAME` (the default) or ``sdpa``;
    ConfigError for anything else."""
    choice = os.environ.get(ENV, NAME) or NAME
    if choice not in (NAME, "sdpa"):
        raise ConfigError(f"{ENV}={choice!r}: use {NAME} (the default) or sdpa")
    return choice


def register() -> None:
    """Make :data:`NAME` known to transformers (its attention function, and stock ``sdpa`` masks).
    Registering again only sets the same entries."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, gqa_sdpa_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def install(model) -> bool:
    """Switch ``model`` from ``sdpa`` to :func:`gqa_sdpa_forward` (same masks); True if it was switched.

    A model on another attention implementation, or one that cannot switch, is left as it is;
    so is every model while ``$CACHEGEN_ATTENTION`` is ``sdpa`` (transformers' own, to compare
    or to rule the swap out)."""
    if configured() == "sdpa" or getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    register()
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, ImportError) as e:  # a model class that pins its attention
        log.info("keeping sdpa attention: %s", e)
        return False
    return model.config._attn_implementation == NAME


@contextmanager
def stock_sdpa(model) -> Iterator[None]:
    """Run ``model`` on transformers' own ``sdpa`` inside the block (then switch back).

    Why: the grouped kernel sums a shared head's gradient in another order, which moves a
    calibrated profile's steps by about 3e-6 (relative) and so its id; calibration runs on stock
    ``sdpa`` so that every version and machine derives the same profile, and the chunks its
    stores hold stay readable. The forward results (logits, caches) are identical either way."""
    if getattr(model.config, "_attn_implementation", None) != NAME:
        yield
        return
    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(NAME)
