"""The engine: a model bound to a codec profile and a context store.

It is the one place that knows all layers: it prefills and stores contexts
(:meth:`Engine.ingest`), loads them back through the streaming loader as a
transformers-ready :class:`~cachegen.kv.KVCache` (:meth:`Engine.load`), and
answers prompts from a loaded prefix (:meth:`Engine.generate`), measuring the
time to first token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from cachegen import codec as codec_mod
from cachegen.engine.hf_cache import values_per_token
from cachegen.engine.models import DEFAULT_MODEL, LoadedModel, load_model
from cachegen.engine.prefill import continue_from, eos_token_ids, prefill
from cachegen.errors import ConfigError, StoreError
from cachegen.kv import KVCache
from cachegen.store import ContextStore, Namespace, open_backend
from cachegen.stream import ADAPTIVE, CostModel, LoadResult, StreamingLoader, ThroughputEstimator
from cachegen.stream import costs as costs_mod


@dataclass
class IngestResult:
    chunks: int
    tokens: int
    written: int  # chunks encoded and written by this call (0: all were stored already)
    reused_tokens: int  # leading tokens whose KV came from the store instead of prefill
    prefill_s: float
    encode_s: float


@dataclass
class Generation:
    token_ids: list[int]
    text: str
    ttft_s: float  # call to first token: load + suffix prefill + first decoding step
    cached_tokens: int
    load: LoadResult | None = None
    timings: dict[str, float] = field(default_factory=dict)


class Engine:
    """A model, its codec profile and a store, with ingest / load / generate."""

    def __init__(self, lm: LoadedModel, store: ContextStore, codec: codec_mod.Codec, costs: CostModel | None = None):
        self.lm, self.store, self.codec = lm, store, codec
        self._costs = costs
        # one throughput estimate across loads: the next load starts from what the last one measured
        self.estimator = ThroughputEstimator()

    @classmethod
    def open(cls, model: str = DEFAULT_MODEL, store_url: str | None = None, chunk_tokens: int = 256,
             levels: Sequence[int] | None = None, progress: bool = True,
             dtype: torch.dtype = torch.bfloat16) -> "Engine":
        """Load the model, its profile (calibrated once and cached) and open the store at ``store_url``.

        The model serves in ``dtype`` (bf16 by default: 2-3x faster prefill on
        CPU, and the KV size serving engines keep); profiles are always
        calibrated in fp32 so they do not depend on it.
        """
        lm = load_model(model, progress=progress)
        profile = codec_mod.load_or_calibrate(lm)
        if dtype != torch.float32:
            lm.model.to(dtype)
        codec = codec_mod.Codec(profile, lm.fingerprint)
        # the KV depends on the compute dtype too: bf16 and fp32 servers must not share chunks
        ns = Namespace(f"{lm.fingerprint}-{str(dtype).removeprefix('torch.')}", codec_mod.FORMAT_VERSION, profile.id)
        store = ContextStore(open_backend(store_url), ns, codec, chunk_tokens,
                             levels=tuple(levels) if levels else tuple(sorted(profile.levels)))
        return cls(lm, store, codec)

    def close(self) -> None:
        self.store.backend.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- model work ------------------------------------------------------------
    @property
    def model(self):
        return self.lm.model

    @property
    def tokenizer(self):
        return self.lm.tokenizer

    def recompute(self, prefix: KVCache | None, token_ids: Sequence[int]) -> KVCache:
        """KV of ``token_ids`` after ``prefix``: the loader's fallback and its text option."""
        return prefill(self.model, token_ids, prefix=prefix)

    def costs(self) -> CostModel:
        """Decode and recompute cost models, measured once on this machine and cached."""
        if self._costs is not None:
            return self._costs
        path = costs_mod.default_path(f"{self.lm.fingerprint}-{self.store.namespace.profile_id}")
        try:
            self._costs = CostModel.load(path)
            return self._costs
        except (OSError, ValueError, KeyError, TypeError):
            pass
        ids = torch.randint(100, 5000, (1024,), generator=torch.Generator().manual_seed(0)).tolist()
        n = self.store.chunk_tokens
        sample = self.recompute(None, ids[:n])
        cm = costs_mod.calibrate_decode(self.codec, sample, self.store.levels)
        cm = costs_mod.calibrate_recompute(self.recompute, ids, n, prefix_tokens=512, base=cm)
        cm.save(path)
        self._costs = cm
        return cm

    # -- store -----------------------------------------------------------------
    def ingest(self, tokens: Sequence[int], progress: bool = False) -> IngestResult:
        """Prefill and store ``tokens`` at every level of the store; skips what is stored already."""
        tokens = list(tokens)
        plan = self.store.plan(tokens)
        want = set(self.store.levels)
        if plan and all(want <= i.sizes.keys() for i in plan):
            return IngestResult(len(plan), len(tokens), 0, len(tokens), 0.0, 0.0)
        t = time.perf_counter()
        kv = prefill(self.model, tokens, progress=progress)
        prefill_s = time.perf_counter() - t
        t = time.perf_counter()
        written = self.store.put_context(tokens, kv)
        return IngestResult(len(plan), len(tokens), len(written), 0, prefill_s, time.perf_counter() - t)

    def ingest_text(self, text: str, progress: bool = False) -> IngestResult:
        ids = self.tokenizer(text, add_special_tokens=True)["input_ids"]
        return self.ingest(ids, progress=progress)

    # -- load and answer ---------------------------------------------------------
    def loader(self, slo_s: float | None = None, link=None, policy=ADAPTIVE, reserve_s: float = 0.0) -> StreamingLoader:
        return StreamingLoader(self.store, self.codec, self.recompute, costs=self.costs(), slo_s=slo_s, link=link,
                               policy=policy, levels=self.store.levels, reserve_s=reserve_s, dtype=self.model.dtype,
                               estimator=self.estimator, values_per_token=values_per_token(self.model.config))

    def load(self, context_ids: Sequence[int], slo_s: float | None = None, link=None, policy=ADAPTIVE) -> LoadResult:
        """The KV of the cached prefix of ``context_ids`` (the loader recomputes on any fault)."""
        return self.loader(slo_s, link, policy).load(list(context_ids))

    def generate(self, context_ids: Sequence[int], question_ids: Sequence[int], max_new_tokens: int = 16,
                 use_cache: bool = True, slo_s: float | None = None, link=None, policy=ADAPTIVE) -> Generation:
        """Greedy answer to ``context_ids + question_ids``.

        With ``use_cache`` the context's KV is streamed from the store (chunks
        that are not stored, or that fail, are recomputed); without, the whole
        prompt is prefilled from text. TTFT counts everything up to the first token.
        """
        context_ids, question_ids = list(context_ids), list(question_ids)
        if not question_ids:
            raise ConfigError("the question must hold at least one token (the model needs logits)")
        t0 = time.perf_counter()
        res: LoadResult | None = None
        kv: KVCache | None = None
        if use_cache:
            try:
                res = self.load(context_ids, slo_s, link, policy)
            except StoreError:  # the store failed before the loader could: answer from text
                res = None
            kv = res.kv if res is not None else None
        cached = kv.end if kv is not None else 0
        t1 = time.perf_counter()
        tail = (context_ids + question_ids)[cached:]
        if kv is not None and kv.dtype != self.model.dtype:
            kv = kv.to(self.model.dtype)
        step = continue_from(self.model, kv, tail)
        first = int(torch.argmax(step.logits[-1]))
        ttft = time.perf_counter() - t0
        out = [first]
        eos = eos_token_ids(self.model, self.tokenizer)
        cache = step.cache
        with torch.inference_mode():
            while len(out) < max_new_tokens and out[-1] not in eos:
                r = self.model(input_ids=torch.tensor([[out[-1]]]), cache=cache, use_cache=True)
                cache = r.cache
                out.append(int(torch.argmax(r.logits[0, -1])))
        return Generation(out, self.tokenizer.decode(out, skip_special_tokens=True), ttft, cached, res,
                          {"load_s": t1 - t0, "prefill_s": ttft - (t1 - t0)})
