"""Store calls hold the caller's deadline: a paused (SIGSTOP) or sleeping (DEBUG SLEEP) real
redis-server, or a locked local index, costs ``timeout`` and a ``StoreUnavailable``, never more.

The bounds asserted are the point of the feature (the URL's socket timeout is 5 s; the calls get
0.3 s), with wide margins for a loaded machine: they are not speed measurements."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import threading
import time

import pytest
from store_helpers import NS, RawEncoder, make_kv

from cachegen.errors import ConfigError, StoreUnavailable
from cachegen.store import ContextStore, open_backend

CALL_TIMEOUT = 0.3
BOUND = 2.0  # well under the 5 s socket timeout the calls would otherwise wait


def stored(url: str) -> tuple[ContextStore, list[int]]:
    cs = ContextStore(open_backend(url), NS, RawEncoder(), chunk_tokens=16)
    toks = list(range(900, 964))
    cs.put_context(toks, make_kv(64, seed=9))
    return cs, toks


def bounded(call) -> float:
    """Seconds ``call`` took to raise StoreUnavailable."""
    t = time.monotonic()
    with pytest.raises(StoreUnavailable):
        call()
    return time.monotonic() - t


def reads(cs: ContextStore, toks):
    refs = cs.refs(toks)
    return [
        lambda: cs.plan(toks, timeout=CALL_TIMEOUT),
        lambda: cs.lookup(toks, timeout=CALL_TIMEOUT),
        lambda: cs.get(refs[0], 0, timeout=CALL_TIMEOUT),
        lambda: cs.get_many([(r, 1) for r in refs], timeout=CALL_TIMEOUT),
    ]


@pytest.mark.redis
def test_paused_redis_costs_the_timeout_not_the_socket_timeout(redis_factory):
    srv = redis_factory()
    cs, toks = stored(srv.url)  # the URL's socket timeout: the default 5 s
    want = [i.sizes for i in cs.plan(toks)]
    os.kill(srv.pid(), signal.SIGSTOP)
    try:
        took = [bounded(call) for call in reads(cs, toks)]
    finally:
        os.kill(srv.pid(), signal.SIGCONT)
    assert max(took) < BOUND, took
    assert [i.sizes for i in cs.plan(toks, timeout=10)] == want  # and it recovers once the server does
    assert cs.get(cs.refs(toks)[0], 0, timeout=10) == RawEncoder().encode(
        make_kv(64, seed=9).slice(0, 16), 0, key=cs.refs(toks)[0].key
    )


@pytest.mark.redis
def test_sleeping_redis_costs_the_timeout(redis_factory):
    srv = redis_factory()
    cs, toks = stored(srv.url)
    want = [i.sizes for i in cs.plan(toks)]
    sleeper = subprocess.Popen(
        [srv.cli, "-h", "127.0.0.1", "-p", str(srv.port), "DEBUG", "SLEEP", "3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        took = []
        for _ in range(100):  # until the server is asleep (the DEBUG command has to arrive first)
            t = time.monotonic()
            try:
                cs.plan(toks, timeout=CALL_TIMEOUT)
            except StoreUnavailable:
                took.append(time.monotonic() - t)
                break
        assert took, "DEBUG SLEEP never stalled the server"
        took += [bounded(call) for call in reads(cs, toks)]
        assert max(took) < BOUND, took
    finally:
        out, err = sleeper.communicate(timeout=30)
    assert sleeper.returncode == 0 and b"OK" in out, err
    assert [i.sizes for i in cs.plan(toks, timeout=10)] == want


@pytest.mark.redis
def test_no_time_left_fails_at_once(any_url):
    cs, toks = stored(any_url)
    for t in (0, -1.0):
        for call in (
            lambda t=t: cs.plan(toks, timeout=t),
            lambda t=t: cs.get(cs.refs(toks)[0], 0, timeout=t),
            lambda t=t: cs.backend.get_many([(cs.refs(toks)[0].key, 0)], timeout=t),
        ):
            with pytest.raises(StoreUnavailable, match="ran out"):
                call()
    assert cs.lookup(toks, timeout=30) == 64


def test_timeouts_of_zero_or_less_are_rejected_in_urls():
    for bad in ("0", "0.0", "-1", "nan", "inf"):
        with pytest.raises(ConfigError, match="timeout"):
            open_backend(f"redis://127.0.0.1:6379/0?timeout={bad}")
    assert open_backend("redis://127.0.0.1:6379/0?timeout=0.01")._kw["socket_timeout"] == 0.01


def test_locked_local_index_costs_the_timeout(tmp_path):
    cs, toks = stored(f"file://{tmp_path / 'store'}")
    want = [i.sizes for i in cs.plan(toks)]
    cs.backend.close()
    locker = sqlite3.connect(tmp_path / "store" / "index.sqlite3", isolation_level=None)
    locker.execute("PRAGMA locking_mode=EXCLUSIVE")  # in WAL mode this shuts readers out too
    locker.execute("BEGIN EXCLUSIVE")
    locker.execute("UPDATE settings SET value=value WHERE name='bytes'")
    took: list[float] = []
    errors: list[BaseException] = []

    def run():  # a fresh thread: a new connection, which must wait for the lock
        try:
            took.extend(bounded(call) for call in reads(cs, toks))
        except BaseException as e:  # reported below
            errors.append(e)

    th = threading.Thread(target=run)
    th.start()
    th.join(60)
    locker.execute("ROLLBACK")
    locker.close()
    assert not errors and len(took) == 4 and max(took) < BOUND, (errors, took)  # the busy timeout is 30 s
    assert [i.sizes for i in cs.plan(toks, timeout=10)] == want


def test_a_writer_holding_the_lock_does_not_delay_local_reads(tmp_path):
    """Readers only skip their access-time update when a writer holds the lock (the LRU loses a tick)."""
    cs, toks = stored(f"file://{tmp_path / 'store'}")
    with cs.backend._write() as db:
        db.execute("UPDATE chunks SET last_access=0")
    writer = sqlite3.connect(tmp_path / "store" / "index.sqlite3", isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")
    try:
        t = time.monotonic()
        data = cs.get_many([(r, 0) for r in cs.refs(toks)], timeout=10)
        took = time.monotonic() - t
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    assert len(data) == 4 and took < BOUND  # it did not wait (up to its 10 s) for the writer
    assert cs.backend._query("SELECT MAX(last_access) FROM chunks")[0][0] == 0  # no update while locked
