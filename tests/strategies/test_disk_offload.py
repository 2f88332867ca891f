"""Optimizer offload to disk: the same parameters as the on-device optimizer; masters and state
in files, host memory within the window (as the tracker measures); bad directories and windows
refused before training; a crash mid write-back leaves the previous file whole, and a damaged
file is noticed."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

import memfit
from memfit.apply.compose import apply_plan
from memfit.strategies import disk_offload
from memfit.strategies.disk_offload import DiskOffloadOptimizer

from .test_optimizer_offload import Net


class Deep(torch.nn.Module):
    """Four (64, 64) layers between Net's first and last: more state than the window holds."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 64)
        self.hidden = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))
        self.c = torch.nn.Linear(64, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.a(x))
        for layer in self.hidden:
            h = torch.nn.functional.gelu(layer(h))
        return ((self.c(h) - y) ** 2).mean()


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _align(n: int) -> int:
    return -(-n // 64) * 64


def _adamw_footprint(p: torch.Tensor) -> int:
    """A parameter's file region with AdamW: fp32 master, two fp32 moments, the step scalar."""
    return 3 * _align(4 * p.numel()) + _align(4)


def _disk(tmp_path, **extra) -> dict:
    return {"optimizer": "disk", "disk_dir": str(tmp_path), **extra}


# The window for each optimizer: small enough that the step goes in several groups.
_WINDOWS = {"adamw": 2 * (3 * 64 * 64 * 4 + 64), "adamw8bit": 50_000, "adafactor": 40_000}


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit", "adafactor"])
@pytest.mark.parametrize("accum", [1, 4])
def test_parameters_equal_the_on_device_optimizer(tmp_path, optimizer, accum):
    torch.manual_seed(0)
    device_model = Net()
    disk_model = copy.deepcopy(device_model)
    common = dict(optimizer=optimizer, grad_accum_steps=accum, max_grad_norm=1.0)
    on_device = apply_plan(device_model, memfit.Plan(**common))
    window = _WINDOWS[optimizer]
    on_disk = apply_plan(disk_model, memfit.Plan(**common, offload=_disk(
        tmp_path, host_window_bytes=window)))  # fmt: skip
    opt = on_disk.optimizer
    assert type(opt) is DiskOffloadOptimizer
    for step in range(4):
        on_device.step(_batch(step))
        on_disk.step(_batch(step))
        assert len(opt.groups) >= 2  # the window really cuts the step into groups
        assert not opt.optimizer.state  # nothing of the state stays in host memory
    for p, q in zip(device_model.parameters(), disk_model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-6)
    # Every parameter's master and state are in its file; the step counts agree.
    state = opt.state_dict()["optimizer"]["state"]
    assert len(state) == 6 and all(int(s["step"]) == 4 for s in state.values())


def test_gradients_on_host_and_bf16_pure_masters(tmp_path):
    torch.manual_seed(0)
    host_model = Net()
    disk_model = copy.deepcopy(host_model)
    common = dict(grad_accum_steps=2, precision="bf16-pure")
    host = apply_plan(host_model, memfit.Plan(**common, offload={
        "optimizer": "host", "gradients_on_host": True}))  # fmt: skip
    disk = apply_plan(disk_model, memfit.Plan(**common, offload=_disk(
        tmp_path, gradients_on_host=True, host_window_bytes=_WINDOWS["adamw"])))  # fmt: skip
    for step in range(3):
        host.step(_batch(step))
        disk.step(_batch(step))
    assert disk.optimizer.transfers == host.optimizer.transfers
    for p, q in zip(host_model.parameters(), disk_model.parameters(), strict=True):
        assert q.dtype == torch.bfloat16
        torch.testing.assert_close(q, p, rtol=0, atol=0)
    masters = disk.optimizer.state_dict()["masters"]
    for m, h in zip(masters, host.optimizer.masters, strict=True):
        torch.testing.assert_close(m, h, rtol=0, atol=1e-6)


def test_host_memory_stays_within_the_window_and_disk_holds_the_state(tmp_path):
    torch.manual_seed(0)
    model = Deep()
    params = list(model.parameters())
    footprints = [_adamw_footprint(p) for p in params]
    window = 2 * max(footprints)  # the minimum: one (64, 64) weight per half
    assert sum(footprints) > 2 * window  # the host tier would hold more than twice the window
    setup = apply_plan(model, memfit.Plan(offload=_disk(tmp_path, host_window_bytes=window)))
    opt = setup.optimizer
    # Consecutive parameters, each group within half the window.
    assert [i for g in opt.groups for i in g] == list(range(len(params)))
    assert all(sum(footprints[i] for i in g) <= window // 2 for g in opt.groups)
    setup.step(_batch(0))  # the first step makes the state
    setup.step(_batch(1))  # and the second writes it into each parameter's other file
    headers = 4096 * len(params)
    # Two files per parameter: the current one and the one the next write goes to.
    assert opt.disk_bytes() == 2 * (sum(footprints) + headers)
    assert sorted(os.listdir(opt.directory)) == sorted(
        f"param-{i:06d}.{k}.bin" for i in range(len(params)) for k in (0, 1)
    )
    with memfit.track(model, opt) as tracker:
        for step in range(2, 4):
            setup.step(_batch(step))
    report = tracker.report()
    host = report.peak_by_tier_category["host"]
    # The two window halves, each as large as the largest group (a (64, 64) weight alone).
    assert host["optimizer_state"] == 2 * max(footprints) == window
    assert report.peak_by_tier["disk"] == 2 * (sum(footprints) + headers)
    # Gradients: fp32 on the host, as with the host tier; nothing of the state on the device.
    assert host["gradients"] == sum(4 * p.numel() for p in params)
    assert report.peak_by_category["optimizer_state"] == 0


def test_bad_directories_and_windows_are_refused_before_training(tmp_path, monkeypatch):
    def plan(**extra):
        return memfit.Plan(offload=_disk(tmp_path, **extra))

    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match="does not exist"):
        apply_plan(Net(), memfit.Plan(offload={"optimizer": "disk", "disk_dir": str(missing)}))
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(ValueError, match="not a directory"):
        apply_plan(Net(), memfit.Plan(offload={"optimizer": "disk", "disk_dir": str(a_file)}))
    with pytest.raises(ValueError, match="needs disk_dir"):
        memfit.Plan(offload={"optimizer": "disk"})
    with pytest.raises(ValueError, match="set optimizer_in_backward false"):
        apply_plan(Net(), memfit.Plan(offload=_disk(tmp_path), optimizer_in_backward=True))
    # Too small: the window names its minimum, two of the (64, 64) weight's master and state.
    minimum = 2 * _adamw_footprint(torch.zeros(64, 64))
    with pytest.raises(ValueError, match=f"minimum of {minimum} bytes"):
        apply_plan(Net(), plan(host_window_bytes=minimum - 1))
    apply_plan(Net(), plan(host_window_bytes=minimum)).remove()
    # Free space: masters and state of every parameter, twice (the file being written).
    need = 2 * sum(_adamw_footprint(p) + 4096 for p in Net().parameters())

    class Usage:
        free = need - 1

    monkeypatch.setattr(disk_offload.shutil, "disk_usage", lambda path: Usage)
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="free but the optimizer's master weights and state"):
        apply_plan(model, plan())
    assert not model.a.weight._post_accumulate_grad_hooks  # nothing was applied
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    Usage.free = need
    apply_plan(Net(), plan()).remove()
    monkeypatch.setattr(disk_offload.os, "access", lambda path, mode: False)
    with pytest.raises(ValueError, match="is not writable"):
        apply_plan(Net(), plan())
    assert os.listdir(tmp_path) == ["file"]  # no file was left by any refused plan


def _current_files(opt: DiskOffloadOptimizer) -> list[str]:
    return [opt._path(i, opt._version[i]) for i in range(len(opt.params))]


def test_a_crash_mid_write_back_leaves_the_previous_file(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    setup = apply_plan(model, memfit.Plan(offload=_disk(tmp_path)))
    ref_setup = apply_plan(reference, memfit.Plan(offload=_disk(tmp_path)))
    for step in range(2):  # both files of every parameter hold state
        setup.step(_batch(step))
        ref_setup.step(_batch(step))
    opt = setup.optimizer
    paths = _current_files(opt)
    before = [Path(p).read_bytes() for p in paths]
    real = disk_offload._write_all

    def crash(f, data):  # half the data reaches the file, then the process "dies"
        data = data.cast("B")
        real(f, data[: len(data) // 2])
        raise OSError("simulated crash during write-back")

    monkeypatch.setattr(disk_offload, "_write_all", crash)
    with pytest.raises(OSError, match="simulated crash"):
        setup.step(_batch(2))
    monkeypatch.setattr(disk_offload, "_write_all", real)
    # Every current file is the previous step's, whole; the half-written ones are not current.
    assert _current_files(opt) == paths
    assert [Path(p).read_bytes() for p in paths] == before
    # The state read back is the previous step's: the masters equal the reference's after 2.
    saved = opt.state_dict()
    for m, r in zip(saved["masters"], ref_setup.optimizer.state_dict()["masters"], strict=True):
        assert torch.equal(m, r)
    assert all(int(s["step"]) == 2 for s in saved["optimizer"]["state"].values())


def test_a_damaged_or_stale_file_is_noticed_on_load(tmp_path):
    torch.manual_seed(0)
    setup = apply_plan(Net(), memfit.Plan(offload=_disk(tmp_path)))
    opt = setup.optimizer
    for step in range(3):
        setup.step(_batch(step))
    path = _current_files(opt)[2]
    good = Path(path).read_bytes()
    Path(path).write_bytes(good[:-100])  # cut short, as a crashed plain overwrite leaves it
    with pytest.raises(RuntimeError, match="damaged or stale"):
        setup.step(_batch(3))
    Path(path).write_bytes(good)
    other = opt._path(2, opt._version[2] + 1)
    Path(path).write_bytes(Path(other).read_bytes())  # whole, but two steps old
    with pytest.raises(RuntimeError, match="damaged or stale"):
        setup.step(_batch(4))


def test_state_dict_moves_between_host_and_disk_tiers_and_remove_cleans_up(tmp_path):
    torch.manual_seed(0)
    model = Net()
    setup = apply_plan(model, memfit.Plan(offload=_disk(tmp_path)))
    setup.step(_batch(0))
    saved = copy.deepcopy(setup.stepper.state_dict())
    host_model = copy.deepcopy(model)
    host = apply_plan(host_model, memfit.Plan(offload="host"))
    host.stepper.load_state_dict(saved)
    before = [p.detach().clone() for p in model.parameters()]
    setup.step(_batch(1))
    setup.stepper.load_state_dict(saved)
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, b)  # the device parameters take the restored masters
    for step in (1, 2):
        setup.step(_batch(step))
        host.step(_batch(step))
    for p, q in zip(model.parameters(), host_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    directory = setup.optimizer.directory
    setup.remove()
    assert not os.path.exists(directory)
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


def test_the_host_step_uses_torch_fused_adamw_unless_the_plan_names_an_implementation(tmp_path):
    for offload in ("host", _disk(tmp_path)):
        setup = apply_plan(Net(), memfit.Plan(offload=offload))
        assert setup.optimizer.optimizer.defaults["fused"] is True
        setup.remove()
    for plan in (
        memfit.Plan(offload="host", optimizer={"name": "adamw", "foreach": False}),
        memfit.Plan(offload="host", optimizer={"name": "adamw", "kwargs": {"fused": False}}),
    ):
        setup = apply_plan(Net(), plan)
        assert not setup.optimizer.optimizer.defaults.get("fused")


@pytest.mark.parametrize(
    ("build", "window"),
    [
        (lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.9), 100_000),
        (lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True), 70_000),
    ],
    ids=["rmsprop", "sgd-nesterov"],
)
def test_any_torch_optimizer_steps_from_disk(tmp_path, build, window):
    from memfit.strategies.offload import OffloadConfig

    torch.manual_seed(0)
    plain_model = Net()
    disk_model = copy.deepcopy(plain_model)
    plain = build(list(plain_model.parameters()))
    config = OffloadConfig(optimizer="disk", disk_dir=str(tmp_path), host_window_bytes=window)
    disk = DiskOffloadOptimizer(list(disk_model.parameters()), build, config)
    assert len(disk.groups) >= 2
    for step in range(3):
        plain_model(*_batch(step)).backward()
        plain.step()
        plain.zero_grad()
        disk.begin_backward(True)
        disk_model(*_batch(step)).backward()
        disk.end_backward()
        disk.step()
        disk.zero_grad()
    for p, q in zip(plain_model.parameters(), disk_model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-6)
    disk.remove()
