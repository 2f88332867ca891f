"""The strategy ladder: the published BERT-large fine-tuning ladder, reproduced and extended.

Each row is a :class:`~memfit.plan.Plan`. Its peak is measured by a dry run at full scale
(fake tensors, category by category) for a target device; its relative compute cost is measured
on this CPU at a reduced scale (fewer layers, shorter sequences) in the same run, as a ratio to
the baseline's step time, so recomputation and micro-batching both show. For a GPU target the
rows add what that GPU would hold (the caching allocator's reserved peak and the device total
with the CUDA context) and the cost model's compute ratio on that GPU.

For a causal LM (a model the fused loss applies to), the ladder adds the fused-loss rungs and
a column with the bytes of the fp32 logits and their gradient for one micro-batch (one chunk
of them under the fused loss) and their share of the row's peak.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..plan import Plan
from ..targets import DeviceProfile
from ..workload import Workload, load_workload

__all__ = ["LadderRow", "ladder_plans", "run_ladder"]

# The published ladder (chinese-macbert-large, one GPU): GPU memory in GB and time in s.
PUBLISHED = {
    "baseline": (15.1, 44),
    "+ gradient accumulation": (7.5, 122),
    "+ gradient checkpointing": (7.3, 461),
    "+ Adafactor": (5.5, 455),
    "+ freeze body": (3.5, 119),
    "+ max length 64": (3.4, 110),
}


@dataclass
class LadderRow:
    """One rung: a named plan, its measured peak and its relative compute."""

    name: str
    plan: Plan
    peak_bytes: int = 0
    peak_by_category: dict[str, int] | None = None
    compute_ratio: float = 0.0
    step_seconds: float = 0.0
    published: tuple[float, float] | None = None
    target_device: str = "cpu"
    peak_reserved_bytes: int = 0
    device_total_bytes: int = 0
    predicted_compute_ratio: float | None = None
    logits_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The JSON row: ``name``, ``plan``, ``peak_bytes``, ``peak_by_category``,
        ``compute_ratio`` (CPU-measured), ``target_device``, ``peak_reserved_bytes``,
        ``device_total_bytes``, ``predicted_compute_ratio`` (cost model on the target; ``None``
        for the CPU), ``logits_bytes`` (fp32 logits and their gradient of one micro-batch, one
        chunk of them under the fused loss; 0 for models without a language-model head) and the
        published figures where there are any."""
        out: dict[str, Any] = {
            "name": self.name,
            "plan": self.plan.to_dict(),
            "target_device": self.target_device,
            "peak_bytes": self.peak_bytes,
            "peak_by_category": self.peak_by_category,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "device_total_bytes": self.device_total_bytes,
            "compute_ratio": self.compute_ratio,
            "predicted_compute_ratio": self.predicted_compute_ratio,
            "step_seconds_reduced_scale": self.step_seconds,
            "logits_bytes": self.logits_bytes,
        }
        if self.published:
            out["published_gpu_gb"], out["published_seconds"] = self.published
        return out


def ladder_plans(
    batch_size: int = 32, short_seq: int = 64, *, causal_lm: bool = False
) -> list[tuple[str, Plan]]:
    """The rungs: the published ladder, then each technique it lacks on the baseline, then
    the best full fine-tune (no freezing, full length, the same effective batch); for a
    ``causal_lm``, the fused loss on the baseline and on the best full fine-tune."""
    # torch's AdamW runs multi-tensor (foreach) by default on a GPU, as in the published runs;
    # on a CPU its default is the per-tensor loop, so the ladder names it explicitly.
    adamw = {"name": "adamw", "foreach": True}
    accum = {"micro_batch_size": 1, "grad_accum_steps": batch_size, "optimizer": adamw}
    accum_af = {**accum, "optimizer": "adafactor"}
    published = [
        ("baseline", Plan(optimizer=adamw)),
        ("+ gradient accumulation", Plan(**accum)),
        ("+ gradient checkpointing", Plan(**accum, checkpointing="full")),
        ("+ Adafactor", Plan(**accum_af, checkpointing="full")),
        (
            "+ freeze body",
            Plan(**accum_af, checkpointing="full", freeze=("body",)),
        ),
        (
            "+ max length 64",
            Plan(**accum_af, checkpointing="full", freeze=("body",), max_seq_len=short_seq),
        ),
    ]
    best = Plan(
        precision="bf16-pure",
        optimizer="adafactor",
        optimizer_in_backward=True,
        checkpointing="full",
    )
    extra = [
        # The state and the step's temporaries only matter where the peak is at the step:
        # after accumulation has removed the activations.
        (
            "accumulation + foreach off",
            Plan(**{**accum, "optimizer": {"name": "adamw", "foreach": False}}),
        ),
        ("accumulation + 8-bit AdamW", Plan(**{**accum, "optimizer": "adamw8bit"})),
        ("baseline + fused optimizer step", Plan(optimizer=adamw, optimizer_in_backward=True)),
        ("baseline + bf16-mixed", Plan(optimizer=adamw, precision="bf16-mixed")),
        ("baseline + bf16-pure", Plan(optimizer=adamw, precision="bf16-pure")),
        ("baseline + selective checkpointing", Plan(optimizer=adamw, checkpointing="selective")),
        ("best full fine-tune", best),
    ]
    if causal_lm:
        extra += [
            ("baseline + fused loss", Plan(optimizer=adamw, fused_loss=True)),
            ("best full fine-tune + fused loss", best.replace(fused_loss=True)),
        ]
    return published + extra + offload_plans(batch_size) + fusion_plans()


def offload_plans(batch_size: int = 32) -> list[tuple[str, Plan]]:
    """The offload rungs: the optimizer on the host (ZeRO-Offload) under accumulation, and
    the most frugal full fine-tune with it: bf16 weights on the device beside fp32 masters on
    the host, one sample per micro-batch, every block checkpointed, each micro-batch's
    gradients leaving the device at once; then with the blocks' parameters streamed from the
    host too (ZeRO-Infinity on one device)."""
    adamw = {"name": "adamw", "foreach": True}
    accum = {"micro_batch_size": 1, "grad_accum_steps": batch_size, "optimizer": adamw}
    host = {"optimizer": "host", "gradients_on_host": True}
    return [
        ("accumulation + optimizer offload", Plan(**accum, offload=host)),
        (
            "best full fine-tune + optimizer offload",
            Plan(**accum, precision="bf16-pure", checkpointing="full", offload=host),
        ),
        (
            "best full fine-tune + parameter offload",
            Plan(
                **accum,
                precision="bf16-pure",
                checkpointing="full",
                offload={**host, "parameters": "host"},
            ),
        ),
    ]


def fusion_plans() -> list[tuple[str, Plan]]:
    """The fusion rungs: each fusion on the baseline, then on the best full fine-tune. A rung
    whose fusion the model has nothing for (fused pointwise on BERT) is left out of a run."""
    adamw = {"name": "adamw", "foreach": True}
    best = {
        "precision": "bf16-pure",
        "optimizer": "adafactor",
        "optimizer_in_backward": True,
        "checkpointing": "full",
    }
    return [
        ("baseline + fused pointwise", Plan(optimizer=adamw, fused_pointwise=True)),
        ("baseline + compiled", Plan(optimizer=adamw, compile=True)),
        ("best full fine-tune + fused pointwise", Plan(**best, fused_pointwise=True)),
    ]


def _applies(workload: Workload, plan: Plan) -> bool:
    """Whether ``plan`` can be applied to ``workload``'s model (checked on fake tensors)."""
    from ..apply.compose import apply_plan
    from ..estimate.fake_kernels import dry_tensors

    with dry_tensors():
        model = workload.build_model()
        try:
            apply_plan(model, plan).remove()
        except ValueError:
            return False
    return True


def _peak(workload: Workload, plan: Plan, device: DeviceProfile) -> dict[str, Any]:
    """Full-scale peak on ``device`` from a dry run (:class:`memfit.estimate.predictor.DryRun`:
    two micro-batches at most, the inputs scaled back to the whole batch)."""
    from ..estimate.predictor import DryRun

    pred = DryRun().predict(workload, plan, device)
    return {
        "peak_bytes": pred.peak_bytes,
        "peak_by_category": dict(pred.by_category),
        "peak_reserved_bytes": pred.reserved_bytes,
        "device_total_bytes": pred.device_total_bytes,
    }


def _step_time(workload: Workload, plan: Plan, steps: int) -> float:
    from ..estimate.dryrun import measure

    if plan.optimizer.foreach is not None:
        # foreach is a GPU speed feature; torch's CPU kernels for it are slower than the
        # per-tensor loop, so CPU timing uses torch's CPU default for every rung.
        plan = plan.replace(optimizer=dataclasses.replace(plan.optimizer, foreach=None))

    # measure() runs real steps; time them (warm-up step excluded) in CPU seconds of this
    # process on one thread, so other jobs on the machine barely move the ratios.
    times: list[float] = []
    last = [time.process_time()]

    def tick(done: int, total: int) -> None:
        now = time.process_time()
        if done > 1:
            times.append(now - last[0])
        last[0] = now

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        if plan.compile_backend is not None:
            # Under the tracker's dispatch mode dynamo runs the model eagerly: time the
            # compiled step without it (the warm-up step compiles).
            _time_untracked(workload, plan, steps + 1, tick)
        else:
            measure(workload, plan, steps=steps + 1, progress=tick)
    finally:
        torch.set_num_threads(threads)
    return min(times)


def _time_untracked(
    workload: Workload, plan: Plan, steps: int, tick: Callable[[int, int], None]
) -> None:
    import torch._dynamo

    from ..apply.compose import apply_plan

    model, batch = workload.build(seed=0)
    torch._dynamo.reset()
    setup = apply_plan(model, plan, loss_fn=workload.loss_fn)
    try:
        for i in range(steps):
            setup.step(batch)
            tick(i + 1, steps)
    finally:
        setup.remove()
        torch._dynamo.reset()


def run_ladder(
    model: str = "bert-large",
    *,
    batch_size: int = 32,
    seq_len: int = 128,
    short_seq: int = 64,
    compute_depth: int = 2,
    compute_seq: int = 32,
    compute_steps: int = 2,
    device: str | DeviceProfile | None = "cpu",
    progress: Callable[[str], None] | None = None,
    only: Sequence[str] | None = None,
) -> list[LadderRow]:
    """Measure every rung.

    Args:
        model: Workload SPEC (a preset with a depth knob for the reduced compute scale).
        batch_size: Effective batch.
        seq_len: Sequence length.
        short_seq: The shortened length of the last published rung.
        compute_depth: Blocks of the reduced model whose step time is measured.
        compute_seq: Sequence length of the reduced model (the batch stays the same, so
            micro-batching shows).
        compute_steps: Timed steps per rung (after one warm-up step).
        device: The target whose memory the dry runs reproduce (a profile name, a custom
            description or a profile; ``None`` is this machine). For a GPU target each row
            also gets the cost model's compute ratio on it.
        progress: Called with the rung's name as it starts.
        only: Run only the rungs with these names (the baseline, the first rung, always runs:
            the compute ratios are relative to it).

    Raises:
        ValueError: when ``only`` names a rung that does not exist for this model.
    """
    from ..estimate.cost import profile_workload, step_cost
    from ..estimate.dryrun import plan_for_target
    from ..targets import get_device

    target = get_device(device)
    say = progress or (lambda msg: None)
    full = load_workload(model, batch_size, seq_len)
    small = full.with_depth(compute_depth) if full.scalable and full.with_depth else full
    small = small.replace(seq_len=min(compute_seq, seq_len))
    head = _lm_head(full)
    rungs = _for_target(ladder_plans(batch_size, short_seq, causal_lm=head is not None), target)
    if only is not None:
        names = [name for name, _ in rungs]
        for name in only:
            if name not in names:
                raise ValueError(
                    f"the ladder has no rung {name!r} for {model}; its rungs are "
                    f"{', '.join(names)}"
                )
        rungs = [r for i, r in enumerate(rungs) if i == 0 or r[0] in only]
    rows = []
    for name, plan in rungs:
        if (plan.fused_pointwise or plan.compile) and not _applies(small, plan):
            say(f"{name}: left out ({full.name} has nothing it fuses)")
            continue
        # The published figures are bert-large's (chinese-macbert-large): other models get none.
        published = PUBLISHED.get(name) if model == "bert-large" else None
        row = LadderRow(name, plan, published=published, target_device=target.name)
        if head is not None:
            row.logits_bytes = _logits_bytes(plan, batch_size, seq_len, *head)
        say(f"{name}: dry run at full scale for {target.name}")
        for key, value in _peak(full, plan, target).items():
            setattr(row, key, value)
        small_plan = plan
        if plan.max_seq_len is not None:
            # Keep the same proportion of the sequence at the reduced scale.
            small_plan = plan.replace(
                max_seq_len=max(1, small.seq_len * plan.max_seq_len // seq_len)
            )
        say(f"{name}: timing on this CPU at reduced scale")
        row.step_seconds = _step_time(small, small_plan, compute_steps)
        rows.append(row)
    base = rows[0].step_seconds
    for row in rows:
        row.compute_ratio = row.step_seconds / base
    if target.is_cuda:
        say(f"costing the rungs on {target.name}")
        profile = profile_workload(full)

        def cost(plan: Plan) -> float:
            # Freezing trains fewer parameters; the cost model takes that as a fraction.
            frac = _trainable_fraction(full, plan) if plan.freeze else 1.0
            resolved = plan_for_target(plan, target)
            return step_cost(
                profile, resolved, target, batch_size=batch_size, trainable_fraction=frac
            ).total

        base_cost = cost(rows[0].plan)
        for row in rows:
            row.predicted_compute_ratio = cost(row.plan) / base_cost
    return rows


def _for_target(rungs: list[tuple[str, Plan]], target: DeviceProfile) -> list[tuple[str, Plan]]:
    """The rungs a target can run: without bf16 (T4), mixed precision is fp16 and the
    bf16-pure rungs are left out (there is no fp16-pure plan)."""
    if target.supports_bf16:
        return rungs
    out = []
    for name, plan in rungs:
        if plan.precision.mode == "bf16-pure":
            continue
        if plan.precision.mode == "bf16-mixed":
            plan = plan.replace(precision="fp16-mixed")
            name = name.replace("bf16-mixed", "fp16-mixed")
        out.append((name, plan))
    return out


def _lm_head(workload: Workload) -> tuple[int, int] | None:
    """(hidden, vocabulary) of the output head when the fused loss applies to the model."""
    from ..estimate.fake_kernels import dry_tensors
    from ..strategies.fused_loss import fused_loss_applies

    with dry_tensors():
        if not fused_loss_applies(workload):
            return None
        head = workload.build_model().get_output_embeddings()
        return head.in_features, head.out_features


def _logits_bytes(plan: Plan, batch_size: int, seq_len: int, hidden: int, vocab: int) -> int:
    """fp32 logits and their gradient of one micro-batch (one chunk of them when fused)."""
    from ..ops import auto_chunk_size

    tokens = plan.micro_batch_for(batch_size) * min(plan.max_seq_len or seq_len, seq_len)
    if plan.fused_loss is not None:
        tokens = plan.fused_loss.chunk_size or auto_chunk_size(tokens, hidden, vocab)
    return 2 * tokens * vocab * 4


def _trainable_fraction(workload: Workload, plan: Plan) -> float:
    from ..estimate.fake_kernels import dry_tensors
    from ..strategies.freezing import apply_freezing

    with dry_tensors():
        model = workload.build_model()
        total = sum(p.numel() for p in model.parameters())
        apply_freezing(model, plan.freeze)
        return sum(p.numel() for p in model.parameters() if p.requires_grad) / total


def _cells(row: LadderRow, gpu: bool, logits: bool = False) -> list[str]:
    from ..units import format_bytes

    cats = row.peak_by_category or {}
    main = ("parameters", "gradients", "optimizer_state", "activations")
    other = sum(v for k, v in cats.items() if k not in main)
    cells = [row.name, format_bytes(row.peak_bytes)]
    if gpu:
        cells += [format_bytes(row.peak_reserved_bytes), format_bytes(row.device_total_bytes)]
    cells += [format_bytes(cats.get(k, 0)) for k in main] + [format_bytes(other)]
    if logits:
        share = row.logits_bytes / row.peak_bytes if row.peak_bytes else 0.0
        cells.append(f"{format_bytes(row.logits_bytes)} ({share:.0%})")
    cells.append(f"{row.compute_ratio:.2f}x")
    if gpu:
        cells.append(f"{row.predicted_compute_ratio or 0.0:.2f}x")
    cells.append(f"{row.published[0]} GB, {row.published[1]} s" if row.published else "")
    return cells


def _headers(rows: list[LadderRow]) -> tuple[list[str], bool, bool]:
    gpu = any(row.predicted_compute_ratio is not None for row in rows)
    logits = any(row.logits_bytes for row in rows)
    device = rows[0].target_device if rows else "cpu"
    headers = ["strategy", "peak" if not gpu else "allocated"]
    if gpu:
        headers += ["reserved", "device total"]
    headers += ["params", "grads", "state", "activations", "other"]
    if logits:
        headers.append("fp32 logits + grad (share)")
    headers.append("compute (CPU)")
    if gpu:
        headers.append(f"compute ({device}, model)")
    headers.append("published GPU")
    return headers, gpu, logits


def ladder_table(rows: list[LadderRow]) -> Any:
    """A rich table of the rungs."""
    from rich.table import Table

    headers, gpu, logits = _headers(rows)
    device = rows[0].target_device if rows else "cpu"
    table = Table(
        title=f"Strategy ladder for {device} (dry run at full scale; compute measured on CPU)"
    )
    for i, name in enumerate(headers):
        table.add_column(name, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*_cells(row, gpu, logits))
    return table


def ladder_markdown(rows: list[LadderRow]) -> str:
    """The same table as Markdown, for the README."""
    headers, gpu, logits = _headers(rows)
    lines = ["| " + " | ".join(headers) + " |", "|---|" + "---:|" * (len(headers) - 1)]
    lines += ["| " + " | ".join(_cells(row, gpu, logits)) + " |" for row in rows]
    return "\n".join(lines)
