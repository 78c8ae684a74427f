"""Stream a stored KV cache into the model before a time-to-first-token deadline.

:class:`StreamingLoader` fetches a prompt's cached chunks from a store
(:class:`~cachegen.stream.protocols.ChunkSource`, e.g. a
:class:`~cachegen.store.ContextStore`), choosing per chunk a quality level (or
recompute from text) with :mod:`cachegen.stream.planner`, decodes them while the
next one is on the wire, and returns a :class:`LoadResult` with the
:class:`~cachegen.kv.KVCache` (each chunk decoded into its range of one preallocated
cache) and the per-chunk decisions. :class:`FormatLadder` makes several codecs'
formats (the project codec's levels, raw KV) one codec to plan over; the
``"fastest"`` policy picks per chunk what ends the load soonest, by the cost model
corrected with the decode and recompute times measured in earlier loads
(:class:`ComputeRates`). It is the one
fetch/decode/stitch implementation: the engine, the benchmarks and the
virtual-time replay (:mod:`cachegen.bench.replay`) all drive it, with a clock, a
link and a runner (:mod:`cachegen.stream.pipeline`) passed in. Links:
:class:`ThrottledLink` (in-process emulation) and :class:`DirectLink`.
"""

from cachegen.stream.compute_rates import ComputeRates
from cachegen.stream.costs import TEXT, CostModel
from cachegen.stream.estimator import ThroughputEstimator
from cachegen.stream.formats import FormatLadder, Rung
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
from cachegen.stream.planner import (
    FASTEST,
    PipelineState,
    PlanChunk,
    choose_adaptive,
    choose_fastest,
    choose_rule,
    decide,
    simulate,
)
from cachegen.stream.protocols import ChunkSource, Clock, Link, Recompute

__all__ = [
    "ADAPTIVE",
    "FASTEST",
    "RULE",
    "TEXT",
    "ChunkDecision",
    "ChunkSource",
    "Clock",
    "ComputeRates",
    "CostModel",
    "DirectLink",
    "FormatLadder",
    "Link",
    "LoadResult",
    "LoaderOptions",
    "PipelineState",
    "PlanChunk",
    "Recompute",
    "Rung",
    "StreamingLoader",
    "ThreadedRunner",
    "ThrottledLink",
    "ThroughputEstimator",
    "Trace",
    "VirtualClock",
    "VirtualRunner",
    "choose_adaptive",
    "choose_fastest",
    "choose_rule",
    "constant",
    "decide",
    "load_trace_file",
    "make_trace",
    "random_trace",
    "simulate",
    "step",
]
