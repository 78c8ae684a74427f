"""``CacheGenConnector``: vLLM's KV, stored and streamed through cachegen (v1 connector API, CPU).

Load it with::

    LLM(model=DIR, kv_transfer_config={
        "kv_connector": "CacheGenConnector",
        "kv_connector_module_path": "cachegen.integrations.vllm.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": "redis://127.0.0.1:6379/0", "slo_s": 1.0}})

vLLM builds one instance in its scheduler and one in each worker.

* Scheduler: :meth:`get_num_new_matched_tokens` plans the prompt's chunk keys in the
  store (one round trip) and reports the chunk-aligned stored prefix beyond what vLLM
  computed itself, always leaving the last prompt token to compute. Keys live in a
  namespace naming the producing engine and dtype, so vLLM-made KV never mixes with
  transformers-made KV. :meth:`build_connector_meta` tells the workers what to load
  (positions at or after vLLM's own computed tokens only: blocks its prefix cache
  shares are never written) and which prompt chunks a step completed (chunked prefill
  completes a chunk in a later step).
* Worker: :meth:`start_load_kv` runs cachegen's streaming loader under ``slo_s`` and
  scatters the decoded chunks into vLLM's blocks. The connector cannot recompute, so a
  chunk that failed (timeout, missing, corrupt) or that the planner left to text is not
  written; its blocks and all later ones are reported by
  :meth:`get_block_ids_with_load_errors` and vLLM recomputes them (with
  ``kv_load_failure_policy="recompute"``): never a wrong cache.
  :meth:`wait_for_save` copies the completed chunks out of the paged buffers and hands
  them to a background thread that encodes and stores them (a bounded queue: a full
  queue drops the chunk and counts it), so encoding does not hold up the model.

Extra config: ``store`` (any cachegen store URL; default the local store), ``levels``
(stored levels; default every profile level), ``policy`` (``"adaptive"``, ``"rule"``
or a level), ``slo_s`` (the load deadline; default 1.0), ``chunk_tokens`` (default 256,
a multiple of vLLM's block size), ``lookup_timeout_s`` (default 0.5), ``save_queue``
(chunks waiting to be encoded; default 64).
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole

from cachegen.errors import CachegenError, ConfigError
from cachegen.integrations.vllm.layout import PagedLayout
from cachegen.kv import KVCache, KVLayer
from cachegen.store.url import redact

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from cachegen.integrations.vllm.setup import StoreSetup
    from cachegen.stream import StreamingLoader

log = logging.getLogger(__name__)


# -- scheduler -> worker ---------------------------------------------------------------


@dataclass
class LoadSpec:
    """Load tokens ``[start, end)`` of ``tokens[:end]`` into ``block_ids`` (the request's blocks from 0)."""

    req_id: str
    tokens: list[int]
    block_ids: list[int]
    start: int
    end: int


@dataclass
class SaveSpec:
    """Store the chunks of tokens ``[start, end)`` (whole chunks) held by ``block_ids``."""

    req_id: str
    tokens: list[int]  # the prompt up to ``end``: chunk keys chain over the whole prefix
    block_ids: list[int]  # the blocks of [start, end)
    start: int
    end: int
    context_end: int  # the prompt's length: the codec spends its bits on the tokens just before it


@dataclass
class CacheGenMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class ConnectorStats:
    """Counters of one connector instance (the scheduler's or a worker's)."""

    lookups: int = 0
    lookup_errors: int = 0
    matched_tokens: int = 0  # reported to vLLM as loadable
    loads: int = 0
    loaded_tokens: int = 0  # written into vLLM's blocks
    load_error_blocks: int = 0  # reported for recompute
    load_faults: list[str] = field(default_factory=list)
    load_s: float = 0.0
    saves_queued: int = 0  # chunk groups handed to the saver
    save_drops: int = 0  # the queue was full
    chunks_saved: int = 0  # chunks the saver wrote
    save_errors: int = 0

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d["load_faults"] = list(self.load_faults)  # a snapshot, not the live list
        return d


@dataclass
class _Request:
    """What the scheduler side tracks per request."""

    tokens: list[int]
    stored: set[int]  # chunk indices already in the store
    matched: int = 0  # chunk-aligned stored prefix (what a load can give)
    load: tuple[int, int] | None = None
    block_ids: list[int] = field(default_factory=list)
    next_save: int = 0  # the first chunk not yet considered for saving


_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


def _layer_order(names: list[str]) -> list[str]:
    """vLLM's layer names in model order (``model.layers.<i>.self_attn.attn``)."""

    def key(name: str) -> tuple[int, str]:
        m = _LAYER_INDEX.search(name)
        return (int(m.group(1)) if m else len(names), name)

    return sorted(names, key=key)


def _cpu_write_kernel(dtype: torch.dtype, block_size: int, head_dim: int, kv_cache_dtype: str):
    """The CPU attention backend's own KV write, for :meth:`PagedLayout.probe`."""
    import vllm._custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block_size, head_dim, kv_cache_dtype)

    def write(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        nb, h, bs, _ = cache.shape
        kc, vc = cache.view(nb, h, 2 * bs, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa)

    return write, isa


class CacheGenConnector(KVConnectorBase_V1):
    """A vLLM KV connector over a cachegen store (see the module docstring)."""

    _live: ClassVar[weakref.WeakSet[CacheGenConnector]] = weakref.WeakSet()

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        mc = vllm_config.model_config
        self.block_size = int(vllm_config.cache_config.block_size)
        # the codec (numba, llvmlite) loads only now: vLLM's worker start-up scans every loaded
        # module's objects for Triton kernels and fails on llvmlite's, and vLLM imports this
        # module to read the class before it starts the worker
        from cachegen.integrations.vllm.setup import ConnectorConfig, open_setup

        self.config = ConnectorConfig.from_extra(extra)
        if self.config.chunk_tokens % self.block_size:
            raise ConfigError(
                f"chunk_tokens {self.config.chunk_tokens} must be a multiple of vLLM's block size "
                f"{self.block_size}: set kv_connector_extra_config['chunk_tokens']"
            )
        if getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning(
                "kv_load_failure_policy is %r: a chunk that fails to load fails the request; "
                "set it to 'recompute' so vLLM recomputes it",
                self._kv_transfer_config.kv_load_failure_policy,
            )
        self.dtype: torch.dtype = mc.dtype
        self.setup: StoreSetup = open_setup(mc.model, self.dtype, self.config)
        hf = mc.hf_text_config
        self.num_layers = int(hf.num_hidden_layers)
        self.num_kv_heads = int(mc.get_num_kv_heads(vllm_config.parallel_config))
        self.head_dim = int(mc.get_head_size())
        if getattr(hf, "sliding_window", None) or any(
            t != "full_attention" for t in getattr(hf, "layer_types", None) or []
        ):
            raise ConfigError("CacheGenConnector supports full-attention models only")
        self.stats = ConnectorStats()
        self._lock = threading.Lock()
        # scheduler side
        self._reqs: dict[str, _Request] = {}
        self._pending_loads: set[str] = set()
        # worker side
        self._layers: list[torch.Tensor] = []
        self._layout: PagedLayout | None = None
        self._errors: set[int] = set()
        self._failed_reqs: set[str] = set()  # requests whose load failed in this step
        self._loader: StreamingLoader | None = None
        self._saves: queue.Queue = queue.Queue(maxsize=self.config.save_queue)
        self._saver: threading.Thread | None = None
        if role == KVConnectorRole.WORKER:
            self._loader = self._make_loader()
            self._saver = threading.Thread(target=self._save_loop, name="cachegen-saver", daemon=True)
            self._saver.start()
        CacheGenConnector._live.add(self)
        log.info(
            "CacheGenConnector (%s): store %s, namespace %s, chunk %d tokens, levels %s, policy %s, slo %ss",
            role.name.lower(),
            redact(self.config.store),
            self.setup.namespace.model_fingerprint,
            self.config.chunk_tokens,
            list(self.setup.levels),
            self.config.policy,
            self.config.slo_s,
        )

    @classmethod
    def instances(cls, role: KVConnectorRole | None = None) -> list[CacheGenConnector]:
        """The live connectors of this process (tests and benchmarks read their counters)."""
        return [c for c in list(cls._live) if role is None or c.role == role]

    # ==================================================================================
    # scheduler side
    # ==================================================================================
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        tokens = list(request.prompt_token_ids or [])
        n = self.config.chunk_tokens
        full = len(tokens) // n * n  # whole chunks of the prompt (the ones worth storing)
        usable = (len(tokens) - 1) // n * n  # vLLM must compute at least the last prompt token
        st = _Request(tokens, set())
        if full:
            self.stats.lookups += 1
            try:
                infos = self.setup.store.plan(tokens[:full], timeout=self.config.lookup_timeout_s)
            except CachegenError as e:  # a store that is down is a miss, never a stalled scheduler
                self.stats.lookup_errors += 1
                log.warning("cachegen lookup failed, computing from text: %s", redact(str(e)))
                infos = []
            st.stored = {i.ref.index for i in infos if i.cached}
            for info in infos:
                if not info.cached or info.ref.end > usable:
                    break
                st.matched = info.ref.end
        old = self._reqs.get(request.request_id)
        if old is not None:  # asked again (the request could not be scheduled): keep the progress
            st.next_save, st.block_ids = old.next_save, old.block_ids
        self._reqs[request.request_id] = st
        ext = st.matched - num_computed_tokens
        return (ext, False) if ext > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None or num_external_tokens <= 0:
            return
        st.load = (st.matched - num_external_tokens, st.matched)
        st.block_ids = list(blocks.get_block_ids()[0])
        self._pending_loads.add(request.request_id)
        self.stats.matched_tokens += num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = CacheGenMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0])
            if new.req_id in self._pending_loads and st.load is not None:
                a, b = st.load
                meta.loads.append(LoadSpec(new.req_id, st.tokens[:b], st.block_ids[: b // self.block_size], a, b))
            self._saves_for(meta, new.req_id, st, new.num_computed_tokens, scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            ids = cached.new_block_ids[i]
            if ids is not None:
                if req_id in cached.resumed_req_ids:  # after a preemption: the whole new block list
                    st.block_ids = list(ids[0])
                else:
                    st.block_ids.extend(ids[0])
            self._saves_for(meta, req_id, st, cached.num_computed_tokens[i], scheduled.get(req_id, 0))
        self._pending_loads.clear()
        return meta

    def _saves_for(self, meta: CacheGenMetadata, req_id: str, st: _Request, before: int, scheduled: int) -> None:
        """Prompt chunks this step completes that the store lacks (after this step's forward).

        When vLLM recomputes from an earlier position (blocks that failed to load, a
        preemption), the chunks from there on are considered again: the worker drops the
        saves of a step whose load failed, as they were computed on top of unloaded blocks."""
        n, bs = self.config.chunk_tokens, self.block_size
        if before < st.next_save * n:
            st.next_save = before // n
        done = min(before + scheduled, len(st.tokens)) // n
        todo = [c for c in range(st.next_save, done) if c not in st.stored]
        st.next_save = max(st.next_save, done)
        # consecutive chunks travel together (one copy, one put)
        while todo:
            run = [todo[0]]
            while len(run) < len(todo) and todo[len(run)] == run[-1] + 1:
                run.append(todo[len(run)])
            todo = todo[len(run) :]
            a, b = run[0] * n, (run[-1] + 1) * n
            if len(st.block_ids) * bs < b:
                log.warning("request %s: blocks for tokens [%d, %d) not known; not saving them", req_id, a, b)
                continue
            meta.saves.append(SaveSpec(req_id, st.tokens[:b], st.block_ids[a // bs : b // bs], a, b, len(st.tokens)))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._reqs.pop(request.request_id, None)
        self._pending_loads.discard(request.request_id)
        return False, None  # the saver copies blocks out in the step itself: they may be freed now

    # ==================================================================================
    # worker side
    # ==================================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = _layer_order(list(kv_caches))
        if len(names) != self.num_layers:
            raise ConfigError(f"vLLM registered {len(names)} KV layers, the model has {self.num_layers}")
        self._layers = [kv_caches[n] for n in names]
        first = self._layers[0]
        if first.device.type != "cpu":
            raise ConfigError(f"CacheGenConnector reads vLLM's KV on the CPU; this one is on {first.device}")
        kv_dtype = str(self._vllm_config.cache_config.cache_dtype)
        if kv_dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ConfigError(f"CacheGenConnector does not support a quantized KV cache ({kv_dtype})")
        write, isa = _cpu_write_kernel(first.dtype, self.block_size, self.head_dim, kv_dtype)
        self._layout = PagedLayout.probe(write, self.block_size, self.num_kv_heads, self.head_dim, first.dtype)
        for layer in self._layers:
            self._layout.check(layer)
        log.info("CacheGenConnector: %d layers %s, %s kernel, layout probed", len(names), tuple(first.shape), isa)

    def _make_loader(self) -> StreamingLoader:
        from cachegen.stream import LoaderOptions, StreamingLoader, ThroughputEstimator

        s = self.setup
        opts = LoaderOptions(
            policy=self.config.policy,
            slo_s=self.config.slo_s,
            levels=s.levels,
            dtype=self.dtype,
            values_per_token=2 * self.num_layers * self.num_kv_heads * self.head_dim,
        )
        return StreamingLoader(
            s.store, s.codec, self._no_recompute, opts, costs=s.costs, estimator=ThroughputEstimator()
        )

    def _no_recompute(self, prefix: KVCache | None, token_ids: list[int]) -> KVCache:
        """The loader's text path: vLLM recomputes these tokens, so this is a placeholder never written
        (:meth:`_load_prefix` keeps only the chunks before the first one decided as text)."""
        n, start = len(token_ids), prefix.end if prefix is not None else 0
        z = torch.zeros(self.num_kv_heads, n, self.head_dim, dtype=self.dtype)
        return KVCache([KVLayer(z, z) for _ in range(self.num_layers)], start=start)

    def _load_prefix(self, tokens: list[int]) -> tuple[KVCache | None, int, list[str]]:
        """The adapter to cachegen's loader: the decoded KV, how many leading tokens of it were
        really loaded (chunks before the first one left to text or failed), and the faults."""
        from cachegen.stream import TEXT

        assert self._loader is not None
        res = self._loader.load(tokens)
        good = 0
        for d in res.decisions:
            if d.choice == TEXT or d.start != good:
                break
            good = d.end
        return res.kv, min(good, res.kv.end if res.kv is not None else 0), list(res.faults)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        self._failed_reqs.clear()
        if not isinstance(meta, CacheGenMetadata):
            return
        for spec in meta.loads:
            self._load(spec)

    def _load(self, spec: LoadSpec) -> None:
        bs = self.block_size
        t = time.perf_counter()
        kv: KVCache | None = None
        good = 0
        faults: list[str] = []
        try:
            kv, good, faults = self._load_prefix(spec.tokens)
        except Exception as e:  # any failure of the load: vLLM recomputes, the request goes on
            faults = [redact(f"load: {type(e).__name__}: {e}")]
            log.warning("cachegen load failed, vLLM recomputes: %s", faults[0])
        good = min(good, spec.end)
        written = 0
        if kv is not None and good > spec.start and self._layout is not None:
            try:
                part = kv.slice(spec.start, good)
                self._layout.write(self._layers, spec.block_ids[spec.start // bs : good // bs], part)
                written = good - spec.start
            except Exception as e:  # a layout or shape mismatch: recompute all of it
                faults.append(redact(f"scatter: {type(e).__name__}: {e}"))
                log.warning("cachegen could not write the loaded KV, vLLM recomputes: %s", faults[-1])
                good = spec.start
        bad = spec.block_ids[max(good, spec.start) // bs : spec.end // bs]
        with self._lock:
            self._errors.update(bad)
            if bad:
                self._failed_reqs.add(spec.req_id)
            self.stats.loads += 1
            self.stats.loaded_tokens += written
            self.stats.load_error_blocks += len(bad)
            self.stats.load_faults.extend(faults)
            self.stats.load_s += time.perf_counter() - t
        if bad:
            log.info(
                "cachegen loaded %d of %d tokens; %d blocks left to vLLM", written, spec.end - spec.start, len(bad)
            )

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv writes every layer before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # all layers are copied once per step, in wait_for_save

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, CacheGenMetadata) or not meta.saves or self._layout is None:
            return
        for spec in meta.saves:
            if spec.req_id in self._failed_reqs:  # computed over blocks vLLM will recompute: saved after that
                continue
            kv = self._layout.read(self._layers, spec.block_ids, spec.start)  # a copy: the blocks may be reused
            try:
                self._saves.put_nowait((spec.tokens, kv, spec.context_end))
                with self._lock:
                    self.stats.saves_queued += 1
            except queue.Full:
                with self._lock:
                    self.stats.save_drops += 1
                log.warning("cachegen save queue full: chunks [%d, %d) not stored", spec.start, spec.end)

    def _save_loop(self) -> None:
        while True:
            item = self._saves.get()
            try:
                if item is None:
                    return
                tokens, kv, end = item
                refs = self.setup.save_store().put_context(tokens, kv, self.setup.levels, context_end=end)
                with self._lock:
                    self.stats.chunks_saved += len(refs)
            except Exception as e:  # a failed save is a later miss, never a failed request
                with self._lock:
                    self.stats.save_errors += 1
                log.warning("cachegen save failed: %s", redact(f"{type(e).__name__}: {e}"))
            finally:
                self._saves.task_done()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued chunk is stored (True) or ``timeout`` s pass (False)."""
        end = None if timeout is None else time.monotonic() + timeout
        while self._saves.unfinished_tasks:
            if end is not None and time.monotonic() > end:
                return False
            time.sleep(0.01)
        return True

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            out, self._errors = self._errors, set()
        return out

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def shutdown(self) -> None:
        if self._saver is not None and self._saver.is_alive():
            if not self.flush(timeout=30.0):
                log.warning("cachegen: %d chunk saves still queued at shutdown", self._saves.unfinished_tasks)
            self._saves.put(None)
            self._saver.join(timeout=5.0)
        self.setup.close()
