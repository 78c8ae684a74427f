"""``cachegen store stats|evict|clear`` (ingest needs a model: see the engine tests)."""

from __future__ import annotations

import json

import pytest

from cachegen.cli.main import main
from cachegen.errors import StoreUnavailable
from cachegen.store import ContextStore, Namespace, default_store_url, open_backend

NS_FOR_SECRETS = Namespace("fp", 1, "p")


def test_stats_evict_clear(store_dir, tmp_path, capsys, namespace, encoder, kv_factory):
    url = f"file://{store_dir}"
    cs = ContextStore(open_backend(url), namespace, encoder, chunk_tokens=16)
    cs.put_context(list(range(40)), kv_factory(40), levels=[0, 2])
    out = tmp_path / "s" / "stats.json"
    assert main(["store", "stats", "--store", url, "--json", str(out)]) == 0  # (--json - is in tests/cli)
    s = json.loads(out.read_text())
    assert (s["contexts"], s["chunks"], set(s["levels"])) == (1, 3, {"0", "2"})
    assert s["bytes"] == cs.backend.stats().bytes and "chunks=3" in capsys.readouterr().out
    assert main(["store", "evict", "--store", url, "--max-bytes", "1"]) == 0
    assert "evicted 3 chunks" in capsys.readouterr().out
    cs.put_context(list(range(40)), kv_factory(40), levels=[0])
    assert main(["store", "clear", "--store", url]) == 0
    assert "cleared 3 chunks" in capsys.readouterr().out and cs.lookup(list(range(40))) == 0


def test_errors_are_reported_not_raised(capsys):
    assert main(["store", "stats", "--store", "redis://127.0.0.1:1/0?timeout=0.2"]) == 2
    assert "cannot" in capsys.readouterr().err
    assert main(["store", "stats", "--store", "ftp://x"]) == 2


def test_default_store_is_under_cachegen_home(tmp_path, monkeypatch):
    monkeypatch.setenv("CACHEGEN_HOME", str(tmp_path))
    assert default_store_url() == f"file://{tmp_path / 'store'}"
    assert open_backend(None).root == tmp_path / "store"


def test_ls_and_rm(store_dir, capsys, namespace, encoder, kv_factory):
    url = f"file://{store_dir}"
    cs = ContextStore(open_backend(url), namespace, encoder, chunk_tokens=16)
    cs.put_context(list(range(40)), kv_factory(40), levels=[0, 2])
    cs.put_context(list(range(100, 120)), kv_factory(20, seed=1), levels=[1])
    assert main(["store", "ls", "--store", url]) == 0
    head, *lines = capsys.readouterr().out.splitlines()
    assert head.split() == ["id", "tokens", "chunks", "levels", "bytes"]
    plans = {40: cs.plan(list(range(40))), 20: cs.plan(list(range(100, 120)))}
    want = {
        p[-1].ref.key[:16]: [
            str(n),
            str(len(p)),
            ",".join(map(str, sorted(p[0].sizes))),
            str(sum(sum(i.sizes.values()) for i in p)),
        ]
        for n, p in plans.items()
    }
    assert {l.split()[0]: l.split()[1:] for l in lines} == want
    assert main(["store", "ls", "--store", url, "--json", "-"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {
        r["id"][:16]: [str(r["tokens"]), str(r["chunks"]), ",".join(map(str, r["levels"])), str(r["bytes"])]
        for r in rows
    } == want
    gone = plans[40][-1].ref.key
    assert main(["store", "rm", gone[:10], "--store", url]) == 0
    assert f"removed context {gone[:16]} (3 chunks)" in capsys.readouterr().out
    assert cs.lookup(list(range(40))) == 0 and cs.lookup(list(range(100, 120))) == 20
    assert main(["store", "rm", gone[:10], "--store", url]) == 2
    assert "no context" in capsys.readouterr().err
    cs.backend.clear()
    assert main(["store", "ls", "--store", url]) == 0 and "no contexts in" in capsys.readouterr().out


def test_output_into_a_closed_pipe(tmp_path, redis_url):
    """``cachegen store ls | head -1`` with more output than a pipe holds: no BrokenPipeError."""
    import subprocess
    import sys

    from cachegen.store import ChunkWrite

    b = open_backend(redis_url)
    b.put_chunks([ChunkWrite(f"{i:064x}", b"\0" * 64, {0: b"x"}, ends_context=True) for i in range(1, 3001)])
    for cmd in (["ls"], ["stats"]):
        p = subprocess.Popen(
            [sys.executable, "-m", "cachegen", "store", *cmd, "--store", redis_url],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        first = p.stdout.readline()
        p.stdout.close()  # what `head -1` does after its line
        err = p.stderr.read().decode()
        p.wait(timeout=60)
        assert first and "Traceback" not in err and "BrokenPipe" not in err, err
        assert p.returncode in (0, 141), (p.returncode, err)


def test_secrets_never_printed(capsys, redis_server):
    """Store URLs may carry a password: errors, reprs and faults show it masked."""
    secret = "hunter2-secret"
    for url in (
        f"redis://:{secret}@127.0.0.1:1/0?timeout=0.2",
        f"redis://user:{secret}@127.0.0.1:1/x",
        f"redis://127.0.0.1:{redis_server.port}/0?password={secret}",
        f"rediss://:{secret}@h/0",
        f"file://user:{secret}@host/x",
    ):
        assert main(["store", "stats", "--store", url]) == 2
        err = capsys.readouterr().err
        assert err.startswith("cachegen: error:") and secret not in err, err
    b = open_backend(f"redis://:{secret}@127.0.0.1:1/0?timeout=0.2")
    cs = ContextStore(b, NS_FOR_SECRETS)
    assert secret not in repr(b) + repr(cs) + b.url
    with pytest.raises(StoreUnavailable) as e:
        cs.plan(list(range(10)), timeout=1)
    assert secret not in str(e.value) and "***" in str(e.value)
