"""Parameter offload: the same loss and gradients as the plain model, with the device holding
the parameters outside the blocks plus two blocks' parameters, as the tracker measures."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import memfit
from memfit.apply.compose import apply_plan
from memfit.strategies.checkpointing import CheckpointConfig, apply_checkpointing
from memfit.strategies.offload import OffloadConfig, host_copy_of
from memfit.strategies.parameter_offload import apply_parameter_offload

N_LAYER = 4
HOST = OffloadConfig(parameters="host")


def _gpt2(n_layer: int = N_LAYER) -> transformers.GPT2LMHeadModel:
    config = transformers.GPT2Config(n_embd=64, n_layer=n_layer, n_head=2, vocab_size=256,
                                     n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def _nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _shape_bytes(model: transformers.GPT2LMHeadModel) -> tuple[int, int]:
    """(bytes of the parameters outside the blocks, bytes of one block), from the shapes."""
    block = _nbytes(model.transformer.h[0].parameters())
    outside = _nbytes(model.parameters()) - N_LAYER * block  # wte (tied head), wpe, ln_f
    return outside, block


def _grads(model, handle=None) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None and handle is not None:
            g = handle.host_grad(p)
        out[name] = g
    return out


def _assert_same_grads(expected, got) -> None:
    assert expected.keys() == got.keys()
    for name, g in expected.items():
        assert got[name] is not None, name
        torch.testing.assert_close(got[name], g, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_same_loss_and_gradients_as_the_plain_model(checkpointing):
    plain = _gpt2()
    model = copy.deepcopy(plain)
    if checkpointing:
        apply_checkpointing(plain, CheckpointConfig(mode="full"))
        apply_checkpointing(model, CheckpointConfig(mode="full"))
    handle = apply_parameter_offload(model, HOST)
    assert handle.blocks == [f"transformer.h.{i}" for i in range(N_LAYER)]
    for seed in range(2):  # the host gradients accumulate like .grad does
        expected = plain(**_batch(seed)).loss
        expected.backward()
        loss = model(**_batch(seed)).loss
        loss.backward()
        torch.testing.assert_close(loss, expected, rtol=0, atol=1e-6)
    _assert_same_grads(_grads(plain), _grads(model, handle))
    # No gradient of an offloaded parameter stays on the device; every block was fetched for
    # its forward and for its backward (twice per micro-batch).
    assert all(p.grad is None for p in model.transformer.h.parameters())
    assert handle.fetches == 2 * 2 * N_LAYER


def test_with_activation_offload_parameters_are_not_copied_as_activations():
    from memfit.strategies.activation_offload import apply_activation_offload

    config = OffloadConfig(activations=True, activation_min_bytes=0)
    plain = _gpt2()
    model = copy.deepcopy(plain)
    alone = apply_activation_offload(plain, config)
    moved = apply_activation_offload(model, config)
    handle = apply_parameter_offload(model, HOST)
    expected = plain(**_batch()).loss
    expected.backward()
    loss = model(**_batch()).loss
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-6)
    _assert_same_grads(_grads(plain), _grads(model, handle))
    # The weights saved for backward are still recognised as parameters (their storages keep
    # their identity while released): activation offload moves exactly what it moves alone.
    assert moved.counters.offloaded_bytes == alone.counters.offloaded_bytes > 0
    handle.remove()
    moved.remove()


def test_the_device_holds_two_blocks_and_the_host_holds_the_rest():
    plain = _gpt2()
    model = copy.deepcopy(plain)
    handle = apply_parameter_offload(model, HOST)
    outside, block = _shape_bytes(model)
    assert handle.offloaded_bytes == N_LAYER * block
    reports, after_backward = {}, {}
    for key, m in (("plain", plain), ("offloaded", model)):
        with memfit.track(m) as tracker:
            m(**_batch()).loss.backward()
            after_backward[key] = tracker.snapshot()["parameters"]
        reports[key] = tracker.report()
    # After backward every block is released: live device parameters are the outside ones.
    assert after_backward == {"plain": outside + N_LAYER * block, "offloaded": outside}
    before, after = reports["plain"], reports["offloaded"]
    assert before.peak_by_category["parameters"] == outside + N_LAYER * block
    assert after.peak_by_category["parameters"] == outside + 2 * block
    assert before.peak_bytes - after.peak_bytes >= (N_LAYER - 2) * block
    # On the host: the parameters' copies and their gradients, nothing of that on the device.
    assert after.peak_by_tier["host"] == 2 * N_LAYER * block
    host = after.peak_by_tier_category["host"]
    assert host["parameters"] == host["gradients"] == N_LAYER * block
    assert before.peak_by_tier["host"] == 0


def test_remove_puts_the_parameters_back_on_the_device():
    plain = _gpt2()
    model = copy.deepcopy(plain)
    handle = apply_parameter_offload(model, HOST)
    plain(**_batch()).loss.backward()
    model(**_batch()).loss.backward()
    handle.remove()
    handle.remove()  # idempotent
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q), name
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size(), name
        assert host_copy_of(p) is None
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6)
    assert not any(b._forward_pre_hooks or b._forward_hooks for b in model.transformer.h)
    assert not hasattr(model, "_memfit_parameter_offload")
    apply_parameter_offload(model, HOST).remove()  # can be applied again


def test_gathered_brings_every_parameter_and_keeps_edits():
    model = _gpt2()
    handle = apply_parameter_offload(model, HOST)
    weight = model.transformer.h[1].mlp.c_fc.weight
    assert weight.untyped_storage().nbytes() == 0
    with handle.gathered():
        state = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            weight.fill_(0.5)
    assert weight.untyped_storage().nbytes() == 0
    assert torch.equal(host_copy_of(weight), torch.full_like(weight, 0.5))
    handle.remove()
    assert torch.equal(weight, torch.full_like(weight, 0.5))
    assert state["transformer.h.1.mlp.c_fc.weight"].abs().sum() > 0


def test_state_dicts_read_and_write_the_host_copies():
    plain = _gpt2()
    model = copy.deepcopy(plain)
    handle = apply_parameter_offload(model, HOST)
    state = model.state_dict()
    expected = plain.state_dict()
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(state[key], value), key
    # Loading goes to the host copies; the device storages stay released.
    other = _gpt2()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(2)
    model.load_state_dict(other.state_dict())
    weight = model.transformer.h[3].attn.c_proj.weight
    assert weight.untyped_storage().nbytes() == 0
    torch.testing.assert_close(model(**_batch()).loss, other(**_batch()).loss, rtol=0, atol=1e-6)
    handle.remove()
    assert torch.equal(weight, other.transformer.h[3].attn.c_proj.weight)


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_plan_with_optimizer_offload_trains_like_optimizer_offload_alone(checkpointing):
    reference, model = _gpt2(), _gpt2()
    common = dict(max_grad_norm=1.0, grad_accum_steps=2, checkpointing=checkpointing)
    ref = apply_plan(reference, memfit.Plan(**common, offload="host"))
    setup = apply_plan(model, memfit.Plan(
        **common, offload={"optimizer": "host", "parameters": "host"}))  # fmt: skip
    assert setup.info["parameter_offload"] == [f"transformer.h.{i}" for i in range(N_LAYER)]
    assert "offload optimizer on host + parameters on host" in setup.plan.summary()
    # fp32 parameters: the optimizer's master is the host copy itself (one host copy).
    block_param = model.transformer.h[0].attn.c_attn.weight
    assert any(m is host_copy_of(block_param) for m in setup.optimizer.masters)
    for step in range(3):
        torch.testing.assert_close(setup.step(_batch(step)), ref.step(_batch(step)),
                                   rtol=0, atol=1e-6)  # fmt: skip
    setup.remove()
    ref.remove()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=name)


def test_plan_tracker_shows_two_blocks_on_the_device():
    model = _gpt2()
    outside, block = _shape_bytes(model)
    setup = apply_plan(model, memfit.Plan(offload={"optimizer": "host", "parameters": "host"}))
    with memfit.track(model, setup.optimizer) as tracker:
        for step in range(2):
            setup.step(_batch(step))
    report = tracker.report()
    assert report.peak_by_category["parameters"] == outside + 2 * block
    assert report.peak_by_category["optimizer_state"] == 0


def test_bf16_pure_streams_bf16_copies_beside_fp32_masters():
    model = _gpt2()
    setup = apply_plan(model, memfit.Plan(
        precision="bf16-pure", offload={"optimizer": "host", "parameters": "host"}))  # fmt: skip
    for step in range(2):
        setup.step(_batch(step))
    weight = model.transformer.h[2].mlp.c_proj.weight
    master = setup.optimizer.masters[[id(p) for p in setup.optimizer.params].index(id(weight))]
    assert host_copy_of(weight).dtype == torch.bfloat16 and master.dtype == torch.float32
    assert torch.equal(host_copy_of(weight), master.to(torch.bfloat16))
    setup.remove()
    # Back on the device in fp32, with the bf16 values trained (as without parameter offload).
    assert weight.dtype == torch.float32
    assert torch.equal(weight, master.to(torch.bfloat16).float())


def test_refusals():
    with pytest.raises(ValueError, match="'disk' is not available yet"):
        OffloadConfig(parameters="disk", disk_dir="/tmp")
    with pytest.raises(memfit.PlanError, match="needs optimizer offload"):
        memfit.Plan(offload={"parameters": "host"})
    with pytest.raises(ValueError, match="cannot be combined with compile"):
        apply_plan(_gpt2(), memfit.Plan(
            compile=True, offload={"optimizer": "host", "parameters": "host"}))  # fmt: skip
    with pytest.raises(ValueError, match="has none"):
        apply_parameter_offload(torch.nn.Linear(4, 4), HOST)
    model = _gpt2()
    apply_parameter_offload(model, HOST)
    with pytest.raises(ValueError, match="already applied"):
        apply_parameter_offload(model, HOST)


@pytest.mark.slow  # builds the model four times (about 5 s in the suite, 13 s alone)
def test_dry_run_predicts_the_real_peak(tmp_path):
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps(_gpt2().config.to_dict()))
    plan = memfit.Plan(offload={"optimizer": "host", "parameters": "host"})
    real = memfit.measure(str(path), plan, batch_size=2, seq_len=16, steps=2)
    dry = memfit.dry_run(str(path), plan, batch_size=2, seq_len=16, steps=2)
    plain = memfit.dry_run(str(path), memfit.Plan(offload="host"), batch_size=2, seq_len=16,
                           steps=2)  # fmt: skip
    assert dry.peak_by_category == real.peak_by_category
    assert dry.peak_bytes == real.peak_bytes
    outside, block = _shape_bytes(_gpt2())
    assert plain.peak_by_category["parameters"] == outside + N_LAYER * block
    assert dry.peak_by_category["parameters"] == outside + 2 * block
