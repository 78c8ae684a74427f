"""Conversion between transformers 5.x caches and :class:`cachegen.kv.KVCache`.

transformers' sliding-window layers drop tokens that fall out of the window.
A stored context must keep them (a later prompt may share only a prefix of
it), so :func:`recording_cache` asks those layers to keep their past, and
:func:`to_transformers` re-applies the window when handing a cache back.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from cachegen.errors import ConfigError
from cachegen.kv import KVCache, KVLayer, LayerKind


def layer_kinds(config) -> list[tuple[LayerKind, int | None]]:
    """(kind, window) per decoder layer, from a model config."""
    cfg = config.get_text_config(decoder=True)
    n = cfg.num_hidden_layers
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * n
    window: Any = getattr(cfg, "sliding_window", None)
    out: list[tuple[LayerKind, int | None]] = []
    for t in types:
        if t == "sliding_attention":
            out.append((LayerKind.SLIDING, int(window)))
        elif t == "full_attention":
            out.append((LayerKind.FULL, None))
        else:
            raise ConfigError(f"unsupported attention layer type {t!r}")
    return out


def values_per_token(config) -> int:
    """K and V values per token over all layers (sliding layers keep every token in a KVCache)."""
    c = config.get_text_config(decoder=True)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim


def recording_cache(config) -> DynamicCache:
    """An empty cache whose sliding layers keep every token (for extraction)."""
    cache = DynamicCache(config=config)
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            layer.activate_past_recording()  # type: ignore[union-attr]  # transformers types cache.layers as a union
    return cache


def from_transformers(cache: DynamicCache, config, start: int = 0) -> KVCache:
    """Copy a transformers cache (batch 1) into a :class:`KVCache`.

    Sliding layers must have been recorded (see :func:`recording_cache`), or
    hold no more tokens than the window keeps, else tokens are missing.
    """
    kinds = layer_kinds(config)
    if len(cache.layers) != len(kinds):
        raise ConfigError(f"cache has {len(cache.layers)} layers, config {len(kinds)}")
    layers = []
    full_len = None
    for layer, (kind, window) in zip(cache.layers, kinds):
        k, v = layer.keys, layer.values  # type: ignore[union-attr]  # transformers' layer union: attention layers here
        if k is None or k.dim() != 4 or k.shape[0] != 1:
            raise ConfigError("expected an initialized batch-1 cache")
        layers.append(KVLayer(k[0].detach().clone(), v[0].detach().clone(), kind, window))  # type: ignore[index]  # values set with keys
        if kind == LayerKind.FULL:
            full_len = k.shape[2]
    for l in layers:
        if full_len is not None and l.num_tokens != full_len:
            raise ConfigError("a sliding layer lost tokens: build the cache with recording_cache()")
    return KVCache(layers, start=start)


def to_transformers(kv: KVCache, config, dtype: torch.dtype | None = None) -> DynamicCache:
    """A transformers cache holding ``kv`` (which must start at token 0)."""
    if kv.start != 0:
        raise ConfigError(f"a model cache must start at token 0, this one starts at {kv.start}")
    kinds = layer_kinds(config)
    if len(kinds) != kv.num_layers:
        raise ConfigError(f"KV has {kv.num_layers} layers but the model has {len(kinds)}")
    cache = DynamicCache(config=config)
    for i, (layer, l) in enumerate(zip(cache.layers, kv.layers)):
        if (l.kind, l.window) != kinds[i]:
            raise ConfigError(f"layer {i} is {l.kind.value}/{l.window}, the model expects {kinds[i]}")
        k, v = l.k, l.v
        if dtype is not None:
            k, v = k.to(dtype), v.to(dtype)
        if type(layer) is DynamicLayer:
            # a plain growing layer only ever replaces its tensors (concatenation, slicing), so it can
            # hold kv's as they are: update() would concatenate them onto an empty tensor, a copy of
            # the whole context (30-90 ms at 4K tokens on SmolLM2 in fp32) before the first step
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k.unsqueeze(0), v.unsqueeze(0)
        else:  # update() keeps the last window-1 tokens of sliding layers and sets cumulative_length = T
            layer.update(k.unsqueeze(0), v.unsqueeze(0))  # type: ignore[union-attr]  # transformers' layer union
    return cache


def finish_recording(cache: DynamicCache) -> None:
    """Trim recorded sliding layers back to their window so the cache is usable for decoding."""
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False) and getattr(layer, "record_past", False) and layer.is_initialized:  # type: ignore[union-attr]  # transformers' layer union
            layer.crop(0)  # type: ignore[union-attr]  # sliding layers have crop()
            layer.record_past = False  # type: ignore[union-attr]  # sliding layers record their past
