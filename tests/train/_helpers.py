"""Tiny causal LMs and text for the training tests (fast on two CPU cores)."""

from __future__ import annotations

import torch
import transformers
from torch import nn

from memfit.train.data import TextDataset
from memfit.train.tokenizer import ByteTokenizer

TEXT = (
    "def add(a, b):\n    return a + b\n\n"
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
) * 40


def tiny_gpt2(seed: int = 0, *, dropout: float = 0.0, n_embd: int = 32, n_layer: int = 2) -> nn.Module:
    """A 2-layer GPT-2 over the byte vocabulary; lm_head is tied to the token embedding."""
    config = transformers.GPT2Config(
        vocab_size=259,
        n_positions=64,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=2,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=258,
        eos_token_id=258,
        use_cache=False,
    )
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config)
    model.train()
    return model


def text_dataset(seq_len: int = 32) -> TextDataset:
    return TextDataset(TEXT, ByteTokenizer(), seq_len)


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}
