"""Chunk container: header, per-section table, checksums; parsing that trusts nothing.

Layout (little endian)::

    "CGKC" u16 version u16 header_len
    header: u8 level, u8 dtype, u8 flags, u8 fp_len, fingerprint, 16-byte profile id,
            16-byte key digest (blake2b of the store's chunk key, "" when none),
            u64 start, u32 tokens, u16 layers, u16 sink_tokens, u16 sections,
            per layer (u8 kind, u32 window, u16 heads, u16 k_dim, u16 v_dim),
            per section (u64 length, u32 crc32)
    u32 crc32 of everything above
    sections: [inline profile if flags & INLINE_PROFILE], then K and V of each layer

Sections are independent, so decoding can start layer by layer. Every field
is bounded here (positions below :data:`MAX_POSITION`, counts below hard caps,
lengths equal to the bytes present); the codec then checks the layout against
its profile and its own per-chunk token maximum before anything is allocated.
The key digest binds a chunk to the key it was written for: the header
checksum covers it, so a chunk copied over another key fails with
:class:`~cachegen.errors.KeyMismatch` instead of loading.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from cachegen.errors import CorruptChunk, FormatVersionError, KeyMismatch
from cachegen.kv import LayerKind

MAGIC = b"CGKC"
FORMAT_VERSION = (
    4  # 2: lossy sections are one interleaved rANS stream (16 shared states); 3: + per-token step multipliers;
)
# 4: + the chunk key's digest in the header; lossless tables never give a symbol p > LOSSLESS_MAX_FREQ / 4096
FLAG_INLINE_PROFILE = 1

DTYPES = {0: torch.float32, 1: torch.float16, 2: torch.bfloat16}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}
KINDS = {0: LayerKind.FULL, 1: LayerKind.SLIDING}
KIND_CODES = {v: k for k, v in KINDS.items()}

MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_DIM = 8192
MAX_TOKENS = 1 << 22
MAX_VALUES = 1 << 31
MAX_POSITION = 1 << 24  # start + tokens: far beyond any model's context, exact in float32 RoPE tables
DIGEST_SIZE = 16

_PRE = struct.Struct("<4sHH")
_FIX = struct.Struct("<BBBB")
_POS = struct.Struct("<QIHHH")
_LAYER = struct.Struct("<BIHHH")
_SEC = struct.Struct("<QI")


@dataclass(frozen=True)
class LayerShape:
    kind: LayerKind
    window: int | None
    heads: int
    k_dim: int
    v_dim: int


@dataclass(frozen=True)
class ChunkHeader:
    """What :meth:`cachegen.codec.Codec.peek` returns: everything but the payload."""

    version: int
    model_fingerprint: str
    profile_id: str  # hex, "" when the chunk carries its own tables
    level: int
    key_digest: bytes  # DIGEST_SIZE bytes: :func:`key_digest` of the chunk key it was written for
    start: int
    num_tokens: int
    dtype: torch.dtype
    layers: tuple[LayerShape, ...]
    sink_tokens: int
    inline_profile: bool
    section_lengths: tuple[int, ...]
    section_crcs: tuple[int, ...]
    payload_offset: int

    @property
    def num_values(self) -> int:
        return sum(self.num_tokens * l.heads * (l.k_dim + l.v_dim) for l in self.layers)

    def section_offsets(self) -> tuple[int, ...]:
        """Where each section starts; computed once per header (a decode asks once per section)."""
        cached = self.__dict__.get("_offsets")
        if cached is None:
            out, o = [], self.payload_offset
            for n in self.section_lengths:
                out.append(o)
                o += n
            cached = tuple(out)
            object.__setattr__(self, "_offsets", cached)  # frozen: not a field, not compared
        return cached


def key_digest(key: str | None) -> bytes:
    """The digest a chunk written for ``key`` carries (``None``: no key, the digest of "")."""
    return hashlib.blake2b((key or "").encode(), digest_size=DIGEST_SIZE, person=b"cachegen-chunk").digest()


def check_key(h: ChunkHeader, key: str | None) -> None:
    """KeyMismatch unless the chunk was written for ``key`` (no check when ``key`` is None)."""
    if key is not None and h.key_digest != key_digest(key):
        raise KeyMismatch("chunk was written for another key (a foreign or swapped chunk)")


def pack_header(h: ChunkHeader) -> bytes:
    fp = h.model_fingerprint.encode()
    if len(fp) > 255:
        raise ValueError("fingerprint longer than 255 bytes")
    pid = bytes.fromhex(h.profile_id) if h.profile_id else bytes(16)
    if len(h.key_digest) != DIGEST_SIZE:
        raise ValueError("bad key digest")
    body = [
        _FIX.pack(h.level, DTYPE_CODES[h.dtype], FLAG_INLINE_PROFILE if h.inline_profile else 0, len(fp)),
        fp,
        pid.ljust(16, b"\0")[:16],
        h.key_digest,
    ]
    body.append(_POS.pack(h.start, h.num_tokens, len(h.layers), h.sink_tokens, len(h.section_lengths)))
    for l in h.layers:
        body.append(_LAYER.pack(KIND_CODES[l.kind], l.window or 0, l.heads, l.k_dim, l.v_dim))
    for n, c in zip(h.section_lengths, h.section_crcs):
        body.append(_SEC.pack(n, c))
    b = b"".join(body)
    pre = _PRE.pack(MAGIC, FORMAT_VERSION, len(b))
    return pre + b + struct.pack("<I", zlib.crc32(pre + b))


def parse_header(data: bytes | memoryview) -> ChunkHeader:
    """Validate and parse the header; raises CorruptChunk / FormatVersionError."""
    mv = memoryview(data)
    n = len(mv)
    if n < _PRE.size:
        raise CorruptChunk("shorter than a chunk header")
    magic, version, hlen = _PRE.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CorruptChunk("bad magic: not a cachegen chunk")
    if version != FORMAT_VERSION:
        raise FormatVersionError(
            f"chunk format version {version}; this cachegen reads version {FORMAT_VERSION} (re-encode the chunk)"
        )
    end = _PRE.size + hlen
    if end + 4 > n:
        raise CorruptChunk("truncated header")
    (crc,) = struct.unpack_from("<I", mv, end)
    if zlib.crc32(mv[:end]) != crc:
        raise CorruptChunk("header checksum mismatch")
    try:
        p = _PRE.size
        level, dcode, flags, fplen = _FIX.unpack_from(mv, p)
        p += _FIX.size
        fp = bytes(mv[p : p + fplen]).decode("ascii")
        p += fplen
        pid = bytes(mv[p : p + 16])
        p += 16
        digest = bytes(mv[p : p + DIGEST_SIZE])
        p += DIGEST_SIZE
        start, tokens, nl, sink, nsec = _POS.unpack_from(mv, p)
        p += _POS.size
        if dcode not in DTYPES:
            raise CorruptChunk(f"unknown dtype code {dcode}")
        if not (1 <= nl <= MAX_LAYERS) or tokens > MAX_TOKENS or sink > tokens:
            raise CorruptChunk("layer or token count out of range")
        if start + tokens > MAX_POSITION:
            raise CorruptChunk(f"positions out of range (start {start})")
        inline = bool(flags & FLAG_INLINE_PROFILE)
        if flags & ~FLAG_INLINE_PROFILE:
            raise CorruptChunk("unknown flags")
        if nsec != 2 * nl + (1 if inline else 0):
            raise CorruptChunk("section count does not match layer count")
        layers = []
        for _ in range(nl):
            kc, win, heads, kd, vd = _LAYER.unpack_from(mv, p)
            p += _LAYER.size
            if kc not in KINDS or not (1 <= heads <= MAX_HEADS) or not (1 <= kd <= MAX_DIM) or not (1 <= vd <= MAX_DIM):
                raise CorruptChunk("layer shape out of range")
            kind = KINDS[kc]
            if (kind == LayerKind.SLIDING) != (win > 0) or win > MAX_POSITION:
                raise CorruptChunk("layer window inconsistent with its kind")
            layers.append(LayerShape(kind, win or None, heads, kd, vd))
        lens, crcs = [], []
        for _ in range(nsec):
            ln, c = _SEC.unpack_from(mv, p)
            p += _SEC.size
            lens.append(ln)
            crcs.append(c)
        if p != end or len(digest) != DIGEST_SIZE:
            raise CorruptChunk("header length mismatch")
    except struct.error:
        raise CorruptChunk("truncated header") from None
    except UnicodeDecodeError:
        raise CorruptChunk("fingerprint is not ascii") from None
    h = ChunkHeader(
        version,
        fp,
        pid.hex() if any(pid) else "",
        level,
        digest,
        start,
        tokens,
        DTYPES[dcode],
        tuple(layers),
        sink,
        inline,
        tuple(lens),
        tuple(crcs),
        end + 4,
    )
    if h.num_values > MAX_VALUES:
        raise CorruptChunk("value count out of range")
    if h.payload_offset + sum(lens) != n:
        raise CorruptChunk(f"payload is {n - h.payload_offset} bytes, the header says {sum(lens)}")
    return h


def section_bytes(data: bytes | memoryview, h: ChunkHeader, i: int) -> memoryview:
    """Section ``i``, checksum verified."""
    o = h.section_offsets()[i]
    mv = memoryview(data)[o : o + h.section_lengths[i]]
    if zlib.crc32(mv) != h.section_crcs[i]:
        raise CorruptChunk(f"section {i} checksum mismatch")
    return mv


class Reader:
    """Bounds-checked little-endian reads from a buffer (a chunk's section, a baseline's chunk).

    Every read checks the bytes are there first, so a hostile length gives
    CorruptChunk, never an out-of-bounds read or an allocation."""

    def __init__(self, mv: memoryview, what: str):
        self.mv, self.p, self.what = mv, 0, what

    def take(self, n: int) -> memoryview:
        if n < 0 or self.p + n > len(self.mv):
            raise CorruptChunk(
                f"{self.what}: truncated (need {n} bytes at offset {self.p}, have {len(self.mv) - self.p})"
            )
        b = self.mv[self.p : self.p + n]
        self.p += n
        return b

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def unpack(self, fmt: str) -> tuple:
        """``struct.unpack`` of little-endian ``fmt``."""
        fmt = "<" + fmt
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def array(self, dtype, count: int) -> np.ndarray:
        """``count`` items of ``dtype`` (a read-only view of the buffer)."""
        dt = np.dtype(dtype)
        return np.frombuffer(self.take(dt.itemsize * count), dtype=dt, count=count)

    @property
    def left(self) -> int:
        """Bytes not read yet."""
        return len(self.mv) - self.p

    def rest(self) -> memoryview:
        return self.take(len(self.mv) - self.p)

    def done(self) -> None:
        """CorruptChunk unless every byte was read."""
        if self.p != len(self.mv):
            raise CorruptChunk(f"{self.what}: {len(self.mv) - self.p} trailing bytes")
