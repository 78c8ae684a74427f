import pytest

from cachegen import corpus
from cachegen.errors import ConfigError


def test_pydoc_topics_are_deduplicated():
    topics = [t for _, t in corpus.pydoc_topics()]
    assert len(topics) > 50
    for i, a in enumerate(topics):
        for j, b in enumerate(topics):
            if i != j:
                assert a not in b
    paras = [p for t in topics for p in t.split("\n\n")]
    assert len(paras) == len(set(paras))


def test_calibration_and_evaluation_halves_are_disjoint():
    calib, ev = corpus.text("pydoc-calib"), corpus.text("pydoc-eval")
    assert len(calib) > 10_000 and len(ev) > 10_000
    calib_topics = set(calib.split("\n\n"))
    assert len(calib_topics) > 100
    shared = [p for p in ev.split("\n\n") if len(p) > 200 and p in calib_topics]
    assert not shared


def test_licenses_present_and_text_by_path(tmp_path):
    assert any(n == "GPL-3" for n, _ in corpus.licenses())
    assert "GNU GENERAL PUBLIC LICENSE" in corpus.text("GPL-3")
    f = tmp_path / "doc.txt"
    f.write_text("hello world")
    assert corpus.text(str(f)) == "hello world"
    with pytest.raises(ConfigError):
        corpus.text("no-such-text")


@pytest.mark.model
def test_take_tokens_and_needle(smollm2):
    tok = smollm2.tokenizer
    doc = corpus.take_tokens(tok, corpus.text("GPL-3"), 300, offset=50)
    n = len(tok(doc, add_special_tokens=False)["input_ids"])
    assert 290 <= n <= 310
    # wraps around short sources
    long_doc = corpus.take_tokens(tok, "One short sentence.", 100)
    assert len(tok(long_doc, add_special_tokens=False)["input_ids"]) >= 95

    a = corpus.needle_case(tok, 500, seed=7)
    b = corpus.needle_case(tok, 500, seed=7)
    c = corpus.needle_case(tok, 500, seed=8)
    assert a == b and a.answer != c.answer
    assert len(a.answer) == 5 and a.answer.isdigit()
    assert 450 <= len(a.context_ids) <= 650
    text = tok.decode(a.context_ids)
    assert f"The secret number is {a.answer}." in text
    assert tok.decode(a.question_ids).rstrip().endswith(corpus.ANSWER_PREFIX)
    assert corpus.is_correct(f" {a.answer}.", a) and not corpus.is_correct(" 12", a)


def test_calibration_mix_interleaves_sources_and_holds_no_evaluation_text():
    from cachegen import corpus

    calib = corpus.text("calib")
    pyd = corpus.text("pydoc-calib")
    assert calib.startswith(pyd[: corpus.CALIB_BLOCK_CHARS])
    have = dict(corpus.licenses())
    evaluation = ("GPL-3", "Apache-2.0", "GPL-2", "LGPL-2.1")
    # every licence the mix and the evaluation name must be there: a missing file would silently
    # shrink the calibration text and drop these checks (Debian's base-files ships them)
    missing = [n for n in (*corpus.CALIB_LICENSES, *evaluation) if n not in have]
    assert not missing, f"licence files missing from {corpus.LICENSE_DIR}: {missing}"
    for name in corpus.CALIB_LICENSES:
        assert have[name][:200] in calib
    for name in evaluation:
        t = have[name]
        blocks = [t[i : i + 200] for i in range(0, len(t) - 200, 997)]
        assert len(blocks) > 5 and not any(b in calib for b in blocks), name
    assert pyd[:200] in calib and corpus.text("pydoc-eval")[:200] not in calib
