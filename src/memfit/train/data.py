"""Text data for training causal language models: corpus, files, chunks, batches, split.

Each part works alone:

* :func:`stdlib_corpus`: the Python standard library's own source, a corpus that ships with
  every Python (so ``memfit train`` trains on real text with nothing downloaded);
* the user's files are read by :mod:`memfit.train.records` (text, chat and prompt/completion
  records from JSONL, JSON, Parquet, CSV and text);
* :class:`TextDataset`: documents tokenised into fixed-length causal-LM samples;
* :func:`train_eval_split`: a deterministic held-out tail;
* :func:`collate` and :class:`BatchStream`: dynamically padded batches in a seeded,
  resumable order (optionally grouped by length).
"""

from __future__ import annotations

import math
import os
import sysconfig
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..workload import Batch, WorkloadError
from .stopping import check_stop
from .tokenizer import Tokenizer

__all__ = [
    "BatchStream",
    "TextDataset",
    "collate",
    "lengths_of",
    "stdlib_corpus",
    "train_eval_split",
]

# Folders of the standard library that are not ordinary library source (installed packages,
# test suites full of deliberately odd code and data).
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})


# ---------------------------------------------------------------------------------- corpora
def stdlib_corpus(max_bytes: int = 2_000_000) -> str:
    """The Python standard library's ``.py`` sources, concatenated: a corpus every Python has.

    Files are read in sorted order of their path relative to the standard library folder
    (``sysconfig.get_paths()["stdlib"]``), so the corpus is the same on every run of the same
    Python version. Installed packages and test suites are left out.

    Args:
        max_bytes: Stop once the corpus holds this many UTF-8 bytes (the last file is cut).

    Returns:
        The text, files separated by a blank line.

    Raises:
        WorkloadError: when the standard library's sources cannot be found (a Python shipped
            without them) or ``max_bytes`` is not positive.
    """
    if max_bytes < 1:
        raise WorkloadError(f"max_bytes must be >= 1, got {max_bytes!r}")
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    size = 0
    for path in _stdlib_files(root):
        check_stop()  # a SIGTERM or SIGINT while reading (memfit.train.stopping)
        try:
            data = path.read_bytes()
        except OSError:
            continue  # unreadable files are simply not part of the corpus
        room = max_bytes - size
        # Cut on a byte count, then drop a character split in two by the cut.
        text = data[:room].decode("utf-8", errors="ignore")
        parts.append(text)
        size += len(data[:room]) + 2
        if size >= max_bytes:
            break
    if not parts:
        raise WorkloadError(
            f"no Python source files found under {str(root)!r}; this Python ships without its "
            "standard library sources, so give your own data files instead"
        )
    return "\n\n".join(parts)


def _stdlib_files(root: Path) -> Iterator[Path]:
    files: list[str] = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        rel = os.path.relpath(folder, root)
        files.extend(os.path.normpath(os.path.join(rel, n)) for n in names if n.endswith(".py"))
    for rel in sorted(files):
        yield root / rel


# ---------------------------------------------------------------------------------- dataset
class TextDataset(torch.utils.data.Dataset):
    """Documents tokenised into causal-LM samples of at most ``seq_len`` input tokens.

    With ``pack=True`` the documents are joined into one token stream (an end-of-text token
    between documents, when the tokenizer has one) and cut into windows; with ``pack=False`` each
    document is cut on its own, so samples have the document's length and batches need padding.

    Consecutive windows share one token, so every next-token transition of the stream is
    predicted exactly once. Labels follow ``label_shift``:

    * ``"model"`` (Hugging Face causal LMs, which shift labels themselves): windows of
      ``seq_len`` tokens; ``labels`` equals ``input_ids`` (``seq_len - 1`` predictions);
    * ``"data"`` (models that do not shift): windows of ``seq_len + 1`` tokens;
      ``input_ids = window[:-1]`` and ``labels = window[1:]`` (``seq_len`` predictions).

    Either way the model sees ``seq_len`` tokens, the length its memory plan is made for. A
    short last window is kept (no text is dropped) and padded by :func:`collate`.

    Args:
        texts: The documents (one string is one document). A signal that asks the run to stop
            (:mod:`memfit.train.stopping`) ends tokenising before the next one, with
            :class:`~memfit.train.stopping.StopRequested`.
        tokenizer: Anything with ``encode(text) -> list[int]`` and ``eos_token_id``.
        seq_len: Input tokens per sample (>= 2).
        pack: Join documents into one stream (no padding) or keep them apart.
        label_shift: ``"model"`` or ``"data"`` (see above).

    Attributes:
        lengths: Input tokens of each sample (for length grouping).
        num_tokens: Tokens in the stream(s).
    """

    def __init__(
        self,
        texts: str | Sequence[str],
        tokenizer: Tokenizer,
        seq_len: int,
        *,
        pack: bool = True,
        label_shift: str = "model",
    ) -> None:
        if not isinstance(seq_len, int) or seq_len < 2:
            raise WorkloadError(f"seq_len must be a whole number >= 2, got {seq_len!r}")
        if label_shift not in ("model", "data"):
            raise WorkloadError(
                f"label_shift {label_shift!r} is not known; use 'model' (the model shifts labels, "
                "as Hugging Face causal LMs do) or 'data'"
            )
        if isinstance(texts, str):
            texts = [texts]
        self.seq_len = seq_len
        self.label_shift = label_shift
        eos = getattr(tokenizer, "eos_token_id", None)
        parts: list[np.ndarray] = []
        for t in texts:
            # A SIGTERM or SIGINT stops tokenising before the next document (StopRequested;
            # one document is tokenised whole, since a cut could change its tokens).
            check_stop()
            ids = _encode(tokenizer, t) + ([eos] if eos is not None else [])
            parts.append(np.asarray(ids, dtype=np.int64))
        # A NumPy array, not a tensor: slicing it runs no torch operation, so a memory tracker
        # never counts the whole corpus as training memory (on CPU, host memory is the
        # device's), only the samples that become batches. Each document is converted once
        # and the arrays joined (not a Python loop over every token of the corpus).
        self.tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        self.num_tokens = int(self.tokens.size)
        # Packed, the documents are one stream; else each is its own.
        stream_lengths = [self.num_tokens] if pack else [int(x.size) for x in parts]
        del parts
        window = seq_len + (1 if label_shift == "data" else 0)
        # (start, end) of each window in self.tokens; windows never cross a stream's end.
        self._spans: list[tuple[int, int]] = []
        offset = 0
        for n in stream_lengths:
            for start in range(0, max(n - 1, 0), window - 1):
                self._spans.append((offset + start, offset + min(start + window, n)))
            offset += n
        if not self._spans:
            raise WorkloadError(
                "the data holds fewer than 2 tokens, too few to predict anything; give more text"
            )
        shift = 1 if label_shift == "data" else 0
        self.lengths: list[int] = [end - start - shift for start, end in self._spans]

    def __len__(self) -> int:
        return len(self._spans)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start, end = self._spans[index]
        window = self.tokens[start:end]
        if self.label_shift == "data":
            return {"input_ids": _tensor(window[:-1]), "labels": _tensor(window[1:])}
        return {"input_ids": _tensor(window), "labels": _tensor(window)}

    def __repr__(self) -> str:
        return (
            f"TextDataset({len(self)} samples, seq_len={self.seq_len}, "
            f"{self.num_tokens:,} tokens, label_shift={self.label_shift!r})"
        )


def _encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text))


def _tensor(ids: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(ids.copy())


def lengths_of(dataset: Any) -> list[int]:
    """Input length of every sample: ``dataset.lengths`` when it has them (also through a
    :class:`torch.utils.data.Subset`), else measured from each sample's ``input_ids``."""
    lengths = getattr(dataset, "lengths", None)
    if lengths is not None:
        return list(lengths)
    if isinstance(dataset, torch.utils.data.Subset):
        inner = getattr(dataset.dataset, "lengths", None)
        if inner is not None:
            return [inner[i] for i in dataset.indices]
    out = []
    for i in range(len(dataset)):
        sample = dataset[i]
        ids = sample.get("input_ids") if isinstance(sample, Mapping) else sample
        out.append(int(ids.shape[-1]) if isinstance(ids, torch.Tensor) else 1)
    return out


def train_eval_split(
    dataset: Any, eval_fraction: float
) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset | None]:
    """Hold out the last ``eval_fraction`` of the samples for evaluation.

    The tail, not a random draw: packed windows overlap their neighbours by one token, so a
    contiguous cut keeps (all but one token of) the evaluation text unseen in training.

    Args:
        dataset: A map-style dataset.
        eval_fraction: In [0, 1); 0 gives no evaluation set. At least one sample is held out
            when the fraction is positive, and at least one is left for training.

    Returns:
        ``(train, eval)``; ``eval`` is ``None`` when ``eval_fraction`` is 0.

    Raises:
        WorkloadError: for a fraction outside [0, 1) or too few samples to split.
    """
    if not 0 <= eval_fraction < 1:
        raise WorkloadError(f"eval_fraction must be in [0, 1), got {eval_fraction!r}")
    n = len(dataset)
    if eval_fraction == 0:
        return dataset, None
    n_eval = max(1, math.floor(n * eval_fraction))
    if n - n_eval < 1:
        raise WorkloadError(
            f"the data makes {n} sample(s), too few to hold out {eval_fraction:.0%} for "
            "evaluation; give more text or set eval_fraction to 0"
        )
    Subset = torch.utils.data.Subset
    return Subset(dataset, range(n - n_eval)), Subset(dataset, range(n - n_eval, n))


# ---------------------------------------------------------------------------------- batches
def collate(
    samples: Sequence[Mapping[str, torch.Tensor]],
    *,
    pad_token_id: int = 0,
    pad_to_multiple_of: int = 1,
) -> dict[str, torch.Tensor]:
    """Stack samples into a batch padded to its own longest sample (dynamic padding).

    Delegates to :func:`memfit.strategies.sequence.pad_collate`: ``input_ids`` are padded with
    ``pad_token_id``, ``labels`` with -100 (never in the loss), and an ``attention_mask`` marks
    the real tokens.
    """
    from ..strategies.sequence import pad_collate

    return pad_collate(samples, pad_id=pad_token_id, pad_to_multiple_of=pad_to_multiple_of)


class BatchStream:
    """Endless batches of a map-style dataset, epoch after epoch, in a seeded, resumable order.

    Each epoch draws a permutation from ``seed + epoch`` (or, with ``group_by_length``, a
    :class:`~memfit.strategies.sequence.LengthGroupedSampler` order, so dynamically padded
    batches waste little), cuts it into batches of ``batch_size`` and drops an incomplete last
    batch, so every optimizer step sees the same effective batch. Where the stream stands is
    two numbers (:meth:`state_dict`), which is all a checkpoint needs to continue exactly.

    Args:
        dataset: Samples, indexable by position.
        batch_size: Samples per batch.
        collate_fn: Turns a list of samples into a batch (default: :func:`collate`).
        shuffle: Permute each epoch (otherwise dataset order).
        seed: Seed of the epoch orders.
        group_by_length: Batch samples of similar length together.

    Raises:
        WorkloadError: when the dataset has fewer samples than one batch.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        *,
        collate_fn: Callable[[list[Any]], Batch] | None = None,
        shuffle: bool = True,
        seed: int = 0,
        group_by_length: bool = False,
    ) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise WorkloadError(f"batch size must be a whole number >= 1, got {batch_size!r}")
        if len(dataset) < batch_size:
            raise WorkloadError(
                f"the training data makes {len(dataset)} sample(s), fewer than one batch of "
                f"{batch_size}; give more data or a smaller batch size"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.collate_fn = collate_fn or collate
        self.shuffle = shuffle
        self.seed = seed
        self.group_by_length = group_by_length
        self.epoch = 0
        self.position = 0  # batches already taken from the current epoch
        self._order: list[int] | None = None
        self.last_indices: list[int] = []

    @property
    def batches_per_epoch(self) -> int:
        """Complete batches in one epoch."""
        return len(self.dataset) // self.batch_size

    def _epoch_order(self, epoch: int) -> list[int]:
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        if self.group_by_length:
            from ..strategies.sequence import LengthGroupedSampler

            sampler = LengthGroupedSampler(lengths_of(self.dataset), self.batch_size, seed=self.seed)
            sampler.set_epoch(epoch)
            return [int(i) for i in sampler]
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(n, generator=generator).tolist()

    def next_batch(self) -> tuple[list[int], Batch]:
        """The next batch and the dataset indices of its samples."""
        if self.position >= self.batches_per_epoch:
            self.epoch += 1
            self.position = 0
            self._order = None
        if self._order is None:
            self._order = self._epoch_order(self.epoch)
        lo = self.position * self.batch_size
        indices = self._order[lo : lo + self.batch_size]
        self.position += 1
        self.last_indices = indices
        return indices, self.collate_fn([self.dataset[i] for i in indices])

    def __iter__(self) -> Iterator[Batch]:
        while True:
            yield self.next_batch()[1]

    def state_dict(self) -> dict[str, int]:
        """Where the stream stands: epoch and batches taken in it."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue from a :meth:`state_dict`."""
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.seed = int(state.get("seed", self.seed))
        self._order = None
