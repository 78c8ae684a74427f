"""The server's parts that need no model: JSON depth, request fields, sampling, text streaming, queues."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from cachegen.engine.sampling import Sampler, SamplingParams, TextStream
from cachegen.engine.writer import BackgroundWriter
from cachegen.errors import ConfigError, StoreUnavailable
from cachegen.kv import KVCache, KVLayer, LayerKind
from cachegen.serve.errors import APIError
from cachegen.serve.limits import json_depth, parse_json
from cachegen.serve.protocol import parse
from cachegen.serve.worker import Job, ModelWorker, QueueFull


@pytest.mark.parametrize("doc", ["{}", "[]", '{"a": [1, {"b": []}]}', '"[[[["', '{"s": "}}]]\\"[["}', "[[[[[1]]]]]"])
def test_json_depth_matches_the_parsed_nesting(doc):
    def depth(x):
        if isinstance(x, dict):
            return 1 + max(map(depth, x.values()), default=0)
        if isinstance(x, list):
            return 1 + max(map(depth, x), default=0)
        return 0

    assert json_depth(doc.encode()) == depth(json.loads(doc))


def test_deep_json_is_refused_without_parsing():
    with pytest.raises(APIError) as e:
        parse_json(b"[" * 200_000 + b"]" * 200_000, 64)
    assert e.value.status == 400 and e.value.code == "json_too_deep"
    with pytest.raises(APIError):
        parse_json(b"[1]", 64)  # not an object
    assert parse_json(b'{"a": 1}', 64) == {"a": 1}


def test_request_fields():
    r = parse(
        {
            "messages": [],
            "max_completion_tokens": 7,
            "temperature": 0,
            "stop": "x",
            "whatever": [1],
            "stream": True,
            "stream_options": {"include_usage": True},
            "cachegen": {"slo_s": 0.5},
        },
        "chat",
        256,
        None,
    )
    assert r.params.max_tokens == 7 and r.params.greedy and r.params.stop == ("x",)
    assert r.stream and r.include_usage and r.opts.slo_s == 0.5 and r.opts.use_cache
    assert parse({"prompt": "hi"}, "completion", 256, 2.0).params.max_tokens == 16
    assert parse({"prompt": [[1, 2]]}, "completion", 256, None).prompt_ids == [1, 2]
    for bad in (
        {"prompt": "x", "n": 3},
        {"prompt": "x", "top_p": 0},
        {"prompt": "x", "seed": 1.5},
        {"prompt": "x", "max_tokens": 0},
        {"prompt": "x", "stop": ["a"] * 5},
        {"prompt": 5},
        {"prompt": [True]},
        {"prompt": "x", "cachegen": {"use_cache": "no"}},
        {"prompt": "x", "temperature": 3},
    ):
        with pytest.raises(APIError) as e:
            parse(bad, "completion", 256, None)
        assert e.value.status == 400


def test_sampler():
    logits = torch.tensor([0.0, 5.0, 4.9, -3.0])
    assert Sampler(SamplingParams(temperature=0.0))(logits) == 1
    picks = {Sampler(SamplingParams(temperature=1.0, top_p=0.5, seed=s))(logits) for s in range(30)}
    assert picks == {1}  # top_p 0.5 keeps only the most likely token here
    wide = {Sampler(SamplingParams(temperature=2.0, seed=s))(logits) for s in range(60)}
    assert {1, 2} <= wide
    a = [Sampler(SamplingParams(temperature=1.0, seed=9))(logits) for _ in range(5)]
    assert len(set(a)) == 1  # the same seed, the same draw
    with pytest.raises(ConfigError):
        SamplingParams(top_p=0.0)


class _Tok:
    """Token i decodes to PIECES[i]; 9 is half a UTF-8 character until 10 follows."""

    PIECES = ("Hel", "lo", " wor", "ld", "!", " S", "TOP", " more", "", "", "")

    def decode(self, ids, skip_special_tokens=True):
        out = "".join(self.PIECES[i] for i in ids if i not in (9, 10))
        if 9 in ids:
            out += "é" if 10 in ids else "\ufffd"
        return out


def test_text_stream_holds_back_partial_stop_strings_and_characters():
    ts = TextStream(_Tok(), stop=[" STOP"])
    assert [ts.push(i) for i in (0, 1, 2)] == ["Hel", "lo", " wor"]
    assert ts.push(5) == ""  # " S" may start " STOP"
    assert ts.push(6) == "" and ts.stopped and ts.text == "Hello wor"
    ts = TextStream(_Tok())
    assert ts.push(9) == "" and ts.push(10) == "é"
    ts = TextStream(_Tok(), stop=[" STOP"])
    ts.push(0)
    ts.push(5)
    assert ts.flush() == " S"  # generation ended: what was held back goes out


def test_worker_queue_is_bounded_and_skips_cancelled_jobs():
    w = ModelWorker(max_queue=1)
    gate, ran = threading.Event(), []
    w.submit(Job(lambda j: (gate.wait(30), ran.append("a"))))
    while w.running == 0:
        gate.wait(0.01)
    skipped = Job(lambda j: ran.append("b"))
    w.submit(skipped)
    with pytest.raises(QueueFull):
        w.submit(Job(lambda j: ran.append("c")))
    skipped.cancel()
    done = threading.Event()
    gate.set()
    while w.waiting:
        gate.wait(0.01)
    w.submit(Job(lambda j: (ran.append("d"), done.set())))
    assert done.wait(30)
    w.close()
    assert ran == ["a", "d"]


class _SlowStore:
    chunk_tokens = 4

    def __init__(self, fail=False):
        self.gate, self.fail, self.puts = threading.Event(), fail, []

    def put_context(self, tokens, kv):
        self.gate.wait(30)
        if self.fail:
            raise StoreUnavailable("redis://:hunter2@db:6379/0 is down")
        self.puts.append(len(tokens))
        return [object()] * ((len(tokens) - kv.start) // 4)


def _kv(n):
    return KVCache([KVLayer(torch.zeros(1, n, 2), torch.zeros(1, n, 2), LayerKind.FULL, None)])


def test_background_writer_drops_when_full_and_counts_failures():
    store = _SlowStore()
    w = BackgroundWriter(store, max_pending=2)
    assert w.submit(list(range(8)), _kv(8)) and w.submit(list(range(8)), _kv(8))
    assert not w.submit(list(range(8)), _kv(8))  # full: dropped, not queued
    assert w.stats.dropped == 1 and w.stats.dropped_chunks == 2 and w.depth() == 2
    store.gate.set()
    assert w.flush(30) and store.puts == [8, 8] and w.stats.written_chunks == 4
    w.close()
    bad = _SlowStore(fail=True)
    bad.gate.set()
    w = BackgroundWriter(bad)
    w.submit(list(range(4)), _kv(4))
    assert w.flush(30) and w.stats.failed == 1 and "hunter2" not in w.stats.errors[0]
    w.close()


def test_busy_port_is_one_line_before_the_model_loads(tmp_path):
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = subprocess.run(
            [sys.executable, "-m", "cachegen", "serve", "--port", str(port), "--store", f"file://{tmp_path}"],
            capture_output=True,
            text=True,
            timeout=120,
            env={**__import__("os").environ, "CACHEGEN_API_KEY": "k"},
        )
    assert r.returncode == 2, r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and str(port) in lines[0] and "Traceback" not in r.stderr


def test_every_serve_flag_reads_an_environment_variable(monkeypatch):
    import argparse

    from cachegen.cli import serve

    monkeypatch.setenv("CACHEGEN_PORT", "9191")
    monkeypatch.setenv("CACHEGEN_MAX_QUEUE", "3")
    monkeypatch.setenv("CACHEGEN_ACCESS_LOG", "true")
    p = argparse.ArgumentParser()
    serve.register(p.add_subparsers())
    args = p.parse_args(["serve"])
    assert args.port == 9191 and args.max_queue == 3 and args.access_log is True
    assert p.parse_args(["serve", "--port", "1234"]).port == 1234
