"""The benchmark tests' tiny random Llama with a byte-level tokenizer (no real model)."""

from __future__ import annotations

import pytest


def _byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", bos_token="<eos>")


class TinyLM:
    """What the harness reads from cachegen.engine.models.LoadedModel."""

    def __init__(self, model, tokenizer):
        self.name, self.model, self.tokenizer, self.fingerprint = "tiny-llama", model, tokenizer, "0" * 24

    @property
    def config(self):
        return self.model.config


@pytest.fixture(scope="module")
def tiny_lm():
    from tiny_models import tiny_llama

    return TinyLM(tiny_llama(vocab_size=260, max_positions=4096), _byte_tokenizer())
