"""Helpers for the store's tests: a stand-in codec, and workers run as separate processes.

Test code, so it lives with the tests; worker processes run this file as a
script: ``python tests/store/store_helpers.py writer URL FIRST N SIZE``.
"""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

from cachegen.store.backend import ChunkWrite
from cachegen.store.context_store import ContextStore
from cachegen.store.keys import Namespace
from cachegen.store.url import open_backend

NS = Namespace("model-fp-test", 1, "0123abcd")
INGEST_TOKENS = list(range(1000, 1000 + 16 * 60 + 5))  # 60 full chunks of 16 and a partial one


class RawEncoder:
    """A small :class:`cachegen.codec.ChunkCodec` standing in for the real codec.

    Level 0 keeps K and V as float32, level 1 as float16, level 2 as int8 with
    one scale per tensor: deterministic (two writers produce identical
    payloads) and decodable. The chunk key's digest is in the header, so a
    chunk stored under another key fails to decode with ``KeyMismatch``.
    Counts encodes, so tests can check that stored levels are not encoded again."""

    levels = (0, 1, 2)
    _HEAD = struct.Struct("<4sIIIIIB8s")  # magic, start, tokens, layers, heads, dim, level, key digest
    _DTYPES = ("float32", "float16", "int8")

    def __init__(self):
        self.calls = 0

    @staticmethod
    def _digest(key: str | None) -> bytes:
        return hashlib.blake2b((key or "").encode(), digest_size=8).digest()

    def encode(self, kv, level: int, *, key: str | None = None) -> bytes:
        import torch

        self.calls += 1
        l0 = kv.layers[0]
        parts = [
            self._HEAD.pack(
                b"RAWE", kv.start, kv.num_tokens, kv.num_layers, l0.k.shape[0], l0.k.shape[2], level, self._digest(key)
            )
        ]
        for layer in kv.layers:
            for t in (layer.k, layer.v):
                t = t.detach().float().contiguous()
                if level == 0:
                    parts.append(t.numpy().tobytes())
                elif level == 1:
                    parts.append(t.half().numpy().tobytes())
                else:
                    scale = float(t.abs().max()) / 127 or 1.0
                    parts.append(struct.pack("<f", scale) + torch.round(t / scale).to(torch.int8).numpy().tobytes())
        return b"".join(parts)

    def decode(self, data: bytes, *, key: str | None = None):
        import numpy as np
        import torch

        from cachegen.errors import CorruptChunk, KeyMismatch
        from cachegen.kv import KVCache, KVLayer

        try:
            magic, start, n, layers, heads, dim, level, digest = self._HEAD.unpack_from(data)
        except struct.error:
            raise CorruptChunk("short RawEncoder header") from None
        if magic != b"RAWE" or level > 2:
            raise CorruptChunk("not a RawEncoder chunk")
        if key is not None and digest != self._digest(key):
            raise KeyMismatch("chunk stored under another key")
        pos, count, out = self._HEAD.size, heads * n * dim, []
        try:
            for _ in range(layers):
                kv = []
                for _ in range(2):
                    if level == 2:
                        (scale,) = struct.unpack_from("<f", data, pos)
                        a = np.frombuffer(data, np.int8, count, pos + 4).astype(np.float32) * scale
                        pos += 4 + count
                    else:
                        dt = np.dtype(self._DTYPES[level])
                        a = np.frombuffer(data, dt, count, pos).astype(np.float32)
                        pos += count * dt.itemsize
                    kv.append(torch.from_numpy(a.copy()).reshape(heads, n, dim))
                out.append(KVLayer(*kv))
        except (ValueError, struct.error):
            raise CorruptChunk("truncated RawEncoder chunk") from None
        if pos != len(data):
            raise CorruptChunk("trailing bytes after a RawEncoder chunk")
        return KVCache(out, start=start)


def make_kv(n_tokens: int, start: int = 0, seed: int = 0, layers: int = 2, heads: int = 2, dim: int = 8):
    import torch

    from cachegen.kv import KVCache, KVLayer

    g = torch.Generator().manual_seed(seed)
    return KVCache(
        [
            KVLayer(torch.randn(heads, n_tokens, dim, generator=g), torch.randn(heads, n_tokens, dim, generator=g))
            for _ in range(layers)
        ],
        start=start,
    )


def ingest_kv():
    return make_kv(len(INGEST_TOKENS), seed=42, layers=4, heads=4, dim=64)


def spawn(*args) -> subprocess.Popen:
    """Run a worker of this module in a new process (stdout: 'ready', then 'done')."""
    return subprocess.Popen(
        [sys.executable, __file__, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def ingest_twice(url: str, tmp_path: Path) -> None:
    go = tmp_path / "go"
    procs = [spawn("ingest", url, go) for _ in range(2)]
    try:
        for p in procs:
            line = p.stdout.readline().strip()
            if line != "ready":  # the worker ended (stdout closed): say how
                try:
                    rc = p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    rc = None
                raise AssertionError(
                    f"worker said {line!r}, exit {rc}; stderr: {p.stderr.read() if rc is not None else ''}"
                )
        go.touch()
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0 and "done" in out, err
    finally:
        for p in procs:  # never leave a worker waiting for ``go``
            if p.poll() is None:
                p.kill()
                p.wait()


def check_one_copy(url: str) -> None:
    cs = ContextStore(open_backend(url), NS, RawEncoder(), chunk_tokens=16)
    toks, kv = INGEST_TOKENS, ingest_kv()
    stats = cs.backend.stats()
    assert (stats.contexts, stats.chunks) == (1, 61)
    assert {l: s.chunks for l, s in stats.levels.items()} == {0: 61, 1: 61, 2: 61}
    plan = cs.plan(toks)
    for info in plan:
        got = cs.get_many([(info.ref, l) for l in (0, 1, 2)])
        want = [cs.encoder.encode(kv.slice(info.ref.start, info.ref.end), l, key=info.ref.key) for l in (0, 1, 2)]
        assert got == want and info.sizes == {l: len(w) for l, w in enumerate(want)}
    assert stats.bytes == sum(sum(i.sizes.values()) for i in plan)


# -- workers -------------------------------------------------------------------


def writer(url: str, first: str, n: str, size: str) -> None:
    """Write chunks ``first..first+n`` with three random payloads of ``size`` bytes each."""
    b = open_backend(url)
    print("ready", flush=True)
    for i in range(int(first), int(first) + int(n)):
        b.put_chunks([ChunkWrite(f"{i:064x}", b"", {l: os.urandom(int(size)) for l in range(3)}, start=i)])
    print("done", flush=True)


def ingest(url: str, go: str) -> None:
    """Ingest the test context once the file ``go`` exists (so two workers start together)."""
    cs = ContextStore(open_backend(url), NS, RawEncoder(), chunk_tokens=16)
    kv = ingest_kv()
    print("ready", flush=True)
    give_up = time.monotonic() + 300
    while not Path(go).exists():
        if time.monotonic() > give_up:
            raise SystemExit("no go signal in 300 s")
        time.sleep(0.001)
    cs.put_context(INGEST_TOKENS, kv)
    print("done", flush=True)


def kill_at(root: str, point: str) -> None:
    """Die by SIGKILL while staging a file (``staged``) or between rename and commit (``renamed``)."""
    import signal

    import cachegen.store.local as local

    def die(*a, **k):
        os.kill(os.getpid(), signal.SIGKILL)

    if point == "staged":
        os.fsync = die
    else:
        local._fsync_dir = die
    local.LocalBackend(root).put_chunk(f"{7:064x}", b"", {0: b"x" * 5000, 1: b"y" * 3000})


if __name__ == "__main__":
    {"writer": writer, "ingest": ingest, "kill_at": kill_at}[sys.argv[1]](*sys.argv[2:])
