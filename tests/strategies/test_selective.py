"""What selective checkpointing keeps does not move when torch's default for saved-tensor hooks
does (torch 2.15's ``respect_saved_tensors_hooks``)."""

from __future__ import annotations

import inspect
import warnings

import torch
from torch.utils.checkpoint import checkpoint

from memfit.strategies import checkpointing, selective
from memfit.strategies.checkpointing import apply_checkpointing

from .test_checkpointing import _config, _stack, _x


def _packed(model: torch.nn.Module) -> list[tuple[int, ...]]:
    """The shapes the saved-tensor hooks around a forward see (memfit's tracker has such hooks
    active whenever it runs)."""
    seen: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x=_x().requires_grad_()).sum().backward()
    return seen


def test_selective_passes_torch_s_hooks_choice_where_torch_asks_for_it():
    asks = "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters
    assert (
        {"respect_saved_tensors_hooks": False} if asks else {}) == selective.SELECTIVE_CHECKPOINT_KEYWORDS


def test_what_selective_saves_bypasses_active_hooks_as_today(monkeypatch):
    model = _stack(2)
    apply_checkpointing(model, _config("selective"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch 2.15 warns where the choice is left to it
        chosen = _packed(model)
    # torch's own default (2.15: bypass, with a FutureWarning; before: bypass) sees the same.
    monkeypatch.setattr(checkpointing, "SELECTIVE_CHECKPOINT_KEYWORDS", {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        default = _packed(model)
    assert chosen == default
    if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters:
        # Routed through the hooks (torch's coming default), the matmul outputs selective
        # keeps are seen too: the figures this test keeps from moving.
        flipped = {"respect_saved_tensors_hooks": True}
        monkeypatch.setattr(checkpointing, "SELECTIVE_CHECKPOINT_KEYWORDS", flipped)
        assert len(_packed(model)) > len(chosen)
