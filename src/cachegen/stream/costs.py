"""Cost models the planner predicts with: fetch, decode and recompute seconds.

Defaults are conservative guesses for a small CPU machine; :func:`calibrate`
replaces them with quick measurements on this machine, and :meth:`CostModel.save`
/ :meth:`CostModel.load` cache the result as JSON (under
``$CACHEGEN_HOME/stream/`` by default, keyed by the caller, e.g. model and
codec profile).
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch

from cachegen import paths
from cachegen.errors import ConfigError
from cachegen.kv import KVCache

TEXT = "text"


@dataclass
class CostModel:
    # decode seconds per million KV values, per level (missing level: ``decode_s_per_mvalue_default``)
    decode_s_per_mvalue: dict[int, float] = field(default_factory=dict)
    decode_s_per_mvalue_default: float = 0.010
    decode_fixed_s: float = 0.002
    # a chunk decoded in one call with others that waited with it in the loader's queue
    # (``DecodesManyInto``): its share of the call, per million values, per level; its fixed part
    # is shared out in it (missing level: the single-chunk model above)
    decode_batched_s_per_mvalue: dict[int, float] = field(default_factory=dict)
    # recompute: fixed + n * (per_token + per_token_ctx * (prefix + n / 2))  (linear + attention)
    recompute_fixed_s: float = 0.010
    recompute_s_per_token: float = 1.0e-3
    recompute_s_per_token_ctx: float = 2.0e-7
    fetch_latency_s: float = 0.001  # per request, on top of bytes / bandwidth
    # CPU seconds a fetch spends per MB (the store's read and checksum, a socket's copies), which a
    # compute stage busy beside it loses: learned from the loader's fetches (ComputeRates), 0 until then
    fetch_cpu_s_per_mb: float = 0.0
    # copying decoded values into the cache (a codec without decode_into: its whole chunk; KVCache.concat)
    stitch_bytes_per_s: float = 1.5e9
    source: str = "defaults"
    # where and when it was measured (calibrated models): a cached measurement is reused only on the
    # same kind of machine and while it is recent (:func:`load_fresh`)
    machine: str = ""
    measured_at: float = 0.0

    # -- predictions ---------------------------------------------------------
    def decode_s(self, level: int, num_values: int, batched: bool = False) -> float:
        """One chunk's decode; ``batched``: decoded in one call with chunks that waited with it."""
        if batched and int(level) in self.decode_batched_s_per_mvalue:
            return self.decode_batched_s_per_mvalue[int(level)] * num_values / 1e6
        per = self.decode_s_per_mvalue.get(int(level), self.decode_s_per_mvalue_default)
        return self.decode_fixed_s + per * num_values / 1e6

    def recompute_s(self, prefix_tokens: int, n_tokens: int) -> float:
        if n_tokens <= 0:
            return 0.0
        return self.recompute_fixed_s + n_tokens * (
            self.recompute_s_per_token + self.recompute_s_per_token_ctx * (prefix_tokens + n_tokens / 2)
        )

    def stitch_s(self, num_values: int, itemsize: int) -> float:
        """Copying ``num_values`` decoded values in memory (joining chunks with :meth:`KVCache.concat`).

        The loader decodes each chunk into its slice of a preallocated cache (inside the chunk's
        decode, which :func:`calibrate_decode` times that way), so no join follows the last decode;
        its plan still keeps this much back from the deadline, as a margin, because the replay
        (``bench/replay.py``) still adds it to each load."""
        return num_values * itemsize / self.stitch_bytes_per_s

    def fetch_s(self, nbytes: int, gbps: float) -> float:
        if gbps <= 0:
            return float("inf")
        return self.fetch_latency_s + nbytes * 8 / (gbps * 1e9)

    def fetch_cpu_s(self, nbytes: int) -> float:
        """The CPU time a fetch of ``nbytes`` takes from the cores the decodes run on.

        Why it matters: on a small machine the fetch thread's read and checksum share the cores with
        the decode pool, so a decode beside a big fetch ends later by about that time (measured on 2
        cores: a 3 MB fetch of 8-bit KV spent 4.4-5.5 ms of CPU, and an L7 decode beside such fetches
        took 30-36 ms against 21 ms alone). A plan that mixes big, cheap-to-decode chunks with small,
        slow-to-decode ones pays it on every decode the big fetches overlap."""
        return self.fetch_cpu_s_per_mb * nbytes / 1e6

    # -- persistence ---------------------------------------------------------
    def to_json(self) -> dict:
        d = asdict(self)
        for f in ("decode_s_per_mvalue", "decode_batched_s_per_mvalue"):
            d[f] = {str(k): v for k, v in getattr(self, f).items()}
        return d

    @classmethod
    def from_json(cls, d: dict) -> CostModel:
        d = dict(d)
        for f in ("decode_s_per_mvalue", "decode_batched_s_per_mvalue"):
            d[f] = {int(k): float(v) for k, v in d.get(f, {}).items()}
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})

    def save(self, path: str | Path) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(p.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        tmp.replace(p)

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        return cls.from_json(json.loads(Path(path).read_text()))


def default_path(key: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in key)[:120]
    return paths.subdir("stream") / f"costs-{safe}.json"


def engine_path(weights_fingerprint: str, dtype: str, profile_id: str, chunk_tokens: int) -> Path:
    """Where the Engine caches its measured costs: keyed by everything they depend on (the weights,
    the compute dtype, the codec profile and the chunk size the recompute is timed at), so a
    measurement in bf16 is never used in fp32. The vLLM connector reads the same file."""
    return default_path(f"{weights_fingerprint}-{dtype.removeprefix('torch.')}-{profile_id}-{chunk_tokens}")


# A cached measurement older than this is taken again: the machine's load, its neighbours on a
# shared host, a kernel or library update all move the costs the planner's deadlines rest on.
MAX_AGE_S = 7 * 24 * 3600.0


def machine_id() -> str:
    """The kind of machine the costs were measured on: CPU model and count. (Not torch's thread count,
    a per-process setting: vLLM's worker reads the file that cachegen's engine wrote.)"""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu} x{os.cpu_count()}"


def stamp(cm: CostModel, now: float | None = None) -> CostModel:
    """Mark ``cm`` as measured here and now (before :meth:`CostModel.save`)."""
    cm.machine = machine_id()
    cm.measured_at = time.time() if now is None else now
    return cm


def load_fresh(path: str | Path, max_age_s: float = MAX_AGE_S, now: float | None = None) -> CostModel | None:
    """The cached costs at ``path`` if they were measured on this kind of machine less than
    ``max_age_s`` ago; None if they are missing, unreadable, foreign or stale (measure again)."""
    try:
        cm = CostModel.load(path)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    now = time.time() if now is None else now
    if cm.machine != machine_id() or not (0.0 <= now - cm.measured_at < max_age_s):
        return None
    return cm


def load_or_measure(path: str | Path, measure: Callable[[], CostModel]) -> CostModel:
    """The fresh cached costs at ``path`` (:func:`load_fresh`), else ``measure()``, stamped and saved there."""
    cm = load_fresh(path)
    if cm is None:
        cm = stamp(measure())
        cm.save(path)
    return cm


def best_time(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` runs of ``fn``, in seconds (the least disturbed by other work)."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


# Inside the loader a chunk decodes in 1.3-1.7x the best isolated time measured here (a payload
# fetched moments ago, cold caches, the fetch thread running): measured 20-28 ms against 15 ms
# for a 256-token SmolLM2 chunk. With 15% headroom the demo missed its 2 s deadline by 20 ms.
DECODE_HEADROOM = 1.5
STITCH_HEADROOM = 1.0


CALIBRATION_BATCH = 8  # chunks per call when timing batched decodes: the loader's default prefetch


def calibrate_decode(
    codec,
    sample: KVCache,
    levels: Sequence[int],
    repeats: int = 2,
    base: CostModel | None = None,
    dtype: torch.dtype | None = None,
    batch: int = CALIBRATION_BATCH,
) -> CostModel:
    """Measure decode seconds per million values for each level on ``sample``, as the loader
    decodes: into a preallocated cache of ``dtype`` (default: the sample's; the loader's
    ``LoaderOptions.dtype``), the copy included. A codec that decodes several chunks in one call
    (:class:`~cachegen.codec.protocol.DecodesManyInto`) is also timed on ``batch`` copies of the
    sample at consecutive positions in one call, for the batched model (each chunk's share)."""
    # here: importing the stream package loads no codec
    from cachegen.codec.protocol import DecodesManyInto, decode_into

    cm = base or CostModel()
    mv = sample.num_values / 1e6
    slot = KVCache.allocate(sample, sample.num_tokens, start=sample.start, dtype=dtype)
    n = sample.num_tokens
    many = isinstance(codec, DecodesManyInto) and batch > 1 and n > 0
    run = [KVCache(sample.layers, start=sample.start + j * n) for j in range(batch)] if many else []
    out = KVCache.allocate(sample, batch * n, start=sample.start, dtype=dtype) if many else None
    for level in levels:
        blob = codec.encode(sample, level)
        decode_into(codec, blob, slot)  # warm-up (JIT, caches)
        t = best_time(partial(decode_into, codec, blob, slot), repeats)
        cm.decode_s_per_mvalue[int(level)] = max(t - cm.decode_fixed_s, 0.0) / mv * DECODE_HEADROOM
        if many:
            blobs = [blob, *(codec.encode(part, level) for part in run[1:])]
            decode_many = partial(codec.decode_many_into, blobs, out, [n] * batch)
            decode_many()
            tb = best_time(decode_many, repeats) / batch
            cm.decode_batched_s_per_mvalue[int(level)] = min(tb, t) / mv * DECODE_HEADROOM
    # joining chunks: a copy of the whole context, slower in the loader than alone (cold caches,
    # allocation); the slowest of a few joins of 8 chunks, divided by STITCH_HEADROOM (measured in
    # the demo: 22-53 ms for 93 MB, 1.7-4.2 GB/s)
    parts = [KVCache(sample.layers, start=i * sample.num_tokens) for i in range(8)]
    worst = max(best_time(lambda: KVCache.concat(parts), 1) for _ in range(3))
    nbytes = 8 * sample.num_values * sample.dtype.itemsize
    cm.stitch_bytes_per_s = nbytes / max(worst, 1e-6) / STITCH_HEADROOM
    cm.source = "calibrated"
    return cm


def calibrate_recompute(
    recompute: Callable, tokens: Sequence[int], chunk_tokens: int, prefix_tokens: int, base: CostModel | None = None
) -> CostModel:
    """Fit the recompute model from two runs: ``chunk_tokens`` at prefix 0 and at ``prefix_tokens``."""
    if len(tokens) < prefix_tokens + chunk_tokens or prefix_tokens <= 0:
        raise ConfigError("calibrate_recompute needs prefix_tokens + chunk_tokens tokens, prefix_tokens > 0")
    cm = base or CostModel()
    first = list(tokens[:chunk_tokens])
    recompute(None, first)  # warm-up
    t0 = best_time(lambda: recompute(None, first), 2)
    prefix = recompute(None, list(tokens[:prefix_tokens]))
    later = list(tokens[prefix_tokens : prefix_tokens + chunk_tokens])
    t1 = best_time(lambda: recompute(prefix, later), 2)
    n = chunk_tokens
    ctx = max((t1 - t0) / (n * prefix_tokens), 0.0)
    per_tok = max((t0 - cm.recompute_fixed_s) / n - ctx * n / 2, 1e-6)
    cm.recompute_s_per_token = per_tok * 1.1
    cm.recompute_s_per_token_ctx = ctx * 1.1
    cm.source = "calibrated"
    return cm


def calibrate_fetch_latency(get: Callable[[], bytes], repeats: int = 5, base: CostModel | None = None) -> CostModel:
    """Per-request overhead of the store, from fetching one small payload a few times."""
    cm = base or CostModel()
    get()
    times = sorted(best_time(get, 1) for _ in range(repeats))
    cm.fetch_latency_s = times[len(times) // 2]
    return cm
