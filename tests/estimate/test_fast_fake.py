"""The dry runs' fake-tensor mode builds exactly the cache keys torch's own code builds."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit.estimate import fast_fake
from memfit.estimate.fake_kernels import dry_tensors
from memfit.estimate.fast_fake import DryFakeTensorMode


def test_fast_keys_equal_torchs_keys_over_a_training_step(monkeypatch):
    checked = {"fast": 0, "fallback": 0}
    fast = DryFakeTensorMode._prep_args_for_hash

    def both(self, result, args, state, ids):
        mine: list[object] = []
        fast(self, mine, args, state, ids)
        theirs: list[object] = []
        FakeTensorMode._prep_args_for_hash(self, theirs, args, state, [])
        assert mine == theirs, (args, mine, theirs)
        assert [type(x) for x in mine] == [type(x) for x in theirs]  # 1 and 1.0, True and 1
        result.extend(mine)
        checked["fast" if not _slow(self, args) else "fallback"] += 1

    def _slow(self, args):
        try:
            self._fast_args([], args) if type(args) is not dict else None
        except fast_fake._Slow:
            return True
        return False

    monkeypatch.setattr(DryFakeTensorMode, "_prep_args_for_hash", both)
    with DryFakeTensorMode(allow_non_fake_inputs=True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Embedding(50, 16),
            torch.nn.LayerNorm(16),
            torch.nn.Linear(16, 32),
            torch.nn.GELU(),
            torch.nn.Dropout(0.1),
            torch.nn.Linear(32, 50),
        )
        opt = torch.optim.AdamW(model.parameters(), foreach=True)
        ids = torch.randint(0, 50, (4, 8))
        for _ in range(2):
            logits = model(ids).transpose(1, 2).contiguous(memory_format=torch.contiguous_format)
            loss = torch.nn.functional.cross_entropy(logits, ids, reduction="mean")
            scores = torch.nn.functional.scaled_dot_product_attention(
                *(torch.randn(2, 2, 8, 16, requires_grad=True) for _ in range(3)), is_causal=True
            )
            (loss + scores.sum()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert checked["fast"] > 100


def test_fallback_for_what_the_fast_key_does_not_handle():
    mode = DryFakeTensorMode()
    with mode:
        x = torch.empty(3, 4)
    out: list[object] = []
    try:
        mode._fast_args(out, (x, lambda: None))
    except fast_fake._Slow:
        pass
    else:  # pragma: no cover
        raise AssertionError("a function argument must take torch's own path")
    other = FakeTensorMode()
    with other:
        y = torch.empty(2)
    try:
        mode._fast_args([], (y,))  # another mode's tensor
    except fast_fake._Slow:
        pass
    else:  # pragma: no cover
        raise AssertionError("another mode's fake tensor must take torch's own path")


_NORM_CALLS = {
    "layer_norm": lambda x, w, b: torch.ops.aten.native_layer_norm(x, [8], w, b, 1e-5),
    "layer_norm_weight_only": lambda x, w, b: torch.ops.aten.native_layer_norm(
        x, [8], w, None, 1e-5
    ),
    "group_norm": lambda x, w, b: torch.ops.aten.native_group_norm(x, w, b, 2, 8, 8, 2, 1e-5),
    "batch_norm": lambda x, w, b: torch.ops.aten.native_batch_norm(
        x, w, b, torch.zeros(8), torch.ones(8), True, 0.1, 1e-5
    ),
    "batch_norm_legit": lambda x, w, b: torch.ops.aten._native_batch_norm_legit(
        x, w, b, torch.zeros(8), torch.ones(8), True, 0.1, 1e-5
    ),
    "batch_norm_with_update": lambda x, w, b: torch.ops.aten._batch_norm_with_update(
        x, w, b, torch.zeros(8), torch.ones(8), 0.1, 1e-5
    ),
    "batch_norm_no_stats": lambda x, w, b: torch.ops.aten._native_batch_norm_legit.no_stats(
        x, w, b, True, 0.1, 1e-5
    ),
}


@pytest.mark.parametrize("params", ["fp32", "same", "none"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm", sorted(_NORM_CALLS))
def test_norm_statistics_have_the_cpu_kernels_dtype(norm, dtype, params):
    # Under autocast a norm gets a bf16 input and keeps its fp32 weights: the CPU kernel then
    # saves fp32 mean and rstd, the meta implementations (and the batch norms' decompositions)
    # the input's dtype: half the bytes of every norm's saved statistics.
    call = _NORM_CALLS[norm]
    if params != "fp32" and norm.startswith("batch_norm") and not norm.endswith("no_stats"):
        pytest.skip("its fp32 running statistics make every case the mixed one")
    pdtype = {"fp32": torch.float32, "same": dtype, "none": None}[params]
    w, b = (None, None) if pdtype is None else (torch.randn(8, dtype=pdtype),) * 2
    real = call(torch.randn(2, 8, 8, dtype=dtype), w, b)
    with dry_tensors():
        dry = call(torch.empty(2, 8, 8, dtype=dtype), w, b)
        again = call(torch.empty(2, 8, 8, dtype=dtype), w, b)  # from fake tensors' cache
    for got in (dry, again):
        assert [(t.dtype, t.shape, t.stride()) for t in got] == [
            (t.dtype, t.shape, t.stride()) for t in real
        ]


def test_a_plain_fake_mode_run_first_does_not_hand_the_dry_run_its_norm_statistics():
    # torch's dispatch cache is shared by every fake mode and keyed without the mode: a plain
    # fake mode's bf16 statistics, cached first, must not come back to the dry run.
    def stats_dtype(mode: FakeTensorMode) -> torch.dtype:
        with mode:
            x = torch.empty(4, 8, dtype=torch.bfloat16)
            out = torch.ops.aten.native_layer_norm.default(x, [8], torch.empty(8), torch.empty(8), 1e-5)
        return out[1].dtype

    assert stats_dtype(FakeTensorMode()) == torch.bfloat16  # the meta kernel's answer
    assert stats_dtype(DryFakeTensorMode()) == torch.float32  # the CPU kernel's
    assert stats_dtype(FakeTensorMode()) == torch.bfloat16  # and nothing leaked back
