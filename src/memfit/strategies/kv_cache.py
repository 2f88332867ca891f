"""Training runs without a KV cache.

A Hugging Face decoder with ``config.use_cache`` on (the default of most configs) builds a KV
cache in every forward, training included, and appends each layer's keys and values to it.
Training never reads that cache back, and a checkpointed block would write it a second time in
its recomputation: the recomputation then saves a different number of tensors than the
original forward and torch's checkpoint fails (transformers 5.24 passes the cache to its
blocks as ``cache=``). Transformers turns the cache off for its own gradient checkpointing;
:func:`apply_kv_cache_off` does the same for every plan memfit applies, checkpointed or not, so
a plan's memory and numerics do not depend on whether the user remembered ``use_cache=False``.

What transformers lacks here: a switch that turns the cache off for a model's whole training
and gives the user's setting back afterwards (``gradient_checkpointing_enable`` only covers
its own checkpointing, and sub-models such as an encoder-decoder's decoder carry their own
config).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from torch import nn

from ..techniques import ENGINES, ApplyContext, Technique

__all__ = ["KVCacheOff", "apply_kv_cache_off", "drop_cache"]


class KVCacheOff:
    """Handle of :func:`apply_kv_cache_off`.

    Attributes:
        configs: The configs whose ``use_cache`` was on and is now off.
    """

    def __init__(self, configs: list[Any]) -> None:
        self.configs = configs

    def remove(self) -> None:
        """Turn the cache back on in every config this handle turned it off in (unless someone
        set it since, whose choice stands). Idempotent."""
        for config in self.configs:
            if config.use_cache is False:
                config.use_cache = True
        self.configs = []


def apply_kv_cache_off(model: nn.Module) -> KVCacheOff:
    """Set ``use_cache = False`` on every config of ``model`` (and of its sub-modules) that has
    it on, until the handle's ``remove()``.

    Costs nothing in memory or time: training does not read the cache, and without it the
    keys and values a decoder layer computes are freed as soon as backward no longer needs
    them instead of living as long as the model's output.

    Args:
        model: Any module; modules without a ``config`` carrying ``use_cache`` are untouched.

    Returns:
        The :class:`KVCacheOff` handle.
    """
    changed: list[Any] = []
    seen: set[int] = set()
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None or id(config) in seen:
            continue
        seen.add(id(config))
        if getattr(config, "use_cache", False) is True:
            config.use_cache = False
            changed.append(config)
    return KVCacheOff(changed)


# transformers' names for a block's KV-cache argument: ``cache`` since 5.24 (before it
# ``past_key_values``, and ``past_key_value`` or ``layer_past`` in older blocks). Any other
# keyword whose value is a transformers ``Cache`` is dropped too, whatever its name.
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _is_cache(obj: Any) -> bool:
    mod = sys.modules.get("transformers.cache_utils")
    cache_cls = getattr(mod, "Cache", None) if mod is not None else None
    return cache_cls is not None and isinstance(obj, cache_cls)


def drop_cache(
    args: tuple, kwargs: dict, warn_once: Callable[[str, str], None]
) -> tuple[tuple, dict]:
    """A block call's arguments without its KV cache (checkpointing's recomputation would
    append to the cache a second time); ``warn_once(key, message)`` says so once."""
    dropped = False
    if any(_is_cache(a) for a in args):
        args = tuple(None if _is_cache(a) else a for a in args)
        dropped = True
    for key, value in kwargs.items():
        if value is not None and (key in _CACHE_KWARGS or _is_cache(value)):
            kwargs = {**kwargs, key: None}
            dropped = True
    if kwargs.get("use_cache"):
        kwargs = {**kwargs, "use_cache": False}
        dropped = True
    if dropped:
        warn_once(
            "cache",
            "memfit checkpointing: a KV cache cannot be used by a checkpointed block (the "
            "recomputation would update it twice); the cache arguments are dropped in training",
        )
    return args, kwargs



def _apply_technique(model: nn.Module, ctx: ApplyContext) -> KVCacheOff:
    return apply_kv_cache_off(model)


#: Every plan turns the KV cache off first: training never reads it, and a checkpointed block
#: would write it twice. Lightning's callback and the Hugging Face Trainer apply it too.
TECHNIQUE = Technique(
    name="kv_cache_off",
    engines=frozenset(ENGINES),
    order=0,
    is_on=lambda plan: True,
    apply=_apply_technique,
)
