"""Terms of the analytic layout model (:mod:`memfit.estimate.layout_cost`) for what a pipeline
holds between its stages, and what sequence parallelism divides:

* :func:`receive_buffer_bytes`: torch's ``PipelineStage`` receives every micro-batch's input,
  and every output gradient, into a buffer of its own: up to torch 2.14 allocated at the first
  step and kept (:func:`receive_buffers_kept`); from 2.15 allocated just before each receive
  and handed to the micro-batch's compute, so that an input's buffer is what the micro-batch
  in flight keeps and an output gradient's lives through one backward;
* :func:`stage_outputs_kept`: a non-last stage's output lives in the stage's forward cache
  until its micro-batch's backward (torch 2.15 lets go of it once sent:
  :func:`stage_outputs_released`), while a non-first stage's first block saves its input,
  which is the receive buffer;
* :func:`norm_kept_bytes`: what one norm saves for backward, the part of a block torch's
  ``SequenceParallel`` norms split over the sequence (the matrices' inputs are gathered whole
  again before the column-parallel projections save them).

Under sequence parallelism the stages pass their local ``seq / tensor`` tokens
(:class:`~memfit.distributed.pipeline.StageModule`), so the first two shrink by the tensor
degree as well: the caller passes the block input at the local token count.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from typing import Any

__all__ = [
    "gradient_buffer_bytes",
    "norm_kept_bytes",
    "receive_buffer_bytes",
    "receive_buffers_kept",
    "stage_outputs_kept",
    "stage_outputs_released",
]


@functools.cache
def receive_buffers_kept() -> bool:
    """Whether the installed torch's ``PipelineStage`` makes every micro-batch's receive
    buffers at its first step and keeps them (torch 2.13, 2.14), rather than allocating each
    just before its receive and handing it to the micro-batch's compute (torch 2.15's
    ``torch/distributed/pipelining/_recv_buffers.py``, whose ``_RecvInfo.buffer`` is ``None``
    between steps). Read off torch itself: the module that 2.15 moved the buffers into."""
    return importlib.util.find_spec("torch.distributed.pipelining._recv_buffers") is None


@functools.cache
def stage_outputs_released() -> bool:
    """Whether the installed torch's ``PipelineStage`` lets go of a stage's output once its
    send to the next stage's rank is done, keeping only its gradient edge for the backward
    (torch 2.15's ``release_fwd_send_outputs``; not for DDP-wrapped stages, whose reducer
    needs the outputs, nor DTensor outputs), rather than caching it until the micro-batch's
    backward (2.13, 2.14)."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    return hasattr(_PipelineStageBase, "release_fwd_send_outputs")


def receive_buffer_bytes(config: Any, rank: int, microbatches: int, stage_input: float) -> int:
    """torch's receive buffers on pipeline rank ``rank``, kept for the run: per local stage and
    micro-batch one block input from the previous stage and one output gradient from the next;
    0 where the installed torch allocates them per receive (:func:`receive_buffers_kept`: the
    input's buffer is then the first block's saved input, and the gradient's a transient of
    the backward, both counted there).

    Args:
        config: The :class:`~memfit.distributed.pipeline_plan.PipelineConfig`.
        rank: The pipeline rank.
        microbatches: Micro-batches per step.
        stage_input: Bytes of one micro-batch's block input as the stages pass it.
    """
    if not receive_buffers_kept():
        return 0
    last = config.num_stages - 1
    ends = sum((s > 0) + (s < last) for s in config.stage_indices(rank))
    return int(ends * microbatches * stage_input)


def stage_outputs_kept(ends: tuple[bool, bool], ddp: bool = False) -> int:
    """Block inputs a micro-batch in flight adds to a rank beyond its blocks' saved tensors,
    per local stage on average. Where torch keeps the receive buffers for the run
    (:func:`receive_buffers_kept`): one on the rank holding the first stage (its output,
    cached until backward), none in the middle (the output cached, the first block's saved
    input the receive buffer, counted with the buffers), one fewer on the last (no output
    sent; the input is the buffer). Where torch makes them per receive (2.15), the first
    block's saved input is the micro-batch's own buffer, counted with the blocks: one on every
    rank but the last's (the output cached until backward), and none once torch lets go of
    the sent outputs (:func:`stage_outputs_released`, 2.15; not under DDP).

    Args:
        ends: Whether the rank holds the first stage, and the last.
        ddp: Whether the stages are DDP's (data replicas without sharding).
    """
    first, last = ends
    if not receive_buffers_kept():
        return 0 if stage_outputs_released() and not ddp else int(not last)
    return int(first) - int(last)


def gradient_buffer_bytes(ends: tuple[bool, bool], stage_input: float) -> int:
    """What a backward adds on a rank for the output gradient it receives, where torch makes
    the buffer at the receive (2.15): one block input's bytes, but on the last stage's rank
    (its gradient comes from the loss); 0 where the buffers are kept for the run, counted by
    :func:`receive_buffer_bytes`.

    Args:
        ends: Whether the rank holds the first stage, and the last.
        stage_input: Bytes of one micro-batch's block input as the stages pass it.
    """
    if receive_buffers_kept() or ends[1]:
        return 0
    return int(stage_input)


def norm_kept_bytes(model: Any, seq_len: int, dtype: str) -> int:
    """Bytes the model's final norm saves for backward for one sample of ``seq_len`` tokens
    (every block's two norms are its like), run on ``model``'s own norm under autocast to
    ``dtype``; 0 for a model without one where memfit looks (Llama's ``model.norm``,
    GPT-2's ``transformer.ln_f``). What a norm saves is linear in the tokens (its input and a
    statistic per token), so it runs at one and two tokens and extends the line: at 128k
    tokens a real run would allocate and normalise gigabytes."""
    norm = getattr(getattr(model, "model", None), "norm", None) or getattr(
        getattr(model, "transformer", None), "ln_f", None)
    if norm is None:
        return 0
    one, two = _norm_saved(norm, 1, dtype), _norm_saved(norm, 2, dtype)
    return one + (two - one) * (seq_len - 1)


def _norm_saved(norm: Any, tokens: int, dtype: str) -> int:
    """Bytes ``norm`` saves for backward on one sample of ``tokens`` tokens."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in norm.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    x = torch.zeros(1, tokens, norm.weight.shape[-1], requires_grad=True)
    autocast = (torch.autocast("cpu", dtype=getattr(torch, dtype))
                if dtype in ("bfloat16", "float16") else contextlib.nullcontext())
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        norm(x)
    return sum(seen.values())
