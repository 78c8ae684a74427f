"""vLLM's paged KV blocks <-> cachegen's per-layer ``[kv_heads, tokens, head_dim]``.

vLLM's CPU attention keeps each layer as ``[num_blocks, kv_heads, block_size,
2 * head_dim]``, but the last two dimensions are not "token, K|V": within one
(block, head) the kernel writes K and V in its own order (on the AVX-512 path K
is ``[head_dim, block_size]``, transposed, then V ``[block_size, head_dim]``;
the AMX path may differ). Reading it naively gives a relative error of 1.4. So
the order is not assumed: :meth:`PagedLayout.probe` writes known tokens with
the engine's own write kernel into a scratch block and reads where each
(token, dim) of K and V landed. Pure torch: the vLLM-specific write kernel is
passed in by the connector.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from cachegen.errors import ConfigError
from cachegen.kv import KVCache, KVLayer

# write(key, value, cache, slot_mapping): key/value [tokens, heads, head_dim] into cache
# [num_blocks, heads, block_size, 2 * head_dim] at the slots, as the attention backend does
WriteKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]

_EXACT = 256  # small integers are exact in bf16 up to here: the probe's markers


@dataclass(frozen=True)
class PagedLayout:
    """Where token ``t``, dim ``d`` of K and V sit in one (block, head) region of ``2 * block_size * head_dim``.

    ``k_index[t * head_dim + d]`` (and ``v_index``) is the flat offset in that region."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    k_index: torch.Tensor
    v_index: torch.Tensor

    @property
    def region(self) -> int:
        return 2 * self.block_size * self.head_dim

    @classmethod
    def probe(
        cls, write: WriteKernel, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.bfloat16
    ) -> PagedLayout:
        """Learn the layout from the engine's write kernel (one scratch block, two writes)."""
        if block_size > _EXACT or head_dim > _EXACT:
            raise ConfigError(
                f"cannot probe a KV layout with block size {block_size} or head size {head_dim} > {_EXACT}"
            )
        heads = max(num_kv_heads, 1)
        cache = torch.zeros(2, heads, block_size, 2 * head_dim, dtype=dtype)
        slots = torch.arange(block_size, 2 * block_size)  # block 1: block 0 must stay untouched
        seen = []
        for marker in (
            torch.arange(block_size)[:, None].expand(block_size, head_dim),
            torch.arange(head_dim)[None, :].expand(block_size, head_dim),
        ):
            cache.zero_()
            k = (marker + 1).to(dtype)[:, None, :].expand(block_size, heads, head_dim).contiguous()
            write(k, -k, cache, slots)
            if bool(cache[0].any()):
                raise ConfigError("the KV write kernel wrote outside the probed block: unknown layout")
            seen.append(cache[1, 0].reshape(-1).to(torch.float32).round().to(torch.int64))
        tok, dim = seen
        if not torch.equal(tok > 0, dim > 0) or not torch.equal(tok < 0, dim < 0) or bool((tok == 0).any()):
            raise ConfigError("the KV write kernel left holes in a block: unknown layout")
        idx = []
        for sign in (1, -1):
            pos = torch.nonzero(tok * sign > 0).flatten()
            flat = (tok[pos] * sign - 1) * head_dim + (dim[pos] * sign - 1)
            if pos.numel() != block_size * head_dim or torch.unique(flat).numel() != flat.numel():
                raise ConfigError("the KV write kernel does not store each (token, dim) once: unknown layout")
            index = torch.empty(block_size * head_dim, dtype=torch.int64)
            index[flat] = pos
            idx.append(index)
        return cls(block_size, num_kv_heads, head_dim, idx[0], idx[1])

    def check(self, layer: torch.Tensor) -> None:
        want = (self.num_kv_heads, self.block_size, 2 * self.head_dim)
        if layer.dim() != 4 or tuple(layer.shape[1:]) != want:
            raise ConfigError(
                f"vLLM KV layer has shape {tuple(layer.shape)}, expected [blocks, {', '.join(map(str, want))}]"
            )
        if not layer.is_contiguous():
            raise ConfigError("vLLM KV layer is not contiguous")

    # -- one layer -------------------------------------------------------------------
    def gather(self, layer: torch.Tensor, block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[kv_heads, len(block_ids) * block_size, head_dim]`` of whole blocks (a copy)."""
        n, h, bs, hd = len(block_ids), self.num_kv_heads, self.block_size, self.head_dim
        x = layer.view(layer.shape[0], h, self.region)[torch.as_tensor(list(block_ids), dtype=torch.int64)]

        def part(index: torch.Tensor) -> torch.Tensor:
            return x[:, :, index].view(n, h, bs, hd).permute(1, 0, 2, 3).reshape(h, n * bs, hd)

        return part(self.k_index), part(self.v_index)

    def scatter(self, layer: torch.Tensor, block_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Overwrite whole blocks with K and V ``[kv_heads, len(block_ids) * block_size, head_dim]``."""
        n, h, bs, hd = len(block_ids), self.num_kv_heads, self.block_size, self.head_dim
        if tuple(k.shape) != (h, n * bs, hd) or tuple(v.shape) != (h, n * bs, hd):
            raise ConfigError(f"K/V {tuple(k.shape)} do not fill {n} blocks of [{h}, {bs}, {hd}]")
        x = torch.empty(n, h, self.region, dtype=layer.dtype)
        x[:, :, self.k_index] = k.to(layer.dtype).reshape(h, n, bs * hd).transpose(0, 1)
        x[:, :, self.v_index] = v.to(layer.dtype).reshape(h, n, bs * hd).transpose(0, 1)
        layer.view(layer.shape[0], h, self.region)[torch.as_tensor(list(block_ids), dtype=torch.int64)] = x

    # -- every layer -----------------------------------------------------------------
    def read(self, layers: Sequence[torch.Tensor], block_ids: Sequence[int], start: int) -> KVCache:
        """The KV of whole blocks of every layer as a :class:`KVCache` starting at token ``start``."""
        out = []
        for layer in layers:
            k, v = self.gather(layer, block_ids)
            out.append(KVLayer(k, v))
        return KVCache(out, start=start)

    def write(self, layers: Sequence[torch.Tensor], block_ids: Sequence[int], kv: KVCache) -> None:
        if kv.num_layers != len(layers):
            raise ConfigError(f"KV has {kv.num_layers} layers, vLLM has {len(layers)}")
        for layer, kl in zip(layers, kv.layers):
            self.scatter(layer, block_ids, kl.k, kl.v)
