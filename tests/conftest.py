"""Shared fixtures: the real SmolLM2 model directory, its tokenizer, and a tiny
random Llama (float32, seeded) that shares SmolLM2's tokenizer so it can stand in
for the real model anywhere text is involved."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY_LLAMA = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    initializer_range=0.5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    """SmolLM2-135M-Instruct as a float32 Hugging Face directory (the default GGUF's cache
    entry, with its de-quantized copy written once on demand)."""
    from shared.models import hf_directory

    return hf_directory("")


@pytest.fixture(scope="session")
def smol_tokenizer(smol_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smol_dir))


def make_tiny_llama(vocab_size: int = 49152, seed: int = 0):
    """A randomly initialised 2-layer Llama, float32, deterministic for ``seed``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, **TINY_LLAMA)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    return model


@pytest.fixture(scope="session")
def tiny_llama():
    return make_tiny_llama()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smol_tokenizer) -> Path:
    """A complete HF model directory: tiny random Llama weights + SmolLM2's tokenizer."""
    d = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_llama(vocab_size=len(smol_tokenizer)).save_pretrained(d)
    smol_tokenizer.save_pretrained(d)
    return d
