"""FP8 training (``precision: fp8``): torchao's float8 linears under bf16 autocast.

Tolerances, stated once: one step of llama-tiny in fp8 against the same step in bf16-mixed
(same weights, same batch). Float8 e4m3 keeps 3 mantissa bits (relative rounding up to 2^-4
per element of a matmul input), e5m2 gradients 2 bits; with per-tensor scales the loss agrees
within 2% and every gradient within 15% of its bf16-mixed norm (relative norm of the
difference), and the parameters after an AdamW step are finite.

Memory, measured two independent ways on one forward: autograd's saved tensors
(``saved_tensors_hooks``, counted once per storage, parameters apart) and the tracker's live
bytes. Both say fp8 keeps bf16-mixed's activations less the bf16 weight copies autocast saves
for the converted linears (2 bytes per weight element), and, with bf16 weights (the H200
harness's setting, ``benchmarks/results/gpu_h200.md``), exactly what bf16 keeps.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import memfit
from memfit import track
from memfit.estimate.dryrun import _fake_mode
from memfit.plan import Plan, PlanError
from memfit.strategies.fp8 import apply_fp8, fp8_eligible, fp8_problem
from memfit.strategies.precision import (
    Fp8Runtime,
    PrecisionConfig,
    apply_precision,
    cast_module,
)
from memfit.targets import get_device
from memfit.workload import call_model, load_workload

pytest.importorskip("torchao.float8")
if fp8_problem(get_device("cpu")) is not None:  # pragma: no cover - older CPU builds
    pytest.skip("this PyTorch has no float8 matmul on the CPU", allow_module_level=True)

# llama-tiny: 2 layers of q, k, v, o (64x64, 64x32, 64x32, 64x64) and gate, up, down
# (64x176, 64x176, 176x64): all multiples of 16; the head (64 x 1000) is left alone.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _llama(batch: int = 2, seq: int = 32):
    workload = load_workload("llama-tiny", batch, seq)
    model, inputs = workload.build(seed=0)
    return workload, model, inputs


def test_converts_eligible_linears_and_remove_restores_the_same_modules():
    _, model, _ = _llama()
    before = dict(model.named_modules())
    params = {n: p for n, p in model.named_parameters()}
    runtime = apply_precision(model, PrecisionConfig("fp8"))
    assert isinstance(runtime, Fp8Runtime) and runtime.mode == "fp8"
    expected = sorted(
        f"model.layers.{i}.{'self_attn' if p[0] in 'qkvo' else 'mlp'}.{p}"
        for i in range(2)
        for p in PROJECTIONS
    )
    assert sorted(runtime.converted) == expected
    assert type(model.lm_head) is nn.Linear  # the output head stays in bf16
    for name in expected:
        assert type(model.get_submodule(name)).__name__ == "Float8Linear"
        # The float8 linear borrows the original parameter objects.
        assert model.get_submodule(name).weight is params[f"{name}.weight"]
    with pytest.raises(RuntimeError, match="already has float8 linears"):
        apply_precision(model, PrecisionConfig("fp8"))
    runtime.remove()
    assert runtime.converted == []
    after = dict(model.named_modules())
    assert after.keys() == before.keys()
    assert all(after[n] is before[n] for n in before)
    assert all(p is params[n] for n, p in model.named_parameters())
    runtime.remove()  # twice is a no-op


def test_eligibility_dims_of_16_plain_linears_and_no_head():
    head = nn.Linear(32, 64)
    assert fp8_eligible(nn.Linear(32, 64))
    assert not fp8_eligible(nn.Linear(24, 64))
    assert not fp8_eligible(nn.Linear(32, 40))
    assert not fp8_eligible(head, {id(head)})

    class Sub(nn.Linear):
        pass

    assert not fp8_eligible(Sub(32, 64))
    # A linear that shares its weight with an embedding (a tied head) is not converted.
    emb = nn.Embedding(64, 32)
    tied = nn.Linear(32, 64, bias=False)
    tied.weight = emb.weight
    model = nn.Sequential(emb, nn.Linear(32, 32), tied)
    conversion = apply_fp8(model)
    assert conversion.converted == ["1"]
    conversion.undo()
    assert type(model[1]) is nn.Linear


def _step(mode: str):
    workload, model, inputs = _llama()
    runtime = apply_precision(model, PrecisionConfig(mode))
    with runtime.autocast():
        loss = workload.loss_fn(call_model(model, inputs), inputs)
    runtime.backward(loss)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    runtime.step(optimizer)
    finite = all(torch.isfinite(p).all() for p in model.parameters())
    return loss.item(), grads, finite, runtime


def test_fp8_step_close_to_bf16_mixed():
    loss8, grads8, finite, runtime = _step("fp8")
    loss16, grads16, _, _ = _step("bf16-mixed")
    assert finite
    assert abs(loss8 - loss16) <= 0.02 * abs(loss16)
    for name, g16 in grads16.items():
        g8 = grads8[name]
        assert g8.dtype == torch.float32  # gradients of the fp32 masters
        rel = (g8 - g16).norm() / g16.norm().clamp_min(1e-12)
        assert rel <= 0.15, (name, rel.item())
    # The converted linears' gradients did go through float8: not bit-equal to bf16's.
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(grads8[q], grads16[q])
    runtime.remove()


def _forward_bytes(model: nn.Module, inputs, workload, autocast) -> tuple[int, int, set]:
    """(bytes autograd saves, counted once per storage without parameters; bytes the tracker
    sees left live by the forward; dtypes saved)."""
    # Storages by their StorageImpl's address (fake tensors' data pointers are all 0).
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    saved: dict[int, int] = {}
    dtypes: set[torch.dtype] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st._cdata not in params:
            saved[st._cdata] = st.nbytes()
            dtypes.add(t.dtype)
        return t

    with track(model) as tracker:
        before = tracker.live_bytes
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
            loss = workload.loss_fn(call_model(model, inputs), inputs)
        held = tracker.live_bytes - before
    del loss
    return sum(saved.values()), held, dtypes


def test_forward_keeps_bf16_mixed_less_the_weight_copies():
    results = {}
    for mode in ("bf16-mixed", "fp8"):
        workload, model, inputs = _llama()
        runtime = apply_precision(model, PrecisionConfig(mode))
        results[mode] = _forward_bytes(model, inputs, workload, runtime.autocast())
        if mode == "fp8":
            numel = sum(model.get_submodule(n).weight.numel() for n in runtime.converted)
    (saved16, held16, _), (saved8, held8, dtypes8) = results["bf16-mixed"], results["fp8"]
    # Autocast saves a bf16 copy of every linear's weight; the float8 linears save the fp32
    # parameter itself (not counted) and their bf16 input, as autocast's linear does.
    assert saved16 - saved8 == 2 * numel
    # The tracker agrees: what one forward leaves live differs by the same bytes.
    assert held16 - held8 == saved16 - saved8
    # No float8 payload or fp32 activation copy is kept for backward (fp32: the loss's and
    # the norms' own, as under bf16-mixed).
    assert not any(d in (torch.float8_e4m3fn, torch.float8_e5m2) for d in dtypes8)


@pytest.mark.parametrize("dry", [False, True])
def test_with_bf16_weights_fp8_keeps_what_bf16_keeps(dry):
    """The H200 harness's eager setting: bf16 weights, no autocast. There bf16 and fp8 held
    the same 8.65 GiB after one forward; so do they here, real and on fake tensors."""
    held = {}
    for fp8 in (False, True):
        workload = load_workload("llama-tiny", 2, 32)
        with _fake_mode() if dry else contextlib.nullcontext():
            model, inputs = workload.build(seed=0)
            cast_module(model, torch.bfloat16)
            if fp8:
                apply_fp8(model)
            held[fp8] = _forward_bytes(model, inputs, workload, contextlib.nullcontext())[:2]
    assert held[True] == held[False]


def test_dry_run_equals_real_run_on_cpu():
    plan = Plan(precision="fp8")
    real = memfit.measure("llama-tiny", plan, batch_size=2, seq_len=32, steps=2)
    dry = memfit.dry_run("llama-tiny", plan, batch_size=2, seq_len=32, steps=2)
    assert dry.peak_by_category == real.peak_by_category
    assert dry.phase_peaks == real.phase_peaks
    bf16 = memfit.measure("llama-tiny", Plan(precision="bf16-mixed"), batch_size=2, seq_len=32)
    assert real.peak_bytes < bf16.peak_bytes  # no bf16 weight copies held into backward


@pytest.mark.parametrize("device", ["h100", "h200", "rtx4090"])
def test_dry_run_on_fp8_targets_keeps_at_most_bf16_mixed(device):
    kw = dict(batch_size=2, seq_len=32, steps=1, device=device, stop="forward")
    fp8 = memfit.dry_run("llama-tiny", Plan(precision="fp8"), **kw)
    bf16 = memfit.dry_run("llama-tiny", Plan(precision="bf16-mixed"), **kw)
    assert fp8.peak_bytes < bf16.peak_bytes


@pytest.mark.parametrize(("device", "cc"), [("a100", "8.0"), ("a100-40gb", "8.0"), ("t4", "7.5")])
def test_targets_without_float8_are_refused_in_one_sentence(device, cc):
    with pytest.raises(PlanError) as info:
        memfit.dry_run("llama-tiny", Plan(precision="fp8"), batch_size=2, seq_len=32,
                       device=device)
    message = str(info.value)
    assert message.count(". ") == 0 and "\n" not in message
    assert f"{device} (compute capability {cc}) has no float8 matmuls" in message
    assert "8.9" in message


def test_fp8_problem_by_capability():
    for name in ("h100", "h200", "rtx4090", "cpu"):
        assert fp8_problem(get_device(name)) is None, name
    for name in ("a100", "t4"):
        assert fp8_problem(get_device(name)) is not None


def test_hf_and_lightning_engines_refuse_fp8():
    from memfit.techniques import get

    technique = get("precision")
    plan = Plan(precision="fp8")
    for engine in ("hf", "lightning", "layout"):
        assert "fp8" in technique.refuses(plan, engine), engine
    assert technique.refuses(plan, "single") is None


def test_a_real_model_on_an_older_gpu_is_refused(monkeypatch):
    import memfit.device as device

    # A model on a CUDA device of compute capability 8.0 (an A100), as device.py reports it.
    monkeypatch.setattr(device, "is_cuda", lambda d: True)
    monkeypatch.setattr(device, "device_capability", lambda d: (8, 0))
    with pytest.raises(ValueError, match=r"compute capability 8\.0\) has no float8 matmuls"):
        apply_fp8(nn.Sequential(nn.Linear(32, 32)))


def test_memfit_train_with_an_fp8_plan(tmp_path):
    import json

    import yaml
    from typer.testing import CliRunner

    from memfit.cli import app

    (tmp_path / "notes.txt").write_text("the quick brown fox jumps over the lazy dog. " * 60)
    config = dict(model="llama-tiny", data=["notes.txt"], batch_size=2, seq_len=32,
                  max_steps=3, plan={"precision": "fp8"})
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "run.json"
    res = CliRunner().invoke(app, ["train", "--config", str(tmp_path / "run.yaml"), "--json",
                                   str(out)], env={"COLUMNS": "1000", "NO_COLOR": "1"})
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["plan"]["precision"]["mode"] == "fp8"
    assert len(data["losses"]) == 3 and all(0 < x < 20 for x in data["losses"])
    assert data["losses"][-1] < data["losses"][0]


COMBINED = {
    "selective": dict(checkpointing="selective"),
    "fused-step": dict(optimizer_in_backward=True),
    "accumulation": dict(grad_accum_steps=2),
    "fused-pointwise": dict(fused_pointwise=True),
    "optimizer-offload": dict(offload={"optimizer": "host"}),
    "parameter-offload": dict(offload={"optimizer": "host", "parameters": "host"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(COMBINED))
def test_dry_run_equals_real_run_with_other_techniques(name):
    plan = Plan(precision="fp8", **COMBINED[name])
    real = memfit.measure("llama-tiny", plan, batch_size=2, seq_len=32, steps=2)
    dry = memfit.dry_run("llama-tiny", plan, batch_size=2, seq_len=32, steps=2)
    assert dry.peak_by_category == real.peak_by_category
    assert dry.phase_peaks == real.phase_peaks
