"""The compiled (inductor) AdamW8bit CPU step: equal to the eager step (codes and block maxima
bit for bit, parameters to 1e-6), when it is used (switch, environment variable, size, fake
tensors and memfit's tracker), and its fallback when compilation or the self-check fails."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import memfit
from memfit.optim import AdamW8bit, _fused8bit
from memfit.optim import adamw8bit as adamw8bit_module
from memfit.optim.quantization import (
    SIGNED_MAP,
    UNSIGNED_MAP,
    dequantize_blocks,
    quantize_blocks_,
)

from ..distributed.harness import run_ranks

STATE_KEYS = ("exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes", "exp_avg_sq_absmax")


@pytest.fixture
def compiled_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the compiled path's use: one entry (elements updated) per parameter step."""
    calls: list[int] = []
    original = adamw8bit_module._update_8bit_compiled

    def spy(*args, **kwargs):
        done = original(*args, **kwargs)
        calls.append(done)
        return done

    monkeypatch.setattr(adamw8bit_module, "_update_8bit_compiled", spy)
    return calls


@pytest.fixture
def needs_compiled(request: pytest.FixtureRequest) -> None:
    """Skip where inductor has no C++ compiler (the optimizer then stays eager, tested below);
    where it has one, the compiled step must build and pass its self-check."""
    # Inductor starts the C++ compiler: the test must carry the subprocess marker, which
    # conftest.py adds only where the fixture is named in the signature (not where it is
    # taken through request.getfixturevalue), so that the fast tier leaves it out.
    if request.node.get_closest_marker("subprocess") is None:
        pytest.fail(f"{request.node.nodeid} uses needs_compiled (inductor starts the C++ "
                    "compiler): mark it @pytest.mark.subprocess")
    problem = _fused8bit.cxx_compiler_problem()
    if problem is not None:
        pytest.skip(f"no C++ compiler for inductor: {problem.splitlines()[0]}")
    # A compiler but no compiled step: the build or its check failed, and its warning, an error
    # here, says why.  Under this filter the build also shows that torch's own warnings while
    # compiling do not abort it (as they would under pytest -W error without its guard).
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _fused8bit.compiled_step(adamw8bit_module._eager_reference) is not None


def _params(*shapes: tuple[int, ...], seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=gen) * 0.1) for s in shapes]


def _twin_runs(shapes, steps: int, **kwargs) -> tuple[list, list, AdamW8bit, AdamW8bit]:
    compiled, eager = _params(*shapes), _params(*shapes)
    opt_c = AdamW8bit(compiled, compiled=True, **kwargs)
    opt_e = AdamW8bit(eager, compiled=False, **kwargs)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for pc, pe in zip(compiled, eager, strict=True):
            # Gradients of varied scale per step, so that block maxima move up and down.
            g = torch.randn(pc.shape, generator=gen) * torch.rand(1, generator=gen).item()
            pc.grad, pe.grad = g, g.clone()
        opt_c.step()
        opt_e.step()
    return compiled, eager, opt_c, opt_e


@pytest.mark.slow
@pytest.mark.parametrize(
    "betas, weight_decay",
    # beta1 = 0.3: lerp's weight 0.7 takes eager lerp's other formula.
    [((0.9, 0.999), 1e-2), ((0.3, 0.95), 0.0)],
)
def test_compiled_step_equals_eager(needs_compiled, compiled_calls, betas, weight_decay):
    # 1100 x 1000: one compiled 1 Mi chunk and an eager tail with a partial last block;
    # 2048 x 1024: two whole chunks; 300 x 100: too small for a compiled chunk.
    shapes = [(1100, 1000), (2048, 1024), (300, 100)]
    compiled, eager, opt_c, opt_e = _twin_runs(
        shapes, steps=4, lr=1e-2, betas=betas, weight_decay=weight_decay
    )
    assert compiled_calls, "the compiled path was never taken"
    assert set(compiled_calls) == {1 << 20, 2 << 20}
    for pc, pe in zip(compiled, eager, strict=True):
        for key in STATE_KEYS:
            assert torch.equal(opt_c.state[pc][key], opt_e.state[pe][key]), key
        torch.testing.assert_close(pc.detach(), pe.detach(), rtol=1e-6, atol=1e-6)
        # The update moved the parameters (a test of equal copies would pass trivially).
        assert not torch.equal(pc.detach(), _params(*shapes)[shapes.index(tuple(pc.shape))])


@pytest.mark.slow
def test_switch_and_environment(needs_compiled, compiled_calls, monkeypatch):
    monkeypatch.delenv(_fused8bit.ENV_VAR, raising=False)
    big = (1024, 1024)
    # Default: used for a 1 Mi tensor ...
    p = _params(big)
    p[0].grad = torch.ones(big)
    AdamW8bit(p).step()
    assert compiled_calls == [1 << 20]
    # ... not for a smaller one (forced: it has no whole compiled chunk) ...
    compiled_calls.clear()
    p = _params((1000, 1000))
    p[0].grad = torch.ones(1000, 1000)
    AdamW8bit(p).step()
    AdamW8bit(p, compiled=True).step()
    assert compiled_calls == []
    # ... never with compiled=False ...
    p = _params(big)
    p[0].grad = torch.ones(big)
    AdamW8bit(p, compiled=False).step()
    assert compiled_calls == []
    # ... nor by default with MEMFIT_COMPILED_OPTIM=0, which compiled=True overrides.
    monkeypatch.setenv(_fused8bit.ENV_VAR, "0")
    AdamW8bit(p).step()
    assert compiled_calls == []
    AdamW8bit(p, compiled=True).step()
    assert compiled_calls == [1 << 20]


def test_compiled_must_be_a_bool_or_none():
    with pytest.raises(TypeError):
        AdamW8bit(_params((4, 4)), compiled="yes")  # type: ignore[arg-type]


def test_env_var_parsing(monkeypatch):
    monkeypatch.delenv(_fused8bit.ENV_VAR, raising=False)
    assert _fused8bit.env_enabled()
    for off in ("0", "false", "off", " NO "):
        monkeypatch.setenv(_fused8bit.ENV_VAR, off)
        assert not _fused8bit.env_enabled()
    monkeypatch.setenv(_fused8bit.ENV_VAR, "1")
    assert _fused8bit.env_enabled()


def test_fake_tensors_stay_eager(compiled_calls):
    with FakeTensorMode():
        p = torch.nn.Parameter(torch.randn(2048, 1024))
        p.grad = torch.randn(2048, 1024)
        opt = AdamW8bit([p], compiled=True)
        opt.step()
        assert opt.state[p]["exp_avg_codes"].numel() == 2048 * 1024
    assert compiled_calls == []


def test_tracker_sees_the_eager_step(compiled_calls):
    # memfit's tracker is a TorchDispatchMode: inside it the step must run eager kernels.
    p = torch.nn.Parameter(torch.randn(1024, 1024))
    p.grad = torch.randn(1024, 1024)
    opt = AdamW8bit([p], compiled=True)
    with memfit.track(optimizer=opt):
        opt.step()
    assert compiled_calls == []
    assert opt.state[p]["step"] == 1


def _extreme_moments() -> tuple[torch.Tensor, torch.Tensor]:
    """Moments of one compiled chunk with denormal blocks and tiny second-moment ratios."""
    gen = torch.Generator().manual_seed(5)
    rows = _fused8bit.COMPILED_CHUNK // _fused8bit.BLOCK_SIZE
    m = torch.randn(rows, _fused8bit.BLOCK_SIZE, generator=gen)
    v = torch.rand(rows, _fused8bit.BLOCK_SIZE, generator=gen)
    m[0] *= 1e-40  # a denormal block maximum
    m[1] *= 2.0**-140
    v[0] *= 1e-40
    # Ratios to the block maximum of 2**-150 .. 2**-160: below fp32's smallest denormal.
    v[1] = 2.0**-50 * (1 + v[1]) / 2.0**10
    v[1, 0] = 2.0**100
    return m, v


# The compiled case takes needs_compiled through request.getfixturevalue, which conftest.py's
# fixture-name check cannot see: it carries the subprocess marker (inductor's compiler runs)
# itself.
@pytest.mark.parametrize(
    "compiled", [False, pytest.param(True, marks=[pytest.mark.slow, pytest.mark.subprocess])]
)
def test_encode_keeps_denormal_blocks_and_tiny_second_moments_as_eager(compiled, request):
    # The fused encode repeats quantize_blocks_: it must share its fixes for denormal block
    # maxima and for second moments whose ratio to the block maximum underflows fp32.
    encode = _fused8bit.encode_
    if compiled:
        request.getfixturevalue("needs_compiled")
        encode = _fused8bit.compiled_step(adamw8bit_module._eager_reference).keywords["kernels"][1]
    m, v = _extreme_moments()
    got = [torch.empty(m.shape, dtype=torch.uint8), torch.empty(m.shape[0])]
    got += [torch.empty_like(got[0]), torch.empty_like(got[1])]
    encode(m, v, *got)
    want = [torch.empty_like(t) for t in got]
    quantize_blocks_(m.clone(), SIGNED_MAP, want[0], want[1])
    quantize_blocks_(v.clone(), UNSIGNED_MAP, want[2], want[3])
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    m_out = dequantize_blocks(got[0], got[1], SIGNED_MAP)
    v_out = dequantize_blocks(got[2], got[3], UNSIGNED_MAP)
    # Within the code book's bound (see test_quantization_properties), plus half a denormal
    # step for the decoded denormals.
    rel = 2.0 ** -(SIGNED_MAP.mantissa_bits + 1)
    floor = got[1].view(-1, 1) * SIGNED_MAP.smallest_positive * (1 + 1e-6)
    assert ((m_out - m).abs()[:2] <= m.abs()[:2] * rel * (1 + 1e-6) + floor[:2] + 2.0**-150).all()
    assert (v_out[v > 0] > 0).all()


def test_self_check_rejects_a_wrong_kernel():
    # Kernels under check take a scratch buffer too; the reference does not.
    def off_by_one_code(param, grad, m_codes, m_absmax, v_codes, v_absmax, hyper, scratch):
        adamw8bit_module._eager_reference(param, grad, m_codes, m_absmax, v_codes, v_absmax, hyper)
        m_codes.view(-1)[7] ^= 1

    def wrong_params(param, grad, m_codes, m_absmax, v_codes, v_absmax, hyper, scratch):
        adamw8bit_module._eager_reference(param, grad, m_codes, m_absmax, v_codes, v_absmax, hyper)
        param.mul_(1 + 1e-4)

    def right(param, grad, m_codes, m_absmax, v_codes, v_absmax, hyper, scratch):
        adamw8bit_module._eager_reference(param, grad, m_codes, m_absmax, v_codes, v_absmax, hyper)

    reference = adamw8bit_module._eager_reference
    assert _fused8bit.self_check(right, reference) is None
    assert "m codes" in _fused8bit.self_check(off_by_one_code, reference)
    assert "parameters" in _fused8bit.self_check(wrong_params, reference)


def test_missing_compiler_falls_back_without_compiling(monkeypatch, compiled_calls):
    def no_compiler():
        return "InvalidCxxCompiler: No working C++ compiler found\n\nSet TORCHDYNAMO_VERBOSE=1"

    def must_not_compile(*args, **kwargs):
        raise AssertionError("torch.compile was called without a compiler")

    monkeypatch.setattr(_fused8bit, "_COMPILED", {})
    monkeypatch.setattr(_fused8bit, "cxx_compiler_problem", no_compiler)
    monkeypatch.setattr(torch, "compile", must_not_compile)
    p, q = _params((1024, 1024)), _params((1024, 1024))
    g = torch.randn(1024, 1024)
    p[0].grad, q[0].grad = g, g.clone()
    with pytest.warns(
        RuntimeWarning, match="No working C\\+\\+ compiler found\\); using the eager"
    ):
        AdamW8bit(p, compiled=True).step()
    AdamW8bit(q, compiled=False).step()
    assert compiled_calls == []
    assert torch.equal(p[0], q[0])


def test_compile_failure_falls_back_to_eager_with_a_warning(monkeypatch, compiled_calls):
    def broken_compile(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(_fused8bit, "_COMPILED", {})
    monkeypatch.setattr(_fused8bit, "cxx_compiler_problem", lambda: None)  # one seems there
    monkeypatch.setattr(torch, "compile", broken_compile)
    p, q = _params((1024, 1024)), _params((1024, 1024))
    g = torch.randn(1024, 1024)
    p[0].grad, q[0].grad = g, g.clone()
    opt_p, opt_q = AdamW8bit(p, compiled=True), AdamW8bit(q, compiled=False)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        opt_p.step()
    opt_q.step()
    assert compiled_calls == []
    for key in STATE_KEYS:
        assert torch.equal(opt_p.state[p[0]][key], opt_q.state[q[0]][key])
    assert torch.equal(p[0], q[0])
    # The failure is remembered: no second attempt, no second warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt_p.step()


def _fsdp_compiled_vs_eager(rank: int, world_size: int) -> dict[str, Any]:
    """One FSDP2-sharded 2048 x 1024 weight (a 1 Mi shard per rank), AdamW8bit compiled and
    eager, three identical steps each; this rank's state and shard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    calls: list[int] = []
    original = adamw8bit_module._update_8bit_compiled

    def spy(*args, **kwargs):
        calls.append(original(*args, **kwargs))
        return calls[-1]

    adamw8bit_module._update_8bit_compiled = spy
    mesh = init_device_mesh("cpu", (world_size,))
    runs = {}
    for compiled in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Linear(1024, 2048, bias=False)
        fully_shard(model, mesh=mesh)
        opt = AdamW8bit(model.parameters(), lr=1e-2, compiled=compiled)
        for step in range(3):
            torch.manual_seed(100 + step)  # the same batch on every rank
            # A loss linear in the output: gradients that do not depend on the weights, so
            # both runs see the same ones although their weights differ by rounding.
            x = torch.randn(8, 1024)
            (model(x) * torch.randn(8, 2048)).sum().backward()
            opt.step()
            opt.zero_grad()
        state = opt.state[model.weight]
        runs[compiled] = {key: state[key].clone() for key in STATE_KEYS}
        runs[compiled]["shard"] = model.weight.to_local().detach().clone()
    return {"runs": runs, "calls": calls}


@pytest.mark.slow
@pytest.mark.distributed
def test_compiled_step_on_fsdp2_shards_equals_eager(needs_compiled):
    # (The compiled step is built here first: the ranks then find its kernels in inductor's
    # on-disk cache instead of both compiling them at once.)
    for result in run_ranks(_fsdp_compiled_vs_eager, 2, timeout=240):
        # Only the compiled run took the compiled path: once per step, one 1 Mi chunk.
        assert result["calls"] == [1 << 20] * 3
        compiled, eager = result["runs"][True], result["runs"][False]
        for key in STATE_KEYS:
            assert torch.equal(compiled[key], eager[key]), key
        assert compiled["shard"].numel() == 1 << 20
        torch.testing.assert_close(compiled["shard"], eager["shard"], rtol=1e-6, atol=1e-6)
