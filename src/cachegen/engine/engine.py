"""The engine: a model bound to a codec profile and a context store.

It is the one place that knows all layers: it prefills and stores contexts
(:meth:`Engine.ingest`, resuming from what is stored), loads them back through
the streaming loader as a transformers-ready :class:`~cachegen.kv.KVCache`
(:meth:`Engine.load`), and answers prompts with automatic reuse
(:meth:`Engine.start`, :meth:`Engine.chat`, :meth:`Engine.complete`: the
stored prefix is loaded, the rest prefilled, the new chunks stored in the
background; see :mod:`cachegen.engine.completion`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from cachegen import codec as codec_mod
from cachegen.codec import Profile
from cachegen.engine.chat import normalize, render
from cachegen.engine.completion import Completion, RequestOptions
from cachegen.engine.dtype import cast_model, resolve_dtype
from cachegen.engine.hf_cache import values_per_token
from cachegen.engine.models import DEFAULT_MODEL, LoadedModel, load_model
from cachegen.engine.prefill import Decoder, eos_token_ids, prefill
from cachegen.engine.sampling import SamplingParams
from cachegen.engine.writer import BackgroundWriter
from cachegen.errors import ConfigError
from cachegen.kv import KVCache
from cachegen.store import ContextStore, Namespace, open_backend
from cachegen.stream import (
    ADAPTIVE,
    ComputeRates,
    CostModel,
    LoaderOptions,
    LoadResult,
    StreamingLoader,
    ThroughputEstimator,
)
from cachegen.stream import costs as costs_mod

ProfileSource = Callable[[LoadedModel], Profile]  # e.g. cachegen.calibrate.load_or_calibrate

log = logging.getLogger(__name__)


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

    def __init__(
        self,
        lm: LoadedModel,
        store: ContextStore,
        codec: codec_mod.ChunkCodec,
        costs: CostModel | None = None,
        max_pending_writes: int = 8,
    ):
        self.lm, self.store, self.codec = lm, store, codec
        self._costs = costs
        # one throughput estimate across loads: the next load starts from what the last one measured
        self.estimator = ThroughputEstimator()
        # and one measure of how fast decodes and recomputes really run here (the fastest policy plans with it)
        self.rates = ComputeRates()
        # what requests computed is stored off the request path (see cachegen.engine.writer)
        self.writer = BackgroundWriter(store, max_pending_writes)
        self.eos_ids = frozenset(eos_token_ids(lm.model, lm.tokenizer))
        self.link = None  # the loader's link when a request names none (benches emulate networks with it)

    @classmethod
    def open(
        cls,
        model: str = DEFAULT_MODEL,
        store_url: str | None = None,
        chunk_tokens: int = 256,
        levels: Sequence[int] | None = None,
        progress: bool = True,
        dtype: str | torch.dtype | None = None,
        *,
        profile: Profile | ProfileSource,
    ) -> Engine:
        """Load the model and open the store at ``store_url``, with the codec ``profile``.

        ``profile`` is a :class:`~cachegen.codec.Profile` or a function of the
        loaded model that returns one; pass
        :func:`cachegen.calibrate.load_or_calibrate` to calibrate once and cache.
        It is a parameter because calibration needs a live model and so sits in
        the layer above this one. The model serves in ``dtype`` (default
        ``"auto"``: bf16 where the CPU computes it natively, else fp32, see
        :mod:`cachegen.engine.dtype`); the profile source gets the fp32 model,
        so profiles do not depend on the serving dtype.
        """
        lm = load_model(model, progress=progress)
        if not isinstance(profile, Profile):
            profile = profile(lm)
        dtype = resolve_dtype(dtype)
        if dtype != torch.float32:
            cast_model(lm.model, dtype)
        codec = codec_mod.Codec(profile, lm.fingerprint)
        # the KV depends on the compute dtype too: bf16 and fp32 servers must not share chunks
        ns = Namespace(f"{lm.fingerprint}-{str(dtype).removeprefix('torch.')}", codec_mod.FORMAT_VERSION, profile.id)
        store = ContextStore(
            open_backend(store_url),
            ns,
            codec,
            chunk_tokens,
            levels=tuple(levels) if levels else tuple(sorted(profile.levels)),
        )
        return cls(lm, store, codec)

    def close(self) -> None:
        self.writer.close()
        self.store.backend.close()

    def __enter__(self) -> Engine:
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
        """Decode and recompute cost models, measured on this machine and cached for a week
        (``costs.MAX_AGE_S``): a measurement from another machine or an older one is taken again."""
        if self._costs is not None:
            return self._costs
        path = costs_mod.engine_path(
            self.lm.fingerprint, str(self.model.dtype), self.store.namespace.profile_id, self.store.chunk_tokens
        )

        def measure() -> CostModel:
            log.info("measuring decode and recompute costs on this machine (cached in %s)", path)
            ids = torch.randint(100, 5000, (1024,), generator=torch.Generator().manual_seed(0)).tolist()
            n = self.store.chunk_tokens
            sample = self.recompute(None, ids[:n])
            cm = costs_mod.calibrate_decode(self.codec, sample, self.store.levels)
            return costs_mod.calibrate_recompute(self.recompute, ids, n, prefix_tokens=512, base=cm)

        self._costs = costs_mod.load_or_measure(path, measure)
        return self._costs

    # -- store -----------------------------------------------------------------
    def ingest(self, tokens: Sequence[int], progress: bool = False, group_chunks: int = 4) -> IngestResult:
        """Prefill and store ``tokens`` at every level of the store; never prefills what is stored.

        The leading chunks stored at every level are loaded (the loader, no
        deadline), the rest is prefilled on top, ``group_chunks`` chunks at a
        time, each group stored before the next one starts: an interrupted
        ingest resumes where it stopped."""
        tokens = list(tokens)
        plan = self.store.plan(tokens)
        want = set(self.store.levels)
        if plan and all(want <= i.sizes.keys() for i in plan):
            return IngestResult(len(plan), len(tokens), 0, len(tokens), 0.0, 0.0)
        c = self.store.chunk_tokens
        stored = 0
        for info in plan:
            if not (want <= info.sizes.keys()) or info.ref.num_tokens != c:
                break
            stored = info.ref.end
        t = time.perf_counter()
        prefix = self.load(tokens[:stored], slo_s=None).kv if stored else None
        dec = Decoder(self.model, prefix)
        start = dec.length
        prefill_s = time.perf_counter() - t
        encode_s, written = 0.0, 0
        for a in range(start, len(tokens), group_chunks * c):
            b = min(a + group_chunks * c, len(tokens))
            t = time.perf_counter()
            dec.feed(tokens[a:b], progress=progress)
            prefill_s += time.perf_counter() - t
            t = time.perf_counter()
            # the context ends at len(tokens), not at this part's end: that is where the next tokens follow
            written += len(self.store.put_context(tokens[:b], dec.kv(a, b), context_end=len(tokens)))
            encode_s += time.perf_counter() - t
        return IngestResult(len(plan), len(tokens), written, start, prefill_s, encode_s)

    def ingest_text(self, text: str, progress: bool = False) -> IngestResult:
        ids = self.tokenizer(text, add_special_tokens=True)["input_ids"]
        return self.ingest(ids, progress=progress)

    # -- load and answer ---------------------------------------------------------
    def loader(self, slo_s: float | None = None, link=None, policy=ADAPTIVE, reserve_s: float = 0.0) -> StreamingLoader:
        """A loader over this engine's store, codec and model (``slo_s`` None: no deadline)."""
        opts = LoaderOptions(
            policy=policy,
            slo_s=slo_s,
            reserve_s=reserve_s,
            levels=self.store.levels,
            dtype=self.model.dtype,
            values_per_token=values_per_token(self.model.config),
        )
        return StreamingLoader(
            self.store,
            self.codec,
            self.recompute,
            opts,
            costs=self.costs(),
            link=link,
            estimator=self.estimator,
            rates=self.rates,
        )

    def load(self, context_ids: Sequence[int], slo_s: float | None = None, link=None, policy=ADAPTIVE) -> LoadResult:
        """The KV of the cached prefix of ``context_ids`` (the loader recomputes on any fault)."""
        return self.loader(slo_s, link, policy).load(list(context_ids))

    # -- requests with automatic reuse --------------------------------------------
    def start(
        self, prompt_ids: Sequence[int], params: SamplingParams | None = None, opts: RequestOptions | None = None, **kw
    ) -> Completion:
        """A generation for ``prompt_ids`` that loads its stored prefix and stores what is new.

        Iterate the result for text deltas, then call ``finish()`` (see
        :class:`~cachegen.engine.completion.Completion`). Not thread-safe: one
        generation at a time per engine (the server runs them on one worker)."""
        prompt_ids = list(prompt_ids)
        if not prompt_ids:
            raise ConfigError("the prompt must hold at least one token")
        self.check_prompt(prompt_ids, (params or SamplingParams()).max_tokens)
        return Completion(self, prompt_ids, params or SamplingParams(), opts, **kw)

    def check_prompt(self, prompt_ids: Sequence[int], max_tokens: int) -> None:
        """Token ids within the vocabulary, prompt + ``max_tokens`` within the model's positions."""
        vocab = self.vocab_size
        bad = next((t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < vocab)), None)
        if bad is not None:
            raise ConfigError(f"token id {bad!r} is outside the vocabulary [0, {vocab})")
        limit = self.max_positions
        if limit is not None and len(prompt_ids) + max_tokens > limit:
            raise ConfigError(
                f"the prompt's {len(prompt_ids)} tokens plus max_tokens {max_tokens} exceed the "
                f"model's {limit} positions: shorten the prompt or lower max_tokens"
            )

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_input_embeddings().weight.shape[0])

    @property
    def max_positions(self) -> int | None:
        cfg = self.model.config.get_text_config(decoder=True)
        n = getattr(cfg, "max_position_embeddings", None)
        return int(n) if n else None

    def chat_prompt(self, messages: Sequence[dict]) -> tuple[list[dict[str, str]], list[int]]:
        """The normalized messages and their prompt under the model's chat template."""
        msgs = normalize(list(messages))
        return msgs, render(self.tokenizer, msgs, add_generation_prompt=True)

    def chat(
        self, messages: Sequence[dict], params: SamplingParams | None = None, opts: RequestOptions | None = None
    ) -> Completion:
        """Answer a chat (run to the end); the answer is stored as the next turn will template it."""
        msgs, ids = self.chat_prompt(messages)
        return self.start(ids, params, opts, messages=msgs).run()

    def complete(
        self, prompt_ids: Sequence[int], params: SamplingParams | None = None, opts: RequestOptions | None = None
    ) -> Completion:
        """Continue ``prompt_ids`` (run to the end), reusing and storing its chunks."""
        return self.start(prompt_ids, params, opts).run()

    def generate(
        self,
        context_ids: Sequence[int],
        question_ids: Sequence[int],
        max_new_tokens: int = 16,
        use_cache: bool = True,
        slo_s: float | None = None,
        link=None,
        policy=ADAPTIVE,
    ) -> Generation:
        """Greedy answer to ``context_ids + question_ids``, loading all of ``context_ids`` that is stored.

        With ``use_cache`` the context's KV is streamed from the store (chunks
        that are not stored, or that fail, are recomputed); without, the whole
        prompt is prefilled from text. TTFT counts everything up to the first token.
        """
        context_ids, question_ids = list(context_ids), list(question_ids)
        if not question_ids:
            raise ConfigError("the question must hold at least one token (the model needs logits)")
        opts = RequestOptions(slo_s=slo_s, use_cache=use_cache, store=False, link=link, policy=policy)
        run = self.start(
            context_ids + question_ids, SamplingParams(max_tokens=max_new_tokens), opts, load_ids=context_ids
        ).run()
        ttft = run.ttft_s or 0.0
        return Generation(
            run.token_ids,
            run.text,
            ttft,
            run.prefix_tokens,
            run.load,
            {"load_s": run.load_s, "prefill_s": ttft - run.load_s},
        )
