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


#: A ChatML-style template: every turn framed by <|im_start|>role ... <|im_end|>.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat_tokenizer_dir(folder, *, chat_template: str | None = CHAT_TEMPLATE):
    """A tiny byte-level BPE tokenizer saved by ``save_pretrained`` into ``folder`` (made
    here, nothing downloaded), with ``chat_template``; returns the folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<pad>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["user assistant system hello world what is two plus two it is four"] * 20
    tok.train_from_iterator(corpus, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<pad>"
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(folder))
    return folder
