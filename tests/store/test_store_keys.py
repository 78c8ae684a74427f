"""Chunk keys: chained, namespaced, and identical across processes and machines."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cachegen.errors import ConfigError
from cachegen.store import Namespace, chunk_keys, chunk_spans, token_bytes
from cachegen.store.keys import check_key, tokens_from_bytes

NS = Namespace("model-fp-test", 1, "0123abcd")
# Pinned: a change here breaks every stored cache and every other machine's keys.
GOLDEN_FIRST_KEY = "f2edcc02948fd1d6e32f1f8f98035b12c8f74312ca16d54901706c933c1e0cbd"


def test_spans_keep_the_partial_last_chunk():
    assert chunk_spans(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_spans(8, 4) == [(0, 4), (4, 8)]
    assert chunk_spans(0, 4) == []
    with pytest.raises(ConfigError, match=r"^chunk_tokens must be positive$"):
        chunk_spans(10, 0)
    assert [(r.start, r.end) for r in chunk_keys(list(range(300)), NS, 100)] == [(0, 100), (100, 200), (200, 300)]


def test_golden_key():
    refs = chunk_keys(list(range(300)), NS, 256)
    assert [(r.index, r.start, r.end) for r in refs] == [(0, 0, 256), (1, 256, 300)]
    assert refs[0].key == GOLDEN_FIRST_KEY


def test_tokens_are_little_endian_uint32():
    assert token_bytes([1, 256, 0xFFFFFFFF]) == b"\x01\x00\x00\x00\x00\x01\x00\x00\xff\xff\xff\xff"
    ids = tokens_from_bytes(token_bytes([5, 70000]))
    assert ids == [5, 70000] and all(type(t) is int for t in ids)
    for bad in ([-1], [1 << 32], [[1, 2]], [1.5]):
        with pytest.raises(ConfigError):
            token_bytes(bad)


def test_same_keys_for_list_numpy_and_torch():
    toks = list(range(1000, 1600))
    ref = chunk_keys(toks, NS, 128)
    assert chunk_keys(np.array(toks, dtype=np.int64), NS, 128) == ref
    assert chunk_keys(torch.tensor(toks), NS, 128) == ref
    assert chunk_keys(np.array(toks, dtype=np.int32), NS, 128) == ref


def test_keys_do_not_depend_on_the_process_or_hash_seed():
    code = (
        "import json; from cachegen.store import Namespace, chunk_keys; "
        "print(json.dumps([r.key for r in chunk_keys(list(range(700)), Namespace('model-fp-test', 1, '0123abcd'), 256)]))"
    )
    here = [r.key for r in chunk_keys(list(range(700)), NS, 256)]
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert json.loads(out.stdout) == here


def test_namespace_separates_everything():
    toks = list(range(40))
    base = {r.key for r in chunk_keys(toks, NS, 16)}
    for other in (
        Namespace("other-model", 1, "0123abcd"),
        Namespace("model-fp-test", 2, "0123abcd"),
        Namespace("model-fp-test", 1, "ffff"),
    ):
        assert base.isdisjoint(r.key for r in chunk_keys(toks, other, 16))
    with pytest.raises(ConfigError):
        Namespace("", 1, "x")


@settings(max_examples=60, deadline=None)
@given(
    toks=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=80),
    other=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=80),
    size=st.integers(1, 20),
)
def test_a_key_names_exactly_the_prefix_up_to_its_chunk(toks, other, size):
    """Two contexts share chunk i's key iff they share every token up to chunk i's end."""
    a, b = chunk_keys(toks, NS, size), chunk_keys(other, NS, size)
    for ra, rb in zip(a, b):
        same_prefix = toks[: ra.end] == other[: rb.end]
        assert (ra.key == rb.key) == same_prefix
    assert [r.end for r in a][-1] == len(toks)
    assert len({r.key for r in a}) == len(a)


def test_key_is_the_documented_chain():
    """The scheme in docs/store.md, reimplemented with hashlib and struct only."""
    import hashlib
    import struct

    root = hashlib.blake2b(b"cachegen/store/chunk-key/v1", digest_size=32)
    for part in (b"model-fp-test", b"1", b"0123abcd"):
        root.update(struct.pack("<I", len(part)) + part)
    toks = list(range(300))
    k0 = hashlib.blake2b(root.digest() + struct.pack("<256I", *toks[:256]), digest_size=32).digest()
    k1 = hashlib.blake2b(k0 + struct.pack("<44I", *toks[256:]), digest_size=32).digest()
    assert [r.key for r in chunk_keys(toks, NS, 256)] == [k0.hex(), k1.hex()]


def test_only_chunk_keys_pass_the_check():
    """What reaches a file name or a Redis key: exactly 64 lowercase hex characters."""
    k = "0123456789abcdef" * 4
    assert check_key(k) == k
    assert check_key(chunk_keys([1, 2, 3], NS, 2)[0].key)
    for bad in (k[:-1], k + "0", k.upper(), "X" * 64, k[:-1] + "g", "../" + k[3:], k[:-1] + "/", ""):
        with pytest.raises(ConfigError, match=r"^not a chunk key: "):
            check_key(bad)


def test_empty_and_boundary_token_ids():
    assert token_bytes([]) == b"" and tokens_from_bytes(b"") == [] and chunk_keys([], NS, 4) == []
    assert token_bytes([0, 0xFFFFFFFF]) == b"\x00\x00\x00\x00\xff\xff\xff\xff"
    assert token_bytes(np.array([7, 1 << 31], dtype=np.uint64)) == b"\x07\x00\x00\x00\x00\x00\x00\x80"
    assert token_bytes(torch.tensor([3], dtype=torch.int32)) == b"\x03\x00\x00\x00"
    for bad in (np.array([1.0, 2.0]), np.array([True]).astype(np.float16)):
        with pytest.raises(ConfigError, match=r"^token ids must be integers, got float"):
            token_bytes(bad)
    with pytest.raises(ConfigError, match=r"^token ids must be one-dimensional, got shape \(1, 2\)$"):
        token_bytes([[1, 2]])
    for bad in ([-1], [1 << 32]):
        with pytest.raises(ConfigError, match=r"^token ids must fit in an unsigned 32-bit integer$"):
            token_bytes(bad)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (("fp", -1, "p"), r"^bad codec format version -1$"),
        (("fp", 1.5, "p"), r"^bad codec format version 1.5$"),
        (("fp", 1, ""), r"^a namespace needs a model fingerprint and a profile id$"),
        (("", 1, "p"), r"^a namespace needs a model fingerprint and a profile id$"),
    ],
)
def test_a_namespace_needs_a_model_a_version_and_a_profile(bad, message):
    with pytest.raises(ConfigError, match=message):
        Namespace(*bad)
    assert Namespace("fp", 0, "p").root() != Namespace("fp", 1, "p").root()  # version 0 is a version


class _DeviceTensor:
    """Stands for a GPU tensor: numpy cannot read it (torch's CUDA tensors refuse ``__array__`` the same
    way), and ``.cpu()`` copies it to host memory."""

    def __init__(self, ids):
        self._host = torch.tensor(ids)

    def __array__(self, *args, **kwargs):
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor first.")

    def cpu(self) -> torch.Tensor:
        return self._host


def test_device_tensors_are_copied_to_the_host_first():
    ids = list(range(1000, 1300))
    with pytest.raises(TypeError):
        np.asarray(_DeviceTensor(ids))  # what token_bytes must not do
    assert token_bytes(_DeviceTensor([1, 256, 0xFFFFFFFF])) == b"\x01\x00\x00\x00\x00\x01\x00\x00\xff\xff\xff\xff"
    assert chunk_keys(_DeviceTensor(ids), NS, 128) == chunk_keys(ids, NS, 128)
