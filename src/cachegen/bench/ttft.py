"""Time to first token against bandwidth, per method.

For a KV method the clock runs from the request to the first generated
token and covers: fetching the context's chunks over the link (a pipelined
fetcher thread, one transfer at a time), decoding each chunk as it arrives
(overlapping later transfers), injecting the cache into the model, and the
first decoding step (the prompt tail after the context). For ``recompute``
it covers fetching the token ids (4 bytes each) and prefilling context and
tail. Encoding is offline (done at ingest) and not counted.

Links: ``inproc`` sleeps as long as the bytes would take at that bandwidth
(:class:`cachegen.stream.link.ThrottledLink`); ``netns`` fetches them with
redis-py from a redis-server behind a tc-shaped veth (:mod:`cachegen.stream.netns`).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from cachegen.bench.baselines import CHUNK_TOKENS, KVCodec, label
from cachegen.bench.quality import text_ids
from cachegen.engine.hf_cache import to_transformers
from cachegen.engine.prefill import prefill
from cachegen.errors import ConfigError, StoreUnavailable
from cachegen.kv import KVCache

TTFT_FIELDS = ("method", "level", "bandwidth_gbps", "ttft_s")


@dataclass
class _Ref:
    index: int


class InprocFetcher:
    """Fetch blobs from memory through the stream package's throttled link at a constant bandwidth."""

    kind = "inproc"

    def __init__(self, latency_s: float = 0.0) -> None:
        self.latency_s = latency_s
        self.blobs: dict[str, list[bytes]] = {}
        self.link = None

    def stage(self, key: str, blobs: list[bytes]) -> None:
        self.blobs[key] = blobs

    def set_bandwidth(self, gbps: float) -> None:
        from cachegen.stream.link import ThrottledLink, constant

        self.link = ThrottledLink(constant(gbps), latency_s=self.latency_s)

    def begin(self) -> None:
        self.link.begin()

    def fetch(self, key: str, i: int) -> bytes:
        blobs = self.blobs[key]
        return self.link.fetch(lambda ref, level: blobs[ref.index], _Ref(i), 0)

    def close(self) -> None:
        pass


class NetnsFetcher:
    """Fetch blobs with redis-py GETs from a redis-server behind a shaped veth (:mod:`cachegen.stream.netns`)."""

    kind = "netns"

    def __init__(self) -> None:
        import redis

        from cachegen.stream.netns import NetnsRedis

        self.link = NetnsRedis(gbps=10.0, port=6390).start()
        self.client = redis.Redis.from_url(self.link.url.split("?")[0], socket_timeout=60)
        self.counts: dict[str, int] = {}

    def stage(self, key: str, blobs: list[bytes]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for i, b in enumerate(blobs):
            pipe.set(f"{key}:{i}", b)
        pipe.execute()
        self.counts[key] = len(blobs)

    def set_bandwidth(self, gbps: float) -> None:
        self.link.set_rate(gbps)

    def begin(self) -> None:
        pass

    def fetch(self, key: str, i: int) -> bytes:
        data = self.client.get(f"{key}:{i}")
        if data is None:
            raise StoreUnavailable(f"blob {key}:{i} is missing from the namespaced redis")
        return data

    def close(self) -> None:
        self.client.close()
        self.link.close()


def make_fetcher(link: str, latency_s: float = 0.0):
    if link == "inproc":
        return InprocFetcher(latency_s)
    if link == "netns":
        if latency_s:
            raise ConfigError("--link netns cannot add latency (the kernel here has no netem)")
        return NetnsFetcher()
    raise ConfigError(f"unknown link {link!r}: use inproc or netns")


def _stream_load(fetch: Callable[[int], bytes], n: int, decode: Callable[[bytes], KVCache]) -> tuple[KVCache, float, float]:
    """Fetch ``n`` blobs in a thread and decode each on arrival; returns (KV, fetch done at, decode seconds)."""
    q: queue.Queue = queue.Queue()
    t0 = time.perf_counter()
    done_at = [0.0]

    def producer() -> None:
        try:
            for i in range(n):
                q.put(fetch(i))
            done_at[0] = time.perf_counter() - t0
        except BaseException as e:  # hand the error to the consumer
            q.put(e)

    th = threading.Thread(target=producer, daemon=True)
    th.start()
    parts, dec = [], 0.0
    for _ in range(n):
        item = q.get()
        if isinstance(item, BaseException):
            th.join()
            raise item
        a = time.perf_counter()
        parts.append(decode(item))
        dec += time.perf_counter() - a
    th.join()
    return KVCache.concat(parts), done_at[0], dec


@torch.inference_mode()
def _first_token(model, cache, tail: Sequence[int]) -> int:
    ids = torch.as_tensor(list(tail), dtype=torch.long).view(1, -1)
    kwargs = {"cache": cache} if cache is not None else {}
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **kwargs)
    return int(out.logits[0, -1].argmax())


@torch.inference_mode()
def _recompute_first_token(model, ids: Sequence[int], step: int = 2048) -> int:
    from transformers import DynamicCache

    t = torch.as_tensor(list(ids), dtype=torch.long).view(1, -1)
    cache = DynamicCache(config=model.config)
    out = None
    for a in range(0, t.shape[1], step):
        out = model(input_ids=t[:, a : a + step], cache=cache, use_cache=True, logits_to_keep=1)
        cache = out.cache
    return int(out.logits[0, -1].argmax())


def time_kv_method(model, fetcher, key: str, n_chunks: int, codec: KVCodec, tail: Sequence[int]) -> dict:
    fetcher.begin()
    t0 = time.perf_counter()
    kv, fetch_s, decode_s = _stream_load(lambda i: fetcher.fetch(key, i), n_chunks, codec.decode)
    t1 = time.perf_counter()
    cache = to_transformers(kv, model.config, dtype=model.dtype)
    t2 = time.perf_counter()
    tok = _first_token(model, cache, tail)
    t3 = time.perf_counter()
    return {"ttft_s": t3 - t0, "fetch_s": fetch_s, "decode_s": decode_s, "inject_s": t2 - t1,
            "first_step_s": t3 - t2, "first_token": tok}


def time_recompute(model, fetcher, key: str, tail: Sequence[int]) -> dict:
    fetcher.begin()
    t0 = time.perf_counter()
    blob = fetcher.fetch(key, 0)
    ids = np.frombuffer(blob, dtype="<u4").tolist()
    t1 = time.perf_counter()
    tok = _recompute_first_token(model, ids + list(tail))
    t2 = time.perf_counter()
    return {"ttft_s": t2 - t0, "fetch_s": t1 - t0, "decode_s": 0.0, "inject_s": 0.0, "first_step_s": t2 - t1,
            "first_token": tok}


def run_ttft(
    lm,
    codecs: Sequence[KVCodec],
    context_tokens: int = 4096,
    bandwidths_gbps: Sequence[float] = (0.1, 1.0, 10.0),
    link: str = "inproc",
    latency_s: float = 0.0,
    tail_tokens: int = 16,
    include_recompute: bool = True,
    repeats: int = 1,
    recompute_repeats: int = 1,
    text: str = "pydoc-eval",
    chunk_tokens: int = CHUNK_TOKENS,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Rows of :data:`TTFT_FIELDS` plus a breakdown.

    ``ttft_s`` is the best of ``repeats`` runs (``recompute_repeats`` for
    recompute, whose long prefill is less sensitive to noise): on a shared
    machine the noise only ever adds time.
    """
    if not bandwidths_gbps or any(b <= 0 for b in bandwidths_gbps):
        raise ConfigError("bandwidths must be positive")
    model = lm.model
    ids = text_ids(lm.tokenizer, text, context_tokens + tail_tokens)
    ctx, tail = ids[:context_tokens], ids[context_tokens:]
    kv = prefill(model, ctx)
    chunks = kv.chunks(chunk_tokens)
    fetcher = make_fetcher(link, latency_s)
    rows = []
    try:
        staged = []
        if include_recompute:
            fetcher.stage("recompute", [np.asarray(ctx, dtype="<u4").tobytes()])
            staged.append(("recompute", None, 4 * len(ctx)))
        for c in codecs:
            blobs = [c.encode(ch) for ch in chunks]
            fetcher.stage(label(c), blobs)
            staged.append((label(c), c, sum(len(b) for b in blobs)))
        for gbps in bandwidths_gbps:
            fetcher.set_bandwidth(gbps)
            for key, c, size in staged:
                runs = []
                for _ in range(max(1, recompute_repeats if c is None else repeats)):
                    if c is None:
                        runs.append(time_recompute(model, fetcher, key, tail))
                    else:
                        runs.append(time_kv_method(model, fetcher, key, len(chunks), c, tail))
                r = min(runs, key=lambda r: r["ttft_s"])
                row = {"method": c.name if c else "recompute", "level": c.level if c else None,
                       "bandwidth_gbps": gbps, "ttft_s": r["ttft_s"], "size_bytes": size}
                row.update({k: r[k] for k in ("fetch_s", "decode_s", "inject_s", "first_step_s", "first_token")})
                rows.append(row)
                if log:
                    log(f"{gbps:g} Gbit/s {key:22s} TTFT {r['ttft_s']:.3f}s")
    finally:
        fetcher.close()
    return {
        "kind": "ttft",
        "model": lm.name,
        "context_tokens": context_tokens,
        "tail_tokens": len(tail),
        "link": link,
        "latency_s": latency_s,
        "repeats": repeats,
        "recompute_repeats": recompute_repeats,
        "dtype": str(model.dtype).replace("torch.", ""),
        "rows": rows,
    }
