"""Cross-entropy of a linear output head, computed in chunks: full logits never exist.

A language model's loss is ``cross_entropy(hidden @ weight.T + bias, labels)``. Done plainly,
the logits (tokens x vocabulary) are the largest tensors of the step: a 128k vocabulary at
4 x 1024 tokens is 2 GiB of fp32 logits, plus their gradient, plus the bf16 copies autocast
and the loss's upcast make. :func:`chunked_cross_entropy` computes the same loss and the same
gradients with only one chunk of logits alive at a time.

How it works (a custom :class:`torch.autograd.Function`):

* **Forward** walks chunks of ``chunk_size`` tokens. Each chunk's logits are made, capped,
  reduced to the token's log-sum-exp, target logit and (for label smoothing) logit sum, and
  dropped. Kept for backward: the inputs (which the plain graph keeps too) and one fp32
  log-sum-exp per token.
* **Backward** recomputes the logits, walking *vocabulary blocks* of the same number of
  logits (all tokens x ``chunk_size * V / N`` classes). The softmax comes back from the saved
  log-sum-exp, and each block gives its slice of the weight (and bias) gradient in one matmul
  over all tokens, written straight into the gradient in the weight's dtype: no fp32 copy of
  a vocabulary-sized weight gradient exists, even for bf16 weights. The hidden-state gradient
  is summed over blocks in fp32 (tokens x hidden x 4 bytes, small next to the logits since
  hidden << vocabulary).

The trade-off: recomputing costs one more head matmul in backward (4 passes of
``tokens x hidden x vocabulary`` instead of 3, about a third more head FLOPs). The alternative,
computing the gradients during forward (what Liger Kernel and torch's chunked
``linear_cross_entropy`` do) saves that matmul but holds a weight-sized gradient (fp32 when
the weight is low precision) and a hidden-sized one from the forward until the backward runs,
and wastes the work when no backward follows.

Numerics: matmuls run in the compute dtype (the inputs' dtype, or autocast's when autocast is
on, as :func:`torch.nn.functional.linear` would), and every reduction (log-sum-exp, softmax,
the loss, the hidden-state gradient across blocks) in fp32, as Hugging Face's loss does after
upcasting the logits. The loss is fp32 whatever the input dtype.

What torch's own ``torch.nn.functional.linear_cross_entropy`` (torch 2.13, chunked with
``LinearCrossEntropyOptions``) lacks, and why this module does not delegate to it: no
z-loss, no logit soft-capping, label smoothing makes it fall back to full logits (with a
warning), inputs must be 1-D or 2-D; and it computes the gradients in forward, holding them
(plus an fp32 weight-sized scratch on CPU) between forward and backward, so its peak is higher
(see ``benchmarks/results/fused_loss.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["auto_chunk_size", "chunked_cross_entropy", "fused_linear_loss"]

_REDUCTIONS = ("mean", "sum", "none")
#: A chunk's fp32 logits take at least this many bytes under the automatic chunk size, so that
#: small inputs do not become many tiny matmuls.
_MIN_CHUNK_BYTES = 16 * 2**20


def auto_chunk_size(num_tokens: int, hidden_size: int, vocab_size: int) -> int:
    """The default tokens per chunk: one chunk's fp32 logits take about as many bytes as the
    fp32 hidden states of all tokens, and at least 16 MiB (never more than ``num_tokens``).

    The working set of the op is then a small multiple of the hidden states' size, which the
    step holds anyway.

    Args:
        num_tokens: Tokens in the batch (all leading dimensions multiplied).
        hidden_size: Features of the hidden state.
        vocab_size: Classes (output features of the head).
    """
    if num_tokens <= 0:
        return 1
    by_hidden = math.ceil(num_tokens * hidden_size / max(vocab_size, 1))
    by_floor = math.ceil(_MIN_CHUNK_BYTES / (4 * max(vocab_size, 1)))
    return max(1, min(num_tokens, max(by_hidden, by_floor)))


@dataclass(frozen=True)
class _Options:
    chunk_size: int
    ignore_index: int
    label_smoothing: float
    z_loss: float
    softcap: float | None
    reduction: str
    compute_dtype: torch.dtype


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_size: int | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T + bias`` against ``labels``, without full logits.

    Equal (within rounding) to the unfused computation::

        logits = F.linear(hidden, weight, bias).float()
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        lse = logits.logsumexp(-1)
        loss = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="none",
                               ignore_index=ignore_index, label_smoothing=label_smoothing)
        loss = loss + z_loss * lse.flatten() ** 2 * (labels.flatten() != ignore_index)
        # then the reduction, over tokens whose label is not ignore_index

    but only ``chunk_size`` tokens' logits (forward) or the same number of logits
    (backward) exist at a time. Gradients flow to ``hidden``, ``weight`` and ``bias``; a weight
    shared with an embedding (tied) simply receives both gradients, as autograd accumulates
    them. Double backward is not supported.

    Args:
        hidden: Hidden states, shape ``(..., H)``, any number of leading dimensions. A
            non-contiguous tensor is copied once (``reshape``).
        weight: The head's weight, shape ``(V, H)`` (``nn.Linear.weight``).
        labels: Class indices, shape ``hidden.shape[:-1]``, integer dtype. Values must be in
            ``[0, V)`` or equal ``ignore_index`` (others raise in the gather, as
            ``F.cross_entropy`` does on CPU, or trip a device assert on a GPU).
        bias: The head's bias, shape ``(V,)``, or None.
        chunk_size: Tokens per forward chunk. Default: :func:`auto_chunk_size`. Smaller chunks
            lower the peak (by ``chunk_size x V x 4`` bytes per token less) and cost more
            kernel launches.
        ignore_index: Label value that contributes neither loss nor gradient.
        label_smoothing: In ``[0, 1]``; the target is ``(1 - ls) * onehot + ls / V``, as in
            ``F.cross_entropy``.
        z_loss: Coefficient of the auxiliary ``log(sum(exp(logits)))**2`` term per token
            (PaLM's z-loss), added to the loss of each non-ignored token; 0 turns it off.
        softcap: If set, logits become ``softcap * tanh(logits / softcap)`` before the loss
            (Gemma 2's final-logit soft-capping).
        reduction: ``"mean"`` over non-ignored tokens (``nan`` when every label is ignored,
            as ``F.cross_entropy`` gives, with zero gradients), ``"sum"``, or ``"none"``
            (shape ``labels.shape``, 0 at ignored tokens).

    Returns:
        The loss, fp32.

    Raises:
        ValueError: On mismatched shapes or dtypes, or an option out of range.
    """
    opts = _check(
        hidden,
        weight,
        labels,
        bias,
        chunk_size,
        label_smoothing,
        z_loss,
        softcap,
        reduction,
        ignore_index,
    )
    h2 = hidden.reshape(-1, hidden.shape[-1])
    loss = _ChunkedLinearCrossEntropy.apply(h2, weight, bias, labels.reshape(-1), opts)
    if reduction == "none":
        return loss.view(labels.shape)
    return loss


def fused_linear_loss(
    hidden: torch.Tensor,
    head: nn.Linear,
    labels: torch.Tensor,
    *,
    shift: bool = False,
    num_items_in_batch: int | torch.Tensor | None = None,
    chunk_size: int | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    reduction: str | None = None,
) -> torch.Tensor:
    """The loss of a model whose output head is ``head`` (an ``nn.Linear``), without logits.

    For custom models: call this in the loss instead of ``cross_entropy(head(hidden), labels)``
    (the model's forward returns the hidden states before the head)::

        hidden = model.body(input_ids)              # (batch, length, H)
        loss = fused_linear_loss(hidden, model.head, labels, shift=True)

    Args:
        hidden: Hidden states before the head, shape ``(..., H)``.
        head: The output layer; its ``weight`` and ``bias`` are used (a forward hook on it
            does not run, since it is not called).
        labels: Class indices, shape ``hidden.shape[:-1]``.
        shift: Next-token prediction as Hugging Face does it: position ``t`` predicts
            ``labels[..., t + 1]`` and the last position predicts nothing.
        num_items_in_batch: If given, the loss is the sum divided by this (Hugging Face's
            token-weighted gradient accumulation) instead of the mean.
        chunk_size: As :func:`chunked_cross_entropy`'s.
        ignore_index: As :func:`chunked_cross_entropy`'s.
        label_smoothing: As :func:`chunked_cross_entropy`'s.
        z_loss: As :func:`chunked_cross_entropy`'s.
        softcap: As :func:`chunked_cross_entropy`'s.
        reduction: As :func:`chunked_cross_entropy`'s; ``None``: ``"mean"``, or ``"sum"``
            with ``num_items_in_batch`` (the only reduction it goes with).

    Returns:
        The loss, fp32.
    """
    if not isinstance(head, nn.Linear):
        raise ValueError(f"fused_linear_loss needs an nn.Linear head, got {type(head).__name__}.")
    if shift:
        # Pad-and-slice (not hidden[..., :-1, :]), so the hidden states are not copied.
        labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    if num_items_in_batch is not None:
        if reduction not in (None, "sum"):
            raise ValueError("num_items_in_batch goes with the sum reduction only.")
        reduction = "sum"
    loss = chunked_cross_entropy(
        hidden,
        head.weight,
        labels,
        bias=head.bias,
        chunk_size=chunk_size,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        softcap=softcap,
        reduction=reduction if reduction is not None else "mean",
    )
    if num_items_in_batch is None:
        return loss
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


# ---------------------------------------------------------------------------------- checks
def _check(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None,
    chunk_size: int | None,
    label_smoothing: float,
    z_loss: float,
    softcap: float | None,
    reduction: str,
    ignore_index: int,
) -> _Options:
    if hidden.dim() < 1:
        raise ValueError("hidden must have a feature dimension, got a 0-d tensor.")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must have shape (V, {hidden.shape[-1]}) for hidden of shape "
            f"{tuple(hidden.shape)}, got {tuple(weight.shape)}."
        )
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"labels must have shape {tuple(hidden.shape[:-1])} (hidden's without the last "
            f"dimension), got {tuple(labels.shape)}."
        )
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"labels must be class indices (an integer dtype), got {labels.dtype}.")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}.")
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(f"chunk_size must be a positive integer or None, got {chunk_size!r}.")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}.")
    if z_loss < 0:
        raise ValueError(f"z_loss must be >= 0, got {z_loss}.")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}.")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(_REDUCTIONS)}; got {reduction!r}.")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        compute = torch.get_autocast_dtype(device_type)
    else:
        if hidden.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
            raise ValueError(
                f"hidden ({hidden.dtype}), weight ({weight.dtype}) and bias must share a dtype "
                "outside autocast, as for F.linear."
            )
        compute = hidden.dtype
    num_tokens = math.prod(hidden.shape[:-1])
    if chunk_size is None:
        chunk_size = auto_chunk_size(num_tokens, hidden.shape[-1], weight.shape[0])
    return _Options(
        chunk_size=chunk_size,
        ignore_index=int(ignore_index),
        label_smoothing=float(label_smoothing),
        z_loss=float(z_loss),
        softcap=None if softcap is None else float(softcap),
        reduction=reduction,
        compute_dtype=compute,
    )


# ---------------------------------------------------------------------------------- autograd
class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Forward over token chunks, backward over vocabulary blocks (see the module docstring)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        h2: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        opts: _Options,
    ) -> torch.Tensor:
        num_tokens, vocab = h2.shape[0], weight.shape[0]
        cdt = opts.compute_dtype
        valid = labels != opts.ignore_index
        # Ignored labels gather class 0; their loss is masked out below.
        target = torch.where(valid, labels, 0).long()
        lse = torch.empty(num_tokens, dtype=torch.float32, device=h2.device)
        token_loss = torch.empty(num_tokens, dtype=torch.float32, device=h2.device)
        with torch.autocast(h2.device.type, enabled=False):
            w = weight.to(cdt)  # a copy only under autocast, as F.linear would make
            b = None if bias is None else bias.to(cdt)
            for start in range(0, num_tokens, opts.chunk_size):
                stop = min(start + opts.chunk_size, num_tokens)
                logits = _logits(h2[start:stop].to(cdt), w, b, opts.softcap)
                rows = target[start:stop, None]
                loss = -(1.0 - opts.label_smoothing) * logits.gather(1, rows).squeeze(1)
                if opts.label_smoothing:
                    loss.sub_(logits.sum(1), alpha=opts.label_smoothing / vocab)
                # The log-sum-exp in place: the chunk is not needed after it.
                peak = logits.amax(1, keepdim=True)
                chunk_lse = logits.sub_(peak).exp_().sum(1).log_().add_(peak.squeeze(1))
                del logits
                loss.add_(chunk_lse)
                if opts.z_loss:
                    loss.add_(chunk_lse.square(), alpha=opts.z_loss)
                lse[start:stop] = chunk_lse
                token_loss[start:stop] = loss
            del w, b
        token_loss.masked_fill_(~valid, 0.0)
        count = valid.sum()
        ctx.save_for_backward(h2, weight, bias, target, valid, lse, count)
        ctx.opts = opts
        if opts.reduction == "none":
            return token_loss
        total = token_loss.sum()
        # 0 / 0 is nan when every label is ignored, as F.cross_entropy gives.
        return total / count if opts.reduction == "mean" else total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        h2, weight, bias, target, valid, lse, count = ctx.saved_tensors
        opts: _Options = ctx.opts
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = grad_w = grad_b = None
        if not (need_h or need_w or need_b):
            return None, None, None, None, None
        num_tokens, vocab = h2.shape[0], weight.shape[0]
        cdt = opts.compute_dtype
        # Each token's weight in the total: zero for ignored tokens (so an all-ignored mean,
        # whose count is 0, gets zero gradients rather than 0 * inf).
        if opts.reduction == "none":
            scale = grad_out.reshape(-1).float() * valid
        elif opts.reduction == "mean":
            scale = valid * (grad_out.float() / count.clamp(min=1))
        else:
            scale = valid * grad_out.float()
        scale = scale.unsqueeze(1)
        # d loss / d logit = scale * (softmax * (1 + 2 z lse) - (1 - ls) onehot - ls / V)
        soft_coef = None if not opts.z_loss else (1.0 + 2.0 * opts.z_loss * lse).unsqueeze(1)
        target_coef = scale * -(1.0 - opts.label_smoothing)
        uniform = scale * (opts.label_smoothing / vocab) if opts.label_smoothing else None
        block = max(1, min(vocab, math.ceil(opts.chunk_size * vocab / max(num_tokens, 1))))
        with torch.autocast(h2.device.type, enabled=False):
            hc = h2.to(cdt)
            if need_h:
                grad_h32 = torch.zeros(h2.shape, dtype=torch.float32, device=h2.device)
            if need_w:
                grad_w = torch.empty_like(weight)
            if need_b:
                grad_b = torch.empty_like(bias)
            for start in range(0, vocab, block):
                stop = min(start + block, vocab)
                w_blk = weight[start:stop].to(cdt)
                b_blk = None if bias is None else bias[start:stop].to(cdt)
                pre = F.linear(hc, w_blk, b_blk).float()  # (tokens, block), before capping
                if opts.softcap is None:
                    capped, grad = None, pre  # the logits themselves become the gradient
                else:
                    # tanh(u / s) is kept for the cap's derivative; the logit is s * that.
                    capped = pre.div_(opts.softcap).tanh_()
                    grad = capped.mul(opts.softcap)
                grad.sub_(lse.unsqueeze(1)).exp_()  # softmax over the whole vocabulary
                if soft_coef is not None:
                    grad.mul_(soft_coef)
                grad.mul_(scale)
                if uniform is not None:
                    grad.sub_(uniform)
                local = target - start
                inside = (local >= 0) & (local < stop - start)
                grad.scatter_add_(
                    1, local.clamp(0, stop - start - 1).unsqueeze(1), target_coef * inside[:, None]
                )
                if capped is not None:
                    grad.mul_(capped.square_().neg_().add_(1.0))  # d(s tanh(u/s))/du
                del pre, capped
                if need_b:
                    grad_b[start:stop] = grad.sum(0)
                grad_c = grad.to(cdt)
                del grad
                if need_w:
                    grad_w[start:stop] = grad_c.t().mm(hc)
                if need_h:
                    grad_h32.add_(grad_c.mm(w_blk))
                del grad_c, w_blk
            if need_h:
                grad_h = grad_h32 if h2.dtype == torch.float32 else grad_h32.to(h2.dtype)
        return grad_h, grad_w, grad_b, None, None


def _logits(
    h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, softcap: float | None
) -> torch.Tensor:
    """One chunk's fp32 logits, soft-capped if asked (a fresh tensor the caller may change)."""
    logits = F.linear(h, w, b).float()
    if softcap is not None:
        logits.div_(softcap).tanh_().mul_(softcap)
    return logits
