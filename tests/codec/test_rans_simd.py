"""The SIMD decoders of interleaved streams (:mod:`cachegen.codec.rans.simd`) against the numba kernels.

Every test decodes the same streams both ways: the numba kernels are the reference (their own
tests check them against a plain-Python coder), and a stream the scalar decoder refuses must be
refused here too. Each test runs once per variant: the AVX2 one where the host has AVX2, the AVX-512
one everywhere (its IR uses only LLVM's generic intrinsics, so on a host without AVX-512 LLVM
lowers ``vpexpandw`` to scalar code: slower, the same results), so an AVX2 CI machine tests both."""

import logging
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachegen.codec import Codec, calibrate, rans
from cachegen.codec.rans import interleaved, simd
from cachegen.errors import CodecError, CorruptChunk
from cachegen.kv import KVCache, KVLayer
from codec.samples import planted_sensitivity

ON_HOST = [v.name for v in simd.host_variants()]
host_has_one = pytest.mark.skipif(not ON_HOST, reason="host without AVX-512 VBMI2 or AVX2")


@pytest.fixture(autouse=True, params=[v.name for v in simd.VARIANTS])
def kernel(request, monkeypatch) -> simd.Variant:
    """The variant this test decodes with (``simd.variant()`` returns it for the test's duration)."""
    if request.param == "avx2" and "avx2" not in ON_HOST:
        pytest.skip("host without AVX2")
    chosen = next(v for v in simd.VARIANTS if v.name == request.param)
    monkeypatch.setattr(simd, "_variant", lambda: chosen)
    return chosen


@host_has_one
def test_the_kernel_compiles_and_the_process_decodes_with_the_hosts_first_variant(kernel, monkeypatch):
    """On a host with the features a kernel is in use: an IR that no longer compiles would fall back
    to the numba kernel with a warning, and every other test here would pass on that kernel."""
    assert sorted(simd._kernels(kernel)) == list(range(1, kernel.group + 1))
    monkeypatch.undo()  # the process's own choice, not the fixture's
    assert [v.name for v in simd.VARIANTS] == ["avx512", "avx2"]  # the order is the preference
    if os.environ.get("CACHEGEN_RANS_SIMD", "1") == "1":
        assert simd.variant() == simd.host_variants()[0]


def test_a_compiled_kernel_is_had_without_waiting_for_numbas_compiler_lock(kernel):
    """Once compiled, a decode takes no lock: another thread compiling with numba (holding its
    global lock for seconds) must not hold up every decode of the process."""
    import threading

    from numba.core.compiler_lock import global_compiler_lock

    first = simd._kernels(kernel)
    held, release, got = threading.Event(), threading.Event(), []

    def compiler() -> None:
        with global_compiler_lock:
            held.set()
            release.wait(30)

    other = threading.Thread(target=compiler)
    other.start()
    try:
        assert held.wait(30)
        reader = threading.Thread(target=lambda: got.append(simd._kernels(kernel)))
        reader.start()
        reader.join(10)
        assert got == [first]
    finally:
        release.set()
        other.join()


def test_the_kernel_compiles_under_numbas_compiler_lock(monkeypatch, kernel):
    """llvmlite is not thread-safe and numba compiles (and loads its cache) through it under its
    global lock: the first decode may compile the kernel in a pool thread while another thread's
    first numba call compiles, so the kernel's compile takes that lock too."""
    import llvmlite.binding as llvm
    from numba.core.compiler_lock import global_compiler_lock

    parse, held = llvm.parse_assembly, []

    def watched(ir: str):
        held.append(global_compiler_lock.is_locked())
        return parse(ir)

    monkeypatch.setattr(llvm, "parse_assembly", watched)
    monkeypatch.setattr(simd, "_compiled", {})  # compile again (the module's kernels stay as they were)
    monkeypatch.setattr(simd, "_ready", {})
    assert sorted(simd._kernels(kernel)) == list(range(1, kernel.group + 1))
    assert simd._kernels(kernel) == simd._kernels(kernel)  # compiled once
    assert held == [True]
    assert not global_compiler_lock.is_locked()
    # the new kernels decode as the numba kernel does, in passes of every size, a damaged stream among
    # them (which ends its pass early and sends the others through alone). Why here: a process that
    # forks after its first decode (mutmut's test runs) never compiles again, so only this test runs
    # the generated IR and its compilation in a fresh state.
    rng = np.random.default_rng(11)
    tables = _tables(rng, 7, 40)
    pairs = [_block(rng, tables, int(rng.integers(1, 20)), 32) for _ in range(2 * kernel.group + 1)]
    blocks = [b for b, _ in pairs]
    blocks[1] = rans.Block(blocks[1].words[:40], blocks[1].n, blocks[1].table_index, blocks[1].row_shift)
    streams = simd.prepare_many(
        [(np.asarray(b.words), *_split(b, tables), np.empty((b.n, 32), np.uint8)) for b in blocks], tables.precision
    )
    verdicts = simd.decode_streams(streams, tables.packed, tables.precision)
    assert verdicts[1] != 0 and verdicts[:1] + verdicts[2:] == [0] * (len(blocks) - 1)
    for k, (s, (_, sym)) in enumerate(zip(streams, pairs, strict=True)):
        if k != 1:
            assert np.array_equal(s.out, sym)


def test_host_support_is_read_from_llvm_and_a_missing_feature_or_api_means_unsupported(monkeypatch):
    import llvmlite.binding as llvm

    every = {f for v in simd.VARIANTS for f in v.needs}
    monkeypatch.setattr(llvm, "get_host_cpu_features", lambda: {f: True for f in every})
    assert simd.host_variants() == list(simd.VARIANTS) and simd.host_supported()
    for v in simd.VARIANTS:
        monkeypatch.setattr(llvm, "get_host_cpu_features", lambda v=v: {f: f in v.needs for f in every})
        assert simd.host_variants() == [v]
        for missing in v.needs:
            monkeypatch.setattr(llvm, "get_host_cpu_features", lambda v=v, m=missing: {f: f != m for f in v.needs})
            assert v not in simd.host_variants()
    monkeypatch.setattr(llvm, "get_host_cpu_features", lambda: {})
    assert not simd.host_supported()
    with pytest.raises(CodecError, match=r"^this CPU has neither AVX-512 VBMI2 nor AVX2: no SIMD rANS decoder$"):
        simd._first_on_host()

    def no_api():
        raise AttributeError("an llvmlite without get_host_cpu_features")

    monkeypatch.setattr(llvm, "get_host_cpu_features", no_api)
    assert not simd.host_supported()


@host_has_one
def test_streams_decode_with_the_process_variant_or_with_the_hosts_first_where_it_is_off(monkeypatch, kernel):
    """``decode_streams`` takes the kernels of ``variant()`` (the fixture's), and where the process
    turned the SIMD kernels off (``CACHEGEN_RANS_SIMD=0``: ``variant()`` is None) the host's first
    variant's: a caller that asks for these streams still gets them decoded."""
    real, asked = simd._kernels, []
    monkeypatch.setattr(simd, "_kernels", lambda v: asked.append(v) or real(v))
    rng = np.random.default_rng(3)
    tables = _tables(rng, 7, 40)
    pairs = [_block(rng, tables, 9, 32) for _ in range(3)]
    for chosen, want in ((kernel, kernel), (None, simd.host_variants()[0])):
        monkeypatch.setattr(simd, "_variant", lambda c=chosen: c)
        streams = simd.prepare_many(
            [(np.asarray(b.words), *_split(b, tables), np.empty((b.n, 32), np.uint8)) for b, _ in pairs],
            tables.precision,
        )
        assert simd.decode_streams(streams, tables.packed, tables.precision) == [0, 0, 0]
        assert asked[-1] == want
        for st_, (_, sym) in zip(streams, pairs, strict=True):
            assert np.array_equal(st_.out, sym)


def test_the_avx2_rows_send_each_renormalizing_lane_the_next_word_in_lane_order():
    """Row ``m`` of the AVX2 permutation table: the lanes of mask ``m`` take words 0, 1, .. in lane
    order; the others take word 0 (their value is not used); the IR holds exactly these rows."""
    table = simd._expand_rows()
    assert len(table) == 256
    for m, row in enumerate(table):
        lanes = [j for j in range(8) if m >> j & 1]
        assert [row[j] for j in lanes] == list(range(len(lanes)))
        assert all(row[j] == 0 for j in range(8) if j not in lanes)
    assert simd._lut_ir().count("[8 x i32] [") == 256 and "i32 7]" in simd._lut_ir()


@pytest.fixture
def scalar(monkeypatch):
    """Within the test, decode_interleaved_many uses the numba kernels (a callable switches back)."""

    def use(on: bool) -> None:
        monkeypatch.setattr(simd, "available", lambda: on)

    return use


def _tables(rng, n_tables: int, alphabet: int, prec: int = 12) -> rans.Tables:
    """Random models; every other one has a symbol of probability ~0.9 (a KV section's zero), so
    slots run far past their symbol's start (the 12-bit ``slot - cum`` field uses its top bits)."""
    models = []
    for k in range(n_tables):
        counts = 1 + (rng.dirichlet(np.full(alphabet, rng.uniform(0.05, 3))) * 5000).astype(np.int64)
        if k % 2:
            counts[rng.integers(0, alphabet)] += 9 * int(counts.sum())
        models.append(rans.Categorical.from_counts(counts, prec))
    return rans.Tables.build(models)


def _block(rng, tables: rans.Tables, n: int, S: int) -> tuple[rans.Block, np.ndarray]:
    """A random block coded with column tables 2..4 and row shifts -2..2 (both kinds of index)."""
    idx = rng.integers(2, tables.n_tables - 2, S)
    shift = rng.integers(-2, 3, n)
    sym = np.empty((n, S), np.uint8)
    for t in range(n):
        for c in range(S):
            f = tables.freq[idx[c] + shift[t]]
            sym[t, c] = rng.choice(f.size, p=f / f.sum())
    words = rans.encode_interleaved(sym, idx, tables, row_shift=shift)
    return rans.Block(words, n, idx, shift), sym


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.integers(0, 40), st.sampled_from([16, 32, 48, 192, 7, 20])), min_size=1, max_size=9),
    st.integers(0, 2**31),
    st.sampled_from([9, 12]),
)
def test_blocks_of_any_count_and_shape_decode_as_the_scalar_kernel_does(shapes, seed, prec):
    """Any number of blocks (passes of every size and a remainder), each of its own length and width
    (widths that are not a multiple of 16 take the numba kernel within the same call)."""
    rng = np.random.default_rng(seed)
    tables = _tables(rng, 7, int(rng.integers(2, 256)), prec)
    blocks, syms = zip(*(_block(rng, tables, n, S) for n, S in shapes), strict=True)
    outs = rans.decode_interleaved_many(list(blocks), tables)
    for out, sym in zip(outs, syms, strict=True):
        assert out.dtype == np.uint8 and np.array_equal(out, sym)


def _damage(rng, words: np.ndarray) -> np.ndarray:
    w = words.copy()
    kind = rng.integers(0, 4)
    if kind == 0:  # one word replaced
        w[rng.integers(0, w.size)] = rng.integers(0, 1 << 16)
    elif kind == 1:  # cut short, but never below its states
        return w[: max(32, w.size - int(rng.integers(1, 40)))]
    elif kind == 2:  # longer
        return np.append(w, rng.integers(0, 1 << 16, int(rng.integers(1, 5))).astype(np.uint16))
    else:  # a run of junk
        p = int(rng.integers(0, w.size))
        w[p : p + 8] = rng.integers(0, 1 << 16, w[p : p + 8].size)
    return w


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**31))
def test_a_damaged_stream_is_refused_exactly_when_the_scalar_kernel_refuses_it(seed):
    """Damaged words (replaced, cut, extended, junk runs, including stop-early cuts that end a pass
    with its other streams unfinished): the verdict is the scalar kernel's, and the streams that
    decode give the scalar kernel's symbols. Junk never makes the kernel read or write out of
    bounds (which would crash this process, not fail the assert)."""
    rng = np.random.default_rng(seed)
    tables = _tables(rng, 7, 40)
    pairs = [_block(rng, tables, int(rng.integers(1, 30)), 32) for _ in range(int(rng.integers(1, 6)))]
    hit = int(rng.integers(0, len(pairs)))
    blocks = [
        b if k != hit else rans.Block(_damage(rng, b.words), b.n, b.table_index, b.row_shift)
        for k, (b, _) in enumerate(pairs)
    ]
    # side by side in shared buffers, as decode_interleaved_many prepares them: a damaged stream's
    # reads past its end stay in its own pad, never in the next stream's words
    streams = simd.prepare_many(
        [(np.asarray(b.words), *_split(b, tables), np.empty((b.n, 32), np.uint8)) for b in blocks], tables.precision
    )
    verdicts = simd.decode_streams(streams, tables.packed, tables.precision)
    for b, s, v in zip(blocks, streams, verdicts, strict=True):
        ref = np.empty((b.n, 32), np.uint8)
        padded = np.zeros(b.words.size + 33, np.uint16)
        padded[: b.words.size] = b.words
        cols, rows = _split(b, tables)
        want = interleaved.decode_lanes(padded, b.words.size, cols, rows, tables.packed, tables.precision, ref)
        assert (v == 0) == (want == 0)
        if v == 0:
            assert np.array_equal(s.out, ref)
    for k, (b, sym) in enumerate(pairs):  # the undamaged ones, through the public call, in the same pass
        if k != hit:
            assert np.array_equal(rans.decode_interleaved_many([b], tables)[0], sym)


def _both(words: np.ndarray, n: int, S: int, cols: np.ndarray, rows: np.ndarray, tables: rans.Tables):
    """(count, symbols) from the SIMD kernel and from the numba kernel, for one stream."""
    fast = simd.prepare(words, cols, rows, tables.precision, np.empty((n, S), np.uint8))
    (count,) = simd.decode_streams([fast], tables.packed, tables.precision)
    ref = np.empty((n, S), np.uint8)
    padded = np.zeros(words.size + S + 1, np.uint16)
    padded[: words.size] = words
    want = interleaved.decode_lanes(padded, words.size, cols, rows, tables.packed, tables.precision, ref)
    return (count, fast.out), (want, ref)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31), st.integers(1, 12), st.sampled_from([16, 48]))
def test_junk_that_never_runs_out_decodes_to_the_scalar_kernels_symbols_and_count(seed, n, S):
    """Random words, at least as many as the block could read (so neither kernel stops early): from
    any states, both kernels take the same steps, so the symbols and the count of lanes off their
    initial state are the same."""
    rng = np.random.default_rng(seed)
    tables = _tables(rng, 5, int(rng.integers(2, 200)))
    words = rng.integers(0, 1 << 16, n * S + 32 + int(rng.integers(0, 9))).astype(np.uint16)
    cols, rows = rng.integers(0, 5, S), np.zeros(n, np.int64)
    (count, out), (want, ref) = _both(words, n, S, cols, rows, tables)
    assert count == want and np.array_equal(out, ref)


def test_a_state_of_exactly_0xffff_renormalizes():
    """The renormalization bound is ``x < 2**16``: with a symbol of probability 1 a lane keeps its
    state, so a lane started at 0xFFFF reads one word (and then ends in the initial state only if
    that word makes it 65536: it cannot), where a bound off by one would read none."""
    tables = rans.Tables.build([rans.Categorical(np.array([4096]), 12)])
    states = [65535] + [65536] * 15
    words = np.array([w for x in states for w in (x >> 16, x & 0xFFFF)] + [9], np.uint16)
    (count, out), (want, ref) = _both(words, 2, 16, np.zeros(16, np.int64), np.zeros(2, np.int64), tables)
    assert count == want == 1 and not out.any() and not ref.any()  # all words read; lane 0 off its state


def _split(b: rans.Block, tables: rans.Tables) -> tuple[np.ndarray, np.ndarray]:
    return interleaved._table_indexes(
        b.n, len(b.table_index), b.table_index, b.row_shift, tables.n_tables, CorruptChunk
    )


@pytest.mark.parametrize(
    "bad_width, good_widths, prec",
    [
        (20, [20, 32], 12),  # the numba lanes kernel fails first, then another lanes block and a SIMD one
        (32, [20], 12),  # the SIMD kernel's failure, with a lanes block in the same call
        (20, [20], 14),  # tables the lanes kernel cannot take: the generic numba kernel
    ],
)
def test_a_failure_in_any_kernel_refuses_the_whole_call_whatever_decodes_after_it(bad_width, good_widths, prec):
    """A call counts every block's verdict: a failed block followed by blocks that decode cleanly
    (by the same kernel or another) still refuses the call."""
    rng = np.random.default_rng(bad_width + prec)
    tables = _tables(rng, 7, 30, prec)
    bad, _ = _block(rng, tables, 12, bad_width)
    bad = rans.Block(np.append(bad.words, np.uint16(7)), bad.n, bad.table_index, bad.row_shift)
    good = [_block(rng, tables, 12, w)[0] for w in good_widths]
    with pytest.raises(CorruptChunk, match="rANS stream did not end in the initial state"):
        rans.decode_interleaved_many([bad, *good], tables)
    rans.decode_interleaved_many(good, tables)  # the others alone are fine


def test_one_refused_block_refuses_the_call_and_the_others_still_decode_alone(scalar):
    rng = np.random.default_rng(5)
    tables = _tables(rng, 7, 30)
    pairs = [_block(rng, tables, 25, 48) for _ in range(4)]
    blocks = [b for b, _ in pairs]
    bad = rans.Block(np.append(blocks[0].words, np.uint16(7)), 25, blocks[0].table_index, blocks[0].row_shift)
    with pytest.raises(CorruptChunk, match="rANS stream did not end in the initial state"):
        rans.decode_interleaved_many([bad, *blocks[1:]], tables)
    # the first stream of the pass failing early leaves the others unfinished: decode_streams runs them alone
    cols, rows = _split(bad, tables)
    cut = simd.prepare(bad.words[:40], cols, rows, tables.precision, np.empty((25, 48), np.uint8))
    rest = [
        simd.prepare(np.asarray(b.words), *_split(b, tables), tables.precision, np.empty((25, 48), np.uint8))
        for b in blocks[1:]
    ]
    assert simd.decode_streams([cut, *rest], tables.packed, tables.precision) == [1, 0, 0, 0]
    for s, (_, sym) in zip(rest, pairs[1:], strict=True):
        assert np.array_equal(s.out, sym)


def _kv(seed: int, layers: int = 3, tokens: int = 80) -> KVCache:
    """K sections 2 x 16 wide (the SIMD decoder), V sections 2 x 4 wide (the numba kernel)."""
    g = torch.Generator().manual_seed(seed)
    return KVCache(
        [
            KVLayer(torch.randn(2, tokens, 16, generator=g) * (1 + i), torch.randn(2, tokens, 4, generator=g))
            for i in range(layers)
        ]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_codec_decodes_the_same_values_with_either_kernel(scalar, dtype):
    """A whole lossy chunk with token importance (a multiplier stream per section), decoded into a
    cache of the chunk's dtype and of another: the SIMD decoder (sections grouped four to a
    job) gives the numba kernels' values (one section per job)."""
    imp = _kv(300, tokens=300)
    prof = calibrate([_kv(1), _kv(2)], "fp-simd", importance_data=[(imp, planted_sensitivity(imp))])
    codec = Codec(prof, threads=2)
    data = codec.encode(_kv(3).to(dtype), 3)
    fast = codec.decode(data)
    into = KVCache.allocate(fast, 80, start=0, dtype=torch.float32 if dtype != torch.float32 else torch.bfloat16)
    codec.decode_into(data, into)
    scalar(False)
    slow = codec.decode(data)
    for a, b, c in zip(fast.layers, slow.layers, into.layers, strict=True):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
        assert torch.equal(c.k, b.k.to(c.k.dtype)) and torch.equal(c.v, b.v.to(c.v.dtype))
    codec.close()


@host_has_one
def test_the_environment_switch_turns_it_off_or_names_a_variant(monkeypatch, caplog):
    monkeypatch.undo()  # the process's own choice, not the fixture's
    try:
        for value, want in [("0", None), ("1", ON_HOST[0]), *((name, name) for name in ON_HOST), ("sse9", ON_HOST[0])]:
            monkeypatch.setenv("CACHEGEN_RANS_SIMD", value)
            simd._variant.cache_clear()
            with caplog.at_level(logging.WARNING, logger=simd.__name__):
                caplog.clear()
                got = simd.variant()
            assert (got.name if got else None) == want and simd.available() == (want is not None)
            assert ("not one of this host's variants" in caplog.text) == (value == "sse9")
    finally:
        simd._variant.cache_clear()


def test_generated_ir_has_one_function_per_pass_size():
    for v in simd.VARIANTS:
        ir = simd.generate_ir(v)
        assert [f"@rans_decode{k}(" in ir for k in range(1, v.group + 2)] == [True] * v.group + [False]
        assert ("@llvm.x86.avx2.permd" in ir) == ("@llvm.x86.avx2.gather.d.d.256" in ir) == (v.name == "avx2")
        assert ("@llvm.masked.expandload" in ir) == (v.name == "avx512")


def test_sections_are_split_into_two_jobs_per_thread_whatever_the_decoder():
    """Each job's streams decode side by side in one call of this kernel, so a job holds 15 of a
    chunk's 60 sections on two threads, not the four the kernel steps at once."""
    sections = list(range(60))
    for threads, n_jobs in ((1, 1), (2, 4), (3, 6), (4, 8)):
        codec = Codec(threads=threads)
        jobs = codec._split(sections, lossy=True)
        codec.close()
        assert len(jobs) == n_jobs and [s for j in jobs for s in j] == sections
        assert max(map(len, jobs)) - min(map(len, jobs)) <= 1
    codec = Codec(threads=2)
    assert codec._split([0, 1], lossy=True) == [[0], [1]]
    assert codec._split([0, 1, 2], lossy=False) == [[0], [1], [2]]
    codec.close()
