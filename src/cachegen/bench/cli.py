"""The ``bench`` group: which benchmarks exist, and the helpers their commands share.

The argparse tree lives in :mod:`cachegen.cli.bench` (the CLI layer); this
module stays free of it so benchmark code never imports the CLI.

A benchmark with its own module registers in :data:`BENCHES` with one line::

    "serve": ("cachegen.bench.serve_bench", "TTFT and throughput of the HTTP server under load"),

The module defines ``register(sub)`` that adds its parser (with
``set_defaults(func=...)``) to the ``bench`` subparsers. It is imported only
when its command runs (or for its own ``--help``), so a module that imports
torch at the top costs ``cachegen --help`` nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

log = logging.getLogger(__name__)

DEFAULT_CODECS = "cachegen,fp16,uniform8,uniform4,kivi4,kivi2,cachegen-released"
QUALITY_COLS = ("codec", "level", "bits_per_value", "size_bytes", "kl", "ppl_delta_pct", "top1_agreement")
NEEDLE_COLS = ("codec", "level", "bits_per_value", "cases", "correct", "accuracy", "ci_low", "ci_high")
TTFT_COLS = (
    "method",
    "level",
    "bandwidth_gbps",
    "ttft_s",
    "size_bytes",
    "fetch_s",
    "decode_s",
    "inject_s",
    "first_step_s",
)
DTYPES = ("float32", "bfloat16", "float16")

#: bench command -> (module with ``register(sub)``, one-line help shown by ``cachegen bench --help``)
BENCHES: dict[str, tuple[str, str]] = {
    "codec": ("cachegen.bench.codec_bench", "codec speed and bits/value on a real model's KV"),
    "attention": (
        "cachegen.bench.attention_bench",
        "the step after a loaded cache on sdpa and on cachegen_sdpa, taking turns",
    ),
    "stream": ("cachegen.bench.stream_bench", "TTFT and quality of streamed loads under a bandwidth trace"),
    "vllm": (
        "cachegen.bench.vllm_bench",
        "warm TTFT and stored bytes of vLLM with cachegen's and vLLM's example KV connector",
    ),
    "serve": ("cachegen.bench.serve_bench", "TTFT and throughput of the HTTP server under multi-round chats"),
    "scale": ("cachegen.bench.scale", "TTFT and the load's peak memory against context length (1K-32K tokens)"),
}


def load(model: str, dtype: str = "float32"):
    """The model in ``dtype`` (a name in :data:`DTYPES`), with a progress display only on a terminal."""
    import torch

    from cachegen.engine.models import load_model

    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    return load_model(model, dtype=dt, progress=True)


def codecs_for(lm, names: Sequence[str]):
    from cachegen.bench.baselines import make_codecs

    return make_codecs(names, loaded_model=lm)
