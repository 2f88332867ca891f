"""Fused operators that keep fewer or smaller tensors than their plain PyTorch composition.

* :func:`chunked_cross_entropy`: the loss of a linear output head followed by cross-entropy,
  computed over chunks, so the logits (tokens x vocabulary) never exist in full.
* :func:`fused_linear_loss`: the same for a model's ``nn.Linear`` head, with Hugging Face's
  next-token shift; the documented entry point for custom models.
"""

from __future__ import annotations

from .cross_entropy import auto_chunk_size, chunked_cross_entropy, fused_linear_loss

__all__ = ["auto_chunk_size", "chunked_cross_entropy", "fused_linear_loss"]
