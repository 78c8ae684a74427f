"""``cachegen store stats|evict|clear`` (ingest needs a model: see the engine tests)."""

from __future__ import annotations

import json

from cachegen.store import ContextStore, default_store_url, open_backend
from cachegen.cli.main import main


def test_stats_evict_clear(store_dir, tmp_path, capsys, namespace, encoder, kv_factory):
    url = f"file://{store_dir}"
    cs = ContextStore(open_backend(url), namespace, encoder, chunk_tokens=16)
    cs.put_context(list(range(40)), kv_factory(40), levels=[0, 2])
    out = tmp_path / "s" / "stats.json"
    assert main(["store", "stats", "--store", url, "--json", str(out)]) == 0
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
