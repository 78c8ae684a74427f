"""A real shaped link: redis-server in a network namespace behind a tbf-shaped veth pair.

Only what this object creates is touched: its own namespace (``cgst<pid>``), the
veth pair inside a private /30 (``10.231.X.1`` host side, ``10.231.X.2`` inside,
X picked free), and the redis-server it starts (stopped by its pid file).
``set_rate(gbps)`` runs ``tc qdisc change`` on both veth ends, so a bandwidth
trace can be replayed during a load: :class:`NetnsLink` does it per chunk (chunk
traces) or from a timer thread (time traces). Bench-only: the stream bench and the
TTFT bench use it for ``--link netns``; docs/streaming.md has the measurements.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from cachegen.errors import ConfigError, StoreUnavailable
from cachegen.stream.link import Trace


def available() -> tuple[bool, str]:
    """(True, "") when root, ``ip netns``, ``tc`` and ``redis-server`` are usable here."""
    if os.name != "posix" or os.geteuid() != 0:
        return False, "needs root"
    for tool in ("ip", "tc", "redis-server"):
        if shutil.which(tool) is None:
            return False, f"{tool} not on PATH"
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if r.returncode != 0:
        return False, f"ip netns does not work: {r.stderr.strip()}"
    return True, ""


def _run(*cmd: str, ns: str | None = None) -> None:
    full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    r = subprocess.run(full, capture_output=True, text=True)
    if r.returncode != 0:
        raise ConfigError(f"{' '.join(full)}: {r.stderr.strip() or r.stdout.strip()}")


def _tbf(gbps: float) -> list[str]:
    rate_bps = gbps * 1e9
    burst = max(256 * 1024, int(rate_bps / 8 * 0.001))  # >= 1 ms of data; >= 1 MB at 10 Gbit/s
    limit = max(8 << 20, 4 * burst)
    return ["tbf", "rate", f"{int(rate_bps / 1000)}kbit", "burst", str(burst), "limit", str(limit)]


class NetnsRedis:
    """Set up with :meth:`start` (or ``with``); ``url`` is the ``redis://`` URL to open the store with."""

    def __init__(self, gbps: float = 1.0, port: int = 6379):
        ok, why = available()
        if not ok:
            raise ConfigError(f"netns link unavailable: {why}")
        tag = f"{os.getpid() % 100000}{int(time.time() * 1000) % 1000:03d}"
        self.ns = f"cgst{tag}"
        self.veth_host, self.veth_ns = f"cgh{tag}"[:15], f"cgn{tag}"[:15]
        self.port = port
        self.gbps = gbps
        self.subnet: int | None = None
        self.tmp = Path(tempfile.mkdtemp(prefix="cg-netns-"))
        self.pidfile = self.tmp / "redis.pid"
        self.started = False

    def _free_subnet(self) -> int:
        used = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
        for x in range(10, 250):
            if f"10.231.{x}." not in used:
                return x
        raise ConfigError("no free 10.231.X.0/30 subnet")

    @property
    def host_ip(self) -> str:
        return f"10.231.{self.subnet}.1"

    @property
    def ns_ip(self) -> str:
        return f"10.231.{self.subnet}.2"

    @property
    def url(self) -> str:
        return f"redis://{self.ns_ip}:{self.port}/0?timeout=5"

    def start(self) -> NetnsRedis:
        self.subnet = self._free_subnet()
        _run("ip", "netns", "add", self.ns)
        self.started = True
        try:
            _run("ip", "link", "add", self.veth_host, "type", "veth", "peer", "name", self.veth_ns)
            _run("ip", "link", "set", self.veth_ns, "netns", self.ns)
            _run("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.veth_host)
            _run("ip", "link", "set", self.veth_host, "up")
            _run("ip", "addr", "add", f"{self.ns_ip}/30", "dev", self.veth_ns, ns=self.ns)
            _run("ip", "link", "set", self.veth_ns, "up", ns=self.ns)
            _run("ip", "link", "set", "lo", "up", ns=self.ns)
            _run("tc", "qdisc", "replace", "dev", self.veth_host, "root", *_tbf(self.gbps))
            _run("tc", "qdisc", "replace", "dev", self.veth_ns, "root", *_tbf(self.gbps), ns=self.ns)
            _run(
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                self.ns_ip,
                "--protected-mode",
                "no",
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "yes",
                "--pidfile",
                str(self.pidfile),
                "--dir",
                str(self.tmp),
                ns=self.ns,
            )
            deadline = time.time() + 5
            while True:
                try:
                    socket.create_connection((self.ns_ip, self.port), timeout=0.5).close()
                    break
                except OSError:
                    if time.time() > deadline:
                        raise StoreUnavailable("redis-server in the namespace did not come up") from None
                    time.sleep(0.05)
        except BaseException:
            self.close()
            raise
        return self

    def set_rate(self, gbps: float) -> None:
        if gbps <= 0:
            raise ConfigError("bandwidth must be positive")
        if gbps == self.gbps:
            return
        self.gbps = gbps
        _run("tc", "qdisc", "change", "dev", self.veth_host, "root", *_tbf(gbps))
        _run("tc", "qdisc", "change", "dev", self.veth_ns, "root", *_tbf(gbps), ns=self.ns)

    def close(self) -> None:
        if self.pidfile.exists():
            try:
                os.kill(int(self.pidfile.read_text().strip()), 15)
                time.sleep(0.05)
            except (ValueError, ProcessLookupError):
                pass
        if self.started:
            subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)
            self.started = False
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> NetnsRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


class NetnsLink:
    """The loader's link over a :class:`NetnsRedis`: fetches go straight to the store (redis
    behind the shaped veth); the trace is replayed with ``tc qdisc change``."""

    kind = "netns"

    def __init__(self, netns: NetnsRedis, trace: Trace):
        self.netns, self.trace = netns, trace
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None

    def begin(self) -> None:
        self._halt()
        self.netns.set_rate(self.trace.gbps_at(0))
        if self.trace.by == "time" and len(self.trace.points) > 1:
            self._stop.clear()
            t0 = time.perf_counter()

            def replay() -> None:
                for x, g in self.trace.points[1:]:
                    if self._stop.wait(max(x - (time.perf_counter() - t0), 0)):
                        return
                    self.netns.set_rate(g)

            self._timer = threading.Thread(target=replay, daemon=True, name="cachegen-netns-trace")
            self._timer.start()

    def fetch(self, get, ref, level):
        if self.trace.by == "chunk":
            self.netns.set_rate(self.trace.gbps_at(ref.index))
        return get(ref, level)

    def _halt(self) -> None:
        self._stop.set()
        if self._timer is not None:
            self._timer.join(timeout=1)
            self._timer = None

    def close(self) -> None:
        self._halt()
