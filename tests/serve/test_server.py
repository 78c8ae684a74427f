"""The OpenAI-compatible server end to end: a real uvicorn subprocess, SmolLM2, the official openai client."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import openai
import pytest

from cachegen import corpus
from conftest import API_KEY, start_redis, start_server

pytestmark = pytest.mark.model

CHUNK = 64
DOC = corpus.text("pydoc-eval")[:1200]  # ~300 tokens of real text


def _chat(doc: str, question: str) -> list[dict]:
    return [
        {"role": "system", "content": "You answer questions about the document in one sentence."},
        {"role": "user", "content": f"{doc}\n\n{question}"},
    ]


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and "type" in err and "code" in err
    return err


# -- the openai client ------------------------------------------------------------


def test_sync_chat_with_usage_and_models(server):
    client = openai.OpenAI(base_url=server.base, api_key=API_KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["smollm2-135m"]
    r = client.chat.completions.create(
        model="smollm2-135m", messages=_chat("Cats purr.", "What do cats do?"), max_tokens=8, temperature=0
    )
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 10 and 1 <= u.completion_tokens <= 8
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens == 0
    extra = r.model_extra["cachegen"]
    assert set(extra) >= {"levels", "load_s", "deadline_met", "faults"}


def test_async_completion_and_stream_match(server):
    async def go():
        client = openai.AsyncOpenAI(base_url=server.base, api_key=API_KEY, max_retries=0)
        prompt = "The capital of France is"
        full = await client.completions.create(model="m", prompt=prompt, max_tokens=6, temperature=0)
        parts, usage, finish = [], None, None
        stream = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for ch in stream:
            if ch.usage is not None:
                usage = ch.usage
                assert ch.choices == []
                continue
            if ch.choices[0].delta.content:
                parts.append(ch.choices[0].delta.content)
            if ch.choices[0].finish_reason:
                finish = ch.choices[0].finish_reason
        ref = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Say hello."}], max_tokens=6, temperature=0
        )
        await client.close()
        return full, "".join(parts), usage, finish, ref

    full, streamed, usage, finish, ref = asyncio.run(go())
    assert full.object == "text_completion" and full.choices[0].text
    assert full.usage.completion_tokens >= 1
    assert streamed == ref.choices[0].message.content  # temperature 0: the same answer either way
    assert finish == ref.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == ref.usage.completion_tokens


def test_raw_sse_format(server):
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 3,
        "stream": True,
        "temperature": 0,
    }
    with server.client() as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length") and "cachegen" in chunks[-1]


def test_sampling_seed_is_reproducible(server):
    client = openai.OpenAI(base_url=server.base, api_key=API_KEY, max_retries=0)
    args = dict(model="m", prompt="Once upon a time", max_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    a, b = client.completions.create(**args), client.completions.create(**args)
    assert a.choices[0].text == b.choices[0].text
    stop = client.completions.create(model="m", prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[","])
    assert "," not in stop.choices[0].text and stop.choices[0].finish_reason == "stop"


# -- automatic reuse ------------------------------------------------------------------


def test_multi_turn_reuse(server):
    client = openai.OpenAI(base_url=server.base, api_key=API_KEY, max_retries=0)
    msgs = _chat(DOC, "What is this document about?")
    r1 = client.chat.completions.create(model="m", messages=msgs, max_tokens=24, temperature=0)
    server.wait_writes()
    # the same prompt again: its full chunks come from the store
    again = client.chat.completions.create(model="m", messages=msgs, max_tokens=24, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == (r1.usage.prompt_tokens - 1) // CHUNK * CHUNK
    server.wait_writes()
    msgs2 = [
        *msgs,
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "Say it in five words."},
    ]
    r2 = client.chat.completions.create(model="m", messages=msgs2, max_tokens=8, temperature=0)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    turn1 = r1.usage.prompt_tokens + r1.usage.completion_tokens
    assert cached % CHUNK == 0
    assert cached >= turn1 // CHUNK * CHUNK  # turn 1's prompt and answer, up to the last full chunk
    assert r2.model_extra["cachegen"]["levels"] and not r2.model_extra["cachegen"]["faults"]


# -- bad input ---------------------------------------------------------------------------


def test_bad_inputs_get_openai_errors(server):
    good = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    with server.client() as c:
        chat = "/v1/chat/completions"
        assert c.post(chat, json={**good, "unknown_field": {"x": 1}, "logit_bias": None}).status_code == 200
        _error(c.post(chat, json={**good, "n": 2}), 400)
        _error(c.post(chat, json={**good, "temperature": "hot"}), 400)
        _error(c.post(chat, json={**good, "max_tokens": "5"}), 400)
        _error(c.post(chat, json={**good, "max_tokens": True}), 400)
        _error(c.post(chat, json={**good, "messages": "hello"}), 400)
        _error(c.post(chat, json={**good, "messages": [{"role": "wizard", "content": "x"}]}), 400)
        _error(c.post(chat, json={**good, "stream": "yes"}), 400)
        _error(c.post(chat, json={**good, "cachegen": {"slo_s": -1}}), 400)
        _error(c.post(chat, content=b"{not json", headers={"Content-Type": "application/json"}), 400)
        _error(c.post(chat, content=b"[1, 2]"), 400)
        deep = b"[" * 200_000 + b"]" * 200_000
        assert "deep" in _error(c.post(chat, content=deep), 400)["message"]
        _error(c.post(chat, content=b"x" * (3 << 20)), 400)  # over --max-body-bytes
        comp = "/v1/completions"
        assert "vocabulary" in _error(c.post(comp, json={"prompt": [1, 2, 10**9], "max_tokens": 1}), 400)["message"]
        _error(c.post(comp, json={"prompt": [1, -5], "max_tokens": 1}), 400)
        _error(c.post(comp, json={"prompt": ["a", "b"], "max_tokens": 1}), 400)
        err = _error(c.post(comp, json={"prompt": [42] * 8000, "max_tokens": 400}), 400)
        assert "positions" in err["message"] and err["code"] == "context_length_exceeded"
        _error(c.get("/v1/nothing"), 404)
        _error(c.get("/v1/chat/completions"), 405)


def test_api_key_required(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        body = {"model": "m", "prompt": "Hi", "max_tokens": 1}
        assert _error(c.post("/v1/completions", json=body), 401)["type"] == "authentication_error"
        _error(c.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}), 401)
        _error(c.get("/v1/models", headers={"Authorization": API_KEY}), 401)
        assert c.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
        assert c.get("/health").status_code == 200  # open for load balancers, and it holds no secret


def test_slow_bodies_do_not_hold_the_server(server):
    """200 clients that announce a body and send 8 bytes of it: each gets an answer, the server goes on."""
    host, port = server.url.removeprefix("http://").split(":")

    def open_slow(length: int) -> socket.socket:
        s = socket.create_connection((host, int(port)), timeout=60)
        s.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
            f'Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n{{"prompt'.encode()
        )
        return s

    socks = [open_slow(16 << 20) for _ in range(100)] + [open_slow(100_000) for _ in range(100)]
    statuses = []
    for s in socks:
        head = s.recv(4096).decode(errors="replace")
        statuses.append(int(head.split()[1]))
        s.close()
    assert statuses[:100] == [400] * 100  # over the body limit: refused from the header alone
    assert set(statuses[100:]) == {408}  # the rest timed out reading (--read-timeout-s)
    with server.client() as c:
        assert c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).status_code == 200


# -- load --------------------------------------------------------------------------------


def test_full_queue_gives_429(server):
    async def go():
        async with httpx.AsyncClient(
            base_url=server.url, timeout=600, headers={"Authorization": f"Bearer {API_KEY}"}
        ) as c:
            body = {"model": "m", "prompt": "Count to one hundred: 1, 2, 3,", "max_tokens": 48, "temperature": 0}
            return await asyncio.gather(*[c.post("/v1/completions", json=body) for _ in range(8)])

    rs = asyncio.run(go())
    codes = sorted(r.status_code for r in rs)
    assert 200 in codes and 429 in codes and set(codes) <= {200, 429}, codes
    busy = next(r for r in rs if r.status_code == 429)
    assert busy.headers["Retry-After"].isdigit()
    assert busy.json()["error"]["type"] == "rate_limit_error"


def test_disconnect_cancels_generation(server):
    body = {
        "model": "m",
        "prompt": "Write a very long story about a dragon.",
        "max_tokens": 4000,
        "temperature": 0,
        "stream": True,
        "cachegen": {"ignore_eos": True},
    }
    with server.client() as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # the first chunk arrived: the model is generating
        # the stream is closed: the next request is served (it would queue behind 4,000 tokens otherwise)
        out = c.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 2})
        assert out.status_code == 200
        metrics = c.get("/metrics").text
    line = next(l for l in metrics.splitlines() if l.startswith("cachegen_cancelled_total"))
    assert float(line.split()[-1]) >= 1


def test_metrics_and_health(server):
    with server.client() as c:
        assert (
            c.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
            ).status_code
            == 200
        )
        text = c.get("/metrics").text
        h = c.get("/health").json()
    for name in (
        "cachegen_requests_total",
        "cachegen_ttft_seconds_bucket",
        "cachegen_request_seconds_bucket",
        "cachegen_prompt_tokens_total",
        "cachegen_queue_depth",
        "cachegen_writer_depth",
        "cachegen_writer_dropped_chunks_total",
        "cachegen_level_choices_total",
    ):
        assert name in text, name
    assert 'endpoint="/v1/chat/completions",status="200"' in text
    assert h["status"] == "ok" and h["store"]["state"] == "ok" and h["model"] == "smollm2-135m"


# -- a store outage ------------------------------------------------------------------------


def test_redis_killed_mid_request_recomputes(tmp_path):
    redis = start_redis(tmp_path)
    srv = start_server(tmp_path, "--store", redis.url, "--chunk-tokens", str(CHUNK), "--max-queue", "4")
    try:
        client = openai.OpenAI(base_url=srv.base, api_key=API_KEY, max_retries=0)
        msgs = _chat(DOC, "Name one topic of the document.")
        first = client.chat.completions.create(model="m", messages=msgs, max_tokens=12, temperature=0)
        srv.wait_writes()
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            h = c.get("/health").json()
        assert h["store"]["state"] == "ok" and "s3cret-pw" not in json.dumps(h)
        # the reference: the whole prompt recomputed (what the loader does when nothing can be loaded)
        ref = client.chat.completions.create(
            model="m",
            messages=msgs,
            max_tokens=12,
            temperature=0,
            extra_body={"cachegen": {"use_cache": False, "store": False}},
        )

        async def go():
            a = openai.AsyncOpenAI(base_url=srv.base, api_key=API_KEY, max_retries=0)
            blocker = asyncio.create_task(
                a.completions.create(model="m", prompt="Tell a story.", max_tokens=80, temperature=0)
            )
            await asyncio.sleep(0.3)
            target = asyncio.create_task(
                a.chat.completions.create(model="m", messages=msgs, max_tokens=12, temperature=0)
            )
            await asyncio.sleep(0.3)
            redis.kill()  # the target request is in flight, waiting for the model
            out = await asyncio.gather(blocker, target)
            await a.close()
            return out[1]

        got = asyncio.run(go())
        assert got.choices[0].message.content == ref.choices[0].message.content
        assert got.usage.prompt_tokens_details.cached_tokens == 0
        faults = got.model_extra["cachegen"]["faults"]
        assert faults and "s3cret-pw" not in json.dumps(faults)
        assert first.usage.prompt_tokens == got.usage.prompt_tokens
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            h = c.get("/health").json()
            metrics = c.get("/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
        assert h["store"]["state"] == "unavailable" and "s3cret-pw" not in json.dumps(h)
        assert "s3cret-pw" not in metrics and "s3cret-pw" not in srv.log.read_text()
        line = next(l for l in metrics.splitlines() if l.startswith("cachegen_store_errors_total"))
        assert float(line.split()[-1]) >= 1
    finally:
        srv.stop()
        if redis.proc.poll() is None:
            redis.kill()
