"""What ``memfit train`` trains, from a :class:`~memfit.train.config.TrainConfig`: the model,
the text, the plan; then the :class:`~memfit.train.Trainer` that runs it.

The same from Python as from the command line::

    from memfit.train import TrainConfig
    from memfit.train.run import prepare_run

    run = prepare_run(TrainConfig(data=("notes.txt",), max_steps=100, budget="2GiB"))
    result = run.trainer().fit()

With no data it trains memfit's built-in ``byte-gpt`` (a 4-layer GPT-2-style model over bytes)
on the Python standard library's own sources, under a budget well below what the plain plan
needs, so the planner has to turn techniques on.

Vocabulary: a preset or a ``config.json`` is built with random weights, so its ``vocab_size``
is simply set to the tokenizer's (259 for the byte tokenizer, the file's size for a
``tokenizer.json``); a preset's own vocabulary size is replaced, nothing is lost. A model folder
(``config.json`` plus saved weights) or a hub id keeps its own: it fine-tunes from its weights,
with its own tokenizer (the folder's, unless another is given), whose ids must fit its embedding.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..plan import Plan, PlanError
from ..weights import WeightsError, check_weights, has_tokenizer, hub_folder, is_hub_id, reason
from ..workload import PRESETS, Workload, WorkloadError, load_workload
from .config import DEFAULT_BATCH_SIZE, TrainConfig
from .lengths import LengthReport, length_report
from .stopping import check_stop
from .tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "MODEL_DEFAULT",
    "PlanChoice",
    "TrainRun",
    "choose_plan",
    "prepare_run",
    "run_tokenizer",
    "text_workload",
]

#: memfit train's own model: GPT-2 blocks over the byte vocabulary, small enough for a CPU.
MODEL_DEFAULT = "byte-gpt"
_BYTE_GPT = dict(n_embd=128, n_layer=4, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


# ---------------------------------------------------------------------------------- model
def text_workload(spec: str, tokenizer: Tokenizer, batch_size: int, seq_len: int) -> Workload:
    """A causal-LM workload whose vocabulary is the tokenizer's.

    Args:
        spec: ``byte-gpt`` (memfit train's default), a causal-LM preset (``gpt2``,
            ``gpt2-tiny``, ``llama-1b``, ...), a path to a Hugging Face ``config.json`` of a
            causal LM, or a causal LM's model folder (config and saved weights) or hub id:
            the workload then loads the weights when it is built for training
            (:meth:`~memfit.workload.Workload.build` with ``pretrained=True``).
        tokenizer: Its ``vocab_size`` (and end-of-text id) go into the model's config; a
            model folder keeps its own, which the tokenizer's ids must fit.
        batch_size: Samples per optimizer step.
        seq_len: Tokens per sample (at most the model's positions).

    Raises:
        WorkloadError: for an unknown spec, a model that is not a causal LM, or a sequence
            longer than the model's positions.
    """
    import transformers

    if spec not in PRESETS and (_is_folder(spec) or is_hub_id(spec)):
        return _pretrained_workload(spec, tokenizer, batch_size, seq_len)
    vocab = int(tokenizer.vocab_size)
    eos = getattr(tokenizer, "eos_token_id", None)
    # use_cache keeps transformers' default, as memfit's workloads do: every applied plan
    # turns it off while it trains (memfit.strategies.kv_cache) and back on afterwards.
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


def _is_folder(spec: str) -> bool:
    return Path(spec).is_dir()


def _pretrained_workload(spec: str, tokenizer: Tokenizer, batch_size: int, seq_len: int) -> Workload:
    """The workload of a model folder or hub id: its own config and vocabulary, its saved
    weights loaded when it is built for training. Its weight files are checked here, before
    any planning, so a missing shard is named at once."""
    workload = load_workload(spec, batch_size, seq_len)  # the config first: it is read first
    try:
        folder = hub_folder(spec, weights=False) if is_hub_id(spec) else Path(spec)
        if not is_hub_id(spec):  # a hub id's weights are fetched (and checked) when it trains
            check_weights(folder)
    except WeightsError as e:
        raise WorkloadError(str(e)) from None
    config = _config_from_file(folder / "config.json", None, {})
    vocab = int(config.vocab_size)
    if int(tokenizer.vocab_size) > vocab:
        raise WorkloadError(
            f"tokenizer {tokenizer!r} has {tokenizer.vocab_size} tokens but model {spec!r} embeds "
            f"only {vocab}; give the model's own tokenizer (--tokenizer DIR)"
        )
    return workload


def run_tokenizer(config: TrainConfig) -> Tokenizer:
    """The run's tokenizer: the config's, else the model folder's (or hub model's) own when
    it has one, else memfit's byte tokenizer.

    Raises:
        WorkloadError: when the tokenizer cannot be read (or fetched).
    """
    path: str | None = config.tokenizer
    if path is None and config.model not in PRESETS:
        if _is_folder(config.model) and has_tokenizer(config.model):
            # The model's config is read first, so a broken one is named as such (not as a
            # tokenizer that AutoTokenizer, which reads it too, cannot load).
            _config_from_file(Path(config.model) / "config.json", None, {})
            path = config.model
        elif is_hub_id(config.model):
            try:
                folder = hub_folder(config.model, weights=False)
            except WeightsError as e:
                raise WorkloadError(str(e)) from None
            path = str(folder) if has_tokenizer(folder) else None
    return load_tokenizer(path)


def _config_from_file(path: Path, vocab: int | None, special: Mapping[str, Any]) -> Any:
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
    if vocab is not None:  # random weights: the tokenizer's vocabulary
        data = {**data, "vocab_size": vocab, **special}
    try:
        config = transformers.AutoConfig.for_model(**data)
    except Exception as e:  # ValueError, KeyError, TypeError for fields it cannot take
        raise WorkloadError(f"model config {str(path)!r} cannot be built ({reason(e)})") from None
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
    lora_rank: int | None = None,
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
        result = run_planner(workload, budget_bytes, allow=allow, forbid=forbid, base=base, progress=progress,
                             lora_rank=lora_rank)
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


def _given_choice(
    workload: Workload, plan: Plan, config: TrainConfig, world_size: int, say: Callable[[str], Any]
) -> PlanChoice:
    """The plan given, with its predicted peak (a dry run of the worst batch) where one
    process trains it; a plan over a ``budget`` the user gave is refused before training.

    A data-parallel or tensor/pipeline plan is not predicted here: its processes are
    predicted per rank (:func:`~memfit.train.layout_run.predict_rank_peaks`).

    Raises:
        ValueError: for a plan whose predicted peak is over the budget given.
    """
    from ..units import format_bytes

    if world_size > 1 or plan.parallel.world_size > 1:
        return PlanChoice(plan, True, None, method="given", explanation="the plan given")
    from ..estimate import dry_run

    say("predicting the plan's peak")
    peak = int(dry_run(workload, plan, steps=2).peak_bytes)
    budget = config.budget_bytes
    if config.budget is not None and peak > budget:
        raise ValueError(
            f"the plan's predicted peak {format_bytes(peak)} is over the budget of "
            f"{format_bytes(budget)} (--budget {config.budget}); give a plan that fits (memfit "
            "plan --budget ... --save PLAN), a larger --budget, or leave out --plan to let the "
            "planner choose"
        )
    return PlanChoice(plan, peak <= budget, peak, method="given", explanation="the plan given")


def _check_machine(choice: PlanChoice) -> None:
    """Refuse a plan whose predicted peak is more memory than this machine's device has at
    all: no step-down reaches it, and torch would fail with a traceback building the model.

    Raises:
        ValueError: naming the figures and what to lower.
    """
    from ..device import default_device, total_memory
    from ..units import format_bytes

    peak = choice.predicted_peak_bytes
    if peak is None:
        return
    device = default_device()
    have = total_memory(device)
    if have is None:  # the CPU: the machine's physical memory
        try:
            have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
            return
    if peak > have:
        raise ValueError(
            f"the run needs {format_bytes(peak)} by its predicted peak (plan "
            f"{choice.plan.summary()}) and this machine's {device.type} has "
            f"{format_bytes(have)} in all; lower --seq-len or --batch-size"
        )


def _over_processes(choice: PlanChoice, world_size: int) -> PlanChoice:
    """The choice with its plan spread over ``world_size`` processes (no fallbacks)."""
    try:
        plan = choice.plan.over_processes(world_size)
    except PlanError as e:
        raise ValueError(
            f"{e}; give --nproc-per-node {choice.plan.parallel.data} or a plan for {world_size}"
        ) from None
    return dataclasses.replace(choice, plan=plan, fallback_plans=[])


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



# ---------------------------------------------------------------------------------- the run
@dataclass
class TrainRun:
    """Everything a training run needs, built from a :class:`TrainConfig` by :func:`prepare_run`.

    Attributes:
        config: The settings it was built from.
        workload: The model (built by the trainer from it, with the config's seed), its
            batch and sequence sizes.
        tokenizer: The tokenizer of the text.
        dataset: All samples; ``train`` and ``eval`` are its two parts.
        train: The training samples.
        eval: The held-out samples (``None`` when ``eval_fraction`` is 0).
        choice: The plan, how it was chosen and the plans to fall back to.
        collate: Turns samples into a batch (pad id, the plan's pad multiple).
        data_name: The text's source, in words.
        lengths: The samples' length distribution and the worst batch, which the plan is
            made for (``workload.seq_len`` is its length).
    """

    config: TrainConfig
    workload: Workload
    tokenizer: Tokenizer
    dataset: Any
    train: Any
    eval: Any
    choice: PlanChoice
    collate: Callable[[list[Any]], Any]
    data_name: str
    lengths: LengthReport | None = None

    @property
    def budget_bytes(self) -> int:
        """The budget planned for, in bytes."""
        return self.config.budget_bytes

    def trainer(self, **kwargs: Any) -> Any:
        """The :class:`~memfit.train.Trainer` of this run; ``kwargs`` go to it (``progress``,
        ``console``, ``report_png``, ``callbacks``, ...)."""
        from .trainer import Trainer

        return Trainer(
            self.workload,
            self.choice.plan,
            self.train,
            eval_data=self.eval,
            config=self.config,
            batch_size=self.workload.batch_size,
            fallback_plans=self.choice.fallback_plans,
            collate_fn=self.collate,
            **kwargs,
        )


def _stopping(say: Callable[[str], Any] | None) -> Callable[[str], Any]:
    """``say`` that first stops the run (:class:`~memfit.train.stopping.StopRequested`) when a
    signal asked it to: every message, the planner's progress included, is a point to stop."""
    told = say or (lambda message: None)

    def checked(message: str) -> Any:
        check_stop()
        return told(message)

    return checked


def prepare_run(
    config: TrainConfig, *, say: Callable[[str], Any] | None = None, world_size: int = 1
) -> TrainRun:
    """Build the run ``config`` describes: tokenizer, text, model, split, and the plan (the
    config's, else the planner's for its budget).

    Args:
        config: The settings.
        say: Called with a line on what is being done (planning takes seconds).
        world_size: Processes training together (data parallelism). The planner then plans
            one process's share of the batch; a plan without ``parallel`` gets stage 0 over
            ``world_size`` processes; a plan for another degree is refused. No step-down
            fallbacks: every process must switch together, which is not available yet.

    Raises:
        WorkloadError: for text, a tokenizer or a model that cannot be used.
        ConfigError: for a plan file that is missing or not a plan.
        ValueError: for unknown ``allow`` / ``forbid`` names (from the planner).
        StopRequested: when a SIGTERM or SIGINT came while it worked (within a
            :func:`~memfit.train.stopping.catch_signals` block): it stops at the next file,
            record, phase or planner message.
    """
    from ..strategies.sequence import pad_collate
    from .chat import build_dataset
    from .data import TextDataset, stdlib_corpus, train_eval_split

    say = _stopping(say)
    tokenizer = run_tokenizer(config)
    batch_size = config.batch_size or DEFAULT_BATCH_SIZE
    # The model first (its weight files' headers, its positions): a damaged download is named
    # before the text is read and tokenised.
    workload = text_workload(config.model, tokenizer, batch_size, config.seq_len)
    if config.data is None:
        texts: Sequence[str] = [stdlib_corpus(config.corpus_bytes)]
        data_name = "the Python standard library's sources"
        dataset = TextDataset(texts, tokenizer, config.seq_len, pack=config.pack)
    else:
        data_name = ", ".join(config.data)
        dataset = build_dataset(
            list(config.data), tokenizer, config.seq_len, pack=config.pack,
            text_field=config.text_field, say=say,
        )
    check_stop()
    # The plan holds for the worst batch: one process's share of samples at the longest
    # sample's length (the model itself is built for the configured seq_len).
    lengths = length_report(dataset, max(batch_size // world_size, 1), seq_len=config.seq_len)
    workload = workload.replace(seq_len=lengths.max)
    train_set, eval_set = train_eval_split(dataset, config.eval_fraction)
    given = config.load_plan()
    if given is not None:
        choice = _given_choice(workload, given, config, world_size, say)
    else:
        from ..units import format_bytes

        say(f"planning for a budget of {format_bytes(config.budget_bytes)}")
        local = workload.replace(batch_size=batch_size // world_size)
        base = None
        planning = contextlib.nullcontext()
        if world_size > 1:
            from ..distributed.config import ParallelConfig
            from ..distributed.data import batches_are_local

            # One process's share, with DDP's memory (its dry-run stand-in communicates
            # nothing, so it runs in the launched processes' group): techniques data
            # parallelism refuses are not candidates.
            base = Plan(parallel=ParallelConfig(data=world_size))
            planning = batches_are_local()
        with planning:
            choice = choose_plan(
                local, config.budget_bytes, allow=config.allow, forbid=config.forbid,
                base=base, progress=say, lora_rank=config.lora_rank,
            )
    check_stop()
    if world_size > 1:
        choice = _over_processes(choice, world_size)
    _check_machine(choice)
    pad = tokenizer.pad_token_id
    pad_multiple = choice.plan.sequence.pad_to_multiple_of
    longest = workload.seq_len

    def collate_fn(samples: list[Any]) -> Any:
        # Never padded past the planned length (a pad multiple rounds up to at most it).
        return pad_collate(samples, pad_id=pad, pad_to_multiple_of=pad_multiple, max_seq_len=longest)

    return TrainRun(
        config=config,
        workload=workload,
        tokenizer=tokenizer,
        dataset=dataset,
        train=train_set,
        eval=eval_set,
        choice=choice,
        collate=collate_fn,
        data_name=data_name,
        lengths=lengths,
    )
