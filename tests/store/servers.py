"""Real Redis servers for the tests: Debian's ``redis-server`` on free loopback ports, one
server or a 3-node Redis Cluster, stopped afterwards; without it on PATH the tests fail and say
how to install it. The fixtures are registered in ``tests/conftest.py``, so the store tests and
the loader tests (``tests/stream``) run against the same stores."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest


def _redis_binaries() -> tuple[str, str]:
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if not server or not cli:
        pytest.fail(
            "redis-server/redis-cli not found on PATH: the store tests need a real Redis. "
            "Install Debian's package: `sudo apt-get install -y redis-server` (or `make redis-server`)",
            pytrace=False,
        )
    return server, cli


def _free_port(also_bus: bool = False) -> int:
    """A free loopback port (and, for a cluster node, its bus port +10000)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port > 55000 and also_bus:
            continue
        if also_bus:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
        return port
    raise RuntimeError("no free port pair")


@dataclass
class RedisServer:
    port: int
    pidfile: Path
    cli: str

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def pid(self) -> int:
        return int(self.pidfile.read_text().strip())

    def command(self, *args: str) -> str:
        return subprocess.run(
            [self.cli, "-h", "127.0.0.1", "-p", str(self.port), *args], capture_output=True, text=True, timeout=30
        ).stdout

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the server (SIGSTOP pauses it, SIGCONT resumes it); a server gone is no error."""
        with contextlib.suppress(ProcessLookupError, FileNotFoundError, ValueError):
            os.kill(self.pid(), sig)

    def kill(self) -> None:
        self.signal(signal.SIGCONT)  # a paused server dies at once on SIGKILL too, but its clients see it sooner
        self.signal(signal.SIGKILL)

    def debug_sleep(self, seconds: float) -> socket.socket:
        """Make the server sleep (it is single-threaded: every client waits) and return once it does
        (a fresh connection's PING goes unanswered); returns the socket that sent the command."""
        s = socket.create_connection(("127.0.0.1", self.port))
        s.sendall(f"DEBUG SLEEP {seconds}\r\n".encode())
        for _ in range(50):
            with socket.create_connection(("127.0.0.1", self.port)) as probe:
                probe.settimeout(0.2)
                probe.sendall(b"PING\r\n")
                try:
                    probe.recv(16)  # answered: the sleep has not begun yet
                except TimeoutError:
                    return s  # asleep
        raise AssertionError("redis-server never started its DEBUG SLEEP")


def start_redis(tmp: Path, cluster: bool = False) -> RedisServer:
    server, cli = _redis_binaries()
    port = _free_port(also_bus=cluster)
    d = tmp / f"redis-{port}"
    d.mkdir(parents=True)
    pidfile = d / "redis.pid"
    args = [
        server,
        "--bind",
        "127.0.0.1",
        "--port",
        str(port),
        "--save",
        "",
        "--appendonly",
        "no",
        "--daemonize",
        "yes",
        "--pidfile",
        str(pidfile),
        "--dir",
        str(d),
        "--logfile",
        str(d / "log"),
        "--enable-debug-command",
        "local",
    ]  # DEBUG SLEEP, for the stalled-server tests
    if cluster:
        args += ["--cluster-enabled", "yes", "--cluster-config-file", str(d / "nodes.conf")]
    subprocess.run(args, check=True, timeout=30)
    srv = RedisServer(port, pidfile, cli)
    for _ in range(200):
        if srv.command("ping").strip() == "PONG" and pidfile.exists():
            return srv
        time.sleep(0.02)
    raise RuntimeError(f"redis-server on port {port} did not start: {(d / 'log').read_text()[-2000:]}")


def create_cluster(nodes: list[RedisServer]) -> None:
    """Join cluster-enabled ``nodes`` into one Redis Cluster (no replicas) and wait until it serves."""
    out = subprocess.run(
        [
            nodes[0].cli,
            "--cluster",
            "create",
            *[f"127.0.0.1:{n.port}" for n in nodes],
            "--cluster-replicas",
            "0",
            "--cluster-yes",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    deadline = time.time() + 30
    while not all("cluster_state:ok" in n.command("cluster", "info") for n in nodes):
        assert time.time() < deadline, "the Redis Cluster did not reach cluster_state:ok"
        time.sleep(0.05)


@pytest.fixture
def redis_factory(tmp_path):
    """Start private Redis servers (to kill or pause); all are stopped at the end."""
    started: list[RedisServer] = []

    def start(cluster: bool = False) -> RedisServer:
        srv = start_redis(tmp_path, cluster)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.kill()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    srv = start_redis(tmp_path_factory.mktemp("redis"))
    yield srv
    srv.kill()


@pytest.fixture
def redis_url(redis_server) -> str:
    """The shared server, emptied for each test."""
    redis_server.command("flushall")
    return redis_server.url


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """A local 3-node Redis Cluster (no replicas); yields its URL."""
    tmp = tmp_path_factory.mktemp("cluster")
    nodes = [start_redis(tmp, cluster=True) for _ in range(3)]
    try:
        create_cluster(nodes)
        yield f"redis+cluster://127.0.0.1:{nodes[0].port}", nodes
    finally:
        for n in nodes:
            n.kill()


@pytest.fixture
def cluster_url(redis_cluster) -> str:
    url, nodes = redis_cluster
    for n in nodes:
        n.command("flushall")
    return url


@pytest.fixture(params=["file", "redis", "cluster", "mock"])
def any_url(request, tmp_path):
    """Each backend in turn, for behaviour they must share."""
    if request.param == "file":
        return f"file://{tmp_path / 'store'}"
    if request.param == "mock":
        from cachegen.store.mock import forget

        name = f"test-{os.getpid()}-{id(request)}"
        request.addfinalizer(lambda: forget(name))
        return f"mock://{name}"
    if request.param == "redis":
        return request.getfixturevalue("redis_url")
    return request.getfixturevalue("cluster_url")
