"""One generation with automatic reuse: load the stored prefix, prefill the rest, decode, store what is new.

Every prompt is looked up in the store by its full chunks: the longest stored
chunk-aligned prefix is streamed in by the adaptive loader under the request's
deadline, and only the rest is prefilled. After the first token, the prompt's
new full chunks go to the background writer; after the answer, for a chat,
so do the chunks of the conversation *as the next turn will render it*
(:func:`cachegen.engine.chat.next_turn_prefix`), so turn n+1 loads turn n's
prompt and answer. Nothing here waits for the codec or the store to write.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cachegen.engine.chat import next_turn_prefix
from cachegen.engine.prefill import Decoder, generate, prefill
from cachegen.engine.sampling import Sampler, SamplingParams, TextStream
from cachegen.errors import CachegenError
from cachegen.kv import KVCache
from cachegen.store.url import redact
from cachegen.stream import ADAPTIVE, TEXT, LoadResult

if TYPE_CHECKING:
    from cachegen.engine.engine import Engine

log = logging.getLogger(__name__)


@dataclass
class RequestOptions:
    """cachegen's own per-request options (the ``cachegen`` field of a request)."""

    slo_s: float | None = None  # the load's deadline (None: no deadline, the best level)
    use_cache: bool = True  # load the stored prefix of the prompt
    store: bool = True  # store the new chunks in the background
    link: object = None  # the loader's link (benches emulate networks with it)
    policy: object = ADAPTIVE


class Completion:
    """A running generation; iterate it for text deltas, then call :meth:`finish`.

    ``load_ids``: the tokens to look up (default: the prompt's full chunks,
    leaving at least one token to prefill). ``messages``: the chat this prompt
    renders, for storing the answer as the next turn will contain it.
    ``cancelled()``: checked between model steps; true stops the generation.
    """

    def __init__(
        self,
        engine: Engine,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        opts: RequestOptions | None = None,
        *,
        messages: Sequence[dict] | None = None,
        load_ids: Sequence[int] | None = None,
        cancelled: Callable[[], bool] | None = None,
    ):
        self.engine, self.params = engine, params
        self.opts = opts or RequestOptions()
        self.prompt = list(prompt_ids)
        self.messages = list(messages) if messages is not None else None
        self.cancelled = cancelled
        c = engine.store.chunk_tokens
        self._load_ids = list(load_ids) if load_ids is not None else self.prompt[: (len(self.prompt) - 1) // c * c]
        self.load: LoadResult | None = None
        self.faults: list[str] = []
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None  # "stop", "length" or "cancelled"
        self.prefix_tokens = 0  # tokens whose KV the loader returned (stored or recomputed by it)
        self.cached_tokens = 0  # of those, loaded from the store
        self.ttft_s: float | None = None
        self.load_s = 0.0
        self.total_s = 0.0
        self.written_from: int | None = None  # first token queued for the background writer
        self._dec: Decoder | None = None
        self._finished = False

    @property
    def computed_tokens(self) -> int:
        return len(self.prompt) - self.cached_tokens

    @property
    def deadline_met(self) -> bool | None:
        if self.load is None or self.load.slo_s is None:
            return None
        return not self.load.missed

    def _load(self) -> KVCache | None:
        if not (self.opts.use_cache and self._load_ids):
            return None
        try:
            link = self.opts.link if self.opts.link is not None else self.engine.link
            res = self.engine.load(self._load_ids, slo_s=self.opts.slo_s, link=link, policy=self.opts.policy)
        except (CachegenError, OSError) as e:  # the store failed before the loader could: answer from text
            self.faults.append(redact(f"load: {type(e).__name__}: {e}"))
            log.warning("load failed, recomputing: %s", self.faults[-1])
            return None
        self.load = res
        self.faults.extend(redact(f) for f in res.faults)
        if res.kv is None:
            return None
        self.prefix_tokens = res.kv.end
        self.cached_tokens = sum(d.end - d.start for d in res.decisions if d.choice != TEXT and d.end <= res.kv.end)
        kv = res.kv
        return kv if kv.dtype == self.engine.model.dtype else kv.to(self.engine.model.dtype)

    def _first_new(self) -> int:
        """The first token whose KV is not stored (a chunk boundary)."""
        c = self.engine.store.chunk_tokens
        if self.load is None:
            return 0
        text = [d.start for d in self.load.decisions if d.choice == TEXT]
        end = min(text) if text else self.prefix_tokens
        return end // c * c

    def __iter__(self) -> Iterator[str]:
        eng = self.engine
        t0 = time.perf_counter()
        kv = self._load()
        self.load_s = time.perf_counter() - t0
        dec = self._dec = Decoder(eng.model, kv)
        ts = TextStream(eng.tokenizer, self.params.stop)
        eos = frozenset() if self.params.ignore_eos else frozenset(eng.eos_ids)
        steps = generate(
            dec, self.prompt[self.prefix_tokens :], Sampler(self.params), self.params.max_tokens, eos, self.cancelled
        )
        self.finish_reason = "length"
        for tok in steps:
            if self.ttft_s is None:
                self.ttft_s = time.perf_counter() - t0
                self._store_prompt()
            if tok in eos:
                self.finish_reason = "stop"
                break
            self.token_ids.append(tok)
            delta = ts.push(tok)
            if delta:
                yield delta
            if ts.stopped:
                self.finish_reason = "stop"
                break
        else:
            if self.cancelled is not None and self.cancelled():
                self.finish_reason = "cancelled"
        steps.close()
        rest = ts.flush()
        self.text = ts.text
        self.total_s = time.perf_counter() - t0
        if rest:
            yield rest

    def run(self) -> Completion:
        """Generate to the end (non-streaming use) and store the answer."""
        for _ in self:
            pass
        self.finish()
        return self

    # -- background stores -----------------------------------------------------
    def _store_prompt(self) -> None:
        if not self.opts.store or self._dec is None:
            return
        c = self.engine.store.chunk_tokens
        end = len(self.prompt) // c * c
        a = self._first_new()
        if end > a and self.engine.writer.submit(self.prompt[:end], self._dec.kv(a, end)):
            self.written_from = a

    def finish(self) -> None:
        """For a chat, queue the chunks holding the answer as the next turn will template them.

        May run a forward pass over the template's closing tokens (a few
        tokens); call it after the answer has been sent."""
        if self._finished:
            return
        self._finished = True
        dec = self._dec
        if not self.opts.store or self.messages is None or dec is None or self.finish_reason == "cancelled":
            return
        c = self.engine.store.chunk_tokens
        try:
            nxt = next_turn_prefix(self.engine.tokenizer, self.messages, self.text)
        except CachegenError:
            return
        end = len(nxt) // c * c
        prompt_end = len(self.prompt) // c * c
        start = prompt_end if self.written_from is not None else self._first_new()
        if end <= max(start, prompt_end):
            return
        seq = (self.prompt + self.token_ids)[: dec.length]
        p = 0
        for x, y in zip(seq, nxt):
            if x != y:
                break
            p += 1
        if p < start:  # the template does not render this prompt as a prefix of the next: nothing safe to store
            return
        if p >= end:
            kv = dec.kv(start, end)
        elif p == dec.length:  # the usual case: only the template's closing tokens are missing
            dec.feed(nxt[p:end])
            kv = dec.kv(start, end)
        else:  # the answer re-tokenizes differently: recompute from where they part
            head = dec.kv(0, p)
            tail = prefill(self.engine.model, nxt[p:end], prefix=head)
            kv = KVCache.concat([head.slice(start, p), tail]) if p > start else tail.slice(start, end)
        self.engine.writer.submit(nxt[:end], kv)

    def info(self) -> dict:
        """The ``cachegen`` field of a response: what the load did, redacted."""
        levels = [d.choice for d in self.load.decisions] if self.load is not None else []
        return {
            "cached_tokens": self.cached_tokens,
            "prefix_tokens": self.prefix_tokens,
            "computed_tokens": self.computed_tokens,
            "levels": levels,
            "load_s": round(self.load_s, 6),
            "ttft_s": round(self.ttft_s, 6) if self.ttft_s is not None else None,
            "slo_s": self.opts.slo_s,
            "deadline_met": self.deadline_met,
            "faults": list(self.faults),
        }
