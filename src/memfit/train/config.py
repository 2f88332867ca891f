"""The run's settings as one typed value: :class:`TrainConfig`.

One frozen dataclass drives the three ways in:

* the YAML file of ``memfit train --config run.yaml`` (:meth:`TrainConfig.read_yaml`, whose keys
  are the field names; relative paths are taken from the file's folder),
* the options of ``memfit train`` (``--max-steps`` sets ``max_steps``; their help is the field's
  docstring, :func:`field_help`),
* the Python API: ``Trainer(model, plan, data, config=TrainConfig(max_steps=200))``.

Every value is checked when the config is built, alone and against the others, so a bad setting
fails with one sentence (:class:`ConfigError`) before anything is built or planned.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import itertools
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import MemfitError, check_names
from ..optim.schedule import LR_SCHEDULES
from ..plan import Plan

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_EVAL_BATCHES",
    "ConfigError",
    "TrainConfig",
    "field_help",
]

#: Samples per step when neither the config nor a workload says.
DEFAULT_BATCH_SIZE = 16

#: Batches an evaluation reads when ``eval_max_batches`` is not given: 16 batches of the
#: training step's shape, the tokens of 16 training steps (see ``TrainConfig.eval_max_batches``).
DEFAULT_EVAL_BATCHES = 16

# Fields that name files or folders: a YAML file's relative paths are taken from its folder.
#: The budget when none is given: the built-in demo's, below what its plain plan needs.
DEFAULT_BUDGET = "48MiB"
_PATH_FIELDS = ("data", "tokenizer", "checkpoint_dir", "plan", "resume_from")


class ConfigError(MemfitError, ValueError):
    """A setting of a :class:`TrainConfig` is not usable.

    ``str(error)`` is one sentence that starts with the setting's name (``max_steps must be a
    whole number >= 1, got 0``); a command line names its flag instead by putting its own label
    before :attr:`problem`.

    Attributes:
        key: The field at fault (the first one, for a clash of two).
        problem: The sentence without the field's name (``must be ..., got ...``).
    """

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key} {problem}")
        self.key = key
        self.problem = problem


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """How to run a training: what to train on, the memory budget, the loop's settings.

    Built from keywords (every field has a default: the run ``memfit train`` does with no
    arguments), from a YAML mapping (:meth:`from_dict`, :meth:`read_yaml`) and changed with
    :meth:`replace`. The :class:`~memfit.train.Trainer` reads the loop's fields (from
    ``batch_size`` on); the fields above them say what ``memfit train`` builds and plans
    (a Trainer is handed its model, data and plan).

    Raises:
        ConfigError: (a ``ValueError``) with one sentence, for a value of the wrong type or
            range, or two settings that contradict each other.
    """

    # ------------------------------------------------------------------ what to train
    model: str = "byte-gpt"
    """The model: ``byte-gpt`` (memfit's 4-layer GPT-2 over bytes), a causal-LM preset
    (``gpt2``, ``gpt2-tiny``, ``llama-1b``, ...) or a path to a Hugging Face ``config.json``,
    built with random weights; or a Hugging Face model folder (``config.json`` and safetensors
    weights) or hub id, fine-tuned from its weights, loaded straight into the plan's dtype. Its
    size is most of the memory: weights, gradients and optimizer state grow with the parameter
    count."""

    data: tuple[str, ...] | None = None
    """Training data: ``.jsonl``, ``.json``, ``.parquet``, ``.csv`` or ``.txt`` files (one path
    or a list) of text records, chat records (``messages``) or ``prompt``/``completion``
    records; chats are rendered with the tokenizer's chat template and their prompt is masked
    out of the loss. ``None``: the Python standard library's own sources (``corpus_bytes`` of
    them). The plan is made for the longest batch the data makes. The tokens are held in host
    memory as a flat array, 8 bytes per token."""

    text_field: str = "text"
    """The field (or CSV column) holding a text record's text."""

    tokenizer: str | None = None
    """A tokenizer folder saved by ``save_pretrained`` (read by transformers' ``AutoTokenizer``;
    its chat template renders chat data) or a ``tokenizer.json`` file; ``None``: the model
    folder's own tokenizer when it has one, else the byte tokenizer (259 ids, nothing to load).
    A larger vocabulary makes the embedding, the LM head and the logits larger."""

    corpus_bytes: int = 1_000_000
    """Bytes of standard-library source to train on when ``data`` is ``None`` (host memory and
    tokenizing time grow with it)."""

    pack: bool = True
    """Pack documents end to end into full ``seq_len`` samples (no padding: every token
    trains); ``False``: one sample per document, padded within a batch."""

    eval_fraction: float = 0.02
    """Fraction of the samples held back for evaluation (0: none). Evaluation runs without
    gradients in the training plan's micro-batches, so it needs no more memory than a step."""

    seq_len: int = 128
    """Tokens per sample: the most a sample keeps (longer records are truncated, and counted).
    Activation memory grows with it (attention scores with its square unless the kernel is
    fused); at most the model's positions."""

    # ------------------------------------------------------------------ the plan
    budget: str | int | None = None
    """The memory budget the planner fits: a size (``4GiB``, ``48MiB``, bytes) or a device name
    (``t4``: its whole memory, allocator reserve and CUDA context included); ``None``: 48 MiB,
    the built-in demo's. A tighter budget turns on techniques that cost compute
    (checkpointing, micro-batching). With a given ``plan``, a budget that was given is checked
    against the plan's predicted peak before training (a plan over it is refused)."""

    allow: tuple[str, ...] = ()
    """Techniques that change training which the planner may use (``freeze``, ``shorter-seq``,
    ``8bit``, ``factored``, ``bf16-pure``, ``lora``, ``qlora``); by default it uses only exact
    ones."""

    lora_rank: int = 16
    """The rank of the LoRA adapters the planner may use with ``lora`` or ``qlora`` allowed:
    ``rank x (in + out)`` adapter parameters per adapted layer, each with its gradient and
    optimizer state (the base keeps neither)."""

    forbid: tuple[str, ...] = ()
    """Techniques the planner must not use (for example ``checkpointing``)."""

    plan: Plan | str | None = None
    """Train with this plan instead of planning: a :class:`~memfit.plan.Plan`, a mapping of its
    fields, or a path to a saved plan (JSON or YAML). Skips the planner's dry runs (seconds)."""

    cap: str | int | None = None
    """A virtual memory cap (``48MiB``, bytes): a step whose live memory passes it runs out of
    memory as a full GPU would, and the trainer steps the plan down. Every step then runs under
    the tracker (a few microseconds per operation), since the cap needs it."""

    # ------------------------------------------------------------------ the loop
    batch_size: int | None = None
    """Samples per optimizer step (the effective batch; micro-batching splits it without
    changing the gradient). ``None``: a workload's own batch size, else 16."""

    max_steps: int = 300
    """Optimizer steps of the run (a resumed run counts the steps already done). Time grows with
    it; host memory does not (see ``track_every``)."""

    lr: float | None = None
    """Peak learning rate; ``None``: the plan's optimizer ``lr`` (1e-3 by default). It applies to
    every plan a step-down moves to."""

    schedule: str = "cosine"
    """Learning-rate decay after warm-up: ``cosine`` or ``linear`` to 0, ``poly`` (with power 1,
    as ``linear``), or ``constant`` (:data:`memfit.optim.schedule.LR_SCHEDULES`)."""

    warmup_steps: int = 10
    """Steps of linear warm-up from ``lr / warmup_steps`` to ``lr``."""

    seed: int = 0
    """Seed of the model's initialisation, the data order and the RNG (dropout)."""

    eval_every: int | None = None
    """Evaluate every N steps and after the last; ``None``: only after the last. Each
    evaluation reads the first ``eval_max_batches`` batches of the held-out samples."""

    eval_max_batches: int | None = None
    """Batches an evaluation reads at most, each of the training step's shape (``batch_size``
    samples of up to ``seq_len`` tokens), always the first ones of the held-out samples, so
    that every evaluation scores the same text. ``None``: 16, the tokens of 16 training steps;
    a batch without gradients costs about a third of a step, so an evaluation takes about as
    long as 5 steps however large the held-out split (a million held-out samples at batch 16
    would otherwise be 62,500 batches per evaluation). ``0``: no bound, the whole held-out
    split every time. More batches give a less noisy loss; time grows linearly, memory not at
    all."""

    checkpoint_dir: str | None = None
    """Folder for checkpoints (``None``: none are written). A checkpoint holds the weights, the
    optimizer state, the schedule, the RNG and the data position: about the model's training
    memory on disk."""

    checkpoint_every: int | None = None
    """Save a checkpoint every N steps and after the last; ``None``: only after the last. Each
    save writes the whole state (seconds for a large model); needs ``checkpoint_dir``."""

    keep_checkpoints: int = 3
    """Checkpoints kept in ``checkpoint_dir``; older ones are deleted (disk, not memory)."""

    resume: bool | str = False
    """Continue from a checkpoint in ``checkpoint_dir``, if there is one: weights, optimizer,
    schedule, RNG, data position and the plan a step-down had moved to. ``true`` (or
    ``"latest"``): the latest checkpoint, refused with the remedies when it is damaged;
    ``"latest-good"``: the newest checkpoint whose files match its manifest, passing over
    damaged ones. The checkpoint is verified (every file's checksum) before any work."""

    resume_from: str | None = None
    """Continue from this checkpoint folder (``step-NNNNNNNN``), verified before any work; new
    checkpoints go to ``checkpoint_dir``, by default the folder holding it."""

    nproc_per_node: int = 1
    """Processes to train with on this machine (data parallelism, one per device): each
    trains on ``batch_size / nproc_per_node`` samples of every batch, with the plan's ZeRO stage
    (``parallel`` in the plan; stage 0 when the plan has none). Started through torch's elastic
    launcher; memory per process drops by its share of the activations and the sharded states."""

    track_every: int = 100
    """Memory is tracked in windows so that a run's host memory stays bounded: the first two
    steps, every N-th step and the steps after a step-down, each by a fresh tracker that records
    every operation of its step (about a microsecond and a few dozen bytes per operation). Steps
    in between run with no tracker at all (no overhead) unless ``cap`` is set."""

    # ------------------------------------------------------------------ checks
    def __post_init__(self) -> None:
        hints = _hints()
        for f in dataclasses.fields(self):
            value = _normalise(f.name, getattr(self, f.name))
            _check_type(f.name, value, hints[f.name])
            object.__setattr__(self, f.name, value)
        for key in (
            "corpus_bytes", "seq_len", "max_steps", "keep_checkpoints", "track_every",
            "nproc_per_node",
        ):  # fmt: skip
            _at_least(key, getattr(self, key), 1)
        for key in ("batch_size", "eval_every", "checkpoint_every"):
            if getattr(self, key) is not None:
                _at_least(key, getattr(self, key), 1)
        if self.eval_max_batches is not None:
            _at_least("eval_max_batches", self.eval_max_batches, 0)
        _at_least("warmup_steps", self.warmup_steps, 0)
        if self.lr is not None and not self.lr > 0:
            raise ConfigError("lr", f"must be > 0, got {self.lr!r}")
        if not 0 <= self.eval_fraction < 1:
            raise ConfigError("eval_fraction", f"must be at least 0 and below 1, got {self.eval_fraction!r}")
        if self.schedule not in LR_SCHEDULES:
            raise ConfigError(
                "schedule", f"{self.schedule!r} is not known; use one of {', '.join(LR_SCHEDULES)}"
            )
        if not self.text_field.strip():
            raise ConfigError("text_field", "is empty; give the name of the field holding the text")
        if self.data == ():
            raise ConfigError("data", "is an empty list; give at least one file, or leave it out")
        _ = self.budget_bytes, self.cap_bytes  # a size that does not parse fails here
        if self.checkpoint_dir is not None and Path(self.checkpoint_dir).exists() and not Path(
            self.checkpoint_dir
        ).is_dir():
            raise ConfigError(
                "checkpoint_dir", f"{self.checkpoint_dir!r} is a file; give a folder for checkpoints"
            )
        # Settings that contradict each other.
        if self.checkpoint_every is not None and self.checkpoint_dir is None:
            raise ConfigError(
                "checkpoint_every", "needs checkpoint_dir, the folder to save checkpoints in"
            )
        if self.resume_from is not None and self.checkpoint_dir is None:
            # The run goes on writing where the checkpoint it continues lies.
            object.__setattr__(self, "checkpoint_dir", str(Path(self.resume_from).parent))
        if self.resume and self.checkpoint_dir is None:
            raise ConfigError(
                "resume", "needs checkpoint_dir, the folder whose latest checkpoint to continue from"
            )
        if self.eval_every is not None and self.eval_fraction == 0:
            raise ConfigError(
                "eval_every", "needs evaluation samples, but eval_fraction is 0; raise eval_fraction"
            )
        if self.nproc_per_node > 1:
            batch = self.batch_size or DEFAULT_BATCH_SIZE
            if batch % self.nproc_per_node:
                raise ConfigError(
                    "nproc_per_node",
                    f"{self.nproc_per_node} does not divide the batch of {batch} samples; use a "
                    f"batch size that is a multiple of {self.nproc_per_node}",
                )
        if self.plan is not None and (self.allow or self.forbid):
            raise ConfigError(
                "allow" if self.allow else "forbid",
                "steers the planner, which a given plan skips; give either the plan or allow/forbid",
            )

    # ------------------------------------------------------------------ derived values
    @property
    def budget_bytes(self) -> int:
        """The budget in bytes (a device name counts its whole memory)."""
        from ..targets import parse_budget

        try:
            return parse_budget(DEFAULT_BUDGET if self.budget is None else self.budget)[0]
        except ValueError as e:
            raise ConfigError("budget", _drop_prefix(str(e), "budget ")) from None

    @property
    def cap_bytes(self) -> int | None:
        """The cap in bytes, or ``None``."""
        if self.cap is None:
            return None
        from ..units import parse_size

        try:
            return parse_size(self.cap)
        except ValueError as e:
            raise ConfigError("cap", _drop_prefix(str(e), "size ")) from None

    @property
    def eval_batch_limit(self) -> int | None:
        """The most batches an evaluation reads: ``eval_max_batches``, its default
        (:data:`DEFAULT_EVAL_BATCHES`) for ``None``, and ``None`` (no bound) for 0."""
        if self.eval_max_batches is None:
            return DEFAULT_EVAL_BATCHES
        return self.eval_max_batches or None

    def load_plan(self) -> Plan | None:
        """The given plan (read from its file when ``plan`` is a path), or ``None``.

        Raises:
            ConfigError: for a plan file that is missing or not a plan.
        """
        if self.plan is None or isinstance(self.plan, Plan):
            return self.plan
        if not Path(self.plan).is_file():
            raise ConfigError("plan", f"file {self.plan!r} does not exist; give a saved plan")
        try:
            return Plan.load(self.plan)
        except (ValueError, OSError) as e:
            raise ConfigError("plan", f"file {self.plan!r} is not a plan ({e})") from None

    # ------------------------------------------------------------------ building and changing
    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with ``changes`` applied (checked again as a whole).

        Raises:
            ConfigError: for an unknown name or a bad value.
        """
        for key in changes:
            _known(key)
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TrainConfig:
        """A config from a mapping of field names (missing ones keep their defaults).

        Raises:
            ConfigError: for an unknown key (naming the keys there are) or a bad value.
        """
        for key in values:
            _known(key)
        return cls(**values)

    @classmethod
    def read_yaml(cls, path: str | Path) -> dict[str, Any]:
        """The settings a YAML file gives, keys checked and relative paths resolved from the
        file's folder; the values are checked when a config is built from them (so a command
        line can add its own settings first).

        Raises:
            ConfigError: for a missing, unparsable or empty file, or an unknown key (with the
                keys there are, and the closest one).
        """
        import yaml

        path = Path(path)
        if not path.is_file():
            raise ConfigError("config file", f"{str(path)!r} does not exist; give a YAML file")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            problem = " ".join(str(e).split())
            raise ConfigError("config file", f"{str(path)!r} is not valid YAML ({problem})") from None
        if data is None:
            raise ConfigError("config file", f"{str(path)!r} is empty; give at least a 'data' key")
        if not isinstance(data, Mapping):
            raise ConfigError(
                "config file", f"{str(path)!r} must be a mapping of keys such as 'data' and 'model'"
            )
        for key in data:
            try:
                _known(key)
            except ConfigError as e:
                raise ConfigError(f"{path.name}: {e.key}", e.problem) from None
        values = {k: v for k, v in data.items() if v is not None}
        return _resolve_paths(values, path.parent)

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> TrainConfig:
        """A config from a YAML file (see :meth:`read_yaml`), with ``overrides`` on top.

        Raises:
            ConfigError: as :meth:`read_yaml` and :meth:`from_dict`.
        """
        return cls.from_dict({**cls.read_yaml(path), **overrides})

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for JSON and YAML): tuples as lists, a plan as its dict."""
        data: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, Plan):
                value = value.to_dict()
            data[f.name] = value
        return data


# ---------------------------------------------------------------------------------- helpers
_TYPE_NAMES = {
    str: "a string",
    int: "a whole number",
    float: "a number",
    bool: "true or false",
    type(None): "null",
    Plan: "a plan (a mapping of plan fields, or a file)",
}


@functools.cache
def _hints() -> dict[str, Any]:
    return typing.get_type_hints(TrainConfig)


def _known(key: Any) -> None:
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    if key in names:
        return
    close = difflib.get_close_matches(str(key), names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(repr(key), f"is not a setting{hint}; the settings are {', '.join(names)}")


def _normalise(key: str, value: Any) -> Any:
    """Accept the spellings a YAML file or a caller naturally uses: a path object for a path,
    one string or a list for a list, a mapping for a plan, a whole number for a number."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if key in ("allow", "forbid") and isinstance(value, (str, list, tuple)):
        # As on the command line: one name, names separated by commas, or a list; each known.
        from ..techniques import allow_names, forbid_names

        try:
            return check_names(value, allow_names() if key == "allow" else forbid_names(), key)
        except MemfitError as e:
            raise ConfigError(key, str(e).removeprefix(f"{key} ")) from None
    if key == "data":
        if isinstance(value, str):
            return (value,)
        if isinstance(value, list):
            return tuple(os.fspath(v) if isinstance(v, os.PathLike) else v for v in value)
    if key == "plan" and isinstance(value, Mapping):
        from ..plan import PlanError

        try:
            return Plan.from_dict(value)
        except (PlanError, TypeError, ValueError) as e:
            raise ConfigError("plan", f"is not a valid plan ({e})") from None
    if key == "resume" and isinstance(value, str):
        from .resume import RESUME_MODES

        if value not in RESUME_MODES:
            raise ConfigError(
                "resume", f"must be true, false, {' or '.join(map(repr, RESUME_MODES))}, got {value!r}"
            )
        return True if value == "latest" else value
    if key == "lr" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if key == "eval_fraction" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _matches(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if origin is tuple:
        (item, _) = typing.get_args(hint)
        return isinstance(value, tuple) and all(_matches(v, item) for v in value)
    if hint is type(None):
        return value is None
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, float)
    return isinstance(value, hint)


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        names = [_describe(a) for a in typing.get_args(hint) if a is not type(None)]
        return " or ".join(names)
    if origin is tuple:
        return f"a list of {_describe(typing.get_args(hint)[0]).removeprefix('a ')}s"
    return _TYPE_NAMES.get(hint, getattr(hint, "__name__", str(hint)))


def _check_type(key: str, value: Any, hint: Any) -> None:
    if not _matches(value, hint):
        raise ConfigError(key, f"must be {_describe(hint)}, got {value!r}")


def _at_least(key: str, value: int, low: int) -> None:
    if value < low:
        raise ConfigError(key, f"must be a whole number >= {low}, got {value!r}")


def _drop_prefix(message: str, prefix: str) -> str:
    return message[len(prefix) :] if message.startswith(prefix) else message


def _resolve_paths(values: dict[str, Any], base: Path) -> dict[str, Any]:
    def resolve(p: Any) -> Any:
        if not isinstance(p, str):
            return p  # the type check names it
        q = Path(p).expanduser()
        return str(q if q.is_absolute() else base / q)

    out = dict(values)
    for key in _PATH_FIELDS:
        value = out.get(key)
        if isinstance(value, list):
            out[key] = [resolve(v) for v in value]
        elif isinstance(value, str):
            out[key] = resolve(value)
    model = out.get("model")
    # A config.json or a model folder beside the file (not a preset or a hub id of that name).
    if isinstance(model, str) and (model.endswith(".json") or (base / model).is_dir()):
        out["model"] = resolve(model)
    return out


@functools.cache
def _field_docs() -> dict[str, str]:
    """Each field's docstring, read from this module's source (Python keeps no attribute
    docstrings at run time)."""
    try:
        tree = ast.parse(inspect.getsource(TrainConfig))
    except (OSError, TypeError):  # no source (a frozen application): no help texts
        return {}
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def field_help(name: str) -> str:
    """The docstring of :class:`TrainConfig`'s field ``name``, on one line (for ``--help``)."""
    return _field_docs().get(name, "")
