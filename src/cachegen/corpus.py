"""Real English text found on every machine, and needle prompts built from it.

Sources: Debian's ``/usr/share/common-licenses`` and CPython's
``pydoc_data.topics``. Some pydoc topics contain others verbatim, so repeated
paragraphs are dropped. The pydoc topics are split into two disjoint
halves: ``pydoc-calib`` for calibrating codec profiles and ``pydoc-eval`` for
measuring them, so no evaluation text is ever calibration text. ``calib`` (the
default calibration text) interleaves ``pydoc-calib`` with the licences in
:data:`CALIB_LICENSES`; the FSF licences (GPL, LGPL, GFDL) and Apache-2.0 are
kept for evaluation only.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from cachegen.errors import ConfigError

LICENSE_DIR = Path("/usr/share/common-licenses")
# Licences mixed into the calibration text: none of them is, or derives from, an evaluation text.
CALIB_LICENSES = ("MPL-2.0", "MPL-1.1", "Artistic", "CC0-1.0", "BSD")
CALIB_BLOCK_CHARS = 2400  # ~500 tokens: each calibration context sees several sources


@lru_cache(maxsize=1)
def pydoc_topics() -> tuple[tuple[str, str], ...]:
    """(name, text) of the pydoc topics, sorted by name, with repeated text removed.

    Some topics contain others verbatim and many share paragraphs, so every
    paragraph is kept only where it first appears.
    """
    from pydoc_data.topics import topics

    seen: set[str] = set()
    keep = []
    for name, body in sorted(topics.items()):
        paras = []
        for para in re.split(r"\n\s*\n", body.strip()):
            para = para.strip("\n")
            if para.strip() and para not in seen:
                seen.add(para)
                paras.append(para)
        if paras:
            keep.append((name, "\n\n".join(paras)))
    return tuple(keep)


@lru_cache(maxsize=1)
def licenses() -> tuple[tuple[str, str], ...]:
    """(name, text) of each distinct license file (symlinks skipped)."""
    if not LICENSE_DIR.is_dir():
        return ()
    out = []
    for p in sorted(LICENSE_DIR.iterdir()):
        if p.is_file() and not p.is_symlink():
            out.append((p.name, p.read_text(encoding="utf-8", errors="replace").strip()))
    return tuple(out)


def source_names() -> list[str]:
    return ["pydoc", "pydoc-calib", "pydoc-eval", "calib", "licenses"] + [n for n, _ in licenses()]


def calibration_text() -> str:
    """``pydoc-calib`` and :data:`CALIB_LICENSES` interleaved in blocks of :data:`CALIB_BLOCK_CHARS`.

    Why a mix: a profile's sensitivities calibrated on one kind of text (pydoc prose) under-
    predicted the KL on legal text 2-7x; mixing kinds halved that (docs/codec.md)."""
    have = dict(licenses())
    srcs = [text("pydoc-calib")] + [have[n] for n in CALIB_LICENSES if n in have]
    blocks, j = [], 0
    while any(j * CALIB_BLOCK_CHARS < len(s) for s in srcs):
        blocks += [
            s[j * CALIB_BLOCK_CHARS : (j + 1) * CALIB_BLOCK_CHARS] for s in srcs if j * CALIB_BLOCK_CHARS < len(s)
        ]
        j += 1
    return "".join(blocks)


def text(name: str) -> str:
    """A whole source by name (see :func:`source_names`), or the contents of a file path."""
    topics = pydoc_topics()
    if name == "pydoc":
        return "\n\n".join(t for _, t in topics)
    if name == "pydoc-calib":
        return "\n\n".join(t for i, (_, t) in enumerate(topics) if i % 2 == 0)
    if name == "pydoc-eval":
        return "\n\n".join(t for i, (_, t) in enumerate(topics) if i % 2 == 1)
    if name == "calib":
        return calibration_text()
    if name == "licenses":
        return "\n\n".join(t for _, t in licenses())
    for n, t in licenses():
        if n == name:
            return t
    p = Path(name)
    if p.is_file():
        return p.read_text(encoding="utf-8", errors="replace")
    raise ConfigError(f"unknown text {name!r}: use a file path or one of {', '.join(source_names())}")


def take_tokens(tokenizer, source: str, n_tokens: int, offset: int = 0) -> str:
    """The substring of ``source`` that spans tokens ``[offset, offset + n_tokens)``.

    Wraps around (repeating the text) when the source is shorter than asked.
    """
    enc = tokenizer(source, add_special_tokens=False, return_offsets_mapping=True)
    spans = enc["offset_mapping"]
    if not spans:
        raise ConfigError("empty source text")
    need = offset + n_tokens
    reps = 1
    while len(spans) * reps < need:
        reps += 1
    if reps > 1:
        return take_tokens(tokenizer, "\n\n".join([source] * reps), n_tokens, offset)
    return source[spans[offset][0] : spans[need - 1][1]]


# -- needle prompts --------------------------------------------------------------

QUESTION = "What is the secret number in the text? Answer with the number only."
ANSWER_PREFIX = "The secret number is"


@dataclass
class NeedleCase:
    """A context with a hidden secret number, and the question that asks it back.

    ``context_ids`` is the reusable prefix (chat header + document); the prompt
    is ``context_ids + question_ids``.
    """

    context_ids: list[int]
    question_ids: list[int]
    answer: str
    depth: float

    @property
    def prompt_ids(self) -> list[int]:
        return self.context_ids + self.question_ids


def _sentence_starts(doc: str) -> list[int]:
    return [0] + [m.end() for m in re.finditer(r"[.!?]\s+", doc)]


def needle_case(tokenizer, n_tokens: int, seed: int, source: str = "pydoc-eval") -> NeedleCase:
    """Hide ``The secret number is NNNNN.`` at a random sentence boundary of ~n_tokens of real text."""
    rng = random.Random(seed)
    full = text(source)
    n_src = len(tokenizer(full, add_special_tokens=False)["input_ids"])
    offset = rng.randrange(0, max(1, n_src - n_tokens))
    doc = take_tokens(tokenizer, full, n_tokens, offset)
    secret = str(rng.randrange(10000, 100000))
    depth = rng.random()
    starts = _sentence_starts(doc)
    pos = min(starts, key=lambda s: abs(s - depth * len(doc)))
    doc = doc[:pos] + f"The secret number is {secret}. " + doc[pos:]
    marker = "\x00QUESTION\x00"
    if getattr(tokenizer, "chat_template", None):
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": doc + "\n\n" + marker}], tokenize=False, add_generation_prompt=True
        )
    else:  # base models without a template: a plain question/answer layout
        bos = tokenizer.bos_token or ""
        chat = f"{bos}{doc}\n\nQuestion: {marker}\nAnswer: "
    head, tail = chat.split(marker)
    context_ids = tokenizer(head, add_special_tokens=False)["input_ids"]
    question_ids = tokenizer(QUESTION + tail + ANSWER_PREFIX, add_special_tokens=False)["input_ids"]
    return NeedleCase(list(context_ids), list(question_ids), secret, pos / max(1, len(doc)))


def is_correct(answer_text: str, case: NeedleCase) -> bool:
    """True when the first number in the model's answer is the secret."""
    m = re.search(r"\d[\d,]*", answer_text)
    return m is not None and m.group(0).replace(",", "") == case.answer
