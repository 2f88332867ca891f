"""The dependency versions memfit supports, checked once at import.

CI proves both ends of the window: ``.ci/run`` runs the suite against the newest releases on
the registry (torch at the lower end's CPU build), its newest-torch job runs the fast tier,
the distributed tests and the planner's worker against the newest torch the registry serves
(its default build, CUDA's, with its own dependencies: :data:`SUPPORTED`'s upper bound), and
its lowest-versions job runs the zoo and the planner tests against the lowest versions
``pyproject.toml`` allows (:data:`SUPPORTED`'s lower bounds, the same numbers). An older
release than the window raises at import with one sentence; a newer one than CI last proved
warns once, and memfit runs.

Where torch's behaviour changed inside the window, memfit follows the installed torch's, found
from torch itself rather than from its version where it can be (the pipeline's receive
buffers: :mod:`memfit.estimate.pipeline_terms`; selective checkpointing's saved-tensor
hooks: :mod:`memfit.strategies.selective`).

``pyproject.toml``'s ``requires-python`` is :data:`PYTHON`: the newest torch of the window
(2.15) and transformers (5.21 on) need Python 3.11, and CI runs on 3.11 only.

What the packaging metadata lacks: ``pip`` enforces the lower bounds only when it installs
memfit, not when a user later installs an older transformers beside it, and an upper bound
there would stop users from trying a release that works.
"""

from __future__ import annotations

import os
import re
import warnings
from importlib import metadata

from .errors import MemfitError

__all__ = ["ALLOW_OLDER", "PYTHON", "SUPPORTED", "UnsupportedVersion", "__version__", "check_versions", "parse_version"]

#: memfit's own version (``memfit.__version__``), here so that any floor may name it without
#: importing the top package (the device fingerprint of targets/profiles.py does).
__version__ = "0.1.0"

#: package -> (lowest supported, newest CI has run the suite against). Keep the lowest in step
#: with pyproject.toml's ``>=`` bounds (a test checks they agree).
SUPPORTED: dict[str, tuple[str, str]] = {
    "torch": ("2.13.0", "2.15.0"),
    "transformers": ("5.18.0", "5.24.0"),
}

#: The lowest Python memfit supports (pyproject.toml's ``requires-python``; a test checks they
#: agree): what the window's newest releases need (torch 2.15, transformers 5.21 on), and the
#: only one CI runs.
PYTHON = "3.11"


#: The environment variable that turns the refusal of an older release into a warning: for a
#: machine whose torch cannot be upgraded (a cluster's CUDA build; the GPU validation harness
#: ran on one), where what memfit uses happens to work. Not tested by CI.
ALLOW_OLDER = "MEMFIT_ALLOW_OLDER_VERSIONS"


def _older_allowed() -> bool:
    return os.environ.get(ALLOW_OLDER, "").strip().lower() in ("1", "true", "yes")


class UnsupportedVersion(MemfitError, ImportError):
    """A dependency is older than memfit supports."""


def parse_version(text: str) -> tuple[int, ...]:
    """``"2.13.0+cpu"`` -> ``(2, 13, 0)``: the leading release numbers (local and pre-release
    tags dropped)."""
    numbers = re.match(r"\d+(?:\.\d+)*", text)
    return tuple(int(n) for n in numbers.group(0).split(".")) if numbers else ()


def check_versions(installed: dict[str, str] | None = None) -> list[str]:
    """Check the installed versions of :data:`SUPPORTED`'s packages.

    Args:
        installed: package -> version, for tests; default: what is installed (a package that
            is not installed is skipped: its import fails on its own, with its own message).

    Returns:
        The warnings issued (newer than CI has proved; older than the window, where
        :data:`ALLOW_OLDER` is set).

    Raises:
        UnsupportedVersion: naming the package, its version and the supported window, when
            one is older than the window.
    """
    said = []
    for package, (lowest, newest) in SUPPORTED.items():
        if installed is not None:
            version = installed.get(package)
        else:
            try:
                version = metadata.version(package)
            except metadata.PackageNotFoundError:
                version = None
        if version is None:
            continue
        if parse_version(version) < parse_version(lowest):
            message = (
                f"memfit needs {package} {lowest} or newer (tested up to {newest}), but "
                f"{package} {version} is installed; upgrade it with "
                f"pip install '{package}>={lowest}'"
            )
            if not _older_allowed():
                raise UnsupportedVersion(
                    message + f" (or set {ALLOW_OLDER}=1 to run at your own risk)"
                )
            warnings.warn(message + f"; running anyway, since {ALLOW_OLDER} is set",
                          stacklevel=2)
            said.append(message)
            continue
        # A patch release of the newest minor one is taken as tested: it fixes, not breaks.
        if parse_version(version)[:2] > parse_version(newest)[:2]:
            message = (
                f"{package} {version} is newer than memfit has been tested with "
                f"({lowest} to {newest}); if something breaks, install '{package}<={newest}' "
                "and report it"
            )
            warnings.warn(message, stacklevel=2)
            said.append(message)
    return said
