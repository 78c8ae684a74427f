"""The file:// store's exact answers: every error and log message word for word, the deadlines each
call passes on, the rebuild of a lost index counted blob by blob, and the waits for a rebuild."""

from __future__ import annotations

import datetime as dt
import logging
import os
import re
import shutil
import sqlite3
import threading
import time
from pathlib import Path

import pytest

import cachegen.store.local as local
from cachegen.errors import ChunkNotFound, ConfigError, CorruptChunk, StoreError, StoreUnavailable
from cachegen.store import ChunkWrite
from cachegen.store.backend import Deadline
from cachegen.store.local import INDEX, MARKER, LocalBackend


def key(i: int) -> str:
    return f"{i:064x}"


def put(b: LocalBackend, i: int, payloads: dict[int, bytes], start: int = 0) -> None:
    b.put_chunks([ChunkWrite(key(i), b"\x01\x00\x00\x00", payloads, start=start)])


def file_of(b: LocalBackend, i: int, level: int) -> str:
    return b._query("SELECT file FROM payloads WHERE key=? AND level=?", (key(i), level))[0][0]


def messages(caplog, level: int = logging.DEBUG) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "cachegen.store.local" and r.levelno >= level]


# -- error messages ---------------------------------------------------------------------------------


def test_every_read_error_names_the_chunk_level_and_store(tmp_path, monkeypatch):
    b = LocalBackend(tmp_path / "s")
    url = f"file://{b.root}"
    k16 = key(1)[:16]
    with pytest.raises(ChunkNotFound) as e:
        b.tokens(key(1))
    assert str(e.value) == f"chunk {k16} is not in {url}"
    with pytest.raises(ChunkNotFound) as e:
        b.get(key(1), 0)
    assert str(e.value) == f"chunk {k16} level 0 is not in {url}"
    put(b, 1, {0: b"a" * 10, 1: b"b" * 20, 2: b"c" * 30})
    (b.blobs / file_of(b, 1, 2)).unlink()  # deleted by hand
    with pytest.raises(ChunkNotFound) as e:
        b.get(key(1), 2)
    assert str(e.value) == f"chunk {k16} level 2 was evicted from {url}"
    (b.blobs / file_of(b, 1, 1)).write_bytes(b"x" * 20)
    with pytest.raises(CorruptChunk) as e:
        b.get(key(1), 1)
    assert str(e.value) == f"corrupt chunk: chunk {k16} level 1 in {url} fails its checksum"

    def denied(path):
        raise PermissionError("denied")

    monkeypatch.setattr(local, "_read_regular", denied)
    with pytest.raises(StoreError) as e:
        b.get(key(1), 0)
    assert str(e.value) == f"cannot read chunk {k16} level 0: denied"


def test_a_row_naming_another_level_or_chunk_is_refused_and_its_file_kept(tmp_path, caplog):
    caplog.set_level(logging.WARNING, "cachegen.store.local")
    b = LocalBackend(tmp_path / "s")
    url = f"file://{b.root}"
    put(b, 1, {0: b"a" * 10, 1: b"b" * 20})
    put(b, 2, {0: b"c" * 10, 1: b"d" * 20})
    level1, other = file_of(b, 1, 1), file_of(b, 2, 1)
    with b._write() as db:
        db.execute("UPDATE payloads SET file=? WHERE key=? AND level=0", (level1, key(1)))
    with pytest.raises(CorruptChunk) as e:  # the same chunk's level 1: not level 0's name
        b.get(key(1), 0)
    assert str(e.value) == f"corrupt chunk: chunk {key(1)[:16]} level 0 in {url} has a bad file name in the index"
    assert messages(caplog) == [
        f"store index {b.root / INDEX} names {level1!r} for chunk {key(1)[:16]}: "
        "not a blob name of this store, left alone"
    ]
    assert (b.blobs / level1).is_file() and b.get(key(1), 1) == b"b" * 20  # level 1 is untouched
    with b._write() as db:
        db.execute("UPDATE payloads SET file=? WHERE key=? AND level=1", (other, key(1)))
    with pytest.raises(CorruptChunk) as e:  # another chunk's blob of the same level and size
        b.get(key(1), 1)
    assert str(e.value) == f"corrupt chunk: chunk {key(1)[:16]} level 1 in {url} has a bad file name in the index"
    assert b.get(key(2), 0) == b"c" * 10 and b.get(key(2), 1) == b"d" * 20


def test_dropping_a_chunk_warns_of_a_row_naming_another_level(tmp_path, caplog):
    caplog.set_level(logging.WARNING, "cachegen.store.local")
    b = LocalBackend(tmp_path / "s")
    put(b, 1, {0: b"a" * 10, 1: b"b" * 20})
    level1 = file_of(b, 1, 1)
    with b._write() as db:
        db.execute("UPDATE payloads SET file=? WHERE key=? AND level=0", (level1, key(1)))
    assert b.delete_chunks([key(1)]) == 1
    assert messages(caplog) == [
        f"store index {b.root / INDEX} names {level1!r} for chunk {key(1)[:16]}: "
        "not a blob name of this store, left alone"
    ]


def test_an_unreadable_marker_is_named(tmp_path):
    root = tmp_path / "s"
    LocalBackend(root).close()
    (root / MARKER).write_text("{not json")
    with pytest.raises(StoreError) as e:
        LocalBackend(root)
    msg = str(e.value)
    assert msg.startswith(f"{root / MARKER} is unreadable (") and msg.endswith(f"): is {root} a cachegen store?")


def test_a_directory_holding_only_what_a_creator_makes_first_is_not_foreign(tmp_path):
    for name in ("blobs", "tmp"):
        root = tmp_path / name / "s"
        (root / name).mkdir(parents=True)
        LocalBackend(root).close()
        assert (root / MARKER).is_file()


def test_chunk_rows_count_tokens_as_integers(tmp_path):
    b = LocalBackend(tmp_path / "s")
    b.put_chunks([ChunkWrite(key(1), b"\x01\x00\x00\x00" * 3, {0: b"a"})])
    (row,) = b.chunk_rows()
    assert type(row.num_tokens) is int and row.num_tokens == 3


# -- deadlines ------------------------------------------------------------------------------------


def test_every_read_gets_the_calls_deadline(tmp_path, monkeypatch):
    b = LocalBackend(tmp_path / "s")
    put(b, 1, {0: b"a" * 10})
    for call in (
        lambda: b.sizes_many([key(1)], timeout=0),
        lambda: b.get_many([(key(1), 0)], timeout=0),
        lambda: b.get_setting("x", timeout=0),
    ):
        with pytest.raises(StoreUnavailable):  # no time left: refused before any statement
            call()
    seen: list[Deadline | None] = []
    query = b._query

    def spy(sql, args=(), d=None):
        seen.append(d)
        return query(sql, args, d)

    monkeypatch.setattr(b, "_query", spy)
    b.sizes_many([key(1)], timeout=5.0)
    b.get_many([(key(1), 0)], timeout=6.0)
    b.get_setting("x", timeout=7.0)
    assert [d.timeout if d is not None else None for d in seen] == [5.0, 6.0, 7.0]


def test_noting_an_access_never_waits_for_the_lock_past_a_hundredth_of_a_second(tmp_path):
    clock_t = [1_700_000_000.0]
    b = LocalBackend(tmp_path / "s", busy_timeout=3.0, clock=lambda: clock_t[0])
    put(b, 1, {0: b"a" * 10})
    t_written = b._query("SELECT last_access FROM chunks")[0][0]
    clock_t[0] += 10  # the chunk is stale: a read notes the access
    assert b.get_many([(key(1), 0)], timeout=5.0) == [b"a" * 10]  # uncontended: noted
    assert b._query("SELECT last_access FROM chunks")[0][0] == t_written + 10
    clock_t[0] += 10
    other = sqlite3.connect(b.root / INDEX, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another writer holds the lock
    try:
        t = time.monotonic()
        assert b.get_many([(key(1), 0)], timeout=5.0) == [b"a" * 10]
        took = time.monotonic() - t
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert took < 0.5  # the note is given up after 0.01 s (the busy timeout is 3 s, the call's 5 s)
    assert b._query("SELECT last_access FROM chunks")[0][0] == t_written + 10  # not noted this time


# -- a lost index ---------------------------------------------------------------------------------


def _index_lost(root: Path, blobs: int, size: int = 10) -> dict[str, bytes]:
    """A store whose index was deleted, with ``blobs`` blob files (of chunk i, level i % 3)."""
    LocalBackend(root).close()
    for p in root.glob(INDEX + "*"):
        p.unlink()
    files = {}
    for i in range(blobs):
        k = key(10_000 + i)
        name = f"{k[:2]}/{k}.{i % 3}.{i:08x}"
        (root / "blobs" / k[:2]).mkdir(exist_ok=True)
        data = bytes([i % 256]) * size
        (root / "blobs" / name).write_bytes(data)
        files[name] = data
    return files


def test_a_rebuild_recovers_every_blob_in_batches_and_says_so(tmp_path, caplog):
    caplog.set_level(logging.INFO, "cachegen.store.local")
    root = tmp_path / "s"
    files = _index_lost(root, 130)  # three batches of 64: the last one partial
    b = LocalBackend(root, max_bytes=1300)  # exactly the blobs' bytes: none is evicted
    assert b.wait_rebuilt(timeout=60)
    rows = b._query("SELECT file, size FROM payloads")
    assert dict(rows) == {n: 10 for n in files}
    assert b._query("SELECT value FROM settings WHERE name='bytes'")[0][0] == 1300
    assert b.stats().chunks == 130
    assert messages(caplog, logging.INFO)[-2:] == [
        f"rebuilding the index of {root} from 130 blobs",
        f"rebuilt the index of {root}: 130 payloads recovered",
    ]


def test_a_blob_that_cannot_be_read_is_skipped_not_the_rest(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, "cachegen.store.local")
    root = tmp_path / "s"
    _index_lost(root, 5)
    read = local._read_regular
    failed: list[Path] = []

    def flaky(path):
        if not failed:
            failed.append(path)
            raise PermissionError("denied")
        return read(path)

    monkeypatch.setattr(local, "_read_regular", flaky)
    b = LocalBackend(root)
    assert b.wait_rebuilt(timeout=60)
    assert b.stats().chunks == 4 and len(failed) == 1
    assert messages(caplog, logging.INFO)[-1] == f"rebuilt the index of {root}: 4 payloads recovered"


def test_a_failed_rebuild_is_logged_and_left_for_the_next_open(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, "cachegen.store.local")
    root = tmp_path / "s"
    _index_lost(root, 3)

    def broken(path):
        raise RuntimeError("a bug")

    monkeypatch.setattr(local, "_read_regular", broken)
    b = LocalBackend(root)
    assert b.wait_rebuilt(timeout=60) is False  # the flag stays: the next open resumes it
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [r.getMessage() for r in errors] == [f"rebuilding the index of {root} failed"]
    assert errors[0].exc_info is not None


def test_a_garbled_index_is_moved_aside_under_a_utc_stamp(tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.ERROR, "cachegen.store.local")
    root = tmp_path / "s"
    LocalBackend(root).close()
    garbage = os.urandom(4096)
    (root / INDEX).write_bytes(garbage)
    monkeypatch.setenv("TZ", "Asia/Kolkata")  # local time is not UTC: the stamp must be UTC
    time.tzset()
    try:
        before = dt.datetime.now(dt.UTC).replace(microsecond=0, tzinfo=None)
        b = LocalBackend(root)
        after = dt.datetime.now(dt.UTC).replace(tzinfo=None)
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
    (aside,) = root.glob(INDEX + ".corrupt-*")
    m = re.fullmatch(re.escape(INDEX) + r"\.corrupt-(\d{8}T\d{6})-(\d+)", aside.name)
    assert m and int(m.group(2)) == os.getpid()
    assert before <= dt.datetime.strptime(m.group(1), "%Y%m%dT%H%M%S") <= after
    stamp = f"{m.group(1)}-{m.group(2)}"
    assert aside.read_bytes() == garbage
    (msg,) = messages(caplog, logging.ERROR)
    assert msg == (
        f"store index {root / INDEX} is unreadable (file is not a database): "
        f"moved aside as {INDEX}.corrupt-{stamp}; rebuilding it from the blobs"
    )
    b.close()


def test_waits_for_a_rebuild_hold_until_it_ends_or_the_timeout(tmp_path, monkeypatch):
    root = tmp_path / "s"
    b = LocalBackend(root)
    with b._write() as db:  # a live process (pid 1) is rebuilding it
        db.execute("INSERT OR REPLACE INTO settings VALUES ('rebuilding', 1)")
    assert b.wait_rebuilt(timeout=0.01) is False
    release = threading.Event()
    rebuild = threading.Thread(target=release.wait, daemon=True)
    rebuild.start()
    monkeypatch.setitem(local._REBUILDS, b.root, rebuild)
    waiter = threading.Thread(target=b.wait_rebuilt, args=(0.05,), daemon=True)
    waiter.start()
    waiter.join(2.0)
    waited_past_timeout = waiter.is_alive()
    closer = threading.Thread(target=b.close, daemon=True)
    closer.start()
    closer.join(0.3)
    close_waited = closer.is_alive()  # close finishes the rebuild first
    release.set()
    closer.join(5)
    waiter.join(5)
    assert not waited_past_timeout and close_waited and not closer.is_alive()


def test_a_process_of_another_user_is_alive(monkeypatch):
    def kill(pid, sig):
        raise PermissionError("not yours")

    monkeypatch.setattr(local.os, "kill", kill)
    assert local._alive(12345) is True


# -- more refusals, word for word ---------------------------------------------------------------


def test_refusals_of_a_bad_cap_the_root_and_an_unopenable_store(tmp_path):
    with pytest.raises(ConfigError) as e:
        LocalBackend(tmp_path / "s", max_bytes=-1)
    assert str(e.value) == "max_bytes must be positive"
    with pytest.raises(ConfigError) as e:
        LocalBackend("/")
    assert str(e.value) == (
        "refusing to use the filesystem root / as a store: give a directory of its own, "
        "e.g. file://$HOME/.cache/cachegen/store"
    )
    root = tmp_path / "s"
    LocalBackend(root).close()
    shutil.rmtree(root / "blobs")
    (root / "blobs").write_bytes(b"a file where blobs/ belongs")
    with pytest.raises(StoreError) as e:
        LocalBackend(root)
    assert str(e.value).startswith(f"cannot open store at {root}: [Errno 17] File exists")


def test_query_and_write_errors_name_the_index_and_the_chunk(tmp_path, monkeypatch):
    b = LocalBackend(tmp_path / "s")
    with pytest.raises(StoreError) as e:
        b._query("SELECT 1 FROM nowhere")
    assert str(e.value) == f"store index {b.root / INDEX}: no such table: nowhere"

    def full(data):
        raise OSError("disk full")

    monkeypatch.setattr(b, "_stage", full)
    with pytest.raises(StoreError) as e:
        put(b, 1, {0: b"a"})
    assert str(e.value) == f"cannot write chunk {key(1)[:16]} to {b.root}: disk full"


def test_staging_files_have_the_name_garbage_collection_knows(tmp_path, monkeypatch):
    b = LocalBackend(tmp_path / "s")
    staged: list[str] = []
    replace = os.replace

    def spy(src, dst):
        staged.append(Path(src).name)
        return replace(src, dst)

    monkeypatch.setattr(local.os, "replace", spy)
    put(b, 1, {0: b"a", 1: b"b"})
    assert len(staged) == 2 and all(local._TMP_NAME.fullmatch(n) for n in staged)
    assert all(n.startswith(f"{os.getpid()}.") for n in staged)


def test_a_new_threads_connection_honours_its_calls_deadline(tmp_path):
    b = LocalBackend(tmp_path / "s")
    put(b, 1, {0: b"a" * 3})
    out: list = []

    def read():
        out.append(b.sizes_many([key(1)]))  # no deadline
        b._drop_connection()
        out.append(b.get_many([(key(1), 0)], timeout=5.0))  # a deadline, on a new connection

    t = threading.Thread(target=read)
    t.start()
    t.join(30)
    assert out == [[{0: 3}], [b"aaa"]]


def test_an_index_that_cannot_be_opened_is_moved_aside(tmp_path, caplog):
    caplog.set_level(logging.ERROR, "cachegen.store.local")
    root = tmp_path / "s"
    LocalBackend(root).close()
    for p in root.glob(INDEX + "*"):
        p.unlink()
    (root / INDEX).mkdir()  # not a database file at all
    b = LocalBackend(root)
    put(b, 1, {0: b"a"})
    assert b.get(key(1), 0) == b"a"
    (aside,) = root.glob(INDEX + ".corrupt-*")
    assert aside.is_dir()
    (msg,) = messages(caplog, logging.ERROR)
    assert f"is unreadable (unable to open database file): moved aside as {aside.name};" in msg


def test_a_rebuild_runs_once_per_store_on_a_named_daemon_thread(tmp_path, monkeypatch):
    root = tmp_path / "s"
    _index_lost(root, 2)
    release = threading.Event()
    rebuild = local.LocalBackend._rebuild

    def slow(self):
        release.wait(10)
        rebuild(self)

    monkeypatch.setattr(local.LocalBackend, "_rebuild", slow)
    b = LocalBackend(root)
    t = local._REBUILDS[b.root]
    assert t.name == "cachegen-rebuild-s" and t.daemon is True and t.is_alive()
    LocalBackend(root)  # a second open in the same process joins it, not a second rebuild
    assert local._REBUILDS[b.root] is t
    release.set()
    assert b.wait_rebuilt(timeout=30) and b.stats().chunks == 2
    with b._write() as db:  # another live process (pid 1) is rebuilding: an open leaves it to it
        db.execute("INSERT OR REPLACE INTO settings VALUES ('rebuilding', 1)")
    LocalBackend(root)
    assert local._REBUILDS[b.root] is t and not t.is_alive()


# -- bounds, the default wait, what counts as a store, garbage collection during a rebuild ------


def test_the_default_lock_wait_and_the_smallest_cap(tmp_path):
    b = LocalBackend(tmp_path / "a")
    assert b.busy_timeout == 30.0  # the documented wait for another process's write lock
    b.close()
    b = LocalBackend(tmp_path / "b", max_bytes=1)  # one byte is a cap (0 is refused above)
    assert b.max_bytes == 1
    b.close()


def test_a_payload_of_exactly_the_cap_fits_and_one_byte_more_is_refused(tmp_path):
    b = LocalBackend(tmp_path / "s", max_bytes=64)
    put(b, 1, {0: b"x" * 64})
    assert b.get(key(1), 0) == b"x" * 64
    with pytest.raises(StoreError) as e:
        put(b, 2, {0: b"y" * 65})
    assert str(e.value) == "a chunk of 65 bytes does not fit in the store's cap of 64 bytes"
    b.close()


def test_a_directory_with_blobs_but_no_index_is_not_taken_for_a_store(tmp_path):
    root = tmp_path / "s"
    (root / "blobs").mkdir(parents=True)
    with pytest.raises(StoreError) as e:
        LocalBackend(root, create=False)
    assert str(e.value) == f"no store at {root}: nothing has been stored there yet"
    assert not (root / MARKER).exists()


def test_only_two_letter_directories_of_blobs_are_scanned(tmp_path):
    root = tmp_path / "s"
    b = LocalBackend(root)
    put(b, 1, {0: b"payload"})
    name = file_of(b, 1, 0)
    b.close()
    (root / "blobs" / "zz").write_bytes(b"a file with a directory's name")
    (root / "blobs" / "abc").mkdir()
    shutil.copy(root / "blobs" / name, root / "blobs" / "abc" / Path(name).name)  # a good name, wrong place
    (root / INDEX).unlink()  # the index is rebuilt from the blobs
    b = LocalBackend(root)
    assert b.wait_rebuilt(timeout=10)
    assert sorted(n for n, _ in b._blob_files()) == [name]
    assert b.get(key(1), 0) == b"payload"
    b.close()


def test_garbage_collection_keeps_unindexed_blobs_while_a_rebuild_runs(tmp_path):
    root = tmp_path / "s"
    b = LocalBackend(root)
    put(b, 1, {0: b"payload"})
    path = root / "blobs" / file_of(b, 1, 0)
    with b._write() as db:  # a live process (pid 1) is rebuilding: its blobs may not be indexed yet
        db.execute("DELETE FROM payloads")
        db.execute("INSERT OR REPLACE INTO settings VALUES ('rebuilding', 1)")
    b.clear()  # collects garbage, except during a rebuild
    assert path.exists()
    with b._write() as db:
        db.execute("DELETE FROM settings WHERE name='rebuilding'")
    b.clear()
    assert not path.exists()
    b.close()


def test_an_index_is_moved_aside_with_its_wal_and_shm(tmp_path):
    root = tmp_path / "s"
    b = LocalBackend(root)
    put(b, 1, {0: b"payload"})
    other = sqlite3.connect(root / INDEX)  # a second reader: closing the store's connection keeps the WAL
    other.execute("SELECT COUNT(*) FROM chunks").fetchall()
    assert (root / (INDEX + "-wal")).exists() and (root / (INDEX + "-shm")).exists()
    b._quarantine("a test")
    assert sorted(p.name.split(".corrupt-")[0] for p in root.glob("*.corrupt-*")) == [
        INDEX,
        INDEX + "-shm",
        INDEX + "-wal",
    ]
    other.close()


def test_a_failure_after_the_renames_removes_the_renamed_files(tmp_path, monkeypatch):
    root = tmp_path / "s"
    b = LocalBackend(root)

    def fail(d):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(local, "_fsync_dir", fail)
    with pytest.raises(StoreError) as e:
        put(b, 1, {0: b"a", 3: b"bc"})
    assert str(e.value) == f"cannot write chunk {key(1)[:16]} to {b.root}: [Errno 5] Input/output error"
    assert list(b._blob_files()) == [] and b.stats().chunks == 0
    b.close()
