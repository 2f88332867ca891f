"""Records (:mod:`memfit.train.records`) tokenised into supervised samples, the prompt masked.

* A **chat** record is rendered with the tokenizer's chat template
  (``tokenizer.apply_chat_template``) and tokenised as one text. Its labels are ``-100``
  (never in the loss) over everything before the content of the last assistant turn: the
  system prompt, the user's turns, earlier answers and the template's markup. From that
  content to the end (the answer and the template's end-of-turn markup, so the model learns
  to stop) the labels equal the input ids.
* A **prompt/completion** record is a user turn and an assistant turn of a chat when the
  tokenizer has a chat template; without one, the prompt and the completion are tokenised
  apart and joined, with the end-of-text token after the completion, the prompt masked.
* A **text** record is trained on whole, with the end-of-text token after it.

Labels follow Hugging Face's convention (``label_shift="model"`` of
:class:`~memfit.train.data.TextDataset`): the model shifts them, so ``labels[t]`` is predicted
from the tokens before ``t``.

:func:`build_dataset` turns a run's data files into its dataset: text alone packs into
windows (:class:`~memfit.train.data.TextDataset`); any chat or prompt/completion record makes
a :class:`SupervisedDataset`, one sample per record.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..workload import WorkloadError
from .data import TextDataset
from .records import Record, read_records
from .stopping import check_stop
from .tokenizer import Tokenizer

__all__ = ["IGNORE_INDEX", "SupervisedDataset", "build_dataset", "chat_tokenizer", "render"]

#: The label of a token the loss ignores (PyTorch's and Hugging Face's default).
IGNORE_INDEX = -100


def chat_tokenizer(tokenizer: Any) -> Any | None:
    """The transformers tokenizer that renders chats for ``tokenizer``, or ``None`` when it
    has no chat template (memfit's byte tokenizer, a bare ``tokenizer.json``)."""
    for candidate in (tokenizer, getattr(tokenizer, "inner", None)):
        if getattr(candidate, "chat_template", None) and hasattr(candidate, "apply_chat_template"):
            return candidate
    return None


def render(record: Record, tokenizer: Tokenizer) -> tuple[list[int], int]:
    """A record's token ids and how many of the first ones are prompt (masked in the loss).

    Raises:
        WorkloadError: for a chat record and a tokenizer without a chat template, or a chat
            the template refuses (one sentence naming the record's line).
    """
    eos = getattr(tokenizer, "eos_token_id", None)
    end = [eos] if eos is not None else []
    if record.kind == "text":
        assert record.text is not None
        return list(tokenizer.encode(record.text)) + end, 0
    chat = chat_tokenizer(tokenizer)
    if record.kind == "prompt":
        assert record.prompt is not None and record.completion is not None
        if chat is None:
            prompt = list(tokenizer.encode(record.prompt))
            return prompt + list(tokenizer.encode(record.completion)) + end, len(prompt)
        turns: Sequence[dict[str, str]] = (
            {"role": "user", "content": record.prompt},
            {"role": "assistant", "content": record.completion},
        )
    else:
        assert record.messages is not None
        turns = record.messages
        if chat is None:
            raise WorkloadError(
                f"{record.where} is a chat record, but the tokenizer {tokenizer!r} has no chat "
                "template to render it with; give a tokenizer folder (--tokenizer) whose "
                "tokenizer_config.json has a chat_template, as save_pretrained writes it"
            )
    try:
        return _render_chat(list(turns), chat)
    except WorkloadError:
        raise
    except Exception as e:  # a template raises what its author chose (jinja's errors mostly)
        raise WorkloadError(
            f"{record.where} cannot be rendered with the tokenizer's chat template "
            f"({' '.join(str(e).split())})"
        ) from None


def _render_chat(turns: list[dict[str, str]], chat: Any) -> tuple[list[int], int]:
    last = max(i for i, t in enumerate(turns) if t["role"] == "assistant")
    full = str(chat.apply_chat_template(turns, tokenize=False))
    # Where the last answer's content starts in the rendered text: after the rendering of the
    # turns before it (with the template's generation prompt when the template has one).
    start = 0
    if last > 0:
        for generation_prompt in (True, False):
            before = str(
                chat.apply_chat_template(
                    turns[:last], tokenize=False, add_generation_prompt=generation_prompt
                )
            )
            if full.startswith(before):
                start = len(before)
                break
    content = turns[last]["content"]
    at = -1
    for piece in (content, content.strip()):  # some templates strip the content
        if piece:
            at = full.find(piece, start)
            if at >= 0:
                break
    boundary = at if at >= 0 else start
    try:
        enc = chat(full, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError:  # a slow (Python) tokenizer has no offsets
        ids = list(chat.encode(full, add_special_tokens=False))
        return ids, len(chat.encode(full[:boundary], add_special_tokens=False))
    ids = list(enc["input_ids"])
    # The first token that reaches past the boundary is the answer's (a token that straddles
    # it holds some of the answer, so it is learned).
    prompt = next((k for k, (_, stop) in enumerate(enc["offset_mapping"]) if stop > boundary), len(ids))
    return ids, prompt


class SupervisedDataset(torch.utils.data.Dataset):
    """One causal-LM sample per record, with the prompt masked out of the loss.

    Samples keep their own lengths (up to ``seq_len``): batches pad to their longest sample
    (:func:`~memfit.train.data.collate`), with ``labels`` -100 on the padding. A sample longer
    than ``seq_len`` is cut to its first ``seq_len`` tokens; one whose answer the cut leaves
    no token of is dropped (it would add nothing to the loss).

    Args:
        records: The records (:func:`~memfit.train.records.read_records`).
        tokenizer: Encodes text; renders chats when it has a chat template.
        seq_len: The most tokens a sample keeps.

    Attributes:
        lengths: Input tokens of each sample.
        num_tokens: Tokens in all samples.
        answer_tokens: Tokens whose label is not masked.
        truncated: Records cut to ``seq_len``.
        dropped: Records dropped because the cut left none of their answer.
        wheres: Each sample's file and line.
    """

    def __init__(self, records: Sequence[Record], tokenizer: Tokenizer, seq_len: int) -> None:
        if not isinstance(seq_len, int) or seq_len < 2:
            raise WorkloadError(f"seq_len must be a whole number >= 2, got {seq_len!r}")
        self.seq_len = seq_len
        self.label_shift = "model"
        self.truncated = 0
        self.dropped = 0
        self.wheres: list[str] = []
        ids_parts: list[list[int]] = []
        prompts: list[int] = []
        for record in records:
            check_stop()  # a SIGTERM or SIGINT stops tokenising here (StopRequested)
            ids, prompt = render(record, tokenizer)
            if len(ids) > seq_len:
                self.truncated += 1
                ids = ids[:seq_len]
            # A label at position 0 is never predicted (nothing comes before it).
            if len(ids) < 2 or max(prompt, 1) >= len(ids):
                self.dropped += 1
                continue
            ids_parts.append(ids)
            prompts.append(prompt)
            self.wheres.append(record.where)
        if not ids_parts:
            raise WorkloadError(
                f"no record of the data keeps a token of its answer within seq_len {seq_len} "
                "(or has 2 tokens); raise seq_len or give longer answers"
            )
        self.lengths: list[int] = [len(p) for p in ids_parts]
        # Flat NumPy arrays, not tensors: a memory tracker then counts only the samples that
        # become batches, never the whole data set (as TextDataset does).
        self.tokens = np.fromiter((i for p in ids_parts for i in p), dtype=np.int64)
        self.labels = self.tokens.copy()
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        for k, prompt in enumerate(prompts):
            self.labels[self.offsets[k] : self.offsets[k] + prompt] = IGNORE_INDEX
        self.num_tokens = int(self.tokens.size)
        self.answer_tokens = int((self.labels != IGNORE_INDEX).sum())

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        lo, hi = int(self.offsets[index]), int(self.offsets[index + 1])
        return {
            "input_ids": torch.from_numpy(self.tokens[lo:hi].copy()),
            "labels": torch.from_numpy(self.labels[lo:hi].copy()),
        }

    def __repr__(self) -> str:
        return (
            f"SupervisedDataset({len(self)} samples, seq_len={self.seq_len}, "
            f"{self.num_tokens:,} tokens, {self.answer_tokens:,} in the loss)"
        )


def build_dataset(
    paths: Sequence[str | os.PathLike[str]],
    tokenizer: Tokenizer,
    seq_len: int,
    *,
    pack: bool = True,
    text_field: str = "text",
    say: Callable[[str], Any] | None = None,
) -> Any:
    """The dataset of a run's data files.

    Text alone becomes a :class:`~memfit.train.data.TextDataset` (packed into ``seq_len``
    windows when ``pack``); files with any chat or prompt/completion record become a
    :class:`SupervisedDataset` (text records in it are trained on whole).

    Args:
        paths: The data files (:func:`~memfit.train.records.read_records`).
        tokenizer: The run's tokenizer.
        seq_len: The most tokens a sample holds.
        pack: Pack text into full windows (text alone only).
        text_field: The field holding a text record's text.
        say: Called with a line on what is being done.

    Raises:
        WorkloadError: one sentence, for files or records that cannot be used.
    """
    say = say or (lambda message: None)
    say(f"reading {', '.join(os.fspath(p) for p in paths)}")
    records = read_records(paths, text_field=text_field)
    if all(r.kind == "text" for r in records):
        return TextDataset([r.text or "" for r in records], tokenizer, seq_len, pack=pack)
    say(f"tokenising {len(records):,} records")
    return SupervisedDataset(records, tokenizer, seq_len)
