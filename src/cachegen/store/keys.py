"""Chunk keys: chained hashes of token ids, namespaced by model and codec.

A chunk's key is ``blake2b(prev_key || tokens)`` where ``tokens`` are the
chunk's token ids as little-endian uint32 and the first ``prev_key`` is a root
digest of the :class:`Namespace`. So a key names the *whole prefix* up to the
chunk's end (the KV of a chunk depends on every token before it), keys are the
same in every process and on every machine (no ``hash()``, no
``PYTHONHASHSEED``), and caches of different models, codec versions or
profiles can never be confused.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from cachegen.errors import ConfigError

KEY_SCHEME = b"cachegen/store/chunk-key/v1"
DIGEST_SIZE = 32  # bytes; keys are 64 hex characters
DEFAULT_CHUNK_TOKENS = 256  # see docs/store.md for the measurement behind it
TOKEN_DTYPE = np.dtype("<u4")


@dataclass(frozen=True)
class Namespace:
    """What must match for a stored chunk to be usable: the weights and the codec."""

    model_fingerprint: str
    format_version: int
    profile_id: str

    def __post_init__(self) -> None:
        if not self.model_fingerprint or not self.profile_id:
            raise ConfigError("a namespace needs a model fingerprint and a profile id")
        if int(self.format_version) != self.format_version or self.format_version < 0:
            raise ConfigError(f"bad codec format version {self.format_version!r}")

    def root(self) -> bytes:
        """The digest that seeds every key chain in this namespace."""
        h = hashlib.blake2b(KEY_SCHEME, digest_size=DIGEST_SIZE)
        for part in (self.model_fingerprint, str(int(self.format_version)), self.profile_id):
            b = part.encode()
            h.update(len(b).to_bytes(4, "little") + b)  # length-prefixed: no ambiguous joins
        return h.digest()


@dataclass(frozen=True)
class ChunkRef:
    """One chunk of a context: tokens ``[start, end)`` and its key (hex)."""

    index: int
    start: int
    end: int
    key: str

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def token_bytes(tokens) -> bytes:
    """Token ids as little-endian uint32 (fixed width, platform independent)."""
    a = np.asarray(tokens.cpu() if hasattr(tokens, "cpu") else tokens)
    if a.ndim != 1:
        raise ConfigError(f"token ids must be one-dimensional, got shape {a.shape}")
    if a.size == 0:
        return b""
    if not np.issubdtype(a.dtype, np.integer):
        raise ConfigError(f"token ids must be integers, got {a.dtype}")
    if int(a.min()) < 0 or int(a.max()) > 0xFFFFFFFF:
        raise ConfigError("token ids must fit in an unsigned 32-bit integer")
    return a.astype(TOKEN_DTYPE, copy=False).tobytes()


def tokens_from_bytes(b: bytes) -> list[int]:
    return np.frombuffer(b, dtype=TOKEN_DTYPE).astype(np.int64).tolist()


def chunk_spans(n_tokens: int, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> list[tuple[int, int]]:
    """``[start, end)`` of each chunk; the last one may be shorter."""
    if chunk_tokens <= 0:
        raise ConfigError("chunk_tokens must be positive")
    return [(a, min(a + chunk_tokens, n_tokens)) for a in range(0, n_tokens, chunk_tokens)]


def chunk_keys(tokens, namespace: Namespace, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> list[ChunkRef]:
    """The chained key of every chunk of ``tokens``, partial last chunk included."""
    raw = token_bytes(tokens)
    n = len(raw) // TOKEN_DTYPE.itemsize
    prev = namespace.root()
    refs = []
    for i, (a, b) in enumerate(chunk_spans(n, chunk_tokens)):
        h = hashlib.blake2b(prev, digest_size=DIGEST_SIZE)
        h.update(raw[a * 4 : b * 4])
        prev = h.digest()
        refs.append(ChunkRef(i, a, b, prev.hex()))
    return refs


def check_key(key: str) -> str:
    """Reject anything that is not a chunk key, before it reaches a path or a Redis key."""
    if len(key) != 2 * DIGEST_SIZE or any(c not in "0123456789abcdef" for c in key):
        raise ConfigError(f"not a chunk key: {key!r}")
    return key
