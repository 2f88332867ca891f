"""Integrations with other training loops (Hugging Face ``Trainer``).

Each integration imports its framework lazily, so ``import memfit`` works without it.
"""
