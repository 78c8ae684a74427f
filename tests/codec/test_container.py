"""The chunk container: the documented layout byte for byte, and every check of its parser at its bounds."""

from __future__ import annotations

import dataclasses
import re
import struct
import zlib

import numpy as np
import pytest
import torch

from cachegen.codec import container as C
from cachegen.codec.container import ChunkHeader, LayerShape, Reader, key_digest, pack_header, parse_header
from cachegen.errors import CorruptChunk, FormatVersionError, KeyMismatch
from cachegen.kv import LayerKind

PID = "00112233445566778899aabbccddeeff"
SECS = (b"abc", b"", b"hello", b"zz")
TWO = (LayerShape(LayerKind.FULL, None, 2, 8, 4), LayerShape(LayerKind.SLIDING, 64, 1, 16, 16))


def header(secs=SECS, **changes) -> ChunkHeader:
    h = ChunkHeader(
        C.FORMAT_VERSION,
        "fp-x",
        PID,
        3,
        key_digest("k"),
        100,
        10,
        torch.float16,
        TWO,
        2,
        False,
        tuple(len(s) for s in secs),
        tuple(zlib.crc32(s) for s in secs),
        0,
    )
    return dataclasses.replace(h, **changes)


def chunk(secs=SECS, **changes) -> bytes:
    """A chunk of ``secs`` whose header has ``changes`` (its sections' lengths and CRCs follow ``secs``)."""
    return pack_header(header(secs, **changes)) + b"".join(secs)


def zero_sections(layers: int, inline: bool = False) -> tuple[bytes, ...]:
    return (b"",) * (2 * layers + inline)


def with_body(data: bytes, edit) -> bytes:
    """``data`` with its header body edited by ``edit(bytearray)`` (length and checksum fixed up)."""
    (hlen,) = struct.unpack_from("<H", data, 6)
    body = bytearray(data[8 : 8 + hlen])
    edit(body)
    pre = data[:4] + struct.pack("<HH", C.FORMAT_VERSION, len(body))
    return pre + bytes(body) + struct.pack("<I", zlib.crc32(pre + bytes(body))) + data[8 + hlen + 4 :]


def exactly(message: str) -> str:
    """A ``match=`` for exactly this CorruptChunk message (after the error's own prefix)."""
    return ": " + re.escape(message) + "$"


def refused(data: bytes, message: str) -> None:
    with pytest.raises(CorruptChunk, match=exactly(message)):
        parse_header(data)


def test_layout_is_the_documented_one():
    fp = b"fp-x"
    body = struct.pack("<BBBB", 3, 1, 0, len(fp)) + fp + bytes.fromhex(PID) + key_digest("k")
    body += struct.pack("<QIHHH", 100, 10, 2, 2, 4)
    body += struct.pack("<BIHHH", 0, 0, 2, 8, 4) + struct.pack("<BIHHH", 1, 64, 1, 16, 16)
    body += b"".join(struct.pack("<QI", len(s), zlib.crc32(s)) for s in SECS)
    pre = b"CGKC" + struct.pack("<HH", 4, len(body))
    assert chunk() == pre + body + struct.pack("<I", zlib.crc32(pre + body)) + b"".join(SECS)


def test_key_digest_is_stable_and_binds_the_key():
    # golden: chunks written by earlier releases must keep matching their keys
    assert key_digest("k").hex() == "655707c9e0aabce6317e8f60e7f463d7"
    assert (
        key_digest(None).hex() == key_digest("").hex() == "6e9019d1d9466507d0d12b4c836ec125"
        and len(key_digest("x" * 1000)) == C.DIGEST_SIZE
    )
    assert len({key_digest(k) for k in ("", "k", "K", "k ", "0" * 64)}) == 5
    h = parse_header(chunk())
    C.check_key(h, "k")
    C.check_key(h, None)  # no key given: nothing to check
    for other in ("", "K", "kk"):
        with pytest.raises(
            KeyMismatch, match=exactly("chunk was written for another key (a foreign or swapped chunk)")
        ):
            C.check_key(h, other)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("inline", [False, True])
def test_parse_gives_back_every_field(dtype, inline):
    secs = SECS + ((b"prof",) if inline else ())
    data = chunk(secs, dtype=dtype, inline_profile=inline, profile_id="" if inline else PID)
    h = parse_header(data)
    assert h == header(
        secs,
        dtype=dtype,
        inline_profile=inline,
        profile_id="" if inline else PID,
        payload_offset=len(data) - sum(map(len, secs)),
    )
    assert data[10] == (1 if inline else 0)  # the flags byte
    assert data[9] == {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}[dtype]
    assert h.num_values == 10 * (2 * (8 + 4) + 1 * (16 + 16))
    offs = h.section_offsets()
    assert offs[0] == h.payload_offset and [data[o : o + len(s)] for o, s in zip(offs, secs)] == list(secs)
    assert [bytes(C.section_bytes(data, h, i)) for i in range(len(secs))] == list(secs)


def test_section_offsets_are_computed_once_per_header():
    h = header(payload_offset=7)
    first = h.section_offsets()
    assert first == (7, 10, 10, 15)  # 7, then + len(b"abc"), + len(b""), + len(b"hello")
    assert h.section_offsets() is first  # the same tuple: not computed again
    assert h == header(payload_offset=7)  # the kept offsets are no field: equality is unchanged
    other = header(payload_offset=0)
    assert other.section_offsets() == (0, 3, 3, 8) and other.section_offsets() is other.section_offsets()


def test_section_checksums_are_checked_one_by_one():
    data = bytearray(chunk())
    h = parse_header(bytes(data))
    data[h.section_offsets()[2] + 1] ^= 4  # "hello" -> "hallo"
    for i in (0, 1, 3):
        assert bytes(C.section_bytes(bytes(data), h, i)) == SECS[i]
    with pytest.raises(CorruptChunk, match=exactly("section 2 checksum mismatch")):
        C.section_bytes(bytes(data), h, 2)


def test_pack_refuses_what_it_cannot_write():
    assert parse_header(chunk(model_fingerprint="f" * 255)).model_fingerprint == "f" * 255
    with pytest.raises(ValueError, match=r"^fingerprint longer than 255 bytes$"):
        pack_header(header(model_fingerprint="f" * 256))
    for bad in (b"", bytes(15), bytes(17)):
        with pytest.raises(ValueError, match=r"^bad key digest$"):
            pack_header(header(key_digest=bad))
    assert parse_header(chunk(profile_id="")).profile_id == ""


def test_prefix_magic_version_and_checksum():
    data = chunk()
    for n in range(8):
        refused(data[:n], "shorter than a chunk header")
    refused(b"CGKD" + data[4:], "bad magic: not a cachegen chunk")
    for v in (C.FORMAT_VERSION - 1, C.FORMAT_VERSION + 1, 0):
        with pytest.raises(FormatVersionError, match=f"version {v}"):
            parse_header(data[:4] + struct.pack("<H", v) + data[6:])
    end = 8 + struct.unpack_from("<H", data, 6)[0]
    for cut in (8, end, end + 3):
        refused(data[:cut], "truncated header")
    for pos in (8, 9, end - 1, end, end + 3):
        b = bytearray(data)
        b[pos] ^= 0x10
        refused(bytes(b), "header checksum mismatch")


def test_payload_must_be_exactly_the_sections():
    data = chunk()
    assert parse_header(data).payload_offset == len(data) - 10
    refused(data + b"\0", "payload is 11 bytes, the header says 10")
    refused(data[:-1], "payload is 9 bytes, the header says 10")


def test_fixed_fields_at_their_bounds():
    def setter(offset: int, value: int):
        return lambda body: body.__setitem__(offset, value)

    data = chunk()
    for code in (3, 255):
        refused(with_body(data, setter(1, code)), f"unknown dtype code {code}")
    for flags in (2, 3, 128):
        refused(with_body(data, setter(2, flags)), "unknown flags")
    refused(with_body(data, setter(4, 0x80)), "fingerprint is not ascii")
    # a body too short for its fixed fields (checksum valid): the reads run past the buffer
    short = b"CGKC" + struct.pack("<HH", C.FORMAT_VERSION, 4) + bytes(4)
    refused(short + struct.pack("<I", zlib.crc32(short)), "truncated header")
    refused(with_body(data, lambda b: b.extend(b"\0")), "header length mismatch")
    refused(with_body(data, lambda b: b.__delitem__(slice(-1, None))), "header length mismatch")


def test_counts_and_positions_at_their_bounds():
    one = (LayerShape(LayerKind.FULL, None, 1, 1, 1),)
    ok = lambda **kw: parse_header(chunk(zero_sections(len(kw.get("layers", one))), **{"layers": one, **kw}))
    bad = lambda match, **kw: refused(chunk(zero_sections(len(kw.get("layers", one))), **{"layers": one, **kw}), match)

    assert ok(layers=one * C.MAX_LAYERS).layers == one * C.MAX_LAYERS
    for n in (0, C.MAX_LAYERS + 1):
        bad("layer or token count out of range", layers=one * n)
    assert ok(num_tokens=C.MAX_TOKENS, start=0).num_tokens == C.MAX_TOKENS
    bad("layer or token count out of range", num_tokens=C.MAX_TOKENS + 1, start=0)
    assert ok(num_tokens=10, sink_tokens=10).sink_tokens == 10
    bad("layer or token count out of range", num_tokens=10, sink_tokens=11)
    assert ok(start=C.MAX_POSITION - 10).start == C.MAX_POSITION - 10
    for start in (C.MAX_POSITION - 9, C.MAX_POSITION, (1 << 64) - 1):
        bad(f"positions out of range (start {start})", start=start)
    refused(
        chunk(zero_sections(1, inline=True), layers=one), "section count does not match layer count"
    )  # one too many, no inline flag
    refused(
        chunk(zero_sections(1), layers=one, inline_profile=True, profile_id=""),
        "section count does not match layer count",
    )


def test_layer_shapes_at_their_bounds():
    def parse(shape: LayerShape, tokens: int = 2):
        return parse_header(chunk(zero_sections(1), layers=(shape,), num_tokens=tokens, sink_tokens=0))

    full = LayerShape(LayerKind.FULL, None, 1, 1, 1)
    for s in (
        dataclasses.replace(full, heads=C.MAX_HEADS),
        dataclasses.replace(full, k_dim=C.MAX_DIM),
        dataclasses.replace(full, v_dim=C.MAX_DIM),
        LayerShape(LayerKind.SLIDING, 1, 1, 1, 1),
        LayerShape(LayerKind.SLIDING, C.MAX_POSITION, 1, 1, 1),
    ):
        assert parse(s).layers == (s,)
    for s in (
        dataclasses.replace(full, heads=0),
        dataclasses.replace(full, heads=C.MAX_HEADS + 1),
        dataclasses.replace(full, k_dim=0),
        dataclasses.replace(full, k_dim=C.MAX_DIM + 1),
        dataclasses.replace(full, v_dim=0),
        dataclasses.replace(full, v_dim=C.MAX_DIM + 1),
    ):
        with pytest.raises(CorruptChunk, match=exactly("layer shape out of range")):
            parse(s)
    for s in (
        LayerShape(LayerKind.FULL, 5, 1, 1, 1),
        LayerShape(LayerKind.SLIDING, None, 1, 1, 1),
        LayerShape(LayerKind.SLIDING, C.MAX_POSITION + 1, 1, 1, 1),
    ):
        with pytest.raises(CorruptChunk, match=exactly("layer window inconsistent with its kind")):
            parse(s)
    data = chunk(zero_sections(1), layers=(full,), num_tokens=2, sink_tokens=0)
    kind_at = 4 + 4 + 16 + C.DIGEST_SIZE + 18  # fixed fields, "fp-x", profile id, digest, positions
    assert data[8 + kind_at] == 0
    refused(with_body(data, lambda b: b.__setitem__(kind_at, 2)), "layer shape out of range")
    # the value count: exactly MAX_VALUES passes, one more layer's worth does not
    big = LayerShape(LayerKind.FULL, None, 128, 2, 2)
    assert parse(big, C.MAX_TOKENS).num_values == C.MAX_VALUES
    with pytest.raises(CorruptChunk, match=exactly("value count out of range")):
        parse(dataclasses.replace(big, v_dim=3), C.MAX_TOKENS)


def test_reader_reads_exactly_what_is_there():
    raw = struct.pack("<I", 7) + b"ab" + struct.pack("<Hh", 513, -2) + np.array([1.5, -2.0], "<f4").tobytes() + b"xyz"
    r = Reader(memoryview(raw), "sec 3")
    assert r.u32() == 7 and bytes(r.take(2)) == b"ab" and r.p == 6
    assert r.unpack("Hh") == (513, -2)
    with pytest.raises(CorruptChunk, match=r": sec 3: truncated \(need 12 bytes at offset 10, have 11\)$"):
        r.take(12)
    with pytest.raises(CorruptChunk, match="truncated"):
        r.take(-1)
    assert r.p == 10  # a refused read consumes nothing
    a = r.array("<f4", 2)
    assert a.tolist() == [1.5, -2.0] and not a.flags.writeable
    with pytest.raises(CorruptChunk, match=r": sec 3: 3 trailing bytes$"):
        r.done()
    assert bytes(r.rest()) == b"xyz" and bytes(r.take(0)) == b""
    r.done()
    with pytest.raises(CorruptChunk, match="truncated"):
        r.u32()
    assert Reader(memoryview(b"\xff\xff\xff\xff"), "u").u32() == 0xFFFFFFFF  # unsigned
