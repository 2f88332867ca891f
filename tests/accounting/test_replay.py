"""A replayed stretch of events leaves the tracker as dispatching it again would."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import memfit
from memfit.accounting import replay


def _update(x: torch.Tensor) -> None:
    # Temporaries of three sizes, one freed before the next is made, one op allocating nothing.
    a = x.square()
    b = torch.cat([a, a])
    del a
    c = b.sum(dim=0)
    x.add_(c.mean())


def _run(use_replay: bool, inner=_update) -> tuple[object, int]:
    replayed = 0
    with FakeTensorMode():
        keep = []
        with memfit.track() as tr:
            xs = [torch.empty(64, 32) for _ in range(4)]  # known to the tracker
            for i, x in enumerate(xs):
                keep.append(torch.empty(16 * (i + 1)))  # live memory differs at each update
                rec = replay.begin(("update", tuple(x.shape))) if use_replay else None
                if rec is not None and rec.replay():
                    replayed += 1
                    continue
                inner(x)
                if rec is not None:
                    rec.finish()
    return tr.report(), replayed


def test_replay_equals_dispatch_event_for_event():
    dispatched, _ = _run(False)
    replayed, n = _run(True)
    assert n == 3  # the first update is dispatched and recorded, the other three replayed
    assert replayed.peak_bytes == dispatched.peak_bytes
    assert replayed.peak_by_category == dispatched.peak_by_category
    assert replayed.num_ops == dispatched.num_ops
    assert replayed.timeline == dispatched.timeline
    assert replayed.peak_op == dispatched.peak_op


def test_a_stretch_that_keeps_what_it_made_is_not_replayed():
    kept = []

    def leaky(x: torch.Tensor) -> None:
        kept.append(x.square())  # outlives the update

    dispatched, _ = _run(False, leaky)
    replayed, n = _run(True, leaky)
    assert n == 0
    assert replayed.timeline == dispatched.timeline


def test_no_replay_under_two_trackers():
    with FakeTensorMode(), memfit.track(), memfit.track():
        assert replay.begin("k") is None


def test_a_stretch_that_relabels_older_storage_is_not_replayed():
    def relabel(x: torch.Tensor) -> None:
        x.square()
        memfit.accounting.tracker.label_open(x, "optimizer_state")  # an older storage's role

    dispatched, _ = _run(False, relabel)
    replayed, n = _run(True, relabel)
    assert n == 0
    assert replayed.peak_by_category == dispatched.peak_by_category
