"""Checkpoint contents without pickle: tensors to safetensors, the rest to JSON, checksums.

A trainer's state (optimizer ``state_dict``, RNG states, scheduler, data position, plan) is a
tree of dicts, lists and tuples whose leaves are tensors or plain values. :func:`flatten`
splits such a tree into a JSON-able tree, where each tensor is replaced by a reference
``{"$tensor": key}``, and a flat ``{key: tensor}`` mapping for a safetensors file;
:func:`unflatten` reverses it exactly. Only JSON-able types go into the JSON; anything else
(an arbitrary object) is refused with :class:`CheckpointError` rather than pickled, so loading
a checkpoint never runs code.

Encodings that keep the round trip exact: tuples (``{"$tuple": [...]}``; Python's RNG state
is one), dicts whose keys are not all strings (``{"$items": [[k, v], ...]}``; an optimizer's
state is keyed by parameter index), non-finite floats (``{"$float": "nan"}``, since strict JSON
has no NaN), NumPy arrays (``{"$ndarray": [...], "dtype": ...}``; NumPy's RNG state holds one)
and NumPy scalars (as Python numbers).

The manifest (``manifest.json``) lists each file of a checkpoint with its size and SHA-256;
:func:`verify` checks them all before anything is loaded.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import MemfitError

__all__ = [
    "FORMAT",
    "MANIFEST_FILE",
    "CheckpointError",
    "file_sha256",
    "flatten",
    "params_sha256",
    "read_manifest",
    "unflatten",
    "verify",
    "write_manifest",
]

FORMAT = "memfit-checkpoint/1"
MANIFEST_FILE = "manifest.json"
_CHUNK = 1 << 22


class CheckpointError(MemfitError, ValueError):
    """A checkpoint that cannot be written or loaded; ``str(error)`` is one sentence."""


# ---------------------------------------------------------------------------------- trees
def flatten(tree: Any, prefix: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """Split ``tree`` into a JSON-able tree and the tensors it references.

    Args:
        tree: Dicts, lists, tuples, tensors, ``None``, bools, ints, floats, strings, NumPy
            arrays and scalars, ``torch.dtype`` values, nested freely.
        prefix: Put before every tensor key (to keep several trees' tensors in one file).

    Returns:
        ``(json_tree, tensors)``: tensors are detached, on the CPU, contiguous and own their
        memory (safetensors refuses views of one storage).

    Raises:
        CheckpointError: for a value of any other type, naming where it sits in the tree.
    """
    tensors: dict[str, torch.Tensor] = {}

    def walk(x: Any, where: str) -> Any:
        if isinstance(x, torch.Tensor):
            key = f"{prefix}{len(tensors)}"
            tensors[key] = x.detach().to("cpu", copy=True).contiguous()
            return {"$tensor": key}
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, int):
            return int(x)
        if isinstance(x, float):
            return x if math.isfinite(x) else {"$float": repr(x)}
        if isinstance(x, torch.dtype):
            return {"$dtype": str(x).removeprefix("torch.")}
        if isinstance(x, tuple):
            return {"$tuple": [walk(v, f"{where}[{i}]") for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [walk(v, f"{where}[{i}]") for i, v in enumerate(x)]
        if isinstance(x, Mapping):
            if all(isinstance(k, str) and not k.startswith("$") for k in x):
                return {k: walk(v, f"{where}.{k}") for k, v in x.items()}
            return {"$items": [[walk(k, where), walk(v, f"{where}[{k!r}]")] for k, v in x.items()]}
        np = _numpy()
        if np is not None and isinstance(x, np.ndarray):
            return {"$ndarray": x.tolist(), "dtype": str(x.dtype)}
        if np is not None and isinstance(x, np.generic):
            return walk(x.item(), where)
        raise CheckpointError(
            f"cannot store {where or 'the value'} in a checkpoint: a {type(x).__name__} is "
            "neither a tensor nor plain JSON data (memfit never pickles)"
        )

    return walk(tree, ""), tensors


def unflatten(tree: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Rebuild the tree :func:`flatten` split, taking tensors from ``tensors``.

    Raises:
        CheckpointError: when a referenced tensor is missing.
    """

    def walk(x: Any) -> Any:
        if isinstance(x, list):
            return [walk(v) for v in x]
        if not isinstance(x, dict):
            return x
        if "$tensor" in x:
            key = x["$tensor"]
            if key not in tensors:
                raise CheckpointError(f"checkpoint state refers to tensor {key!r}, which is missing")
            return tensors[key]
        if "$float" in x:
            return float(x["$float"])
        if "$dtype" in x:
            return getattr(torch, x["$dtype"])
        if "$tuple" in x:
            return tuple(walk(v) for v in x["$tuple"])
        if "$items" in x:
            return {walk(k): walk(v) for k, v in x["$items"]}
        if "$ndarray" in x:
            np = _numpy()
            assert np is not None, "a checkpoint with NumPy state needs NumPy"
            return np.asarray(x["$ndarray"], dtype=x["dtype"])
        return {k: walk(v) for k, v in x.items()}

    return walk(tree)


def _numpy() -> Any:
    try:
        import numpy

        return numpy
    except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
        return None


# ---------------------------------------------------------------------------------- checksums
def file_sha256(path: str | os.PathLike[str]) -> str:
    """The SHA-256 of a file's bytes, as hex (read in 4 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def params_sha256(model: torch.nn.Module) -> str:
    """SHA-256 over ``model``'s parameters in ``named_parameters()`` order, each tensor's bytes
    (its dtype's bytes in row-major order, on the CPU): equal hashes mean equal weights bit for
    bit. A sharded parameter (FSDP2's DTensor) is hashed whole, so every process of a run
    gets the same hash (a collective: every process must call it)."""
    h = hashlib.sha256()
    for _, p in model.named_parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        if hasattr(t, "quantized_data"):  # QLoRA's 4-bit weight: the bytes it is made of
            t = torch.cat([t.quantized_data, t.quantized_scalers.view(torch.uint8)])
        t = t.to("cpu").contiguous()
        # A uint8 view gives the raw bytes of any dtype (NumPy has no bfloat16).
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def write_manifest(folder: Path, step: int, extra: Mapping[str, Any] | None = None) -> Path:
    """Write ``manifest.json`` listing every file in ``folder`` with its size and SHA-256.

    Written last, so a folder with a manifest holds the files it names.
    """
    files = {
        p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != MANIFEST_FILE
    }
    data = {"format": FORMAT, "step": int(step), "files": files, **dict(extra or {})}
    path = folder / MANIFEST_FILE
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return path


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of a checkpoint folder.

    Raises:
        CheckpointError: when it is missing, unreadable or of another format.
    """
    path = folder / MANIFEST_FILE
    if not path.is_file():
        old = " (an older memfit format that used pickle; it cannot be loaded)" if (
            folder / "state.pt"
        ).exists() else ""
        raise CheckpointError(
            f"checkpoint {str(folder)!r} has no {MANIFEST_FILE}{old}; it is not a finished memfit "
            "checkpoint: resume from another with --resume-from PATH, or the newest whole one "
            "with --resume latest-good"
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {str(folder)!r} has an unreadable manifest ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("files"), dict):
        raise CheckpointError(
            f"checkpoint {str(folder)!r} has a manifest that is not a {FORMAT} manifest"
        )
    return data


def verify(folder: Path) -> dict[str, Any]:
    """Check every file the manifest names (present, same size, same SHA-256).

    Returns:
        The manifest.

    Raises:
        CheckpointError: naming the first file that is missing or differs.
    """
    manifest = read_manifest(folder)
    stamp = _stamp(folder, manifest)
    if stamp is not None and _VERIFIED.get(Path(folder).resolve()) == stamp:
        return manifest  # hashed already by this process, and not touched since
    for name, meta in manifest["files"].items():
        p = folder / name
        if not p.is_file():
            raise CheckpointError(f"checkpoint {str(folder)!r} is incomplete: {name} is missing")
        if p.stat().st_size != meta.get("bytes") or file_sha256(p) != meta.get("sha256"):
            raise CheckpointError(
                f"checkpoint {str(folder)!r} is corrupt: the checksum of {name} does not match "
                "its manifest; delete that folder to resume from an earlier checkpoint"
            )
    if stamp is not None:
        _VERIFIED[Path(folder).resolve()] = stamp
    return manifest


#: Checkpoints this process verified: folder -> the stat of each of its files then. A run
#: checks the checkpoint it resumes from before any work and again when it loads it; the
#: second check hashes nothing when no file changed.
_VERIFIED: dict[Path, tuple[tuple[str, int, int, int], ...]] = {}


def _stamp(folder: Path, manifest: Mapping[str, Any]) -> tuple[tuple[str, int, int, int], ...] | None:
    try:
        names = [MANIFEST_FILE, *sorted(manifest["files"])]
        stats = [(n, os.stat(Path(folder) / n)) for n in names]
    except OSError:
        return None
    return tuple((n, s.st_size, s.st_mtime_ns, s.st_ino) for n, s in stats)
