"""TrainConfig: one typed value behind the YAML file, the command line and the Python API."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import yaml

import memfit
from memfit.commands.train import build_config
from memfit.train import Trainer
from memfit.train.callbacks import Callback
from memfit.train.config import ConfigError, TrainConfig, field_help

from ._helpers import text_dataset, tiny_gpt2


def tiny_model_and_data():
    return tiny_gpt2(), text_dataset()


def test_defaults_are_the_zero_argument_run():
    cfg = TrainConfig()
    assert cfg.model == "byte-gpt" and cfg.max_steps == 300 and cfg.budget_bytes == 48 * 2**20
    assert cfg.data is None and cfg.plan is None and cfg.cap_bytes is None


def test_frozen_and_every_field_documented():
    cfg = TrainConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_steps = 3  # type: ignore[misc]
    for f in dataclasses.fields(TrainConfig):
        assert field_help(f.name), f"{f.name} has no docstring"


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"max_steps": 0}, "max_steps must be a whole number >= 1, got 0"),
        ({"max_steps": "ten"}, "max_steps"),
        ({"lr": -1.0}, "lr must be > 0"),
        ({"eval_fraction": 1.0}, "eval_fraction must be at least 0 and below 1"),
        ({"schedule": "cosin"}, "schedule 'cosin' is not known"),
        ({"budget": "lots"}, "budget"),
        ({"cap": "12 parsecs"}, "cap"),
        ({"checkpoint_every": 5}, "checkpoint_every needs checkpoint_dir"),
        ({"resume": True}, "resume needs checkpoint_dir"),
        ({"eval_every": 5, "eval_fraction": 0.0}, "eval_every needs evaluation samples"),
        ({"plan": memfit.Plan(), "allow": ("freeze",)}, "allow steers the planner"),
        ({"data": ()}, "data is an empty list"),
        ({"max_stepz": 3}, "max_steps"),  # the closest known name is suggested
    ],
)
def test_a_bad_setting_is_one_sentence_naming_it(changes, needle):
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_dict(changes)
    message = str(info.value)
    assert needle in message, message
    assert "\n" not in message
    assert isinstance(info.value, ValueError)


def test_yaml_keys_are_fields_and_relative_paths_follow_the_file(tmp_path):
    (tmp_path / "sub").mkdir()
    path = tmp_path / "sub" / "run.yaml"
    path.write_text(yaml.safe_dump({"data": ["a.txt"], "max_steps": 7, "seq_len": 64}))
    cfg = TrainConfig.from_yaml(path)
    assert cfg.data == (str(tmp_path / "sub" / "a.txt"),)
    assert (cfg.max_steps, cfg.seq_len) == (7, 64)
    assert TrainConfig.from_yaml(path, max_steps=9).max_steps == 9


@pytest.mark.parametrize(
    "text, needle",
    [
        ("", "is empty"),
        ("- a\n- b\n", "must be a mapping"),
        ("max_steps: [1\n", "is not valid YAML"),
        ("batchsize: 4\n", "did you mean 'batch_size'"),
    ],
)
def test_bad_yaml_files(tmp_path, text, needle):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        TrainConfig.from_yaml(path)


def test_round_trip_through_plain_data():
    cfg = TrainConfig(data=("x.txt",), max_steps=5, plan=memfit.Plan(grad_accum_steps=2))
    again = TrainConfig.from_dict(cfg.to_dict())
    assert again == cfg


def test_command_line_flags_override_the_file_and_are_named_as_flags(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"max_steps": 7, "seed": 3}))
    cfg = build_config(path, {"max_steps": 2})
    assert (cfg.max_steps, cfg.seed) == (2, 3)
    with pytest.raises(ConfigError, match=r"^--max-steps must be a whole number >= 1, got 0$"):
        build_config(path, {"max_steps": 0})
    path.write_text(yaml.safe_dump({"max_steps": 0}))
    with pytest.raises(ConfigError, match=r"^run\.yaml: max_steps must be"):
        build_config(path, {})


def test_typer_options_are_the_config_fields():
    """Every option of ``memfit train`` that sets a setting names a TrainConfig field."""
    from memfit.commands.train import _FLAG_NAMES, train

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    hints = typing.get_type_hints(train, include_extras=True)
    own = {"config", "json_path", "plot", "plan_path", "return", "quiet", "verbose"}
    # --resume-mode carries the word after --resume (the field resume).
    renamed_words = {"resume_mode": "resume"}
    # Options named after the words rather than the field (--save-every, --keep).
    renamed = {"save_every": "checkpoint_every", "keep": "keep_checkpoints"}
    for field, flag in _FLAG_NAMES.items():
        assert renamed[flag.replace("-", "_")] == field
    for name in hints:
        if name not in own:
            assert renamed.get(name, renamed_words.get(name, name)) in fields, name


def test_the_trainer_reads_its_config_and_keywords_override_it():
    model, data = tiny_model_and_data()
    cfg = TrainConfig(max_steps=3, batch_size=4, seed=1, warmup_steps=0)
    trainer = Trainer(model, memfit.Plan(), data, config=cfg, progress=False)
    assert trainer.config is not cfg and trainer.config == cfg.replace(plan=None)
    assert (trainer.max_steps, trainer.batch_size, trainer.seed) == (3, 4, 1)
    trainer = Trainer(model, memfit.Plan(), data, config=cfg, max_steps=2, progress=False)
    assert trainer.max_steps == 2 and trainer.config.batch_size == 4
    assert trainer.fit().steps == 2
    with pytest.raises(TypeError, match="config must be a TrainConfig"):
        Trainer(model, memfit.Plan(), data, config={"max_steps": 2})
    with pytest.raises(ConfigError, match="max_steps must be"):
        Trainer(model, memfit.Plan(), data, max_steps=0)


def test_callbacks_run_in_order_around_every_step():
    model, data = tiny_model_and_data()
    events: list[str] = []

    class Recorder(Callback):
        def on_fit_start(self, trainer):
            events.append("start")

        def on_step_end(self, trainer, info):
            events.append(f"step{info.step}")

        def on_fit_end(self, trainer, result):
            events.append(f"end{result.steps}")

    trainer = Trainer(
        model, memfit.Plan(), data, max_steps=2, batch_size=4, progress=False, callbacks=[Recorder()]
    )
    trainer.fit()
    assert events == ["start", "step1", "step2", "end2"]
