"""The one in-memory KV cache type of the project.

A :class:`KVCache` is a list of :class:`KVLayer`, each holding K and V of
shape ``[kv_heads, tokens, head_dim]`` (batch 1) for one attention layer, plus
the layer's kind. Every layer holds the *same* token range
``[start, start + num_tokens)``: sliding-window layers keep all their tokens
here too, so that any prefix of a context can be rebuilt from its chunks; the
window is applied only when the cache is handed to a model.

It depends on torch alone, so the codec and the store can use it without
transformers.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import Enum

import torch

from cachegen.errors import ConfigError

# Tokens of room a loader leaves after its cache's full-attention layers: a decoding session that
# takes them (:meth:`KVCache.take_room`) appends its first steps there instead of copying the cache.
ROOM_TOKENS = 256
_ROOM_LOCK = threading.Lock()


class LayerKind(str, Enum):
    FULL = "full"
    SLIDING = "sliding"


@dataclass
class KVLayer:
    """K and V of one layer, ``[kv_heads, tokens, head_dim]`` each."""

    k: torch.Tensor
    v: torch.Tensor
    kind: LayerKind = LayerKind.FULL
    window: int | None = None  # sliding window length, for SLIDING layers

    def __post_init__(self) -> None:
        if self.k.dim() != 3 or self.v.dim() != 3:
            raise ConfigError(
                f"K and V must be [heads, tokens, head_dim], got {tuple(self.k.shape)} and {tuple(self.v.shape)}"
            )
        if self.k.shape[:2] != self.v.shape[:2]:
            raise ConfigError(f"K {tuple(self.k.shape)} and V {tuple(self.v.shape)} disagree on heads/tokens")
        if self.kind == LayerKind.SLIDING and not self.window:
            raise ConfigError("a sliding layer needs its window")

    @property
    def num_tokens(self) -> int:
        return int(self.k.shape[1])

    def slice(self, a: int, b: int) -> KVLayer:
        # not dataclasses.replace: a loader slices every layer for every chunk it places
        return KVLayer(self.k[:, a:b], self.v[:, a:b], self.kind, self.window)


@dataclass
class KVCache:
    """The KV of a token range ``[start, start + num_tokens)`` for every layer."""

    layers: list[KVLayer]
    start: int = 0
    meta: dict = field(default_factory=dict)  # free-form, e.g. model fingerprint
    # per layer, the buffer its K and V are the first tokens of (allocate(room_tokens=...)); not
    # carried by slices, copies or dataclasses.replace, and handed out once (take_room)
    _room: tuple[int, list[tuple[torch.Tensor, torch.Tensor] | None]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if not self.layers:
            raise ConfigError("a KVCache needs at least one layer")
        n = self.layers[0].num_tokens
        for i, layer in enumerate(self.layers):
            if layer.num_tokens != n:
                raise ConfigError(f"layer {i} holds {layer.num_tokens} tokens, layer 0 holds {n}")

    # -- shape ---------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_tokens(self) -> int:
        return self.layers[0].num_tokens

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].k.dtype

    @property
    def num_values(self) -> int:
        """K and V elements over all layers."""
        return sum(l.k.numel() + l.v.numel() for l in self.layers)

    @property
    def nbytes(self) -> int:
        return sum(l.k.numel() * l.k.element_size() + l.v.numel() * l.v.element_size() for l in self.layers)

    # -- operations ----------------------------------------------------------
    def slice(self, a: int, b: int) -> KVCache:
        """Tokens ``[a, b)`` in *absolute* positions (``start <= a <= b <= end``)."""
        if not (self.start <= a <= b <= self.end):
            raise ConfigError(f"slice [{a}, {b}) outside cache range [{self.start}, {self.end})")
        lo, hi = a - self.start, b - self.start
        return KVCache([l.slice(lo, hi) for l in self.layers], start=a, meta=dict(self.meta))

    def chunks(self, chunk_tokens: int) -> list[KVCache]:
        """Split into consecutive slices of ``chunk_tokens`` (the last may be shorter)."""
        if chunk_tokens <= 0:
            raise ConfigError("chunk_tokens must be positive")
        return [self.slice(a, min(a + chunk_tokens, self.end)) for a in range(self.start, self.end, chunk_tokens)]

    def to(self, dtype: torch.dtype) -> KVCache:
        return KVCache(
            [replace(l, k=l.k.to(dtype), v=l.v.to(dtype)) for l in self.layers], start=self.start, meta=dict(self.meta)
        )

    def clone(self) -> KVCache:
        return KVCache(
            [replace(l, k=l.k.clone(), v=l.v.clone()) for l in self.layers], start=self.start, meta=dict(self.meta)
        )

    def same_layout(self, other: KVCache) -> bool:
        """True when both have the same layers, kinds, heads and head sizes."""
        if self.num_layers != other.num_layers:
            return False
        for a, b in zip(self.layers, other.layers):
            if (a.kind, a.window) != (b.kind, b.window):
                return False
            if a.k.shape[0] != b.k.shape[0] or a.k.shape[2] != b.k.shape[2] or a.v.shape[2] != b.v.shape[2]:
                return False
        return True

    @staticmethod
    def allocate(
        like: KVCache, num_tokens: int, *, start: int = 0, dtype: torch.dtype | None = None, room_tokens: int = 0
    ) -> KVCache:
        """An uninitialised cache of ``num_tokens`` from ``start`` with ``like``'s layout (dtype: ``like``'s).

        Why: a loader that knows the whole prefix's length allocates it once and writes each
        chunk's slice as it is decoded (:meth:`write`), instead of joining the chunks at the end
        (:meth:`concat`, a second copy of the whole context and twice its memory at the peak).
        With ``room_tokens``, each full-attention layer's K and V are the first tokens of a buffer
        that many tokens longer, which one decoding session may take (:meth:`take_room`) to append
        into, so that its first step does not copy the whole cache."""
        if num_tokens < 0 or room_tokens < 0:
            raise ConfigError("num_tokens and room_tokens must be >= 0")
        dt = dtype or like.dtype
        layers, room = [], []
        for l in like.layers:
            r = room_tokens if l.kind == LayerKind.FULL else 0
            kb = torch.empty((l.k.shape[0], num_tokens + r, l.k.shape[2]), dtype=dt)
            vb = torch.empty((l.v.shape[0], num_tokens + r, l.v.shape[2]), dtype=dt)
            layers.append(replace(l, k=kb[:, :num_tokens], v=vb[:, :num_tokens]))
            room.append((kb, vb) if r else None)
        out = KVCache(layers, start=start, meta=dict(like.meta))
        if any(r is not None for r in room):
            out._room = (num_tokens, room)
        return out

    def take_room(self) -> list[tuple[torch.Tensor, torch.Tensor] | None] | None:
        """Per layer, the buffer (``[heads, tokens + room, dim]``) whose first tokens are the layer's
        K and V, or None for a layer without room; None for a cache without room, or whose room was
        taken already, or whose layers were replaced since.

        Why once: the taker writes after the cache's tokens. Two decoding sessions over one loaded
        cache would write the same room, so only the first gets it; the cache's own tokens are
        never written either way."""
        with _ROOM_LOCK:
            held, self._room = self._room, None
        if held is None or len(held[1]) != len(self.layers):
            return None
        n, room = held
        for l, r in zip(self.layers, room):
            if r is None:
                continue
            for t, b in zip((l.k, l.v), r):
                if t.data_ptr() != b.data_ptr() or t.stride() != b.stride() or t.dtype != b.dtype:
                    return None
                if t.shape[1] != n or t.shape[::2] != b.shape[::2]:
                    return None
        return room

    def write(self, part: KVCache) -> None:
        """Copy ``part`` into its token range of this cache (cast to this cache's dtype, as :meth:`to`)."""
        if not (self.start <= part.start and part.end <= self.end):
            raise ConfigError(f"part [{part.start}, {part.end}) outside cache range [{self.start}, {self.end})")
        if not self.same_layout(part):
            raise ConfigError("the part's layout differs from the cache's")
        lo, hi = part.start - self.start, part.end - self.start
        for dst, src in zip(self.layers, part.layers):
            dst.k[:, lo:hi].copy_(src.k)
            dst.v[:, lo:hi].copy_(src.v)

    @staticmethod
    def concat(parts: Sequence[KVCache]) -> KVCache:
        """Join consecutive slices; they must be contiguous and share a layout."""
        if not parts:
            raise ConfigError("nothing to concatenate")
        first = parts[0]
        for prev, nxt in itertools.pairwise(parts):
            if nxt.start != prev.end:
                raise ConfigError(f"slices are not contiguous: [{prev.start}, {prev.end}) then [{nxt.start}, ...)")
            if not first.same_layout(nxt):
                raise ConfigError("slices have different layouts")
        layers = []
        for i, l0 in enumerate(first.layers):
            layers.append(
                replace(
                    l0,
                    k=torch.cat([p.layers[i].k for p in parts], dim=1),
                    v=torch.cat([p.layers[i].v for p in parts], dim=1),
                )
            )
        return KVCache(layers, start=first.start, meta=dict(first.meta))
