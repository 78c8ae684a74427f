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
from cachegen.kv import ROOM_TOKENS, KVCache, KVLayer, LayerKind


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
    """An empty cache whose sliding layers keep every token (for extraction) and whose
    full-attention layers are :class:`GrowingLayer` s, which append in place."""
    cache = _growing(DynamicCache(config=config))
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            layer.activate_past_recording()  # type: ignore[union-attr]  # transformers types cache.layers as a union
    return cache


def _growing(cache: DynamicCache) -> DynamicCache:
    """``cache`` with its (empty) full-attention layers replaced by :class:`GrowingLayer` s."""
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            cache.layers[i] = GrowingLayer()
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


class GrowingLayer(DynamicLayer):
    """A full-attention layer that appends new tokens in place, into spare room after its tokens.

    Why: transformers' :class:`DynamicLayer` concatenates on every step, so each decoding step
    copies the whole cache into new tensors: at 4K tokens of SmolLM2 in fp32 that is about 190 MB
    per step, as much memory traffic as the attention itself. This layer copies its tokens once,
    into a buffer ``spare_tokens`` longer, and then writes each step's tokens after them; the keys
    and values it returns are views of the buffer's first tokens, so a tensor returned by an
    earlier step never changes. Anything that replaces its tensors (a batch reorder or selection)
    or crops it makes the next step copy into a new buffer, as concatenation would."""

    def __init__(self, spare_tokens: int = ROOM_TOKENS) -> None:
        super().__init__()
        self.spare_tokens = max(1, spare_tokens)
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None
        self._reserved = 0

    def hold(
        self, keys: torch.Tensor, values: torch.Tensor, room: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> None:
        """Take ``keys`` and ``values`` (``[1, heads, tokens, dim]``) as the layer's tokens without
        copying them; they are never written. The first update copies them into a buffer with
        room, or, given ``room`` (from :meth:`KVCache.take_room`: ``[heads, tokens + n, dim]``
        buffers whose first tokens they are), appends into it.

        Why: ``update()`` on an empty layer would copy them, and the first step again into the buffer."""
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values
        self._kbuf = self._vbuf = None
        if room is not None:
            self._kbuf, self._vbuf = room[0].unsqueeze(0), room[1].unsqueeze(0)

    def reserve(self, tokens: int) -> None:
        """Make the next buffer this layer allocates hold at least ``tokens`` tokens before its spare room.

        Why: a prompt fed in steps of a few hundred tokens outgrows the spare room at every step;
        told the prompt's length first, the layer copies its tokens once, not once per step."""
        self._reserved = max(self._reserved, tokens)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, m = self.get_seq_length(), key_states.shape[-2]
        if not self._fits(n + m, key_states, value_states):
            self._copy_into_new_buffers(n, max(n + m, self._reserved) + self.spare_tokens, key_states, value_states)
        kb, vb = self._kbuf, self._vbuf
        assert kb is not None and vb is not None
        kb[..., n : n + m, :] = key_states
        vb[..., n : n + m, :] = value_states
        self.keys, self.values = kb[..., : n + m, :], vb[..., : n + m, :]
        return self.keys, self.values

    def crop(self, tokens_to_remove: int) -> None:
        """As :meth:`DynamicLayer.crop`; the next step copies, so that no tensor returned before
        the crop sees the tokens written after it."""
        super().crop(tokens_to_remove)
        self._kbuf = self._vbuf = None

    def _fits(self, total: int, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
        """Whether the layer's tensors are still the first tokens of its buffers, with room for
        ``total`` tokens of the new states' batch, heads, dtype and device."""
        kb, vb, k, v = self._kbuf, self._vbuf, self.keys, self.values
        if kb is None or vb is None or k is None or v is None or k.dim() != 4 or v.dim() != 4:
            return False
        return (
            total <= kb.shape[-2]
            and k.data_ptr() == kb.data_ptr()
            and v.data_ptr() == vb.data_ptr()
            and k.stride() == kb.stride()
            and v.stride() == vb.stride()
            and kb.shape[:-2] == key_states.shape[:-2] == k.shape[:-2]
            and vb.shape[:-2] == value_states.shape[:-2] == v.shape[:-2]
            and kb.shape[-1] == key_states.shape[-1]
            and vb.shape[-1] == value_states.shape[-1]
            and torch.promote_types(kb.dtype, key_states.dtype) == kb.dtype
            and torch.promote_types(vb.dtype, value_states.dtype) == vb.dtype
            and kb.device == key_states.device
        )

    def _copy_into_new_buffers(
        self, n: int, capacity: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> None:
        """New buffers holding the layer's ``n`` tokens, in the dtype ``torch.cat`` would give the
        old tokens and the new states together (the wider of the two)."""
        old_k, old_v = (self.keys, self.values) if n else (None, None)
        kd, vd = key_states.dtype, value_states.dtype
        if old_k is not None and old_v is not None:  # set whenever n > 0
            kd, vd = torch.promote_types(old_k.dtype, kd), torch.promote_types(old_v.dtype, vd)
        kb = key_states.new_empty((*key_states.shape[:-2], capacity, key_states.shape[-1]), dtype=kd)
        vb = value_states.new_empty((*value_states.shape[:-2], capacity, value_states.shape[-1]), dtype=vd)
        if old_k is not None and old_v is not None:
            kb[..., :n, :] = old_k
            vb[..., :n, :] = old_v
        self._kbuf, self._vbuf = kb, vb


def to_transformers(kv: KVCache, config, dtype: torch.dtype | None = None) -> DynamicCache:
    """A transformers cache holding ``kv`` (which must start at token 0); its full-attention layers
    are :class:`GrowingLayer` s, which append in place (into ``kv``'s room when it has some that no
    one took: :meth:`KVCache.take_room`)."""
    if kv.start != 0:
        raise ConfigError(f"a model cache must start at token 0, this one starts at {kv.start}")
    kinds = layer_kinds(config)
    if len(kinds) != kv.num_layers:
        raise ConfigError(f"KV has {kv.num_layers} layers but the model has {len(kinds)}")
    for i, l in enumerate(kv.layers):
        if (l.kind, l.window) != kinds[i]:
            raise ConfigError(f"layer {i} is {l.kind.value}/{l.window}, the model expects {kinds[i]}")
    return fill_cache(_growing(DynamicCache(config=config)), kv, dtype)


def fill_cache(cache: DynamicCache, kv: KVCache, dtype: torch.dtype | None = None) -> DynamicCache:
    """``cache`` (empty, one layer per ``kv`` layer) holding ``kv``, cast to ``dtype`` if given: its
    :class:`GrowingLayer` s hold kv's tensors as they are and never write them (their first update
    appends into kv's room when no one took it, :meth:`KVCache.take_room`, else copies them once
    into a buffer with room; ``update()`` here would copy them first, 30-90 ms at 4K tokens on
    SmolLM2 in fp32, then again); other layers take them through ``update()``, which keeps the
    last window-1 tokens of a sliding layer (all of a recording one) and sets its length."""
    room = kv.take_room() if dtype in (None, kv.dtype) else None
    for i, (layer, l) in enumerate(zip(cache.layers, kv.layers)):
        k, v = l.k.unsqueeze(0), l.v.unsqueeze(0)
        if dtype is not None:
            k, v = k.to(dtype), v.to(dtype)
        if isinstance(layer, GrowingLayer):
            layer.hold(k, v, room[i] if room else None)
        else:
            layer.update(k, v)  # type: ignore[union-attr]  # transformers' layer union
    return cache


def finish_recording(cache: DynamicCache) -> None:
    """Trim recorded sliding layers back to their window so the cache is usable for decoding."""
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False) and getattr(layer, "record_past", False) and layer.is_initialized:  # type: ignore[union-attr]  # transformers' layer union
            layer.crop(0)  # type: ignore[union-attr]  # sliding layers have crop()
            layer.record_past = False  # type: ignore[union-attr]  # sliding layers record their past
