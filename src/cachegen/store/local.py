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
* Every read checks the payload's size and blake2b checksum from the index.
"""

from __future__ import annotations

import os
import secrets
import sqlite3
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from cachegen.errors import ChunkNotFound, ConfigError, CorruptChunk, StoreError
from cachegen.store.backend import Backend, ChunkWrite, LevelStats, StoreStats, checksum
from cachegen.store.keys import check_key

DEFAULT_MAX_BYTES = 10 << 30
INDEX = "index.sqlite3"
TMP_MAX_AGE_S = 3600  # a temporary file this old belongs to a dead writer

_SCHEMA = """
CREATE TABLE IF NOT EXISTS chunks(
    key TEXT PRIMARY KEY, tokens BLOB NOT NULL, start INTEGER NOT NULL,
    ends_context INTEGER NOT NULL DEFAULT 0, created INTEGER NOT NULL, last_access INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS chunks_lru ON chunks(last_access, start DESC);
CREATE TABLE IF NOT EXISTS payloads(
    key TEXT NOT NULL, level INTEGER NOT NULL, size INTEGER NOT NULL, checksum BLOB NOT NULL,
    file TEXT NOT NULL, PRIMARY KEY(key, level));
CREATE TABLE IF NOT EXISTS settings(name TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO settings VALUES ('bytes', 0);
"""


class LocalBackend(Backend):
    """``file://PATH``: a directory holding ``index.sqlite3``, ``blobs/`` and ``tmp/``."""

    def __init__(self, root: str | os.PathLike, max_bytes: int | None = None, busy_timeout: float = 30.0):
        self.root = Path(root).expanduser().resolve()
        self.url = f"file://{self.root}"
        self.blobs = self.root / "blobs"
        self.tmp = self.root / "tmp"
        self.busy_timeout = busy_timeout
        self._local = threading.local()
        try:
            if max_bytes is not None and max_bytes <= 0:
                raise ConfigError("max_bytes must be positive")
            for d in (self.root, self.blobs, self.tmp):
                d.mkdir(parents=True, exist_ok=True)
            with self._write() as db:
                db.execute("INSERT OR IGNORE INTO settings VALUES ('max_bytes', ?)", (max_bytes or DEFAULT_MAX_BYTES,))
                if max_bytes is not None:  # the cap belongs to the store, so every process enforces the same one
                    db.execute("UPDATE settings SET value=? WHERE name='max_bytes'", (max_bytes,))
                    self._make_room(db, 0)  # a lowered cap holds from now on
        except OSError as e:
            raise StoreError(f"cannot open store at {self.root}: {e}") from e

    # -- connection and transactions -----------------------------------------
    def _db(self) -> sqlite3.Connection:
        """One connection per thread and process (a forked child must not reuse its parent's)."""
        db = getattr(self._local, "db", None)
        if db is None or self._local.pid != os.getpid():
            # switching a new index to WAL needs an exclusive lock that sqlite's busy timeout does not
            # wait for: two processes opening a new store at once saw "database is locked" at once
            give_up = time.monotonic() + self.busy_timeout
            while True:
                db = None
                try:
                    db = sqlite3.connect(self.root / INDEX, timeout=self.busy_timeout, isolation_level=None)
                    db.execute("PRAGMA journal_mode=WAL")
                    db.execute("PRAGMA synchronous=NORMAL")
                    db.executescript(_SCHEMA)
                    break
                except sqlite3.Error as e:
                    if db is not None:
                        db.close()
                    if "locked" not in str(e) or time.monotonic() > give_up:
                        raise StoreError(f"cannot open store index {self.root / INDEX}: {e}") from e
                    time.sleep(0.01)
            self._local.db, self._local.pid = db, os.getpid()
        return db

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """A transaction holding the store's single write lock from its first statement."""
        db = self._db()
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

    def _query(self, sql: str, args: Sequence = ()) -> list[tuple]:
        try:
            return self._db().execute(sql, args).fetchall()
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
        have = self._levels(w.key)
        staged: dict[int, tuple[Path, int, bytes]] = {}
        try:
            for level, data in w.payloads.items():
                if int(level) not in have:
                    staged[int(level)] = (self._stage(data), len(data), checksum(data))
            now = int(time.time())
            renamed: list[Path] = []
            try:
                with self._write() as db:
                    have = self._levels(w.key)  # again, under the lock: another process may have won
                    todo = {l: s for l, s in staged.items() if l not in have}
                    need = sum(size for _, size, _ in todo.values())
                    self._make_room(db, need, keep=w.key)
                    if db.execute("SELECT 1 FROM chunks WHERE key=?", (w.key,)).fetchone():
                        db.execute(
                            "UPDATE chunks SET last_access=?, ends_context=MAX(ends_context, ?) WHERE key=?",
                            (now, int(w.ends_context), w.key),
                        )
                    else:
                        db.execute(
                            "INSERT INTO chunks VALUES (?, ?, ?, ?, ?, ?)",
                            (w.key, w.tokens, w.start, int(w.ends_context), now, now),
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

    def _drop(self, db: sqlite3.Connection, key: str) -> int:
        """Delete a chunk's rows and files (inside a write transaction); returns bytes freed."""
        rows = db.execute("SELECT size, file FROM payloads WHERE key=?", (key,)).fetchall()
        for _, name in rows:
            (self.blobs / name).unlink(missing_ok=True)
        freed = sum(size for size, _ in rows)
        db.execute("DELETE FROM payloads WHERE key=?", (key,))
        db.execute("DELETE FROM chunks WHERE key=?", (key,))
        db.execute("UPDATE settings SET value=value-? WHERE name='bytes'", (freed,))
        return freed

    # -- reads ---------------------------------------------------------------
    def _levels(self, key: str) -> set[int]:
        return {l for (l,) in self._query("SELECT level FROM payloads WHERE key=?", (key,))}

    def sizes_many(self, keys: Sequence[str]) -> list[dict[int, int]]:
        out: dict[str, dict[int, int]] = {k: {} for k in keys}
        for i in range(0, len(keys), 500):
            part = list(keys[i : i + 500])
            q = f"SELECT key, level, size FROM payloads WHERE key IN ({','.join('?' * len(part))})"
            for key, level, size in self._query(q, part):
                out[key][level] = size
        return [dict(out[k]) for k in keys]

    def tokens(self, key: str) -> bytes:
        row = self._query("SELECT tokens FROM chunks WHERE key=?", (key,))
        if not row:
            raise ChunkNotFound(f"chunk {key[:16]} is not in {self.url}")
        return bytes(row[0][0])

    def get_many(self, items: Sequence[tuple[str, int]]) -> list[bytes]:
        out = []
        now = int(time.time())
        stale = set()
        for key, level in items:
            row = self._query(
                "SELECT p.size, p.checksum, p.file, c.last_access FROM payloads p JOIN chunks c USING (key) "
                "WHERE p.key=? AND p.level=?",
                (key, level),
            )
            if not row:
                raise ChunkNotFound(f"chunk {key[:16]} level {level} is not in {self.url}")
            size, digest, name, last = row[0]
            try:
                with open(self.blobs / name, "rb") as f:
                    data = f.read()
            except FileNotFoundError:  # evicted or cleared since the row was read
                raise ChunkNotFound(f"chunk {key[:16]} level {level} was evicted from {self.url}") from None
            except OSError as e:
                raise StoreError(f"cannot read chunk {key[:16]} level {level}: {e}") from e
            if len(data) != size or checksum(data) != bytes(digest):
                self._discard(key, level, name)
                raise CorruptChunk(f"chunk {key[:16]} level {level} in {self.url} fails its checksum")
            if last < now:
                stale.add(key)
            out.append(data)
        if stale:
            self._touch(stale, now)
        return out

    def _touch(self, keys: set[str], now: int) -> None:
        """Record an access for LRU (at most once a second per chunk, to keep readers mostly read-only)."""
        try:
            with self._write() as db:
                db.executemany("UPDATE chunks SET last_access=MAX(last_access, ?) WHERE key=?", [(now, k) for k in keys])
        except StoreError:
            pass  # a busy index only costs LRU precision

    def _discard(self, key: str, level: int, name: str) -> None:
        """Forget a corrupt payload so that it is recomputed and stored again."""
        try:
            with self._write() as db:
                row = db.execute("SELECT size FROM payloads WHERE key=? AND level=? AND file=?", (key, level, name)).fetchone()
                if row:
                    db.execute("DELETE FROM payloads WHERE key=? AND level=?", (key, level))
                    db.execute("UPDATE settings SET value=value-? WHERE name='bytes'", (row[0],))
                    (self.blobs / name).unlink(missing_ok=True)
        except (StoreError, OSError):
            pass

    # -- maintenance ---------------------------------------------------------
    def stats(self) -> StoreStats:
        s = StoreStats()
        s.chunks = self._query("SELECT COUNT(*) FROM chunks")[0][0]
        s.contexts = self._query("SELECT COUNT(*) FROM chunks WHERE ends_context=1")[0][0]
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

    def _collect_garbage(self, db: sqlite3.Connection) -> None:
        """Remove files no committed row names (crashed writers). Runs under the write lock, when no
        writer can be between its rename and its commit."""
        known = {name for (name,) in db.execute("SELECT file FROM payloads")}
        for p in self.blobs.glob("*/*"):
            if f"{p.parent.name}/{p.name}" not in known:
                p.unlink(missing_ok=True)
        cutoff = time.time() - TMP_MAX_AGE_S
        for p in self.tmp.iterdir():
            pid = p.name.split(".", 1)[0]
            try:
                dead = not pid.isdigit() or not _alive(int(pid)) or p.stat().st_mtime < cutoff
                if dead:
                    p.unlink(missing_ok=True)
            except OSError:
                pass

    def clear(self) -> int:
        with self._write() as db:
            n = db.execute("SELECT COUNT(*) FROM chunks").fetchone()[0]
            db.execute("DELETE FROM payloads")
            db.execute("DELETE FROM chunks")
            db.execute("UPDATE settings SET value=0 WHERE name='bytes'")
            self._collect_garbage(db)
        return n

    def close(self) -> None:
        db = getattr(self._local, "db", None)
        if db is not None and self._local.pid == os.getpid():
            db.close()
        self._local = threading.local()


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
    return True
