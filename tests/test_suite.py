"""The suite's own arrangements, checked where they can silently stop working."""

from __future__ import annotations

import os

import pytest


@pytest.mark.distributed
def test_multi_process_tests_share_one_xdist_worker(request):
    # Under xdist's loadgroup every multi-process test carries the "processes" group in its
    # node id, which is what sends them all to one worker (see conftest.py): without it two
    # of them run at once on the two cores, each several times slower.
    if not os.environ.get("PYTEST_XDIST_WORKER") or not request.config.getvalue("loadgroup"):
        pytest.skip("not run by xdist with --dist loadgroup")
    assert request.node.nodeid.endswith("@processes")
