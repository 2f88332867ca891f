"""Which checkpoint a run resumes from, chosen and verified before any work.

Three ways to resume (``memfit train``'s options, :class:`~memfit.train.config.TrainConfig`'s
fields):

* ``--resume`` (``resume: true`` or ``"latest"``): the latest checkpoint of the checkpoint
  folder. A damaged one stops the run with the remedies: ``--resume latest-good`` or
  ``--resume-from PATH``.
* ``--resume latest-good`` (``resume: "latest-good"``): the newest checkpoint whose files
  match its manifest; damaged ones after it are passed over, and named.
* ``--resume-from PATH`` (``resume_from``): that checkpoint folder; the run's new checkpoints
  go to the checkpoint folder (by default the one holding ``PATH``).

Every file of the chosen checkpoint is checked against its manifest here (sizes and SHA-256,
:func:`~memfit.train.manifest.verify`), so a damaged checkpoint is named seconds into a run,
not after tokenising and planning. The trainer's load verifies again (cheaply: unchanged
files are not hashed twice in one process).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .checkpoint import list_checkpoints
from .manifest import CheckpointError, verify

__all__ = ["ResumePoint", "resume_point"]

#: ``resume``'s values, as ``memfit train --resume WORD`` takes them.
RESUME_MODES = ("latest", "latest-good")


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run continues from.

    Attributes:
        path: The checkpoint folder (``step-NNNNNNNN``).
        passed_over: Newer checkpoints that were damaged (``--resume latest-good``), each
            with why.
    """

    path: Path
    passed_over: tuple[tuple[Path, str], ...] = field(default=())

    def describe(self) -> str:
        """One line for the run's output: where it continues from, and what it passed over."""
        text = f"resuming from {self.path}"
        if self.passed_over:
            names = ", ".join(p.name for p, _ in self.passed_over)
            text += f" (passed over the damaged {names})"
        return text


def resume_point(
    checkpoint_dir: str | os.PathLike[str] | None,
    resume: bool | str = False,
    resume_from: str | os.PathLike[str] | None = None,
) -> ResumePoint | None:
    """The verified checkpoint to resume from, or ``None`` (nothing to resume: the run starts
    at step 0, as a first run with ``--resume`` does).

    Args:
        checkpoint_dir: The run's checkpoint folder.
        resume: ``False``, ``True``/``"latest"`` or ``"latest-good"``.
        resume_from: A checkpoint folder to continue from (wins over ``resume``).

    Raises:
        CheckpointError: one sentence naming the checkpoint, what is wrong and the remedy.
    """
    if resume_from is not None:
        path = Path(resume_from)
        if not path.is_dir():
            raise CheckpointError(
                f"--resume-from {str(path)!r} is not a folder; give a checkpoint folder "
                "(step-NNNNNNNN) of an earlier run"
            )
        _verify(path, "--resume-from names a damaged checkpoint",
                "give an earlier one with --resume-from PATH")
        return ResumePoint(path)
    if not resume or checkpoint_dir is None:
        return None
    found = list_checkpoints(checkpoint_dir)
    if not found:
        return None
    if resume == "latest-good":
        passed: list[tuple[Path, str]] = []
        for path in reversed(found):
            try:
                verify(path)
            except CheckpointError as e:
                passed.append((path, str(e)))
                continue
            return ResumePoint(path, tuple(passed))
        raise CheckpointError(
            f"no checkpoint in {str(checkpoint_dir)!r} is whole ({len(found)} damaged, the "
            f"latest {found[-1].name}); start a new run with another --checkpoint-dir"
        )
    latest = found[-1]
    earlier = f" (or --resume-from {found[-2]})" if len(found) > 1 else ""
    _verify(latest, "the latest checkpoint is damaged",
            f"resume from the newest whole one with --resume latest-good{earlier}")
    return ResumePoint(latest)


def _verify(path: Path, what: str, remedy: str) -> None:
    try:
        verify(path)
    except CheckpointError as e:
        raise CheckpointError(f"{what}: {_drop_remedy(str(e))}; {remedy}") from None


def _drop_remedy(message: str) -> str:
    # verify()'s own remedy (delete the folder) is replaced by the resume options.
    return message.split("; ", 1)[0]
