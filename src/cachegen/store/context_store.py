"""Contexts on top of a backend: chunking, lookup, planning, put and get.

The streaming loader calls :meth:`ContextStore.plan` (sizes per level, no
payload transfer), then :meth:`ContextStore.get` per chunk at the level it
picks; it tells a missing chunk (``ChunkNotFound``), an unreachable store
(``StoreUnavailable``) and a corrupt payload (``CorruptChunk``) apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, Sequence

from cachegen.errors import ConfigError
from cachegen.store.backend import Backend, ChunkWrite
from cachegen.store.keys import DEFAULT_CHUNK_TOKENS, ChunkRef, Namespace, chunk_keys, token_bytes, tokens_from_bytes

if TYPE_CHECKING:  # torch is not needed to read or write bytes
    from cachegen.kv import KVCache


class Encoder(Protocol):
    """What the store needs of a codec (``cachegen.codec.Codec`` is one)."""

    def encode(self, kv: KVCache, level: int) -> bytes: ...


@dataclass
class ChunkInfo:
    """A chunk and the payload size of each stored level (``{}``: not stored)."""

    ref: ChunkRef
    sizes: dict[int, int] = field(default_factory=dict)

    @property
    def cached(self) -> bool:
        return bool(self.sizes)


class ContextStore:
    """Find, fetch and store the chunks of a context from its token ids alone."""

    def __init__(
        self,
        backend: Backend,
        namespace: Namespace,
        encoder: Encoder | None = None,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        levels: Sequence[int] | None = None,
    ):
        if chunk_tokens <= 0:
            raise ConfigError("chunk_tokens must be positive")
        self.backend, self.namespace, self.encoder, self.chunk_tokens = backend, namespace, encoder, chunk_tokens
        self.levels = tuple(levels) if levels is not None else tuple(getattr(encoder, "levels", ()) or ())

    def refs(self, tokens) -> list[ChunkRef]:
        return chunk_keys(tokens, self.namespace, self.chunk_tokens)

    def plan(self, tokens) -> list[ChunkInfo]:
        """Every chunk of ``tokens`` with its stored sizes, in one round trip.

        A chunk after a missing one is still usable: its key covers the whole prefix."""
        refs = self.refs(tokens)
        return [ChunkInfo(r, s) for r, s in zip(refs, self.backend.sizes_many([r.key for r in refs]))]

    def lookup(self, tokens) -> int:
        """How many leading tokens of ``tokens`` are cached (at any level)."""
        n = 0
        for info in self.plan(tokens):
            if not info.cached:
                break
            n = info.ref.end
        return n

    def get(self, chunk: ChunkRef | str, level: int) -> bytes:
        return self.backend.get(_key(chunk), level)

    def get_many(self, items: Sequence[tuple[ChunkRef | str, int]]) -> list[bytes]:
        return self.backend.get_many([(_key(c), l) for c, l in items])

    def tokens(self, chunk: ChunkRef | str) -> list[int]:
        return tokens_from_bytes(self.backend.tokens(_key(chunk)))

    def put_context(self, tokens, kv: KVCache, levels: Sequence[int] | None = None) -> list[ChunkRef]:
        """Encode and store every chunk of ``tokens`` that ``kv`` covers, at ``levels``.

        ``kv`` holds tokens ``[kv.start, len(tokens))`` with ``kv.start`` on a chunk
        boundary (a caller may prefill only what :meth:`lookup` did not find).
        Levels already stored are not encoded again. Returns the refs written to."""
        if self.encoder is None:
            raise ConfigError("this ContextStore has no encoder; pass one to store contexts")
        levels = tuple(levels) if levels is not None else self.levels
        if not levels:
            raise ConfigError("no levels to store: pass levels= or an encoder with a .levels attribute")
        raw = token_bytes(tokens)
        n = len(raw) // 4
        if kv.end != n or kv.start % self.chunk_tokens:
            raise ConfigError(
                f"KV covers [{kv.start}, {kv.end}) but must end at the context's {n} tokens "
                f"and start on a {self.chunk_tokens}-token chunk boundary"
            )
        plan = [i for i in self.plan(tokens) if i.ref.start >= kv.start]
        written = []
        for info in plan:
            ref = info.ref
            missing = [l for l in levels if l not in info.sizes]
            last = ref.end == n
            if not missing and not last:
                continue
            part = kv.slice(ref.start, ref.end)
            payloads = {l: self.encoder.encode(part, l) for l in missing}
            self.backend.put_chunks(
                [ChunkWrite(ref.key, raw[ref.start * 4 : ref.end * 4], payloads, start=ref.start, ends_context=last)]
            )
            if payloads:
                written.append(ref)
        return written


def _key(chunk: ChunkRef | str) -> str:
    return chunk.key if isinstance(chunk, ChunkRef) else chunk
