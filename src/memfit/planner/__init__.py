"""The planner: the fastest plan that fits a memory budget, with the evidence."""

from .entry import plan
from .explain import explain_table
from .result import Candidate, NothingFits, PlanResult
from .search import ALLOW, FORBID

__all__ = ["ALLOW", "FORBID", "Candidate", "NothingFits", "PlanResult", "explain_table", "plan"]
