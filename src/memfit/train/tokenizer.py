"""Tokenizers for training on text: a built-in byte tokenizer and user ``tokenizer.json`` files.

The byte tokenizer needs no file and no download: every UTF-8 byte is a token, plus three
specials. It is what ``memfit train`` uses by default, so a model trains on any text out of the
box (with a small vocabulary: 259 tokens, so the embedding and the logits stay small).

A user's own tokenizer is a ``tokenizer.json`` (the format of the ``tokenizers`` library, which
every Hugging Face fast tokenizer saves), or a tokenizer folder (``save_pretrained`` of a
transformers tokenizer, which a model folder often holds beside its weights) read by
transformers' ``AutoTokenizer`` as a :class:`PretrainedTokenizer`, which keeps the folder's
chat template: chat data (:mod:`memfit.train.chat`) is rendered with it. Either is loaded from
disk only.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from ..weights import reason
from ..workload import WorkloadError

__all__ = ["ByteTokenizer", "FileTokenizer", "PretrainedTokenizer", "Tokenizer", "load_tokenizer"]


class Tokenizer(Protocol):
    """What training needs from a tokenizer."""

    vocab_size: int
    pad_token_id: int
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (special tokens dropped)."""
        ...


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0-255) plus ``pad`` 256, ``bos`` 257 and ``eos`` 258.

    Any text encodes losslessly; decoding drops the specials and replaces bytes that do not form
    valid UTF-8 (a sequence cut in the middle of a character) with U+FFFD.

    Example::

        tok = ByteTokenizer()
        tok.decode(tok.encode("héllo")) == "héllo"
    """

    pad_token_id = 256
    bos_token_id = 257
    eos_token_id = 258
    vocab_size = 259

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Byte ids of ``text``; with ``add_special_tokens`` framed by ``bos`` ... ``eos``."""
        ids = list(text.encode("utf-8"))
        if add_special_tokens:
            return [self.bos_token_id, *ids, self.eos_token_id]
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; special and out-of-range ids are skipped."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=259)"


# Names tokenizer.json files commonly give their padding and end-of-text tokens.
_PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>")
_EOS_NAMES = ("</s>", "<|endoftext|>", "<eos>", "[SEP]", "<|end_of_text|>", "<|eot_id|>")


class FileTokenizer:
    """A ``tokenizers.Tokenizer`` loaded from a ``tokenizer.json``, with the training interface.

    Padding uses the file's pad token when it has one, else its end-of-text token, else id 0:
    padded positions never reach the loss (their labels are -100), so any id works.

    Attributes:
        inner: The ``tokenizers.Tokenizer``.
        path: Where it was loaded from.
    """

    def __init__(self, inner: Any, path: Path) -> None:
        self.inner = inner
        self.path = path
        self.vocab_size: int = int(inner.get_vocab_size(with_added_tokens=True))
        self.eos_token_id: int | None = _first_id(inner, _EOS_NAMES)
        pad = _first_id(inner, _PAD_NAMES)
        self.pad_token_id: int = pad if pad is not None else (self.eos_token_id or 0)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without the file's post-processing specials."""
        return list(self.inner.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (special tokens skipped)."""
        return str(self.inner.decode([int(i) for i in ids], skip_special_tokens=True))

    def __repr__(self) -> str:
        return f"FileTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


class PretrainedTokenizer:
    """A transformers tokenizer (``AutoTokenizer`` of a local folder), with the training
    interface.

    A document is encoded as the tokenizer frames it for the model (a Llama tokenizer's
    beginning-of-text token first), without the end-of-text token its post-processor may add:
    the dataset ends every document with ``eos_token_id`` itself. Padding uses the pad token,
    else the end-of-text token, else id 0 (padded positions never reach the loss).

    Unlike :class:`FileTokenizer` it keeps what the folder's ``tokenizer_config.json`` adds to
    the ``tokenizer.json``: the special tokens' roles and the chat template.

    Attributes:
        inner: The transformers tokenizer (``apply_chat_template`` lives there).
        path: The folder it was loaded from.
    """

    def __init__(self, inner: Any, path: Path) -> None:
        self.inner = inner
        self.path = path
        self.vocab_size: int = len(inner)  # added tokens included
        self.eos_token_id: int | None = inner.eos_token_id
        pad = inner.pad_token_id
        self.pad_token_id: int = pad if pad is not None else (self.eos_token_id or 0)
        # The ids the tokenizer puts before a text (its beginning-of-text token, if any),
        # found once by encoding a probe with and without its specials.
        plain = list(inner("a", add_special_tokens=False)["input_ids"])
        framed = list(inner("a", add_special_tokens=True)["input_ids"])
        at = next((i for i in range(len(framed)) if framed[i : i + len(plain)] == plain), 0)
        self.prefix: list[int] = framed[:at]

    @property
    def chat_template(self) -> str | None:
        """The folder's chat template (``None`` when it has none)."""
        return getattr(self.inner, "chat_template", None) or None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``: the tokenizer's leading specials, then the text's tokens."""
        return self.prefix + list(self.inner(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (special tokens skipped)."""
        return str(self.inner.decode([int(i) for i in ids], skip_special_tokens=True))

    def __repr__(self) -> str:
        return f"PretrainedTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


def _first_id(inner: Any, names: Sequence[str]) -> int | None:
    for name in names:
        idx = inner.token_to_id(name)
        if idx is not None:
            return int(idx)
    return None


def load_tokenizer(path: str | Path | None) -> ByteTokenizer | FileTokenizer | PretrainedTokenizer:
    """The tokenizer for a run: the byte tokenizer for ``None``, else the one on disk.

    Args:
        path: ``None``; a tokenizer folder with a ``tokenizer_config.json`` (as
            ``save_pretrained`` of a transformers tokenizer writes, often a model folder),
            read by ``AutoTokenizer``; a ``tokenizer.json`` file, or a folder holding only
            one. Nothing is downloaded.

    Raises:
        WorkloadError: when the file is missing or cannot be read as a tokenizer.
    """
    if path is None:
        return ByteTokenizer()
    p = Path(path)
    if p.is_dir() and any((p / name).is_file() for name in _AUTO_FILES):
        return _auto_tokenizer(p)
    if p.name == "tokenizer.json" and (p.parent / "tokenizer_config.json").is_file():
        return _auto_tokenizer(p.parent)  # the file of a saved folder: keep its chat template
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise WorkloadError(
            f"tokenizer file {str(p)!r} does not exist; give a tokenizer folder or a "
            "tokenizer.json, or leave the tokenizer out to use memfit's byte tokenizer"
        )
    from tokenizers import Tokenizer as HFTokenizer

    try:
        inner = HFTokenizer.from_file(str(p))
    except Exception as e:  # the library raises bare Exceptions on bad files
        raise WorkloadError(
            f"tokenizer file {str(p)!r} cannot be read as a tokenizers JSON file ({e}); "
            "give a tokenizer.json saved by the tokenizers or transformers library"
        ) from None
    return FileTokenizer(inner, p)


# A folder with one of these is a transformers tokenizer's: AutoTokenizer reads it.
_AUTO_FILES = ("tokenizer_config.json", "tokenizer.model", "vocab.json")


def _auto_tokenizer(folder: Path) -> PretrainedTokenizer:
    import transformers

    try:
        inner = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError...
        # A folder whose config names no class transformers knows: its tokenizer.json still
        # loads as a plain fast tokenizer, with the config's chat template and specials.
        try:
            inner = transformers.PreTrainedTokenizerFast.from_pretrained(
                str(folder), local_files_only=True
            )
        except Exception:
            inner = None
        if inner is not None:
            return PretrainedTokenizer(inner, folder)
        raise WorkloadError(
            f"tokenizer folder {str(folder)!r} cannot be read by transformers' AutoTokenizer "
            f"({reason(e)}); give a folder written by a tokenizer's save_pretrained"
        ) from None
    return PretrainedTokenizer(inner, folder)
