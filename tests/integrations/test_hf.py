"""memfit plans inside the stock Hugging Face Trainer (CPU, tiny random GPT-2)."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from memfit import Plan  # noqa: E402
from memfit.integrations import hf  # noqa: E402

VOCAB, SEQ, N = 64, 16, 32


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


class _Data(torch.utils.data.Dataset):
    """A learnable sequence: token t+1 = token t + 1 (mod VOCAB)."""

    def __init__(self, n: int = N) -> None:
        g = torch.Generator().manual_seed(1)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        self.ids = (start + torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        # Position 0 is never a target (labels shift); -100 there makes every count of label
        # tokens agree (transformers' num_items_in_batch may count the unshifted labels).
        labels = self.ids[i].clone()
        labels[0] = -100
        return {"input_ids": self.ids[i], "labels": labels}


def _args(tmp_path, **kw) -> TrainingArguments:
    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no",
                per_device_train_batch_size=8, num_train_epochs=1, logging_steps=1,
                learning_rate=1e-2, lr_scheduler_type="constant", seed=0,
                dataloader_drop_last=True, disable_tqdm=True)
    base.update(kw)
    return TrainingArguments(**base)


class _Recorder(transformers.TrainerCallback):
    """Stands for a reporter (TensorBoard, W&B): what on_log hands it."""

    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def _train(model, plan, tmp_path, epochs=1, **kw):
    args, optimizers, callbacks = hf.apply(plan, model, _args(tmp_path, num_train_epochs=epochs,
                                                                **kw))
    recorder = _Recorder()
    # The recorder goes first, as the Trainer's reporters do; memfit's callback must still
    # reach it with its numbers.
    trainer = Trainer(model=model, args=args, optimizers=optimizers,
                      callbacks=[recorder, *callbacks], train_dataset=_Data())
    trainer.train()
    trainer.recorder = recorder
    return trainer, callbacks[0]


def test_loss_falls_and_report_written(tmp_path):
    plan = Plan(optimizer={"name": "adamw", "lr": 1e-2}, checkpointing="selective")
    trainer, cb = _train(tiny_gpt2(), plan, tmp_path, epochs=4)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 16
    assert sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3
    logged = [h for h in trainer.recorder.logs if "memfit/peak_bytes" in h]
    assert len(logged) == 16
    assert logged and all(h["memfit/peak_bytes"] > 0 for h in logged)
    assert (tmp_path / "memfit_report.json").exists()
    assert cb.report.peak_bytes == max(h["memfit/peak_bytes"] for h in logged)


def test_figures_reach_log_history_and_reporters_on_both_sides(tmp_path):
    """Trainer.log copies ``logs`` into ``state.log_history`` before any on_log: memfit's
    figures are in the history (what trainer_state.json saves) and reach a reporter called
    before memfit's callback (as TensorBoard and W&B are) and one called after it."""
    model = tiny_gpt2()
    args, optimizers, callbacks = hf.apply(Plan(optimizer={"name": "adamw", "lr": 1e-2}), model,
                                           _args(tmp_path))
    before, after = _Recorder(), _Recorder()
    trainer = Trainer(model=model, args=args, optimizers=optimizers,
                      callbacks=[before, *callbacks, after], train_dataset=_Data())
    trainer.train()
    history = [h for h in trainer.state.log_history if "loss" in h]
    assert len(history) == N // 8
    for h in history:
        assert h["memfit/peak_bytes"] >= h["memfit/live_bytes"] > 0
    seen = [{k: v for k, v in h.items() if k != "step"} for h in history]
    assert [h for h in before.logs if "loss" in h] == seen
    assert [h for h in after.logs if "loss" in h] == seen
    assert max(h["memfit/peak_bytes"] for h in history) == callbacks[0].report.peak_bytes
    # The Trainer's log is its own again once training ends.
    assert "log" not in vars(trainer)


def test_plan_fields_reach_training_args(tmp_path):
    plan = Plan(micro_batch_size=4, grad_accum_steps=2, precision="bf16-mixed",
                checkpointing="full", max_grad_norm=1.0, sequence={"group_by_length": True},
                freeze=("transformer.wte.*",), optimizer={"name": "adafactor", "lr": 1e-2})
    model = tiny_gpt2()
    args, (opt, sched), cbs = hf.apply(plan, model, _args(tmp_path))
    assert args.gradient_accumulation_steps == 2
    assert args.per_device_train_batch_size == 4
    assert args.bf16 and not args.fp16
    flag, kwargs = hf._checkpoint_names(hf._args_fields(args))  # activation_ from 5.2x
    assert getattr(args, flag)
    assert getattr(args, kwargs) == {"use_reentrant": False}
    assert args.max_grad_norm == 1.0
    assert args.train_sampling_strategy == "group_by_length"
    assert not model.transformer.wte.weight.requires_grad
    assert type(opt).__name__ == "Adafactor" and sched is None
    assert all(p.requires_grad for g in opt.param_groups for p in g["params"])
    assert isinstance(cbs[0], hf.MemfitCallback)


def _record_micro_batches(model) -> list[torch.Tensor]:
    """The micro-batches the Trainer feeds ``model`` in training, in order (to replay them)."""
    seen: list[torch.Tensor] = []
    model.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["input_ids"].clone()) if m.training else None,
        with_kwargs=True,
    )
    return seen


def _plain_loop(model, steps_batches, accum, max_norm, stale_clip):
    """The reference: plain torch, micro-batch mean losses / accum, clipping, SGD momentum.

    ``stale_clip``: clip step t with the norm of step t-1's unclipped gradient (no clipping at
    the first step), which is what the fused step's ``approx`` mode promises. ``max_norm``
    ``None``: no clipping. Returns each step's unclipped gradient norm.
    """
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    prev = None
    norms = []
    for micro in steps_batches:
        for ids in micro:
            (model(input_ids=ids, labels=ids).loss / accum).backward()
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
        if max_norm is None:
            pass
        elif not stale_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        else:
            grads = [p.grad for p in model.parameters()]
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            if prev is not None:
                coef = torch.clamp(max_norm / (prev + 1e-6), max=1.0)
                for g in grads:
                    g.mul_(coef)
            prev = norm
        opt.step()
        opt.zero_grad(set_to_none=True)
    return norms


@pytest.mark.parametrize("fused", [False, True])
def test_accumulation_clipping_numerics_match_plain_loop(tmp_path, fused):
    """Accumulation 2 over micro-batches of 4, clipping at 0.5 (the gradient norm is about 1,
    so every step clips): exact clipping through the Trainer, or the fused step with approx
    clipping; parameters equal a plain torch loop on the same micro-batches."""
    plan = Plan(micro_batch_size=4, grad_accum_steps=2,
                optimizer={"name": "sgd", "lr": 0.1, "kwargs": {"momentum": 0.9}},
                optimizer_in_backward=fused, max_grad_norm=0.5,
                grad_clip_mode="approx" if fused else "exact")
    model = tiny_gpt2()
    ref = copy.deepcopy(model)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    seen = _record_micro_batches(model)
    _train(model, plan, tmp_path, per_device_train_batch_size=4)
    assert len(seen) == N // 4
    _plain_loop(ref, [seen[i:i + 2] for i in range(0, len(seen), 2)], 2, 0.5, stale_clip=fused)
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert not torch.equal(p, init[n]), n  # it trained
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("max_norm", [None, 0.5], ids=["no-clip", "approx-clip"])
def test_fused_step_logs_the_true_grad_norm(tmp_path, max_norm):
    """The Trainer measures grad_norm after backward, when the fused step has freed every
    gradient; the logged grad_norm is still each step's true unclipped norm: that of a plain
    run's accumulated gradient over the same micro-batches, to float32 rounding."""
    plan = Plan(micro_batch_size=4, grad_accum_steps=2,
                optimizer={"name": "sgd", "lr": 0.1, "kwargs": {"momentum": 0.9}},
                optimizer_in_backward=True, max_grad_norm=max_norm, grad_clip_mode="approx")
    model = tiny_gpt2()
    ref = copy.deepcopy(model)
    seen = _record_micro_batches(model)
    trainer, _ = _train(model, plan, tmp_path, per_device_train_batch_size=4)
    steps = [seen[i:i + 2] for i in range(0, len(seen), 2)]
    want = torch.stack(_plain_loop(ref, steps, 2, max_norm, stale_clip=True))
    logged = torch.tensor([h["grad_norm"] for h in trainer.state.log_history if "loss" in h])
    assert len(logged) == len(want) == N // 8
    assert (want > 0.5).all()  # so clipping binds in the approx-clip case
    torch.testing.assert_close(logged, want, rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    ("plan", "words"),
    [
        (Plan(offload="host"), "offload"),
        (Plan(optimizer_in_backward=True, max_grad_norm=1.0), "approx"),
        (Plan(max_seq_len=8), "max_length"),
        (Plan(loss_normalization="tokens"), "num_items_in_batch"),
    ],
)
def test_unsupported_combinations_refused(tmp_path, plan, words):
    model = tiny_gpt2()
    with pytest.raises(ValueError, match=words):
        hf.apply(plan, model, _args(tmp_path))
    assert all(p.requires_grad for p in model.parameters())


def test_emit_names_arguments_and_code():
    text = hf.emit(Plan(grad_accum_steps=4, checkpointing="full", precision="bf16-mixed"))
    assert "gradient_accumulation_steps=4," in text
    assert "activation_checkpointing=True," in text
    assert "bf16=True," in text
    assert "hf.apply(plan, model, args)" in text


def test_cli_emit_hf_and_unknown_emit():
    from typer.testing import CliRunner

    from memfit.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["plan", "-m", "tests.models:mlp_workload", "-b", "4", "-l", "1",
                              "--budget", "1GiB", "--emit", "hf"])
    assert res.exit_code == 0, res.output
    assert "gradient_accumulation_steps=" in res.output
    assert "hf.apply(plan, model, args)" in res.output
    res = runner.invoke(app, ["plan", "-m", "tests.models:mlp_workload", "--budget", "1GiB",
                              "--emit", "lightning-x"])
    assert res.exit_code == 2
    assert "--emit 'lightning-x' is not known" in res.output
    assert "Traceback" not in res.output


def _make_batch(model, batch_size, seq_len):
    ids = torch.randint(0, VOCAB, (batch_size, seq_len))
    labels = ids.clone()
    labels[:, 0] = -100
    return {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("checkpointing", ["none", "selective"])
def test_tracker_peak_matches_dry_run(tmp_path, checkpointing):
    """The callback's measured peak over a whole Trainer run is within 5% of memfit.dry_run's
    prediction for the same plan, batch and length (measured: 2.7% and 0.6% under)."""
    import memfit
    from memfit.workload import Workload

    plan = Plan(micro_batch_size=4, grad_accum_steps=2, checkpointing=checkpointing,
                optimizer={"name": "adamw", "lr": 1e-3})
    workload = Workload(name="tiny-gpt2", batch_size=8, seq_len=SEQ, build_model=tiny_gpt2,
                        make_batch=_make_batch)
    predicted = memfit.dry_run(workload, plan).peak_bytes
    _, cb = _train(tiny_gpt2(), plan, tmp_path, per_device_train_batch_size=8)
    measured = cb.report.peak_bytes
    assert abs(measured - predicted) <= 0.05 * predicted, (measured, predicted)
    # The states the plan fixes are exact: AdamW's two fp32 moments per trainable parameter.
    n = sum(p.numel() for p in tiny_gpt2().parameters())
    assert cb.report.peak_by_category["optimizer_state"] >= 8 * n


@pytest.mark.parametrize("fused", [False, True])
def test_fused_step_drops_gradient_memory_in_the_trainer(tmp_path, fused):
    """The plain run holds every fp32 gradient at once (4 bytes per parameter); the fused step
    inside the Trainer frees each gradient as it steps, and its peak holds none."""
    plan = Plan(micro_batch_size=8, optimizer={"name": "adamw", "lr": 1e-3},
                optimizer_in_backward=fused)
    model = tiny_gpt2()
    n = sum(p.numel() for p in model.parameters())
    _, cb = _train(model, plan, tmp_path, per_device_train_batch_size=8)
    most_grads = max(cb.report.timeline["gradients"])
    if fused:
        # At most one module's own parameters at once (one backward node makes them), plus the
        # tied embedding/head's first partial gradient, held until its second use.
        bucket = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
        assert most_grads <= 4 * (bucket + model.transformer.wte.weight.numel()) < 4 * n
        assert cb.report.peak_by_category["gradients"] == 0
    else:
        assert most_grads == 4 * n


def test_memfit_checkpointing_modes_and_bf16_pure_reach_the_model(tmp_path):
    from memfit.strategies.checkpointing import checkpointed_blocks

    model = tiny_gpt2()
    args, _, _ = hf.apply(Plan(checkpointing="selective", precision="bf16-pure"), model,
                          _args(tmp_path))
    flag, _ = hf._checkpoint_names(hf._args_fields(args))  # activation_ from 5.2x
    assert not getattr(args, flag) and not args.bf16
    assert checkpointed_blocks(model) == ["transformer.h.0", "transformer.h.1"]
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_emitted_python_runs_and_trains(tmp_path):
    # --emit hf's text is Python as it stands: executed, it builds the plan and its train()
    # trains a model in the Trainer under it (the plan's TrainingArguments set).
    plan = Plan(grad_accum_steps=2, checkpointing="full", optimizer={"name": "adamw", "lr": 1e-2})
    namespace: dict = {}
    exec(compile(hf.emit(plan), "emitted.py", "exec"), namespace)
    assert namespace["plan"] == plan
    trainer = namespace["train"](
        tiny_gpt2(), _Data(), output_dir=str(tmp_path), use_cpu=True, report_to=[],
        save_strategy="no", per_device_train_batch_size=4, num_train_epochs=1, logging_steps=1,
        disable_tqdm=True,
    )
    assert trainer.args.gradient_accumulation_steps == 2
    assert trainer.state.global_step == N // (4 * 2)
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert losses and all(loss == loss for loss in losses)  # finite, no NaN


def test_cli_emit_hf_output_runs_as_python():
    from typer.testing import CliRunner

    from memfit.cli import app

    res = CliRunner().invoke(app, ["plan", "-m", "tests.models:mlp_workload", "-b", "4", "-l",
                                   "1", "--budget", "1GiB", "--emit", "hf"])
    assert res.exit_code == 0, res.output
    assert res.stderr == ""  # all of it is the Python: memfit plan ... --emit hf > run.py
    namespace: dict = {}
    exec(compile(res.output, "memfit-plan-emit-hf.py", "exec"), namespace)
    assert isinstance(namespace["plan"], Plan) and callable(namespace["train"])
    # The answer's words are still there, as comments above the code.
    assert "# plan: " + namespace["plan"].summary() in res.stdout.splitlines()
    assert "# Candidates weighed against a budget of 1.00 GiB" in res.stdout
