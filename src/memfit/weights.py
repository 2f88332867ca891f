"""Saved weights: a local Hugging Face model folder, or a hub id, read for a fine-tune.

A model folder is what ``save_pretrained`` writes: a ``config.json`` and the weights in
safetensors, one ``model.safetensors`` or shards listed by ``model.safetensors.index.json``,
and often the tokenizer's files. Dry runs (``memfit profile``, ``memfit plan`` and the
planner inside ``memfit train``) read ``config.json`` alone (:mod:`memfit.workload`): the weight
files are not opened, so an 8B model is planned in seconds, and a folder whose weights are
still downloading can be planned already. For a training run:

* :func:`check_weights` checks that the weight files are all there (without reading them), so
  a missing shard is named before any planning.
* :func:`load_pretrained` builds the model on the meta device and loads every tensor straight
  into the dtype asked for (transformers' own loading: tied weights stay tied, checkpoints
  whose names or layouts differ from the model's are converted as transformers converts
  them). No tensor of the whole model exists in another dtype first: a bf16 plan's 8B model
  takes its 16 GB, never fp32's 32 GB, however the checkpoint was saved (one tensor at a time
  is converted).

A hub id (``meta-llama/Llama-3.1-8B``) is fetched through ``huggingface_hub`` only when it is
not a local path: the config alone for a dry run, the weights when a run trains. Where the hub
cannot be reached the error says how to download the folder and pass it instead.

Every failure is a :class:`WeightsError` with one sentence naming the file at fault.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .errors import MemfitError

__all__ = [
    "TOKENIZER_FILES",
    "WeightsError",
    "check_weights",
    "has_tokenizer",
    "hub_folder",
    "is_hub_id",
    "is_model_folder",
    "load_pretrained",
    "model_class",
    "reason",
]

#: The single-file and the sharded safetensors layouts ``save_pretrained`` writes.
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: Files that make a folder a tokenizer's (any one is enough for ``AutoTokenizer``).
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json")

# What a hub id looks like: ``owner/name`` (letters, digits, ``-_.``), nothing else.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
# The files a training run needs from the hub: transformers' safetensors layout only (no
# PyTorch pickles, no second copy in another layout such as Mistral's consolidated.safetensors).
_HUB_PATTERNS = ["*.json", "model*.safetensors", "tokenizer.model", "*.txt"]


class WeightsError(MemfitError, ValueError):
    """A model folder or hub id cannot be used; ``str(error)`` is one sentence naming the
    file (or the hub id) at fault and what to do."""


def reason(error: BaseException, limit: int = 200) -> str:
    """The first sentence of a library's error message, on one line and at most ``limit``
    characters: what goes in parentheses in memfit's one-sentence errors (transformers'
    messages run to a list of every model type it knows)."""
    text = " ".join(str(error).split()) or type(error).__name__
    text = re.split(r"(?<=[a-z0-9\)'\"])\. ", text, maxsplit=1)[0].rstrip(".")
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


# ---------------------------------------------------------------------------------- what a spec is
def is_model_folder(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a folder holding a ``config.json`` (a Hugging Face model folder)."""
    p = Path(path)
    return p.is_dir() and (p / "config.json").is_file()


def is_hub_id(spec: str) -> bool:
    """Whether ``spec`` reads as a hub id (``owner/name``) and names no local path."""
    return bool(_HUB_ID.match(spec)) and not os.path.exists(spec) and not spec.endswith(".json")


def has_tokenizer(folder: str | os.PathLike[str]) -> bool:
    """Whether ``folder`` holds a tokenizer's files (``save_pretrained`` of a tokenizer)."""
    p = Path(folder)
    return p.is_dir() and any((p / name).is_file() for name in TOKENIZER_FILES)


# ---------------------------------------------------------------------------------- loading
def model_class(config: Any) -> Any:
    """The transformers class a config builds: its ``architectures`` entry, else the first
    auto class (causal LM, masked LM, sequence classifier) that knows its model type.

    Raises:
        WeightsError: when transformers has no such model for it.
    """
    import transformers

    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, arch, None)
        if isinstance(cls, type) and issubclass(cls, nn.Module):
            return cls
    for auto, mapping in (
        ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING"),
        ("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING"),
        ("AutoModelForSequenceClassification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING"),
    ):
        if type(config) in getattr(transformers, mapping):
            return getattr(transformers, auto)
    raise WeightsError(
        f"transformers has no causal-LM, masked-LM or sequence-classification model for "
        f"model_type {config.model_type!r}"
    )


def check_weights(folder: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files of a model folder, each checked to exist and to be whole (its
    header is read and the file's size checked against it; no tensor is read), so a damaged
    download is named before any tokenising or planning.

    Returns:
        ``[model.safetensors]``, or the shards ``model.safetensors.index.json`` lists.

    Raises:
        WeightsError: naming the file: no weights at all, an index that is not JSON or lists
            no shards, a shard the index names that is not in the folder, or a file that is
            not safetensors or is cut short.
    """
    files = _weight_files(folder)
    for f in files:
        problem = safetensors_problem(f)
        if problem is not None:
            raise WeightsError(
                f"weights file {str(f)!r} {problem}; download or copy it again"
            )
    return files


def safetensors_problem(path: str | os.PathLike[str]) -> str | None:
    """What is wrong with a safetensors file, judged from its header alone, as the end of a
    sentence (``"is cut short: 1,024 of 4,096 bytes"``), or ``None`` for a whole file.

    The format: 8 bytes of header length (little-endian), the JSON header, then the tensors'
    bytes, whose extent the header's ``data_offsets`` give; a file shorter than that was cut
    (an interrupted copy or a full disk).
    """
    import struct

    p = Path(path)
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"is not a readable safetensors file ({size} bytes)"
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100_000_000:
                return "is not a readable safetensors file (its header length is past its end)"
            header = json.loads(f.read(n))
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    except (UnicodeDecodeError, json.JSONDecodeError):
        return "is not a readable safetensors file (its header is not JSON)"
    if not isinstance(header, dict):
        return "is not a readable safetensors file (its header is not a JSON object)"
    try:
        end = max(
            (int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
            default=0,
        )
    except (KeyError, TypeError, ValueError, IndexError):
        return "is not a readable safetensors file (a tensor's entry has no data_offsets)"
    if size < 8 + n + end:
        return f"is cut short: {size:,} of {8 + n + end:,} bytes"
    return None


def _weight_files(folder: str | os.PathLike[str]) -> list[Path]:
    """:func:`check_weights`' files, each checked to exist."""
    p = Path(folder)
    single, index = p / SINGLE_FILE, p / INDEX_FILE
    if index.is_file():
        try:
            data = json.loads(index.read_text())
            shards = sorted(set(data["weight_map"].values()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise WeightsError(
                f"weights index {str(index)!r} is not a safetensors index (a JSON file whose "
                "'weight_map' names each tensor's shard); save the model again"
            ) from None
        if not shards:
            raise WeightsError(f"weights index {str(index)!r} lists no shards; save the model again")
        for shard in shards:
            if not (p / shard).is_file():
                raise WeightsError(
                    f"weights shard {str(p / shard)!r}, listed in {INDEX_FILE}, is missing; "
                    "download or copy the whole folder again"
                )
        return [p / s for s in shards]
    if single.is_file():
        return [single]
    pickles = sorted(q.name for q in p.glob("pytorch_model*.bin"))
    if pickles:
        raise WeightsError(
            f"model folder {str(p)!r} has PyTorch pickles ({pickles[0]}) but no {SINGLE_FILE} "
            f"or {INDEX_FILE}; memfit loads safetensors: save the model again with "
            "save_pretrained(folder, safe_serialization=True)"
        )
    raise WeightsError(
        f"model folder {str(p)!r} has no weights ({SINGLE_FILE} or {INDEX_FILE}); give a folder "
        "written by save_pretrained, or a config.json path to train from random weights"
    )


def load_pretrained(
    folder: str | os.PathLike[str],
    model_class: Any,
    config: Any,
    dtype: torch.dtype,
    device: torch.device | str | None = None,
) -> nn.Module:
    """The model of ``folder`` with its saved weights, every tensor loaded straight into
    ``dtype`` on ``device``.

    Transformers builds the model on the meta device (no memory), then reads the safetensors
    files one tensor at a time, converting each to ``dtype`` as it is placed; tied weights
    stay tied. Tensors the checkpoint lacks would be initialised at random: that is refused
    (a fine-tune of half-random weights is not what was asked for).

    Args:
        folder: A model folder (:func:`check_weights` is run first).
        model_class: The transformers class (or ``AutoModelFor...``) to build.
        config: The folder's config (read from its config.json alone), used as is.
        dtype: The dtype of every floating parameter (``torch.bfloat16`` for a bf16-pure
            plan, else ``torch.float32``).
        device: Where the tensors go (``None``: torch's default device).

    Raises:
        WeightsError: for missing files, a file that is not safetensors, or weights that do
            not fit the config (one sentence naming the file or the tensor).
    """
    files = check_weights(folder)
    device = torch.device(device) if device is not None else torch.get_default_device()
    kwargs: dict[str, Any] = {}
    if device.type != "cpu":
        kwargs["device_map"] = str(device)
    from transformers.utils import logging as hf_logging

    # Transformers' loading bar would cut into memfit's own output: off while loading.
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model, info = model_class.from_pretrained(
            str(folder), config=config, dtype=dtype, local_files_only=True,
            output_loading_info=True, **kwargs,
        )  # fmt: skip
    except Exception as e:  # safetensors and transformers raise many kinds; name the file
        bad = _unreadable(files)
        if bad is not None:
            raise WeightsError(
                f"weights file {str(bad)!r} is not a readable safetensors file; download or "
                "copy it again"
            ) from None
        problem = reason(e)
        which = files[0].name if len(files) == 1 else f"{len(files)} shards of {INDEX_FILE}"
        raise WeightsError(
            f"weights in {str(folder)!r} ({which}) cannot be loaded into "
            f"{getattr(model_class, '__name__', model_class)} ({problem})"
        ) from None
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    missing = _really_missing(model, info.get("missing_keys") or ())
    if missing:
        raise WeightsError(
            f"weights in {str(folder)!r} lack {len(missing)} tensor(s) the model needs "
            f"({missing[0]}{', ...' if len(missing) > 1 else ''}); the checkpoint does not match "
            "its config.json"
        )
    return model


def _unreadable(files: Sequence[Path]) -> Path | None:
    """The first of ``files`` whose safetensors header cannot be read (no tensor is read)."""
    from safetensors import safe_open

    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                handle.keys()
        except Exception:  # safetensors raises its own error types, and OSError
            return f
    return None


def _really_missing(model: nn.Module, missing: Sequence[str]) -> list[str]:
    """Missing keys that are not tied to a loaded tensor (an LM head tied to the embedding
    is saved once and reported missing by some versions)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    out = []
    for key in sorted(missing):
        p = params.get(key)
        if p is not None and any(q is p for k, q in params.items() if k != key and k not in missing):
            continue
        out.append(key)
    return out


# ---------------------------------------------------------------------------------- the hub
def hub_folder(repo_id: str, *, weights: bool) -> Path:
    """The local folder of hub model ``repo_id``: its config (and tokenizer) alone, or with
    ``weights`` every safetensors file too, fetched into the Hugging Face cache.

    Raises:
        WeightsError: when the hub cannot be reached (``HF_HUB_OFFLINE``, no network), with
            the command that downloads the folder; when it has no such model or it is gated.
    """
    try:
        from huggingface_hub import errors, snapshot_download
    except ImportError:  # transformers depends on it; a stripped install may not
        raise WeightsError(_offline_message(repo_id)) from None
    patterns = _HUB_PATTERNS if weights else ["config.json", *TOKENIZER_FILES, "*.txt"]
    try:
        path = snapshot_download(repo_id, allow_patterns=patterns)
    except (errors.GatedRepoError, errors.RepositoryNotFoundError):
        raise WeightsError(
            f"model {repo_id!r} is not a local path, and the Hugging Face hub has no such model "
            "or it needs a login (hf auth login) and an accepted licence"
        ) from None
    except Exception:  # offline mode, no network, a proxy: the same advice for each
        raise WeightsError(_offline_message(repo_id)) from None
    return Path(path)


def _offline_message(repo_id: str) -> str:
    return (
        f"model {repo_id!r} is not a local path and the Hugging Face hub cannot be reached from "
        f"here; download it where it can with `hf download {repo_id} --local-dir DIR` "
        f"(`huggingface-cli download {repo_id} --local-dir DIR` with an older huggingface_hub), "
        "then pass --model DIR"
    )
