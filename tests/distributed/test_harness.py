import pytest
import torch
import torch.distributed as dist

from .harness import run_ranks


def _sum_ranks(rank: int, world_size: int) -> float:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise RuntimeError("rank one fails")


@pytest.mark.distributed
def test_two_real_processes_all_reduce():
    assert run_ranks(_sum_ranks, 2) == [3.0, 3.0]


@pytest.mark.distributed
def test_a_failing_rank_fails_the_test():
    with pytest.raises(AssertionError, match="rank one fails"):
        run_ranks(_fail_on_one, 2, timeout=60)
