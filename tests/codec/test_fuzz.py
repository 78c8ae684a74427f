"""The structured decoder fuzzer in CI: 10,000 mutated real chunks, in a subprocess with a memory limit
(`make fuzz` runs a million).

Every outcome must be CorruptChunk (or one of its kinds) or a finite decode of the shape the
header and the profile promise (``cachegen.bench.fuzz.check_decode``); MemoryError under the
address-space limit, any other exception, a non-finite value or a wrong shape fails.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from cachegen.bench import fuzz

CASES = 10_000


def test_fuzz_10k_structured_mutations_in_a_memory_limited_subprocess():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "cachegen.bench.fuzz",
            "--cases",
            str(CASES),
            "--seed",
            "14",
            "--memory-mb",
            "512",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.stdout.strip(), r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    counts = res["counts"]
    fails = {k: v for k, v in counts.items() if not (k == "ok" or k.startswith("corrupt:"))}
    assert not fails, fails
    assert sum(counts.values()) == CASES and r.returncode == 0
    # the mutations reach the parsers behind the checksums: most are refused there, some decode
    assert counts.get("corrupt:CorruptChunk", 0) > CASES // 4 and counts.get("ok", 0) > CASES // 50
    assert counts.get("corrupt:KeyMismatch", 0) > 0 and counts.get("corrupt:ProfileMismatch", 0) > 0


def test_mutations_keep_checksums_valid():
    """A mutated chunk still passes the header checksum (or is a garbled header on purpose)."""
    from cachegen.codec.container import parse_header
    from cachegen.errors import CorruptChunk

    corpus = fuzz.build_corpus()
    rng = np.random.default_rng(1)
    parsed = 0
    for i in range(400):
        data = fuzz.mutate(rng, corpus.chunks[i % len(corpus.chunks)][1])
        try:
            parse_header(data)
            parsed += 1
        except CorruptChunk:  # a header field that fails its own range check, or a garbled header on purpose
            pass
    assert parsed > 300


def test_check_decode_flags_what_it_must():
    corpus = fuzz.build_corpus()
    _name, data, codec = corpus.chunks[0]
    assert fuzz.check_decode(codec, data) == "ok"
    assert fuzz.check_decode(codec, data[:-1]).startswith("corrupt:")

    class Liar:  # a decoder that returns a non-finite cache must be reported
        max_tokens, profile = codec.max_tokens, None

        def decode(self, d, key=None):
            kv = codec.decode(d, key=key)
            kv.layers[0].k[0, 0, 0] = float("nan")
            return kv

    assert fuzz.check_decode(Liar(), data) == "FAIL:nonfinite"
