"""Contexts as a user sees them: ``cachegen store ls`` and ``cachegen store rm``.

A store holds chunks, not contexts: an ingested context is the chain of
chunks that ends at a chunk marked as a context's end, each chunk naming the
one before it (``ChunkWrite.prev``). Contexts that share a prefix share its
chunks, so removing one context removes only the chunks no other context
still goes through.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

from cachegen.errors import ConfigError
from cachegen.store.backend import Backend, ChunkRow

log = logging.getLogger(__name__)

MIN_ID_CHARS = 8  # an id prefix shorter than this is too easy to mistype into another context


@dataclass
class ContextInfo:
    """One stored context: ``id`` is its last chunk's key."""

    id: str
    tokens: int  # context length, from its first stored chunk to its end
    chunks: int
    levels: list[int]  # levels stored for every chunk of the context
    bytes: int  # payload bytes of its chunks, all levels (shared chunks counted in each context)
    complete: bool  # every chunk back to token 0 is still stored

    def to_json(self) -> dict:
        return asdict(self)


def _chains(backend: Backend) -> tuple[dict[str, ChunkRow], list[list[ChunkRow]]]:
    rows = {r.key: r for r in backend.chunk_rows()}
    chains = []
    for end in sorted((r for r in rows.values() if r.ends_context), key=lambda r: (r.start, r.key)):
        chain, seen, r = [end], {end.key}, end
        while r.prev and r.prev in rows and r.prev not in seen:  # ``seen``: a garbled row cannot loop
            r = rows[r.prev]
            chain.append(r)
            seen.add(r.key)
        chains.append(chain[::-1])
    return rows, chains


def list_contexts(backend: Backend) -> list[ContextInfo]:
    """Every ingested context whose last chunk is still stored, shortest first."""
    out = []
    for chain in _chains(backend)[1]:
        levels = set(chain[0].sizes)
        for r in chain[1:]:
            levels &= set(r.sizes)
        first, last = chain[0], chain[-1]
        out.append(
            ContextInfo(
                id=last.key,
                tokens=last.start + last.num_tokens - first.start,
                chunks=len(chain),
                levels=sorted(levels),
                bytes=sum(sum(r.sizes.values()) for r in chain),
                complete=first.start == 0,
            )
        )
    return out


def find_context(backend: Backend, context_id: str) -> list[ChunkRow]:
    """The chain of the one context whose id starts with ``context_id``."""
    want = context_id.strip().lower()
    if len(want) < MIN_ID_CHARS or any(c not in "0123456789abcdef" for c in want):
        raise ConfigError(
            f"bad context id {context_id!r}: give at least {MIN_ID_CHARS} hex characters "
            "of an id that `cachegen store ls` prints"
        )
    found = [c for c in _chains(backend)[1] if c[-1].key.startswith(want)]
    if not found:
        raise ConfigError(f"no context {context_id!r} in {backend.url}: `cachegen store ls` lists them")
    if len(found) > 1:
        raise ConfigError(f"context id {context_id!r} is ambiguous ({len(found)} contexts): give more characters")
    return found[0]


def remove_context(backend: Backend, context_id: str) -> int:
    """Remove one context: its chunks that no other context uses. Returns chunks removed."""
    chain = find_context(backend, context_id)
    target = chain[-1].key
    used = {r.key for c in _chains(backend)[1] if c[-1].key != target for r in c}
    mine = [r.key for r in chain if r.key not in used]
    if target in used:  # a prefix of a longer context: it stays, only its end mark goes
        backend.unmark_end(target)
    n = backend.delete_chunks(mine)
    log.info(
        "removed context %s: %d chunks (%d shared with other contexts kept)", target[:16], n, len(chain) - len(mine)
    )
    return n
