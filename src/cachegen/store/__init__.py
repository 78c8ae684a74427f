"""Find a context's KV chunks from its token ids, in a local directory or in Redis.

``open_backend(url)`` picks the backend; :class:`ContextStore` adds chunking,
chained keys, lookup, planning and put/get on top of it.
"""

from cachegen.store.backend import Backend, ChunkWrite, LevelStats, StoreStats
from cachegen.store.context_store import ChunkInfo, ContextStore, Encoder
from cachegen.store.keys import DEFAULT_CHUNK_TOKENS, ChunkRef, Namespace, chunk_keys, chunk_spans, token_bytes
from cachegen.store.url import default_store_url, open_backend, parse_size

__all__ = [
    "Backend",
    "ChunkInfo",
    "ChunkRef",
    "ChunkWrite",
    "ContextStore",
    "DEFAULT_CHUNK_TOKENS",
    "Encoder",
    "LevelStats",
    "Namespace",
    "StoreStats",
    "chunk_keys",
    "chunk_spans",
    "default_store_url",
    "open_backend",
    "parse_size",
    "token_bytes",
]
