"""Load and run a benchmark script (``benchmarks/NAME.py``) from the GPU harnesses' tests."""

from __future__ import annotations

import importlib.util
import os
import runpy
import subprocess
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_script(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` imported as a module (its functions, without running it)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``python benchmarks/<name>.py <args>``, its output captured."""
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / f"{name}.py"), *args], capture_output=True, text=True,
        check=False,
    )


def run_here(name: str, *args: str, monkeypatch, capsys) -> subprocess.CompletedProcess[str]:
    """``python benchmarks/<name>.py <args>`` run as ``__main__`` in this interpreter: its exit
    code, stdout and stderr as :func:`run_script` gives them, without the seconds a fresh
    interpreter spends importing torch (for the checks a script makes before it measures;
    each script keeps a test that runs it as a real process). What a script changes at import
    (``sys.argv``, ``sys.path``, the environment, torch's threads) is put back."""
    import torch

    path = BENCHMARKS / f"{name}.py"
    monkeypatch.setattr(sys, "argv", [str(path), *args])
    monkeypatch.setattr(sys, "path", [str(BENCHMARKS), *sys.path])
    monkeypatch.setattr(os, "environ", os.environ.copy())
    threads = torch.get_num_threads()
    capsys.readouterr()  # what the test printed before is not the script's
    code: int | str | None = 0
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as stop:
        code = stop.code
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr()
    returncode = code if isinstance(code, int) else (0 if code is None else 1)
    return subprocess.CompletedProcess([str(path), *args], returncode, out.out, out.err)
