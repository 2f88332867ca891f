"""Activation offload: gradients equal the plain model's, the tracker sees the bytes move.

On this CPU-only machine the compute tensors are the device tier and the host copies, made
inside ``host_tier()``, the host tier. Every expectation is computed from shapes, in fp32.

The MLP (``Linear(D_IN, H1) -> ReLU -> Linear(H1, H2) -> ReLU -> Linear(H2, OUT)``) saves for
backward, besides its parameters and its input: each ReLU's output, which the ReLU keeps and
the next Linear keeps again as its input (one storage, saved twice). So the movable bytes are
exactly ``B * H1 * 4`` and ``B * H2 * 4``; nothing else is saved inside the model.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import transformers
from torch import nn
from torch.nn import functional as F

import memfit
from memfit.strategies.activation_offload import apply_activation_offload
from memfit.strategies.checkpointing import CheckpointConfig, apply_checkpointing
from memfit.strategies.offload import OffloadConfig

F32 = 4
B, D_IN, H1, H2, OUT = 8, 16, 64, 32, 4
RELU1, RELU2 = B * H1 * F32, B * H2 * F32  # the two storages the MLP can move
ALL = OffloadConfig(activations=True, activation_min_bytes=0)


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(D_IN, H1), nn.ReLU(), nn.Linear(H1, H2), nn.ReLU(), nn.Linear(H2, OUT)
    )


def _x() -> torch.Tensor:
    return torch.randn(B, D_IN, generator=torch.Generator().manual_seed(1))


def _grads(model: nn.Module, loss_fn) -> dict[str, torch.Tensor]:
    torch.manual_seed(123)  # dropout draws the same masks in both runs
    loss_fn(model).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _assert_same(ref: dict, got: dict) -> None:
    assert ref.keys() == got.keys()
    for name in ref:
        # The bytes travel unchanged, so the computation is the same one: exactly equal.
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=0, msg=name)


def _no_saved_hooks() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None


# ---------------------------------------------------------------------------------- numerics
def test_mlp_gradients_equal_the_plain_model():
    plain, off = _mlp(), _mlp()
    handle = apply_activation_offload(off, ALL)
    x = _x()
    _assert_same(_grads(plain, lambda m: m(x).square().sum()),
                 _grads(off, lambda m: m(x).square().sum()))
    assert handle.counters.offloaded_bytes == RELU1 + RELU2
    assert handle.counters.offloaded_storages == 2
    # Each ReLU output is copied back once, though two nodes (the ReLU and the next Linear)
    # read it in backward; the host copies die with the graph.
    assert handle.counters.restored_bytes == RELU1 + RELU2
    assert handle.host_bytes_live == 0
    assert _no_saved_hooks()


HF = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128)),
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=2, vocab_size=128, n_positions=64)),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(HF))
@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpointed"])
def test_hf_gradients_equal_the_plain_model(name, checkpoint):
    torch.manual_seed(0)
    plain = HF[name]()
    plain.train()  # dropout on (GPT-2): the RNG must replay identically
    base, off = copy.deepcopy(plain), copy.deepcopy(plain)  # base: all but the offload
    if checkpoint:
        apply_checkpointing(base, CheckpointConfig(mode="full"))
        apply_checkpointing(off, CheckpointConfig(mode="full"))
    handle = apply_activation_offload(off, ALL)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))

    def loss(m):
        return m(input_ids=ids, labels=ids, use_cache=False).loss

    ref, got = _grads(plain, loss), _grads(off, loss)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=0, atol=1e-6, msg=n)
    assert handle.host_bytes_live == 0
    assert _no_saved_hooks()
    # The device holds after the forward exactly the bytes moved less; the host holds them.
    live = {}
    for key, model in (("base", base), ("off", off)):
        with memfit.track(model) as tracker:
            out = loss(model)
            live[key] = tracker.live_bytes
            out.backward()
            del out
        model.zero_grad(set_to_none=True)
    moved = handle.counters.last_forward_offloaded_bytes
    # What something else still holds is not freed by the move. Here, GPT-2 checkpointed:
    # the position ids (1 x 16, int64), which the position embedding saves and the
    # checkpointed blocks' keyword arguments keep alive.
    held = handle.counters.last_forward_held_bytes
    assert held == (16 * 8 if checkpoint and name == "gpt2" else 0)
    assert moved > 0
    assert live["base"] - live["off"] == moved - held
    assert tracker.report().peak_by_tier["host"] == moved


# ---------------------------------------------------------------------------------- memory
def _forward_then_backward(model: nn.Module, x: torch.Tensor) -> tuple[int, dict, object]:
    with memfit.track(model) as tracker:
        out = model(x)
        after_forward = tracker.live_bytes
        snapshot = tracker.snapshot()
        out.square().sum().backward()
        del out
    return after_forward, snapshot, tracker.report()


def test_tracker_measures_the_bytes_moved():
    plain, off = _mlp(), _mlp()
    handle = apply_activation_offload(off, ALL)
    x = _x()
    plain_live, plain_snap, plain_report = _forward_then_backward(plain, x)
    off_live, off_snap, off_report = _forward_then_backward(off, x)
    moved = RELU1 + RELU2
    assert handle.counters.last_forward_offloaded_bytes == moved
    # After the forward the device holds exactly the moved bytes less...
    assert plain_live - off_live == moved
    assert plain_snap["activations"] == moved and off_snap["activations"] == 0
    # ...and the host holds them: its peak is the copies of one forward.
    assert off_report.peak_by_tier["host"] == moved
    # The tracker knows the host copies for what they are: activations kept for backward.
    assert off_report.peak_by_tier_category["host"]["activations"] == moved
    assert plain_report.peak_by_tier["host"] == 0
    assert handle.counters.host_peak_bytes == moved


def _backward_births(model: nn.Module, nbytes: int) -> int:
    """Device storages of ``nbytes`` allocated during backward."""
    with memfit.track(model) as tracker:
        loss = model(_x()).square().sum()
        start = tracker.trace().num_events
        loss.backward()
    trace = tracker.trace()
    return sum(1 for n, born, tier in zip(trace.nbytes, trace.birth, trace.tier, strict=True)
               if tier == 0 and born > start and n == nbytes)


def test_copies_back_are_device_allocations_in_backward():
    plain, off = _mlp(), _mlp()
    handle = apply_activation_offload(off, ALL)
    # Backward allocates gradients of these sizes too: the copies back are one more each.
    for nbytes in (RELU1, RELU2):
        assert _backward_births(off, nbytes) == _backward_births(plain, nbytes) + 1
    assert handle.counters.restored_bytes == 2 * (RELU1 + RELU2)  # two steps


def test_views_and_repeated_saves_move_once():
    class Views(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(D_IN, H1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = F.relu(self.lin(x))
            a, b = y[:, : H1 // 2], y[:, H1 // 2 :]  # two views of one storage
            return (a * a).sum() + (b * b).sum() + (y * a.sum()).sum()

    torch.manual_seed(0)
    plain = Views()
    off = copy.deepcopy(plain)
    handle = apply_activation_offload(off, ALL)
    x = _x()
    _assert_same(_grads(plain, lambda m: m(x)), _grads(off, lambda m: m(x)))
    # y (relu's output, saved by relu, by `y * ...`, and through its views a and b) moves
    # once; a.sum() is saved by the last mul but is a 4-byte storage of its own.
    assert handle.counters.offloaded_bytes == RELU1 + F32
    assert handle.counters.offloaded_storages == 2


# ---------------------------------------------------------------------------------- settings
def test_min_bytes_keeps_small_storages_on_the_device():
    off = _mlp()
    assert RELU2 < RELU1
    handle = apply_activation_offload(off, ALL.replace(activation_min_bytes=RELU2 + 1))
    _, _, report = _forward_then_backward(off, _x())
    assert handle.counters.offloaded_bytes == RELU1
    assert handle.counters.kept_small_bytes == RELU2
    assert handle.kept_bytes == RELU2
    assert report.peak_by_tier["host"] == RELU1
    # At the threshold a storage moves (the threshold is "smaller than").
    handle.remove()
    off = _mlp()
    handle = apply_activation_offload(off, ALL.replace(activation_min_bytes=RELU2))
    _forward_then_backward(off, _x())
    assert handle.counters.offloaded_bytes == RELU1 + RELU2


def test_host_bound_keeps_what_does_not_fit_on_the_device():
    plain, off = _mlp(), _mlp()
    # Room for the first ReLU output only: the second (saved later) stays on the device.
    handle = apply_activation_offload(off, ALL.replace(host_bytes=RELU1 + RELU2 - 1))
    x = _x()
    plain_live, _, _ = _forward_then_backward(plain, x)
    off_live, _, report = _forward_then_backward(off, x)
    assert handle.counters.offloaded_bytes == RELU1
    assert handle.counters.kept_over_bound_bytes == RELU2
    assert plain_live - off_live == RELU1
    assert report.peak_by_tier["host"] == RELU1
    _assert_same(_grads(plain, lambda m: m(x).sum()), _grads(off, lambda m: m(x).sum()))


def test_host_bound_spans_graphs_waiting_for_backward():
    off = _mlp()
    handle = apply_activation_offload(off, ALL.replace(host_bytes=RELU1 + RELU2))
    x = _x()
    first = off(x).sum()  # fills the bound
    second = off(x).sum()  # nothing more fits until the first graph is freed
    assert handle.counters.offloaded_bytes == RELU1 + RELU2
    assert handle.counters.kept_over_bound_bytes == RELU1 + RELU2
    assert handle.host_bytes_live == RELU1 + RELU2
    first.backward()
    assert handle.host_bytes_live == 0
    second.backward()
    off(x).sum().backward()  # room again
    assert handle.counters.offloaded_bytes == 2 * (RELU1 + RELU2)


def test_no_grad_moves_nothing():
    off = _mlp()
    handle = apply_activation_offload(off, ALL)
    with torch.no_grad():
        off(_x())
    assert handle.counters.offloaded_bytes == 0
    assert _no_saved_hooks()


# ---------------------------------------------------------------------------------- checkpointing
class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln(x)))))


class Stack(nn.Module):
    def __init__(self, n: int, d: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


N_BLOCKS, S, D = 4, 16, 32
HIDDEN = B * S * D * F32  # one block's input


def test_with_checkpointing_only_block_inputs_move():
    torch.manual_seed(0)
    plain = Stack(N_BLOCKS, D)
    off = copy.deepcopy(plain)
    apply_checkpointing(off, CheckpointConfig(mode="full"))
    handle = apply_activation_offload(off, ALL)
    x = torch.randn(B, S, D, generator=torch.Generator().manual_seed(2))
    _assert_same(_grads(plain, lambda m: m(x).square().mean()),
                 _grads(off, lambda m: m(x).square().mean()))
    # The first block's input is the model's input (the caller holds it: not moved); each
    # other block keeps the previous block's output, and nothing else is saved.
    assert handle.counters.offloaded_storages == N_BLOCKS - 1
    assert handle.counters.offloaded_bytes == (N_BLOCKS - 1) * HIDDEN
    assert handle.blocks == [f"blocks.{i}" for i in range(N_BLOCKS)]
    with memfit.track(off) as tracker:
        loss = off(x).square().mean()
        loss.backward()
    assert tracker.report().peak_by_tier["host"] == (N_BLOCKS - 1) * HIDDEN


# ---------------------------------------------------------------------------------- prefetch
def test_prefetch_copies_back_one_block_ahead(monkeypatch):
    """The CUDA path's logic, run on the CPU with a stand-in copy stream whose copies are the
    ordinary synchronous ones: which storages are copied back ahead, and that each is then
    used instead of copied again."""
    from memfit import device

    calls = {"stream": 0, "consumed": []}

    @contextlib.contextmanager
    def on_stream(stream):
        calls["stream"] += 1
        yield

    monkeypatch.setattr(device, "copy_stream", lambda d: "copy stream")
    monkeypatch.setattr(device, "stream_ready", lambda stream, after: None)
    monkeypatch.setattr(device, "on_stream", on_stream)
    monkeypatch.setattr(device, "record_event", lambda stream: "event")
    monkeypatch.setattr(device, "wait_for", lambda event, d: None)
    monkeypatch.setattr(device, "record_stream",
                        lambda t, d: calls["consumed"].append(t.numel()))  # fmt: skip
    torch.manual_seed(0)
    plain = Stack(N_BLOCKS, D)
    off = copy.deepcopy(plain)
    handle = apply_activation_offload(off, ALL)
    per_block = []  # bytes each block's forward moved
    for block in off.blocks:
        block.register_forward_pre_hook(lambda m, a: per_block.append(-handle.offloaded_bytes))
        block.register_forward_hook(lambda m, a, o: per_block.append(handle.offloaded_bytes))
    x = torch.randn(B, S, D, generator=torch.Generator().manual_seed(2))
    _assert_same(_grads(plain, lambda m: m(x).square().mean()),
                 _grads(off, lambda m: m(x).square().mean()))
    per_block = [a + b for a, b in zip(per_block[::2], per_block[1::2], strict=True)]
    moved = handle.counters.offloaded_bytes
    assert len(per_block) == N_BLOCKS and sum(per_block) == moved > 0  # all inside blocks
    # Backward reaches the last block first: it is copied back on demand, and each block
    # before it ahead, while the block after it computes; nothing is copied twice.
    assert calls["stream"] == N_BLOCKS - 1
    assert sum(calls["consumed"]) == sum(per_block[:-1])
    assert handle.counters.restored_bytes == moved
    assert handle.host_bytes_live == 0


# ---------------------------------------------------------------------------------- fake
def test_fake_tensors_move_like_real_ones():
    """A dry run (fake tensors) sees the same saving as a real run."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        plain, off = _mlp(), _mlp()
        handle = apply_activation_offload(off, ALL)
        x = torch.randn(B, D_IN)
        plain_live, _, _ = _forward_then_backward(plain, x)
        off_live, _, report = _forward_then_backward(off, x)
    assert handle.counters.offloaded_bytes == RELU1 + RELU2
    assert plain_live - off_live == RELU1 + RELU2
    assert report.peak_by_tier["host"] == RELU1 + RELU2


# ---------------------------------------------------------------------------------- lifecycle
def _hook_tables(model: nn.Module) -> list:
    return [(n, dict(m._forward_hooks), dict(m._forward_pre_hooks),
             dict(m._forward_hooks_with_kwargs), dict(m._forward_hooks_always_called))
            for n, m in model.named_modules()]  # fmt: skip


def test_remove_restores_the_model():
    fresh = Stack(2, D)
    model = Stack(2, D)
    handle = apply_activation_offload(model, ALL)
    assert _hook_tables(model) != _hook_tables(fresh)
    handle.remove()
    handle.remove()  # idempotent
    assert _hook_tables(model) == _hook_tables(fresh)
    assert "_memfit_activation_offload" not in model.__dict__
    model(torch.randn(B, S, D)).sum().backward()
    assert handle.counters.offloaded_bytes == 0


def test_off_is_a_handle_that_does_nothing():
    model = _mlp()
    fresh = _mlp()
    handle = apply_activation_offload(model, OffloadConfig(optimizer="host"))
    assert _hook_tables(model) == _hook_tables(fresh)
    handle.remove()


def test_apply_twice():
    model = _mlp()
    handle = apply_activation_offload(model, ALL)
    assert apply_activation_offload(model, ALL) is handle
    with pytest.raises(RuntimeError, match="already has activation offload"):
        apply_activation_offload(model, ALL.replace(activation_min_bytes=8))
    handle.remove()
    apply_activation_offload(model, ALL.replace(activation_min_bytes=8)).remove()


def test_a_forward_that_raises_leaves_no_hooks_behind():
    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(D_IN, H1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            F.relu(self.lin(x))
            raise RuntimeError("boom")

    model = Broken()
    handle = apply_activation_offload(model, ALL)
    with pytest.raises(RuntimeError, match="boom"):
        model(_x())
    assert _no_saved_hooks()
    with pytest.raises(RuntimeError, match="boom"):
        model(_x())  # and the next forward enters them again
    assert _no_saved_hooks()
    assert handle.counters.offloaded_bytes == 2 * RELU1


def test_reset_counters():
    model = _mlp()
    handle = apply_activation_offload(model, ALL)
    model(_x()).sum().backward()
    handle.reset_counters()
    assert handle.counters.offloaded_bytes == 0 and handle.counters.host_peak_bytes == 0


# ---------------------------------------------------------------------------------- targets
def _peak_under(target: str, fake: bool) -> tuple[int, list[int]]:
    """The tracker's device peak of one forward and backward of the Stack (no dropout) with
    activation offload, the kernels of ``target`` emulated, and the bytes each block moved."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memfit.targets import emulate, get_device

    with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
        torch.manual_seed(0)
        model = Stack(N_BLOCKS, D).eval()
        handle = apply_activation_offload(model, ALL)
        per_block: list[int] = []
        for block in model.blocks:
            block.register_forward_pre_hook(lambda m, a: per_block.append(-handle.offloaded_bytes))
            block.register_forward_hook(lambda m, a, o: per_block.append(handle.offloaded_bytes))
        x = torch.randn(B, S, D)
        with emulate(get_device(target)), memfit.track(model) as tracker:
            model(x).square().mean().backward()
    moved = [a + b for a, b in zip(per_block[::2], per_block[1::2], strict=True)]
    return tracker.report().peak_by_tier["device"], moved


def test_a_cuda_target_counts_the_block_copied_back_ahead():
    """On a GPU the copy back runs one block ahead; emulating a CUDA target on the CPU (a dry
    run for a GPU) makes the same copies at the same moments, fake or real."""
    cpu, moved = _peak_under("cpu", fake=False)
    gpu, _ = _peak_under("h100", fake=False)
    assert _peak_under("h100", fake=True)[0] == gpu and _peak_under("cpu", fake=True)[0] == cpu
    # One block's storages more at the peak in backward, give or take a bookkeeping tensor of
    # autograd's that is alive at one peak and not the other.
    assert moved[1] == moved[2] and gpu - cpu == pytest.approx(moved[1], abs=256)


def test_empty_storages_stay():
    class SavesEmpty(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x.new_empty(0), x)
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            empty, _ = ctx.saved_tensors
            assert empty.numel() == 0
            return grad * 2

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x):
            return SavesEmpty.apply(self.lin(x))

    net = Net()
    handle = apply_activation_offload(net, ALL)
    net(torch.randn(B, D)).sum().backward()
    # The linear's output alone moves (its input is the caller's, its weight a parameter).
    assert handle.counters.offloaded_storages == 1
    assert handle.counters.offloaded_bytes == B * D * F32
