"""Redis and Redis Cluster: atomic chunks, TTL, crashes, concurrent writers, and failures."""

from __future__ import annotations

import contextlib
import hashlib
import random
import signal
import socket
import threading
import time

import pytest
from store_helpers import check_one_copy, ingest_twice, spawn

from cachegen.errors import ChunkNotFound, ConfigError, CorruptChunk, StoreError, StoreUnavailable
from cachegen.store import ChunkWrite, open_backend
from cachegen.store.redis_backend import RedisBackend
from store.servers import create_cluster

pytestmark = pytest.mark.redis


def key(i: int) -> str:
    return f"{i:064x}"


@pytest.fixture(params=["redis", "cluster"])
def url(request):
    return request.getfixturevalue("redis_url" if request.param == "redis" else "cluster_url")


def raw_client(url: str):
    b = open_backend(url)
    return b.client


def test_one_slot_per_chunk_and_ttl(url):
    b = open_backend(url + "?ttl=100")
    b.put_chunks([ChunkWrite(key(1), b"\x05\x00\x00\x00", {0: b"a" * 10, 3: b"b" * 7}, start=32, ends_context=True)])
    c = b.client
    names = sorted(n.decode() for n in c.scan_iter(match="cg:*"))
    assert names == sorted(f"cg:{{{key(1)}}}:{s}" for s in ("m", "t", "0", "3"))
    assert 90 < c.ttl(names[0]) <= 100 and all(c.ttl(n) > 0 for n in names)
    assert b.sizes(key(1)) == {0: 10, 3: 7} and b.tokens(key(1)) == b"\x05\x00\x00\x00"
    # adding a level refreshes the TTL of the levels already there
    c.expire(f"cg:{{{key(1)}}}:0", 5)
    b.put_chunks([ChunkWrite(key(1), b"\x05\x00\x00\x00", {1: b"c"})])
    assert c.ttl(f"cg:{{{key(1)}}}:0") > 90
    assert b.stats().to_json() == {
        "contexts": 1,
        "chunks": 1,
        "bytes": 18,
        "levels": {"0": {"chunks": 1, "bytes": 10}, "1": {"chunks": 1, "bytes": 1}, "3": {"chunks": 1, "bytes": 7}},
    }
    assert open_backend(url).evict(max_bytes=0) == 1 and b.stats().chunks == 0


def test_corrupt_payload_is_detected(url):
    b = open_backend(url)
    b.put_chunk(key(1), b"", {0: b"payload"})
    name = f"cg:{{{key(1)}}}:0"
    value = b.client.get(name)
    b.client.set(name, value[:-1] + b"X")
    with pytest.raises(CorruptChunk):
        b.get(key(1), 0)
    b.client.set(name, b"short")
    with pytest.raises(CorruptChunk):
        b.get(key(1), 0)
    with pytest.raises(ChunkNotFound):
        b.get(key(2), 0)


def test_values_written_with_blake2b_still_read(url):
    """A value is the payload's CRC-32 and the payload; one written before CRC-32 began with its
    blake2b-128, and still reads (and fails when the payload does not match it)."""
    b = open_backend(url)
    b.put_chunk(key(1), b"", {0: b"payload"})
    name = f"cg:{{{key(1)}}}:0"
    assert len(b.client.get(name)) == 4 + len(b"payload")
    legacy = hashlib.blake2b(b"payload", digest_size=16).digest()
    b.client.set(name, legacy + b"payload")
    assert b.get(key(1), 0) == b"payload"
    b.client.set(name, legacy + b"paylaod")
    with pytest.raises(CorruptChunk):
        b.get(key(1), 0)


def test_sigkill_during_writes_leaves_no_torn_entry(url):
    rng = random.Random(1)
    for rnd in range(3):
        p = spawn("writer", url, rnd * 1000, 10_000, 200_000)
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
        time.sleep(rng.uniform(0.1, 0.4))
        p.send_signal(signal.SIGKILL)
        p.wait()
    b = open_backend(url)
    metas = b._metas()
    assert metas
    for k, _ in metas:
        sizes = b.sizes(k)
        assert sizes.keys() == {0, 1, 2}  # a chunk is visible with all its levels or not at all
        assert [len(x) for x in b.get_many([(k, l) for l in sizes])] == list(sizes.values())


def test_two_processes_ingesting_the_same_context(url, tmp_path):
    ingest_twice(url, tmp_path)
    check_one_copy(url)


def test_bad_urls():
    for bad in (
        "redis://127.0.0.1:1/x",
        "redis+cluster://127.0.0.1:1/3",
        "redis://127.0.0.1:1/0?timeout=abc",
        "redis://127.0.0.1:1/0?nope=1",
        "s3://bucket",
        "file://",
    ):
        with pytest.raises(ConfigError):
            open_backend(bad)
    b = open_backend("redis://127.0.0.1:6390/2?timeout=0.25&ttl=60&retries=1")
    assert isinstance(b, RedisBackend) and (b.db, b.ttl, b._kw["socket_timeout"]) == (2, 60, 0.25)


# -- a Redis that goes away --------------------------------------------------------


def _payload(i: int, size: int) -> bytes:
    """Chunk i's payload: random bytes the test can recompute, so reads are compared by value."""
    return random.Random(i).randbytes(size)


def _filled(url: str, n: int = 8, size: int = 1 << 20) -> tuple[RedisBackend, list[tuple[str, int]]]:
    b = open_backend(url + "?timeout=0.5")
    b.put_chunks([ChunkWrite(key(i), b"", {0: _payload(i, size)}) for i in range(n)])
    return b, [(key(i), 0) for i in range(n)]


def test_killed_server_raises_store_unavailable(redis_factory):
    srv = redis_factory()
    b, items = _filled(srv.url)
    assert b.get_many(items) == [_payload(i, 1 << 20) for i in range(8)]
    srv.kill()
    t = time.monotonic()
    for call in (
        lambda: b.get_many(items),
        lambda: b.sizes(key(0)),
        lambda: b.put_chunk(key(9), b"", {0: b"x"}),
        lambda: b.stats(),
    ):
        with pytest.raises(StoreUnavailable, match="cannot"):
            call()
    assert time.monotonic() - t < 5
    assert issubclass(StoreUnavailable, StoreError)


def test_paused_server_times_out(redis_factory):
    srv = redis_factory()
    b, items = _filled(srv.url, n=1, size=10)
    b.get_many(items)
    srv.command("client", "pause", "3000", "ALL")
    t = time.monotonic()
    with pytest.raises(StoreUnavailable):
        b.get_many(items)
    assert time.monotonic() - t < 2  # ?timeout=0.5, no retries


class CuttingProxy:
    """Forwards to Redis, but drops the connection after ``limit`` bytes of replies: a server that
    goes away in the middle of a read."""

    def __init__(self, port: int, limit: int):
        self.port, self.limit = port, limit
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.url = f"redis://127.0.0.1:{self.sock.getsockname()[1]}/0"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.port))
            threading.Thread(target=self._pipe, args=(client, upstream, None), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, self.limit), daemon=True).start()

    @staticmethod
    def _pipe(src, dst, limit):
        sent = 0
        try:
            while data := src.recv(65536):
                if limit is not None and sent + len(data) > limit:
                    dst.sendall(data[: limit - sent])
                    break
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self):
        self.sock.close()


def test_connection_cut_mid_reply_raises_store_unavailable(redis_url):
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    _, items = _filled(redis_url, n=4, size=256 << 10)
    proxy = CuttingProxy(port, limit=300 << 10)  # the reply to 4 pipelined gets is ~1 MiB
    try:
        b = open_backend(proxy.url + "?timeout=2")
        with pytest.raises(StoreUnavailable):
            b.get_many(items)
        b2 = open_backend(proxy.url + "?timeout=2")
        assert b2.get(*items[0]) == _payload(0, 256 << 10)  # a reply that fits is whole and verified
    finally:
        proxy.close()


def test_unreachable_store(redis_factory):
    srv = redis_factory()
    srv.kill()
    for url in (srv.url + "?timeout=0.2", f"redis+cluster://127.0.0.1:{srv.port}?timeout=0.2"):
        with pytest.raises(StoreUnavailable):
            open_backend(url).sizes(key(1))


def test_cluster_node_killed_mid_use(redis_factory):
    nodes = [redis_factory(cluster=True) for _ in range(3)]
    create_cluster(nodes)
    b, items = _filled(f"redis+cluster://127.0.0.1:{nodes[0].port}", n=30, size=100)
    assert b.get_many(items) == [_payload(i, 100) for i in range(30)]
    nodes[1].kill()
    with pytest.raises(StoreUnavailable):
        b.get_many(items)
