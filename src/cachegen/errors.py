"""One exception hierarchy for the whole project.

Callers catch :class:`CachegenError` for anything this library raises on
purpose; the subclasses say which layer failed and why.
"""

from __future__ import annotations


class CachegenError(Exception):
    """Base class of every error cachegen raises deliberately."""


class ConfigError(CachegenError, ValueError):
    """A bad argument, option or configuration value."""


class ModelNotFound(CachegenError):
    """A model name or directory that cannot be loaded; the message names the fix."""


class CodecError(CachegenError):
    """Encoding or decoding failed."""


class CorruptChunk(CodecError):
    """Bytes that are not a valid chunk: bad magic, checksum, bounds or structure."""

    def __init__(self, reason: str):
        super().__init__(f"corrupt chunk: {reason}")
        self.reason = reason


class FormatVersionError(CorruptChunk):
    """A chunk written by an incompatible format version."""


class ProfileMismatch(CorruptChunk):
    """A chunk refers to a profile (codebook) or model that is not the one given.

    A kind of :class:`CorruptChunk`: to a loader, a chunk it cannot decode with
    its profile is as unusable as a damaged one, and gets the same fallback.
    """

    def __init__(self, reason: str):
        CodecError.__init__(self, reason)
        self.reason = reason


class KeyMismatch(CorruptChunk):
    """A valid chunk stored under another chunk's key (a foreign or swapped chunk)."""


class StoreError(CachegenError):
    """A store backend failed (I/O, network, bad URL)."""


class StoreUnavailable(StoreError):
    """The store cannot be reached (connection refused, timeout, went away)."""


class ChunkNotFound(StoreError, KeyError):
    """The requested chunk or level is not in the store."""

    __str__ = Exception.__str__  # KeyError would quote the message


class LoaderError(CachegenError):
    """The streaming loader could not produce a cache (it then recomputes)."""
