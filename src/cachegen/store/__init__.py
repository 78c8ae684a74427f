"""Find a context's KV chunks from its token ids, in a local directory or in Redis.

``open_backend(url)`` picks the backend; :class:`ContextStore` adds chunking,
chained keys, lookup, planning and put/get on top of it; :mod:`.catalog`
lists and removes whole contexts.
"""

from cachegen.store.backend import Backend, ChunkRow, ChunkWrite, LevelStats, StoreStats
from cachegen.store.catalog import ContextInfo, list_contexts, remove_context
from cachegen.store.context_store import ChunkInfo, ContextStore
from cachegen.store.keys import DEFAULT_CHUNK_TOKENS, ChunkRef, Namespace, chunk_keys, chunk_spans, token_bytes
from cachegen.store.url import default_store_url, open_backend, parse_size, redact

__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "Backend",
    "ChunkInfo",
    "ChunkRef",
    "ChunkRow",
    "ChunkWrite",
    "ContextInfo",
    "ContextStore",
    "LevelStats",
    "Namespace",
    "StoreStats",
    "chunk_keys",
    "chunk_spans",
    "default_store_url",
    "list_contexts",
    "open_backend",
    "parse_size",
    "redact",
    "remove_context",
    "token_bytes",
]
