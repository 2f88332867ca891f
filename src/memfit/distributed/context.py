"""Context parallelism: every sample's sequence cut into contiguous chunks, one per rank of a
context-parallel group, :func:`apply_context_parallel`.

A rank runs the whole model on its chunk of ``seq_len / degree`` tokens: its embeddings, norms,
MLPs, logits and loss, and everything they keep for backward, hold ``1 / degree`` of the
sample's activations. Only attention needs the other chunks, and two ways are offered:

* ``ring`` (ring attention): the chunks' keys and values travel round the group, one hop per
  step (``torch.distributed.batch_isend_irecv`` to the next rank, from the previous one, posted
  before the step's compute so that they overlap it). Each rank attends its queries to each
  chunk in turn and merges the partial softmaxes by their log-sum-exp (the online softmax);
  backward runs the ring again, the keys' and values' gradients travelling with them back to
  their owner. A rank holds its own chunk's tensors plus two chunks' keys and values in flight
  (forward) or keys, values and their gradients (backward).
* ``all-to-all`` (DeepSpeed-Ulysses): queries, keys and values are re-split by an all-to-all
  from sequence chunks to head groups, attention runs on the whole sequence for ``heads /
  degree`` heads, and a second all-to-all splits the output back by sequence. Needs the heads
  (per tensor-parallel rank) divisible by the degree; the key-value heads are repeated first
  when they are not.

Why memfit has its own: torch 2.13's ``torch.distributed.tensor.experimental.context_parallel``
dispatches only the CUDA SDPA kernels (flash, memory-efficient, cuDNN); on CPU the SDPA op
(``_scaled_dot_product_flash_attention_for_cpu``) has no sharding strategy and the call fails,
and it runs on ``F.scaled_dot_product_attention`` rather than on a Hugging Face model's
attention interface. torch has no all-to-all (Ulysses) attention at all. So both modes here
are memfit's own, on torch.distributed's point-to-point operations and
the functional collectives' ``all_to_all_single_autograd`` (which differentiates), with aten's SDPA
kernels computing each block (those that return the log-sum-exp: the CPU flash kernel on CPU,
the memory-efficient one elsewhere). The algorithm is torch's (and Liu et al.'s ring
attention) without load balancing: chunks are contiguous, so under the causal mask rank ``r``
computes ``r + 1`` blocks and skips the rest (the ranks' memory is alike, their compute not).

The hook into the model is transformers' attention interface: the model's attention
implementation is switched to ``memfit_context`` (registered once), which reads the group from
its attention module. Position ids are the chunk's global positions (rotary embeddings and
learned positions see where the chunk sits), and the labels are shifted over the whole sample
before it is cut, so the last token of a chunk predicts the first of the next. The loss is the
mean over every token of the sample on all ranks: each rank's summed cross-entropy times the
degree over the global token count, so that gradients averaged over the group (as data
parallelism averages them) are the whole sample's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .config import CONTEXT_MODES

__all__ = [
    "ATTENTION_NAME",
    "ContextParallel",
    "apply_context_parallel",
    "check_context_parallel",
    "context_chunk",
    "ring_attention",
    "ulysses_attention",
]

#: The name memfit's context-parallel attention is registered under in transformers.
ATTENTION_NAME = "memfit_context"

#: The attribute of an attention module that holds its :class:`ContextParallel`.
_ATTR = "_memfit_context"


# --------------------------------------------------------------------------- checks
def check_context_parallel(model_or_config: Any, degree: int, mode: str, *, tensor: int = 1,
                           seq_len: int | None = None) -> list[str]:
    """What stops ``degree``-way context parallelism in ``mode``, one sentence each.

    Args:
        model_or_config: The model (or its HF config): its attention heads, for all-to-all.
        degree: The context-parallel degree.
        mode: ``ring`` or ``all-to-all``.
        tensor: The tensor-parallel degree (all-to-all splits each tensor rank's heads).
        seq_len: The sequence length, when known: the degree must divide it.
    """
    out: list[str] = []
    if degree == 1:
        return out
    if seq_len is not None and seq_len % degree:
        out.append(f"context parallelism of {degree} does not divide the sequence of {seq_len} "
                   f"tokens into equal chunks; use a sequence length that is a multiple of "
                   f"{degree}")
    cfg = getattr(model_or_config, "config", model_or_config)
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    if mode == "all-to-all" and isinstance(heads, int) and (heads // tensor) % degree:
        out.append(f"all-to-all context parallelism of {degree} does not divide the "
                   f"{heads // tensor} attention heads of a tensor rank; use a degree that "
                   f"divides {heads // tensor}, or context_mode ring")
    return out


def context_chunk(seq_len: int, degree: int, index: int) -> slice:
    """The tokens of chunk ``index`` (contiguous, ``seq_len / degree`` each)."""
    n = seq_len // degree
    return slice(index * n, (index + 1) * n)


# --------------------------------------------------------------------------- attention blocks
def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention and its log-sum-exp per query (``b x h x n``, fp32), by aten's
    SDPA kernels that return it."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale)
    else:
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale)
        lse = lse[..., :q.shape[2]]  # the kernel pads the queries' statistics
    return out, lse.float()


def _block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, scale: float,
                    causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's gradients given the *merged* output and log-sum-exp (the flash backward
    recomputes the block's probabilities from them, so each block's share is exact)."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    empty = torch.empty(0, device=q.device, dtype=torch.long)
    pad = -(-q.shape[2] // 32) * 32
    lse_p = F.pad(lse, (0, pad - lse.shape[-1]))
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, torch.empty(0, device=q.device, dtype=q.dtype), out, lse_p, empty, empty,
        0.0, [True, True, True, False], causal, scale=scale)
    return dq, dk, dv


def _repeat(kv: torch.Tensor, groups: int) -> torch.Tensor:
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def _unrepeat(grad: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return grad
    b, h, n, d = grad.shape
    return grad.view(b, h // groups, groups, n, d).sum(2)


class _Ring:
    """Send a flat buffer to the next rank of ``group`` and receive the previous rank's."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, buf: torch.Tensor) -> tuple[torch.Tensor, list[Any]]:
        recv = torch.empty_like(buf)
        ops = [dist.P2POp(dist.isend, buf, self.next, self.group),
               dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        return recv, dist.batch_isend_irecv(ops)


def _pack(*ts: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def _unpack(buf: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, at = [], 0
    for t in like:
        out.append(buf[at:at + t.numel()].view(t.shape))
        at += t.numel()
    return out


class _RingAttention(torch.autograd.Function):
    """Causal ring attention over contiguous chunks (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                group: Any) -> torch.Tensor:
        ring = _Ring(group)
        groups = q.shape[1] // k.shape[1]
        out = lse = None
        kv = _pack(k, v)
        for step in range(ring.size):
            pending = ring.start(kv) if step + 1 < ring.size else None
            src = (ring.rank - step) % ring.size
            if src <= ring.rank:  # later chunks are wholly in the causal mask's future
                ck, cv = _unpack(kv, [k, v])
                o, s = _block_forward(q, _repeat(ck, groups), _repeat(cv, groups), scale,
                                      causal=src == ring.rank)
                if out is None:
                    out, lse = o.float(), s
                else:  # merge the partial softmaxes by their log-sum-exp
                    new = torch.logaddexp(lse, s)
                    out = (out * torch.exp(lse - new).unsqueeze(-1)
                           + o.float() * torch.exp(s - new).unsqueeze(-1))
                    lse = new
                del o, s
            if pending is not None:
                recv, works = pending
                for w in works:
                    w.wait()
                kv = recv
        del kv
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.group = scale, group
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group)
        groups = q.shape[1] // k.shape[1]
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        # The keys and values travel with their gradients' running sums back to their owner.
        bundle = _pack(k, v, torch.zeros_like(k), torch.zeros_like(v))
        like = [k, v, k, v]
        for step in range(ring.size):
            src = (ring.rank - step) % ring.size
            if src <= ring.rank:
                ck, cv, dk, dv = _unpack(bundle, like)
                gq, gk, gv = _block_backward(dout, q, _repeat(ck, groups), _repeat(cv, groups),
                                             out, lse, ctx.scale, causal=src == ring.rank)
                dq += gq
                dk += _unrepeat(gk, groups)
                dv += _unrepeat(gv, groups)
                del gq, gk, gv
            recv, works = ring.start(bundle)
            for w in works:
                w.wait()
            bundle = recv
        _, _, dk, dv = _unpack(bundle, like)
        return dq.to(q.dtype), dk.clone(), dv.clone(), None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any,
                   scale: float | None = None) -> torch.Tensor:
    """Causal attention of this rank's chunk of queries to every earlier chunk's keys and
    values, passed round ``group`` (a ring).

    Args:
        q: ``batch x heads x chunk x head_dim``: this rank's queries (rank ``i`` of the group
            holds chunk ``i`` of the sequence).
        k: ``batch x kv_heads x chunk x head_dim`` (``heads`` a multiple of ``kv_heads``).
        v: Like ``k``.
        group: The context-parallel process group.
        scale: The softmax scale (default ``head_dim ** -0.5``).

    Returns:
        ``batch x heads x chunk x head_dim``.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), scale, group)


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    from torch.distributed import _functional_collectives as fc

    # The functional collective differentiates (its backward is the reverse all-to-all).
    out = fc.all_to_all_single_autograd(x.contiguous(), None, None, group)
    return fc.wait_tensor(out)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any,
                      scale: float | None = None) -> torch.Tensor:
    """Causal attention by all-to-all (DeepSpeed-Ulysses): the chunks' queries, keys and
    values re-split by head groups, attention over the whole sequence, the output split back.
    Arguments as :func:`ring_attention`'s; ``heads`` must be a multiple of the group's size."""
    c = dist.get_world_size(group)
    b, h, n, d = q.shape
    if k.shape[1] % c:  # too few key-value heads to split: give each query head its own
        k, v = _repeat(k, h // k.shape[1]), _repeat(v, h // v.shape[1])

    def to_heads(x: torch.Tensor) -> torch.Tensor:
        # [b, H, n, d] -> [c, b, H/c, n, d] -> exchange -> [b, H/c, c*n, d]
        hh = x.shape[1]
        x = x.view(b, c, hh // c, n, d).transpose(0, 1)
        y = _all_to_all(x, group)  # now dim 0 is the source rank: its sequence chunk
        return y.permute(1, 2, 0, 3, 4).reshape(b, hh // c, c * n, d)

    qh, kh, vh = to_heads(q), to_heads(k), to_heads(v)
    o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                       enable_gqa=kh.shape[1] != qh.shape[1])
    # [b, h/c, c*n, d] -> [c, b, h/c, n, d] -> exchange -> [b, h, n, d]
    o = o.view(b, h // c, c, n, d).permute(2, 0, 1, 3, 4)
    o = _all_to_all(o, group)
    return o.transpose(0, 1).reshape(b, h, n, d)


def _context_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, attention_mask: Any, dropout: float = 0.0,
                       scaling: float | None = None, **_: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface for a context-parallel model."""
    cp: ContextParallel | None = getattr(module, _ATTR, None)
    if cp is None:
        raise RuntimeError(f"{type(module).__name__} runs {ATTENTION_NAME!r} attention but "
                           "was not prepared by apply_context_parallel")
    if dropout:
        raise ValueError("context-parallel attention has no attention dropout; set the "
                         "model's attention_dropout to 0")
    if attention_mask is not None:
        raise ValueError("context-parallel attention takes causal batches without padding "
                         "masks; pass input ids alone")
    fn = ring_attention if cp.mode == "ring" else ulysses_attention
    out = fn(query, key, value, cp.group, scaling)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    if ATTENTION_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION_NAME, _context_attention)


# --------------------------------------------------------------------------- the model
@dataclass
class ContextParallel:
    """A model prepared by :func:`apply_context_parallel`, and its loss.

    Attributes:
        model: The model: its forward takes the whole sample's input ids, keeps this rank's
            chunk and returns that chunk's logits.
        group: The context-parallel process group.
        degree: Its size.
        index: This rank's chunk.
        mode: ``ring`` or ``all-to-all``.
    """

    model: nn.Module
    group: Any
    degree: int
    index: int
    mode: str
    _undo: list[Callable[[], None]] = field(default_factory=list)

    def chunk(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of a ``batch x sequence`` tensor.

        Raises:
            ValueError: when the degree does not divide the sequence.
        """
        problems = check_context_parallel(self.model, self.degree, self.mode,
                                          seq_len=t.shape[1])
        if problems:
            raise ValueError(problems[0])
        return t[:, context_chunk(t.shape[1], self.degree, self.index)]

    def positions(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """This chunk's global position ids, ``1 x chunk``."""
        sl = context_chunk(seq_len, self.degree, self.index)
        return torch.arange(sl.start, sl.stop, device=device).unsqueeze(0)

    def targets(self, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """This chunk's next-token targets: the labels shifted over the whole sample, then cut
        (a chunk's last token predicts the next chunk's first)."""
        return self.chunk(F.pad(labels, (0, 1), value=ignore_index)[:, 1:])

    def loss(self, logits: torch.Tensor, labels: torch.Tensor,
             ignore_index: int = -100) -> torch.Tensor:
        """This rank's share of the causal LM loss, a mean over every counted token of the
        whole samples: ``degree x`` its chunk's summed cross-entropy over the token count of
        all chunks, so that the group's average is the loss and averaging the gradients over
        the group gives the whole samples' gradients.

        Args:
            logits: This chunk's ``batch x chunk x vocab`` (vocabulary-sharded under tensor
                parallelism: run it inside ``loss_parallel``).
            labels: The whole samples' labels, ``batch x sequence`` (all ranks alike).
            ignore_index: Label value that does not count.
        """
        target = self.targets(labels, ignore_index)
        count = (target != ignore_index).sum().to(torch.float32)
        dist.all_reduce(count, group=self.group)
        total = F.cross_entropy(logits.flatten(0, 1).float(), target.reshape(-1),
                                ignore_index=ignore_index, reduction="sum")
        return total * (self.degree / count.clamp(min=1))

    def remove(self) -> None:
        """Give the model back its own attention and forward."""
        while self._undo:
            self._undo.pop()()


def apply_context_parallel(model: nn.Module, group: Any, mode: str = "ring") -> ContextParallel:
    """Make ``model`` (a Hugging Face causal LM) train on this rank's chunk of each sample.

    Every rank of ``group`` calls it with the same model. Afterwards ``model(input_ids)``
    takes the whole samples (``batch x sequence``, every rank alike), keeps this rank's chunk
    with its global position ids, and returns the chunk's logits; the loss is
    :meth:`ContextParallel.loss` with the whole labels; average the gradients over the group
    (:mod:`memfit.distributed.layout` does, with the data-parallel replicas). Memory per rank:
    the activations and logits of ``seq_len / degree`` tokens, plus the attention's traffic
    (see the module docstring); the parameters are whole on each rank.

    Args:
        model: A Hugging Face causal LM whose attention goes through transformers' attention
            interface (Llama, Mistral, Qwen2, GPT-2 ...), without attention dropout.
        group: The context-parallel process group (``mesh["cp"].get_group()``).
        mode: ``ring`` or ``all-to-all``.

    Returns:
        The :class:`ContextParallel` handle (``remove()`` undoes it).

    Raises:
        ValueError: for an unknown mode, a model without an HF config, or one
            :func:`check_context_parallel` refuses.
    """
    if mode not in CONTEXT_MODES:
        raise ValueError(f"context_mode {mode!r} is not known; use one of "
                         f"{', '.join(CONTEXT_MODES)}")
    # A pipeline stage carries its model's HF config as hf_config.
    config = getattr(model, "config", None) or getattr(model, "hf_config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        raise ValueError(f"context parallelism hooks a Hugging Face model's attention, and "
                         f"{type(model).__name__} has no config to switch it")
    degree, index = dist.get_world_size(group), dist.get_rank(group)
    problems = check_context_parallel(model, degree, mode)
    if problems:
        raise ValueError("; ".join(problems))
    _register()
    cp = ContextParallel(model, group, degree, index, mode)
    before = config._attn_implementation
    config._attn_implementation = ATTENTION_NAME
    cp._undo.append(lambda: setattr(config, "_attn_implementation", before))
    for mod in model.modules():
        if getattr(mod, "config", None) is config and hasattr(mod, "is_causal"):
            setattr(mod, _ATTR, cp)
            cp._undo.append(lambda m=mod: delattr(m, _ATTR))

    def take_chunk(_: nn.Module, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        ids = args[0] if args else kwargs.pop("input_ids")
        kwargs.pop("input_ids", None)
        if kwargs.get("position_ids") is None:
            kwargs["position_ids"] = cp.positions(ids.shape[1], ids.device)
        return (cp.chunk(ids), *args[1:]), kwargs

    if hasattr(model, "context"):
        # A pipeline stage (StageModule) chunks its ids and places its positions itself.
        model.context = cp
        cp._undo.append(lambda: setattr(model, "context", None))
        return cp
    handle = model.register_forward_pre_hook(take_chunk, with_kwargs=True)
    cp._undo.append(handle.remove)
    return cp
