"""Choosing the next token (greedy, temperature, top-p) and stopping on stop strings.

One place for the sampling rules, so the Python API, the server and the
benches decode the same way: temperature 0 is greedy (argmax, deterministic,
what the tests compare against); otherwise softmax at that temperature,
restricted to the smallest set of tokens whose probability reaches ``top_p``,
drawn with a generator seeded by ``seed`` when one is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from cachegen.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False  # generate max_tokens tokens whatever the model says (benchmarks)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ConfigError("max_tokens must be at least 1")
        if not 0.0 <= self.temperature <= 2.0:
            raise ConfigError("temperature must be in [0, 2]")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError("top_p must be in (0, 1]")
        if len(self.stop) > 4 or any(not s for s in self.stop):
            raise ConfigError("stop takes up to 4 non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    """Picks tokens from logits under :class:`SamplingParams` (one per generation: it owns the RNG)."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self._gen = torch.Generator()
        if params.seed is not None:
            self._gen.manual_seed(int(params.seed))
        else:
            self._gen.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.greedy:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float() / p.temperature, dim=-1)
        if p.top_p < 1.0:
            sorted_p, idx = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < p.top_p  # always keeps the most likely token
            sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
            pick = int(torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=self._gen))
            return int(idx[pick])
        return int(torch.multinomial(probs, 1, generator=self._gen))


class TextStream:
    """Turns generated token ids into text deltas, holding back what may become a stop string.

    Decodes the whole answer each time (token boundaries do not split UTF-8
    cleanly) and emits only the new, stable part: text ending in U+FFFD (an
    incomplete byte sequence) or in a prefix of a stop string waits for the
    next token.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.ids: list[int] = []
        self.sent = 0  # characters of the answer already emitted
        self.stopped = False
        self.text = ""

    def push(self, token_id: int) -> str:
        """Add a token; returns the text that can be sent now ("" if none)."""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for s in self.stop:
            at = text.find(s, max(self.sent - len(s), 0))
            if at >= 0:
                self.stopped = True
                text = text[:at]
                break
        self.text = text
        if self.stopped:
            return self._emit(len(text))
        hold = len(text)
        if text.endswith("\ufffd"):
            hold = len(text) - 1
        for s in self.stop:  # a suffix that could grow into a stop string waits
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = min(hold, len(text) - k)
                    break
        return self._emit(max(hold, self.sent))

    def flush(self) -> str:
        """The rest of the text once generation ended."""
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        out = self.text[self.sent : upto]
        self.sent = max(self.sent, upto)
        return out
