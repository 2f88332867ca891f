"""Each --allow option is searched: with every other saving ruled out and a budget just under
the plain plan's peak, the winner is a plan that uses the allowed option."""

from __future__ import annotations

import pytest

import memfit
from memfit.planner import plan
from memfit.workload import load_workload

WORKLOAD = load_workload("gpt2-tiny", 4, 32)
FORBID = ("accumulation", "checkpointing", "mixed-precision", "fused-step", "foreach-off",
          "fused-loss")

USES = {
    "freeze": lambda p: bool(p.freeze),
    "shorter-seq": lambda p: p.max_seq_len is not None and p.max_seq_len < 32,
    "8bit": lambda p: p.optimizer.name == "adamw8bit",
    "factored": lambda p: p.optimizer.name == "adafactor",
    "bf16-pure": lambda p: p.precision.mode == "bf16-pure",
    "offload": lambda p: p.offload is not None,
}


@pytest.mark.slow
@pytest.mark.parametrize("option", sorted(USES))
def test_each_allowed_option_is_used_when_only_it_fits(option):
    plain = memfit.dry_run(WORKLOAD, memfit.Plan()).peak_bytes
    budget = int(plain * 0.95)
    result = plan(WORKLOAD, budget, allow=[option], forbid=FORBID, device="cpu")
    assert result.fits and result.predicted_device_total_bytes <= budget
    assert USES[option](result.plan), result.plan.summary()
    # Without the option nothing fits: the option is what made the difference.
    with pytest.raises(memfit.NothingFits):
        plan(WORKLOAD, budget, forbid=FORBID, device="cpu")
