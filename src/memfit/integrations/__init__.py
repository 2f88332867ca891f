"""Integrations of memfit plans with other training loops (Hugging Face ``Trainer``,
Lightning).

Each integration imports its framework lazily, so ``import memfit`` works without it.
"""
