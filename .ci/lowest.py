"""Print pip constraints that pin every dependency pyproject.toml bounds from below to that
lower bound: the "lowest versions" CI job installs memfit with them (``pip install -c``), so
the bounds memfit declares are the versions it was tested with."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
wanted = project["project"]["dependencies"] + project["project"]["optional-dependencies"]["dev"]
for requirement in wanted:
    match = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9][0-9.]*)", requirement.strip())
    if match is None:
        sys.exit(f"pyproject.toml: {requirement!r} has no plain '>=' lower bound to pin")
    print(f"{match[1]}=={match[2]}")
