"""Prediction and confirmation: a candidate's memory on the target, and the budget check.

:func:`probe` rules a candidate out by its full-depth first forward, when that alone passes
the budget (cheapest); :func:`predict` composes the candidate's peak from two shallow dry
runs, or a floor when the deeper run shows the budget passed (cheap); :func:`confirm` checks
it at full depth before it is returned (its full-depth trace built from the shallow runs',
else a full-depth dry run; two micro-batches stand for all). All compare with the budget as
:func:`fits` does, the planner's one budget check.
"""

from __future__ import annotations

from ..estimate.compose import confirm_peak, first_forward_peak
from ..estimate.prediction import Prediction
from ..estimate.predictor import Composed
from ..targets import DeviceProfile
from ..workload import Workload
from .result import Candidate

__all__ = ["confirm", "fits", "predict", "probe", "record", "take"]


def fits(prediction: Prediction, budget_bytes: int, host_budget: int | None = None) -> bool:
    """Whether ``prediction`` fits ``budget_bytes``: the planner's one budget check.

    What must fit is what the target device holds, at the upper edge of its error band
    (:attr:`Prediction.upper_device_total_bytes`): on a GPU the caching allocator's reserved
    peak plus the CUDA context and workspaces, plus what real runs exceeded predictions by on
    the GPU harness; on the CPU the tensors' peak, exact. With a ``host_budget``, the host
    tier's peak (offload) must fit it too.
    """
    if prediction.upper_device_total_bytes > budget_bytes:
        return False
    return host_budget is None or prediction.host_bytes <= host_budget


def record(
    candidate: Candidate, prediction: Prediction, budget_bytes: int, host_budget: int | None = None
) -> bool:
    """Write ``prediction`` and its verdict into ``candidate``; return the verdict."""
    candidate.peak_bytes = prediction.peak_bytes
    candidate.by_category = dict(prediction.by_category)
    candidate.reserved_bytes = prediction.reserved_bytes
    candidate.device_total_bytes = prediction.device_total_bytes
    candidate.host_bytes = prediction.host_bytes
    candidate.fits = fits(prediction, budget_bytes, host_budget)
    candidate.host_misfit = not candidate.fits and fits(prediction, budget_bytes)
    return candidate.fits


def predict(
    candidate: Candidate,
    workload: Workload,
    device: DeviceProfile,
    budget_bytes: int,
    host_budget: int | None = None,
    *,
    floor: bool = True,
) -> bool:
    """Predict ``candidate``'s memory (composed from shallow dry runs where possible).

    With ``floor``, a run that shows the budget passed stops there, and the candidate's
    figures are that floor (``at_least``); without it (the most frugal candidates, whose
    figures the answer quotes when nothing fits), the prediction is always the peak.
    """
    predictor = Composed(budget_bytes=budget_bytes if floor else None)
    prediction = predictor.predict(workload, candidate.plan, device)
    return take(candidate, prediction, budget_bytes, host_budget)


def take(
    candidate: Candidate,
    prediction: Prediction,
    budget_bytes: int,
    host_budget: int | None = None,
) -> bool:
    """Make ``prediction`` (a :func:`~memfit.estimate.compose.predict_peak` of
    ``candidate``'s plan, however it was made) ``candidate``'s, with its verdict and a note
    of how it was made; return the verdict."""
    if prediction.method == "at-least":
        candidate.at_least = True
        candidate.note = (
            f"over the budget before the end of its run: at least {prediction.device_total_bytes} "
            "bytes (the depth-3 run stopped there)"
        )
        # Stopped at the first forward's end: the floor :func:`probe` finds (the same traces),
        # so it counts as one.
        candidate.probed = prediction.extra.get("stopped_at_forward") == 0
    else:
        candidate.note = f"{prediction.method}, peak in {prediction.peak_phase}"
    ok = record(candidate, prediction, budget_bytes, host_budget)
    # Only a candidate that fits is confirmed: its shallow runs' traces may spare that run.
    candidate.composed = prediction if ok else None
    return ok


def confirm(
    candidate: Candidate,
    workload: Workload,
    device: DeviceProfile,
    budget_bytes: int,
    host_budget: int | None = None,
) -> bool:
    """``candidate``'s figures at full depth (:func:`~memfit.estimate.compose.confirm_peak`:
    its full-depth trace, built from its prediction's shallow runs where it can be, else a
    full-depth dry run); they become the confirmed ones."""
    prediction = confirm_peak(workload, candidate.plan, candidate.composed, device=device)
    candidate.composed = None
    ok = record(candidate, prediction, budget_bytes, host_budget)
    how = (
        "the full-depth trace built from the shallow runs'"
        if prediction.method == "extended"
        else "a full-depth dry run"
    )
    candidate.note = (
        (candidate.note + "; " if candidate.note else "")
        + f"confirmed by {how}: {prediction.device_total_bytes} bytes"
    )
    return ok


def probe(
    candidate: Candidate, workload: Workload, device: DeviceProfile, budget_bytes: int
) -> bool:
    """Rule ``candidate`` out cheaply if it can be: whether the full-depth run already holds
    more than ``budget_bytes`` by the end of its first forward
    (:func:`~memfit.estimate.compose.first_forward_peak`, a few blocks' forward instead of a
    prediction's two training runs). If so, the candidate's fields hold that floor (marked
    ``at_least``) and its verdict; if not (or when the floor cannot be built), nothing is
    decided and the candidate is left to :func:`predict`."""
    floor = first_forward_peak(workload, candidate.plan, device=device)
    if floor is None:
        return False
    peak = sum(floor.values())
    total = peak + (device.overhead_bytes if device.is_cuda else 0)
    if total <= budget_bytes:
        return False
    candidate.peak_bytes = peak
    candidate.by_category = floor
    candidate.device_total_bytes = total
    candidate.fits = False
    candidate.at_least = candidate.probed = True
    candidate.note = (
        f"over the budget by the end of the first forward: at least {total} bytes (built "
        "from the depth-2 and depth-3 first forwards)"
    )
    return True
