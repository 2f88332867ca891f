"""Applying a plan: the techniques of a :class:`~memfit.plan.Plan` put on a model in one
fixed order (:mod:`memfit.apply.compose`) and stepped through one loop
(:mod:`memfit.apply.stepper`).

A floor above ``plan.py``, the techniques (:mod:`memfit.strategies`) and the parallel engines
(:mod:`memfit.distributed`) it loops over: they know nothing of each other and meet only here.
"""
