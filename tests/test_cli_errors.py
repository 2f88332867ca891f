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
A_FOLDER = "{tmp}/a-folder"  # an existing folder, given where a file is written

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
        "--json": [UNWRITABLE, A_FOLDER],
        "--plot": [UNWRITABLE, A_FOLDER],
        "--snapshot": [UNWRITABLE, A_FOLDER],
        "--html": [UNWRITABLE, A_FOLDER],
        "--job": None,
        "--cap": ["lots", "0"],
        "--top": ["-1"],
        "--device": ["no-such-gpu"],
        "--expert-load": ["0.5"],
        "--world-size": ["0", "3", "x"],
        "--data": [MISSING, "{tmp}/a-file", "{tmp}/bad-chat.jsonl"],
        "--tokenizer": [MISSING],
        "--text-field": ["body"],
        "--quiet": None,
        "--verbose": None,
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
        "--json": [UNWRITABLE, A_FOLDER],
        "--save": [UNWRITABLE, A_FOLDER],
        "--host-budget": ["lots"],
        "--disk-dir": [MISSING],
        "--emit": ["deepspeed"],
        "--expert-load": ["0.5"],
        "--world-size": ["0", "3", "x"],
        "--gpus-per-node": ["0", "3", "x"],
        "--jobs": ["0", "x"],
        "--data": [MISSING, "{tmp}/a-file", "{tmp}/bad-chat.jsonl"],
        "--tokenizer": [MISSING],
        "--text-field": ["body"],
        "--lora-rank": ["0", "x"],
        "--quiet": None,
        "--verbose": None,
        "--maximize": ["tokens"],
        "--budgets": ["lots"],
    },
    "train": {
        "--config": [MISSING],
        "--model": ["nonsense-model", "{tmp}/a-folder", "{tmp}/a-file"],
        "--data": [MISSING, "{tmp}/a-file", "{tmp}/bad-chat.jsonl"],
        "--tokenizer": [MISSING, "{tmp}/a-folder"],
        "--text-field": [""],
        "--batch-size": ["0", "x"],
        "--seq-len": ["0", "x"],
        "--max-steps": ["0", "x"],
        "--seed": ["x"],
        "--budget": ["lots"],
        "--json": [UNWRITABLE, A_FOLDER],
        "--cap": ["lots"],
        "--plot": [UNWRITABLE, A_FOLDER],
        "--plan": [MISSING],
        "--checkpoint-dir": ["{tmp}/a-file", "{tmp}/a-file/ck"],
        "--save-every": ["0"],
        "--nproc-per-node": ["0", "3", "x"],
        "--keep": ["0"],
        "--eval-max-batches": ["-1", "x"],
        "--resume": None,
        "--resume-mode": ["newest"],
        "--resume-from": [MISSING, "{tmp}/a-folder"],
        "--quiet": None,
        "--verbose": None,
    },
    "bench ladder": {
        "--json": [UNWRITABLE, A_FOLDER],
        "--model": ["nonsense-model"],
        "--batch-size": ["0"],
        "--seq-len": ["0"],
        "--compute-depth": ["0"],
        "--compute-seq": ["0"],
        "--markdown": [UNWRITABLE, A_FOLDER],
        "--device": ["no-such-gpu"],
        "--only": ["nonsense-rung"],
        "--quiet": None,
        "--verbose": None,
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
    (tmp_path / "a-folder").mkdir()
    # A chat record, then one without the chat fields: named by its line.
    (tmp_path / "bad-chat.jsonl").write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
        '{"prompt": "hi"}\n'
    )
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


# ------------------------------------------------------------------------------ output paths
# Every path option of every command: what it writes (a file or a folder), or that it is read.
OUTPUTS: dict[str, dict[str, str]] = {
    "profile": {"--json": "file", "--plot": "file", "--snapshot": "file", "--html": "file"},
    "plan": {"--json": "file", "--save": "file", "--disk-dir": "existing folder"},
    "train": {"--json": "file", "--plot": "file", "--checkpoint-dir": "folder"},
    "bench ladder": {"--json": "file", "--markdown": "file"},
}
INPUTS = {("profile", "--plan"), ("plan", "--plan"), ("train", "--config"), ("train", "--plan"),
          ("train", "--resume-from"),
          ("profile", "--tokenizer"), ("plan", "--tokenizer")}  # train's also takes a hub id
# What each kind of output cannot be, as a value and the end of the sentence that refuses it.
REFUSED = {
    "file": [("{tmp}/a-file/out.x", "{tmp}/a-file is a file, not a folder"),
             ("{tmp}/a-file/new/deeper/out.x", "{tmp}/a-file is a file, not a folder"),
             ("{tmp}/a-folder", "it is a folder; give a file name")],
    "folder": [("{tmp}/a-file", "it is a file, not a folder"),
               ("{tmp}/a-file/new", "{tmp}/a-file is a file, not a folder")],
    "existing folder": [("{tmp}/a-file", "it is a file, not a folder"),
                        ("{tmp}/no-such-folder", "the folder does not exist; create it first")],
}  # fmt: skip


def _path_options() -> dict[str, set[str]]:
    """Each command's options whose value is a path (read from the functions' annotations)."""
    import typing
    from pathlib import Path

    found: dict[str, set[str]] = {}

    def walk(cmd, path):
        if getattr(cmd, "commands", None):
            for name, sub in cmd.commands.items():
                walk(sub, [*path, name])
            return
        fn = getattr(cmd.callback, "__wrapped__", cmd.callback)
        hints = typing.get_type_hints(fn)
        found[" ".join(path)] = {
            p.opts[0] for p in cmd.params
            if hints.get(p.name) is Path or Path in typing.get_args(hints.get(p.name))
        }  # fmt: skip

    walk(typer.main.get_command(app), [])
    return found


def test_every_path_option_is_an_input_or_a_checked_output():
    for command, options in _path_options().items():
        outputs = set(OUTPUTS.get(command, {}))
        inputs = {o for c, o in INPUTS if c == command}
        assert options == outputs | inputs, command


@pytest.fixture
def no_work(monkeypatch):
    """Every command's work refuses to start: an output check that came too late shows."""

    def started(*args, **kwargs):
        raise AssertionError("the work started before the output paths were checked")

    import memfit.bench.ladder
    import memfit.commands.train
    import memfit.distributed.launch
    import memfit.workload

    monkeypatch.setattr(memfit.workload, "load_workload", started)
    monkeypatch.setattr(memfit.commands.train, "prepare_run", started)
    monkeypatch.setattr(memfit.distributed.launch, "launch", started)
    monkeypatch.setattr(memfit.bench.ladder, "run_ladder", started)


OUTPUT_CASES = [
    pytest.param(command, option, value, why, id=f"{command} {option} {value}")
    for command, options in OUTPUTS.items()
    for option, kind in options.items()
    for value, why in REFUSED[kind]
]


@pytest.mark.parametrize(("command", "option", "value", "why"), OUTPUT_CASES)
def test_an_unwritable_output_stops_the_command_before_any_work(
    tmp_path, no_work, command, option, value, why
):
    (tmp_path / "a-file").write_text("not a folder")
    (tmp_path / "a-folder").mkdir()
    before = sorted(tmp_path.rglob("*"))
    extra = ["--allow", "offload"] if option == "--disk-dir" else []
    path = value.format(tmp=tmp_path)
    args = [*command.split(), *BASE[command], *extra, option, path]
    res = runner.invoke(app, args, env={"COLUMNS": "1000", "NO_COLOR": "1"})
    assert res.exit_code == 2, f"{args}: exit {res.exit_code}\n{res.output}"
    assert res.output.strip() == f"error: {option} {path}: {why.format(tmp=tmp_path)}"
    assert sorted(tmp_path.rglob("*")) == before  # nothing written


def test_a_config_files_checkpoint_dir_is_checked_before_any_work(tmp_path, no_work):
    (tmp_path / "a-file").write_text("not a folder")
    (tmp_path / "run.yaml").write_text("checkpoint_dir: a-file/ck\nmax_steps: 1\n")
    res = runner.invoke(app, ["train", "--config", str(tmp_path / "run.yaml")],
                        env={"COLUMNS": "1000", "NO_COLOR": "1"})  # fmt: skip
    assert res.exit_code == 2, res.output
    assert res.output.strip() == (
        f"error: run.yaml: checkpoint_dir {tmp_path}/a-file/ck: {tmp_path}/a-file is a file, "
        "not a folder"
    )


def test_a_given_plans_disk_folder_is_checked_before_any_work(tmp_path, no_work):
    from memfit.plan import Plan

    plan = Plan(offload={"optimizer": "disk", "disk_dir": str(tmp_path / "gone")})
    plan.to_json(tmp_path / "plan.json")
    res = runner.invoke(app, ["train", "--max-steps", "1", "--plan", str(tmp_path / "plan.json")],
                        env={"COLUMNS": "1000", "NO_COLOR": "1"})  # fmt: skip
    assert res.exit_code == 2, res.output
    assert res.output.strip() == (
        f"error: the plan's offload.disk_dir {tmp_path}/gone: the folder does not exist; "
        "create it first"
    )


def test_a_missing_folder_of_a_file_output_stops_before_work(tmp_path):
    # The case: --json /no/such/dir/p.json. A file's folder is the user's to create
    # (a missing one is most likely a typo), even where it could be made.
    json_path = tmp_path / "no" / "such" / "p.json"
    res = runner.invoke(
        app,
        ["plan", *BASE["plan"], "--jobs", "1", "--json", str(json_path)],
        env={"COLUMNS": "1000", "NO_COLOR": "1"},
    )
    assert res.exit_code == 2, res.output
    assert f"the folder {tmp_path}/no/such does not exist; create it first" in res.output
    assert "Traceback" not in res.output and not (tmp_path / "no").exists()
