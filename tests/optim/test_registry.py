"""The optimizer registry: every optimizer's predicted state bytes against its real state after
a step, how names are read, the sentence for an unknown one, and a user's own optimizer named
in a plan."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit.optim import AdamW8bit, registry, state_bytes
from memfit.optim.config import OptimizerConfig
from memfit.optim.registry import OptimizerSpec
from memfit.optim.state_size import StateSize, per_tensor
from memfit.plan import Plan, PlanError


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    """Tensors of every kind a state rule tells apart: an 8192-element table (quantised by
    every 8-bit optimizer), a 4224-element matrix (over the 4096-element threshold but not whole
    256-element blocks: memfit pads it, bitsandbytes does not, torchao keeps it in fp32), a 3-D
    convolution weight (Adafactor factors its last dimension), vectors under every threshold."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(64, 128),
        nn.Linear(128, 33),
        nn.LayerNorm(33),
        nn.Conv1d(33, 8, 3),
    ).to(dtype)


def _stepped(spec: OptimizerSpec, settings: dict[str, Any], dtype: torch.dtype):
    model = _model(dtype)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    optimizer = spec.build(params, **settings)
    optimizer.step()
    return params, optimizer


def _needs(spec: OptimizerSpec) -> None:
    if spec.package is not None and importlib.util.find_spec(spec.package) is None:
        pytest.skip(f"{spec.package} is not installed: {spec.name} cannot be stepped here")


# torchao's step is torch.compile'd: inductor starts compile workers and a C++ compiler.
_COMPILED = {"torchao-adamw8bit"}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=[pytest.mark.slow, pytest.mark.subprocess]) if n in _COMPILED else n
        for n in registry.names()
    ],
)
def test_predicted_state_bytes_are_the_real_ones_after_a_step(name: str) -> None:
    spec = registry.get(name)
    _needs(spec)
    params, optimizer = _stepped(spec, {}, torch.float32)
    assert spec.state_bytes(params) == state_bytes(optimizer)
    assert state_bytes(optimizer) > 0 or name == "sgd"  # torch's SGD: no momentum, no state


@pytest.mark.parametrize(
    ("name", "settings", "dtype"),
    [
        ("sgd", {"momentum": 0.9}, torch.float32),  # one buffer of the parameter's dtype
        ("sgd", {"momentum": 0.9}, torch.bfloat16),
        ("adam", {"amsgrad": True}, torch.float32),
        ("adamw", {}, torch.bfloat16),  # torch's moments follow the parameter's dtype
        ("adamw", {"foreach": True}, torch.float32),
        ("adamw8bit", {"min_8bit_size": 1024, "block_size": 64}, torch.float32),
        ("adamw8bit", {}, torch.bfloat16),  # fp32 moments below the threshold
        ("adafactor", {"beta1": 0.9}, torch.float32),
        ("adafactor", {}, torch.bfloat16),
        ("lamb", {}, torch.bfloat16),
        ("lars", {"momentum": 0.0}, torch.float32),
        ("lars", {}, torch.bfloat16),
        ("onebit-adam", {"warmup_steps": 1}, torch.bfloat16),
        ("bnb-adamw8bit", {"min_8bit_size": 5000}, torch.float32),
    ],
)
def test_predicted_state_bytes_follow_settings_and_dtype(
    name: str, settings: dict[str, Any], dtype: torch.dtype
) -> None:
    spec = registry.get(name)
    _needs(spec)
    params, optimizer = _stepped(spec, settings, dtype)
    assert spec.state_bytes(params, settings) == state_bytes(optimizer)


@pytest.mark.parametrize("name", registry.names())
def test_the_estimators_rule_is_the_state_of_a_large_matrix(name: str) -> None:
    # The per-parameter figure the cost models use leaves out per-tensor scalars, block maxima
    # and factored statistics: within 0.05 bytes of the exact state of a 1024 x 1024 matrix.
    spec = registry.get(name)
    big = torch.empty(1024, 1024, device="meta")
    exact = spec.state_bytes([big]) / big.numel()
    assert spec.bytes_per_parameter() == pytest.approx(exact, abs=0.05)


def test_sgd_keeps_state_only_with_momentum() -> None:
    sgd = registry.get("sgd")
    # memfit's default SGD is torch's: momentum 0, so nothing is kept.
    assert OptimizerConfig(name="sgd").kwargs == {}
    assert sgd.bytes_per_parameter() == 0.0
    assert sgd.bytes_per_parameter({"momentum": 0.9}) == 4.0
    assert sgd.bytes_per_parameter({"momentum": 0.9}, torch.bfloat16) == 2.0


def test_peers_build_their_stand_in_under_fake_tensors() -> None:
    # A dry run plans with memfit's AdamW8bit in the same layout: no peer library needed.
    with FakeTensorMode():
        params = [nn.Parameter(torch.zeros(64, 128))]
        for name in ("bnb-adamw8bit", "bnb-paged-adamw8bit", "torchao-adamw8bit"):
            opt = registry.get(name).build(params, lr=1e-3)
            assert type(opt) is AdamW8bit
            assert opt.param_groups[0]["min_8bit_size"] == 4096


@pytest.mark.subprocess
def test_importing_memfit_imports_no_peer_library() -> None:
    code = (
        "import sys, memfit, memfit.planner, memfit.estimate\n"
        "from memfit.optim import registry\n"
        "[registry.get(n) for n in registry.names()]\n"
        "print(sorted(m for m in ('bitsandbytes', 'torchao') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"



# --------------------------------------------------------------------------- names
@pytest.mark.parametrize(
    ("spelling", "canonical"),
    [
        ("AdamW_8bit", "adamw8bit"),
        ("onebitadam", "onebit-adam"),
        ("OneBit_Adam", "onebit-adam"),
        (" SGD ", "sgd"),
        ("BNB_AdamW8bit", "bnb-adamw8bit"),
        ("torchao_adamw_8bit", "torchao-adamw8bit"),
    ],
)
def test_aliases_normalise_to_the_canonical_name(spelling: str, canonical: str) -> None:
    assert registry.get(spelling).name == canonical
    assert OptimizerConfig(name=spelling).name == canonical
    plan = Plan(optimizer=spelling)
    assert plan.optimizer.name == canonical
    assert Plan.from_dict(plan.to_dict()).optimizer.name == canonical


def test_names_are_the_canonical_ones_in_order() -> None:
    names = registry.names()
    assert names[:3] == ("adamw", "adam", "sgd")
    assert "onebit-adam" in names and "onebitadam" not in names
    assert [s.name for s in registry.specs()] == list(names)


def test_an_unknown_name_is_one_sentence_naming_the_known_ones() -> None:
    with pytest.raises(ValueError) as info:
        registry.get("rmsprop")
    message = str(info.value)
    assert message.startswith("optimizer 'rmsprop' is not known; use one of ")
    assert "\n" not in message
    for name in registry.names():
        assert repr(name) in message
    with pytest.raises(ValueError, match="optimizer 'rmsprop' is not known"):
        Plan(optimizer="rmsprop")


def test_zero_stages_follow_the_registry() -> None:
    for stage in (1, 3):
        with pytest.raises(PlanError, match=rf"'torchao-adamw8bit'.*stage {stage}.*stage 0 only"):
            Plan(parallel={"data": 2, "zero_stage": stage}, optimizer="torchao-adamw8bit")
    with pytest.raises(PlanError, match=r"'onebit-adam'.*stage 0 only"):
        Plan(parallel={"data": 2, "zero_stage": 1}, optimizer="onebitadam")
    Plan(parallel={"data": 2, "zero_stage": 3}, optimizer="adamw8bit")


# --------------------------------------------------------------------------- a user's own
class SignSGD(torch.optim.Optimizer):
    """signSGD with momentum (Bernstein et al.): one fp32 buffer per parameter."""

    def __init__(self, params: Any, lr: float = 1e-3, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("buf", torch.zeros_like(p, dtype=torch.float32))
                buf.mul_(group["beta"]).add_(p.grad, alpha=1 - group["beta"])
                p.add_(buf.sign().to(p.dtype), alpha=-group["lr"])


@pytest.fixture
def signsgd() -> Iterator[OptimizerSpec]:
    spec = registry.register(
        OptimizerSpec(
            name="sign-sgd",
            aliases=("signum",),
            load=lambda: SignSGD,
            state=StateSize(per_tensor(lambda p, s: 4 * p.numel()), lambda s, dtype: 4.0),
            step_bytes=20.0,
            zero_stage1=False,
        )
    )
    yield spec
    registry.unregister("sign-sgd")


def test_a_registered_optimizer_is_named_in_a_plan_and_built(signsgd: OptimizerSpec) -> None:
    from memfit.train import prepare

    plan = Plan(optimizer={"name": "Signum", "lr": 0.01, "kwargs": {"beta": 0.5}})
    assert plan.optimizer.name == "sign-sgd"
    assert Plan.from_dict(plan.to_dict()) == plan
    model = nn.Linear(8, 4)
    before = model.weight.detach().clone()
    prepared = prepare(model, plan, loss_fn=lambda out, batch: out.square().mean())
    assert type(prepared.optimizer) is SignSGD
    prepared.step(torch.randn(16, 8))
    # Every weight moved by exactly the learning rate (the sign of its momentum).
    moved = (model.weight.detach() - before).abs()
    torch.testing.assert_close(moved, torch.full_like(moved, 0.01))
    assert signsgd.state_bytes(list(model.parameters())) == state_bytes(prepared.optimizer)
    with pytest.raises(PlanError, match=r"'sign-sgd' cannot run at ZeRO stage 1.*stages 0, 2, 3"):
        Plan(parallel={"data": 2, "zero_stage": 1}, optimizer="signum")


def test_a_registered_optimizer_is_costed_from_its_record(
    signsgd: OptimizerSpec, tmp_path: Any
) -> None:
    from memfit.estimate.cost import WorkloadProfile, step_cost
    from memfit.targets import DeviceProfile

    profile = WorkloadProfile(1e12, 2e12, 0.8e12, 1e9, 1000, 600, 100_000_000, 200, 128)
    device = DeviceProfile(name="test", memory_bytes=2**36, flops={"fp32": 1e14},
                           mem_bandwidth=2e12, host_bandwidth=5e10, host_mem_bandwidth=1e11,
                           disk_bandwidth=1e9, launch_overhead=1e-5, half_tokens=128.0)
    plan = Plan(optimizer="sign-sgd")
    # Its step: its step bytes at bandwidth, and a launch per op per tensor (no foreach).
    cost = step_cost(profile, plan, device, batch_size=8)
    assert cost.optimizer == pytest.approx(1e8 * 20 / 2e12 + 200 * 10 * 1e-5)
    # On disk: its masters and state (4 + 4 bytes) read and written each step, at disk speed,
    # slower here than the host step (24 bytes at host memory bandwidth).
    on_disk = plan.replace(offload={"optimizer": "disk", "disk_dir": str(tmp_path)})
    assert signsgd.host_step_bytes() == 24.0
    assert 2 * 1e8 * 8 / 1e9 > 1e8 * 24 / 1e11
    off = step_cost(profile, on_disk, device, batch_size=8)
    host = step_cost(profile, plan.replace(offload={"optimizer": "host"}), device, batch_size=8)
    assert off.offload - host.offload == pytest.approx(2 * 1e8 * 8 / 1e9 - 1e8 * 24 / 1e11)


def test_a_taken_name_is_refused(signsgd: OptimizerSpec) -> None:
    with pytest.raises(ValueError, match="taken by 'sign-sgd'"):
        registry.register(OptimizerSpec(name="SIGNUM".lower(), load=lambda: SignSGD,
                                        state=signsgd.state))
    with pytest.raises(ValueError, match="taken by 'adamw'"):
        registry.register(OptimizerSpec(name="adam-w", load=lambda: SignSGD, state=signsgd.state))
