"""Byte sizes: formatting in binary units and parsing of budget strings."""

from __future__ import annotations

import math
import numbers
import re

from .errors import MemfitTypeError, MemfitValueError, check_int, describe

__all__ = ["GiB", "KiB", "MiB", "TiB", "format_bytes", "parse_size"]

KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": KiB,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": MiB,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": GiB,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": TiB,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def format_bytes(n: float, precision: int = 2) -> str:
    """Format a byte count in binary units (B, KiB, MiB, GiB, TiB).

    Args:
        n: Number of bytes (may be negative, for differences).
        precision: Digits after the decimal point for units above bytes.
    """
    # numbers.Real: numpy's integers too, which are no ints.
    if isinstance(n, bool) or not isinstance(n, numbers.Real):
        raise MemfitTypeError(f"format_bytes takes a number of bytes, got {describe(n)}")
    if math.isnan(n):
        raise MemfitValueError("format_bytes takes a number of bytes, got nan")
    check_int(precision, "precision", 0)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{sign}{n / size:.{precision}f} {unit}"
    return f"{sign}{int(n)} B"


def parse_size(text: str | int | float) -> int:
    """Parse a size such as ``4GiB``, ``4GB``, ``4096MiB``, ``0.5TiB`` or ``123456`` into bytes.

    Decimal units (kB, MB, GB, TB) are powers of 1000, binary ones (KiB, MiB, GiB, TiB)
    powers of 1024; a bare number (an int, a float or a string without a unit) is bytes and
    must be whole: ``4.5`` is refused rather than read as 4 bytes (issue 37), while ``4.0``
    and ``"1.5e3"`` are 4 and 1500 bytes. With a unit, a fraction is rounded down to whole
    bytes (``0.1GiB``), which must leave at least one.

    Raises:
        MemfitTypeError: for anything but a string or a number (a ``TypeError``).
        MemfitValueError: with one sentence saying what was wrong and what is accepted (a
            ``ValueError``).
    """
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise MemfitTypeError(
            f"size {describe(text)} is not a number of bytes; give an int of bytes or a string "
            "such as 4GiB"
        )
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        match = _SIZE_RE.match(text)
        if not match or match.group(2).lower() not in _UNITS:
            raise MemfitValueError(
                f"size {text!r} is not understood; use a number with an optional unit "
                "such as 4GiB, 4GB, 4096MiB, 0.5TiB or plain bytes"
            )
        value, unit = float(match.group(1)), match.group(2).lower()
    size = value * _UNITS[unit] if not isinstance(text, int) else text
    if not math.isfinite(size) or size <= 0:
        raise MemfitValueError(f"size {text!r} must be a positive number of bytes")
    if _UNITS[unit] == 1 and size != int(size):
        raise MemfitValueError(
            f"size {text!r} is not a whole number of bytes; give whole bytes or a unit, such "
            "as 4.5GiB"
        )
    if int(size) < 1:
        raise MemfitValueError(f"size {text!r} is less than one byte")
    return int(size)
