"""A torch.compile'd (inductor) fused decode -> AdamW update -> encode for AdamW8bit (private).

The eager 8-bit step runs a few dozen element-wise kernels per chunk, each a full pass over
memory; compiled, a chunk takes two kernels (:func:`update_`, :func:`encode_`).  They write the
eager path's operations (:func:`memfit.optim.adamw8bit.adamw_math`,
:func:`memfit.optim.quantization.quantize_blocks_`) in the same order and with eager's rounding
(its lerp and addcmul round as fused multiply-adds, written here with inductor's ``fma``), so
compiled they produce the eager codes and block maxima bit for bit and parameters to within an
ulp or two (eager's sqrt comes from MKL).  Run uncompiled they are *not* exact (``prims.fma``
is then an unfused multiply-add).  :func:`self_check` verifies the compiled kernels against the
eager step once per process; the optimizer falls back to eager (with a warning) if compilation
fails or the check does not pass.

The compiled path is only for real (non-fake) CPU tensors outside any dispatch mode: memfit's
tracker is a ``TorchDispatchMode`` and dry runs use fake tensors, and both must see the eager
kernels (their memory behaviour is what they measure).
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .quantization import SIGNED_MAP, UNSIGNED_MAP, Minifloat8

#: Environment switch: ``MEMFIT_COMPILED_OPTIM=0`` disables the compiled path by default.
ENV_VAR = "MEMFIT_COMPILED_OPTIM"
#: Parameters (local shards) with fewer elements stay on the eager path.
MIN_COMPILED_NUMEL = 1 << 20
#: Elements per compiled call: bounds the fp32 temporaries (as the eager path's chunks do)
#: while keeping the per-call overhead (guards, launch) small against the work.
COMPILED_CHUNK = 1 << 20
#: The block size the compiled kernel is built and checked for (AdamW8bit's default).
BLOCK_SIZE = 256


def env_enabled() -> bool:
    """Whether the environment allows the compiled path (``MEMFIT_COMPILED_OPTIM`` not 0)."""
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "no", "off")


def outside_special_modes() -> bool:
    """No fake mode, no dispatch mode (memfit's tracker, a dry run), no tracing is active."""
    from torch._guards import active_fake_mode
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    # Also not while torch.compile traces the step itself (it then sees its own fake values).
    return (
        active_fake_mode() is None
        and _get_current_dispatch_mode() is None
        and not torch.compiler.is_compiling()
    )


def _decode(codes: Tensor, fmt: Minifloat8) -> Tensor:
    # Integer form of the code book (see Minifloat8 / _build_minifloat_table): exact, and in a
    # fused kernel cheaper than a gather.
    # Widened from int8 (sign-extending): inductor's vector uint8 -> int32 cast is slow for
    # bytes of 128 and up, the int8 one is not.  Bit 7 of the code becomes bit 31 (the sign).
    s = codes.view(torch.int8).to(torch.int32)
    c = torch.bitwise_and(s, 0xFF)
    mag = torch.bitwise_and(c, fmt.max_magnitude_code)
    bits = torch.where(mag == 0, 0, torch.bitwise_left_shift(mag + fmt._offset, fmt._shift))
    if fmt.signed:
        bits = torch.bitwise_or(bits, torch.bitwise_and(s, -(1 << 31)))
    else:
        bits = torch.where(c > fmt.max_magnitude_code, 127 << 23, bits)
    return bits.view(torch.float32)


def _encode(blocks: Tensor, fmt: Minifloat8) -> tuple[Tensor, Tensor]:
    # quantize_blocks_ with Minifloat8._encode_int32, written out of place.
    if fmt.signed:
        absmax = torch.amax(blocks.abs(), dim=1)
    else:
        absmax = torch.amax(blocks, dim=1).clamp(min=0.0)
    # A division, as eager's (see quantize_blocks_): exact for denormal block maxima.
    m = absmax.view(-1, 1)
    scaled = blocks / torch.where(m == 0, 1.0, m)
    bits = scaled.view(torch.int32)
    bias = (fmt._offset << fmt._shift) - (1 << (fmt._shift - 1))
    top = fmt.max_magnitude_code
    if fmt.signed:
        mag = torch.bitwise_right_shift(torch.bitwise_and(bits, 0x7FFFFFFF) - bias, fmt._shift)
        mag = mag.clamp(0, top)
        sign = torch.bitwise_and(torch.bitwise_right_shift(bits, 24), 0x80)
        code = torch.bitwise_or(mag, sign)
    else:
        code = torch.bitwise_right_shift(bits - bias, fmt._shift)
        # Positive inputs get at least code 1, also where their quotient underflowed to 0.
        code = torch.maximum(code, blocks.view(torch.int32).clamp(max=1)).clamp(0, top)
    # Through int8 (a wrapping cast: the same byte): inductor's vector int32 -> uint8 cast is
    # about twice as slow as the whole encode for values of 128 and up.
    return code.to(torch.int8).view(torch.uint8), absmax


def _fma(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    # Inductor's fused multiply-add primitive (one rounding), registered by this import.
    import torch._inductor.inductor_prims

    return torch.ops.prims.fma(a, b, c)


def update_(
    param: Tensor,
    grad: Tensor,
    m_codes: Tensor,
    m_absmax: Tensor,
    v_codes: Tensor,
    v_absmax: Tensor,
    hyper: Tensor,
    m_out: Tensor,
    v_out: Tensor,
) -> None:
    """Decode the moments, update them and the parameter (first compiled kernel, in place).

    Args:
        param: fp32 ``(blocks, block_size)`` parameter values, updated.
        grad: fp32 gradient of the same shape.
        m_codes, v_codes: uint8 ``(blocks, block_size)`` codes of the two moments.
        m_absmax, v_absmax: fp32 ``(blocks,)`` block maxima.
        hyper: fp64 ``(7,)``: 1 - beta1, beta2, 1 - beta2, sqrt of the second bias correction,
            eps, the weight-decay factor 1 - lr * wd, -step_size (Python floats in the eager
            path; a tensor here, so that a new step does not recompile).
        m_out, v_out: fp32 scratch of the shape of ``param``: the updated moments.
    """
    # The eager kernels cast these double scalars to fp32 before use.
    h = hyper.to(torch.float32)
    w1, b2, w2, bc2, eps, decay, neg_step = (h[i] for i in range(7))
    g = grad
    m = _decode(m_codes, SIGNED_MAP) * m_absmax.view(-1, 1)
    v = _decode(v_codes, UNSIGNED_MAP) * v_absmax.view(-1, 1)
    # adamw_math's operations, in its order, with eager's rounding.  Eager CPU lerp computes
    # fma(coeff, end - start, base) (Vectorized lerp); an unfused a + w * d differs in the last
    # bit for about a tenth of the elements, enough to flip codes.
    small = torch.abs(w1) < 0.5
    coeff = torch.where(small, w1, w1 - 1.0)
    m = _fma(coeff.expand_as(m), g - m, torch.where(small, m, g))
    # Eager CPU addcmul rounds as fma(value * t1, t2, self).
    v = _fma(w2 * g, g, v * b2)
    denom = torch.sqrt(v) / bc2 + eps
    param.copy_(torch.addcdiv(param * decay, m, denom, value=neg_step))
    m_out.copy_(m)
    v_out.copy_(v)


def encode_(
    m: Tensor, v: Tensor, m_codes: Tensor, m_absmax: Tensor, v_codes: Tensor, v_absmax: Tensor
) -> None:
    """Quantise the updated moments into their codes and maxima (second compiled kernel).

    A separate kernel because the block maxima must be known before any code: in one kernel
    inductor computes the moments twice (once for the maxima), which costs more than a round
    trip of the fp32 moments through a scratch buffer.
    """
    mc, ma = _encode(m, SIGNED_MAP)
    vc, va = _encode(v, UNSIGNED_MAP)
    m_codes.copy_(mc)
    m_absmax.copy_(ma)
    v_codes.copy_(vc)
    v_absmax.copy_(va)


def fused_step_(
    param: Tensor,
    grad: Tensor,
    m_codes: Tensor,
    m_absmax: Tensor,
    v_codes: Tensor,
    v_absmax: Tensor,
    hyper: Tensor,
    scratch: Tensor,
    *,
    kernels: tuple[Callable[..., None], Callable[..., None]] = (update_, encode_),
) -> None:
    """One AdamW8bit update of whole blocks, in place: :func:`update_` then :func:`encode_`.

    Args:
        param, grad, m_codes, m_absmax, v_codes, v_absmax, hyper: As for :func:`update_`.
        scratch: fp32 ``(2, blocks, block_size)`` buffer (contents irrelevant, overwritten).
        kernels: The two functions to run (their compiled versions on the fast path).
    """
    update, encode = kernels
    update(param, grad, m_codes, m_absmax, v_codes, v_absmax, hyper, scratch[0], scratch[1])
    encode(scratch[0], scratch[1], m_codes, m_absmax, v_codes, v_absmax)


_LOCK = threading.Lock()
_COMPILED: dict[str, Any] = {}


#: The eager reference the self-check compares against (fused_step_'s signature, no scratch).
Reference = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], None]


def compiled_step(reference: Reference) -> Callable[..., None] | None:
    """:func:`fused_step_` with compiled kernels, or ``None`` where compilation or the self-check
    failed.

    Built and checked against ``reference`` (the eager step, same signature) once per process.
    """
    with _LOCK:
        if "fn" not in _COMPILED:
            _COMPILED["fn"] = _build(reference)
        return _COMPILED["fn"]


def cxx_compiler_problem() -> str | None:
    """Why inductor has no working C++ compiler here, or ``None`` if it has one (or the check
    is not available in this torch, in which case compiling finds out)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
    except ImportError:  # a torch without this (private) helper: let torch.compile decide
        return None
    try:
        get_cpp_compiler()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _build(reference: Reference) -> Callable[..., None] | None:
    # The compiler is looked for first: without one, torch.compile would spend seconds
    # tracing before it fails.
    fn = None
    problem = cxx_compiler_problem()
    if problem is None:
        try:
            # Compilation (in the self-check's first call) warns about torch's internals; under
            # an "error" warnings filter (pytest -W error) those warnings would abort it.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                kernels = tuple(
                    torch.compile(f, backend="inductor", dynamic=False, fullgraph=True)
                    for f in (update_, encode_)
                )
                fn = functools.partial(fused_step_, kernels=kernels)
                problem = self_check(fn, reference)
        except Exception as exc:  # any compiler failure means: stay eager
            problem = f"{type(exc).__name__}: {exc}"
    if problem is not None:
        warnings.warn(
            f"AdamW8bit: the compiled CPU step is unavailable ({_summary(problem)}); using the eager "
            f"step (set {ENV_VAR}=0 to skip the attempt)",
            RuntimeWarning,
            stacklevel=4,
        )
        return None
    return fn


def _summary(problem: str) -> str:
    # Up to the first blank line, on one line: inductor's messages go on with advice on
    # debugging inductor.
    head = problem.strip().split("\n\n")[0]
    return " ".join(line.strip() for line in head.splitlines())


def self_check(fn: Callable[..., None], reference: Reference) -> str | None:
    """Run ``fn`` and ``reference`` on the same random chunk; ``None`` if they agree.

    Codes and maxima must be equal bit for bit, parameters to 1e-6 (relative).
    """
    gen = torch.Generator().manual_seed(1234)
    blocks, block = COMPILED_CHUNK // 256, 256
    param = torch.randn(blocks, block, generator=gen)
    grad = torch.randn(blocks, block, generator=gen) * 1e-2
    m_codes = torch.randint(0, 256, (blocks, block), generator=gen, dtype=torch.uint8)
    v_codes = torch.randint(0, 256, (blocks, block), generator=gen, dtype=torch.uint8)
    m_absmax = torch.rand(blocks, generator=gen) * 1e-2
    v_absmax = torch.rand(blocks, generator=gen) * 1e-4
    # Dyadic scalars: the reference rebuilds betas, lr and decay from them without rounding.
    hyper = torch.tensor(
        [2**-3, 1 - 2**-10, 2**-10, 0.25, 2**-27, 1 - 2**-13, -(2**-10)], dtype=torch.float64
    )
    state = (param, grad, m_codes, m_absmax, v_codes, v_absmax)
    want = [t.clone() for t in state]
    got = [t.clone() for t in state]
    reference(*want, hyper)
    fn(*got, hyper, torch.empty(2, blocks, block))
    names = ("parameters", "", "m codes", "m absmax", "v codes", "v absmax")
    for name, a, b in list(zip(names, want, got, strict=True))[2:]:
        if not torch.equal(a, b):
            return f"{name} differ from the eager step"
    if not torch.allclose(want[0], got[0], rtol=1e-6, atol=1e-7):
        return "parameters differ from the eager step"
    return None
