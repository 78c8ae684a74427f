"""The tests' tiny random Llama (2 layers, GQA): one definition for every fixture that needs one."""

from __future__ import annotations

import torch


def tiny_llama(vocab_size: int = 512, max_positions: int = 2048):
    """A seeded 2-layer Llama with 4 query heads over 2 KV heads of 16 dimensions."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=vocab_size,
        max_position_embeddings=max_positions,
    )
    return LlamaForCausalLM(cfg).eval()
