"""The local store under a hostile user: files corrupted, deleted or placed by hand, a garbled or
deleted index, index rows naming files outside the store. It touches only what it owns."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from store_helpers import NS, RawEncoder, make_kv

from cachegen.errors import ChunkNotFound, ConfigError, CorruptChunk, StoreError
from cachegen.store import ContextStore, open_backend
from cachegen.store.local import INDEX, MARKER, LocalBackend, blob_name_ok


def key(i: int) -> str:
    return f"{i:064x}"


def blob_files(root: Path) -> list[Path]:
    """The store's own blob files (by name), regular files only."""
    return sorted(p for p in (root / "blobs").glob("*/*") if p.is_file() and blob_name_ok(f"{p.parent.name}/{p.name}"))


def counter(b: LocalBackend) -> tuple[int, int, int]:
    """The byte counter, the sum of indexed sizes and the bytes of the blob files on disk."""
    indexed = b._query("SELECT COALESCE(SUM(size), 0) FROM payloads")[0][0]
    kept = b._query("SELECT value FROM settings WHERE name='bytes'")[0][0]
    on_disk = sum(p.stat().st_size for p in blob_files(b.root))
    return kept, indexed, on_disk


def filled(root: Path, tokens: int = 64) -> tuple[ContextStore, list[int]]:
    cs = ContextStore(LocalBackend(root), NS, RawEncoder(), chunk_tokens=16)
    toks = list(range(500, 500 + tokens))
    cs.put_context(toks, make_kv(tokens, seed=5))
    return cs, toks


def place_foreign_files(root: Path) -> dict[Path, bytes]:
    """A user's files in and next to the store, some with names close to the store's own."""
    files = {
        root / "notes.txt": b"my notes",
        root / "blobs" / "cat.jpg": b"\xff\xd8 a cat",
        root / "blobs" / "ab" / "report.pdf": b"%PDF report",
        root / "blobs" / "ab" / (key(0xAB)[:-2] + "zz.0.0123abcd"): b"almost a blob name",
        root / "blobs" / "cd" / (key(0xAB) + ".0.0123abcd"): b"a blob name in the wrong directory",
        root / "blobs" / "mine" / "build.log": b"log",
        root / "tmp" / "build.log": b"a log",
        root / "tmp" / "12.notmine.tmp": b"almost a temporary name",
        root.parent / "victim.txt": b"next to the store",
    }
    for p, data in files.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return files


def assert_survived(files: dict[Path, bytes]) -> None:
    for p, data in files.items():
        assert p.read_bytes() == data, p


# -- which directories it uses -----------------------------------------------------


def test_refuses_the_root_and_directories_it_did_not_create(tmp_path):
    for url in ("file:///", "file:/"):
        with pytest.raises(ConfigError, match="filesystem root"):
            open_backend(url)
    user = tmp_path / "home"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not empty and is not a cachegen store"):
        open_backend(f"file://{user}")
    assert sorted(p.name for p in user.iterdir()) == ["notes.txt"]  # nothing was added
    with pytest.raises(ConfigError, match="is a file"):
        LocalBackend(user / "notes.txt")
    empty = tmp_path / "empty"
    empty.mkdir()
    LocalBackend(empty).put_chunk(key(1), b"", {0: b"x"})
    assert json.loads((empty / MARKER).read_text()) == {"format": "cachegen-store", "version": 1}
    assert LocalBackend(empty).sizes(key(1)) == {0: 1}  # a directory with the marker is a store
    (empty / MARKER).write_text(json.dumps({"format": "cachegen-store", "version": 99}))
    with pytest.raises(ConfigError, match="version 99"):
        LocalBackend(empty)


def test_a_store_another_process_is_creating_is_not_foreign(tmp_path):
    """Two processes opening one new store at once: the second may see the first's files before its marker."""
    root = tmp_path / "new"
    (root / "tmp").mkdir(parents=True)
    (root / f".{MARKER}.123.0a1b2c3d").write_text("{}")
    (root / INDEX).touch()
    LocalBackend(root).put_chunk(key(1), b"", {0: b"x"})
    assert (root / MARKER).is_file() and LocalBackend(root).get(key(1), 0) == b"x"


def test_a_store_from_before_the_marker_is_adopted(tmp_path):
    root = tmp_path / "old"
    LocalBackend(root).put_chunk(key(1), b"", {0: b"payload"})
    (root / MARKER).unlink()
    assert LocalBackend(root).get(key(1), 0) == b"payload"
    assert (root / MARKER).is_file()


def test_read_only_opens_never_create_a_store(tmp_path, capsys):
    from cachegen.cli.main import main

    where = tmp_path / "nothing" / "here"
    with pytest.raises(StoreError, match="no store at"):
        open_backend(f"file://{where}", create=False)
    for cmd in ("stats", "ls", "evict", "clear"):
        assert main(["store", cmd, "--store", f"file://{where}"]) == 2
        assert "no store at" in capsys.readouterr().err
    assert main(["store", "rm", "0123456789abcdef", "--store", f"file://{where}"]) == 2
    assert not (tmp_path / "nothing").exists()


def test_relative_file_urls(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="file:///ABSOLUTE/PATH") as e:
        open_backend("file://relative/x")
    assert "file:./relative/x" in str(e.value)
    assert not Path("/relative").exists()
    monkeypatch.chdir(tmp_path)
    b = open_backend("file:./rel/store")
    assert b.root == tmp_path / "rel" / "store" and (b.root / MARKER).is_file()
    assert open_backend(f"file:{tmp_path}/abs").root == tmp_path / "abs"
    assert open_backend(f"file://localhost{tmp_path}/abs").root == tmp_path / "abs"


# -- what it deletes -----------------------------------------------------------------


def test_evict_and_clear_delete_only_their_own_files(tmp_path, capsys):
    from cachegen.cli.main import main

    root = tmp_path / "store"
    cs, toks = filled(root)
    own = blob_files(root)
    assert len(own) == 4 * 3
    files = place_foreign_files(root)
    (root / "tmp" / "999999.0123456789abcdef.tmp").write_bytes(b"debris of a dead writer")
    debris = root / "blobs" / "ef" / ("ef" + "1" * 62 + ".1.0123abcd")  # a blob without a row: a crashed writer's
    debris.parent.mkdir(exist_ok=True)
    debris.write_bytes(b"debris")
    assert main(["store", "evict", "--store", f"file://{root}", "--max-bytes", "1"]) == 0
    assert "evicted 4 chunks" in capsys.readouterr().out
    assert_survived(files)
    assert not any(p.exists() for p in own) and not debris.exists()
    assert not (root / "tmp" / "999999.0123456789abcdef.tmp").exists()
    cs.put_context(toks, make_kv(64, seed=5))
    assert cs.backend.clear() == 4
    assert_survived(files)
    assert blob_files(root) == []


def test_index_rows_naming_other_files_are_never_followed(tmp_path):
    root = tmp_path / "deep" / "store"
    b = LocalBackend(root)
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"not the store's")
    b.put_chunk(key(1), b"", {0: b"a" * 100, 1: b"b" * 50})
    b.put_chunk(key(2), b"", {0: b"c" * 70})
    other = b._query("SELECT file FROM payloads WHERE key=?", (key(2),))[0][0]
    with b._write() as db:
        db.execute("UPDATE payloads SET file='../../victim.txt' WHERE key=? AND level=0", (key(1),))
        db.execute("UPDATE payloads SET file=? WHERE key=? AND level=1", (other, key(1)))  # another chunk's blob
    for level in (0, 1):
        with pytest.raises(CorruptChunk, match="bad file name"):
            b.get(key(1), level)
    assert victim.read_bytes() == b"not the store's"
    assert b.get(key(2), 0) == b"c" * 70  # the other chunk's blob is untouched
    assert b.sizes(key(1)) == {} and b.stats().chunks == 1  # the bad rows are gone
    with b._write() as db:  # and eviction never follows a bad name either
        db.execute("INSERT INTO payloads VALUES (?, 5, 15, x'00', '../../victim.txt')", (key(2),))
    b.evict(max_bytes=1)
    b.clear()
    assert victim.read_bytes() == b"not the store's"


# -- files damaged, deleted or replaced ---------------------------------------------------


def test_byte_counter_stays_consistent_when_payloads_are_dropped(tmp_path):
    root = tmp_path / "store"
    cs, toks = filled(root)
    b = cs.backend
    plan = cs.plan(toks)
    files = {f"{p.parent.name}/{p.name}": p for p in blob_files(root)}
    by_row = {(k, l): files[f] for k, l, f in b._query("SELECT key, level, file FROM payloads")}
    damaged = [(plan[0].ref.key, 0), (plan[1].ref.key, 2), (plan[2].ref.key, 1)]
    p = by_row[damaged[0]]
    p.write_bytes(p.read_bytes()[:-3])  # truncated
    p = by_row[damaged[1]]
    p.write_bytes(b"\x00" * p.stat().st_size)  # overwritten, same size
    by_row[damaged[2]].unlink()  # deleted by hand
    for (k, level), exc in zip(damaged, (CorruptChunk, CorruptChunk, ChunkNotFound)):
        with pytest.raises(exc):
            b.get(k, level)
    kept, indexed, on_disk = counter(b)
    assert kept == indexed == on_disk == b.stats().bytes
    assert indexed == sum(sum(i.sizes.values()) for i in plan) - sum(
        plan[i].sizes[l] for i, l in ((0, 0), (1, 2), (2, 1))
    )
    assert [sorted(i.sizes) for i in cs.plan(toks)] == [[1, 2], [0, 1], [0, 2], [0, 1, 2]]
    assert cs.put_context(toks, make_kv(64, seed=5)) == [i.ref for i in plan[:3]]  # recomputed levels go back
    assert counter(b)[0] == counter(b)[1] == counter(b)[2]


def test_byte_counter_stays_consistent_after_eviction_and_rm(tmp_path):
    """The counter that the size cap is enforced with equals the indexed sizes and the bytes on disk,
    exactly, after each way chunks leave: `store rm` of a context that shares its prefix, a delete of
    what is not there, eviction under a lower cap (by evict, by a new cap, by writes), and clear."""
    from cachegen.store.catalog import remove_context

    root = tmp_path / "store"
    cs, toks = filled(root)
    b = cs.backend
    other = toks[:32] + list(range(900, 932))  # shares its first two chunks with ``toks``
    cs.put_context(other, make_kv(64, seed=6))
    sizes = {i.ref.key: sum(i.sizes.values()) for t in (toks, other) for i in cs.plan(t)}
    (size,) = set(sizes.values())  # every chunk: 16 tokens at the same three levels
    assert len(sizes) == 6 and counter(b) == (6 * size,) * 3

    assert remove_context(b, cs.plan(other)[-1].ref.key) == 2  # its own two chunks; the shared ones stay
    assert counter(b) == (4 * size,) * 3 and cs.lookup(toks) == 64
    assert b.delete_chunks([key(12345)]) == 0 and counter(b) == (4 * size,) * 3

    assert b.evict(max_bytes=4 * size - 1) == 1
    assert counter(b) == (3 * size,) * 3
    LocalBackend(root, max_bytes=2 * size)  # a lower cap holds at once
    assert counter(b) == (2 * size,) * 3
    third = list(range(2000, 2064))
    cs.put_context(third, make_kv(64, seed=7))  # each chunk written evicts one
    assert counter(b) == (2 * size,) * 3 and b.stats().chunks == 2

    assert b.clear() == 2 and counter(b) == (0, 0, 0) and blob_files(root) == []


def test_a_fifo_or_symlink_in_place_of_a_blob_neither_blocks_nor_is_followed(tmp_path):
    b = LocalBackend(tmp_path / "store")
    b.put_chunk(key(1), b"", {0: b"a" * 10, 1: b"b" * 10})
    f0, f1 = (tmp_path / "store" / "blobs" / n for (n,) in b._query("SELECT file FROM payloads ORDER BY level"))
    f0.unlink()
    os.mkfifo(f0)  # opening a FIFO for reading would wait for a writer forever
    target = tmp_path / "secret.txt"
    target.write_bytes(b"b" * 10)  # same size as the payload
    f1.unlink()
    f1.symlink_to(target)
    for level in (0, 1):
        with pytest.raises(CorruptChunk):
            b.get(key(1), level)
    assert target.read_bytes() == b"b" * 10 and b.stats().chunks == 0


def test_capped_ingest_leaves_no_empty_chunk_counted_as_a_context(tmp_path):
    root = tmp_path / "store"
    cs, toks = filled(root)
    b = cs.backend
    plan = cs.plan(toks)
    total = sum(sum(i.sizes.values()) for i in plan)
    b.delete_chunks([plan[0].ref.key])
    with b._write() as db:  # every chunk last used at the same moment: the context's tail goes first
        db.execute("UPDATE chunks SET last_access=1000")
    LocalBackend(root, max_bytes=total - 1)
    # rewriting chunk 0 evicts the last chunk, which the plan (taken before) reported as stored
    cs.put_context(toks, make_kv(64, seed=5))
    s = b.stats()
    assert [i.cached for i in cs.plan(toks)] == [True, True, True, False]
    assert (s.chunks, s.contexts) == (3, 0)
    assert b._query("SELECT COUNT(*) FROM chunks WHERE key NOT IN (SELECT key FROM payloads)")[0][0] == 0


# -- the index ---------------------------------------------------------------------------


def _payload_bytes(cs: ContextStore, toks) -> list[dict[int, bytes]]:
    return [{l: cs.get(i.ref, l) for l in i.sizes} for i in cs.plan(toks)]


@pytest.mark.parametrize("damage", ["garbled", "deleted"])
def test_a_lost_index_is_rebuilt_from_the_blobs(tmp_path, damage):
    root = tmp_path / "store"
    cs, toks = filled(root)
    before = _payload_bytes(cs, toks)
    files = place_foreign_files(root)
    cs.backend.close()
    index = root / INDEX
    if damage == "garbled":
        data = bytearray(index.read_bytes())
        data[:100] = os.urandom(100)  # the header: not a database any more
        index.write_bytes(bytes(data))
        garbled = bytes(data)
    else:
        for p in root.glob(INDEX + "*"):
            p.unlink()
    b = LocalBackend(root)  # opens (a server still starts); the rebuild runs in the background
    assert b.wait_rebuilt(timeout=60)
    if damage == "garbled":
        (aside,) = root.glob(INDEX + ".corrupt-*")
        assert aside.read_bytes() == garbled  # kept for a post-mortem, not deleted
    cs2 = ContextStore(b, NS, RawEncoder(), chunk_tokens=16)
    assert _payload_bytes(cs2, toks) == before  # every blob is back, with its checksum
    kept, indexed, on_disk = counter(b)
    assert kept == indexed == on_disk
    assert_survived(files)
    # the token ids and context marks were in the lost index only: the chunks load, stats say so
    assert (b.stats().chunks, b.stats().contexts) == (4, 0)
    cs2.put_context(toks, make_kv(64, seed=5))  # a new ingest marks the context again
    assert b.stats().contexts == 1 and cs2.tokens(cs2.plan(toks)[-1].ref) == toks[48:]


def test_lookups_miss_while_the_index_is_rebuilt(tmp_path, monkeypatch):
    root = tmp_path / "store"
    cs, toks = filled(root)
    want = [i.sizes for i in cs.plan(toks)]
    cs.backend.close()
    for p in root.glob(INDEX + "*"):
        p.unlink()
    # the rebuild waits until the lookups are made (12 blobs rebuild faster than the test can look)
    go = threading.Event()
    rebuild = LocalBackend._rebuild

    def held(self):
        assert go.wait(60)
        rebuild(self)

    monkeypatch.setattr(LocalBackend, "_rebuild", held)
    b = LocalBackend(root)
    assert b._query("SELECT value FROM settings WHERE name='rebuilding'")
    # while the rebuild runs, a plan never fails: every chunk misses (recomputed), none has a wrong size
    cs2 = ContextStore(b, NS, RawEncoder(), chunk_tokens=16)
    assert [i.sizes for i in cs2.plan(toks)] == [{}] * len(want)
    assert not b.wait_rebuilt(timeout=0.05)
    go.set()
    assert b.wait_rebuilt(timeout=60) and [i.sizes for i in cs2.plan(toks)] == want


def test_an_index_from_before_store_ls_is_migrated(tmp_path):
    """An index without the ``prev`` column (written before ``store ls``) opens and gains it."""
    root = tmp_path / "old"
    cs, toks = filled(root)
    want = [i.sizes for i in cs.plan(toks)]
    with cs.backend._write() as db:
        db.execute("ALTER TABLE chunks DROP COLUMN prev")
    cs.backend.close()
    (root / MARKER).unlink()
    b = LocalBackend(root)
    assert [i.sizes for i in ContextStore(b, NS, RawEncoder(), chunk_tokens=16).plan(toks)] == want
    assert "prev" in {r[1] for r in b._query("PRAGMA table_info(chunks)")}
    from cachegen.store import list_contexts

    (ctx,) = list_contexts(b)  # its chunks name no previous chunk: only the last one is listed
    assert (ctx.chunks, ctx.complete) == (1, False)
