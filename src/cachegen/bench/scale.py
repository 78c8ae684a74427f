"""``cachegen bench scale``: time to first token and the load's peak memory against context length.

Per model and context length, four methods over one link (1 Gbit/s by default):
``recompute`` (prefill of the whole context), ``uniform8`` (8-bit KV), the
project codec at the level the cost model predicts fastest at that bandwidth
(``cachegen``, its level in ``level``) and ``adaptive`` (the loader's ``fastest``
policy over raw 16- and 8-bit KV and that level, :func:`cachegen.bench.ttft.adaptive_ladder`).

Every row runs in a **fresh subprocess** (``python -m cachegen.bench.scale JOB``),
so that its peak memory is its own: the child loads the model, warms the decoders
up on one chunk, resets the kernel's peak-RSS mark (``/proc/self/clear_refs``),
runs the request and reads the mark back (``VmHWM``). ``peak_rss_mb`` is the
peak of the load (the request up to the whole KV); ``request_peak_rss_mb`` adds
the cache's injection into the model and the first step; ``base_rss_mb`` is the
child before the load (the model and the interpreter); ``kv_mb`` the decoded KV
in the model's dtype. The recompute child's prefill is the one prefill of each
context: it hands its KV (recorded, sliding layers included) to the parent,
which stores it for the other methods (encoding is offline and not timed).
Recompute is measured once per context; its rows at each bandwidth add the
token ids' transfer (4 bytes per token) to it.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SCALE_FIELDS = ("method", "model", "context_tokens", "bandwidth_gbps", "ttft_s", "peak_rss_mb")
SCALE_COLS = (
    "model",
    "context_tokens",
    "method",
    "level",
    "bandwidth_gbps",
    "ttft_s",
    "load_s",
    "peak_rss_mb",
    "base_rss_mb",
    "kv_mb",
)
ROOM = 64  # positions kept free for the question after the context
TAIL_TOKENS = 16
CHILD_TIMEOUT_S = 1800.0
MIB = 1 << 20


@dataclass(frozen=True)
class ModelPlan:
    """One model and the context lengths it is run at."""

    model: str
    contexts: tuple[int, ...]


def default_plan(positions: dict[str, int | None] | None = None) -> list[ModelPlan]:
    """SmolLM2 at 1K-8K and Gemma-3 up to 32K (each up to its positions less :data:`ROOM`)."""
    from cachegen.engine.models import model_positions

    pos = positions or {m: model_positions(m) for m in ("smollm2-135m", "gemma3-270m")}
    s = pos.get("smollm2-135m") or 8192
    g = pos.get("gemma3-270m") or 32768
    return [
        ModelPlan("smollm2-135m", (1024, 2048, 4096, s - ROOM)),
        ModelPlan("gemma3-270m", (8192, 16384, g - ROOM)),
    ]


# -- memory -----------------------------------------------------------------------------


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field}")


class PeakRss:
    """The process's peak resident memory since :meth:`reset` (Linux: VmHWM after ``clear_refs``)."""

    def reset(self) -> None:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS

    @staticmethod
    def rss_mb() -> float:
        return _status_kb("VmRSS") / 1024

    @staticmethod
    def peak_mb() -> float:
        return _status_kb("VmHWM") / 1024


# -- the child: one row in a fresh process ---------------------------------------------


def _child(job: dict) -> dict:
    import torch

    from cachegen.bench.baselines import UniformCodec, Variant, project_codec
    from cachegen.bench.cli import load
    from cachegen.bench.ttft import _Bench, _first_token, adaptive_ladder
    from cachegen.engine.hf_cache import to_transformers
    from cachegen.engine.prefill import Decoder
    from cachegen.errors import ConfigError
    from cachegen.stream import FASTEST, CostModel, LoaderOptions, StreamingLoader, ThroughputEstimator

    lm = load(job["model"], job["dtype"])
    model = lm.model
    ids = json.loads(Path(job["ids"]).read_text())
    n = job["context_tokens"]
    ctx, tail = ids[:n], ids[n:]
    mem = PeakRss()
    out: dict[str, Any] = {}
    if job["method"] == "recompute":
        with torch.inference_mode():
            Decoder(model).feed(tail)  # warm-up: kernels, allocator
        base = mem.rss_mb()
        mem.reset()
        t0 = time.perf_counter()
        dec = Decoder(model)
        dec.feed(ctx)
        t1 = time.perf_counter()
        with torch.inference_mode():
            logits = dec.feed(tail)
        tok = int(logits.argmax())
        t2 = time.perf_counter()
        out.update(ttft_s=t2 - t0, load_s=t1 - t0, first_token=tok, base_rss_mb=base, peak_rss_mb=mem.peak_mb())
        out["request_peak_rss_mb"] = out["peak_rss_mb"]
        kv = dec.kv(0, n)
        out["kv_mb"] = kv.nbytes / MIB
        if job.get("save_kv"):
            torch.save({"layers": [(l.k, l.v, l.kind.value, l.window) for l in kv.layers]}, job["save_kv"])
        return out

    bench = _Bench("inproc", 0.0, Path(job["root"]))
    try:
        bench.set_bandwidth(job["bandwidth_gbps"])
        level = job.get("level")
        vpt = job["values_per_token"]
        codec: Any
        if job["method"] == "uniform8":
            codec, label = UniformCodec(8), "uniform8"
            opts = LoaderOptions(policy=0, slo_s=None, dtype=model.dtype, values_per_token=vpt)
        elif job["method"] == "cachegen":
            if level is None:
                raise ConfigError("the cachegen method needs its level")
            codec, label = project_codec(lm), f"cachegen/L{level}"
            opts = LoaderOptions(policy=int(level), slo_s=None, dtype=model.dtype, values_per_token=vpt)
        else:
            codec = adaptive_ladder([Variant(project_codec(lm), int(level))] if level is not None else [])
            label = _adaptive_label(level)
            opts = LoaderOptions(policy=FASTEST, slo_s=None, dtype=model.dtype, values_per_token=vpt)
        store = bench.store(lm.fingerprint, label, job["chunk_tokens"], codec)
        costs = CostModel.from_json(job["costs"]) if job.get("costs") else None
        est = ThroughputEstimator()
        infos = store.plan(ctx)
        # warm-up on the first chunk at every stored level, through the link: the decoders' JIT and
        # the estimator (a link the process has used before, as the engine keeps its estimator)
        bench.link.begin()
        for lv in infos[0].sizes:
            t = time.perf_counter()
            data = bench.link.fetch(store.get, infos[0].ref, lv)
            est.add(len(data), time.perf_counter() - t)
            codec.decode(data, key=infos[0].ref.key)
        loader = StreamingLoader(
            store,
            codec,
            lambda prefix, t_ids: prefill_after(model, prefix, t_ids),
            opts,
            costs=costs,
            link=bench.link,
            estimator=est,
        )
        base = mem.rss_mb()
        mem.reset()
        t0 = time.perf_counter()
        res = loader.load(ctx, t0=t0)
        t1 = time.perf_counter()
        peak_load = mem.peak_mb()
        if res.kv is None or res.faults or res.cached_tokens != len(ctx):
            raise RuntimeError(f"{label}: the load did not read the stored context: {res.summary()}")
        kv_mb = res.kv.nbytes / MIB
        cache = to_transformers(res.kv, model.config, dtype=model.dtype)
        tok = _first_token(model, cache, tail)
        t2 = time.perf_counter()
        out.update(
            ttft_s=t2 - t0,
            load_s=t1 - t0,
            first_token=tok,
            base_rss_mb=base,
            peak_rss_mb=peak_load,
            request_peak_rss_mb=mem.peak_mb(),
            kv_mb=kv_mb,
            fetched_bytes=sum(d.bytes for d in res.decisions),
        )
        if job["method"] == "adaptive":
            from collections import Counter

            from cachegen.stream import TEXT

            out["formats"] = dict(Counter("text" if c == TEXT else codec.label(int(c)) for c in res.choices))
        return out
    finally:
        bench.close()


def _adaptive_label(level: int | None) -> str:
    """The adaptive method's store namespace: one per ladder (its project-codec rung's level)."""
    return "adaptive" if level is None else f"adaptive-L{level}"


def prefill_after(model, prefix, token_ids):
    from cachegen.engine.prefill import prefill

    return prefill(model, token_ids, prefix=prefix)


def _run_child(job: dict, workdir: Path) -> dict:
    """One row in a fresh interpreter (its peak memory its own)."""
    path = workdir / f"job-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(job))
    res_path = path.with_suffix(".out.json")
    cmd = [sys.executable, "-m", "cachegen.bench.scale", str(path), str(res_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    if p.returncode != 0 or not res_path.exists():
        raise RuntimeError(f"bench scale child ({job['method']}) failed (rc {p.returncode}): {p.stderr[-2000:]}")
    return json.loads(res_path.read_text())


# -- the parent ---------------------------------------------------------------------------


def _load_kv(path: Path):
    import torch

    from cachegen.kv import KVCache, KVLayer, LayerKind

    d = torch.load(path)
    return KVCache([KVLayer(k, v, LayerKind(kind), window) for k, v, kind, window in d["layers"]])


@dataclass
class _LevelModel:
    """The project codec's levels on one model: bytes per chunk and the cost model (measured once per model)."""

    codec: Any
    sizes: dict[int, int]
    costs: Any
    values_per_token: int

    @classmethod
    def measure(cls, lm, kv, chunk_tokens: int) -> _LevelModel:
        from cachegen.bench.baselines import project_codec
        from cachegen.codec import LEVELS
        from cachegen.stream.costs import calibrate_decode

        codec = project_codec(lm)
        sample = kv.slice(chunk_tokens, 2 * chunk_tokens) if kv.end >= 2 * chunk_tokens else kv
        costs = calibrate_decode(codec, sample, LEVELS, dtype=lm.model.dtype)
        sizes = {lv: len(codec.encode(sample, lv)) * chunk_tokens // sample.num_tokens for lv in LEVELS}
        return cls(codec, sizes, costs, kv.num_values // kv.num_tokens)

    def fastest(self, n_tokens: int, chunk_tokens: int, gbps: float) -> int:
        """The level the cost model predicts loads ``n_tokens`` soonest at ``gbps``."""
        from cachegen.stream import PlanChunk, simulate

        chunks = [
            PlanChunk(i, a, chunk_tokens, chunk_tokens * self.values_per_token, self.sizes)
            for i, a in enumerate(range(0, n_tokens, chunk_tokens))
        ]
        return min(self.sizes, key=lambda lv: simulate(chunks, [lv] * len(chunks), gbps, self.costs))


def run_scale(
    plan: Sequence[ModelPlan],
    *,
    bandwidths_gbps: Sequence[float] = (1.0,),
    dtype: str = "auto",
    text: str = "pydoc-eval",
    chunk_tokens: int = 256,
    project_codec: bool = True,
) -> dict:
    """Rows of :data:`SCALE_FIELDS` (and :data:`SCALE_COLS`), one child process per row.

    ``project_codec`` False: without the ``cachegen`` method, and the adaptive ladder holds only
    raw KV (a model without a codec profile, e.g. a small test model)."""
    from cachegen.bench.baselines import UniformCodec, Variant
    from cachegen.bench.cli import load
    from cachegen.bench.quality import text_ids
    from cachegen.bench.ttft import _Bench, adaptive_costs, adaptive_ladder
    from cachegen.engine.dtype import auto_dtype_name

    if dtype == "auto":
        dtype = auto_dtype_name()

    rows: list[dict] = []
    t_start = time.perf_counter()
    for mp in plan:
        lm = load(mp.model, dtype)
        levels: _LevelModel | None = None
        # per level of the ladder's project-codec rung (the costs do not depend on the context)
        ladder_costs: dict[int, dict] = {}
        with tempfile.TemporaryDirectory(prefix="cachegen-scale-") as tmp:
            work = Path(tmp)
            for n in mp.contexts:
                ids = text_ids(lm.tokenizer, text, n + TAIL_TOKENS)
                ids_path = work / f"ids-{n}.json"
                ids_path.write_text(json.dumps(ids))
                base = {"model": mp.model, "dtype": dtype, "ids": str(ids_path), "context_tokens": n}
                kv_path = work / f"kv-{n}.pt"
                t = time.perf_counter()
                rec = _run_child({**base, "method": "recompute", "save_kv": str(kv_path)}, work)
                log.info(
                    "%s %d tokens: recompute %.2fs (child %.0fs)", mp.model, n, rec["ttft_s"], time.perf_counter() - t
                )
                kv = _load_kv(kv_path).to(lm.model.dtype)
                kv_path.unlink()
                for gbps in bandwidths_gbps:
                    link_s = n * 4 * 8 / (gbps * 1e9)  # the token ids cross the link
                    rows.append(_row(mp.model, n, "recompute", None, gbps, {**rec, "ttft_s": rec["ttft_s"] + link_s}))
                if levels is None and project_codec:
                    levels = _LevelModel.measure(lm, kv, chunk_tokens)
                bench = _Bench("inproc", 0.0, work / f"store-{n}")
                try:
                    for gbps in bandwidths_gbps:
                        level = levels.fastest(n, chunk_tokens, gbps) if levels is not None else None
                        best = [Variant(levels.codec, level)] if levels is not None and level is not None else []
                        ladder = adaptive_ladder(best)
                        ckey = -1 if level is None else level
                        if ckey not in ladder_costs:
                            ladder_costs[ckey] = adaptive_costs(
                                lm.model, ladder, kv, ids[:n], chunk_tokens, 0.0
                            ).to_json()
                        for v in (Variant(UniformCodec(8), 0), *best):
                            bench.store(lm.fingerprint, v.label, chunk_tokens, v.codec).put_context(
                                ids[:n], kv, [v.level]
                            )
                        bench.store(lm.fingerprint, _adaptive_label(level), chunk_tokens, ladder).put_context(
                            ids[:n], kv, ladder.levels
                        )
                        job = {
                            **base,
                            "root": str(work / f"store-{n}"),
                            "bandwidth_gbps": gbps,
                            "chunk_tokens": chunk_tokens,
                            "level": level,
                            "values_per_token": kv.num_values // kv.num_tokens,
                        }
                        for method in ("uniform8", *(["cachegen"] if best else []), "adaptive"):
                            costs = ladder_costs[ckey] if method == "adaptive" else None
                            r = _run_child({**job, "method": method, "costs": costs}, work)
                            rows.append(_row(mp.model, n, method, level if method == "cachegen" else None, gbps, r))
                            log.info("%s %d tokens %g Gbit/s: %s %.3fs", mp.model, n, gbps, method, r["ttft_s"])
                finally:
                    bench.close()
                del kv
        del lm
    return {
        "kind": "scale",
        "dtype": dtype,
        "bandwidths_gbps": list(bandwidths_gbps),
        "chunk_tokens": chunk_tokens,
        "memory": "peak RSS of a fresh subprocess per row (VmHWM after clear_refs), from the request to the whole KV",
        "elapsed_s": time.perf_counter() - t_start,
        "rows": rows,
    }


def _row(model: str, n: int, method: str, level: int | None, gbps: float, r: dict) -> dict:
    row: dict[str, Any] = {"method": method, "model": model, "context_tokens": n, "bandwidth_gbps": gbps}
    row["level"] = level
    keys = ("ttft_s", "load_s", "peak_rss_mb", "request_peak_rss_mb", "base_rss_mb", "kv_mb", "first_token")
    row.update({k: r[k] for k in keys if k in r})
    row["within_memory"] = row["peak_rss_mb"] <= row["base_rss_mb"] + 1.5 * row["kv_mb"]
    for k in ("fetched_bytes", "formats"):
        if k in r:
            row[k] = r[k]
    return row


def section(model: str, out: Path, sizes: dict, quick: bool, *, project_codec: bool, dtype: str) -> list[str]:
    """``bench all``'s scale section: ``scale.json`` and a results.md table (quick: ``model`` at one
    small context; full: :func:`default_plan`)."""
    from cachegen.bench.plots import table

    plan = [ModelPlan(model, (int(sizes.get("scale") or sizes["ttft"]),))] if quick else default_plan()
    res = run_scale(plan, dtype=dtype, project_codec=project_codec)
    (out / "scale.json").write_text(json.dumps(res, indent=1) + "\n")
    return [
        "## Scaling with context length",
        "",
        f"Model in {dtype}, link `inproc` at {', '.join(map(str, res['bandwidths_gbps']))} Gbit/s; one fresh "
        "process per row. `peak_rss_mb`: the peak resident memory of the load (from the request to the whole KV), "
        "`base_rss_mb` the process before it, `kv_mb` the decoded KV.",
        "",
        table(res["rows"], SCALE_COLS, markdown=True),
        "",
    ]


# -- command -------------------------------------------------------------------------------


def cmd_scale(args: argparse.Namespace) -> int:
    from cachegen.bench.plots import table
    from cachegen.engine.models import model_positions
    from cachegen.errors import ConfigError

    if args.quick:
        plan = [ModelPlan(args.model or "smollm2-135m", (QUICK_TOKENS,))]
    else:
        plan = default_plan()
        if args.model:
            plan = [p for p in plan if p.model == args.model] or [ModelPlan(args.model, (1024, 2048, 4096))]
    for p in plan:
        top = model_positions(p.model)
        if top is not None and max(p.contexts) + TAIL_TOKENS > top:
            raise ConfigError(f"{p.model} takes at most {top} positions: {max(p.contexts)} + {TAIL_TOKENS} do not fit")
    res = run_scale(plan, bandwidths_gbps=args.bandwidth_gbps, dtype=args.dtype, text=args.text)
    print(table(res["rows"], SCALE_COLS))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


QUICK_TOKENS = 512


def register(sub) -> None:
    from cachegen.bench.cli import DTYPES

    p = sub.add_parser("scale", help="TTFT and the load's peak memory against context length, per method")
    p.add_argument(
        "--model",
        default=None,
        metavar="NAME|DIR",
        help="one model (default: smollm2-135m at 1K-8K tokens and gemma3-270m up to 32K)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", *DTYPES),
        help="model precision (default auto: bfloat16 on a CPU with AVX512-BF16 or AMX, else float32)",
    )
    p.add_argument(
        "--bandwidth-gbps",
        type=lambda v: [float(x) for x in v.split(",") if x.strip()],
        default=[1.0],
        metavar="GBPS,...",
        help="comma-separated link bandwidths in Gbit/s (default 1.0)",
    )
    p.add_argument(
        "--text",
        default="pydoc-eval",
        metavar="FILE|NAME",
        help="context text: a UTF-8 text file, or a corpus name such as pydoc-eval (the default)",
    )
    p.add_argument("--quick", action="store_true", help=f"one model at {QUICK_TOKENS} tokens (a smoke test)")
    p.add_argument("--json", metavar="PATH", help="write the result as JSON ('-': stdout)")
    p.set_defaults(func=cmd_scale)


def main(argv: Sequence[str] | None = None) -> int:
    """The child: ``python -m cachegen.bench.scale JOB.json OUT.json``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print(
            "usage: python -m cachegen.bench.scale JOB.json OUT.json (run by `cachegen bench scale`)", file=sys.stderr
        )
        return 2
    job = json.loads(Path(args[0]).read_text())
    res = _child(job)
    Path(args[1]).write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
