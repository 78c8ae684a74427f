"""Mutation testing of cachegen's core with mutmut 3: ``make mutate`` runs every module of :data:`MODULES`.

Usage::

    python tools/mutate.py                      # every module, then mutation.json (what `make mutate` runs)
    python tools/mutate.py --module keys        # one module (repeatable); its row of mutation.json is replaced
    python tools/mutate.py --module keys --keep # reuse mutmut's earlier results for that module (see below)
    python tools/mutate.py --module keys --mutant 'cachegen.store.keys.x_chunk_keys*'   # re-run some mutants
    python tools/mutate.py --list               # the table: modules, files, test selections
    python tools/mutate.py --rerun-equivalent   # also re-test the mutants judged equivalent (see below)

Why one mutmut run per module: mutmut first runs the selected tests once ("stats") to learn which
tests execute each function, then runs, for every mutant, only the tests that execute the mutated
function. Selecting only the tests written for a module keeps that per-mutant run short (a codec
mutant would otherwise also run every store and loader test that happens to decode a chunk), and a
module can be measured alone while its tests are being written.

How: a module gets a work directory ``mutants/<name>/`` with links ``src`` and ``tests`` to the
repository's and a ``pyproject.toml`` that is the repository's with the ``[tool.mutmut]`` section
rewritten: the shared settings of the repository's own section, plus ``do_not_mutate`` naming every
other source file and the module's test selection. mutmut copies ``src`` and ``tests`` to
``mutants/<name>/mutants/``, rewrites the module's functions there into trampolines (one variant per
mutant, chosen by the environment variable ``MUTANT_UNDER_TEST``), puts that copy first on
``sys.path`` (it removes the repository's ``src``), forks one test run per mutant and records each
exit status in ``<file>.meta``, which this script reads. By default a module's work directory is
removed first, so every mutant is tested against the current tests; ``--keep`` lets mutmut reuse its
results (it re-tests mutants of functions whose source changed and runs the stats again for new
tests, but does not re-test a surviving mutant against a changed test: pass ``--mutant``).

``--mutant`` merges: before the run the script reads the module's ``.meta`` results, and after it every
mutant that mutmut left "not checked" (exit status None: not named, or reset by mutmut, which after a
change of the test selection re-runs its stats and drops every earlier result) gets its earlier
result back, if the source of its function is unchanged (same ``hash_by_function_name``; a changed
function renumbers its mutants, so those stay unchecked until named). The merged results are written
back to the ``.meta`` files, and the row counts the whole module, its ``merged`` field says how many
results were kept from before, its ``seconds`` add this run to the earlier row's. A mutant without
an earlier result stays unchecked (counted under ``other``, not as a kill: an earlier version read it
from mutation.json's row, "not listed as a survivor" taken for "killed", and the next full run of the
local store found 60 survivors among mutants its row had counted as killed). A kept kill stays right
when tests were only added; a kept survivor may be killed by a new test: name it to re-test it. After
tests were removed from a selection, run the whole module again.

Known equivalents are not re-run. A mutant listed in :data:`EQUIVALENT` survived every test when it
was judged, and by the reason given it always will; re-running it costs a full pass over its tests
(about 6 s each in the codec, 420 s of the 2-core machine over all modules). Each row of
``mutation.json`` keeps, for its equivalent mutants, the hash mutmut gave their function's source
(``equivalent_hashes``); the next run marks such a mutant survived without running it when its
function's hash is the same and mutmut's version too (``equivalent_not_rerun`` counts them). A
changed function renumbers its mutants, so its equivalents run again and their listing must be
checked against the new numbers. ``--rerun-equivalent`` runs them all; so does a run with no
``mutation.json``. Named ``--mutant`` mutants always run.

Adding a module: add a row to :data:`MODULES`: its name, its source files (paths under ``src/``; a
directory means every ``.py`` file below it) and the pytest arguments that select its tests (files,
``file::test`` ids, ``-k`` / ``-m`` expressions). Keep the selection to the tests written for the
module, without real-model tests where a toy input exercises the same code: the selected tests that
execute a function run once per mutant of it. A test can only kill a mutant in its own process: one
that starts ``python -m cachegen...`` imports the unmutated source, and one that reads repository
files other than ``src/`` and ``tests/`` fails in the copy, so leave those out of the selection.

What mutmut 3 does not mutate: code outside functions (module constants), functions with a decorator
other than ``@staticmethod`` / ``@classmethod`` (every numba ``@njit`` kernel, properties) and the
methods of decorated classes (dataclasses). docs/testing.md lists what that leaves out per module and
the surviving mutants judged equivalent (:data:`EQUIVALENT`, excluded from the score).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "mutants"
RESULT = ROOT / "mutation.json"
MUTMUT_KEYS = ("source_paths", "do_not_mutate", "pytest_add_cli_args_test_selection")


@dataclass(frozen=True)
class Module:
    """One row of the table: what to mutate and which tests may kill its mutants."""

    name: str
    paths: tuple[str, ...]  # under the repository root: files, or directories (every .py below)
    tests: tuple[str, ...]  # pytest arguments selecting the module's tests
    owner: str  # who keeps the row's tests (H1: codec, H2: store and stream)


_FAST = ("-m", "not model and not redis and not slow")

# mutmut stops a mutant's run after (t + timeout_constant) * timeout_multiplier seconds of wall time, t being
# the summed call time, in the clean run, of the tests that execute the mutated function (setup, teardown and
# pytest's own start are not in t). A mutant stopped there counts as killed, so the limit must stay well above
# what a surviving mutant takes, and a mutant that loops forever holds a worker for all of it. The ratios
# below (slowest survivor's time / (t + 1 s)) are from the .meta files of the previous full runs.
TIMEOUTS: dict[str, dict[str, float]] = {
    # quantize_counts' tests add up to t = 22 s and its slowest survivor takes 0.5 (t + 1): 2x leaves 4x headroom,
    # and its 8 mutants that loop forever are stopped after 47 s, not 116 s
    "rans": {"timeout_multiplier": 2.0},
    # survivors at 0.9 (t + 1): 3x; the 20 timeouts (loops over an index that no longer shrinks) end sooner
    "local": {"timeout_multiplier": 3.0},
    # the loader's tests spend most of their time in setup (a store per test), which t leaves out: a survivor
    # takes up to 5 (t + 1) s, as long as the default limit; 4 s more per test keeps it from a false timeout
    "loader": {"timeout_constant": 4.0},
}

# The per-module test selections. Each row's owner may edit it.
MODULES: tuple[Module, ...] = (
    # -- codec (H1) -------------------------------------------------------------------------------
    Module(
        "container",
        ("src/cachegen/codec/container.py",),
        ("tests/codec/test_container.py", "tests/codec/test_codec_bounds.py", "tests/codec/test_codec.py", *_FAST),
        "H1",
    ),
    Module(
        "codec",
        (
            "src/cachegen/codec/codec.py",
            "src/cachegen/codec/quant.py",
            "src/cachegen/codec/transform.py",
        ),
        (
            "tests/codec/test_quant.py",
            "tests/codec/test_codec_bounds.py",
            "tests/codec/test_codec.py",
            "tests/codec/test_codec_paths.py",
            "tests/codec/test_finite_check.py",
            "tests/codec/test_context_end.py",
            "tests/codec/test_decode_many.py",
            *_FAST,
        ),
        "H1",
    ),
    Module(
        "rans",
        ("src/cachegen/codec/rans",),
        (
            "tests/codec/test_rans.py",
            "tests/codec/test_rans_oracles.py",
            "tests/codec/test_rans_simd.py",
            "tests/codec/test_rans_column_many.py",
            "-k",
            "not generated_lanes_module_is_current and not generator_check_mode",
            *_FAST,
        ),
        "H1",
    ),
    # -- store and stream (H2) --------------------------------------------------------------------
    Module("keys", ("src/cachegen/store/keys.py",), ("tests/store/test_store_keys.py", *_FAST), "H2"),
    Module(
        "local",
        ("src/cachegen/store/local.py",),
        (
            "tests/store/test_store_local.py",
            "tests/store/test_store_chaos.py",
            "tests/store/test_store_names.py",
            "tests/store/test_store_local_oracles.py",
            # the SIGKILL and multi-process tests check other processes, which run the unmutated source
            "-k",
            "not sigkill and not two_processes and not concurrent",
            *_FAST,
        ),
        "H2",
    ),
    Module(
        "loader",
        ("src/cachegen/stream/loader.py", "src/cachegen/stream/compute_rates.py"),
        (
            "tests/stream/test_loader.py",
            "tests/stream/test_compute_rates.py",
            "tests/stream/test_loader_faults.py",
            "tests/stream/test_loader_accounting.py",
            "tests/stream/test_loader_messages.py",
            "tests/stream/test_loader_options.py",
            "tests/stream/test_planner_oracles.py",
            "tests/stream/test_loader_batch.py",
            "tests/stream/test_fetch_cpu.py",
            "tests/stream/test_steady.py",
            "tests/stream/test_loader_layout.py",
            # the real codec's test compiles its numba kernels in the mutated copy (38 s in mutmut's
            # stats), and mutmut runs it for every mutant of load(): the toy codec's tests hold the loader
            "-k",
            "not real_codec_through_local_store",
            *_FAST,
        ),
        "H2",
    ),
    Module(
        "planner",
        ("src/cachegen/stream/planner.py",),
        (
            "tests/stream/test_planner.py",
            "tests/stream/test_planner_oracles.py",
            "tests/stream/test_planner_units.py",
            "tests/stream/test_planner_adaptive.py",
            "tests/stream/test_planner_fastest.py",
            "tests/stream/test_fastest.py",
            "tests/stream/test_batched_costs.py",
            "tests/stream/test_fetch_cpu.py",
            "tests/stream/test_steady.py",
            *_FAST,
        ),
        "H2",
    ),
    Module(
        "estimator",
        ("src/cachegen/stream/estimator.py",),
        ("tests/stream/test_estimator.py", "tests/stream/test_planner.py", *_FAST),
        "H2",
    ),
)

# Surviving mutants that no test can kill because they do not change behaviour: name -> why.
# (Mutant names are mutmut's: <module>.x_<function>__mutmut_<n>; docs/testing.md lists them too.)
_PID16 = "a profile id is 32 hex digits (Profile.id) or empty (16 zero bytes): pid is always 16 bytes, never padded"
_F64 = "astype(None) is astype(float64)"
_I64 = "the rANS entry points cast table indexes, lengths and row shifts to int64 (np.ascontiguousarray(..., int64))"
_EXACT = "float64 holds these small integers exactly and the numba kernels read them through np.int64(...)"
_U32 = "'<i' and '<I' pack the same bytes below 2^31, and these counts stay far below (2^31 words is 4 GiB)"
_PREC = "Categorical's precision defaults to 12 = PRECISION"
_CHECK = "encode_columns' check= only tests symbol < alphabet size: uint8 plane bytes are always < 256"
_DUMMY = "a one-symbol plane's dummy count: any positive count below the cap's remainder gives the same capped table"
_SLICE = "a section/step/class slice one longer is cut back to the layer's two by the zip over (k, v) in _encode_layer"
_COPY = "tobytes() copies anyway: whether astype copies changes no byte"
_ZIP = "zip over sequences of equal length by construction: strict= changes nothing"
_JOBS = "how sections are grouped into decode jobs changes the work per thread, not a value"
_ONE_BY_ONE = "chunks decoded one by one instead of together: the same values (the tests' reference), only slower"
_F64BUF = "the kernel computes in float32: a float64 buffer holds its values exactly and the cast rounds them the same"
_CODEC_EQUIVALENT = {
    "x_all_finite__mutmut_3": "the first sum in the tensor's own dtype instead of float32: NaN and Inf still make it"
    " non-finite and an overflow still falls back to the float64 sum; only slower for bf16 and fp16",
    "x__decode_lossless__mutmut_14": "'<b' reads the element-size byte: a byte >= 128 is refused either way (neither 2 nor 4)",
    "x__decode_lossless__mutmut_27": "float64 frequencies from '<u2' are exact; Categorical takes int64 and the checks use int()",
    "x__decode_lossless__mutmut_46": _I64,
    "x__decode_lossless__mutmut_89": _PREC,
    "x__decode_lossless__mutmut_101": _EXACT,
    "x__decode_lossless__mutmut_103": _I64,
    "x__decode_lossless__mutmut_105": _I64,
    "x__decode_lossless__mutmut_113": "reshape(None) and reshape(-2) of the C-contiguous raw bytes: np.frombuffer reads the same buffer",
    "x__decode_lossless__mutmut_115": "reshape(None) and reshape(-2) of the C-contiguous raw bytes: np.frombuffer reads the same buffer",
    "x__encode_lossless__mutmut_26": "'<b' and '<B' pack an element size of 2 or 4 to the same byte",
    "x__encode_lossless__mutmut_37": _PREC,
    "x__encode_lossless__mutmut_42": _CHECK,
    "x__encode_lossless__mutmut_46": _CHECK,
    "x__encode_lossless__mutmut_52": _CHECK,
    "x__encode_lossless__mutmut_48": _I64,
    "x__encode_lossless__mutmut_50": _I64,
    "x__encode_lossless__mutmut_63": _U32,
    "x__encode_section__mutmut_3": "with no sink tokens x[:, :0] gives b'' too",
    "x__encode_section__mutmut_34": _U32,
    "x__encode_section__mutmut_40": _U32,
    "x__encode_section__mutmut_69": _U32,
    "x__encode_section__mutmut_51": _EXACT + " (multiplier symbols 0..6)",
    "x__encode_section__mutmut_54": _I64,
    "x__encode_section__mutmut_56": _I64,
    "x__encode_section__mutmut_58": "typing.cast returns its value whatever the type named",
    "x__lossless_tables__mutmut_2": _F64,
    "x__lossless_tables__mutmut_14": _DUMMY + " (0 overwritten when it is the plane's symbol: 1 gets the rest)",
    "x__lossless_tables__mutmut_16": _DUMMY + " (the plane's symbol overwritten: the first other gets the rest)",
    "x__lossless_tables__mutmut_20": _DUMMY + " (1e-9 / n instead of 1e-9 * n)",
    "x__lossless_tables__mutmut_26": _DUMMY + " (2e-9 instead of 1e-9 for an empty plane)",
    "x__lossless_tables__mutmut_35": "at exactly the cap the capping moves freqs[top] - cap = 0",
    "x__lossless_tables__mutmut_39": "-2 or -1 at the top: argmax of the rest picks a frequency >= 0 either way",
    "x_section_symbols__mutmut_12": "a pad of two instead of one: quantize writes at most y.size escapes",
    "xǁCodecǁencode__mutmut_55": "pid None or '': pack_header writes 16 zero bytes for any false profile id",
    "xǁCodecǁencode__mutmut_85": "calibrate's n_sink defaults to DEFAULT_SINK = 4",
    "xǁCodecǁencode__mutmut_118": _SLICE + " (layer_multipliers' extra u is unused)",
    "xǁCodecǁencode__mutmut_119": _SLICE + " (layer_multipliers' extra u is unused)",
    "xǁCodecǁencode__mutmut_124": _SLICE,
    "xǁCodecǁencode__mutmut_125": _SLICE,
    "xǁCodecǁencode__mutmut_130": _SLICE,
    "xǁCodecǁencode__mutmut_131": _SLICE,
    "xǁCodecǁencode__mutmut_144": "pack_header writes FORMAT_VERSION itself, not h.version",
    "xǁCodecǁencode__mutmut_157": "pack_header ignores payload_offset (parse_header computes it)",
    "xǁCodecǁencode__mutmut_177": "pack_header ignores payload_offset (parse_header computes it)",
    # the lossy decode, split into parsing, rANS and values for decoding several chunks in one call
    "x__parse_lossy__mutmut_33": _EXACT + " (the escapes are int32)",
    "x__parse_lossy__mutmut_35": _EXACT + " (the escapes are int32)",
    "x__parse_lossy__mutmut_37": "a pad of two instead of one: dequantize reads at most esc[n_esc]",
    "x__parse_lossy__mutmut_96": "the section's index is read only by the multiplier range error, which cannot be raised"
    " (_decode_multipliers 22)",
    "x__parse_lossy__mutmut_117": "float64 zeros: row_scale casts u to float64, decode_interleaved row shifts to int64",
    "x__parse_lossy__mutmut_119": "float64 zeros: row_scale casts u to float64, decode_interleaved row shifts to int64",
    "x__decode_multipliers__mutmut_13": _ZIP,
    "x__decode_multipliers__mutmut_16": _ZIP,
    "x__decode_multipliers__mutmut_17": _ZIP,
    "x__decode_multipliers__mutmut_20": "float64 u: the range check compares values, row_scale casts to float64, row shifts"
    " to int64",
    "x__decode_multipliers__mutmut_22": "unreachable: a u table has N_U = U_MAX - U_MIN + 1 symbols (checked by"
    " Profile.from_bytes), so u <= U_MAX",
    "x__decode_lossy__mutmut_32": "the placeholder arrays are all replaced by decoded symbols before they are read",
    "x__decode_lossy__mutmut_49": _ZIP,
    "x__decode_lossy__mutmut_52": _ZIP,
    "x__decode_lossy__mutmut_53": _ZIP,
    "x__finish_lossy__mutmut_20": _ZIP,
    "x__finish_lossy__mutmut_23": _ZIP,
    "x__finish_lossy__mutmut_24": _ZIP,
    "x__decode_job__mutmut_30": "a buffer of the chunks' dtype when out has it too: the same values, one copy more",
    "x__decode_job__mutmut_49": _ZIP,
    "x__decode_job__mutmut_52": _ZIP,
    "x__decode_job__mutmut_53": _ZIP,
    "x__from_bytes__mutmut_10": "an empty tensor: copying no values, whatever its dtype",
    "x__from_bytes__mutmut_12": "an empty tensor: copying no values, whatever its dtype",
    "x_layer_inputs__mutmut_32": "K and V of a layer have the same heads (KVLayer and the profile's layer_dims)",
    "x_layer_inputs__mutmut_36": "K and V of a layer have the same tokens (KVLayer checks it)",
    "xǁCodecǁ_decode_sections__mutmut_26": _JOBS,
    "xǁCodecǁ_decode_sections__mutmut_29": _JOBS,
    "xǁCodecǁ_decode_sections__mutmut_39": _ZIP,
    "xǁCodecǁ_decode_sections__mutmut_42": _ZIP,
    "xǁCodecǁ_decode_sections__mutmut_43": _ZIP,
    "xǁCodecǁdecode_many_into__mutmut_14": _ZIP,
    "xǁCodecǁdecode_many_into__mutmut_17": _ZIP,
    "xǁCodecǁdecode_many_into__mutmut_18": _ZIP,
    "xǁCodecǁdecode_many_into__mutmut_44": _ONE_BY_ONE,
    "xǁCodecǁdecode_many_into__mutmut_50": _ONE_BY_ONE,
    "xǁCodecǁdecode_many_into__mutmut_52": _ONE_BY_ONE,
    "xǁCodecǁdecode_many_into__mutmut_56": _ZIP,
    "xǁCodecǁdecode_many_into__mutmut_59": _ZIP,
    "xǁCodecǁdecode_many_into__mutmut_60": _ZIP,
    "xǁCodecǁ__del____mutmut_10": "shutdown(wait=None): as wait=False, None is false",
    "xǁCodecǁ__del____mutmut_11": "joining the idle pool from __del__: it deadlocked only when a collection ran inside"
    " another thread's start-up, which no test provokes reliably",
}
_TRANSFORM_EQUIVALENT = {
    "x_inverse_section_into__mutmut_1": "every caller passes start",
    "x_inverse_section_into__mutmut_57": _F64BUF,
    "x_inverse_section_into__mutmut_59": _F64BUF,
}
_QUANT_EQUIVALENT = {
    "x_classes_for__mutmut_7": _F64,
    "x_classes_for__mutmut_9": _F64,
    "x_laplace_prior__mutmut_13": "an int64 arange plus 0.5 gives the same float64 values",
    "x_laplace_prior__mutmut_16": "an int64 arange plus 0.5 gives the same float64 values",
    "x_laplace_prior__mutmut_28": "at x = 0 both halves of the CDF are 0.5 (and x = q +- 1/2 is never 0)",
    "x_laplace_prior__mutmut_60": "a probability of exactly 2**-13 from a difference of two Laplace CDF values does not occur",
    "x_laplace_prior__mutmut_68": "np.zeros defaults to float64",
    "x_laplace_prior__mutmut_70": "np.zeros defaults to float64",
    "x_tables_from_counts__mutmut_10": _F64,
    "x_tables_from_counts__mutmut_33": "the dropped 1e-12 never exceeds 1e-9 * max(total, 1.0)",
}
_IDX = "decode_columns / encode_columns cast table indexes and lengths to int64 themselves"
_QDIFF = (
    "unreachable: rounding leaves 2**prec - sum(f) below k/2 (each rounded share is > its value - 1/2), so a"
    " positive error never exceeds k and takes steps of 1"
)
_KIDX = (
    "the kernels copy table indexes into int64 arrays (tb[j] = tab_idx[...]): indexes of integer value select the"
    " same models whatever their dtype"
)
_INTS = "np.array of Python ints is int64 here"
_NEG = "every verdict count is >= 0: the negated sum is nonzero exactly when the sum is"
_NO_SIMD = "the AVX-512 kernel never used: the numba kernels give the same symbols and verdicts, only slower"
_LABEL = "a label's name is read only by the branch just before its definition: any distinct name is the same IR"

_RANS_EQUIVALENT = {
    "blob.x_decode__mutmut_14": "unpack_from's offset defaults to 0",
    "blob.x_decode__mutmut_35": _IDX,
    "blob.x_decode__mutmut_51": "(len + pos) % 2 and (len - pos) % 2 have the same parity",
    "blob.x_decode__mutmut_57": "float64 words hold the 16-bit values exactly and the column kernels read them through np.int64(...)",
    "blob.x_decode__mutmut_83": _IDX,
    "blob.x_decode__mutmut_85": _IDX,
    "blob.x_decode__mutmut_88": _IDX,
    "blob.x_decode__mutmut_90": _IDX,
    "blob.x_encode__mutmut_12": "no dtype kind is 'X': 'XXuiXX' admits exactly the kinds 'ui' does",
    "blob.x_encode__mutmut_29": _IDX,
    "blob.x_encode__mutmut_31": _IDX,
    "blob.x_encode__mutmut_34": _IDX,
    "blob.x_encode__mutmut_36": _IDX,
    "blob.x_encode__mutmut_39": "float64 symbols: encode_columns refuses one >= the alphabet size with the same message"
    " and the kernel reads them through np.int64(...)",
    "columns.x_encode_columns__mutmut_38": "a float64 scratch holds the 16-bit words exactly; _gather_kernel copies them into uint16 words",
    "columns.x_encode_columns__mutmut_40": "a float64 scratch holds the 16-bit words exactly; _gather_kernel copies them into uint16 words",
    # 2026-12-06: decode_column_many, prepare_many, and simd.py's first triage (it came after the row's last run)
    **{f"interleaved.x_decode_column_many__mutmut_{i}": _INTS for i in (12, 14, 17, 19)},
    **{
        f"interleaved.x_decode_column_many__mutmut_{i}": "the streams as given (uint16 everywhere): the kernel reads"
        " the same values from any integer words"
        for i in (7, 9)
    },
    **{
        f"interleaved.x_decode_column_many__mutmut_{i}": "float64 offsets hold the word positions exactly, and"
        " the kernel's slices take them as integers"
        for i in (74, 76)
    },
    **{f"interleaved.x_decode_interleaved_many__mutmut_{i}": _NEG for i in (86, 107, 131)},
    **{f"interleaved.x_decode_interleaved_many__mutmut_{i}": _NO_SIMD for i in (60, 69)},
    "interleaved.x_decode_interleaved_many__mutmut_80": "pad words are read only by a stream already past its last"
    " word, which decode_lanes refuses whatever they hold",
    "interleaved.x_decode_interleaved_many__mutmut_83": "one pad word more than decode_lanes can read",
    # 2026-12-07: the AVX2 variant renumbered _function's, _kernels' and decode_streams' mutants (and _kernels'
    # lock-free check for compiled kernels, later, _kernels' again: +3)
    **{f"simd.x__function__mutmut_{i}": _LABEL for i in (61, 62, 107, 108, 109, 110, 112, 113, 114)},
    **{
        f"simd.x__expand_avx2__mutmut_{i}": "a value's name, defined once and read after it: any distinct name is the"
        " same IR"
        for i in (18, 19, 20)
    },
    "simd.x__kernels__mutmut_10": "the host's features are given explicitly: the CPU name only repeats them",
    "simd.x__kernels__mutmut_11": "the host's CPU name implies its features",
    "simd.x__kernels__mutmut_4": "every variant steps at least two streams, so its kernel 2 is compiled with kernel 1",
    **{
        f"simd.x__kernels__mutmut_{i}": "a function the IR lacks has address 0: kept in _compiled, never returned or"
        " called"
        for i in (26, 30)
    },
    "simd.x__kernels__mutmut_12": "opt=2 instead of 3: the same code for this IR, or slower, never other results",
    "simd.x__kernels__mutmut_35": "without the declared int32, ctypes passes the Python int prec as a C int: the same"
    " 32-bit register on x86-64",
    **{
        f"simd.x_decode_streams__mutmut_{i}": "a stream that ended cleanly decoded again alone: the same symbols and 0"
        for i in (32, 33)
    },
    "simd.x_decode_streams__mutmut_24": "any negative start: the kernel writes 0 or a count, and < 0 still means not"
    " reached",
    **{f"simd.x_decode_streams__mutmut_{i}": "Tables.packed is int32 and C-contiguous already" for i in (7, 9)},
    **{f"simd.x_host_variants__mutmut_{i}": "None is false like False" for i in (4, 6)},
    **{f"simd.x_prepare_many__mutmut_{i}": _INTS for i in (5, 7, 10, 12, 16, 18)},
    "simd.x_prepare_many__mutmut_132": "n * S is a multiple of 16: the float quotient is exact and cast back into int64",
    **{
        f"simd.x_prepare_many__mutmut_{i}": "decode_streams sets the result slot to -1 before each pass"
        for i in (139, 140)
    },
    **{
        f"simd.x_prepare_many__mutmut_{i}": "a Stream's arrays only keep the shared buffers alive: the kernel reads"
        " the argument table"
        for i in (152, 154, 156)
    },
    "simd.x_prepare_many__mutmut_90": "None stored in a bool array is False",
    "interleaved.x_decode_interleaved__mutmut_55": "pad words are read only by a stream already past its last word, which"
    " decode_lanes refuses whatever they hold (S - 1 pad words: the last such read is one word out of the buffer)",
    "interleaved.x_decode_interleaved__mutmut_57": "one pad word more than decode_lanes can read",
    "interleaved.x_encode_interleaved__mutmut_41": "a stream is at most n*S + 16 words (a lane's first coded symbol never"
    " renormalises: 2**16 < f << (32 - prec)), so n*S + 31 words hold it",
    "interleaved.x_encode_interleaved__mutmut_45": "a bigger buffer: the stream is taken from its end (out[p:])",
    "interleaved.x_encode_interleaved__mutmut_46": "a bigger buffer: the stream is taken from its end (out[p:])",
    "interleaved.x_encode_interleaved__mutmut_48": "always recomputing freq | cum << 16 gives Tables.build's fc",
    "model.x_min_bits__mutmut_3": "the largest of the per-table maxima is the maximum over all tables",
    "model.x_quantize_counts__mutmut_6": "c / c.sum() is true division: integer counts give the same float64 shares",
    "model.x_quantize_counts__mutmut_8": "c / c.sum() is true division: integer counts give the same float64 shares",
    "model.x_quantize_counts__mutmut_32": "the float64 shares are assigned into the int64 f, which casts them the same",
    "model.x_quantize_counts__mutmut_53": "numpy reads the sort kind case-insensitively ('STABLE' is 'stable')",
    "model.x_quantize_counts__mutmut_62": "the loop breaks at diff == 0 before this test",
    "model.x_quantize_counts__mutmut_65": _QDIFF,
    **{f"model.x_quantize_counts__mutmut_{i}": _QDIFF for i in range(67, 81)},
    "columns.x_encode_columns__mutmut_12": _KIDX,
    "columns.x_encode_columns__mutmut_14": _KIDX,
    "columns.x_decode_columns__mutmut_10": _KIDX,
    "columns.x_decode_columns__mutmut_12": _KIDX,
    "columns.x_decode_columns__mutmut_3": "integer stream lengths: np.asarray keeps them (cumsum writes int64 offsets)",
    "columns.x_decode_columns__mutmut_5": "integer stream lengths: np.asarray keeps them (cumsum writes int64 offsets)",
    "model.x_quantize_counts__mutmut_86": "an entry at 1 gets step = min(step, f[j] - 1) = 0: the same as skipping it",
    "model.x_quantize_counts__mutmut_113": "step <= max(1, (f[j] - 1) // 8) <= f[j] - 1 when f[j] > 1: the cap never binds",
    "model.xǁTablesǁbuild__mutmut_38": "1.0 / np.maximum(freq, 1) never divides by zero: errstate(divide=...) changes nothing",
    "model.xǁTablesǁbuild__mutmut_77": "the int64 symbol ids are assigned into the lut of the symbol dtype, which casts them the same",
    "model.xǁTablesǁbuild__mutmut_79": "the int64 symbol ids are assigned into the lut of the symbol dtype, which casts them the same",
    "model.xǁTablesǁbuild__mutmut_88": "np.arange of an int defaults to int64",
    "model.xǁTablesǁbuild__mutmut_90": "np.arange of an int defaults to int64",
    "model.xǁTablesǁbuild__mutmut_101": "take_along_axis' default axis -1 is axis 1 of the 2-D tables",
    "model.xǁTablesǁbuild__mutmut_109": "take_along_axis' default axis -1 is axis 1 of the 2-D tables",
    "model.xǁCategoricalǁfrom_counts__mutmut_11": "quantize_counts casts the counts to float64 itself",
    "model.xǁCategoricalǁfrom_counts__mutmut_13": "quantize_counts casts the counts to float64 itself",
}
_NOTEXT = "text=None is false like text=False: options() leaves TEXT out"
_PREVTEXT = "prev TEXT or None: neither is a level, so no chunk after it joins a batch either way"
_NETONLY = "chunk_costs' one caller (choose_rule) reads only the network seconds"
_TEXTPRICE = (
    "text's price holds its recompute as both decode prices, and the text steps read neither its fetch, its fetch's CPU"
    " nor the batched one"
)
_PLANNER_EQUIVALENT = {
    "x_lift__mutmut_2": "boost 0 passes the check: lv[max(0, lv.index(level) - 0)] is the level itself",
    "x_lift__mutmut_8": _NOTEXT,
    "x_lift__mutmut_11": "TEXT among the levels: text returned before, TEXT is last and a lift only moves to earlier places",
    "x_lift__mutmut_12": "TEXT among the levels: text returned before, TEXT is last and a lift only moves to earlier places",
    "x_smallest_level__mutmut_5": _NOTEXT,
    "x_choose_rule__mutmut_3": _NOTEXT,
    "x_choose_rule__mutmut_6": "TEXT as the last option returns TEXT (its fetch is 0.0 s) when no level fits, as the fall-through does",
    "x_choose_rule__mutmut_7": "TEXT as the last option returns TEXT (its fetch is 0.0 s) when no level fits, as the fall-through does",
    "x_simulate__mutmut_3": "simulate never reads the default state's time_left_s",
    "x_simulate__mutmut_4": "simulate never reads the default state's time_left_s",
    "x__cold_start__mutmut_23": "the text step returns the link time unchanged and only its compute end is read",
    "x__cold_start__mutmut_27": "the text step does not read the rate (the recompute alone)",
    "x__cold_start__mutmut_36": "the text step returns the link time unchanged and only its compute end is read",
    "x_choose_adaptive__mutmut_147": _PREVTEXT,
    "x_choose_adaptive__mutmut_155": _PREVTEXT,
    "x_finish_quantile__mutmut_26": _PREVTEXT,
    "x_chunk_costs__mutmut_1": _NETONLY,
    "x_chunk_costs__mutmut_16": _NETONLY,
    "x_chunk_costs__mutmut_19": _NETONLY,
    "x_decide__mutmut_37": _NOTEXT,
    "x_decide__mutmut_91": "with one chunk left there is no tail: choose_adaptive's fits() never reads the futures",
    "x_decide__mutmut_105": "finish_quantile reads one column of futures per later chunk: the two extra are never read",
    "x__at__mutmut_3": _TEXTPRICE,
    "x__prices__mutmut_9": _TEXTPRICE,
    "x__prices__mutmut_10": _TEXTPRICE,
    "x__soonest__mutmut_6": _TEXTPRICE,
}
_DRAIN = (
    "draining for more messages than are left only finds the queue empty (Receive at now returns None at once)"
    " or the fetch stage's end, which the loop never reaches: it stops after its n messages"
)
_LOADER_EQUIVALENT = {
    "xǁ_Loadǁkeeps__mutmut_13": "next_estimate reads first_of_load as a truth value: None is False",
    "xǁ_Loadǁfetch_stage__mutmut_109": "a chunk whose fetch failed is always recomputed, which sets its choice to text"
    " over the level the failed fetch recorded",
    "xǁ_Loadǁcompute_stage__mutmut_103": _DRAIN,
    "xǁ_Loadǁcompute_stage__mutmut_104": _DRAIN,
    "xǁ_Loadǁcompute_stage__mutmut_140": "go_on is set by the loop over the batch, which is never empty",
    "xǁ_Loadǁcompute_stage__mutmut_141": "go_on is set by the loop over the batch, which is never empty",
    "xǁ_Loadǁbook__mutmut_1": "every caller passes joins",
    "xǁ_Loadǁcompute_stage__mutmut_100": "a batch tried where none can be made (before the cache exists, or with a codec"
    " that decodes one chunk at a time) fails at once with a LoaderError and its chunks are decoded one by one: the"
    " same cache, the same decisions",
    "xǁ_Loadǁdecode_batch__mutmut_30": _ZIP,
    "xǁ_Loadǁdecode_batch__mutmut_33": _ZIP,
    "xǁ_Loadǁdecode_batch__mutmut_34": _ZIP,
    "xǁ_Loadǁdecode_batch__mutmut_60": _ZIP,
    "xǁ_Loadǁdecode_batch__mutmut_63": _ZIP,
    "xǁ_Loadǁdecode_batch__mutmut_64": _ZIP,
    "xǁ_Loadǁdecode_batch__mutmut_71": "a call priced at 0 has every chunk's prediction 0, which observe() ignores"
    " whatever the measured time",
    "xǁ_Loadǁplan_costs__mutmut_9": "replace() with the latency the model already has is an equal copy of it",
}
_SQLCASE = "SQL keywords, identifiers, pragma names and values are case-insensitive; no quoted literal changes"
_LOCAL_EQUIVALENT = {
    "xǁLocalBackendǁ_discard__mutmut_14": _SQLCASE,
    "xǁLocalBackendǁ_discard__mutmut_15": _SQLCASE,
    "xǁLocalBackendǁ_discard__mutmut_21": _SQLCASE,
    "xǁLocalBackendǁ_discard__mutmut_30": _SQLCASE,
    "xǁLocalBackendǁ_discard__mutmut_31": _SQLCASE,
    "xǁLocalBackendǁ_discard__mutmut_37": _SQLCASE,
    "xǁLocalBackendǁ_discard__mutmut_38": _SQLCASE,
    "xǁLocalBackendǁ_discard__mutmut_7": _SQLCASE,
    "xǁLocalBackendǁ_discard__mutmut_8": _SQLCASE,
    "xǁLocalBackendǁ_drop__mutmut_22": _SQLCASE,
    "xǁLocalBackendǁ_drop__mutmut_23": _SQLCASE,
    "xǁLocalBackendǁ_drop__mutmut_30": _SQLCASE,
    "xǁLocalBackendǁ_drop__mutmut_7": _SQLCASE,
    "xǁLocalBackendǁ_drop__mutmut_8": _SQLCASE,
    "xǁLocalBackendǁ_levels__mutmut_6": _SQLCASE,
    "xǁLocalBackendǁ_make_room__mutmut_29": _SQLCASE,
    "xǁLocalBackendǁ_make_room__mutmut_6": _SQLCASE,
    "xǁLocalBackendǁ_open_index__mutmut_24": _SQLCASE,
    "xǁLocalBackendǁ_put_one__mutmut_59": _SQLCASE,
    "xǁLocalBackendǁ_put_one__mutmut_60": _SQLCASE,
    "xǁLocalBackendǁ_put_one__mutmut_85": _SQLCASE,
    "xǁLocalBackendǁ_rebuild__mutmut_51": _SQLCASE,
    "xǁLocalBackendǁ_rebuild__mutmut_58": _SQLCASE,
    "xǁLocalBackendǁ_rebuild__mutmut_59": _SQLCASE,
    "xǁLocalBackendǁ_rebuild__mutmut_62": _SQLCASE,
    "xǁLocalBackendǁ_rebuild__mutmut_68": _SQLCASE,
    "xǁLocalBackendǁ_rebuild__mutmut_69": _SQLCASE,
    "xǁLocalBackendǁ_rebuild__mutmut_75": _SQLCASE,
    "xǁLocalBackendǁ_rebuild__mutmut_82": _SQLCASE,
    "xǁLocalBackendǁ_resume_rebuild__mutmut_23": _SQLCASE,
    "xǁLocalBackendǁ_touch__mutmut_7": _SQLCASE,
    "xǁLocalBackendǁ_touch__mutmut_8": _SQLCASE,
    "xǁLocalBackendǁchunk_rows__mutmut_14": _SQLCASE,
    "xǁLocalBackendǁchunk_rows__mutmut_15": _SQLCASE,
    "xǁLocalBackendǁchunk_rows__mutmut_4": _SQLCASE,
    "xǁLocalBackendǁchunk_rows__mutmut_5": _SQLCASE,
    "xǁLocalBackendǁclaim_setting__mutmut_13": _SQLCASE,
    "xǁLocalBackendǁclaim_setting__mutmut_7": _SQLCASE,
    "xǁLocalBackendǁclear__mutmut_10": _SQLCASE,
    "xǁLocalBackendǁclear__mutmut_13": _SQLCASE,
    "xǁLocalBackendǁclear__mutmut_14": _SQLCASE,
    "xǁLocalBackendǁclear__mutmut_21": _SQLCASE,
    "xǁLocalBackendǁclear__mutmut_4": _SQLCASE,
    "xǁLocalBackendǁclear__mutmut_5": _SQLCASE,
    "xǁLocalBackendǁclear__mutmut_9": _SQLCASE,
    "xǁLocalBackendǁdelete_chunks__mutmut_8": _SQLCASE,
    "xǁLocalBackendǁdelete_chunks__mutmut_9": _SQLCASE,
    "xǁLocalBackendǁget_many__mutmut_15": _SQLCASE,
    "xǁLocalBackendǁget_many__mutmut_16": _SQLCASE,
    "xǁLocalBackendǁget_setting__mutmut_10": _SQLCASE,
    "xǁLocalBackendǁstats__mutmut_17": _SQLCASE,
    "xǁLocalBackendǁstats__mutmut_18": _SQLCASE,
    "xǁLocalBackendǁtokens__mutmut_7": _SQLCASE,
    "xǁLocalBackendǁtokens__mutmut_8": _SQLCASE,
    "xǁLocalBackendǁunmark_end__mutmut_6": _SQLCASE,
    "xǁLocalBackendǁunmark_end__mutmut_7": _SQLCASE,
    "xǁLocalBackendǁwait_rebuilt__mutmut_8": _SQLCASE,
    "xǁLocalBackendǁ_db__mutmut_41": _SQLCASE,
    "xǁLocalBackendǁ_db__mutmut_42": _SQLCASE,
    "xǁLocalBackendǁ_db__mutmut_45": _SQLCASE,
    "xǁLocalBackendǁ_init_schema__mutmut_14": _SQLCASE,
    "xǁLocalBackendǁ_init_schema__mutmut_15": _SQLCASE,
    "xǁLocalBackendǁ_init_schema__mutmut_29": _SQLCASE,
    "xǁLocalBackendǁ_init_schema__mutmut_30": _SQLCASE,
    "xǁLocalBackendǁget_many__mutmut_18": _SQLCASE,
    "xǁLocalBackendǁget_many__mutmut_19": _SQLCASE,
    "xǁLocalBackendǁ_put_one__mutmut_46": _SQLCASE,
    "xǁLocalBackendǁ_put_one__mutmut_51": _SQLCASE,
    "xǁLocalBackendǁclear__mutmut_17": _SQLCASE,
    "xǁLocalBackendǁclear__mutmut_18": "SQLite's LIKE is case-insensitive for ASCII: 'CHUNK_TOKENS:%' matches the same names",
    "xǁLocalBackendǁ_init_schema__mutmut_24": "ALTER TABLE is always tried: the duplicate-column error it gets is swallowed",
    "xǁLocalBackendǁ_init_schema__mutmut_26": "ALTER TABLE is always tried: the duplicate-column error it gets is swallowed",
    "xǁLocalBackendǁ_write_marker__mutmut_3": "token_hex(None) is 32 bytes: only the temporary marker's name is longer",
    "xǁLocalBackendǁsizes_many__mutmut_15": "batches of 501 keys every 500: one key is asked twice, with the same answer",
    "xǁLocalBackendǁ_make_room__mutmut_31": "no key is '' or 'XXXX' (keys are 64 hex digits): key != either excludes nothing",
    "xǁLocalBackendǁ_make_room__mutmut_43": "the inner loop stops early, the outer loop asks again for the same LRU order: same victims",
    "xǁLocalBackendǁ_collect_garbage__mutmut_24": "split('.', 2)[0] is split('.', 1)[0]",
    "xǁLocalBackendǁevict__mutmut_2": "cap=None makes _make_room read the store's cap, which is self.max_bytes",
    "xǁLocalBackendǁ_drop_connection__mutmut_15": "a thread's db and pid are set together: pid exists whenever db is not None",
    "x__read_regular__mutmut_13": "os.O_NOFOLLOW exists on every platform the store runs on (POSIX)",
    "x__read_regular__mutmut_16": "os.O_NOFOLLOW exists on every platform the store runs on (POSIX)",
    "xǁLocalBackendǁget_many__mutmut_71": "a touch at last_access == now writes MAX(last_access, now) = the same value",
    "xǁLocalBackendǁ_rebuild__mutmut_23": "batches of 64 every 1 overlap: an already indexed blob is skipped (the SELECT before INSERT)",
    "xǁLocalBackendǁ_rebuild__mutmut_28": "batches of 65 every 64 overlap by one: the repeated blob is skipped (the SELECT before INSERT)",
    "xǁLocalBackendǁ__init____mutmut_32": _SQLCASE,
    "xǁLocalBackendǁ_collect_garbage__mutmut_3": _SQLCASE,
    "xǁLocalBackendǁ_collect_garbage__mutmut_8": _SQLCASE,
    "xǁLocalBackendǁ_collect_garbage__mutmut_9": _SQLCASE,
    "xǁLocalBackendǁ_drop__mutmut_36": _SQLCASE,
    "xǁLocalBackendǁ_levels__mutmut_7": _SQLCASE,
    "xǁLocalBackendǁ_db__mutmut_46": _SQLCASE,
    "xǁLocalBackendǁ_init_schema__mutmut_33": _SQLCASE,
    "xǁLocalBackendǁ_make_room__mutmut_15": _SQLCASE,
    "xǁLocalBackendǁ_make_room__mutmut_28": _SQLCASE,
    "xǁLocalBackendǁ_put_one__mutmut_35": _SQLCASE,
    "xǁLocalBackendǁ_put_one__mutmut_36": _SQLCASE,
    "xǁLocalBackendǁ_put_one__mutmut_42": _SQLCASE,
    "xǁLocalBackendǁ_put_one__mutmut_45": _SQLCASE,
    "xǁLocalBackendǁ_put_one__mutmut_48": _SQLCASE,
    "xǁLocalBackendǁ_put_one__mutmut_49": _SQLCASE,
    "xǁLocalBackendǁ_put_one__mutmut_52": _SQLCASE,
    "xǁLocalBackendǁ_put_one__mutmut_62": _SQLCASE,
    "xǁLocalBackendǁ_put_one__mutmut_84": _SQLCASE,
    "xǁLocalBackendǁ_put_one__mutmut_92": _SQLCASE,
    "xǁLocalBackendǁ_rebuild__mutmut_5": _SQLCASE,
    "xǁLocalBackendǁ_rebuild__mutmut_50": _SQLCASE,
    "xǁLocalBackendǁ_resume_rebuild__mutmut_4": _SQLCASE,
    "xǁLocalBackendǁclaim_setting__mutmut_14": _SQLCASE,
    "xǁLocalBackendǁclaim_setting__mutmut_6": _SQLCASE,
    "xǁLocalBackendǁget_setting__mutmut_9": _SQLCASE,
    "xǁLocalBackendǁstats__mutmut_4": _SQLCASE,
    "xǁLocalBackendǁstats__mutmut_5": _SQLCASE,
    "xǁLocalBackendǁ_collect_garbage__mutmut_21": "split('.')[0] is split('.', 1)[0]",
    "xǁLocalBackendǁ_collect_garbage__mutmut_31": "inside try/except OSError: a FileNotFoundError from missing_ok=None is swallowed too",
    "xǁLocalBackendǁ_collect_garbage__mutmut_32": "inside try/except OSError: a FileNotFoundError from missing_ok=False is swallowed too",
    "xǁLocalBackendǁ_put_one__mutmut_94": "the rolled-back files were renamed into place under the write lock, which every remover holds: they exist",
    "xǁLocalBackendǁ_put_one__mutmut_95": "the rolled-back files were renamed into place under the write lock, which every remover holds: they exist",
    "xǁLocalBackendǁ_write_marker__mutmut_4": "token_hex(5): only the temporary marker's name is longer",
    "xǁLocalBackendǁsizes_many__mutmut_9": "batches of 500 keys from every key: keys are asked again, with the same answers",
    "xǁLocalBackendǁ_init_schema__mutmut_23": "ALTER TABLE is always tried: the duplicate-column error it gets is swallowed",
    "xǁLocalBackendǁ__init____mutmut_41": _SQLCASE,
    "xǁLocalBackendǁ_drop__mutmut_29": _SQLCASE,
    "xǁLocalBackendǁ_rebuild__mutmut_4": _SQLCASE,
    "xǁLocalBackendǁ_rebuild__mutmut_61": _SQLCASE,
    "x__read_regular__mutmut_10": "os.O_NOFOLLOW exists on every platform the store runs on (POSIX): the default is never read",
}
EQUIVALENT: dict[str, str] = {
    "cachegen.codec.container.x_pack_header__mutmut_9": _PID16 + " (bytes.fromhex('') padded = bytes(16))",
    "cachegen.codec.container.x_pack_header__mutmut_12": _PID16 + " (bytes(17) is cut to 16)",
    "cachegen.codec.container.x_pack_header__mutmut_32": _PID16 + " (the pad byte is never used)",
    "cachegen.codec.container.x_pack_header__mutmut_33": _PID16 + " (rjust of 16 bytes is the same)",
    "cachegen.codec.container.x_pack_header__mutmut_34": _PID16 + " (ljust(17) is cut to 16)",
    "cachegen.codec.container.x_pack_header__mutmut_36": _PID16 + " ([:17] of 16 bytes)",
    "cachegen.codec.container.x_parse_header__mutmut_12": "unpack_from's offset defaults to 0",
    "cachegen.codec.container.x_parse_header__mutmut_55": 'codec names are case-insensitive ("ASCII" is "ascii")',
    "cachegen.codec.container.xǁReaderǁarray__mutmut_8": "the buffer taken is exactly count items: frombuffer reads them all",
    **{f"cachegen.stream.planner.{n}": why for n, why in _PLANNER_EQUIVALENT.items()},
    **{f"cachegen.codec.codec.{n}": why for n, why in _CODEC_EQUIVALENT.items()},
    **{f"cachegen.codec.quant.{n}": why for n, why in _QUANT_EQUIVALENT.items()},
    **{f"cachegen.codec.transform.{n}": why for n, why in _TRANSFORM_EQUIVALENT.items()},
    **{f"cachegen.codec.rans.{n}": why for n, why in _RANS_EQUIVALENT.items()},
    "cachegen.store.keys.x_token_bytes__mutmut_34": _COPY,
    "cachegen.store.keys.x_token_bytes__mutmut_36": _COPY,
    "cachegen.store.keys.x_token_bytes__mutmut_37": _COPY,
    **{f"cachegen.store.local.{n}": why for n, why in _LOCAL_EQUIVALENT.items()},
    "cachegen.stream.loader.xǁ_Loadǁno_message__mutmut_10": "unreachable: the fetch stage sends only messages that"
    " compute_stage handles before no_message (a timeout's None and ProducerEnded return earlier)",
    **{f"cachegen.stream.loader.{n}": why for n, why in _LOADER_EQUIVALENT.items()},
}


def status(code: int | None) -> str:
    """mutmut's class of a mutant's exit status ("killed", "survived", "timeout", "no tests", ...)."""
    from mutmut.stats import status_by_exit_code

    return status_by_exit_code[code]


def module_files(m: Module) -> list[str]:
    """The module's .py files, relative to the root."""
    out: list[str] = []
    for p in m.paths:
        path = ROOT / p
        if path.is_dir():
            out += sorted(str(f.relative_to(ROOT)) for f in path.rglob("*.py"))
        elif path.is_file():
            out.append(p)
        else:
            raise SystemExit(f"{m.name}: {p} does not exist (fix its row in tools/mutate.py)")
    return out


def shared_config() -> dict:
    """The repository's ``[tool.mutmut]`` settings that every module's run shares."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"].get("mutmut", {})
    return {k: v for k, v in cfg.items() if k not in MUTMUT_KEYS}


def _toml_value(v) -> str:
    # JSON strings, numbers, booleans and arrays of them are TOML too
    return json.dumps(v)


def module_pyproject(m: Module) -> str:
    """The repository's pyproject.toml with the module's own ``[tool.mutmut]`` section."""
    text = (ROOT / "pyproject.toml").read_text()
    text = re.sub(r"(?ms)^\[tool\.mutmut\]\n.*?(?=^\[|\Z)", "", text)
    mine = set(module_files(m))
    others = sorted(
        str(f.relative_to(ROOT)) for f in (ROOT / "src").rglob("*.py") if str(f.relative_to(ROOT)) not in mine
    )
    cfg = {
        **shared_config(),
        "source_paths": ["src"],
        "do_not_mutate": others,
        "pytest_add_cli_args_test_selection": list(m.tests),
        **TIMEOUTS.get(m.name, {}),  # this module's timeouts replace the shared ones
    }
    lines = ["", "[tool.mutmut]", f"# generated by tools/mutate.py for the module {m.name!r}"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in cfg.items()]
    return text.rstrip() + "\n" + "\n".join(lines) + "\n"


def prepare(m: Module, keep: bool) -> Path:
    """The module's work directory, fresh unless ``keep``."""
    work = WORK / m.name
    if work.exists() and not keep:
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    for name in ("src", "tests"):
        link = work / name
        if not link.is_symlink():
            link.symlink_to(ROOT / name, target_is_directory=True)
    (work / "pyproject.toml").write_text(module_pyproject(m))
    return work


# mutmut's command line, with one repair. In its stats run (every selected test once, in mutmut's own
# process, to learn which tests execute which function) each trampoline sets a ContextVar on entry and resets
# it on exit. A trampolined generator left unfinished by a test is closed later by the garbage collector, in
# the middle of some other call, and its reset then removes the variable under that call: mutmut 3.8.1 fails
# the stats run with LookupError (the codec's selection hits it; with the collector disabled it passes). The
# variable only names the caller for mutmut's dependency tracking, not which tests reach a function, so a reset
# that finds it gone is skipped. Second, the mutants of CACHEGEN_MUTATE_KNOWN_EQUIVALENT (name -> function hash,
# from known_equivalent) whose function still has that hash are marked survived before mutmut picks the
# mutants to run, so it skips them; their names are written to known_equivalent_skipped.json.
_MUTMUT = """
import sys
from mutmut.core import MutmutCallStack

_reset = MutmutCallStack.reset.__func__


def _tolerant_reset(cls, token):
    try:
        _reset(cls, token)
    except (LookupError, ValueError):
        pass


MutmutCallStack.reset = classmethod(_tolerant_reset)
import json
import os

import mutmut.__main__ as main

_collect = main.collect_source_file_mutation_data
_skip = json.loads(os.environ.get("CACHEGEN_MUTATE_KNOWN_EQUIVALENT") or "{}")


def _without_known_equivalents(*, mutant_names):
    mutants, by_path = _collect(mutant_names=mutant_names)
    if mutant_names:
        return mutants, by_path
    out = []
    for data, name, result in mutants:
        fn = name.rpartition("__mutmut_")[0].rpartition(".")[2]
        if result is None and name in _skip and _skip[name] == data.hash_by_function_name.get(fn):
            data.exit_code_by_key[name] = 0
            data.save()
            result = 0
        out.append((data, name, result))
    with open("known_equivalent_skipped.json", "w") as f:
        json.dump(sorted(n for data, n, r in out if n in _skip and r == 0 and n not in data.durations_by_key), f)
    return out, by_path


main.collect_source_file_mutation_data = _without_known_equivalents
from mutmut.__main__ import cli

sys.argv[0] = "mutmut"
sys.exit(cli())
"""


def known_equivalent(m: Module, rerun: bool) -> dict[str, str]:
    """The module's mutants judged equivalent in its last run whose function is unchanged since: mutant ->
    the hash mutmut gave its function then. The shim above marks them survived without running them."""
    if rerun or not RESULT.exists():
        return {}
    old = json.loads(RESULT.read_text())
    if old.get("mutmut") != _mutmut_version():  # another mutmut may hash or number differently
        return {}
    hashes = old.get("modules", {}).get(m.name, {}).get("equivalent_hashes", {})
    return {n: h for n, h in hashes.items() if n in EQUIVALENT}


def _mutmut() -> list[str]:
    try:
        import mutmut  # noqa: F401
    except ImportError:
        raise SystemExit("mutmut is not installed in this environment: `make setup` installs the test extra") from None
    return [sys.executable, "-c", _MUTMUT]


def run_module(m: Module, keep: bool, children: int, mutants: list[str], rerun_equivalent: bool = False) -> dict:
    """Run mutmut over one module; its results."""
    work = prepare(m, keep)
    skip = known_equivalent(m, rerun_equivalent)
    env = dict(os.environ)
    env.update(
        {
            # the kernels' numba cache of the mutated copy stays in the work directory
            "NUMBA_CACHE_DIR": str(work / "numba-cache"),
            # each forked test run is single-threaded: `children` runs share the cores
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "NUMBA_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "CACHEGEN_MUTATE_KNOWN_EQUIVALENT": json.dumps(skip),
        }
    )
    (work / "known_equivalent_skipped.json").unlink(missing_ok=True)
    before = read_meta(m, work) if mutants else {}
    row = _old_row(m)
    t0 = time.monotonic()
    cmd = [*_mutmut(), "run", "--max-children", str(children), *mutants]
    print(f"== {m.name}: {' '.join(module_files(m))}\n   tests: {' '.join(m.tests)}", flush=True)
    rc = subprocess.run(cmd, cwd=work, env=env).returncode
    seconds = time.monotonic() - t0
    kept = merge_meta(m, work, before) if mutants else 0
    res = collect(m, work)
    skipped = work / "known_equivalent_skipped.json"
    res["equivalent_not_rerun"] = len(json.loads(skipped.read_text())) if skipped.exists() else 0
    res["seconds"] = round(seconds, 1)
    if mutants:
        res["merged"] = kept
        res["seconds_this_run"] = res["seconds"]
        res["seconds"] = round(seconds + row.get("seconds", 0.0), 1)
    if rc != 0:
        res["error"] = f"mutmut exited with status {rc} (its output is above)"
    return res


def read_meta(m: Module, work: Path) -> dict[str, dict]:
    """The module's mutmut ``.meta`` files as they are now, by source file (absent ones left out)."""
    out = {}
    for f in module_files(m):
        meta = work / "mutants" / (f + ".meta")
        if meta.exists():
            out[f] = json.loads(meta.read_text())
    return out


def _function(key: str) -> str:
    # cachegen.codec.codec.xǁCodecǁencode__mutmut_46 -> xǁCodecǁencode (a key of hash_by_function_name)
    return key.rpartition("__mutmut_")[0].rpartition(".")[2]


def merge_meta(m: Module, work: Path, before: dict[str, dict]) -> int:
    """Give every mutant left unchecked by a ``--mutant`` run its result from ``before`` (see the module
    docstring); write the merged ``.meta`` files back. The number of results kept."""
    kept = 0
    for f, new in read_meta(m, work).items():
        old = before.get(f)
        if old is None:
            continue
        same = {
            fn
            for fn, h in new.get("hash_by_function_name", {}).items()
            if old.get("hash_by_function_name", {}).get(fn) == h
        }
        codes = new["exit_code_by_key"]
        for key, code in codes.items():
            was = old["exit_code_by_key"].get(key)
            if code is None and was is not None and _function(key) in same:
                codes[key] = was
                for d in ("durations_by_key", "estimated_durations_by_key"):
                    if key in old.get(d, {}):
                        new.setdefault(d, {})[key] = old[d][key]
                kept += 1
        (work / "mutants" / (f + ".meta")).write_text(json.dumps(new, indent=4))
    return kept


def _old_row(m: Module) -> dict:
    return json.loads(RESULT.read_text()).get("modules", {}).get(m.name, {}) if RESULT.exists() else {}


def collect(m: Module, work: Path) -> dict:
    """Counts per class, the score and the survivors' names from mutmut's ``.meta`` files."""
    codes: dict[str, int | None] = {}
    hashes: dict[str, str] = {}  # mutant -> its function's hash, per file (two files may name a function alike)
    for meta in read_meta(m, work).values():
        codes.update(meta["exit_code_by_key"])
        fh = meta.get("hash_by_function_name", {})
        hashes.update({n: fh[_function(n)] for n in meta["exit_code_by_key"] if _function(n) in fh})
    by = {name: status(code) for name, code in codes.items()}
    count = lambda s: sum(1 for v in by.values() if v == s)
    survivors = sorted(n for n, s in by.items() if s in ("survived", "no tests"))
    equivalent = [n for n in survivors if n in EQUIVALENT]
    killed, timeout = count("killed"), count("timeout")
    total = len(by)
    scored = total - len(equivalent)
    return {
        "files": module_files(m),
        "tests": list(m.tests),
        "total": total,
        "killed": killed,
        "survived": count("survived"),
        "timeout": timeout,
        "no_tests": count("no tests"),
        "other": total - killed - timeout - count("survived") - count("no tests"),
        "equivalent": len(equivalent),
        # killed (a timeout is a mutant the tests stopped) over the mutants that are not equivalent
        "score": round((killed + timeout) / scored, 4) if scored else None,
        "survivors": [n for n in survivors if n not in EQUIVALENT],
        "equivalent_mutants": equivalent,
        # what a later run skips while the function is unchanged (known_equivalent)
        "equivalent_hashes": {n: hashes[n] for n in equivalent if n in hashes},
        "not_killed_other": sorted(n for n, s in by.items() if s not in ("killed", "timeout", "survived", "no tests")),
    }


def write_result(results: dict[str, dict], command: str) -> dict:
    """Merge ``results`` into mutation.json (modules run earlier keep their rows) and write it."""
    old = json.loads(RESULT.read_text()) if RESULT.exists() else {}
    modules = {**old.get("modules", {}), **results}
    modules = {m.name: modules[m.name] for m in MODULES if m.name in modules}
    tot = {k: sum(r[k] for r in modules.values()) for k in ("total", "killed", "survived", "timeout", "no_tests")}
    eq = sum(r["equivalent"] for r in modules.values())
    scored = tot["total"] - eq
    out = {
        **tot,
        "equivalent": eq,
        "score": round((tot["killed"] + tot["timeout"]) / scored, 4) if scored else None,
        "command": command,
        "mutmut": _mutmut_version(),
        "written": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "modules": modules,
    }
    RESULT.write_text(json.dumps(out, indent=2) + "\n")
    return out


def _mutmut_version() -> str:
    from importlib.metadata import version

    return version("mutmut")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--module", action="append", choices=[m.name for m in MODULES], help="a module (repeatable)")
    ap.add_argument("--keep", action="store_true", help="reuse mutmut's earlier results in mutants/<module>/")
    ap.add_argument("--mutant", action="append", default=[], help="only these mutants (mutmut names or globs)")
    ap.add_argument("--max-children", type=int, default=2, help="mutants tested at once (default 2)")
    ap.add_argument(
        "--rerun-equivalent",
        action="store_true",
        help="also run the mutants judged equivalent whose function is unchanged since (skipped by default)",
    )
    ap.add_argument("--list", action="store_true", help="print the table and exit")
    a = ap.parse_args(argv)
    chosen = [m for m in MODULES if not a.module or m.name in a.module]
    if a.list:
        for m in chosen:
            print(f"{m.name:10} {m.owner}  {' '.join(module_files(m))}\n{'':14}tests: {' '.join(m.tests)}")
        return 0
    if a.mutant and len(chosen) != 1:
        ap.error("--mutant needs exactly one --module")
    results = {}
    for m in chosen:
        results[m.name] = run_module(m, a.keep or bool(a.mutant), a.max_children, a.mutant, a.rerun_equivalent)
        results[m.name]["command"] = (
            f"python tools/mutate.py --module {m.name}"
            + "".join(f" --mutant '{g}'" for g in a.mutant)
            + (" --rerun-equivalent" if a.rerun_equivalent else "")
        )
        r = results[m.name]
        print(
            f"== {m.name}: {r['killed']} killed, {r['timeout']} timeout, {r['survived']} survived, "
            f"{r['no_tests']} no tests of {r['total']} (score {r['score']}) in {r['seconds']} s",
            flush=True,
        )
    command = "python tools/mutate.py" + "".join(f" --module {m.name}" for m in chosen if a.module)
    command = command if a.module else "make mutate (python tools/mutate.py)"
    out = write_result(results, command)
    print(
        f"mutation.json: {out['killed'] + out['timeout']}/{out['total'] - out['equivalent']} killed (score {out['score']})"
    )
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
