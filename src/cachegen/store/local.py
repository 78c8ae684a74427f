"""The embedded store: a SQLite index plus one file per chunk and level.

Why it is safe with several processes and SIGKILL:

* A payload file is written under ``tmp/``, fsynced, and renamed into
  ``blobs/`` only while holding SQLite's write lock (``BEGIN IMMEDIATE``), in
  the same transaction that inserts its index row. A file without a committed
  row (a writer killed between rename and commit) is invisible and removed by
  :meth:`LocalBackend.evict`; a row is never committed before its file is in place.
* File names carry a random nonce, so a reader holding an old index row never
  opens another copy's file: it gets that copy or ``ChunkNotFound``.
* The size cap is stored in the index and enforced inside that same write
  transaction: least recently used chunks are dropped (rows and files) before
  the new files are renamed in, so committed payload bytes never exceed it,
  whatever the number of writers.
* Every read checks the payload's size and checksum (CRC-32; blake2b-128 for payloads written
  before it) from the index.

Why it touches only what it owns:

* A store is a directory holding the marker file ``cachegen-store.json``
  (with the format version). The store creates it only in a new or empty
  directory; it refuses ``/`` and any other non-empty directory.
* It deletes only names of its own patterns (``blobs/XX/KEY.LEVEL.NONCE``,
  ``tmp/PID.NONCE.tmp``), and a name read from the index is used only if it
  has that pattern and names the row's own key and level: a row naming
  ``../../x`` is dropped, never followed.
* A garbled index is renamed aside (``index.sqlite3.corrupt-*``) and a new one
  is rebuilt from the blobs in the background; meanwhile lookups miss (loads
  recompute) and garbage collection deletes nothing.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import secrets
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from cachegen.errors import ChunkNotFound, ConfigError, CorruptChunk, StoreError, StoreUnavailable
from cachegen.store.backend import Backend, ChunkRow, ChunkWrite, Deadline, LevelStats, StoreStats, checksum, verify
from cachegen.store.keys import check_key

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 10 << 30
INDEX = "index.sqlite3"
MARKER = "cachegen-store.json"
STORE_FORMAT = "cachegen-store"
STORE_VERSION = 1
TMP_MAX_AGE_S = 3600  # a temporary file this old belongs to a dead writer

_BLOB_NAME = re.compile(r"([0-9a-f]{2})/([0-9a-f]{64})\.([0-9]{1,6})\.[0-9a-f]{8}")
_TMP_NAME = re.compile(r"[0-9]{1,10}\.[0-9a-f]{16}\.tmp")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS chunks(
    key TEXT PRIMARY KEY, tokens BLOB NOT NULL, start INTEGER NOT NULL,
    ends_context INTEGER NOT NULL DEFAULT 0, created INTEGER NOT NULL, last_access INTEGER NOT NULL,
    prev TEXT NOT NULL DEFAULT '');
CREATE INDEX IF NOT EXISTS chunks_lru ON chunks(last_access, start DESC);
CREATE TABLE IF NOT EXISTS payloads(
    key TEXT NOT NULL, level INTEGER NOT NULL, size INTEGER NOT NULL, checksum BLOB NOT NULL,
    file TEXT NOT NULL, PRIMARY KEY(key, level));
CREATE TABLE IF NOT EXISTS settings(name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS meta(name TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT OR IGNORE INTO settings VALUES ('bytes', 0);
"""

_REBUILDS: dict[Path, threading.Thread] = {}  # the rebuild running in this process, per store
_REBUILDS_LOCK = threading.Lock()


def blob_name_ok(name: str, key: str | None = None, level: int | None = None) -> bool:
    """Whether ``name`` (from the index or a directory listing) is one of this store's blob names."""
    m = _BLOB_NAME.fullmatch(name)
    if not m or m.group(1) != m.group(2)[:2]:
        return False
    return (key is None or m.group(2) == key) and (level is None or int(m.group(3)) == level)


def _being_created(name: str) -> bool:
    """An entry another process creating the same store at this moment may have made already."""
    return name in ("blobs", "tmp") or name.startswith((INDEX, f".{MARKER}."))


def _is_store(root: Path) -> bool:
    return (root / MARKER).is_file()


def _read_marker(root: Path) -> None:
    try:
        info = json.loads((root / MARKER).read_text())
        fmt, version = info["format"], info["version"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise StoreError(f"{root / MARKER} is unreadable ({e}): is {root} a cachegen store?") from None
    if fmt != STORE_FORMAT or version != STORE_VERSION:
        raise ConfigError(
            f"{root} holds a store of format {fmt!r} version {version!r}; this cachegen reads "
            f"{STORE_FORMAT!r} version {STORE_VERSION}: use another directory"
        )


class LocalBackend(Backend):
    """``file://PATH``: a directory holding ``cachegen-store.json``, ``index.sqlite3``, ``blobs/`` and ``tmp/``.

    ``create=False`` (read-only commands) opens an existing store only: it
    raises ``StoreError`` where there is none instead of making one. ``clock``: wall-clock seconds
    for access times (LRU) and the age of temporary files; a test passes one it moves itself."""

    local = True

    def __init__(
        self,
        root: str | os.PathLike,
        max_bytes: int | None = None,
        busy_timeout: float = 30.0,
        create: bool = True,
        clock: Callable[[], float] = time.time,
    ):
        self.root = Path(root).expanduser().resolve()
        self.url = f"file://{self.root}"
        self.blobs = self.root / "blobs"
        self.tmp = self.root / "tmp"
        self.busy_timeout = busy_timeout
        self.clock = clock
        self._local = threading.local()
        if max_bytes is not None and max_bytes <= 0:
            raise ConfigError("max_bytes must be positive")
        try:
            self._claim_directory(create)
            for d in (self.blobs, self.tmp):
                d.mkdir(exist_ok=True)
            self._open_index()
            with self._write() as db:
                db.execute("INSERT OR IGNORE INTO settings VALUES ('max_bytes', ?)", (max_bytes or DEFAULT_MAX_BYTES,))
                if max_bytes is not None:  # the cap belongs to the store, so every process enforces the same one
                    db.execute("UPDATE settings SET value=? WHERE name='max_bytes'", (max_bytes,))
                    self._make_room(db, 0)  # a lowered cap holds from now on
        except OSError as e:
            raise StoreError(f"cannot open store at {self.root}: {e}") from e
        self._resume_rebuild()

    # -- the directory ---------------------------------------------------------
    def _claim_directory(self, create: bool) -> None:
        """Use ``root`` only if it is a store, or (``create``) a new or empty directory it makes one of."""
        root = self.root
        if root == Path(root.anchor):
            raise ConfigError(
                f"refusing to use the filesystem root {root} as a store: give a directory of its own, "
                "e.g. file://$HOME/.cache/cachegen/store"
            )
        if _is_store(root):
            return _read_marker(root)
        if root.is_dir() and (root / INDEX).is_file() and self.blobs.is_dir():
            if create:  # a store made before the marker existed
                self._write_marker()
            return None
        if root.exists() and not root.is_dir():
            raise ConfigError(f"{root} is a file, not a store directory: give a directory")
        if root.is_dir() and any(not _being_created(p.name) for p in root.iterdir()):
            raise ConfigError(
                f"{root} is not empty and is not a cachegen store (it has no {MARKER}): give a new or empty directory"
            )
        if not create:
            raise StoreError(f"no store at {root}: nothing has been stored there yet")
        root.mkdir(parents=True, exist_ok=True)
        self._write_marker()
        return None

    def _write_marker(self) -> None:
        tmp = self.root / f".{MARKER}.{os.getpid()}.{secrets.token_hex(4)}"
        tmp.write_text(json.dumps({"format": STORE_FORMAT, "version": STORE_VERSION}) + "\n")
        os.replace(tmp, self.root / MARKER)  # concurrent creators write the same content

    # -- connection and transactions -----------------------------------------
    def _db(self, d: Deadline | None = None) -> sqlite3.Connection:
        """One connection per thread and process (a forked child must not reuse its parent's)."""
        db = getattr(self._local, "db", None)
        if db is None or self._local.pid != os.getpid():
            wait = self.busy_timeout if d is None or d.end is None else min(self.busy_timeout, d.end - time.monotonic())
            give_up = time.monotonic() + wait
            # switching a new index to WAL needs an exclusive lock that sqlite's busy timeout does not
            # wait for: two processes opening a new store at once saw "database is locked" at once
            while True:
                db = None
                try:
                    db = sqlite3.connect(self.root / INDEX, timeout=max(0.001, wait), isolation_level=None)
                    db.execute("PRAGMA journal_mode=WAL")
                    db.execute("PRAGMA synchronous=NORMAL")
                    db.execute(f"PRAGMA busy_timeout={int(1000 * self.busy_timeout)}")
                    break
                except sqlite3.Error as e:
                    if db is not None:
                        db.close()
                    if "locked" not in str(e) or time.monotonic() > give_up:
                        raise
                    time.sleep(0.01)
            self._local.db, self._local.pid = db, os.getpid()
        return db

    def _drop_connection(self) -> None:
        """Close this thread's connection (other threads keep theirs)."""
        db = getattr(self._local, "db", None)
        if db is not None and getattr(self._local, "pid", None) == os.getpid():
            db.close()
        self._local.db = None

    def _open_index(self) -> None:
        """Create or check the index; a garbled one is renamed aside and rebuilt from the blobs."""
        fresh = not (self.root / INDEX).exists()
        try:
            self._init_schema()
        except sqlite3.DatabaseError as e:
            if isinstance(e, sqlite3.OperationalError) and "locked" in str(e):
                raise StoreError(f"store index {self.root / INDEX}: {e}") from e
            self._quarantine(str(e))
            fresh = True
            try:
                self._init_schema()
            except sqlite3.Error as e2:
                raise StoreError(f"cannot make a new store index {self.root / INDEX}: {e2}") from e2
        if fresh and any(self._blob_files()):  # deleted or garbled index: the blobs are still good
            with self._write() as db:
                db.execute("INSERT OR REPLACE INTO settings VALUES ('rebuilding', ?)", (os.getpid(),))

    def _init_schema(self) -> None:
        db = self._db()
        for _ in range(2):
            try:
                db.executescript(_SCHEMA)
                break
            except sqlite3.OperationalError as e:
                if "locked" not in str(e):
                    raise
                time.sleep(0.05)
        if db.execute("PRAGMA quick_check(1)").fetchone()[0] != "ok":
            raise sqlite3.DatabaseError("quick_check failed")
        if "prev" not in {r[1] for r in db.execute("PRAGMA table_info(chunks)")}:  # an index from before `store ls`
            try:
                db.execute("ALTER TABLE chunks ADD COLUMN prev TEXT NOT NULL DEFAULT ''")
            except sqlite3.OperationalError as e:  # another process added it first
                if "duplicate" not in str(e):
                    raise

    def _quarantine(self, why: str) -> None:
        self._drop_connection()
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f"-{os.getpid()}"
        for suffix in ("", "-wal", "-shm"):
            src = self.root / (INDEX + suffix)
            with contextlib.suppress(FileNotFoundError):
                os.replace(src, self.root / f"{INDEX}{suffix}.corrupt-{stamp}")
        log.error(
            "store index %s is unreadable (%s): moved aside as %s.corrupt-%s; rebuilding it from the blobs",
            self.root / INDEX,
            why,
            INDEX,
            stamp,
        )

    @contextmanager
    def _write(self, d: Deadline | None = None) -> Iterator[sqlite3.Connection]:
        """A transaction holding the store's single write lock from its first statement."""
        with self._bounded(d) as db:
            try:
                db.execute("BEGIN IMMEDIATE")
                try:
                    yield db
                    db.execute("COMMIT")
                except BaseException:
                    db.execute("ROLLBACK")
                    raise
            except sqlite3.Error as e:
                raise StoreError(f"store index {self.root / INDEX}: {e}") from e

    @contextmanager
    def _bounded(self, d: Deadline | None) -> Iterator[sqlite3.Connection]:
        """The connection, with sqlite's lock waits and queries cut off at the deadline ``d``."""
        try:
            db = self._db(d)
        except sqlite3.Error as e:
            if d is not None and d.end is not None and (time.monotonic() >= d.end or "locked" in str(e)):
                raise StoreUnavailable(f"{self.url} did not answer within {d.timeout:.3g} s: {e}") from e
            raise StoreError(f"cannot open store index {self.root / INDEX}: {e}") from e
        if d is None or d.end is None:
            yield db
            return
        end = d.end
        d.left()  # no time left: StoreUnavailable before any statement
        db.execute(f"PRAGMA busy_timeout={max(1, int(1000 * (end - time.monotonic())))}")
        db.set_progress_handler(lambda: time.monotonic() > end, 1000)  # nonzero aborts the statement
        try:
            yield db
        except (sqlite3.Error, StoreError) as e:
            if time.monotonic() >= end or "interrupted" in str(e) or "locked" in str(e):
                raise StoreUnavailable(f"{self.url} did not answer within {d.timeout:.3g} s: {e}") from e
            raise
        finally:
            db.set_progress_handler(None, 0)
            db.execute(f"PRAGMA busy_timeout={int(1000 * self.busy_timeout)}")

    def _query(self, sql: str, args: Sequence = (), d: Deadline | None = None) -> list[tuple]:
        with self._bounded(d) as db:
            try:
                return db.execute(sql, args).fetchall()
            except sqlite3.Error as e:
                raise StoreError(f"store index {self.root / INDEX}: {e}") from e

    @property
    def max_bytes(self) -> int:
        return self._query("SELECT value FROM settings WHERE name='max_bytes'")[0][0]

    # -- writes --------------------------------------------------------------
    def put_chunks(self, writes: Sequence[ChunkWrite]) -> None:
        for w in writes:  # one short transaction per chunk: writers interleave, the lock is never held long
            self._put_one(w)

    def _put_one(self, w: ChunkWrite) -> None:
        check_key(w.key)
        if w.prev:
            check_key(w.prev)
        have = self._levels(w.key)
        staged: dict[int, tuple[Path, int, bytes]] = {}
        try:
            for level, data in w.payloads.items():
                if int(level) not in have:
                    staged[int(level)] = (self._stage(data), len(data), checksum(data))
            now = int(self.clock())
            renamed: list[Path] = []
            try:
                with self._write() as db:
                    have = self._levels(w.key)  # again, under the lock: another process may have won
                    todo = {l: s for l, s in staged.items() if l not in have}
                    if not todo and not have:
                        return  # nothing to store (its levels were evicted meanwhile): no empty row
                    need = sum(size for _, size, _ in todo.values())
                    self._make_room(db, need, keep=w.key)
                    if db.execute("SELECT 1 FROM chunks WHERE key=?", (w.key,)).fetchone():
                        db.execute(
                            # a row rebuilt from the blobs lacks tokens, start and prev: fill them in
                            "UPDATE chunks SET last_access=?, ends_context=MAX(ends_context, ?), "
                            "prev=CASE WHEN prev='' THEN ? ELSE prev END, "
                            "start=CASE WHEN length(tokens)=0 THEN ? ELSE start END, "
                            "tokens=CASE WHEN length(tokens)=0 THEN ? ELSE tokens END WHERE key=?",
                            (now, int(w.ends_context), w.prev, w.start, w.tokens, w.key),
                        )
                    else:
                        db.execute(
                            "INSERT INTO chunks(key, tokens, start, ends_context, created, last_access, prev) "
                            "VALUES (?, ?, ?, ?, ?, ?, ?)",
                            (w.key, w.tokens, w.start, int(w.ends_context), now, now, w.prev),
                        )
                    dirs = set()
                    for level, (tmp, size, digest) in todo.items():
                        name = f"{w.key[:2]}/{w.key}.{level}.{secrets.token_hex(4)}"
                        dst = self.blobs / name
                        dst.parent.mkdir(exist_ok=True)
                        os.replace(tmp, dst)
                        renamed.append(dst)
                        dirs.add(dst.parent)
                        db.execute("INSERT INTO payloads VALUES (?, ?, ?, ?, ?)", (w.key, level, size, digest, name))
                    for d in dirs:
                        _fsync_dir(d)  # the renames are durable before the rows are
                    db.execute("UPDATE settings SET value=value+? WHERE name='bytes'", (need,))
            except BaseException:
                for p in renamed:  # rolled back: the renamed files have no row, remove them
                    p.unlink(missing_ok=True)
                raise
        except OSError as e:
            raise StoreError(f"cannot write chunk {w.key[:16]} to {self.root}: {e}") from e
        finally:
            for tmp, _, _ in staged.values():
                tmp.unlink(missing_ok=True)

    def _stage(self, data: bytes) -> Path:
        """Write ``data`` to a fsynced temporary file (outside any lock)."""
        p = self.tmp / f"{os.getpid()}.{secrets.token_hex(8)}.tmp"
        with open(p, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return p

    def _make_room(self, db: sqlite3.Connection, need: int, keep: str | None = None, cap: int | None = None) -> int:
        """Drop LRU chunks until ``need`` more bytes fit under the cap; must run inside :meth:`_write`."""
        cap = db.execute("SELECT value FROM settings WHERE name='max_bytes'").fetchone()[0] if cap is None else cap
        if need > cap:
            raise StoreError(f"a chunk of {need} bytes does not fit in the store's cap of {cap} bytes")
        total = db.execute("SELECT value FROM settings WHERE name='bytes'").fetchone()[0]
        dropped = 0
        while total + need > cap:
            # oldest first; on a tie the later chunk of a context goes first, so prefixes stay usable
            victims = db.execute(
                "SELECT key FROM chunks WHERE key != ? ORDER BY last_access, start DESC LIMIT 32", (keep or "",)
            ).fetchall()
            if not victims:
                raise StoreError(f"cannot free {need} bytes under the cap of {cap} bytes")
            for (key,) in victims:
                total -= self._drop(db, key)
                dropped += 1
                if total + need <= cap:
                    break
        return dropped

    def _unlink_blob(self, name: str, key: str, level: int | None = None) -> None:
        """Delete a blob named by the index, only if the name is one of ours for that chunk."""
        if blob_name_ok(name, key, level):
            (self.blobs / name).unlink(missing_ok=True)
        else:
            log.warning(
                "store index %s names %r for chunk %s: not a blob name of this store, left alone",
                self.root / INDEX,
                name,
                key[:16],
            )

    def _drop(self, db: sqlite3.Connection, key: str) -> int:
        """Delete a chunk's rows and files (inside a write transaction); returns bytes freed."""
        rows = db.execute("SELECT size, file, level FROM payloads WHERE key=?", (key,)).fetchall()
        for _, name, level in rows:
            self._unlink_blob(name, key, level)
        freed = sum(size for size, _, _ in rows)
        db.execute("DELETE FROM payloads WHERE key=?", (key,))
        db.execute("DELETE FROM chunks WHERE key=?", (key,))
        db.execute("UPDATE settings SET value=value-? WHERE name='bytes'", (freed,))
        return freed

    # -- reads ---------------------------------------------------------------
    def _levels(self, key: str) -> set[int]:
        return {l for (l,) in self._query("SELECT level FROM payloads WHERE key=?", (key,))}

    def sizes_many(self, keys: Sequence[str], *, timeout: float | None = None) -> list[dict[int, int]]:
        d = Deadline(timeout)
        out: dict[str, dict[int, int]] = {k: {} for k in keys}
        for i in range(0, len(keys), 500):
            part = list(keys[i : i + 500])
            q = f"SELECT key, level, size FROM payloads WHERE key IN ({','.join('?' * len(part))})"
            for key, level, size in self._query(q, part, d):
                out[key][level] = size
        return [dict(out[k]) for k in keys]

    def tokens(self, key: str) -> bytes:
        row = self._query("SELECT tokens FROM chunks WHERE key=?", (key,))
        if not row:
            raise ChunkNotFound(f"chunk {key[:16]} is not in {self.url}")
        return bytes(row[0][0])

    def get_many(self, items: Sequence[tuple[str, int]], *, timeout: float | None = None) -> list[bytes]:
        d = Deadline(timeout)
        out = []
        now = int(self.clock())
        stale = set()
        for key, level in items:
            d.left()
            row = self._query(
                "SELECT p.size, p.checksum, p.file, c.last_access FROM payloads p JOIN chunks c USING (key) "
                "WHERE p.key=? AND p.level=?",
                (key, level),
                d,
            )
            if not row:
                raise ChunkNotFound(f"chunk {key[:16]} level {level} is not in {self.url}")
            size, digest, name, last = row[0]
            if not blob_name_ok(name, key, level):
                self._discard(key, level, name)
                raise CorruptChunk(f"chunk {key[:16]} level {level} in {self.url} has a bad file name in the index")
            try:
                data = _read_regular(self.blobs / name)
            except FileNotFoundError:  # evicted or cleared since the row was read, or deleted by hand
                self._discard(key, level, name)
                raise ChunkNotFound(f"chunk {key[:16]} level {level} was evicted from {self.url}") from None
            except OSError as e:
                raise StoreError(f"cannot read chunk {key[:16]} level {level}: {e}") from e
            if data is None or len(data) != size or not verify(bytes(digest), data):
                self._discard(key, level, name)
                raise CorruptChunk(f"chunk {key[:16]} level {level} in {self.url} fails its checksum")
            if last < now:
                stale.add(key)
            out.append(data)
        if stale and not d.expired:  # with a deadline, never wait for the lock just to note an access
            self._touch(stale, now, None if d.end is None else Deadline(min(d.left() or 0.0, 0.01)))
        return out

    def _touch(self, keys: set[str], now: int, d: Deadline | None) -> None:
        """Record an access for LRU (at most once a second per chunk, to keep readers mostly read-only)."""
        try:
            with self._write(d) as db:
                db.executemany(
                    "UPDATE chunks SET last_access=MAX(last_access, ?) WHERE key=?", [(now, k) for k in keys]
                )
        except StoreError:
            pass  # a busy index (or no time left) only costs LRU precision

    def _discard(self, key: str, level: int, name: str) -> None:
        """Forget a corrupt or missing payload so that it is recomputed and stored again."""
        try:
            with self._write() as db:
                row = db.execute(
                    "SELECT size FROM payloads WHERE key=? AND level=? AND file=?", (key, level, name)
                ).fetchone()
                if row:
                    db.execute("DELETE FROM payloads WHERE key=? AND level=?", (key, level))
                    db.execute("UPDATE settings SET value=value-? WHERE name='bytes'", (row[0],))
                    if not db.execute("SELECT 1 FROM payloads WHERE key=?", (key,)).fetchone():
                        db.execute("DELETE FROM chunks WHERE key=?", (key,))  # no level left: no chunk
                    self._unlink_blob(name, key, level)
        except (StoreError, OSError):
            pass

    # -- settings --------------------------------------------------------------
    def get_setting(self, name: str, *, timeout: float | None = None) -> str | None:
        row = self._query("SELECT value FROM meta WHERE name=?", (name,), Deadline(timeout))
        return row[0][0] if row else None

    def claim_setting(self, name: str, value: str) -> str:
        with self._write() as db:
            db.execute("INSERT OR IGNORE INTO meta VALUES (?, ?)", (name, value))
            return db.execute("SELECT value FROM meta WHERE name=?", (name,)).fetchone()[0]

    # -- contexts ----------------------------------------------------------------
    def chunk_rows(self) -> list[ChunkRow]:
        sizes: dict[str, dict[int, int]] = {}
        for key, level, size in self._query("SELECT key, level, size FROM payloads"):
            sizes.setdefault(key, {})[level] = size
        rows = self._query("SELECT key, start, length(tokens), prev, ends_context FROM chunks")
        return [ChunkRow(k, s, n // 4, p, bool(e), sizes[k]) for k, s, n, p, e in rows if k in sizes]

    def delete_chunks(self, keys: Sequence[str]) -> int:
        n = 0
        with self._write() as db:
            for key in keys:
                if db.execute("SELECT 1 FROM chunks WHERE key=?", (key,)).fetchone():
                    self._drop(db, key)
                    n += 1
        return n

    def unmark_end(self, key: str) -> None:
        with self._write() as db:
            db.execute("UPDATE chunks SET ends_context=0 WHERE key=?", (key,))

    # -- maintenance ---------------------------------------------------------
    def stats(self) -> StoreStats:
        s = StoreStats()
        with_payload = "key IN (SELECT key FROM payloads)"
        s.chunks = self._query(f"SELECT COUNT(*) FROM chunks WHERE {with_payload}")[0][0]
        s.contexts = self._query(f"SELECT COUNT(*) FROM chunks WHERE ends_context=1 AND {with_payload}")[0][0]
        rows = self._query("SELECT level, COUNT(*), SUM(size) FROM payloads GROUP BY level")
        for level, n, total in rows:
            s.levels[level] = LevelStats(n, total)
            s.bytes += total
        return s

    def evict(self, max_bytes: int | None = None) -> int:
        with self._write() as db:
            cap = self.max_bytes if max_bytes is None else max_bytes
            dropped = self._make_room(db, 0, cap=cap)
            self._collect_garbage(db)
        return dropped

    def _blob_files(self) -> Iterator[tuple[str, Path]]:
        """``(name, path)`` of every file in ``blobs/`` with this store's name pattern (nothing else)."""
        try:
            subdirs = [p for p in self.blobs.iterdir() if len(p.name) == 2 and p.is_dir() and not p.is_symlink()]
        except FileNotFoundError:
            return
        for sub in subdirs:
            for p in sub.iterdir():
                name = f"{sub.name}/{p.name}"
                if blob_name_ok(name):
                    yield name, p

    def _collect_garbage(self, db: sqlite3.Connection) -> None:
        """Remove files of ours that no committed row names (crashed writers). Runs under the write lock,
        when no writer can be between its rename and its commit; not while the index is being rebuilt."""
        if db.execute("SELECT 1 FROM settings WHERE name='rebuilding'").fetchone():
            return
        known = {name for (name,) in db.execute("SELECT file FROM payloads")}
        for name, p in self._blob_files():
            if name not in known:
                with contextlib.suppress(OSError):  # a directory, or a file we may not remove: not ours to force
                    p.unlink()
        cutoff = self.clock() - TMP_MAX_AGE_S
        for p in self.tmp.iterdir():
            if not _TMP_NAME.fullmatch(p.name):
                continue
            pid = p.name.split(".", 1)[0]
            try:
                if not _alive(int(pid)) or p.stat().st_mtime < cutoff:
                    p.unlink(missing_ok=True)
            except OSError:
                pass

    def clear(self) -> int:
        with self._write() as db:
            n = db.execute("SELECT COUNT(*) FROM chunks").fetchone()[0]
            db.execute("DELETE FROM payloads")
            db.execute("DELETE FROM chunks")
            db.execute("DELETE FROM meta WHERE name LIKE 'chunk_tokens:%'")  # an empty store takes any chunk size
            db.execute("UPDATE settings SET value=0 WHERE name='bytes'")
            self._collect_garbage(db)
        return n

    # -- rebuilding a lost index -------------------------------------------------
    def _resume_rebuild(self) -> None:
        """Start (or take over from a dead process) the rebuild of the index from the blobs."""
        row = self._query("SELECT value FROM settings WHERE name='rebuilding'")
        if not row:
            return
        pid = int(row[0][0])
        if pid != os.getpid() and _alive(pid):
            return  # another live process is rebuilding it
        with _REBUILDS_LOCK:
            t = _REBUILDS.get(self.root)
            if t is not None and t.is_alive():
                return
            with self._write() as db:
                db.execute("UPDATE settings SET value=? WHERE name='rebuilding'", (os.getpid(),))
            t = threading.Thread(target=self._rebuild, name=f"cachegen-rebuild-{self.root.name}", daemon=True)
            _REBUILDS[self.root] = t
            t.start()

    def wait_rebuilt(self, timeout: float | None = None) -> bool:
        """Wait for a rebuild of the index started by this process; True once none is running."""
        t = _REBUILDS.get(self.root)
        if t is not None:
            t.join(timeout)
        return not self._query("SELECT 1 FROM settings WHERE name='rebuilding'")

    def _rebuild(self) -> None:
        """Index every blob the index does not know. Token ids and context marks were only in the old
        index: rebuilt chunks load, but ``store ls`` cannot list them and their tokens read as empty."""
        try:
            known = {name for (name,) in self._query("SELECT file FROM payloads")}
            found = [(n, p) for n, p in self._blob_files() if n not in known]
            log.info("rebuilding the index of %s from %d blobs", self.root, len(found))
            added = 0
            for i in range(0, len(found), 64):
                batch = []
                for name, p in found[i : i + 64]:
                    try:
                        data = _read_regular(p)
                        mtime = int(p.stat().st_mtime)
                    except OSError:
                        continue
                    if data is not None:
                        m = _BLOB_NAME.fullmatch(name)
                        assert m is not None
                        batch.append((m.group(2), int(m.group(3)), len(data), checksum(data), name, mtime))
                with self._write() as db:
                    for key, level, size, digest, name, mtime in batch:
                        if db.execute("SELECT 1 FROM payloads WHERE key=? AND level=?", (key, level)).fetchone():
                            continue  # written again meanwhile: this copy is an orphan, collected below
                        db.execute(
                            "INSERT OR IGNORE INTO chunks(key, tokens, start, ends_context, created, "
                            "last_access) VALUES (?, x'', 0, 0, ?, ?)",
                            (key, mtime, mtime),
                        )
                        db.execute("INSERT INTO payloads VALUES (?, ?, ?, ?, ?)", (key, level, size, digest, name))
                        db.execute("UPDATE settings SET value=value+? WHERE name='bytes'", (size,))
                        added += 1
            with self._write() as db:
                db.execute("DELETE FROM settings WHERE name='rebuilding'")
                self._make_room(db, 0)
                self._collect_garbage(db)
            log.info("rebuilt the index of %s: %d payloads recovered", self.root, added)
        except Exception:  # the next open resumes it; meanwhile loads recompute
            log.exception("rebuilding the index of %s failed", self.root)
        finally:
            self._drop_connection()

    def close(self) -> None:
        t = _REBUILDS.get(self.root)
        if t is not None and t.is_alive() and t is not threading.current_thread():
            t.join()  # finish the rebuild: a command that exits meanwhile would leave it for the next open
        self._drop_connection()


def _read_regular(path: Path) -> bytes | None:
    """The file's bytes, or ``None`` if it is not a regular file (a FIFO or device placed there
    must neither block the reader nor be read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        if e.errno == errno.ELOOP:  # a symlink placed in the store
            return None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OverflowError:
        return False
    return True
