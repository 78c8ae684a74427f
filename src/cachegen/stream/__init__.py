"""Stream a stored KV cache into the model before a time-to-first-token deadline.

:class:`StreamingLoader` fetches a prompt's cached chunks from a
:class:`~cachegen.store.ContextStore`, choosing per chunk a quality level (or
recompute from text) with :mod:`cachegen.stream.planner`, decodes them while the
next one is on the wire, and returns a :class:`LoadResult` with the stitched
:class:`~cachegen.kv.KVCache` and the per-chunk decisions. Links:
:class:`ThrottledLink` (in-process) and :mod:`cachegen.stream.netns` (a shaped
veth pair to a Redis server in a network namespace).
"""

from cachegen.stream.costs import TEXT, CostModel
from cachegen.stream.estimator import ThroughputEstimator
from cachegen.stream.link import (DirectLink, ThrottledLink, Trace, constant, load_trace_file, make_trace,
                                  random_trace, step)
from cachegen.stream.loader import ADAPTIVE, RULE, ChunkDecision, LoadResult, StreamingLoader
from cachegen.stream.planner import PipelineState, PlanChunk, choose_adaptive, choose_rule, decide, simulate
from cachegen.stream.sim import SimResult, simulate_load

__all__ = [
    "ADAPTIVE", "RULE", "TEXT", "ChunkDecision", "CostModel", "DirectLink", "LoadResult", "PipelineState",
    "PlanChunk", "StreamingLoader", "ThrottledLink", "ThroughputEstimator", "Trace", "choose_adaptive",
    "choose_rule", "constant", "decide", "SimResult", "simulate_load", "load_trace_file", "make_trace", "random_trace", "simulate", "step",
]
