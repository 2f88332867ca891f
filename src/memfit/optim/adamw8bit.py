"""AdamW with block-wise 8-bit optimizer state, and the StableEmbedding layer that goes with it."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..device import is_fake
from . import _fused8bit
from ._base import MemfitOptimizer, compute_dtype, dense_grad, work_copy, write_back
from ._dry import run_update
from .quantization import SIGNED_MAP, UNSIGNED_MAP, dequantize_blocks, quantize_blocks_
from .sharding import local_tensor

__all__ = ["KEEP_32BIT_ATTR", "AdamW8bit", "StableEmbedding"]

#: Attribute that, set truthy on a parameter, makes :class:`AdamW8bit` keep 32-bit state for it.
KEEP_32BIT_ATTR = "memfit_keep_32bit_state"


class AdamW8bit(MemfitOptimizer):
    """AdamW whose two moments are stored as block-wise quantised 8-bit codes.

    The update is the one of :class:`torch.optim.AdamW` (decoupled weight decay, bias-corrected
    moments).  For every large parameter the first moment is kept as signed 8-bit codes
    (:data:`~memfit.optim.quantization.SIGNED_MAP`) and the second moment as unsigned codes
    (:data:`~memfit.optim.quantization.UNSIGNED_MAP`), each block of ``block_size`` elements
    with its own fp32 absolute maximum: 2 bytes + 8 / ``block_size`` bytes per element (2.03 at
    the default 256) instead of the 8 bytes of fp32 AdamW.

    A step walks each parameter in chunks of ``chunk_size`` elements: decode the chunk's
    moments to fp32, apply the AdamW update, re-encode.  The fp32 temporaries therefore stay
    bounded by a few chunks (by default 256 Ki elements, 1 MiB of fp32, per intra-op thread:
    each thread's share stays in its cache), whatever the model size; a full fp32 copy of the
    moments never exists.  Each chunk costs a few dozen element-wise kernels; where the CPU is
    oversubscribed (other busy processes), every kernel's thread synchronisation gets slow,
    and a larger ``chunk_size`` (fewer kernels) or fewer torch threads helps.

    Small tensors (fewer than ``min_8bit_size`` elements: biases, norms) and parameters named in
    ``keep_32bit`` or flagged with :data:`KEEP_32BIT_ATTR` (see :class:`StableEmbedding`) keep
    ordinary fp32 moments: they cost little memory and are the most sensitive to quantisation.

    bf16/fp16 parameters are updated in fp32 and rounded once per step.  The step is free of
    host synchronisation and data-dependent control flow, so it also runs under
    ``FakeTensorMode``.

    Parameters sharded by FSDP2 (DTensors) are stepped shard by shard: each rank quantises its
    local shard in blocks that start at the shard's first element, so no block straddles two
    ranks, the block maxima stay local and the update needs no communication.  Which tensors
    get 8-bit state is decided on the whole parameter's size, the same on every rank.  State
    is kept as plain local tensors: ``state_dict()`` holds this rank's shard of the state and
    loads back into the same sharding.

    Args:
        params: Parameters or parameter groups.  Pass ``model.named_parameters()`` (or groups
            with named parameters) to refer to parameters by name in ``keep_32bit``.
        lr: Learning rate.
        betas: Coefficients of the running averages of the gradient and its square.
        eps: Term added to the denominator for numerical stability.
        weight_decay: Decoupled weight decay coefficient.
        block_size: Elements per quantisation block.
        min_8bit_size: Parameters with fewer elements keep fp32 state.
        keep_32bit: Parameters (tensors) or parameter names (exact, or ``fnmatch`` patterns
            such as ``"*.embed_tokens.weight"``) that keep fp32 state.
        chunk_size: Elements processed at once by the quantised update (rounded down to a
            multiple of ``block_size``); bounds the temporaries of a step.  ``None``: 256 Ki
            times ``torch.get_num_threads()`` at step time.
        compiled: Use a ``torch.compile``'d (inductor) fused decode-update-encode kernel for
            fp32 CPU parameters with 8-bit state: a few times faster than the eager kernels, with
            the same codes bit for bit.  ``None`` (default): for local shards of at least 1 Mi
            elements, unless the environment sets ``MEMFIT_COMPILED_OPTIM=0``; ``True``: for
            every such parameter with at least one whole 1 Mi chunk; ``False``: never.  Never
            under fake tensors or a dispatch mode (memfit's tracker, dry runs), and the eager
            kernels stay in use (with a warning) if compilation fails or the one-time check
            against the eager step does not pass.  Needs a C++ compiler at run time; compiles
            in the first step (seconds; cached on disk) and keeps an 8 MiB fp32 scratch buffer.

    Example:
        >>> model = torch.nn.Linear(128, 128)
        >>> opt = AdamW8bit(model.named_parameters(), lr=1e-3, min_8bit_size=1024)
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        block_size: int = 256,
        min_8bit_size: int = 4096,
        keep_32bit: Iterable[str | Tensor] = (),
        chunk_size: int | None = None,
        compiled: bool | None = None,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if eps < 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Invalid betas: {betas}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if chunk_size is not None and chunk_size < block_size:
            raise ValueError(f"chunk_size ({chunk_size}) must be >= block_size ({block_size})")
        if compiled is not None and not isinstance(compiled, bool):
            raise TypeError(f"compiled must be None, True or False, got {compiled!r}")
        self._compiled = compiled
        # fp32 scratch of the compiled step (one chunk of each moment), made on first use.
        self._scratch: Tensor | None = None
        self._keep_names: list[str] = []
        self._keep_ids: set[int] = set()
        for item in keep_32bit:
            if isinstance(item, str):
                self._keep_names.append(item)
            elif isinstance(item, Tensor):
                self._keep_ids.add(id(item))
            else:
                raise TypeError(f"keep_32bit entries must be str or Tensor, got {type(item)}")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "block_size": block_size,
            "min_8bit_size": min_8bit_size,
            "chunk_size": chunk_size,
        }
        super().__init__(params, defaults)
        if self._keep_names and not any("param_names" in g for g in self.param_groups):
            raise ValueError(
                "keep_32bit names need named parameters: pass model.named_parameters() "
                "(or param groups built from (name, tensor) pairs)"
            )

    def _wants_8bit(self, param: Tensor, group: dict[str, Any], index: int) -> bool:
        if param.numel() < group["min_8bit_size"] or not param.is_floating_point():
            return False
        if getattr(param, KEEP_32BIT_ATTR, False) or id(param) in self._keep_ids:
            return False
        names = group.get("param_names")
        if names is not None and self._keep_names:
            name = names[index]
            if any(name == pat or fnmatch.fnmatchcase(name, pat) for pat in self._keep_names):
                return False
        return True

    def _init_state(
        self, param: Tensor, state: dict[str, Any], group: dict[str, Any], index: int
    ) -> None:
        state["step"] = 0
        # The choice uses the whole (possibly sharded) parameter, the state its local shard.
        local = local_tensor(param)
        if self._wants_8bit(param, group, index):
            block = group["block_size"]
            blocks = -(-local.numel() // block)
            # Codes are flat and padded to whole blocks: every chunk then covers whole blocks
            # and the (at most block - 1) padding bytes stay zero forever (zero grads there).
            for key in ("exp_avg", "exp_avg_sq"):
                state[f"{key}_codes"] = torch.zeros(
                    blocks * block, dtype=torch.uint8, device=local.device
                )
                state[f"{key}_absmax"] = torch.zeros(
                    blocks, dtype=torch.float32, device=local.device
                )
        else:
            dtype = compute_dtype(local)
            state["exp_avg"] = torch.zeros_like(
                local, dtype=dtype, memory_format=torch.preserve_format
            )
            state["exp_avg_sq"] = torch.zeros_like(
                local, dtype=dtype, memory_format=torch.preserve_format
            )

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimisation step.

        Args:
            closure: Optional callable that re-evaluates the model and returns the loss.

        Returns:
            The closure's loss, if a closure was given.
        """
        loss = self._run_closure(closure)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for index, param in enumerate(group["params"]):
                if param.grad is None:
                    continue
                grad = local_tensor(dense_grad(param, type(self).__name__))
                state = self.state[param]
                if not state:
                    self._init_state(param, state, group, index)
                # A sharded parameter's update is element- and block-wise: its local shard's.
                local = local_tensor(param)
                state["step"] += 1
                step = state["step"]
                hyper = _Hyper(
                    lr=group["lr"],
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    step_size=group["lr"] / (1.0 - beta1**step),
                    bias_correction2_sqrt=math.sqrt(1.0 - beta2**step),
                )
                run_update(
                    self,
                    group,
                    (tuple(param.shape), _chunk(group)),
                    (local, grad),
                    state,
                    self._update,
                    (local, grad, state, group, hyper),
                )
        return loss

    def _update(
        self,
        local: Tensor,
        grad: Tensor,
        state: dict[str, Any],
        group: dict[str, Any],
        hyper: _Hyper,
    ) -> None:
        """One parameter's update (its state exists, its step counted)."""
        if "exp_avg_codes" in state:
            done = 0
            if self._use_compiled(local, grad, group["block_size"]):
                if self._scratch is None:
                    rows = _fused8bit.COMPILED_CHUNK // _fused8bit.BLOCK_SIZE
                    self._scratch = torch.empty(2, rows, _fused8bit.BLOCK_SIZE)
                done = _update_8bit_compiled(local, grad, state, hyper, self._scratch)
            _update_8bit(local, grad, state, hyper, group["block_size"], _chunk(group), start=done)
        else:
            work = work_copy(local)
            adamw_math(work, grad.to(work.dtype), state["exp_avg"], state["exp_avg_sq"], hyper)
            write_back(local, work)

    def _use_compiled(self, local: Tensor, grad: Tensor, block_size: int) -> bool:
        """Whether this parameter's 8-bit update runs the compiled kernel (see ``compiled``)."""
        if self._compiled is False:
            return False
        if self._compiled is None and (
            local.numel() < _fused8bit.MIN_COMPILED_NUMEL or not _fused8bit.env_enabled()
        ):
            return False
        eligible = (
            block_size == _fused8bit.BLOCK_SIZE
            and local.numel() >= _fused8bit.COMPILED_CHUNK
            and local.device.type == "cpu"
            and local.dtype == torch.float32
            and grad.dtype == torch.float32
            and local.is_contiguous()
            and grad.is_contiguous()
            and not is_fake(local)
            and _fused8bit.outside_special_modes()
        )
        return eligible and _fused8bit.compiled_step(_eager_reference) is not None


def _chunk(group: dict[str, Any]) -> int:
    block = group["block_size"]
    chunk = group["chunk_size"]
    if chunk is None:
        # Per-thread share of a chunk constant: ~1 MiB of fp32 per thread and temporary.
        chunk = _CHUNK_PER_THREAD * torch.get_num_threads()
    # A multiple of the block size, so chunks never split a block.
    return max(block, chunk - chunk % block)


_CHUNK_PER_THREAD = 1 << 18


class _Hyper:
    """Per-step scalars of the AdamW update (plain Python floats: no device syncs)."""

    __slots__ = (
        "beta1",
        "beta2",
        "bias_correction2_sqrt",
        "eps",
        "lr",
        "step_size",
        "weight_decay",
    )

    def __init__(self, **kwargs: float) -> None:
        for key, value in kwargs.items():
            setattr(self, key, float(value))


def adamw_math(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, h: _Hyper) -> None:
    """One AdamW update, in place, with the operation order of ``torch.optim.AdamW``.

    ``exp_avg``/``exp_avg_sq``/``grad`` may be longer than ``param`` (zero padding of the last
    quantisation block); only their first ``param.numel()`` elements reach the parameter.
    """
    exp_avg.lerp_(grad, 1.0 - h.beta1)
    exp_avg_sq.mul_(h.beta2).addcmul_(grad, grad, value=1.0 - h.beta2)
    denom = exp_avg_sq.sqrt().div_(h.bias_correction2_sqrt).add_(h.eps)
    numer = exp_avg
    n = param.numel()
    if exp_avg.shape != param.shape:
        numer = exp_avg.view(-1)[:n]
        denom = denom.view(-1)[:n]
    if h.weight_decay != 0.0:
        param.mul_(1.0 - h.lr * h.weight_decay)
    param.addcdiv_(numer, denom, value=-h.step_size)


def _update_8bit(
    param: Tensor,
    grad: Tensor,
    state: dict[str, Any],
    h: _Hyper,
    block_size: int,
    chunk_size: int,
    start: int = 0,
) -> None:
    # ``start`` (a multiple of block_size): elements before it were updated already.
    n = param.numel()
    if start >= n:
        return
    # Non-contiguous parameters are rare; give them a contiguous work tensor and copy back.
    target = param if param.is_contiguous() else param.detach().contiguous()
    flat_param = target.view(-1)
    flat_grad = grad.reshape(-1)
    m_codes, m_absmax = state["exp_avg_codes"], state["exp_avg_absmax"]
    v_codes, v_absmax = state["exp_avg_sq_codes"], state["exp_avg_sq_absmax"]
    starts = range(start, n, chunk_size)
    if is_fake(param) and len(starts) > 2:
        # Fake tensors have no values, and every full chunk allocates the same temporaries and
        # updates in place: the first chunk and the (shorter) last one show the step's memory
        # exactly, at a fraction of the dispatch cost of a dry run.
        starts = [starts[0], starts[-1]]
    for start in starts:
        end = min(start + chunk_size, n)
        length = end - start
        blocks = -(-length // block_size)
        b0 = start // block_size
        padded = blocks * block_size
        mc = m_codes[start : start + padded]
        vc = v_codes[start : start + padded]
        ma = m_absmax[b0 : b0 + blocks]
        va = v_absmax[b0 : b0 + blocks]
        exp_avg = dequantize_blocks(mc, ma, SIGNED_MAP)
        exp_avg_sq = dequantize_blocks(vc, va, UNSIGNED_MAP)
        g = flat_grad[start:end].float()
        if padded != length:
            # Zero gradient on the padding keeps its moments (and so the block maxima) untouched.
            g = F.pad(g, (0, padded - length))
        g = g.view(blocks, block_size)
        exp_avg = exp_avg.view(blocks, block_size)
        exp_avg_sq = exp_avg_sq.view(blocks, block_size)
        work = work_copy(flat_param[start:end])
        adamw_math(work, g, exp_avg, exp_avg_sq, h)
        write_back(flat_param[start:end], work)
        quantize_blocks_(exp_avg, SIGNED_MAP, mc, ma)
        quantize_blocks_(exp_avg_sq, UNSIGNED_MAP, vc, va)
    if target is not param:
        param.copy_(target)


def _hyper_tensor(h: _Hyper) -> Tensor:
    # The scalars of _fused8bit.fused_step_, each computed in double as adamw_math does.
    values = [
        1.0 - h.beta1,
        h.beta2,
        1.0 - h.beta2,
        h.bias_correction2_sqrt,
        h.eps,
        1.0 - h.lr * h.weight_decay if h.weight_decay != 0.0 else 1.0,
        -h.step_size,
    ]
    return torch.tensor(values, dtype=torch.float64)


def _update_8bit_compiled(
    param: Tensor, grad: Tensor, state: dict[str, Any], h: _Hyper, scratch: Tensor
) -> int:
    """Update the whole compiled chunks of a contiguous fp32 CPU parameter.

    Returns:
        The number of leading elements updated (the eager path does the rest).
    """
    fn = _fused8bit.compiled_step(_eager_reference)
    assert fn is not None  # checked by _use_compiled
    chunk, block = _fused8bit.COMPILED_CHUNK, _fused8bit.BLOCK_SIZE
    done = param.numel() - param.numel() % chunk
    hyper = _hyper_tensor(h)
    flat_param, flat_grad = param.view(-1), grad.view(-1)
    m_codes, m_absmax = state["exp_avg_codes"], state["exp_avg_absmax"]
    v_codes, v_absmax = state["exp_avg_sq_codes"], state["exp_avg_sq_absmax"]
    rows = chunk // block
    for start in range(0, done, chunk):
        b0 = start // block
        fn(
            flat_param[start : start + chunk].view(rows, block),
            flat_grad[start : start + chunk].view(rows, block),
            m_codes[start : start + chunk].view(rows, block),
            m_absmax[b0 : b0 + rows],
            v_codes[start : start + chunk].view(rows, block),
            v_absmax[b0 : b0 + rows],
            hyper,
            scratch,
        )
    return done


def _eager_reference(
    param: Tensor,
    grad: Tensor,
    m_codes: Tensor,
    m_absmax: Tensor,
    v_codes: Tensor,
    v_absmax: Tensor,
    hyper: Tensor,
) -> None:
    """The eager 8-bit update with _fused8bit.fused_step_'s signature (for its self-check)."""
    w1, b2, _, bc2, eps, decay, neg_step = hyper.tolist()
    h = _Hyper(
        lr=1.0 - decay,
        beta1=1.0 - w1,
        beta2=b2,
        eps=eps,
        weight_decay=1.0,
        step_size=-neg_step,
        bias_correction2_sqrt=bc2,
    )
    state = {
        "exp_avg_codes": m_codes.view(-1),
        "exp_avg_absmax": m_absmax,
        "exp_avg_sq_codes": v_codes.view(-1),
        "exp_avg_sq_absmax": v_absmax,
    }
    _update_8bit(param, grad, state, h, param.shape[-1], param.numel())


class StableEmbedding(nn.Embedding):
    """Embedding layer that trains stably with 8-bit optimizers.

    In the spirit of ``bitsandbytes.nn.StableEmbedding``: Xavier-uniform initialisation (keeps
    the initial embedding scale independent of the vocabulary size), a layer norm applied to the
    looked-up vectors (computed in fp32 for stability under bf16/fp16), and the weight flagged
    with :data:`KEEP_32BIT_ATTR` so that :class:`AdamW8bit` keeps full-precision state for it:
    embedding rows see rare, sparse updates whose moments quantise poorly.

    Takes the arguments of :class:`torch.nn.Embedding`; ``device``/``dtype`` also apply to the
    layer norm.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: Tensor | None = None,
        _freeze: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            num_embeddings,
            embedding_dim,
            padding_idx=padding_idx,
            max_norm=max_norm,
            norm_type=norm_type,
            scale_grad_by_freq=scale_grad_by_freq,
            sparse=sparse,
            _weight=_weight,
            _freeze=_freeze,
            device=device,
            dtype=dtype,
        )
        self.norm = nn.LayerNorm(embedding_dim, device=device, dtype=dtype)
        setattr(self.weight, KEEP_32BIT_ATTR, True)

    def reset_parameters(self) -> None:
        """Xavier-uniform weights; the padding row (if any) is zeroed as in ``nn.Embedding``."""
        nn.init.xavier_uniform_(self.weight)
        self._fill_padding_idx_with_zero()

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> StableEmbedding:
        out = super()._apply(fn, recurse)
        # Conversions may replace the Parameter object; keep the 32-bit-state flag on it.
        setattr(self.weight, KEEP_32BIT_ATTR, True)
        return out

    def forward(self, input: Tensor) -> Tensor:
        """Look up ``input`` and layer-normalise the vectors (in fp32, returned in weight dtype)."""
        emb = F.embedding(
            input,
            self.weight,
            self.padding_idx,
            self.max_norm,
            self.norm_type,
            self.scale_grad_by_freq,
            self.sparse,
        )
        out = F.layer_norm(
            emb.float(),
            self.norm.normalized_shape,
            None if self.norm.weight is None else self.norm.weight.float(),
            None if self.norm.bias is None else self.norm.bias.float(),
            self.norm.eps,
        )
        return out.to(self.weight.dtype)
