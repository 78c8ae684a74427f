"""``cachegen bench vllm``: warm time to first token and stored bytes of vLLM with and without a KV connector.

Rows (``method``): ``vllm`` (plain, prefix caching off: a fresh engine or another
machine computes the whole prompt), ``vllm+example-connector`` (vLLM's own
``ExampleConnector``: raw KV as safetensors files) and ``vllm+cachegen``
(:class:`~cachegen.integrations.vllm.connector.CacheGenConnector` storing one level,
loading with the adaptive loader under ``--slo``). Each method runs in a fresh vLLM
engine: a cold request (stores), then ``--runs`` warm requests of the same prompt with
``max_tokens=1`` (their median is ``ttft_s``). ``stored_bytes``: what the connector
stored for the context.

It runs from cachegen's environment and starts each engine in the vLLM environment
(``--vllm-python``, default ``.venv-vllm/bin/python``: ``make vllm-setup``) as a
subprocess of this module (``--worker``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cachegen.errors import ConfigError

log = logging.getLogger(__name__)

METHODS = ("vllm", "vllm+example-connector", "vllm+cachegen")
COLS = ("method", "store", "context_tokens", "ttft_s", "cold_s", "stored_bytes", "loaded_tokens")
QUESTION = "\n\nQuestion: what is this text about? Answer in one sentence."


def default_vllm_python() -> Path:
    return Path(__file__).resolve().parents[3] / ".venv-vllm" / "bin" / "python"


# -- the main environment's side -----------------------------------------------------------


def run_vllm_bench(
    model: str = "smollm2-135m",
    context_tokens: int = 2048,
    json_path: str | None = None,
    vllm_python: str | None = None,
    level: int = 4,
    slo_s: float = 2.0,
    runs: int = 3,
    store: str | None = None,
    methods: tuple[str, ...] = METHODS,
    text: str = "pydoc-eval",
) -> list[dict]:
    from cachegen import corpus
    from cachegen.integrations.vllm.prepare import prepare

    py = Path(vllm_python) if vllm_python else default_vllm_python()
    if not py.exists():
        raise ConfigError(f"no vLLM environment at {py}: run `make vllm-setup` (or pass --vllm-python)")
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise ConfigError(f"unknown methods {bad}: use {', '.join(METHODS)}")
    model_dir, _, _ = prepare(model)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ctx = tok(corpus.text(text), add_special_tokens=False)["input_ids"][:context_tokens]
    if len(ctx) < context_tokens:
        raise ConfigError(f"the text {text!r} has only {len(ctx)} tokens")
    ids = ctx + tok(QUESTION, add_special_tokens=False)["input_ids"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="cachegen-vllm-bench-") as tmp:
        for method in methods:
            spec = {
                "method": method,
                "model": model_dir,
                "ids": ids,
                "runs": runs,
                "level": level,
                "slo_s": slo_s,
                "store": store or f"file://{tmp}/cachegen-store",
                "example_dir": f"{tmp}/example",
                "context_tokens": context_tokens,
            }
            sp, out = Path(tmp) / "spec.json", Path(tmp) / "row.json"
            sp.write_text(json.dumps(spec))
            env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
            log.info("vllm bench: %s (one vLLM engine, ~1-2 minutes)", method)
            t = time.perf_counter()
            r = subprocess.run(
                [str(py), "-m", "cachegen.bench.vllm_bench", "--worker", str(sp), str(out)],
                env=env,
                capture_output=True,
                text=True,
            )
            if r.returncode:
                raise RuntimeError(f"vLLM run {method} failed (exit {r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")
            row = json.loads(out.read_text())
            row["wall_s"] = time.perf_counter() - t
            rows.append(row)
    print_table(rows)
    if json_path:
        Path(json_path).write_text(
            json.dumps(
                {
                    "rows": rows,
                    "model": model,
                    "context_tokens": context_tokens,
                    "level": level,
                    "slo_s": slo_s,
                    "runs": runs,
                },
                indent=1,
            )
        )
    return rows


def print_table(rows: list[dict]) -> None:
    base = next((r for r in rows if r["method"] == "vllm"), None)
    ex = next((r for r in rows if r["method"] == "vllm+example-connector"), None)
    print(f"{'method':<24} {'store':<22} {'ttft_s':>8} {'vs vllm':>8} {'stored':>12} {'vs example':>10}")
    for r in rows:
        vs = f"{r['ttft_s'] / base['ttft_s']:.2f}x" if base else "-"
        size = f"{r['stored_bytes'] / 2**20:.1f} MiB" if r["stored_bytes"] else "-"
        vs_ex = (
            f"{r['stored_bytes'] / ex['stored_bytes']:.2f}x" if ex and ex["stored_bytes"] and r["stored_bytes"] else "-"
        )
        print(f"{r['method']:<24} {r['store']:<22} {r['ttft_s']:>8.3f} {vs:>8} {size:>12} {vs_ex:>10}")


def section(model: str, out: Path, quick: bool) -> list[str]:
    """The vLLM part of ``cachegen bench all`` (skipped without the vLLM environment)."""
    from cachegen.bench.plots import table

    if not default_vllm_python().exists():
        return ["## vLLM KV connector", "", "Skipped: no vLLM environment (`make vllm-setup`).", ""]
    n, runs = (1024, 1) if quick else (2048, 3)
    rows = run_vllm_bench(model, n, json_path=str(Path(out) / "vllm.json"), runs=runs)
    return [
        "## vLLM KV connector",
        "",
        f"`cachegen bench vllm --context-tokens {n}`: {n} context tokens + a question, one fresh vLLM engine "
        f"per method (prefix caching off), `ttft_s` the median of {runs} warm `max_tokens=1` requests after "
        "a cold one; `stored_bytes` what the connector stored for the context.",
        "",
        table(rows, COLS, markdown=True),
        "",
    ]


def register(sub) -> None:
    """Add the ``vllm`` subcommand to the ``bench`` subparsers."""
    p = sub.add_parser("vllm", help="warm TTFT and stored bytes: vLLM, vLLM's example connector, cachegen's connector")
    p.add_argument("--model", default="smollm2-135m", help="model name or directory (default smollm2-135m)")
    p.add_argument("--context-tokens", type=int, default=2048, help="tokens of real text in the context (default 2048)")
    p.add_argument("--level", type=int, default=4, help="the level cachegen's connector stores (default: strict, 4)")
    p.add_argument("--slo-s", type=float, default=2.0, help="the connector's load deadline, seconds")
    p.add_argument("--runs", type=int, default=3, help="warm requests per method (ttft_s is their median)")
    p.add_argument("--store", help="cachegen's store URL (default: a temporary local store)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument("--vllm-python", help="the vLLM environment's python (default .venv-vllm/bin/python)")
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON ('-': stdout)")
    p.set_defaults(
        func=lambda a: run_vllm_bench(
            a.model,
            a.context_tokens,
            a.json,
            a.vllm_python,
            a.level,
            a.slo_s,
            a.runs,
            a.store,
            tuple(a.methods.split(",")),
        )
    )


# -- the vLLM environment's side -------------------------------------------------------------


def _dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file()) if d.exists() else 0


def worker(spec_path: str, out_path: str) -> None:
    """One method in one vLLM engine: a cold request, then the warm ones."""
    from vllm import LLM, SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    method, ids = spec["method"], spec["ids"]
    kw: dict = dict(
        model=spec["model"],
        max_model_len=4096,
        enforce_eager=True,
        dtype="bfloat16",
        enable_prefix_caching=False,
        seed=0,
    )
    store = "-"
    if method == "vllm+example-connector":
        d = Path(spec["example_dir"])
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        kw["kv_transfer_config"] = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(d)},
        }
        store = "file (safetensors)"
    elif method == "vllm+cachegen":
        from cachegen.integrations.vllm import kv_transfer_config
        from cachegen.store.url import redact

        kw["kv_transfer_config"] = kv_transfer_config(
            store=spec["store"], levels=[spec["level"]], policy="adaptive", slo_s=spec["slo_s"]
        )
        url = redact(spec["store"])
        store = f"{url.split(':', 1)[0]} (L{spec['level']})"
    llm = LLM(**kw)
    sp = SamplingParams(temperature=0.0, max_tokens=1)

    def once() -> tuple[float, int]:
        t = time.perf_counter()
        r = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
        return time.perf_counter() - t, int(r.outputs[0].token_ids[0])

    cold_s, first = once()
    conn = None
    if method == "vllm+cachegen":
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from cachegen.integrations.vllm.connector import CacheGenConnector

        (conn,) = CacheGenConnector.instances(KVConnectorRole.WORKER)
        conn.flush(300)
    warm = [once() for _ in range(spec["runs"])]
    stored, loaded = 0, 0
    if method == "vllm+example-connector":
        stored = _dir_bytes(Path(spec["example_dir"]))
    elif conn is not None:
        stored = sum(sum(i.sizes.values()) for i in conn.setup.store.plan(ids))
        loaded = conn.stats.loaded_tokens // max(len(warm), 1)
    row = {
        "method": method,
        "store": store,
        "context_tokens": spec["context_tokens"],
        "prompt_tokens": len(ids),
        "ttft_s": statistics.median(t for t, _ in warm),
        "ttft_runs": [t for t, _ in warm],
        "cold_s": cold_s,
        "stored_bytes": stored,
        "loaded_tokens": loaded,
        "first_token": first,
        "same_first_token": all(f == first for _, f in warm),
    }
    if conn is not None:
        row["connector"] = conn.stats.to_json()
        conn.shutdown()
    Path(out_path).write_text(json.dumps(row))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
    else:
        import argparse

        ap = argparse.ArgumentParser(prog="python -m cachegen.bench.vllm_bench")
        register(ap.add_subparsers())
        a = ap.parse_args()
        a.func(a)
