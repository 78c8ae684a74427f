"""Stream a stored KV cache into the model before a time-to-first-token deadline.

:class:`StreamingLoader` fetches a prompt's cached chunks from a store
(:class:`~cachegen.stream.protocols.ChunkSource`, e.g. a
:class:`~cachegen.store.ContextStore`), choosing per chunk a quality level (or
recompute from text) with :mod:`cachegen.stream.planner`, decodes them while the
next one is on the wire, and returns a :class:`LoadResult` with the stitched
:class:`~cachegen.kv.KVCache` and the per-chunk decisions. It is the one
fetch/decode/stitch implementation: the engine, the benchmarks and the
virtual-time replay (:mod:`cachegen.bench.replay`) all drive it, with a clock, a
link and a runner (:mod:`cachegen.stream.pipeline`) passed in. Links:
:class:`ThrottledLink` (in-process emulation) and :class:`DirectLink`.
"""

from cachegen.stream.costs import TEXT, CostModel
from cachegen.stream.estimator import ThroughputEstimator
from cachegen.stream.link import (
    DirectLink,
    ThrottledLink,
    Trace,
    constant,
    load_trace_file,
    make_trace,
    random_trace,
    step,
)
from cachegen.stream.loader import ADAPTIVE, RULE, ChunkDecision, LoaderOptions, LoadResult, StreamingLoader
from cachegen.stream.pipeline import ThreadedRunner, VirtualClock, VirtualRunner
from cachegen.stream.planner import PipelineState, PlanChunk, choose_adaptive, choose_rule, decide, simulate
from cachegen.stream.protocols import ChunkSource, Clock, Link, Recompute

__all__ = [
    "ADAPTIVE",
    "RULE",
    "TEXT",
    "ChunkDecision",
    "ChunkSource",
    "Clock",
    "CostModel",
    "DirectLink",
    "Link",
    "LoadResult",
    "LoaderOptions",
    "PipelineState",
    "PlanChunk",
    "Recompute",
    "StreamingLoader",
    "ThreadedRunner",
    "ThrottledLink",
    "ThroughputEstimator",
    "Trace",
    "VirtualClock",
    "VirtualRunner",
    "choose_adaptive",
    "choose_rule",
    "constant",
    "decide",
    "load_trace_file",
    "make_trace",
    "random_trace",
    "simulate",
    "step",
]
