"""keep_freed_memory: glibc's malloc tuned in the processes the CLI runs, off on request."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

from cachegen import allocator

IS_GLIBC = sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION") is not None


def _run(env_value: str | None) -> str:
    env = dict(os.environ)
    env.pop(allocator.ENV, None)
    if env_value is not None:
        env[allocator.ENV] = env_value
    code = "from cachegen.allocator import keep_freed_memory; print(keep_freed_memory())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout


@pytest.mark.skipif(not IS_GLIBC, reason="glibc only")
def test_it_takes_effect_on_glibc_and_not_when_turned_off():
    assert _run(None).strip() == "True"
    for off in ("0", "off", "false"):
        assert _run(off).strip() == "False"


def test_it_passes_glibcs_parameters(monkeypatch):
    calls: list[tuple[int, int]] = []

    def mallopt(param: int, value: int) -> int:  # stands for the C function
        calls.append((param, value))
        return 1

    class FakeLibc:
        pass

    FakeLibc.mallopt = mallopt  # type: ignore[attr-defined]
    monkeypatch.delenv(allocator.ENV, raising=False)
    monkeypatch.setattr(allocator.sys, "platform", "linux")
    monkeypatch.setattr(allocator.ctypes, "CDLL", lambda _name: FakeLibc)
    assert allocator.keep_freed_memory() is True
    # the mmap threshold (-3) at glibc's 32 MB maximum, the trim threshold (-1) at the largest int
    assert calls == [(-3, 32 << 20), (-1, 2**31 - 1)]
    assert mallopt.argtypes == [ctypes.c_int, ctypes.c_int]  # type: ignore[attr-defined]


def test_a_refusal_or_a_libc_without_mallopt_is_false(monkeypatch):
    class Refuses:
        @staticmethod
        def mallopt(param: int, value: int) -> int:
            return 0

    monkeypatch.delenv(allocator.ENV, raising=False)
    monkeypatch.setattr(allocator.sys, "platform", "linux")
    monkeypatch.setattr(allocator.ctypes, "CDLL", lambda _name: Refuses)
    assert allocator.keep_freed_memory() is False
    monkeypatch.setattr(allocator.ctypes, "CDLL", lambda _name: object())  # no mallopt (musl)
    assert allocator.keep_freed_memory() is False
    monkeypatch.setattr(allocator.sys, "platform", "darwin")
    assert allocator.keep_freed_memory() is False


def test_the_cli_tunes_its_process(monkeypatch, capsys):
    from cachegen.cli import main as cli

    called: list[bool] = []
    monkeypatch.setattr(cli, "keep_freed_memory", lambda: called.append(True) or True)
    assert cli.main(["models"]) == 0
    assert called == [True]
