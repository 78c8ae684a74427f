"""The engine end to end on SmolLM2: ingest, stream back, answer; faults fall back to recompute."""

import pytest
import torch

from cachegen import corpus
from cachegen.calibrate import load_or_calibrate
from cachegen.engine.engine import Engine
from cachegen.engine.prefill import prefill
from cachegen.errors import ConfigError
from cachegen.store import ContextStore, open_backend
from cachegen.stream import TEXT, CostModel, ThrottledLink, constant

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("store")
    eng = Engine.open(
        "smollm2-135m",
        f"file://{root}",
        levels=(1, 4, 7),
        progress=False,
        dtype=torch.float32,
        profile=load_or_calibrate,
    )
    eng._costs = CostModel()  # defaults: the tests check behaviour, not timing
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def case(engine):
    return corpus.needle_case(engine.tokenizer, 600, seed=5)


def test_ingest_is_idempotent(engine, case):
    first = engine.ingest(case.context_ids)
    assert first.tokens == len(case.context_ids)
    assert first.chunks == -(-len(case.context_ids) // 256)
    assert first.written == first.chunks
    again = engine.ingest(case.context_ids)
    assert again.written == 0
    assert engine.store.lookup(case.context_ids) == len(case.context_ids)
    sizes = [i.sizes for i in engine.store.plan(case.context_ids)]
    assert all(s[1] > s[4] > s[7] for s in sizes)


def test_stream_back_and_answer(engine, case):
    engine.ingest(case.context_ids)
    exact = prefill(engine.model, case.context_ids)
    res = engine.load(case.context_ids, slo_s=None)  # no deadline: the best level everywhere
    assert res.cached_tokens == len(case.context_ids) and not res.faults
    assert res.choices == [1] * len(res.decisions)
    # each load teaches the engine's rates (kept across loads, as its estimator is) its decode times
    assert engine.rates.known and engine.loader().rates is engine.rates
    err = max((a.k - b.k).abs().max().item() for a, b in zip(res.kv.layers, exact.layers))
    scale = max(a.k.abs().max().item() for a in exact.layers)
    assert 0 < err < 0.05 * scale
    gen = engine.generate(case.context_ids, case.question_ids, max_new_tokens=8, slo_s=None)
    assert gen.cached_tokens == len(case.context_ids)
    assert corpus.is_correct(gen.text, case), gen.text
    ref = engine.generate(case.context_ids, case.question_ids, max_new_tokens=8, use_cache=False)
    assert ref.cached_tokens == 0 and corpus.is_correct(ref.text, case)


def test_tight_deadline_picks_smaller_levels(engine, case):
    engine.ingest(case.context_ids)
    sizes = engine.store.plan(case.context_ids)
    best = sum(i.sizes[1] for i in sizes) * 8 / 1e9  # seconds at 1 Gbps
    link = ThrottledLink(constant(1.0))
    loose = engine.load(case.context_ids, slo_s=50 * best + 5, link=link)
    tight = engine.load(case.context_ids, slo_s=0.6 * best, link=link)
    assert all(c == 1 for c in loose.choices[1:])
    assert any(c in (4, 7) for c in tight.choices[1:])


def test_corrupt_store_falls_back_to_exact_recompute(engine, case, tmp_path):
    store = ContextStore(open_backend(f"file://{tmp_path}"), engine.store.namespace, engine.codec, levels=(1, 7))
    bad = Engine(engine.lm, store, engine.codec, CostModel())
    bad.ingest(case.context_ids)
    blobs = [p for p in (tmp_path / "blobs").rglob("*") if p.is_file()]
    assert len(blobs) == 2 * len(store.plan(case.context_ids))
    for f in blobs:  # damage every payload: every chunk must be recomputed
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    res = bad.load(case.context_ids, slo_s=None)
    assert res.faults
    assert all(c == TEXT for c in res.choices)
    exact = prefill(engine.model, case.context_ids)
    for a, b in zip(res.kv.layers, exact.layers):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    store.backend.close()


def test_ingest_resumes_from_the_stored_prefix(engine, tmp_path):
    store = ContextStore(open_backend(f"file://{tmp_path}"), engine.store.namespace, engine.codec, levels=(1, 7))
    eng = Engine(engine.lm, store, engine.codec, CostModel())
    ids = corpus.needle_case(engine.tokenizer, 1100, seed=9).context_ids
    first = eng.ingest(ids[:600])  # an "interrupted" ingest: the first chunks of the context
    assert first.reused_tokens == 0 and first.written == 3
    again = eng.ingest(ids)
    assert again.reused_tokens == 512  # the two full chunks stored: loaded, not prefilled
    assert again.written == len(store.plan(ids)) - 2
    assert store.lookup(ids) == len(ids)
    eng.close()


def test_ingest_tells_every_part_where_the_whole_context_ends(engine, tmp_path):
    """A long context is stored a few chunks at a time; each part's codec is told the context's
    own end (where the next tokens follow), not the part's, or every part's tail would be coded
    as the recent end of a context."""
    store = ContextStore(open_backend(f"file://{tmp_path}"), engine.store.namespace, engine.codec, levels=(4,))
    ends: list = []
    put = store.put_context
    store.put_context = lambda toks, kv, levels=None, *, context_end=None: (  # type: ignore[method-assign]
        ends.append((len(toks), context_end)),
        put(toks, kv, levels, context_end=context_end),
    )[1]
    eng = Engine(engine.lm, store, engine.codec, CostModel())
    ids = corpus.needle_case(engine.tokenizer, 1100, seed=9).context_ids
    eng.ingest(ids, group_chunks=2)
    assert [n for n, _ in ends] == [512, 1024, len(ids)]
    assert {e for _, e in ends} == {len(ids)}
    eng.close()


def test_automatic_reuse_across_requests_and_turns(engine, tmp_path):
    from cachegen.engine.sampling import SamplingParams

    store = ContextStore(open_backend(f"file://{tmp_path}"), engine.store.namespace, engine.codec, 64, levels=(1,))
    eng = Engine(engine.lm, store, engine.codec, CostModel())
    doc = corpus.take_tokens(engine.tokenizer, corpus.text("pydoc-eval"), 300)
    msgs = [{"role": "user", "content": doc + "\n\nWhat is this about?"}]
    p = SamplingParams(max_tokens=12)
    one = eng.chat(msgs, p)
    assert one.cached_tokens == 0 and one.finish_reason in ("stop", "length") and one.text
    eng.writer.flush(120)
    assert eng.writer.stats.written_chunks > 0 and eng.writer.stats.failed == 0
    same = eng.chat(msgs, p)
    assert same.cached_tokens == (len(one.prompt) - 1) // 64 * 64
    eng.writer.flush(120)
    two = eng.chat([*msgs, {"role": "assistant", "content": one.text}, {"role": "user", "content": "Shorter."}], p)
    assert two.cached_tokens >= (len(one.prompt) + len(one.token_ids)) // 64 * 64
    assert two.cached_tokens % 64 == 0 and not two.faults
    eng.close()


def test_sampling_and_stop_strings(engine):
    from cachegen.engine.sampling import SamplingParams

    ids = engine.tokenizer("1, 2, 3, 4, 5,")["input_ids"]
    greedy = engine.start(ids, SamplingParams(max_tokens=6), None).run()
    assert greedy.token_ids == engine.start(ids, SamplingParams(max_tokens=6)).run().token_ids
    a = engine.start(ids, SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, seed=3)).run()
    b = engine.start(ids, SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, seed=3)).run()
    assert a.token_ids == b.token_ids
    stop = engine.start(ids, SamplingParams(max_tokens=12, stop=(",",))).run()
    assert "," not in stop.text and stop.finish_reason == "stop"
    with pytest.raises(ConfigError):
        engine.start([10**9], SamplingParams(max_tokens=1))
    with pytest.raises(ConfigError):
        engine.start([5] * 8000, SamplingParams(max_tokens=500))


def test_costs_are_measured_here_cached_and_measured_again_when_stale(engine, monkeypatch, tmp_path):
    from cachegen.stream import costs as costs_mod

    monkeypatch.setenv("CACHEGEN_HOME", str(tmp_path))
    calls = []

    def fake_decode(codec, sample, levels, **kw):
        calls.append(("decode", sample.num_tokens, tuple(levels)))
        return CostModel(decode_s_per_mvalue={lv: 0.5 for lv in levels}, source="calibrated")

    def fake_recompute(recompute, ids, n, prefix_tokens, base):
        calls.append(("recompute", n, prefix_tokens))
        base.recompute_s_per_token = 7e-3
        return base

    monkeypatch.setattr(costs_mod, "calibrate_decode", fake_decode)
    monkeypatch.setattr(costs_mod, "calibrate_recompute", fake_recompute)
    saved = engine._costs
    try:
        engine._costs = None
        cm = engine.costs()
        assert calls == [("decode", 256, (1, 4, 7)), ("recompute", 256, 512)]
        assert cm.recompute_s_per_token == 7e-3 and cm.machine == costs_mod.machine_id()
        path = costs_mod.engine_path(
            engine.lm.fingerprint, "torch.float32", engine.store.namespace.profile_id, engine.store.chunk_tokens
        )
        assert path.is_relative_to(tmp_path) and costs_mod.load_fresh(path) == cm
        engine._costs = None
        assert engine.costs() == cm and len(calls) == 2  # read back, not measured again
        cm.measured_at -= costs_mod.MAX_AGE_S  # a week old
        cm.save(path)
        engine._costs = None
        engine.costs()
        assert len(calls) == 4 and costs_mod.load_fresh(path) is not None  # measured and stamped again
    finally:
        engine._costs = saved
