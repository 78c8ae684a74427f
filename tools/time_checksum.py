"""What a store read of one chunk costs in checksums: the store's CRC-32 against the blake2b-128 it
used before, and a local store's whole ``get``.

    .venv/bin/python tools/time_checksum.py [--mb 3.0] [--repeats 50]

A random payload of ``--mb`` MB (3 MB is a 256-token chunk of SmolLM2 in 8-bit KV); best of
``--repeats``, milliseconds. The ``get`` row reads it back from a ``file://`` store in a temporary
directory (page-cached: the read, the index query and the checksum). Quoted in
``cachegen.store.backend.checksum`` and docs/store.md.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
from collections.abc import Callable

from cachegen.store.backend import ChunkWrite, checksum
from cachegen.store.local import LocalBackend
from cachegen.stream.costs import best_time


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    return best_time(fn, repeats) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=3.0)
    ap.add_argument("--repeats", type=int, default=50)
    a = ap.parse_args()
    data = os.urandom(int(a.mb * 1e6))
    rows = {
        "blake2b-128": best_ms(lambda: hashlib.blake2b(data, digest_size=16).digest(), a.repeats),
        "crc32 (checksum)": best_ms(lambda: checksum(data), a.repeats),
    }
    with tempfile.TemporaryDirectory() as tmp:
        b = LocalBackend(tmp)
        key = "ab" * 32
        b.put_chunks([ChunkWrite(key, b"\x01\x00\x00\x00", {0: data})])
        rows["local store get"] = best_ms(lambda: b.get(key, 0), a.repeats)
        b.close()
    for name, ms in rows.items():
        print(f"{name:18s} {ms:6.2f} ms  ({len(data) / 1e6 / ms:5.2f} GB/s)")


if __name__ == "__main__":
    main()
