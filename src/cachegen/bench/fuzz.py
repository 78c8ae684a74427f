"""Structured fuzzing of the chunk decoder: ``python -m cachegen.bench.fuzz --cases N``.

Why structured: random bytes stop at the checksums, so they only ever test the
first check. Here every case takes a real chunk (lossless, lossy with a
profile and token importance, lossy with inline tables), changes one field the
parsers read (a header field, a table entry, a stream length, an escape, a
payload word, the inline profile's bytes), then recomputes the section and
header checksums so the parsers behind them are reached. Every outcome must be
:class:`~cachegen.errors.CorruptChunk` or a decode with finite values and the
shape the header and the profile promise; anything else (another exception, a
non-finite value, a wrong shape) is a failure. The process limits its own
address space (``RLIMIT_AS``), so a decoder that allocated what a chunk claims
would fail with MemoryError, which counts as a failure too.

``make fuzz`` runs 1,000,000 cases; ``tests/codec/test_fuzz.py`` runs 20,000 in CI.
Prints one line per outcome with its count (``--json``: the counts as JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import resource
import struct
import sys
import time
import zlib
from collections import Counter
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch

from cachegen.codec import LOSSLESS, Codec, calibrate
from cachegen.codec.container import ChunkHeader, key_digest, pack_header, parse_header
from cachegen.errors import CorruptChunk
from cachegen.kv import KVCache, KVLayer, LayerKind

log = logging.getLogger(__name__)

KEY = "ab" * 16  # the chunk key every corpus chunk is written for
MAX_TOKENS = 256


def _kv(seed: int, tokens: int, start: int = 0, dtype: torch.dtype = torch.float32, layers: int = 2) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(layers):
        k = torch.randn(2, tokens, 16, generator=g) * (1 + i) + 0.5
        v = torch.randn(2, tokens, 8, generator=g) * 0.3
        kind = LayerKind.SLIDING if i % 2 else LayerKind.FULL
        out.append(KVLayer(k.to(dtype), v.to(dtype), kind, 16 if i % 2 else None))
    return KVCache(out, start=start)


def planted_sensitivity(kv: KVCache) -> np.ndarray:
    """Per-token sensitivities (layers, 2, heads, tokens) that follow each token's first key
    channel: a token-importance predictor can learn them, so chunks carry a spread of multipliers
    (the fuzzer's profile, and the codec tests')."""
    out = []
    for layer in kv.layers:
        z = layer.k[..., 0].double().numpy()
        z = (z - z.mean()) / z.std()
        out.append(np.stack([np.exp(2.0 * z), np.exp(-1.5 * z)]))
    return np.stack(out)


@dataclasses.dataclass
class Corpus:
    """Real chunks and the codecs that read them."""

    profile_codec: Codec
    inline_codec: Codec
    chunks: list[tuple[str, bytes, Codec]]


def build_corpus() -> Corpus:
    """Chunks of every kind the format has: lossless (fp32, fp16, bf16), lossy levels with a token-importance
    profile (with and without sink tokens), lossy with inline tables."""
    imp = _kv(300, 400)
    prof = calibrate([_kv(100 + i, 96) for i in range(2)], "fuzz", importance_data=[(imp, planted_sensitivity(imp))])
    pc = Codec(prof, threads=1, max_tokens=MAX_TOKENS)
    ic = Codec(None, "fuzz", threads=1, max_tokens=MAX_TOKENS)
    chunks: list[tuple[str, bytes, Codec]] = [  # small chunks: a case costs a few ms even on a busy machine
        ("lossless-float16", pc.encode(_kv(1, 24, 8, torch.float16), LOSSLESS, key=KEY), pc),
        ("lossless-float32-noprofile", ic.encode(_kv(1, 16, 8, layers=1), LOSSLESS, key=KEY), ic),
        ("lossless-bfloat16-noprofile", ic.encode(_kv(1, 16, 8, torch.bfloat16, layers=1), LOSSLESS, key=KEY), ic),
        ("inline-L3", ic.encode(_kv(4, 24, 2, layers=1), 3, key=KEY), ic),
    ]
    for lv in (1, 4, 7):
        chunks.append((f"lossy-L{lv}-sink", pc.encode(_kv(2, 40, 0), lv, key=KEY), pc))
        chunks.append((f"lossy-L{lv}", pc.encode(_kv(3, 32, 300, torch.float16), lv, key=KEY), pc))
    return Corpus(pc, ic, chunks)


# -- mutations -------------------------------------------------------------------------


def _repack(h: ChunkHeader, sections: list[bytes]) -> bytes:
    """A chunk from a (possibly edited) header and sections, every checksum recomputed."""
    h = dataclasses.replace(
        h, section_lengths=tuple(len(s) for s in sections), section_crcs=tuple(zlib.crc32(s) for s in sections)
    )
    return pack_header(h) + b"".join(sections)


def _sections(data: bytes, h: ChunkHeader) -> list[bytes]:
    return [data[o : o + n] for o, n in zip(h.section_offsets(), h.section_lengths)]


_BIG = (
    0,
    1,
    2,
    3,
    255,
    256,
    4095,
    4096,
    65535,
    65536,
    1 << 22,
    (1 << 24) - 1,
    1 << 24,
    (1 << 31) - 1,
    1 << 31,
    (1 << 32) - 1,
)
_BIG64 = (*_BIG, (1 << 63) - 1, 1 << 63, (1 << 64) - 1)


def _value(rng: np.random.Generator, bits: int) -> int:
    pool = _BIG64 if bits == 64 else _BIG
    v = (
        int(rng.choice([p for p in pool if p < 1 << bits]))
        if rng.random() < 0.7
        else int(rng.integers(0, 1 << min(bits, 62)))
    )
    return v


def _mutate_header(rng: np.random.Generator, h: ChunkHeader, secs: list[bytes]) -> bytes:
    field = rng.integers(0, 12)
    if field == 0:
        h = dataclasses.replace(h, level=int(rng.integers(0, 256)))
    elif field == 1:
        h = dataclasses.replace(
            h, start=_value(rng, 64) if rng.random() < 0.5 else h.start + int(rng.integers(-8, 8)) % (1 << 64)
        )
    elif field == 2:
        h = dataclasses.replace(
            h, num_tokens=_value(rng, 32) if rng.random() < 0.5 else max(0, h.num_tokens + int(rng.integers(-3, 4)))
        )
    elif field == 3:
        h = dataclasses.replace(h, sink_tokens=int(rng.integers(0, 10)) if rng.random() < 0.7 else _value(rng, 16))
    elif field == 4:
        dt = (torch.float32, torch.float16, torch.bfloat16)
        h = dataclasses.replace(h, dtype=dt[int(rng.integers(0, 3))])
    elif field == 5:
        h = dataclasses.replace(h, inline_profile=not h.inline_profile)
    elif field == 6:
        pid = rng.bytes(16).hex() if rng.random() < 0.5 else ""
        h = dataclasses.replace(h, profile_id=pid)
    elif field == 7:
        h = dataclasses.replace(h, key_digest=key_digest("other") if rng.random() < 0.5 else rng.bytes(16))
    elif field == 8:
        h = dataclasses.replace(h, model_fingerprint=["", "fuzz", "other", "x" * 200][int(rng.integers(0, 4))])
    elif field in (9, 10):  # one layer's shape
        li = int(rng.integers(0, len(h.layers)))
        lay = h.layers[li]
        attr = ["heads", "k_dim", "v_dim", "window"][int(rng.integers(0, 4))]
        if attr == "window":
            new = dataclasses.replace(lay, kind=LayerKind.SLIDING, window=max(1, _value(rng, 32)))
        else:
            new = dataclasses.replace(
                lay,
                **cast(
                    "dict[str, Any]",
                    {
                        attr: max(
                            1,
                            min(
                                65535,
                                getattr(lay, attr) + int(rng.integers(-2, 3))
                                if rng.random() < 0.6
                                else _value(rng, 16),
                            ),
                        )
                    },
                ),
            )
        h = dataclasses.replace(h, layers=(*h.layers[:li], new, *h.layers[li + 1 :]))
    else:  # layers added or dropped, sections with them
        if rng.random() < 0.5 and len(h.layers) > 1:
            h = dataclasses.replace(h, layers=h.layers[:-1])
            secs = secs[:-2]
        else:
            h = dataclasses.replace(h, layers=h.layers + h.layers[-1:])
            secs = secs + secs[-2:]
    try:
        return _repack(h, secs)
    except (struct.error, ValueError):  # a value the header cannot hold: a garbled header instead
        return b"CGKC" + rng.bytes(int(rng.integers(0, 64)))


def _put(b: bytearray, off: int, fmt: str, v: int) -> None:
    if 0 <= off <= len(b) - struct.calcsize(fmt):
        struct.pack_into(fmt, b, off, v % (1 << (8 * struct.calcsize(fmt))))


def _mutate_lossless(rng: np.random.Generator, sec: bytes, c: int) -> bytes:
    """Edit one field of a lossless section: element size, a plane's table, word count, a stream length, a word."""
    b = bytearray(sec)
    planes, p = [], 1
    while p + 516 <= len(b):
        nw = struct.unpack_from("<I", b, p + 512)[0]
        planes.append((p, nw))
        p += 512 + 4 + 4 * c + 2 * nw
    what = int(rng.integers(0, 7))
    if what == 0 or not planes:
        b[0] = int(rng.integers(0, 9))
        return bytes(b)
    p0, nw = planes[int(rng.integers(0, len(planes)))]
    if what == 1:  # a table that gives one symbol probability 1 (the bomb's table) or another skew
        f = np.zeros(256, dtype="<u2")
        f[int(rng.integers(0, 256))] = 4096 if rng.random() < 0.5 else int(rng.integers(3700, 4096))
        if f.sum() < 4096:
            f[int(rng.integers(0, 256))] += 4096 - int(f.sum())
        b[p0 : p0 + 512] = f.tobytes()
    elif what == 2:  # one table entry
        _put(b, p0 + 2 * int(rng.integers(0, 256)), "<H", _value(rng, 16))
    elif what == 3:
        _put(b, p0 + 512, "<I", _value(rng, 32))
    elif what == 4:  # a stream length
        _put(
            b,
            p0 + 516 + 4 * int(rng.integers(0, c)),
            "<I",
            _value(rng, 32) if rng.random() < 0.5 else int(rng.integers(0, 40)),
        )
    elif what == 5 and nw:  # a word
        _put(b, p0 + 516 + 4 * c + 2 * int(rng.integers(0, nw)), "<H", int(rng.integers(0, 65536)))
    else:  # words moved between streams: lengths still add up
        i, j = (p0 + 516 + 4 * int(k) for k in rng.integers(0, c, 2))
        if i != j:
            a, d = struct.unpack_from("<I", b, i)[0], int(rng.integers(1, 4))
            _put(b, i, "<I", a - d)
            _put(b, j, "<I", struct.unpack_from("<I", b, j)[0] + d)
    return bytes(b)


def _mutate_lossy(rng: np.random.Generator, sec: bytes, has_u: bool) -> bytes:
    """Edit one field of a lossy section: sink size or bytes (NaN/Inf), escape count or values, multiplier stream, words."""
    b = bytearray(sec)
    if len(b) < 8:
        return bytes(rng.bytes(int(rng.integers(0, 16))))
    ns = struct.unpack_from("<I", b, 0)[0]
    pe = 4 + ns
    ne = struct.unpack_from("<I", b, pe)[0] if pe + 4 <= len(b) else 0
    pu = pe + 4 + 4 * ne
    what = int(rng.integers(0, 8))
    if what == 0:
        _put(b, 0, "<I", _value(rng, 32) if rng.random() < 0.5 else ns + int(rng.integers(-2, 3)))
    elif what == 1 and ns >= 4:  # a sink value: NaN or Inf patterns (fp32 / 16-bit)
        o = 4 + 2 * int(rng.integers(0, ns // 2 - 1))
        pat = [b"\x00\x7c", b"\x00\xfc", b"\x01\x7e", b"\x80\x7f", b"\xc0\x7f"][int(rng.integers(0, 5))]
        b[o : o + 2] = pat
    elif what == 2:
        _put(b, pe, "<I", _value(rng, 32) if rng.random() < 0.5 else ne + int(rng.integers(-2, 3)))
    elif what == 3 and ne:  # an escape value, up to +-2^31
        _put(
            b,
            pe + 4 + 4 * int(rng.integers(0, ne)),
            "<I",
            int(rng.choice([2**31 - 1, -(2**31), 2**20, -(2**20), 0, 65504])),
        )
    elif what == 4 and has_u:
        _put(
            b,
            pu,
            "<I",
            _value(rng, 32) if rng.random() < 0.5 else struct.unpack_from("<I", b, pu)[0] + int(rng.integers(-2, 3)),
        )
    elif what == 5 and has_u and pu + 8 <= len(b):
        o = pu + 4 + 2 * int(rng.integers(0, max(1, (struct.unpack_from("<I", b, pu)[0]))))
        _put(b, o, "<H", int(rng.integers(0, 65536)))
    elif what == 6:  # a word of the main stream
        o = len(b) - 2 * int(rng.integers(1, max(2, (len(b) - pu) // 2)))
        _put(b, o, "<H", int(rng.integers(0, 65536)))
    else:  # truncated or extended
        if rng.random() < 0.5:
            del b[len(b) - int(rng.integers(1, min(8, len(b)) + 1)) :]
        else:
            b += rng.bytes(int(rng.integers(1, 8)))
    return bytes(b)


def _mutate_inline(rng: np.random.Generator, sec: bytes) -> bytes:
    """Edit the inline profile: its JSON header (a number, a name) or an array byte."""
    b = bytearray(sec)
    if len(b) < 12:
        return bytes(b)
    jlen = struct.unpack_from("<I", b, 6)[0]
    if rng.random() < 0.5 and jlen:
        o = 10 + int(rng.integers(0, jlen))
        b[o] = int(rng.choice(list(b'0123456789-.e,:[]{}" ')))
    else:
        o = 10 + jlen + int(rng.integers(0, max(1, len(b) - 10 - jlen)))
        if o < len(b):
            b[o] = int(rng.integers(0, 256))
    return bytes(b)


def mutate(rng: np.random.Generator, data: bytes) -> bytes:
    """One structured mutation of a valid chunk ``data``, checksums recomputed."""
    h = parse_header(data)
    secs = _sections(data, h)
    if rng.random() < 0.3:
        return _mutate_header(rng, h, secs)
    first = 1 if h.inline_profile else 0
    i = int(rng.integers(0, len(secs)))
    if i < first:
        secs[i] = _mutate_inline(rng, secs[i])
    elif h.level == LOSSLESS:
        lay = h.layers[(i - first) // 2]
        secs[i] = _mutate_lossless(rng, secs[i], lay.heads * (lay.k_dim if (i - first) % 2 == 0 else lay.v_dim))
    else:
        secs[i] = _mutate_lossy(rng, secs[i], has_u=not h.inline_profile)
    return _repack(h, secs)


# -- running ---------------------------------------------------------------------------


def check_decode(codec: Codec, data: bytes) -> str:
    """The outcome of decoding ``data``: ``corrupt:<Class>``, ``ok``, or a failure (``FAIL:...``)."""
    try:
        kv = codec.decode(data, key=KEY)
    except CorruptChunk as e:
        return f"corrupt:{type(e).__name__}"
    except Exception as e:  # any other exception is what the fuzzer looks for
        return f"FAIL:{type(e).__name__}:{str(e)[:80]}"
    h = parse_header(data)
    if kv.num_tokens != h.num_tokens or kv.start != h.start or kv.num_tokens > codec.max_tokens:
        return "FAIL:shape:tokens"
    for layer, shape in zip(kv.layers, h.layers):
        want_k, want_v = (shape.heads, h.num_tokens, shape.k_dim), (shape.heads, h.num_tokens, shape.v_dim)
        if tuple(layer.k.shape) != want_k or tuple(layer.v.shape) != want_v or layer.k.dtype != h.dtype:
            return "FAIL:shape:layer"
        if not (bool(torch.isfinite(layer.k).all()) and bool(torch.isfinite(layer.v).all())):
            return "FAIL:nonfinite"
    prof = codec.profile
    if prof is not None and [tuple(d) for d in prof.layer_dims] != [(s.heads, s.k_dim, s.v_dim) for s in h.layers]:
        return "FAIL:shape:profile"
    return "ok"


def limit_memory(extra_mb: int) -> None:
    """Cap this process's address space at its current size plus ``extra_mb`` (RLIMIT_AS)."""
    with open("/proc/self/statm") as f:
        vm = int(f.read().split()[0]) * resource.getpagesize()
    soft = vm + extra_mb * (1 << 20)
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    resource.setrlimit(resource.RLIMIT_AS, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def run(
    cases: int,
    seed: int = 0,
    extra_mb: int | None = 512,
    progress: Callable[[int, Counter], None] | None = None,
    max_seconds: float | None = None,
) -> Counter:
    """Counts per outcome over ``cases`` mutations (the corpus round-robin), fewer if ``max_seconds`` runs out first."""
    torch.set_num_threads(1)  # tiny tensors: torch's thread pool only adds waits (50 ms per bmm on a busy machine)
    corpus = build_corpus()
    for name, data, codec in corpus.chunks:  # the corpus itself decodes cleanly
        if check_decode(codec, data) != "ok":
            raise AssertionError(f"corpus chunk {name} does not decode")
    if extra_mb is not None:
        limit_memory(extra_mb)
    rng = np.random.default_rng(seed)
    counts: Counter = Counter()
    n = len(corpus.chunks)
    stop = None if max_seconds is None else time.monotonic() + max_seconds
    for i in range(cases):
        if stop is not None and i % 256 == 0 and time.monotonic() > stop:
            log.warning("seed %d: time is up after %d of %d cases", seed, i, cases)
            break
        name, data, codec = corpus.chunks[i % n]
        counts[check_decode(codec, mutate(rng, data))] += 1
        if progress is not None and (i + 1) % 50_000 == 0:
            progress(i + 1, counts)
    return counts


def _worker(args: tuple[int, int, int | None, float | None]) -> Counter:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cases, seed, extra_mb, max_seconds = args
    return run(
        cases,
        seed,
        extra_mb,
        progress=lambda i, c: log.info(
            "seed %d: %d cases, %d failures", seed, i, sum(v for k, v in c.items() if k.startswith("FAIL"))
        ),
        max_seconds=max_seconds,
    )


def run_parallel(
    cases: int, seed: int = 0, extra_mb: int | None = 512, jobs: int = 1, max_seconds: float | None = None
) -> Counter:
    """:func:`run` split over ``jobs`` processes (seeds ``seed .. seed + jobs - 1``), counts summed."""
    if jobs <= 1:
        return _worker((cases, seed, extra_mb, max_seconds))
    import multiprocessing

    parts = [(cases // jobs + (1 if j < cases % jobs else 0), seed + j, extra_mb, max_seconds) for j in range(jobs)]
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        total: Counter = Counter()
        for c in pool.imap_unordered(_worker, parts):
            total.update(c)
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m cachegen.bench.fuzz", description="structured fuzzing of the chunk decoder"
    )
    ap.add_argument("--cases", type=int, default=1_000_000, help="number of mutated chunks to decode")
    ap.add_argument("--seed", type=int, default=0, help="seed of the mutations")
    ap.add_argument(
        "--memory-mb", type=int, default=512, help="address space allowed above the start-up size (RLIMIT_AS)"
    )
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (each with its own seed and memory limit)")
    ap.add_argument(
        "--max-seconds", type=float, default=None, help="stop each worker after this long (counts so far are printed)"
    )
    ap.add_argument("--json", action="store_true", help="print the counts as one JSON object")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    t = time.perf_counter()
    counts = run_parallel(a.cases, a.seed, a.memory_mb, a.jobs, a.max_seconds)
    fails = sum(v for k, v in counts.items() if k.startswith("FAIL"))
    done = sum(counts.values())
    if a.json:
        print(
            json.dumps(
                {
                    "cases": done,
                    "requested": a.cases,
                    "seed": a.seed,
                    "jobs": a.jobs,
                    "seconds": round(time.perf_counter() - t, 1),
                    "counts": dict(counts),
                }
            )
        )
    else:
        for k, v in sorted(counts.items(), key=lambda kv: -kv[1]):
            print(f"{v:9d}  {k}")
        print(f"{done} cases (of {a.cases}) in {time.perf_counter() - t:.0f} s, {fails} failures")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
