"""memfit's optional dependencies (pyproject.toml's extras): which extra brings which package,
and the one sentence that says what to install when one is missing.

A floor-1 module (it imports nothing of memfit), so every floor can raise :class:`MissingExtra`
where it imports a peer's library, and the commands can check a run's needs before any work
(:func:`require`).
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from .errors import MemfitError

__all__ = ["EXTRAS", "MissingExtra", "import_extra", "installed", "require"]

#: Package -> the extra of memfit that installs it (``pip install 'memfit[EXTRA]'``).
EXTRAS: dict[str, str] = {
    "peft": "peft",
    "torchao": "torchao",
    "datasets": "data",
    "accelerate": "hf",
    "lightning": "lightning",
    "bitsandbytes": "bitsandbytes",
}


class MissingExtra(MemfitError, ImportError, ValueError):
    """An optional dependency is not installed; the message is one sentence naming the extra.

    Both an ``ImportError`` (what it is) and a ``ValueError`` (what the commands turn into one
    sentence and exit code 2: the run asked for something this installation lacks).

    Args:
        package: The missing package (``peft``).
        what: What needs it, as the subject of the sentence (``--allow lora``).
        extra: The extra that installs it (default: :data:`EXTRAS`'s for ``package``).
        instead: A clause ending the sentence: what to do instead (`` (or use ...)``).
    """

    def __init__(
        self, package: str, what: str, extra: str | None = None, instead: str = ""
    ) -> None:
        self.package = package
        self.extra = extra or EXTRAS.get(package, package)
        self.what = what
        super().__init__(
            f"{what} needs {package}, which is not installed here: "
            f"pip install 'memfit[{self.extra}]'{instead}",
            name=package,
        )


def installed(package: str) -> bool:
    """Whether ``package`` can be imported, without importing it (no time spent, no output
    printed by its import)."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a parent package missing; a module set to None
        return False


def require(package: str, what: str, extra: str | None = None) -> None:
    """Raise :class:`MissingExtra` when ``package`` is not installed.

    Raises:
        MissingExtra: naming ``what`` needs it and the extra to install.
    """
    if not installed(package):
        raise MissingExtra(package, what, extra)


def import_extra(module: str, what: str, extra: str | None = None) -> ModuleType:
    """Import ``module`` (``peft``, ``torchao.float8``) of an optional package.

    Raises:
        MissingExtra: when its top package cannot be imported (not installed, or an install
            whose import fails: installing the extra again is the fix either way).
        ImportError: the package's own, when the package imports but ``module`` does not (a
            version without it): its message says more than "not installed" would.
    """
    package = module.split(".")[0]
    try:
        importlib.import_module(package)
    except ImportError:
        raise MissingExtra(package, what, extra) from None
    return importlib.import_module(module)
