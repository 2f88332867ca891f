"""What activation checkpointing's recomputation needs in order to repeat its forward exactly.

Used by :mod:`memfit.strategies.checkpointing`: the recomputation of a checkpointed block runs
inside ``backward()``, under other modes and with other counters than the forward it repeats.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["in_function_modes", "retryable"]


def in_function_modes(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` under the torch function modes open now, also when checkpoint recomputes it.

    The recomputation runs inside ``backward()``, and a torch function mode is off while its
    own handler runs, so one that handled ``backward()`` is gone by then: a dry run's values
    (:class:`~memfit.estimate.values.DryRunValues`, which knows a router's expert choice) would
    be missing from the recomputed forward. The missing modes go back on the stack for it.
    """
    modes = torch.overrides._get_current_function_mode_stack()
    if not modes:
        return fn

    def run(*args: Any, **kwargs: Any) -> Any:
        now = torch.overrides._get_current_function_mode_stack()
        missing = modes[len(now) :]
        if not missing or any(a is not b for a, b in zip(now, modes, strict=False)):
            return fn(*args, **kwargs)  # the forward itself, or a stack we cannot extend
        for mode in missing:
            torch.overrides._push_mode(mode)
        try:
            return fn(*args, **kwargs)
        finally:
            for _ in missing:
                torch.overrides._pop_mode()

    return run


@functools.cache
def retryable(cls: type) -> type:
    """``cls`` (torch's recomputing mode of selective checkpointing) made safe for an op that
    raises and is called again.

    The mode numbers each op's calls to find what the forward stored for the same call. The
    forward's mode counts a call once it has returned, the recomputing one before running it,
    so an op that raises and is retried (a dry run's data-dependent op: fake tensors refuse
    it, then it is computed for real and replayed) is counted twice in recomputation and once
    in forward, and every later call of that op looks up the wrong entry. A call that raises
    is uncounted here, as it is in forward.
    """
    import torch.utils.checkpoint as ckpt

    key_of = getattr(ckpt, "_sac_storage_key", lambda func, args: func)
    ignored = getattr(ckpt, "SAC_IGNORED_OPS", frozenset())

    class Retryable(cls):  # type: ignore[valid-type, misc]
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            try:
                return super().__torch_dispatch__(func, types, args, kwargs)
            except Exception:
                if func not in ignored:
                    self.func_counter[key_of(func, args)] -= 1
                raise

    return Retryable
