"""Every command and option of the CLI, given bad values: exit code 2, one clear sentence, no
traceback. The test walks the live command tree, so a new option without bad values listed
here fails :func:`test_every_option_has_bad_values_listed`."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from memfit.cli import app

runner = CliRunner()
MISSING = "no/such/file.yaml"
UNWRITABLE = "{tmp}/a-file/out.json"  # its parent is a file: cannot be written

# The smallest valid invocation of each command, to which one bad option is added.
BASE = {
    "profile": ["--model", "gpt2-tiny", "--dry-run"],
    "plan": ["--model", "gpt2-tiny", "--budget", "1GiB"],
    "train": ["--max-steps", "1"],
    "bench ladder": ["--model", "gpt2-tiny"],
}
# option -> bad values (None: a flag, nothing to get wrong).
BAD: dict[str, dict[str, list[str] | None]] = {
    "profile": {
        "--model": ["nonsense-model"],
        "--batch-size": ["0", "abc"],
        "--seq-len": ["0"],
        "--dry-run": None,
        "--steps": ["0"],
        "--plan": [MISSING],
        "--json": [UNWRITABLE],
        "--plot": [UNWRITABLE],
        "--cap": ["lots", "0"],
        "--top": ["-1"],
        "--device": ["no-such-gpu"],
        "--expert-load": ["0.5"],
        "--world-size": ["0", "3", "x"],
    },
    "plan": {
        "--model": ["nonsense-model"],
        "--budget": ["lots", "0"],
        "--batch-size": ["0"],
        "--seq-len": ["0"],
        "--allow": ["teleportation"],
        "--forbid": ["teleportation"],
        "--device": ["no-such-gpu"],
        "--plan": [MISSING],
        "--json": [UNWRITABLE],
        "--save": [UNWRITABLE],
        "--host-budget": ["lots"],
        "--disk-dir": [MISSING],
        "--emit": ["deepspeed"],
        "--world-size": ["0", "3", "x"],
        "--gpus-per-node": ["0", "3", "x"],
        "--jobs": ["0", "x"],
    },
    "train": {
        "--config": [MISSING],
        "--max-steps": ["0", "x"],
        "--seed": ["x"],
        "--budget": ["lots"],
        "--json": [UNWRITABLE],
        "--cap": ["lots"],
        "--plot": [UNWRITABLE],
        "--plan": [MISSING],
        "--checkpoint-dir": ["{tmp}/a-file"],
        "--save-every": ["0"],
        "--nproc-per-node": ["0", "3", "x"],
        "--keep": ["0"],
        "--resume": None,
    },
    "bench ladder": {
        "--json": [UNWRITABLE],
        "--model": ["nonsense-model"],
        "--batch-size": ["0"],
        "--seq-len": ["0"],
        "--compute-depth": ["0"],
        "--compute-seq": ["0"],
        "--markdown": [UNWRITABLE],
        "--device": ["no-such-gpu"],
        "--only": ["nonsense-rung"],
    },
}
# Options whose bad value is only bad together with another option.
NEEDS = {("train", "--save-every"): ["--checkpoint-dir", "{tmp}/ck"]}


def _commands() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}

    def walk(cmd, path):
        subs = getattr(cmd, "commands", None)
        if subs:
            for name, sub in subs.items():
                walk(sub, [*path, name])
        else:
            found[" ".join(path)] = [p.opts[0] for p in cmd.params if p.opts]

    walk(typer.main.get_command(app), [])
    return found


def test_every_option_has_bad_values_listed():
    commands = _commands()
    assert set(commands) == set(BAD)
    for name, options in commands.items():
        assert set(options) == set(BAD[name]), name


CASES = [
    pytest.param(command, option, value, id=f"{command} {option} {value}")
    for command, options in BAD.items()
    for option, values in options.items()
    for value in values or ()
]


@pytest.mark.parametrize(("command", "option", "value"), CASES)
def test_bad_values_exit_2_with_one_sentence(tmp_path, command, option, value):
    (tmp_path / "a-file").write_text("not a folder")
    fill = {"tmp": str(tmp_path)}
    extra = [a.format(**fill) for a in NEEDS.get((command, option), [])]
    if command == "train" and option == "--resume":
        extra = []
    args = [*command.split(), *BASE[command], *extra, option, value.format(**fill)]
    res = runner.invoke(app, args, env={"COLUMNS": "1000", "NO_COLOR": "1"})
    output = res.output
    assert res.exit_code == 2, f"{args}: exit {res.exit_code}\n{output}"
    assert "Traceback" not in output
    if "Usage:" in output:  # the option parser's own message (a value of the wrong type)
        assert "Invalid value" in output
    else:
        lines = [ln for ln in output.splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("error:")]
        assert len(errors) == 1, output
        sentence = errors[0].removeprefix("error:").strip()
        assert sentence and "\n" not in sentence


def test_resume_without_a_checkpoint_folder_is_one_sentence():
    res = runner.invoke(app, ["train", "--max-steps", "1", "--resume"], env={"COLUMNS": "1000"})
    assert res.exit_code == 2
    assert "--resume needs checkpoint_dir" in res.output


def test_a_corrupt_checkpoint_on_resume_is_one_sentence(tmp_path):
    from memfit.train.checkpoint import save_checkpoint

    from .train._helpers import tiny_gpt2

    path = save_checkpoint(tmp_path, 1, tiny_gpt2())
    data = bytearray((path / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (path / "model.safetensors").write_bytes(bytes(data))
    res = runner.invoke(
        app,
        ["train", "--max-steps", "2", "--plan", _plain_plan(tmp_path), "--checkpoint-dir",
         str(tmp_path), "--resume"],
        env={"COLUMNS": "1000"},
    )  # fmt: skip
    assert res.exit_code == 2, res.output
    assert "is corrupt: the checksum of model.safetensors does not match" in res.output
    assert "Traceback" not in res.output


def _plain_plan(tmp_path) -> str:
    from memfit.plan import Plan

    p = tmp_path / "plan.json"
    Plan().to_json(p)
    return str(p)
