"""Find a model's repeated blocks (transformer layers and the like).

Freezing (``blocks:K``) and activation checkpointing both act on "the blocks": the repeated
units that make up most of a deep model. This module finds them without knowing the
architecture, so both techniques work on any ``nn.Module``.
"""

from __future__ import annotations

from torch import nn

__all__ = ["find_blocks"]


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's repeated blocks, in order, with their qualified names.

    Every ``nn.ModuleList`` and ``nn.Sequential`` in the model is a candidate container. Its
    children are grouped by exact class; a group of at least two children of one class, holding
    at least one parameter, is a candidate list of blocks. The candidate with the most
    parameters wins (ties: more blocks, then the outermost container). For Hugging Face
    transformers this is the list of layers (``bert.encoder.layer``, ``transformer.h``,
    ``model.layers``); a container with a different first child (``Sequential(embedding,
    block, block, head)``) still yields its blocks.

    Args:
        model: Any module.

    Returns:
        ``(qualified name, module)`` pairs in the container's order; empty when the model has
        no repeated blocks (for example a single ``nn.Linear``).
    """
    best: tuple[int, int, int] | None = None  # (parameters, blocks, -discovery order)
    best_blocks: list[tuple[str, nn.Module]] = []
    for order, (name, container) in enumerate(model.named_modules()):
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        groups: dict[type, list[tuple[str, nn.Module]]] = {}
        for child_name, child in container.named_children():
            qualified = f"{name}.{child_name}" if name else child_name
            groups.setdefault(type(child), []).append((qualified, child))
        for members in groups.values():
            if len(members) < 2:
                continue
            # Count each parameter once even if blocks share some (tied weights).
            unique = {id(p): p for _, block in members for p in block.parameters()}
            n_params = sum(p.numel() for p in unique.values())
            if n_params == 0:
                continue
            key = (n_params, len(members), -order)
            if best is None or key > best:
                best, best_blocks = key, members
    return list(best_blocks)
