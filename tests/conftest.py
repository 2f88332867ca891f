"""Settings shared by the whole suite, and the checks that keep its markers honest."""

from __future__ import annotations

import multiprocessing.util
import os
import subprocess

import pytest
import torch

# Processes started so far in this process (subprocess.Popen, and multiprocessing's spawn,
# which torch.multiprocessing and the elastic launcher use; a fork is not counted).
_STARTED = [0]
_BEFORE = pytest.StashKey[int]()
_MARKS = ("subprocess", "distributed")


def _counting(fn, spared: str | None = None):
    def wrapper(*args, **kwargs):
        if spared is None or not any(spared in str(a) for a in args):
            _STARTED[0] += 1
        return fn(*args, **kwargs)

    return wrapper


def pytest_configure(config: pytest.Config) -> None:
    subprocess.Popen.__init__ = _counting(subprocess.Popen.__init__)  # type: ignore[method-assign]
    # Not counted: multiprocessing's fork server, which the planner starts for its worker where
    # this process ran a backward on a CUDA build of torch (memfit/planner/ahead.py): started
    # once per process, from a thread beside the planner (so possibly while a later test runs),
    # and its workers are forks. Tests that need it up carry the subprocess marker.
    multiprocessing.util.spawnv_passfds = _counting(
        multiprocessing.util.spawnv_passfds, spared="multiprocessing.forkserver"
    )


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        # The multi-process tests share one xdist worker: two of them at once would each wait
        # for the cores the other holds.
        if item.get_closest_marker("distributed"):
            item.add_marker(pytest.mark.xdist_group("processes"))
        # Inductor's compiled step starts the C++ compiler (tests/optim/test_fused8bit.py).
        if "needs_compiled" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.subprocess)
    # The long tests first: xdist hands tests out in order, and one of them started last
    # would leave the other core idle while it runs.
    items.sort(key=lambda item: not any(item.get_closest_marker(m) for m in ("slow", *_MARKS)))


@pytest.hookimpl(tryfirst=True)  # before xdist's worker sends the collected ids
def pytest_collection_finish(session: pytest.Session) -> None:
    # pytest-xdist's loadgroup puts a test in its group by suffixing its node id with
    # "@group", through ``item._nodeid``; pytest 9 keeps node ids in ``item._id`` (a NodeId),
    # so that suffix is lost and every group's tests are spread over the workers (two
    # multi-process tests then fight for the two cores). Give such items the suffixed id here.
    if not session.config.getoption("loadgroup", default=None):
        return
    for item in session.items:
        groups = sorted({str(m.args[0]) for m in item.iter_markers("xdist_group") if m.args})
        if groups and "@" not in item.nodeid and hasattr(item, "_id"):
            from _pytest.nodes import NodeId

            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(groups)}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    item.stash[_BEFORE] = _STARTED[0]
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if call.when != "call" or not report.passed or any(item.get_closest_marker(m) for m in _MARKS):
        return
    started = _STARTED[0] - item.stash.get(_BEFORE, _STARTED[0])
    if started:
        # The fast tier (-m "not slow and not distributed and not subprocess") must not start
        # interpreters: each costs seconds of imports.
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} started {started} process(es) (in the test or a fixture it uses) "
            "without @pytest.mark.subprocess or @pytest.mark.distributed"
        )


# The same for the interpreters tests start (``memfit train`` in a subprocess, torchrun's
# workers: the launcher sets its own share): on two busy cores a second thread per process
# only spins. A caller's own setting stands.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    # The models in the tests are tiny: a second intra-op thread buys nothing, and on a busy
    # two-core machine its spinning makes each op many times slower.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
