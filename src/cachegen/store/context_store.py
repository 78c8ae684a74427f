"""Contexts on top of a backend: chunking, lookup, planning, put and get.

The streaming loader calls :meth:`ContextStore.plan` (sizes per level, no
payload transfer), then :meth:`ContextStore.get` per chunk at the level it
picks; it tells a missing chunk (``ChunkNotFound``), an unreachable or stalled
store (``StoreUnavailable``) and a corrupt payload (``CorruptChunk``) apart.
Both take ``timeout=``: the time the loader has left, never exceeded.

The chunk size is recorded with the namespace on the first put: a store
written with other chunk sizes would otherwise look empty (every key differs),
so a mismatch is a :class:`~cachegen.errors.ConfigError` that names the size
to use, and ``chunk_tokens=None`` adopts the recorded one.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cachegen.errors import ConfigError
from cachegen.store.backend import Backend, ChunkWrite, Deadline
from cachegen.store.keys import DEFAULT_CHUNK_TOKENS, ChunkRef, Namespace, chunk_keys, token_bytes, tokens_from_bytes
from cachegen.store.url import redact

if TYPE_CHECKING:  # torch and the codec are not needed to read or write bytes
    from cachegen.codec import ChunkCodec
    from cachegen.kv import KVCache

log = logging.getLogger(__name__)


@dataclass
class ChunkInfo:
    """A chunk and the payload size of each stored level (``{}``: not stored)."""

    ref: ChunkRef
    sizes: dict[int, int] = field(default_factory=dict)

    @property
    def cached(self) -> bool:
        return bool(self.sizes)


def _accepts_key(fn) -> bool:
    """Whether ``fn`` takes ``key=`` (every ``ChunkCodec`` does; older codecs may not yet)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "key" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


class ContextStore:
    """Find, fetch and store the chunks of a context from its token ids alone."""

    def __init__(
        self,
        backend: Backend,
        namespace: Namespace,
        encoder: ChunkCodec | None = None,
        chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
        levels: Sequence[int] | None = None,
    ):
        if chunk_tokens is not None and chunk_tokens <= 0:
            raise ConfigError("chunk_tokens must be positive")
        self.backend, self.namespace, self.encoder = backend, namespace, encoder
        self.levels = tuple(levels) if levels is not None else tuple(getattr(encoder, "levels", ()) or ())
        self._wanted = chunk_tokens  # None: adopt what the store recorded
        self.chunk_tokens = chunk_tokens or DEFAULT_CHUNK_TOKENS
        self._checked = False
        self._encode_key = encoder is not None and _accepts_key(encoder.encode)
        self._encode_end = False
        if encoder is not None:  # an encoder means the codec package is loaded already
            from cachegen.codec.protocol import takes_context_end

            self._encode_end = takes_context_end(encoder)
        if backend.local:  # no network: check now, so a mismatch shows when the store opens
            self.check()

    def __repr__(self) -> str:
        return f"ContextStore({redact(self.backend.url)!r}, chunk_tokens={self.chunk_tokens})"

    # -- the chunk size recorded with the namespace ------------------------------
    @property
    def _setting(self) -> str:
        return f"chunk_tokens:{self.namespace.root().hex()}"

    def check(self, *, timeout: float | None = None) -> None:
        """Compare the chunk size with the one recorded for this namespace (once per store object)."""
        if self._checked:
            return
        stored = self.backend.get_setting(self._setting, timeout=timeout)
        if stored is not None:
            n = int(stored)
            if self._wanted is None:
                self.chunk_tokens = n
            elif n != self._wanted:
                msg = (
                    f"the store {redact(self.backend.url)} holds this model's chunks with {n} tokens each, "
                    f"not {self._wanted}: pass --chunk-tokens {n} (chunk_tokens={n}) or use another store"
                )
                log.error("%s", msg)  # logged too: a loader that falls back on any error must not hide it
                raise ConfigError(msg)
        self._checked = True

    def _claim(self) -> None:
        self.check()
        stored = int(self.backend.claim_setting(self._setting, str(self.chunk_tokens)))
        if stored != self.chunk_tokens:  # another process recorded another size meanwhile
            self._checked = False
            self.check()

    # -- reads -------------------------------------------------------------------
    def refs(self, tokens) -> list[ChunkRef]:
        return chunk_keys(tokens, self.namespace, self.chunk_tokens)

    def plan(self, tokens, *, timeout: float | None = None) -> list[ChunkInfo]:
        """Every chunk of ``tokens`` with its stored sizes, in one round trip.

        A chunk after a missing one is still usable: its key covers the whole
        prefix. Raises ``StoreUnavailable`` rather than take more than ``timeout`` s."""
        d = Deadline(timeout)
        self.check(timeout=d.left())
        refs = self.refs(tokens)
        sizes = self.backend.sizes_many([r.key for r in refs], timeout=d.left())
        return [ChunkInfo(r, s) for r, s in zip(refs, sizes)]

    def lookup(self, tokens, *, timeout: float | None = None) -> int:
        """How many leading tokens of ``tokens`` are cached (at any level)."""
        n = 0
        for info in self.plan(tokens, timeout=timeout):
            if not info.cached:
                break
            n = info.ref.end
        return n

    def get(self, chunk: ChunkRef | str, level: int, *, timeout: float | None = None) -> bytes:
        return self.backend.get(_key(chunk), level, timeout=timeout)

    def get_many(self, items: Sequence[tuple[ChunkRef | str, int]], *, timeout: float | None = None) -> list[bytes]:
        return self.backend.get_many([(_key(c), l) for c, l in items], timeout=timeout)

    def tokens(self, chunk: ChunkRef | str) -> list[int]:
        return tokens_from_bytes(self.backend.tokens(_key(chunk)))

    # -- writes ------------------------------------------------------------------
    def _encode(self, part: KVCache, level: int, key: str, context_end: int) -> bytes:
        assert self.encoder is not None
        kw: dict = {}
        if self._encode_key:  # the chunk carries its key's digest: a swapped chunk fails to decode
            kw["key"] = key
        if self._encode_end:  # the codec spends its bits where the continuation will look
            kw["context_end"] = context_end
        return self.encoder.encode(part, level, **kw)

    def put_context(
        self, tokens, kv: KVCache, levels: Sequence[int] | None = None, *, context_end: int | None = None
    ) -> list[ChunkRef]:
        """Encode and store every chunk of ``tokens`` that ``kv`` covers, at ``levels``.

        ``kv`` holds tokens ``[kv.start, len(tokens))`` with ``kv.start`` on a chunk
        boundary (a caller may prefill only what :meth:`lookup` did not find).
        Levels already stored are not encoded again. Returns the refs written to.
        ``context_end``: where the context these tokens begin ends (default: at their end; a
        writer that stores a long context a part at a time passes the whole length), for a
        codec that spends its bits by recency (:class:`~cachegen.codec.protocol.EncodesInContext`)."""
        if self.encoder is None:
            raise ConfigError("this ContextStore has no encoder; pass one to store contexts")
        levels = tuple(levels) if levels is not None else self.levels
        if not levels:
            raise ConfigError("no levels to store: pass levels= or an encoder with a .levels attribute")
        self._claim()
        raw = token_bytes(tokens)
        n = len(raw) // 4
        if kv.end != n or kv.start % self.chunk_tokens:
            raise ConfigError(
                f"KV covers [{kv.start}, {kv.end}) but must end at the context's {n} tokens "
                f"and start on a {self.chunk_tokens}-token chunk boundary"
            )
        end = n if context_end is None else context_end
        if not (isinstance(end, int) and not isinstance(end, bool) and end >= n):
            raise ConfigError(f"context_end {context_end!r} must be an int, at least the {n} tokens given")
        full = self.plan(tokens)
        written = []
        for i, info in enumerate(full):
            ref = info.ref
            if ref.start < kv.start:
                continue
            missing = [l for l in levels if l not in info.sizes]
            last = ref.end == n
            if not missing and not last:
                continue
            part = kv.slice(ref.start, ref.end)
            payloads = {l: self._encode(part, l, ref.key, end) for l in missing}
            prev = full[i - 1].ref.key if i else ""
            self.backend.put_chunks(
                [
                    ChunkWrite(
                        ref.key,
                        raw[ref.start * 4 : ref.end * 4],
                        payloads,
                        start=ref.start,
                        ends_context=last,
                        prev=prev,
                    )
                ]
            )
            if payloads:
                written.append(ref)
        return written


def _key(chunk: ChunkRef | str) -> str:
    return chunk.key if isinstance(chunk, ChunkRef) else chunk
