"""``memfit train``: plan for a memory budget, then train a causal LM on text under that plan.

With no arguments it trains memfit's built-in ``byte-gpt`` (a 4-layer GPT-2-style model over
bytes) on the Python standard library's own sources, under a budget well below what the plain
plan needs, so the planner has to turn techniques on. ``--config run.yaml`` trains a preset or a
Hugging Face ``config.json`` on the user's own ``.txt`` / ``.csv`` / ``.jsonl`` files.

Vocabulary: the model is built with random weights, so its ``vocab_size`` is simply set to the
tokenizer's (259 for the byte tokenizer, the file's size for a ``tokenizer.json``); a preset's
own vocabulary size is replaced, nothing is lost.

Register it with ``app.command("train")(train)``.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import torch
import typer
from torch import nn

from ..plan import Plan
from ..workload import PRESETS, Workload, WorkloadError
from .tokenizer import Tokenizer

__all__ = ["DEFAULTS", "MODEL_DEFAULT", "PlanChoice", "choose_plan", "text_workload", "train"]

#: memfit train's own model: GPT-2 blocks over the byte vocabulary, small enough for a CPU.
MODEL_DEFAULT = "byte-gpt"
_BYTE_GPT = dict(n_embd=128, n_layer=4, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

#: The run ``memfit train`` does with no arguments; every key may be set in ``--config``.
DEFAULTS: dict[str, Any] = {
    "model": MODEL_DEFAULT,
    "data": None,  # None: the Python standard library's sources
    "tokenizer": None,  # None: the byte tokenizer
    "batch_size": 16,
    "seq_len": 128,
    "max_steps": 300,
    "lr": 1e-3,
    "schedule": "cosine",
    "warmup_steps": 10,
    "budget": "48MiB",
    "cap": None,
    "seed": 0,
    "eval_fraction": 0.02,
    "eval_every": None,
    "checkpoint_dir": None,
    "checkpoint_every": None,
    "allow": [],
    "forbid": [],
    "pack": True,
    "plan": None,
    "corpus_bytes": 1_000_000,
}

_TYPES: dict[str, tuple[type, ...]] = {
    "model": (str,),
    "data": (str, list),
    "tokenizer": (str,),
    "batch_size": (int,),
    "seq_len": (int,),
    "max_steps": (int,),
    "lr": (float, int),
    "schedule": (str,),
    "warmup_steps": (int,),
    "budget": (str, int),
    "cap": (str, int),
    "seed": (int,),
    "eval_fraction": (float, int),
    "eval_every": (int,),
    "checkpoint_dir": (str,),
    "checkpoint_every": (int,),
    "allow": (list, str),
    "forbid": (list, str),
    "pack": (bool,),
    "plan": (str, dict),
    "corpus_bytes": (int,),
}
_PATH_KEYS = ("tokenizer", "checkpoint_dir", "plan")
_TYPE_NAMES = {
    str: "a string",
    int: "a whole number",
    float: "a number",
    bool: "true or false",
    list: "a list",
    dict: "a mapping",
}


# ---------------------------------------------------------------------------------- config
def load_config(path: Path | None) -> dict[str, Any]:
    """The run's settings: :data:`DEFAULTS` updated from a YAML file.

    Relative paths in the file (data, tokenizer, checkpoint folder, plan, a config.json
    model) are taken relative to the file's folder.

    Raises:
        WorkloadError: for a missing or unparsable file, an unknown key (naming the keys that
            exist) or a value of the wrong type.
    """
    cfg = dict(DEFAULTS)
    if path is None:
        return cfg
    import yaml

    if not path.is_file():
        raise WorkloadError(f"config file {str(path)!r} does not exist; give a YAML file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise WorkloadError(f"config file {str(path)!r} is not valid YAML ({e})") from None
    if data is None:
        raise WorkloadError(f"config file {str(path)!r} is empty; give at least a 'data' key")
    if not isinstance(data, Mapping):
        raise WorkloadError(f"config file {str(path)!r} must be a mapping of keys such as 'data' and 'model'")
    for key, value in data.items():
        if key not in DEFAULTS:
            close = difflib.get_close_matches(str(key), DEFAULTS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise WorkloadError(
                f"config key {key!r} is not known{hint}; the keys are {', '.join(DEFAULTS)}"
            )
        if value is None:
            continue
        types = _TYPES[key]
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            want = " or ".join(_TYPE_NAMES[t] for t in types if not (t is int and float in types))
            raise WorkloadError(f"config key {key!r} must be {want}, got {value!r}")
        cfg[key] = value
    base = path.parent
    if cfg["data"] is not None:
        data_paths = [cfg["data"]] if isinstance(cfg["data"], str) else list(cfg["data"])
        cfg["data"] = [str(_relative(base, p)) for p in data_paths]
    for key in _PATH_KEYS:
        if isinstance(cfg[key], str):
            cfg[key] = str(_relative(base, cfg[key]))
    if isinstance(cfg["model"], str) and cfg["model"].endswith(".json"):
        cfg["model"] = str(_relative(base, cfg["model"]))
    for key in ("allow", "forbid"):
        if isinstance(cfg[key], str):
            cfg[key] = [cfg[key]]
    return cfg


def _relative(base: Path, value: str) -> Path:
    p = Path(value).expanduser()
    return p if p.is_absolute() else base / p


# ---------------------------------------------------------------------------------- model
def text_workload(spec: str, tokenizer: Tokenizer, batch_size: int, seq_len: int) -> Workload:
    """A causal-LM workload whose vocabulary is the tokenizer's.

    Args:
        spec: ``byte-gpt`` (memfit train's default), a causal-LM preset (``gpt2``,
            ``gpt2-tiny``, ``llama-1b``, ...) or a path to a Hugging Face ``config.json`` of a
            causal LM.
        tokenizer: Its ``vocab_size`` (and end-of-text id) go into the model's config.
        batch_size: Samples per optimizer step.
        seq_len: Tokens per sample (at most the model's positions).

    Raises:
        WorkloadError: for an unknown spec, a model that is not a causal LM, or a sequence
            longer than the model's positions.
    """
    import transformers

    vocab = int(tokenizer.vocab_size)
    eos = getattr(tokenizer, "eos_token_id", None)
    # use_cache keeps transformers' default, as memfit's workloads do: without a cache Llama
    # inspects position ids, which the planner's fake tensors cannot show.
    special = {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": None}
    causal = [n for n, p in PRESETS.items() if p.family in ("gpt2", "llama")]
    if spec == MODEL_DEFAULT:
        config: Any = transformers.GPT2Config(
            vocab_size=vocab, n_positions=max(seq_len, 128), **_BYTE_GPT, **special
        )
        about = "memfit's byte-level GPT-2 (4 layers, 128 wide)"
    elif spec in PRESETS:
        preset = PRESETS[spec]
        if preset.family not in ("gpt2", "llama"):
            raise WorkloadError(
                f"model {spec!r} is a sequence classifier; training on text needs a causal LM: "
                f"{MODEL_DEFAULT}, {', '.join(causal)} or a causal LM's config.json"
            )
        cls = transformers.GPT2Config if preset.family == "gpt2" else transformers.LlamaConfig
        config = cls(**{**preset.config, "vocab_size": vocab, **special})
        about = preset.about
    elif spec.endswith(".json") or Path(spec).exists():
        config = _config_from_file(Path(spec), vocab, special)
        about = f"{config.model_type} from {spec}"
    else:
        raise WorkloadError(
            f"model {spec!r} names nothing memfit can train on text; use {MODEL_DEFAULT}, a "
            f"causal-LM preset ({', '.join(causal)}) or a path to a causal LM's config.json"
        )
    limit = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if limit is not None and seq_len > int(limit):
        raise WorkloadError(
            f"seq_len {seq_len} is longer than model {spec!r}'s {limit} positions; use seq_len "
            f"{limit} or less"
        )

    def build() -> nn.Module:
        return transformers.AutoModelForCausalLM.from_config(config)

    def make_batch(model: nn.Module, bs: int, sl: int) -> dict[str, torch.Tensor]:
        # Random tokens of the real batches' shape: what the planner's dry runs measure.
        ids = torch.randint(0, vocab, (bs, sl))
        return {"input_ids": ids, "labels": ids.clone()}

    return Workload(spec, batch_size, seq_len, build, make_batch, description=about)


def _config_from_file(path: Path, vocab: int, special: Mapping[str, Any]) -> Any:
    import transformers

    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise WorkloadError(f"model config {str(path)!r} does not exist; give a path to a config.json")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise WorkloadError(f"model config {str(path)!r} is not valid JSON ({e})") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise WorkloadError(f"model config {str(path)!r} has no 'model_type'; give a Hugging Face config.json")
    data = {**data, "vocab_size": vocab, **special}
    try:
        config = transformers.AutoConfig.for_model(**data)
    except (ValueError, KeyError) as e:
        raise WorkloadError(f"model config {str(path)!r} cannot be built ({e})") from None
    if type(config) not in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise WorkloadError(
            f"model config {str(path)!r} is a {data['model_type']!r} model, which has no causal-LM "
            "head in transformers; give the config of a causal LM (gpt2, llama, ...)"
        )
    return config


# ---------------------------------------------------------------------------------- plan
@dataclass
class PlanChoice:
    """The plan picked for a budget, and how.

    Attributes:
        plan: The plan to train with.
        fits: Whether its predicted peak fits the budget.
        predicted_peak_bytes: Its predicted (dry-run) peak.
        fallback_plans: Plans to step down to if a step still runs out of memory.
        method: ``planner`` (``memfit.planner``), ``dry-run step-down`` (planning
            unavailable) or ``given``.
        explanation: One or two sentences on the choice.
    """

    plan: Plan
    fits: bool
    predicted_peak_bytes: int | None
    fallback_plans: list[Plan] = field(default_factory=list)
    method: str = "planner"
    explanation: str = ""


def choose_plan(
    workload: Workload,
    budget_bytes: int,
    *,
    allow: Iterable[str] = (),
    forbid: Iterable[str] = (),
    base: Plan | None = None,
    progress: Any = None,
) -> PlanChoice:
    """The fastest plan whose peak fits ``budget_bytes``.

    Uses :func:`memfit.planner.plan` when the planner is available; otherwise steps ``base``
    down (:func:`memfit.train.oom.step_down`) until a dry run of the workload fits.

    Raises:
        ValueError: for unknown ``allow`` / ``forbid`` names (from the planner).
    """
    try:
        from ..planner import NothingFits
        from ..planner import plan as run_planner
    except ImportError:
        return _dry_run_step_down(workload, budget_bytes, base or Plan())
    try:
        result = run_planner(workload, budget_bytes, allow=allow, forbid=forbid, base=base, progress=progress)
    except NothingFits as e:
        result = e.result
    frontier = list(result.frontier)
    later = frontier[frontier.index(result.plan) + 1 :] if result.plan in frontier else frontier
    return PlanChoice(
        plan=result.plan,
        fits=bool(result.fits),
        predicted_peak_bytes=int(result.predicted_peak_bytes),
        fallback_plans=[p for p in later if p != result.plan],
        method="planner",
        explanation=result.explanation,
    )


def _dry_run_step_down(workload: Workload, budget_bytes: int, plan: Plan) -> PlanChoice:
    from ..estimate import dry_run
    from .oom import step_down

    best: tuple[int, Plan] | None = None
    current: Plan | None = plan
    while current is not None:
        peak = int(dry_run(workload, current, steps=2).peak_bytes)
        if best is None or peak < best[0]:
            best = (peak, current)
        if peak <= budget_bytes:
            return PlanChoice(current, True, peak, method="dry-run step-down")
        current = step_down(current, workload.batch_size)
    assert best is not None
    return PlanChoice(best[1], False, best[0], method="dry-run step-down")


# ---------------------------------------------------------------------------------- command
def train(
    config: Annotated[Path | None, typer.Option("--config", "-c", help="A YAML run file (model, data, tokenizer, batch_size, seq_len, max_steps, lr, budget, ...).")] = None,
    max_steps: Annotated[int | None, typer.Option("--max-steps", help="Optimizer steps (overrides the config).")] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="Seed of the model, data order and RNG (default 0).")] = None,
    budget: Annotated[str | None, typer.Option("--budget", help="Memory budget to plan for (e.g. 48MiB, 4GiB, t4).")] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the results as JSON here.")] = None,
    cap: Annotated[str | None, typer.Option("--cap", help="Virtual memory cap (e.g. 48MiB): a step beyond it runs out of memory and the trainer steps down.")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write a PNG of the run's memory here.")] = None,
    plan_path: Annotated[Path | None, typer.Option("--plan", help="Train with this saved plan instead of planning.")] = None,
    checkpoint_dir: Annotated[Path | None, typer.Option("--checkpoint-dir", help="Save checkpoints here.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the latest checkpoint in --checkpoint-dir.")] = False,
) -> None:
    """Train a causal LM on text under a memory budget: plan, train, report memory."""
    from ..console import err, out, quiet_libraries
    from ..console import fail as _fail

    quiet_libraries()
    try:
        settings = _settings(config, max_steps, seed, budget, cap, plan_path, checkpoint_dir)
        # Planner progress goes to a transient status line: it is noise once a plan is chosen.
        with err.status("preparing the run") as status:
            run = _prepare_run(settings, say=lambda m: status.update(str(m)))
    except (WorkloadError, ValueError) as e:
        _fail(str(e))
    _print_plan(out, run)
    from .trainer import Trainer

    try:
        result = Trainer(
            run["workload"],
            run["choice"].plan,
            run["train"],
            eval_data=run["eval"],
            lr=float(settings["lr"]),
            schedule=settings["schedule"],
            warmup_steps=settings["warmup_steps"],
            max_steps=settings["max_steps"],
            eval_every=settings["eval_every"],
            checkpoint_dir=settings["checkpoint_dir"],
            checkpoint_every=settings["checkpoint_every"],
            resume=resume,
            cap=run["cap_bytes"],
            fallback_plans=run["choice"].fallback_plans,
            seed=settings["seed"],
            batch_size=settings["batch_size"],
            collate_fn=run["collate"],
            report_png=plot,
            console=err,
        ).fit()
    except torch.OutOfMemoryError as e:
        _fail(str(e), code=1)
    except (WorkloadError, ValueError) as e:
        _fail(str(e))
    _print_result(out, run, result)
    if plot is not None:
        out.print(f"wrote {plot}")
    if json_path is not None:
        json_path.write_text(json.dumps(_result_json(settings, run, result), indent=2) + "\n")
        out.print(f"wrote {json_path}")


def _settings(
    config: Path | None,
    max_steps: int | None,
    seed: int | None,
    budget: str | None,
    cap: str | None,
    plan_path: Path | None,
    checkpoint_dir: Path | None,
) -> dict[str, Any]:
    cfg = load_config(config)
    for key, value in (
        ("max_steps", max_steps),
        ("seed", seed),
        ("budget", budget),
        ("cap", cap),
        ("plan", str(plan_path) if plan_path else None),
        ("checkpoint_dir", str(checkpoint_dir) if checkpoint_dir else None),
    ):
        if value is not None:
            cfg[key] = value
    for key in ("batch_size", "seq_len", "max_steps"):
        if cfg[key] < 1:
            raise WorkloadError(f"{key.replace('_', '-')} must be a whole number >= 1, got {cfg[key]}")
    if not float(cfg["lr"]) > 0:
        raise WorkloadError(f"lr must be > 0, got {cfg['lr']}")
    return cfg


def _prepare_run(cfg: Mapping[str, Any], say: Any) -> dict[str, Any]:
    from ..targets import parse_budget
    from ..units import parse_size
    from .data import TextDataset, collate, load_text_files, stdlib_corpus, train_eval_split
    from .tokenizer import load_tokenizer

    budget_bytes, _ = parse_budget(cfg["budget"])
    cap_bytes = None
    if cfg["cap"] is not None:
        try:
            cap_bytes = parse_size(cfg["cap"])
        except ValueError as e:
            raise WorkloadError(f"cap: {e}") from None
    tokenizer = load_tokenizer(cfg["tokenizer"])
    if cfg["data"] is None:
        texts: Sequence[str] = [stdlib_corpus(cfg["corpus_bytes"])]
        data_name = "the Python standard library's sources"
    else:
        texts = load_text_files(cfg["data"])
        data_name = ", ".join(cfg["data"])
    workload = text_workload(cfg["model"], tokenizer, cfg["batch_size"], cfg["seq_len"])
    dataset = TextDataset(texts, tokenizer, cfg["seq_len"], pack=cfg["pack"])
    train_set, eval_set = train_eval_split(dataset, float(cfg["eval_fraction"]))
    if cfg["plan"] is not None:
        plan = Plan.from_dict(cfg["plan"]) if isinstance(cfg["plan"], Mapping) else Plan.load(cfg["plan"])
        choice = PlanChoice(plan, True, None, method="given", explanation="the plan given")
    else:
        say(f"planning for a budget of {_fmt(budget_bytes)}")
        choice = choose_plan(
            workload, budget_bytes, allow=cfg["allow"], forbid=cfg["forbid"], progress=say
        )
    pad = tokenizer.pad_token_id

    def collate_fn(samples: list[Any]) -> Any:
        return collate(samples, pad_token_id=pad, pad_to_multiple_of=choice.plan.sequence.pad_to_multiple_of)

    return {
        "workload": workload,
        "tokenizer": tokenizer,
        "dataset": dataset,
        "train": train_set,
        "eval": eval_set,
        "choice": choice,
        "budget_bytes": budget_bytes,
        "cap_bytes": cap_bytes,
        "collate": collate_fn,
        "data_name": data_name,
    }


def _fmt(n: int | None) -> str:
    from ..units import format_bytes

    return "-" if n is None else format_bytes(n)


def _print_plan(out: Any, run: Mapping[str, Any]) -> None:
    w, choice, ds = run["workload"], run["choice"], run["dataset"]
    out.print(
        f"[bold]{w.name}[/]: {w.description}; batch {w.batch_size}, length {w.seq_len}; "
        f"data: {run['data_name']} ({ds.num_tokens:,} tokens, {len(run['train']):,} training samples)",
        highlight=False,
    )
    verdict = "fits" if choice.fits else "[red]does not fit[/]"
    out.print(
        f"plan ({choice.method}): [bold]{choice.plan.summary()}[/]; predicted peak "
        f"{_fmt(choice.predicted_peak_bytes)} {verdict} the budget of {_fmt(run['budget_bytes'])}",
        highlight=False,
    )


def _print_result(out: Any, run: Mapping[str, Any], result: Any) -> None:
    budget = run["budget_bytes"]
    within = "within" if result.peak_bytes <= budget else "[red]over[/]"
    out.print(
        f"loss {result.first_loss:.4f} -> {result.final_loss:.4f} in {result.steps} steps "
        f"({result.seconds:.1f} s, {result.tokens_per_second:,.0f} tokens/s); measured peak "
        f"[bold]{_fmt(result.peak_bytes)}[/], {within} the budget of {_fmt(budget)}",
        highlight=False,
    )
    for s in result.step_downs:
        out.print(f"stepped down at step {s['step'] + 1}: {s['summary']}", highlight=False)
    if result.step_downs:
        out.print(
            "(the measured peak includes the allocation that ran out of memory, which a real "
            "device would have refused)",
            highlight=False,
        )


def _result_json(cfg: Mapping[str, Any], run: Mapping[str, Any], result: Any) -> dict[str, Any]:
    choice = run["choice"]
    data = result.to_dict()
    data.update(
        budget_bytes=run["budget_bytes"],
        fits_budget=result.peak_bytes <= run["budget_bytes"],
        cap_bytes=run["cap_bytes"],
        predicted_peak_bytes=choice.predicted_peak_bytes,
        planner=choice.method,
        model=run["workload"].name,
        num_parameters=int(result.report.meta.get("num_parameters") or 0) or None,
        batch_size=cfg["batch_size"],
        seq_len=cfg["seq_len"],
        seed=cfg["seed"],
        lr=float(cfg["lr"]),
        data=run["data_name"],
        tokenizer=repr(run["tokenizer"]),
        memory_report=result.report.to_dict(max_points=200),
    )
    return data
