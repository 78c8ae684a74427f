"""SIMD decoder of interleaved streams, several streams per pass, in LLVM IR compiled by llvmlite.

Why: one interleaved stream is one chain of dependent steps per 16 symbols (gather the 16 table
entries, multiply, compare, hand the next stream words to the lanes that renormalize, next states),
about 60 cycles long, so a single stream decodes at ~0.7 G symbols/s on one core however it is
written (the unrolled numba kernel of :mod:`._lanes` reaches the same). Streams are independent, so
this kernel steps a few of them in lockstep: their chains overlap (``cachegen bench codec`` prints
the rate the codec gets). The format is unchanged: lane ``j`` of a group of 16 columns reads the
next stream word exactly when the scalar decoder's lane ``j`` would.

Two variants (:data:`VARIANTS`), the first the host offers is used:

- ``avx512`` (AVX-512 F/BW and VBMI2): one ``vpexpandw`` with the mask of lanes that renormalize
  hands out the words; four streams per pass decode at ~2.4 G symbols/s on one core.
- ``avx2``: two ``vpgatherdd`` read the entries; per half of 8 lanes, the next 8 words are widened
  and permuted to the lanes that renormalize (``vpermd`` with a row of a 256-row table chosen by
  the half's mask); two streams per pass, ~2x the numba kernel on one core of an AVX2 machine
  (``tools/time_rans_simd.py``).

numba has no vector types, so the kernel is written as LLVM IR (generated below, one function per
pass size), compiled once per process by llvmlite (which numba already depends on) for the host
CPU, and called through ctypes, which releases the GIL. ``CACHEGEN_RANS_SIMD=0`` turns it off (the
numba kernels decode), ``=avx2`` picks that variant on an AVX-512 host. Only 12-bit-or-less
tables with byte symbols (:attr:`Tables.packed`) and blocks whose width is a multiple of 16 take
this path.

Bounds: every table read is ``tab_idx[c] + row_idx[t]`` (checked by the caller) plus a slot below
``2**prec``; after each group the kernel stops with a failure when the word position passed the
stream's end, so a group's reads stay within the :data:`PAD` words after it; outputs are written
only inside ``out``. A stream that fails or is not reached reports it through its result.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from cachegen.errors import CodecError

log = logging.getLogger(__name__)

PAD = 16  # zero words after a stream: the most one group of 16 lanes reads past a position in bounds
_ARGS = ("words", "nw", "tb", "rb", "out", "groups", "S")  # then the result slot
_POINTERS = {"words", "tb", "rb", "out"}
_STATE = (("s", "<16 x i32>"), ("p", "i64"), ("c", "i64"), ("t", "i64"), ("ro", "i32"), ("o", "i64"), ("g", "i64"))


@dataclass
class Stream:
    """One block's arrays as the kernel reads them (kept alive here for the duration of a call)."""

    words: np.ndarray  # uint16: the stream, then PAD zero words
    tb: np.ndarray  # int32 (S,): tab_idx * 2**prec
    rb: np.ndarray  # int32 (n + 1,): row_idx * 2**prec, then 0 (read after the last row)
    out: np.ndarray  # uint8 (n, S), C-contiguous
    args: np.ndarray  # int64: the fields of _ARGS, then the result (-1 until the kernel writes it)


def prepare(words: np.ndarray, tab_idx: np.ndarray, row_idx: np.ndarray, prec: int, out: np.ndarray) -> Stream:
    """Arrays for one block: ``words`` at least 32 long, ``S % 16 == 0``, indexes already checked."""
    return prepare_many([(words, tab_idx, row_idx, out)], prec)[0]


def prepare_many(items: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]], prec: int) -> list[Stream]:
    """:func:`prepare` of several blocks ``(words, tab_idx, row_idx, out)``, their arrays side by side
    in shared buffers: a handful of numpy calls for all of them instead of a handful per block (a
    batch of sixteen chunks has 960 blocks, whose one-by-one set-up had cost as much as their decode)."""
    k = len(items)
    if not k:
        return []
    sizes = np.array([w.size for w, _, _, _ in items], dtype=np.int64)
    ns = np.array([o.shape[0] for *_, o in items], dtype=np.int64)
    widths = np.array([o.shape[1] for *_, o in items], dtype=np.int64)
    woff = np.zeros(k + 1, dtype=np.int64)
    np.cumsum(sizes + PAD, out=woff[1:])
    words = np.zeros(int(woff[-1]), dtype=np.uint16)
    for (w, _, _, _), a in zip(items, woff.tolist()):
        words[a : a + w.size] = w
    toff = np.zeros(k + 1, dtype=np.int64)
    np.cumsum(widths, out=toff[1:])
    tb = (np.concatenate([t for _, t, _, _ in items]) << prec).astype(np.int32)
    roff = np.zeros(k + 1, dtype=np.int64)
    np.cumsum(ns + 1, out=roff[1:])
    rb = np.zeros(int(roff[-1]), dtype=np.int32)  # each block's rows, then a 0
    rows = np.ones(rb.size, dtype=bool)
    rows[roff[1:] - 1] = False
    rb[rows] = np.concatenate([r for _, _, r, _ in items]) << prec
    args = np.empty((k, len(_ARGS) + 1), dtype=np.int64)
    args[:, 0] = words.ctypes.data + 2 * woff[:-1]
    args[:, 1] = sizes
    args[:, 2] = tb.ctypes.data + 4 * toff[:-1]
    args[:, 3] = rb.ctypes.data + 4 * roff[:-1]
    args[:, 4] = [o.ctypes.data for *_, o in items]
    args[:, 5] = ns * widths // 16
    args[:, 6] = widths
    args[:, 7] = -1
    w0, t0, r0 = woff.tolist(), toff.tolist(), roff.tolist()
    return [
        Stream(words[w0[i] : w0[i + 1]], tb[t0[i] : t0[i + 1]], rb[r0[i] : r0[i + 1]], items[i][3], args[i])
        for i in range(k)
    ]


def decode_streams(streams: Sequence[Stream], packed: np.ndarray, prec: int) -> list[int]:
    """Decode each stream into its ``out``; one count per stream, 0 iff it ended cleanly (as the
    numba kernels count). Streams go through the kernel :attr:`Variant.group` at a time, with the
    process's variant (:func:`variant`), or the host's first where it is turned off."""
    chosen = variant() or _first_on_host()
    kernels = _kernels(chosen)
    pk = np.ascontiguousarray(packed, dtype=np.int32)
    bad = []
    for i in range(0, len(streams), chosen.group):
        part = streams[i : i + chosen.group]
        for s in part:
            s.args[-1] = -1
        kernels[len(part)](*(s.args.ctypes.data for s in part), pk.ctypes.data, prec)
        for s in part:
            if s.args[-1] < 0:  # another stream of the pass failed and ended it first: this one alone
                kernels[1](s.args.ctypes.data, pk.ctypes.data, prec)
            bad.append(int(s.args[-1]))
    return bad


def available() -> bool:
    """Whether this process decodes with a SIMD kernel (:func:`variant` is not None)."""
    return variant() is not None


def variant() -> Variant | None:
    """The variant this process decodes with, chosen once: the first of :data:`VARIANTS` the host
    offers that compiles, the one ``CACHEGEN_RANS_SIMD`` names, or None (``CACHEGEN_RANS_SIMD=0``,
    or a host with neither): then the numba kernels decode."""
    return _variant()


def host_variants() -> list[Variant]:
    """The variants whose CPU features the host (and OS) offer, as LLVM detects them."""
    try:
        import llvmlite.binding as llvm

        feats = llvm.get_host_cpu_features()
    except Exception:  # an llvmlite without the API: treated as a host without the features
        return []
    return [v for v in VARIANTS if all(feats.get(f, False) for f in v.needs)]


def host_supported() -> bool:
    """Whether the host offers any variant."""
    return bool(host_variants())


def _first_on_host() -> Variant:
    on_host = host_variants()
    if not on_host:
        raise CodecError("this CPU has neither AVX-512 VBMI2 nor AVX2: no SIMD rANS decoder")
    return on_host[0]


@functools.cache
def _variant() -> Variant | None:
    want = os.environ.get("CACHEGEN_RANS_SIMD", "1")
    if want == "0":
        return None
    on_host = host_variants()
    named = [v for v in on_host if v.name == want]
    if want != "1" and not named:
        log.warning("CACHEGEN_RANS_SIMD=%s: not one of this host's variants %s", want, [v.name for v in on_host])
    for v in named or on_host:
        try:
            _kernels(v)
        except Exception as e:  # a JIT failure: the numba kernels decode (the tests fail on such a host)
            log.warning("%s rANS decoder unavailable (%s); using the scalar kernel", v.name, e)
            return None
        return v
    return None


_lock = threading.Lock()
_compiled: dict[tuple[str, int], Callable[..., None]] = {}
_ready: dict[str, dict[int, Callable[..., None]]] = {}  # by variant name, once compiled
_engines: list[object] = []  # the JIT engines own the machine code: keep them alive


def _kernels(v: Variant) -> dict[int, Callable[..., None]]:
    """Variant ``v``'s kernels by pass size, compiled on first use. Why numba's compiler lock:
    llvmlite's binding layer is not thread-safe, and numba compiles (and loads cached kernels)
    through it under that lock; the first decode can run in a pool thread while another thread's
    first numba call compiles. Once compiled, a decode takes no lock: it would otherwise wait
    for whatever numba compiles in another thread."""
    ready = _ready.get(v.name)
    if ready is not None:
        return ready
    from numba.core.compiler_lock import global_compiler_lock

    with _lock, global_compiler_lock:
        if (v.name, 1) not in _compiled:
            import llvmlite.binding as llvm

            llvm.initialize_native_target()
            llvm.initialize_native_asmprinter()
            tm = llvm.Target.from_default_triple().create_target_machine(
                cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=3
            )
            mod = llvm.parse_assembly(generate_ir(v))
            mod.verify()
            engine = llvm.create_mcjit_compiler(mod, tm)
            engine.finalize_object()
            _engines.append(engine)
            ptr = ctypes.c_void_p
            for k in range(1, v.group + 1):
                proto = ctypes.CFUNCTYPE(None, *([ptr] * (k + 1)), ctypes.c_int32)
                _compiled[v.name, k] = proto(engine.get_function_address(f"rans_decode{k}"))
        ready = _ready[v.name] = {k: _compiled[v.name, k] for k in range(1, v.group + 1)}
        return ready


# -- the IR ------------------------------------------------------------------------------------------------


def generate_ir(v: Variant) -> str:
    """LLVM IR of ``rans_decode1`` .. ``rans_decode{v.group}``: ``(args_0, .., args_{k-1}, packed, prec)``."""
    head = [
        "declare <16 x i32> @llvm.masked.gather.v16i32.v16p0(<16 x ptr>, i32, <16 x i1>, <16 x i32>)",
        "declare <16 x i32> @llvm.fshl.v16i32(<16 x i32>, <16 x i32>, <16 x i32>)",
        "declare i16 @llvm.ctpop.i16(i16)",
        *v.head(),
    ]
    return "\n".join(head + [_function(k, v) for k in range(1, v.group + 1)]) + "\n"


def _function(K: int, variant: Variant) -> str:
    """Streams step one group each per iteration while all have groups left; then each finishes alone."""
    ks = [f"k{i}" for i in range(K)]
    ir = [
        f"define void @rans_decode{K}({', '.join(f'ptr noalias %arg{i}' for i in range(K))}, ptr noalias %pk, i32 %prec) {{",
        "entry:",
        *(_load_args(k, i) for i, k in enumerate(ks)),
        "  %m1 = sub i32 0, 1",
        "  %mbits = sub i32 32, %prec",
        "  %m = lshr i32 %m1, %mbits",
        "  %mi = insertelement <16 x i32> poison, i32 %m, i64 0",
        "  %maskv = shufflevector <16 x i32> %mi, <16 x i32> poison, <16 x i32> zeroinitializer",
        "  %pi = insertelement <16 x i32> poison, i32 %prec, i64 0",
        "  %precv = shufflevector <16 x i32> %pi, <16 x i32> poison, <16 x i32> zeroinitializer",
        *_all_positive("E", [f"%{k}_groups" for k in ks]),
        f"  br i1 %allE_{K - 1}, label %multi, label %multi_exit",
        "multi:",
        *(_phis(k, "P", [("entry", _initial(k)), ("latch", _next(k, "P"))]) for k in ks),
    ]
    for i, k in enumerate(ks):
        nxt = f"step{i + 1}" if i + 1 < K else "latch"
        ir += [_step(k, "P", nxt, variant), f"{nxt}:"]
    ir += [*_all_positive("L", [f"%{k}_g1_P" for k in ks]), f"  br i1 %allL_{K - 1}, label %multi, label %multi_exit"]
    ir.append("multi_exit:")
    for k in ks:
        for name, ty in _STATE:
            ir.append(f"  %{k}_{name}_X = phi {ty} [{_initial(k)[name]}, %entry], [{_next(k, 'P')[name]}, %latch]")
    pre = "multi_exit"
    for i, k in enumerate(ks):
        nxt = f"alone{i + 1}" if i + 1 < K else "done"
        here = {n: f"%{k}_{n}_X" for n, _ in _STATE}
        ir += [
            f"  %{k}_more = icmp sgt i64 %{k}_g_X, 0",
            f"  br i1 %{k}_more, label %{k}_loop, label %{k}_end",
            f"{k}_loop:",
            _phis(k, "S", [(pre, here), (f"{k}_latch", _next(k, "S"))]),
            _step(k, "S", f"{k}_latch", variant),
            f"{k}_latch:",
            f"  %{k}_again = icmp sgt i64 %{k}_g1_S, 0",
            f"  br i1 %{k}_again, label %{k}_loop, label %{k}_end",
            f"{k}_end:",
        ]
        for name, ty in _STATE:
            ir.append(f"  %{k}_{name}_E = phi {ty} [%{k}_{name}_X, %{pre}], [{_next(k, 'S')[name]}, %{k}_latch]")
        ir += [_result(k), f"  br label %{nxt}", f"{nxt}:"]
        pre = nxt
    ir.append("  ret void")
    for k in ks:
        ir += [f"{k}_fail:", f"  store i64 1, ptr %{k}_res, align 8", "  ret void"]
    ir.append("}")
    return "\n".join(ir)


def _load_args(k: str, i: int) -> str:
    lines = []
    for j, f in enumerate(_ARGS):
        lines.append(f"  %{k}_{f}_at = getelementptr i64, ptr %arg{i}, i64 {j}")
        if f in _POINTERS:
            lines += [
                f"  %{k}_{f}_i = load i64, ptr %{k}_{f}_at, align 8",
                f"  %{k}_{f} = inttoptr i64 %{k}_{f}_i to ptr",
            ]
        else:
            lines.append(f"  %{k}_{f} = load i64, ptr %{k}_{f}_at, align 8")
    lines += [
        f"  %{k}_res = getelementptr i64, ptr %arg{i}, i64 {len(_ARGS)}",
        # the 16 initial states: word 2j high, word 2j + 1 low (little-endian i32 loads swap them)
        f"  %{k}_raw = load <16 x i32>, ptr %{k}_words, align 2",
        f"  %{k}_s0 = call <16 x i32> @llvm.fshl.v16i32(<16 x i32> %{k}_raw, <16 x i32> %{k}_raw, <16 x i32> splat (i32 16))",
        f"  %{k}_ro0 = load i32, ptr %{k}_rb, align 4",
    ]
    return "\n".join(lines)


def _all_positive(tag: str, values: list[str]) -> list[str]:
    lines, acc = [], "true"
    for i, v in enumerate(values):
        lines += [f"  %pos{tag}_{i} = icmp sgt i64 {v}, 0", f"  %all{tag}_{i} = and i1 {acc}, %pos{tag}_{i}"]
        acc = f"%all{tag}_{i}"
    return lines


def _initial(k: str) -> dict[str, str]:
    return {"s": f"%{k}_s0", "p": "32", "c": "0", "t": "0", "ro": f"%{k}_ro0", "o": "0", "g": f"%{k}_groups"}


def _next(k: str, loop: str) -> dict[str, str]:
    return {n: f"%{k}_{n}1_{loop}" for n, _ in _STATE}


def _phis(k: str, loop: str, sources: list[tuple[str, dict[str, str]]]) -> str:
    return "\n".join(
        f"  %{k}_{n}_{loop} = phi {ty} " + ", ".join(f"[{vals[n]}, %{label}]" for label, vals in sources)
        for n, ty in _STATE
    )


def _step(k: str, loop: str, nxt: str, variant: Variant) -> str:
    """One group of 16 columns of stream ``k``: decode, renormalize, store, advance (row, column, words)."""

    def v(name: str) -> str:
        return f"%{k}_{name}_{loop}"

    vec = "<16 x i32>"
    return f"""  {v("slot")} = and {vec} {v("s")}, %maskv
  {v("tbp")} = getelementptr i32, ptr %{k}_tb, i64 {v("c")}
  {v("tbv")} = load {vec}, ptr {v("tbp")}, align 4
  {v("roi")} = insertelement {vec} poison, i32 {v("ro")}, i64 0
  {v("rov")} = shufflevector {vec} {v("roi")}, {vec} poison, {vec} zeroinitializer
  {v("base")} = add {vec} {v("tbv")}, {v("rov")}
  {v("idx")} = add {vec} {v("base")}, {v("slot")}
{variant.gather(v)}
  {v("fq")} = lshr {vec} {v("e")}, splat (i32 12)
  {v("fm")} = and {vec} {v("fq")}, splat (i32 4095)
  {v("freq")} = add {vec} {v("fm")}, splat (i32 1)
  {v("hi")} = lshr {vec} {v("s")}, %precv
  {v("prod")} = mul {vec} {v("freq")}, {v("hi")}
  {v("bias")} = and {vec} {v("e")}, splat (i32 4095)
  {v("x")} = add {vec} {v("prod")}, {v("bias")}
  {v("need")} = icmp ult {vec} {v("x")}, splat (i32 65536)
{variant.expand(v, k)}
  {v("xs")} = shl {vec} {v("x")}, splat (i32 16)
  {v("xw")} = or {vec} {v("xs")}, {v("wz")}
  {v("s1")} = select <16 x i1> {v("need")}, {vec} {v("xw")}, {vec} {v("x")}
  {v("sy")} = lshr {vec} {v("e")}, splat (i32 24)
  {v("sym")} = trunc {vec} {v("sy")} to <16 x i8>
  {v("op")} = getelementptr i8, ptr %{k}_out, i64 {v("o")}
  store <16 x i8> {v("sym")}, ptr {v("op")}, align 1
  {v("o1")} = add i64 {v("o")}, 16
  {v("g1")} = sub i64 {v("g")}, 1
  {v("cc")} = add i64 {v("c")}, 16
  {v("wrap")} = icmp eq i64 {v("cc")}, %{k}_S
  {v("c1")} = select i1 {v("wrap")}, i64 0, i64 {v("cc")}
  {v("dt")} = zext i1 {v("wrap")} to i64
  {v("t1")} = add i64 {v("t")}, {v("dt")}
  {v("rbp")} = getelementptr i32, ptr %{k}_rb, i64 {v("t1")}
  {v("ro1")} = load i32, ptr {v("rbp")}, align 4
  {v("over")} = icmp ugt i64 {v("p1")}, %{k}_nw
  br i1 {v("over")}, label %{k}_fail, label %{nxt}"""


def _result(k: str) -> str:
    """Stream ``k``'s count: 1 when the words were not used up exactly, plus one per lane off its initial state."""
    return f"""  %{k}_pbad = icmp ne i64 %{k}_p_E, %{k}_nw
  %{k}_pbad64 = zext i1 %{k}_pbad to i64
  %{k}_sbad = icmp ne <16 x i32> %{k}_s_E, splat (i32 65536)
  %{k}_sbits = bitcast <16 x i1> %{k}_sbad to i16
  %{k}_scnt = call i16 @llvm.ctpop.i16(i16 %{k}_sbits)
  %{k}_scnt64 = zext i16 %{k}_scnt to i64
  %{k}_bad = add i64 %{k}_pbad64, %{k}_scnt64
  store i64 %{k}_bad, ptr %{k}_res, align 8"""


def _gather_generic(v: Callable[[str], str]) -> str:
    """IR that sets ``e``: the 16 packed table entries at ``pk[idx]``."""
    vec = "<16 x i32>"
    return f"""  {v("ptrs")} = getelementptr i32, ptr %pk, {vec} {v("idx")}
  {v("e")} = call {vec} @llvm.masked.gather.v16i32.v16p0(<16 x ptr> {v("ptrs")}, i32 4, <16 x i1> splat (i1 true), {vec} poison)"""


def _gather_avx2(v: Callable[[str], str]) -> str:
    """:func:`_gather_generic` as two ``vpgatherdd`` with 32-bit indexes (LLVM scalarizes the
    generic gather on AVX2 hosts whose gathers it deems slow, through 64-bit pointers)."""
    h8 = "<8 x i32>"
    lo = ", ".join(f"i32 {i}" for i in range(8))
    hi = ", ".join(f"i32 {i}" for i in range(8, 16))
    both = ", ".join(f"i32 {i}" for i in range(16))
    return f"""  {v("ilo")} = shufflevector <16 x i32> {v("idx")}, <16 x i32> poison, <8 x i32> <{lo}>
  {v("ihi")} = shufflevector <16 x i32> {v("idx")}, <16 x i32> poison, <8 x i32> <{hi}>
  {v("glo")} = call {h8} @llvm.x86.avx2.gather.d.d.256({h8} zeroinitializer, ptr %pk, {h8} {v("ilo")}, {h8} splat (i32 -1), i8 4)
  {v("ghi")} = call {h8} @llvm.x86.avx2.gather.d.d.256({h8} zeroinitializer, ptr %pk, {h8} {v("ihi")}, {h8} splat (i32 -1), i8 4)
  {v("e")} = shufflevector {h8} {v("glo")}, {h8} {v("ghi")}, <16 x i32> <{both}>"""


def _head_avx512() -> list[str]:
    return ["declare <16 x i16> @llvm.masked.expandload.v16i16(ptr, <16 x i1>, <16 x i16>)"]


def _expand_avx512(v: Callable[[str], str], k: str) -> str:
    """IR that sets ``wz`` (the next stream words handed to the lanes that renormalize, in lane
    order; the other lanes' values are not used) and ``p1`` (the word position after them)."""
    vec = "<16 x i32>"
    return f"""  {v("wp")} = getelementptr i16, ptr %{k}_words, i64 {v("p")}
  {v("w")} = call <16 x i16> @llvm.masked.expandload.v16i16(ptr {v("wp")}, <16 x i1> {v("need")}, <16 x i16> zeroinitializer)
  {v("wz")} = zext <16 x i16> {v("w")} to {vec}
  {v("nb")} = bitcast <16 x i1> {v("need")} to i16
  {v("cnt")} = call i16 @llvm.ctpop.i16(i16 {v("nb")})
  {v("cnt64")} = zext i16 {v("cnt")} to i64
  {v("p1")} = add i64 {v("p")}, {v("cnt64")}"""


def _head_avx2() -> list[str]:
    return [
        "declare <8 x i32> @llvm.x86.avx2.permd(<8 x i32>, <8 x i32>)",
        "declare <8 x i32> @llvm.x86.avx2.gather.d.d.256(<8 x i32>, ptr, <8 x i32>, <8 x i32>, i8)",
        "declare i8 @llvm.ctpop.i8(i8)",
        _lut_ir(),
    ]


def _expand_avx2(v: Callable[[str], str], k: str) -> str:
    """:func:`_expand_avx512` with AVX2: per half of 8 lanes, the next 8 words (within :data:`PAD`
    of a position in bounds), widened and permuted so that word ``i`` reaches the ``i``-th lane that
    renormalizes (``vpermd`` with the row of :func:`_lut_ir` the half's mask picks); the upper half's
    words start after the lower half's."""
    h8 = "<8 x i32>"
    lines = [f"  {v('nb')} = bitcast <16 x i1> {v('need')} to i16"]
    at = v("p")
    for half, shift, after in (("lo", 0, v("pm")), ("hi", 8, v("p1"))):
        m = v(f"m{half}")
        lines += [
            f"  {m}16 = lshr i16 {v('nb')}, {shift}",
            f"  {m} = trunc i16 {m}16 to i8",
            f"  {m}64 = zext i8 {m} to i64",
            f"  {v('lp' + half)} = getelementptr [8 x i32], ptr @rans_expand_lut, i64 {m}64",
            f"  {v('perm' + half)} = load {h8}, ptr {v('lp' + half)}, align 32",
            f"  {v('wp' + half)} = getelementptr i16, ptr %{k}_words, i64 {at}",
            f"  {v('w' + half)} = load <8 x i16>, ptr {v('wp' + half)}, align 2",
            f"  {v('wz' + half)} = zext <8 x i16> {v('w' + half)} to {h8}",
            f"  {v('e' + half)} = call {h8} @llvm.x86.avx2.permd({h8} {v('wz' + half)}, {h8} {v('perm' + half)})",
            f"  {v('c' + half)} = call i8 @llvm.ctpop.i8(i8 {m})",
            f"  {v('c64' + half)} = zext i8 {v('c' + half)} to i64",
            f"  {after} = add i64 {at}, {v('c64' + half)}",
        ]
        at = after
    order = ", ".join(f"i32 {i}" for i in range(16))
    lines.append(f"  {v('wz')} = shufflevector {h8} {v('elo')}, {h8} {v('ehi')}, <16 x i32> <{order}>")
    return "\n".join(lines)


def _expand_rows() -> list[list[int]]:
    """``vpermd`` rows by mask: lane ``j`` of a half whose lanes ``m`` renormalize takes the word
    counted by the lanes of ``m`` below ``j`` (0 for lanes that do not: their value is not used)."""
    return [[(m & ((1 << j) - 1)).bit_count() if m >> j & 1 else 0 for j in range(8)] for m in range(256)]


def _lut_ir() -> str:
    rows = ", ".join("[8 x i32] [" + ", ".join(f"i32 {x}" for x in row) + "]" for row in _expand_rows())
    return f"@rans_expand_lut = private unnamed_addr constant [256 x [8 x i32]] [{rows}], align 32"


@dataclass(frozen=True)
class Variant:
    """One SIMD kernel: the CPU features it needs, how many streams a pass steps (measured per
    variant, below) and the parts of its step that differ: how it reads the table entries and how
    it hands out the renormalization words."""

    name: str
    needs: tuple[str, ...]
    group: int
    head: Callable[[], list[str]]  # its declarations and constants
    gather: Callable[[Callable[[str], str]], str]  # its step's table reads (see _gather_generic)
    expand: Callable[[Callable[[str], str], str], str]  # its step's word hand-out (see _expand_avx512)


# the order is the preference: on one core, avx512 steps 4 streams at 2.4 G symbols/s (6 at 2.9, 8 at
# 2.8); on an AVX2 Zen 3 core avx2 steps 2 at 0.63-0.69 G (1 at 0.38, 3 at 0.63-0.65, 4 at 0.55-0.60)
VARIANTS = (
    Variant("avx512", ("avx512f", "avx512bw", "avx512vbmi2"), 4, _head_avx512, _gather_generic, _expand_avx512),
    Variant("avx2", ("avx2",), 2, _head_avx2, _gather_avx2, _expand_avx2),
)
