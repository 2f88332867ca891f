"""memfit's own errors, and the small checks the public functions run on their arguments.

Every error memfit raises on purpose derives from :class:`MemfitError`, so one ``except
memfit.MemfitError`` tells memfit's refusals from a bug (an ``AttributeError`` from deep inside
is a bug: issue 37). Each keeps the built-in base it had, so code that catches ``ValueError``
(the CLI does) still catches it:

* :class:`MemfitTypeError` (``TypeError``): an argument of the wrong kind, e.g. ``None`` where
  a model goes;
* :class:`MemfitValueError` (``ValueError``): an argument of the right kind but a wrong value,
  e.g. a budget of ``4.5`` bytes, an unknown ``allow`` name;
* :class:`MemfitStateError` (``RuntimeError``): a call at the wrong moment, e.g. a
  tracker's ``report()`` before its block ran;
* the errors of each concern (``PlanError``, ``WorkloadError``, ``ConfigError``, ...) derive
  from :class:`MemfitError` and their old base.

Messages are one sentence naming the argument, what was given and what is accepted, the same
sentence the CLI prints for the same mistake where the CLI can make it. The checks run before
any work, so a wrong argument never costs a search.

Stdlib only, on the bottom floor: every floor may raise these.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

__all__ = [
    "MemfitError",
    "MemfitStateError",
    "MemfitTypeError",
    "MemfitValueError",
    "check_bool",
    "check_int",
    "check_names",
    "check_number",
    "check_text",
    "check_type",
    "describe",
]


class MemfitError(Exception):
    """Base class of every error memfit raises on purpose: a refusal with one sentence."""


class MemfitTypeError(MemfitError, TypeError):
    """An argument of a public function is of a kind it does not accept."""


class MemfitValueError(MemfitError, ValueError):
    """An argument of a public function is of the right kind but a value it does not accept."""


class MemfitStateError(MemfitError, RuntimeError):
    """A call at a moment it cannot serve, e.g. ``tracker.report()`` before the tracker's
    block ran."""


def describe(value: Any) -> str:
    """``value`` as a message names it: its type, and its repr when that is short."""
    kind = type(value).__name__
    kind = f"{'an' if kind[:1].lower() in 'aeiou' else 'a'} {kind}"
    if value is None:
        return "None"
    try:
        text = repr(value)
    except Exception:  # a broken __repr__ must not hide the real mistake
        return kind
    if len(text) > 60 or "\n" in text:
        return kind
    if isinstance(value, (str, int, float)):
        return f"{text} ({kind})"
    return f"{kind} ({text})"


def check_type(value: Any, types: type | tuple[type, ...], name: str, accepted: str) -> None:
    """Raise :class:`MemfitTypeError` unless ``value`` is an instance of ``types``.

    Args:
        value: The argument.
        types: The accepted classes.
        name: The argument's name, as the message shows it (``model``, ``--allow``).
        accepted: What is accepted, in words (``"an nn.Module"``).
    """
    if not isinstance(value, types):
        raise MemfitTypeError(f"{name} must be {accepted}, got {describe(value)}")


def check_int(value: Any, name: str, minimum: int | None = None, *, optional: bool = False) -> None:
    """Raise unless ``value`` is a whole number (not a bool) of at least ``minimum``.

    ``None`` passes with ``optional``. A wrong kind is a :class:`MemfitTypeError`; a float
    (even a whole one: an int argument stays an int) or a number below ``minimum`` is a
    :class:`MemfitValueError`.
    """
    if value is None and optional:
        return
    floor = "" if minimum is None else f" >= {minimum}"
    if isinstance(value, float):
        # A number, but not a whole one: a wrong value, as a budget of 4.5 bytes is.
        raise MemfitValueError(f"{name} must be a whole number{floor}, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise MemfitTypeError(f"{name} must be a whole number{floor}, got {describe(value)}")
    if minimum is not None and value < minimum:
        raise MemfitValueError(f"{name} must be a whole number{floor}, got {value}")


def check_number(value: Any, name: str, minimum: float | None = None) -> None:
    """Raise unless ``value`` is a finite int or float (not a bool) of at least ``minimum``."""
    floor = "" if minimum is None else f" >= {minimum:g}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MemfitTypeError(f"{name} must be a number{floor}, got {describe(value)}")
    if value != value or value in (float("inf"), float("-inf")):
        raise MemfitValueError(f"{name} must be a finite number{floor}, got {value}")
    if minimum is not None and value < minimum:
        raise MemfitValueError(f"{name} must be a number{floor}, got {value}")


def check_text(value: Any, name: str, accepted: str) -> str:
    """``value`` as a string: a ``str``, or a path (``os.PathLike``) as its string; anything
    else is a :class:`MemfitTypeError` naming ``accepted``."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise MemfitTypeError(f"{name} must be {accepted}, got {describe(value)}")
    return value


def check_bool(value: Any, name: str) -> None:
    """Raise :class:`MemfitTypeError` unless ``value`` is ``True`` or ``False``."""
    if not isinstance(value, bool):
        raise MemfitTypeError(f"{name} must be True or False, got {describe(value)}")


def check_names(value: Any, known: Iterable[str], name: str) -> tuple[str, ...]:
    """Names given as the CLI takes them, checked against ``known``.

    Args:
        value: A string (one name, or several separated by commas, as on the command line:
            ``"lora,qlora"``) or an iterable of such strings; ``None`` is no names.
        known: The accepted names, listed in the message when one is not among them.
        name: The argument's name in the message (``--allow``).

    Returns:
        The stripped, non-empty names, in order.

    Raises:
        MemfitTypeError: for anything but a string or an iterable of strings.
        MemfitValueError: for a name not in ``known``.
    """
    known = tuple(known)
    accepted = f"a name or a list of names among {', '.join(known)}"
    if value is None:
        return ()
    if isinstance(value, str):
        parts: list[Any] = [value]
    elif isinstance(value, (bytes, dict)) or not isinstance(value, Iterable):
        raise MemfitTypeError(f"{name} must be {accepted}, got {describe(value)}")
    else:
        parts = list(value)
    out: list[str] = []
    for part in parts:
        if not isinstance(part, str):
            raise MemfitTypeError(f"{name} must be {accepted}, got an item {describe(part)}")
        out += [p.strip() for p in part.split(",") if p.strip()]
    for v in out:
        if v not in known:
            raise MemfitValueError(
                f"{name} value {v!r} does not exist; use one or more of {', '.join(known)}"
            )
    return tuple(out)
