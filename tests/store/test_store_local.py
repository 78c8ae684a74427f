"""The file:// store: persistence, checksums, the size cap, crashes and concurrent processes."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import sqlite3
import threading
import time
import zlib
from pathlib import Path

import pytest
from store_helpers import check_one_copy, ingest_twice, spawn

from cachegen.errors import ChunkNotFound, ConfigError, CorruptChunk, StoreError
from cachegen.store import ChunkWrite, ContextStore, open_backend
from cachegen.store.backend import checksum, verify
from cachegen.store.local import LocalBackend


def key(i: int) -> str:
    return f"{i:064x}"


def write(backend, i: int, sizes=(1000,), start: int = 0, ends: bool = False) -> dict[int, bytes]:
    payloads = {l: os.urandom(s) for l, s in enumerate(sizes)}
    backend.put_chunks([ChunkWrite(key(i), b"\x01\x00\x00\x00", payloads, start=start, ends_context=ends)])
    return payloads


def blob_files(root: Path) -> list[Path]:
    return [p for p in (root / "blobs").glob("*/*")]


def check_consistent(root: Path) -> int:
    """Every indexed payload reads back with a valid checksum; no file lacks a row after GC."""
    b = LocalBackend(root)
    keys = [k for (k,) in b._query("SELECT key FROM chunks")]
    n = 0
    for k, sizes in zip(keys, b.sizes_many(keys)):
        for level, size in sizes.items():
            assert len(b.get(k, level)) == size
            n += 1
    total = b._query("SELECT COALESCE(SUM(size), 0) FROM payloads")[0][0]
    assert b._query("SELECT value FROM settings WHERE name='bytes'")[0][0] == total
    b.evict()  # removes debris of killed writers
    assert len(blob_files(root)) == n
    assert list((root / "tmp").iterdir()) == []
    assert sum(p.stat().st_size for p in blob_files(root)) == total
    b.close()
    return n


def test_roundtrip_and_persistence(store_dir):
    b = open_backend(f"file://{store_dir}")
    p = write(b, 1, sizes=(10, 20), ends=True)
    b.close()
    b = open_backend(f"file://{store_dir}")  # a restart: the index is on disk
    assert b.sizes(key(1)) == {0: 10, 1: 20}
    assert b.get(key(1), 1) == p[1] and b.tokens(key(1)) == b"\x01\x00\x00\x00"
    assert b.has(key(1)) and not b.has(key(2))
    assert b.stats().contexts == 1
    write(b, 1, sizes=(99, 99, 30))  # existing levels are kept, the new one is added
    assert b.sizes(key(1)) == {0: 10, 1: 20, 2: 30}
    assert b.clear() == 1 and b.stats().chunks == 0 and blob_files(store_dir) == []
    with pytest.raises(ChunkNotFound):
        b.get(key(1), 0)


def test_checksum_verified_on_every_read(store_dir):
    b = LocalBackend(store_dir)
    write(b, 1, sizes=(100, 100))
    assert b.get(key(1), 0)
    (f,) = [p for p in blob_files(store_dir) if p.name.split(".")[1] == "0"]
    data = bytearray(f.read_bytes())
    data[50] ^= 1
    f.write_bytes(bytes(data))
    with pytest.raises(CorruptChunk):
        b.get(key(1), 0)
    # the damaged copy is dropped so that it is recomputed; the other level is untouched
    assert b.sizes(key(1)) == {1: 100}
    with pytest.raises(ChunkNotFound):
        b.get(key(1), 0)
    f2 = blob_files(store_dir)[0]
    f2.write_bytes(f2.read_bytes()[:-1])  # truncated
    with pytest.raises(CorruptChunk):
        b.get(key(1), 1)


def test_checksums_are_crc32_and_blake2b_digests_still_verify(store_dir):
    """New payloads carry their CRC-32; a store written before it holds 16-byte blake2b digests in
    its index, and they still verify (a digest of any other length never does)."""
    data = os.urandom(300)
    assert checksum(data) == zlib.crc32(data).to_bytes(4, "little")
    legacy = hashlib.blake2b(data, digest_size=16).digest()
    assert verify(checksum(data), data) and verify(legacy, data)
    assert not verify(checksum(data), data[:-1]) and not verify(legacy, data[:-1])
    assert not verify(legacy[:8], data) and not verify(b"", data)
    b = LocalBackend(store_dir)
    p = write(b, 1, sizes=(100, 100))
    db = sqlite3.connect(store_dir / "index.sqlite3")
    with db:
        assert [len(d) for (d,) in db.execute("SELECT checksum FROM payloads")] == [4, 4]
        db.execute("UPDATE payloads SET checksum=? WHERE level=0", (hashlib.blake2b(p[0], digest_size=16).digest(),))
        db.execute("UPDATE payloads SET checksum=? WHERE level=1", (hashlib.blake2b(p[0], digest_size=16).digest(),))
    db.close()
    b = LocalBackend(store_dir)
    assert b.get(key(1), 0) == p[0]
    with pytest.raises(CorruptChunk):  # level 1's digest is of other bytes
        b.get(key(1), 1)


def test_evicted_file_reads_as_not_found(store_dir):
    b = LocalBackend(store_dir)
    write(b, 1)
    for f in blob_files(store_dir):
        f.unlink()
    with pytest.raises(ChunkNotFound):
        b.get(key(1), 0)


class FakeClock:
    """Wall-clock seconds that move only when a test says so (the store's access times come from it)."""

    def __init__(self, t: float = 1_700_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def last_access(b: LocalBackend, i: int) -> int:
    return b._query("SELECT last_access FROM chunks WHERE key=?", (key(i),))[0][0]


def test_lru_eviction_under_the_cap(store_dir):
    clock = FakeClock()
    t0 = int(clock.t)
    b = LocalBackend(store_dir, max_bytes=5000, clock=clock)
    for i in range(4):  # written in one second
        write(b, i, start=0)
    clock.t += 50
    b.get(key(1), 0)
    clock.t += 40
    b.get(key(2), 0)
    assert [last_access(b, i) for i in range(4)] == [t0, t0 + 50, t0 + 90, t0]
    clock.t += 0.5  # the same second as chunk 2's read
    write(b, 4, sizes=(2500,), start=16)  # in the same second as chunk 2's read; needs 0 and 3 (the oldest) to go
    assert [b.has(key(i)) for i in range(5)] == [False, True, True, False, True]
    assert b.stats().bytes == 4500 and last_access(b, 4) == t0 + 90
    with pytest.raises(StoreError):
        write(b, 5, sizes=(6000,))
    # the cap belongs to the store: another process opening it without one keeps it
    assert LocalBackend(store_dir).max_bytes == 5000
    # 1 goes first (oldest); 2 and 4 tie on their second, and then the later chunk of a context goes first
    assert b.evict(max_bytes=1000) == 2 and b.stats().bytes == 1000
    assert [b.has(key(i)) for i in (1, 2, 4)] == [False, True, False]


def test_old_temporary_files_of_live_writers_are_collected(store_dir):
    """A writer's staging file is left alone while the writer lives, unless it is over an hour old."""
    clock = FakeClock()
    b = LocalBackend(store_dir, clock=clock)
    mine = store_dir / "tmp" / f"{os.getpid()}.{'ab' * 8}.tmp"  # this process is alive
    mine.write_bytes(b"staged")
    os.utime(mine, (clock.t, clock.t))
    clock.t += 3599
    b.evict()
    assert mine.exists()
    clock.t += 2
    b.evict()
    assert not mine.exists()


def test_eviction_drops_a_context_tail_first(store_dir, namespace, encoder, kv_factory):
    b = open_backend(f"file://{store_dir}?max_bytes=1M")
    cs = ContextStore(b, namespace, encoder, chunk_tokens=16)
    toks = list(range(64))
    cs.put_context(toks, kv_factory(64), levels=[0])
    b.evict(max_bytes=b.stats().bytes - 1)
    assert cs.lookup(toks) == 48  # the last chunk went, the prefix still loads


def test_sigkill_during_writes_leaves_no_torn_entry(store_dir):
    LocalBackend(store_dir)
    rng = random.Random(0)
    for rnd in range(6):
        p = spawn("writer", f"file://{store_dir}", rnd * 1000, 10_000, 200_000)
        assert p.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.05, 0.4))
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert check_consistent(store_dir) > 0


@pytest.mark.parametrize("point", ["staged", "renamed"])
def test_sigkill_at_the_worst_moment(store_dir, point):
    b = LocalBackend(store_dir)
    write(b, 1)
    p = spawn("kill_at", store_dir, point)
    assert p.wait() == -signal.SIGKILL
    # nothing of chunk 7 is visible, and the store still takes writes (the lock died with the writer)
    assert b.sizes(key(7)) == {}
    debris = list((store_dir / "tmp").iterdir()) + blob_files(store_dir)
    assert len(debris) >= 2
    write(b, 8)
    assert check_consistent(store_dir) == 2


def test_two_processes_ingesting_the_same_context(store_dir, tmp_path):
    url = f"file://{store_dir}"
    ingest_twice(url, tmp_path)
    check_one_copy(url)
    assert check_consistent(store_dir) == 61 * 3


def test_size_cap_holds_under_concurrent_writes(store_dir):
    cap = 1_500_000
    LocalBackend(store_dir, max_bytes=cap)
    procs = [spawn("writer", f"file://{store_dir}", w * 1000, 60, 20_000 + 7_000 * w) for w in range(3)]
    violations, samples = [], 0
    watcher = sqlite3.connect(store_dir / "index.sqlite3", isolation_level=None, timeout=30)
    while any(p.poll() is None for p in procs):
        # under the store's write lock nobody renames or unlinks: the files on disk are exact
        watcher.execute("BEGIN IMMEDIATE")
        indexed = watcher.execute("SELECT COALESCE(SUM(size), 0) FROM payloads").fetchone()[0]
        on_disk = sum(p.stat().st_size for p in blob_files(store_dir))
        watcher.execute("COMMIT")
        samples += 1
        if indexed > cap or on_disk > cap:
            violations.append((indexed, on_disk))
        time.sleep(0.005)
    for p in procs:
        assert p.wait() == 0, p.stderr.read()
    assert samples > 5 and violations == []
    assert LocalBackend(store_dir).stats().bytes <= cap
    check_consistent(store_dir)


def test_threads_share_a_backend(store_dir):
    b = LocalBackend(store_dir)
    errors = []

    def run(t):
        try:
            for i in range(20):
                p = write(b, t * 100 + i)
                assert b.get(key(t * 100 + i), 0) == p[0]
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and b.stats().chunks == 80


def test_lowering_the_cap_applies_at_once(store_dir):
    b = LocalBackend(store_dir)
    for i in range(5):
        write(b, i)
    assert LocalBackend(store_dir, max_bytes=2500).stats().bytes <= 2500
    assert b.stats().chunks == 2


# -- the rest of the backend's interface, value by value ------------------------------------------


def test_sizes_tokens_stats_and_end_marks(store_dir):
    b = LocalBackend(store_dir)
    write(b, 0, sizes=(10, 20), start=0)
    write(b, 1, sizes=(30,), start=16, ends=True)
    keys = [key(i) for i in range(501)]  # over one query's 500 keys: the last one is in a second batch
    write(b, 500, sizes=(7,), start=32)
    sizes = b.sizes_many(keys)
    assert sizes[0] == {0: 10, 1: 20} and sizes[1] == {0: 30} and sizes[500] == {0: 7}
    assert all(s == {} for s in sizes[2:500])
    assert b.tokens(key(0)) == b"\x01\x00\x00\x00"
    with pytest.raises(ChunkNotFound):
        b.tokens(key(2))
    s = b.stats()
    assert (s.chunks, s.contexts, s.bytes) == (3, 1, 67)
    assert {lv: (x.chunks, x.bytes) for lv, x in s.levels.items()} == {0: (3, 47), 1: (1, 20)}
    b.unmark_end(key(1))
    assert b.stats().contexts == 0
    rows = {r.key: r for r in b.chunk_rows()}
    assert rows[key(1)].start == 16 and rows[key(1)].num_tokens == 1 and rows[key(1)].sizes == {0: 30}
    assert not rows[key(1)].ends_context


def test_settings_first_claim_wins_and_clear_forgets_chunk_sizes(store_dir):
    b = LocalBackend(store_dir)
    assert b.get_setting("chunk_tokens:ab") is None
    assert b.claim_setting("chunk_tokens:ab", "16") == "16"
    assert b.claim_setting("chunk_tokens:ab", "32") == "16"  # another process's claim came first
    assert b.claim_setting("other", "x") == "x"
    write(b, 0)
    assert b.clear() == 1
    assert b.get_setting("chunk_tokens:ab") is None and b.get_setting("other") == "x"


def test_a_chunk_that_cannot_fit_beside_itself_is_refused(store_dir):
    b = LocalBackend(store_dir, max_bytes=1000)
    write(b, 0, sizes=(800,))
    with pytest.raises(StoreError, match="cannot free"):  # its own level 0 may not be evicted for its level 1
        write(b, 0, sizes=(800, 800))
    assert b.sizes(key(0)) == {0: 800} and b.stats().bytes == 800
    with pytest.raises(ConfigError):
        LocalBackend(store_dir, max_bytes=0)


def test_staging_files_of_dead_writers_are_collected_at_once(store_dir):
    b = LocalBackend(store_dir)
    tmp = store_dir / "tmp"
    dead = [tmp / f"{pid}.{'cd' * 8}.tmp" for pid in (2**22 + 1, 9_999_999_999)]  # no such process / pid
    other = tmp / "notes.txt"  # not a name of this store: left alone
    for p in (*dead, other):
        p.write_bytes(b"x")
    b.evict()
    assert [p.exists() for p in dead] == [False, False] and other.exists()
