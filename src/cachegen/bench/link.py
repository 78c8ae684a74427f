"""A real shaped link for the TTFT benchmark: redis-server behind a tc-shaped veth in a network namespace.

The in-process throttle (:class:`cachegen.stream.link.ThrottledLink`) is the
default. :class:`NetnsRedisLink` is the real thing where the machine allows
it (root, ``ip``, ``tc`` with ``tbf``, ``redis-server``): a private /30
between the host and a namespace, ``tbf`` on both veth ends, redis-py GETs
through it. Set-up and tear-down take about 0.1 s; deleting the namespace
removes both veth ends. Only the namespace, veth pair and redis-server this
object created are touched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from cachegen.errors import ConfigError, StoreUnavailable


def netns_available() -> tuple[bool, str]:
    """Whether :class:`NetnsRedisLink` can run here, and why not."""
    if os.name != "posix" or os.geteuid() != 0:
        return False, "needs root (network namespaces and tc)"
    for tool in ("ip", "tc", "redis-server"):
        if shutil.which(tool) is None:
            return False, f"{tool} is not on PATH" + (" (apt-get install redis-server)" if tool == "redis-server" else "")
    return True, ""


def _run(*cmd: str) -> None:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise ConfigError(f"{' '.join(cmd)} failed: {p.stderr.strip() or p.stdout.strip()}")


class NetnsRedisLink:
    """redis-server in a fresh namespace behind a veth pair shaped with tc tbf.

    Use as a context manager. :meth:`put` stores blobs with the shaping off,
    :meth:`set_bandwidth` shapes both directions, :meth:`get` fetches through
    the shaped link.
    """

    kind = "netns"

    def __init__(self, port: int = 6390) -> None:
        ok, why = netns_available()
        if not ok:
            raise ConfigError(f"--link netns is not possible here: {why}")
        tag = os.getpid() % 100000
        self.ns = f"cgbench{tag}"
        self.host_if, self.ns_if = f"cgb{tag}h", f"cgb{tag}n"
        sub = 1 + tag % 250
        self.host_ip, self.ns_ip = f"10.233.{sub}.1", f"10.233.{sub}.2"
        self.port = port
        self._dir = Path(tempfile.mkdtemp(prefix="cgbench-redis-"))
        self.pidfile = self._dir / "redis.pid"
        self.client = None
        self._up = False
        self.gbps: float | None = None

    # -- lifecycle ------------------------------------------------------------------
    def __enter__(self) -> "NetnsRedisLink":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        import redis

        try:
            _run("ip", "netns", "add", self.ns)
            self._up = True
            _run("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
            _run("ip", "link", "set", self.ns_if, "netns", self.ns)
            _run("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
            _run("ip", "link", "set", self.host_if, "up")
            _run("ip", "netns", "exec", self.ns, "ip", "addr", "add", f"{self.ns_ip}/30", "dev", self.ns_if)
            _run("ip", "netns", "exec", self.ns, "ip", "link", "set", self.ns_if, "up")
            _run("ip", "netns", "exec", self.ns, "ip", "link", "set", "lo", "up")
            _run("ip", "netns", "exec", self.ns, "redis-server", "--port", str(self.port), "--bind", self.ns_ip,
                 "--protected-mode", "no", "--save", "", "--appendonly", "no", "--daemonize", "yes",
                 "--pidfile", str(self.pidfile), "--dir", str(self._dir), "--proto-max-bulk-len", "2gb")
            self.client = redis.Redis(host=self.ns_ip, port=self.port, socket_timeout=120)
            deadline = time.monotonic() + 10
            while True:
                try:
                    self.client.ping()
                    break
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise StoreUnavailable("redis-server in the namespace did not answer") from None
                    time.sleep(0.05)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.client is not None:
            try:
                self.client.close()
            except Exception:
                pass
            self.client = None
        try:
            pid = int(self.pidfile.read_text().strip())
            os.kill(pid, 15)
            for _ in range(100):
                os.kill(pid, 0)
                time.sleep(0.02)
        except (OSError, ValueError):
            pass
        if self._up:
            subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)
            self._up = False
        shutil.rmtree(self._dir, ignore_errors=True)

    # -- shaping ------------------------------------------------------------------
    def _unshape(self) -> None:
        subprocess.run(["tc", "qdisc", "del", "dev", self.host_if, "root"], capture_output=True)
        subprocess.run(["ip", "netns", "exec", self.ns, "tc", "qdisc", "del", "dev", self.ns_if, "root"], capture_output=True)
        self.gbps = None

    def set_bandwidth(self, gbps: float) -> None:
        """tbf at ``gbps`` on both ends; the burst is ~1 ms of data (at least 64 KB)."""
        if gbps <= 0:
            raise ConfigError("bandwidth must be positive")
        rate_bytes = gbps * 1e9 / 8
        burst = max(64 * 1024, int(rate_bytes * 1e-3))
        limit = max(8 << 20, 4 * burst)
        spec = ["root", "tbf", "rate", f"{gbps * 1000:.3f}mbit", "burst", str(burst), "limit", str(limit)]
        _run("tc", "qdisc", "replace", "dev", self.host_if, *spec)
        _run("ip", "netns", "exec", self.ns, "tc", "qdisc", "replace", "dev", self.ns_if, *spec)
        self.gbps = gbps

    # -- data ---------------------------------------------------------------------
    def put(self, key: str, data: bytes) -> None:
        """Store without shaping (staging is not part of the measurement)."""
        gbps = self.gbps
        if gbps is not None:
            self._unshape()
        self.client.set(key, data)
        if gbps is not None:
            self.set_bandwidth(gbps)

    def get(self, key: str) -> bytes:
        data = self.client.get(key)
        if data is None:
            raise StoreUnavailable(f"{key} is not in the benchmark's redis")
        return data

    def flush(self) -> None:
        self.client.flushall()
