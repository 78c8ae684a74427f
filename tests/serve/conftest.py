"""A real ``cachegen serve`` in a subprocess on a free 127.0.0.1 port, and a real redis-server.

Start-ups are slow (the model loads), so most tests share one module-scoped
server; the Redis fault test starts its own.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

API_KEY = "test-key-123"
START_TIMEOUT_S = 900  # model load + first-run profile and cost calibration on a busy machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str  # http://127.0.0.1:PORT
    log: Path

    @property
    def base(self) -> str:
        return self.url + "/v1"

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=600, **kw)

    def wait_writes(self, timeout: float = 300) -> None:
        """Until the background writer has stored everything queued (polls /health)."""
        end = time.monotonic() + timeout
        with httpx.Client(base_url=self.url, timeout=30) as c:
            while time.monotonic() < end:
                if c.get("/health").json()["writer"]["depth"] == 0:
                    return
                time.sleep(0.2)
        raise AssertionError("background writes did not finish")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_server(tmp: Path, *args: str, env: dict | None = None) -> Server:
    log = tmp / f"server-{time.monotonic_ns()}.log"
    cmd = [sys.executable, "-m", "cachegen", "serve", "--port", "0", "--api-key", API_KEY, *args]
    out = open(log, "w")  # noqa: SIM115 (the server writes to it until it stops)
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=out,
        text=True,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})},
    )
    end = time.monotonic() + START_TIMEOUT_S
    assert proc.stdout is not None
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                out.close()
                raise RuntimeError(f"cachegen serve exited with {proc.returncode}: {log.read_text()[-3000:]}")
            continue
        m = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line)
        if m:
            return Server(proc, m.group(1), log)
    proc.kill()
    raise RuntimeError(f"cachegen serve did not start: {log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    srv = start_server(
        tmp,
        "--store",
        f"file://{tmp / 'store'}",
        "--chunk-tokens",
        "64",
        "--max-queue",
        "2",
        "--read-timeout-s",
        "3",
        "--max-tokens",
        "64",
    )
    yield srv
    srv.stop()


@dataclass
class Redis:
    proc: subprocess.Popen
    port: int

    @property
    def url(self) -> str:
        return f"redis://:s3cret-pw@127.0.0.1:{self.port}/0"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def start_redis(tmp: Path) -> Redis:
    exe = shutil.which("redis-server")
    if not exe:
        pytest.fail("redis-server not found on PATH: install it with `make redis-server`", pytrace=False)
    port = free_port()
    proc = subprocess.Popen(
        [
            exe,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--requirepass",
            "s3cret-pw",
            "--dir",
            str(tmp),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(200):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return Redis(proc, port)
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")
