"""``cachegen bench serve``: multi-round chats against the real HTTP server, per reuse mode.

Several users chat over several rounds. Each request goes through the
official ``openai`` AsyncOpenAI client, streaming, to a uvicorn server on
127.0.0.1 (run in a thread of this process, so the modes share one loaded
model). Users share a system prompt and each has a private document of real
text (:mod:`cachegen.corpus`); requests arrive at ``--qps`` (a user's next
round waits for its last answer too). One row per mode:

* ``recompute``: no reuse (every request prefills its whole prompt);
* ``ram-prefix``: raw bf16 KV in RAM (a size-bounded store on tmpfs), the
  analogue of a serving engine's automatic prefix cache;
* ``cachegen-local``: the cachegen codec in the file store;
* ``cachegen-redis-1gbps`` / ``cachegen-redis-100mbps``: a real redis-server
  behind an emulated link: a tbf-shaped veth pair into a network namespace
  when this machine allows it, else the in-process ThrottledLink (``link`` in
  the row says which).

Time to first token is measured by the client: request sent to first content.

By default (``--qps auto``) requests arrive at a rate this machine sustains
without reuse: one every 1.3 times the predicted service time of a first-round
request (prefill of its whole prompt plus its answer's decoding steps, from the
Engine's measured cost model). Above that rate every mode's time to first token
is mostly time in the queue, which measures the CPU, not the reuse. The load
deadline (``--slo-s auto``) is a quarter of the predicted prefill of that
prompt: a load is worth it only well under a recompute.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MODES = ("recompute", "ram-prefix", "cachegen-local", "cachegen-redis-1gbps", "cachegen-redis-100mbps")
COLS = (
    "mode",
    "requests",
    "ttft_s_p50",
    "ttft_s_p95",
    "ttft_s_p50_r2",
    "ttft_s_p95_r2",
    "cached_token_fraction",
    "throughput_tok_s",
    "errors",
    "link",
)
QUESTIONS = (
    "Summarize the document in two sentences.",
    "What is the most important rule it states?",
    "Which detail would a new reader miss?",
    "Give one example from the document.",
    "What would you ask its author?",
)


@dataclass
class Workload:
    users: int = 4
    rounds: int = 3
    system_tokens: int = 1000
    doc_tokens: int = 2000
    answer_tokens: int = 32
    qps: float | None = None  # None: auto (see sustainable_qps)


AUTO_HEADROOM = 1.3  # inter-arrival time over predicted service time
AUTO_SLO_FRACTION = 0.25  # load deadline over predicted prefill time


def first_prompt_tokens(tokenizer, system: str, doc: str) -> int:
    """Tokens of a first-round prompt as the server templates it."""
    from cachegen.engine.chat import render

    msgs = [{"role": "system", "content": system}, {"role": "user", "content": f"{doc}\n\n{QUESTIONS[0]}"}]
    return len(render(tokenizer, msgs))


def sustainable_qps(costs, prompt_tokens: int, answer_tokens: int) -> float:
    """Requests/s one model sustains without reuse: ``1 / (AUTO_HEADROOM * service)``."""
    service = costs.recompute_s(0, prompt_tokens) + answer_tokens * costs.recompute_s(prompt_tokens, 1)
    return 1.0 / (AUTO_HEADROOM * service)


def _pct(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def _free_socket() -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    s.listen(256)
    return s


@contextmanager
def serving(engine, config) -> Iterator[str]:
    """The app on a free 127.0.0.1 port, served by uvicorn in a thread; yields the /v1 base URL."""
    import uvicorn

    from cachegen.serve import create_app

    sock = _free_socket()
    server = uvicorn.Server(uvicorn.Config(create_app(engine, config), log_level="warning", lifespan="on"))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="bench-uvicorn", daemon=True)
    th.start()
    while not server.started:
        if not th.is_alive():
            raise RuntimeError("the bench server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        th.join(timeout=30)
        sock.close()


@contextmanager
def redis_server() -> Iterator[str]:
    """A throwaway redis-server on a free loopback port (no persistence)."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not on PATH (make redis-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = tempfile.mkdtemp(prefix="cachegen-bench-redis-")
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", d],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait(10)
        shutil.rmtree(d, ignore_errors=True)


@contextmanager
def redis_link(gbps: float, prefer_netns: bool = True) -> Iterator[tuple[str, object, str]]:
    """(store URL, loader link or None, what the row says) for a redis-server behind a ``gbps`` link.

    A real shaped link (:mod:`cachegen.bench.netns`: a network namespace, a veth pair with tbf) when
    this machine allows it (root, ``ip``, ``tc``); otherwise a local redis-server behind the
    in-process :class:`~cachegen.stream.ThrottledLink`."""
    from cachegen.errors import CachegenError
    from cachegen.stream import ThrottledLink, constant

    nr = None
    if prefer_netns:
        from cachegen.bench.netns import NetnsRedis

        try:
            nr = NetnsRedis(gbps).start()
        except (CachegenError, OSError) as e:
            log.info("netns link unavailable (%s): using an in-process ThrottledLink", e)
            nr = None
    if nr is not None:
        try:
            yield nr.url, None, f"netns veth+tbf {gbps:g} Gbit/s"
        finally:
            nr.close()
        return
    with redis_server() as url:
        yield url, ThrottledLink(constant(gbps)), f"in-process ThrottledLink {gbps:g} Gbit/s (no netns)"


def conversations(tokenizer, w: Workload) -> tuple[str, list[str]]:
    """The shared system prompt and one private document per user, of real text."""
    from cachegen import corpus

    system = "You are a careful assistant. Answer from the user's document only, briefly.\n\n" + corpus.take_tokens(
        tokenizer, corpus.text("pydoc-calib"), w.system_tokens
    )
    src = corpus.text("pydoc-eval")
    docs = [corpus.take_tokens(tokenizer, src, w.doc_tokens, offset=u * w.doc_tokens) for u in range(w.users)]
    return system, docs


async def _user(client, u: int, system: str, doc: str, w: Workload, t0: float, extra: dict, out: list) -> None:
    msgs: list[dict] = [{"role": "system", "content": system}]
    for r in range(w.rounds):
        assert w.qps is not None, "resolve qps before driving"
        slot = t0 + (r * w.users + u) / w.qps
        await asyncio.sleep(max(0.0, slot - time.perf_counter()))
        q = QUESTIONS[r % len(QUESTIONS)]
        msgs.append({"role": "user", "content": f"{doc}\n\n{q}" if r == 0 else q})
        row: dict[str, Any] = {
            "user": u,
            "round": r,
            "ttft_s": None,
            "prompt_tokens": 0,
            "cached_tokens": 0,
            "completion_tokens": 0,
            "error": None,
        }
        sent = time.perf_counter()
        parts: list[str] = []
        try:
            stream = await client.chat.completions.create(
                model="m",
                messages=msgs,
                max_tokens=w.answer_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=extra,
            )
            async for ch in stream:
                if ch.usage is not None:
                    row["prompt_tokens"] = ch.usage.prompt_tokens
                    row["completion_tokens"] = ch.usage.completion_tokens
                    details = ch.usage.prompt_tokens_details
                    row["cached_tokens"] = details.cached_tokens if details else 0
                elif ch.choices and ch.choices[0].delta.content:
                    if row["ttft_s"] is None:
                        row["ttft_s"] = time.perf_counter() - sent
                    parts.append(ch.choices[0].delta.content)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
            log.warning("user %d round %d failed: %s", u, r, row["error"])
        row["latency_s"] = time.perf_counter() - sent
        out.append(row)
        msgs.append({"role": "assistant", "content": "".join(parts)})


async def _drive(base_url: str, system: str, docs: list[str], w: Workload, extra: dict) -> tuple[list[dict], float]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=600)
    out: list[dict] = []
    t0 = time.perf_counter()
    await asyncio.gather(*[_user(client, u, system, d, w, t0, extra, out) for u, d in enumerate(docs)])
    wall = time.perf_counter() - t0
    await client.close()
    return out, wall


def summarize(mode: str, reqs: list[dict], wall_s: float, link: str) -> dict:
    ok = [r for r in reqs if r["error"] is None and r["ttft_s"] is not None]
    later = [r["ttft_s"] for r in ok if r["round"] >= 1]
    prompt = sum(r["prompt_tokens"] for r in ok)
    p50, p95, p50r, p95r = (
        _pct([r["ttft_s"] for r in ok], 0.5),
        _pct([r["ttft_s"] for r in ok], 0.95),
        _pct(later, 0.5),
        _pct(later, 0.95),
    )
    return {
        "mode": mode,
        "requests": len(reqs),
        "ttft_s_p50": p50,
        "ttft_s_p95": p95,
        "ttft_s_p50_r2": p50r,
        "ttft_s_p95_r2": p95r,
        "cached_token_fraction": sum(r["cached_tokens"] for r in ok) / prompt if prompt else 0.0,
        "throughput_tok_s": sum(r["completion_tokens"] for r in ok) / wall_s if wall_s > 0 else 0.0,
        "errors": len(reqs) - len(ok),
        "link": link,
        "wall_s": wall_s,
    }


def _engine_for(mode: str, base, tmp: Path, redis: tuple | None, chunk_tokens: int, ram_bytes: int):
    """An Engine sharing ``base``'s model and codec, over the store ``mode`` uses; and its link's name."""
    from cachegen.bench.baselines.raw import RawCodec
    from cachegen.engine.engine import Engine
    from cachegen.store import ContextStore, Namespace, open_backend

    ns = base.store.namespace
    link, link_name = None, "none"
    if mode == "ram-prefix":
        root = Path(tempfile.mkdtemp(prefix="cachegen-ram-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
        raw = RawCodec("bf16")
        store = ContextStore(
            open_backend(f"file://{root}?max_bytes={ram_bytes}"),
            Namespace(ns.model_fingerprint + "-raw", ns.format_version, "raw-bf16"),
            raw,
            chunk_tokens,
            levels=raw.levels,
        )
        eng = Engine(base.lm, store, raw, base.costs())
        link_name = "ram (tmpfs)"
    else:
        url = f"file://{tmp / mode}" if redis is None else redis[0]
        store = ContextStore(open_backend(url), ns, base.codec, chunk_tokens, levels=base.store.levels)
        eng = Engine(base.lm, store, base.codec, base.costs())
        if redis is not None:
            link, link_name = redis[1], redis[2]
        elif mode == "cachegen-local":
            link_name = "local file store"
    eng.link = link
    return eng, link_name


def run(
    model: str = "smollm2-135m",
    modes: Sequence[str] = MODES,
    workload: Workload | None = None,
    chunk_tokens: int = 256,
    slo_s: float | str | None = "auto",
    ram_bytes: int = 2 << 30,
    plot: str | Path | None = None,
    prefer_netns: bool = True,
    dtype: str = "auto",
) -> dict:
    """Every mode in turn against a fresh store; returns ``{"rows": [...], "requests": {...}, ...}``.

    ``workload.qps`` None and ``slo_s`` ``"auto"`` are set from the Engine's measured costs
    (see the module docstring); the result records the values used."""
    from cachegen.calibrate import load_or_calibrate
    from cachegen.engine.engine import Engine
    from cachegen.serve import ServeConfig

    w = workload or Workload()
    unknown = set(modes) - set(MODES)
    if unknown:
        from cachegen.errors import ConfigError

        raise ConfigError(f"unknown mode(s) {', '.join(sorted(unknown))}: choose from {', '.join(MODES)}")
    tmp = Path(tempfile.mkdtemp(prefix="cachegen-bench-serve-"))
    rows, per_request = [], {}
    base = Engine.open(
        model,
        f"file://{tmp / 'base'}",
        chunk_tokens,
        progress=False,
        dtype=dtype,
        profile=load_or_calibrate,
    )
    try:
        costs = base.costs()
        system, docs = conversations(base.tokenizer, w)
        n_first = first_prompt_tokens(base.tokenizer, system, docs[0])
        auto = {"prompt_tokens": n_first, "predicted_prefill_s": costs.recompute_s(0, n_first)}
        if w.qps is None:
            w = Workload(**{**w.__dict__, "qps": sustainable_qps(costs, n_first, w.answer_tokens)})
            log.info("serve bench: --qps auto = %.3f requests/s (%d-token first prompts)", w.qps, n_first)
        if slo_s == "auto":
            slo_s = AUTO_SLO_FRACTION * auto["predicted_prefill_s"]
            log.info("serve bench: --slo-s auto = %.2f s", slo_s)
        elif isinstance(slo_s, str):
            from cachegen.errors import ConfigError

            raise ConfigError(f"slo_s must be a number of seconds or 'auto', got {slo_s!r}")
        for mode in modes:
            log.info("== serve bench: %s", mode)
            gbps = 1.0 if mode.endswith("1gbps") else 0.1
            with redis_link(gbps, prefer_netns) if "redis" in mode else _none() as redis:
                eng, link_name = _engine_for(mode, base, tmp, redis, chunk_tokens, ram_bytes)
                try:
                    # answers of exactly --answer-tokens tokens: every mode does the same decoding work
                    extra = {
                        "cachegen": {
                            "ignore_eos": True,
                            **({"use_cache": False, "store": False} if mode == "recompute" else {}),
                        }
                    }
                    cfg = ServeConfig(
                        model_name=base.lm.name,
                        max_queue=max(64, w.users * 2),
                        default_max_tokens=w.answer_tokens,
                        slo_s=slo_s if mode.startswith("cachegen") else None,
                    )
                    with serving(eng, cfg) as url:
                        reqs, wall = asyncio.run(_drive(url, system, docs, w, extra))
                    eng.writer.close()
                finally:
                    eng.store.backend.close()
            row = summarize(mode, reqs, wall, link_name)
            log.info("%s", row)
            rows.append(row)
            per_request[mode] = sorted(reqs, key=lambda r: (r["round"], r["user"]))
    finally:
        base.close()
        shutil.rmtree(tmp, ignore_errors=True)
    out = {
        "model": model,
        "dtype": str(base.model.dtype).removeprefix("torch."),
        "workload": w.__dict__,
        "chunk_tokens": chunk_tokens,
        "slo_s": slo_s,
        "auto": auto,
        "rows": rows,
        "requests": per_request,
    }
    if plot:
        plot_rows(rows, plot)
        out["plot"] = str(plot)
    return out


@contextmanager
def _none() -> Iterator[None]:
    yield None


def plot_rows(rows: list[dict], path: str | Path) -> None:
    """Bars of TTFT p50 and p95 (rounds 2+) per mode, with the cached fraction above them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(rows))
    p50 = [r["ttft_s_p50_r2"] or 0 for r in rows]
    p95 = [r["ttft_s_p95_r2"] or 0 for r in rows]
    ax.bar([x - 0.2 for x in xs], p50, 0.4, label="p50 (rounds 2+)")
    ax.bar([x + 0.2 for x in xs], p95, 0.4, label="p95 (rounds 2+)")
    for x, r in zip(xs, rows):
        ax.text(x, max(p50[x], p95[x]) * 1.02, f"{r['cached_token_fraction']:.0%} cached", ha="center", fontsize=8)
    ax.set_xticks(list(xs), [r["mode"] for r in rows], rotation=15, fontsize=8)
    ax.set_ylabel("time to first token (s)")
    ax.set_title("cachegen serve: multi-round chats, streaming, official openai client")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- the command -------------------------------------------------------------------------


def _positive(conv):
    def parse(text: str):
        try:
            x = conv(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not x > 0:
            raise argparse.ArgumentTypeError(f"expected a number above 0, got {text!r}")
        return x

    return parse


def _auto_or(conv):
    def parse(text: str):
        return "auto" if text == "auto" else conv(text)

    return parse


def register(sub) -> None:
    """Add ``bench serve`` (plain argparse: bench code does not import the CLI layer)."""
    pint, pfloat = _positive(int), _positive(float)
    p = sub.add_parser("serve", help="TTFT and throughput of the HTTP server under multi-round chats, per mode")
    p.add_argument("--model", default="smollm2-135m", help="model name or directory (default smollm2-135m)")
    p.add_argument("--chunk-tokens", type=pint, default=256, help="tokens per stored chunk (default 256)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated modes (default {','.join(MODES)})")
    p.add_argument("--users", type=pint, default=4, help="concurrent users (default 4)")
    p.add_argument("--rounds", type=pint, default=3, help="chat rounds per user (default 3)")
    p.add_argument("--system-tokens", type=pint, default=1000, help="tokens of the shared system prompt (default 1000)")
    p.add_argument("--doc-tokens", type=pint, default=2000, help="tokens of each user's document (default 2000)")
    p.add_argument("--answer-tokens", type=pint, default=32, help="max_tokens per answer (default 32)")
    p.add_argument(
        "--qps",
        type=_auto_or(pfloat),
        default="auto",
        help="request arrival rate per second, or auto: the rate this machine sustains without reuse (default auto)",
    )
    p.add_argument(
        "--slo-s",
        type=_auto_or(pfloat),
        default="auto",
        help="load deadline of the cachegen modes in seconds, or auto: a quarter of the predicted prefill "
        "of a first-round prompt (default auto)",
    )
    p.add_argument(
        "--ram-bytes", type=pint, default=2 << 30, help="size bound of the ram-prefix cache in bytes (default 2 GiB)"
    )
    p.add_argument(
        "--dtype",
        choices=("auto", "bfloat16", "float32"),
        default="auto",
        help="the model's compute dtype (default auto: bfloat16 on a CPU with AVX512-BF16 or AMX, else float32)",
    )
    p.add_argument(
        "--link",
        choices=("netns", "inproc"),
        default="netns",
        help="redis modes: a shaped veth link in a network namespace when possible (default), "
        "or the in-process ThrottledLink",
    )
    p.add_argument("--plot", default=None, metavar="PNG", help="write a TTFT bar chart here")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON ('-': stdout, only JSON)")
    p.set_defaults(func=_cmd)


def _cmd(args: argparse.Namespace) -> int:
    import json
    import sys

    from cachegen.bench.plots import table

    qps = None if args.qps == "auto" else args.qps
    w = Workload(args.users, args.rounds, args.system_tokens, args.doc_tokens, args.answer_tokens, qps)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    res = run(
        args.model,
        modes,
        w,
        args.chunk_tokens,
        args.slo_s,
        args.ram_bytes,
        args.plot,
        prefer_netns=args.link == "netns",
        dtype=args.dtype,
    )
    print(table(res["rows"], COLS), file=sys.stderr if args.json == "-" else sys.stdout)
    if args.json == "-":
        json.dump(res, sys.stdout, indent=2)
        print()
    elif args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


QUICK = Workload(users=2, rounds=3, system_tokens=200, doc_tokens=400, answer_tokens=8, qps=2.0)


def section(model: str, out: Path, quick: bool = False, dtype: str = "auto") -> list[str]:
    """The ``bench all`` section: runs every mode, writes serve.json and serve.png, returns Markdown lines."""
    import json

    from cachegen.bench.plots import table

    w = QUICK if quick else Workload()
    res = run(model, MODES, w, plot=out / "serve.png", dtype=dtype)
    (Path(out) / "serve.json").write_text(json.dumps(res, indent=2) + "\n")
    qps = res["workload"]["qps"]
    rate = f"{qps:.3g} requests/s" + ("" if w.qps is not None else " (auto: what this machine sustains without reuse)")
    return [
        "## Serving: multi-round chats",
        "",
        f"{w.users} users x {w.rounds} rounds, a shared {w.system_tokens}-token system prompt and a "
        f"{w.doc_tokens}-token document per user, {w.answer_tokens}-token answers at {rate}, "
        f"load deadline {res['slo_s']:.2f} s, streamed through the official openai client to the server on "
        "127.0.0.1; `_r2`: rounds 2 and later.",
        "",
        table(res["rows"], COLS, markdown=True),
        "",
        "![serve](serve.png)",
        "",
    ]
