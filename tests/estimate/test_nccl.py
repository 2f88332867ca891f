"""NCCL's communicator memory per rank: the model's scaling with groups, channels and
settings, its zeros, its environment overrides, and its place in each rank's device total."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memfit.cli import app
from memfit.distributed.config import ParallelConfig
from memfit.estimate.nccl import (
    NcclSettings,
    communicator_bytes,
    nccl_bytes,
    nccl_rank_bytes,
    process_groups,
    rank_target,
)
from memfit.targets import get_device
from memfit.units import MiB

H100, A100, CPU = get_device("h100"), get_device("a100"), get_device("cpu")
DEFAULTS = NcclSettings()


def test_nothing_for_one_process_the_cpu_or_gloo():
    assert nccl_bytes(ParallelConfig(), 0, H100) == 0
    assert process_groups(ParallelConfig(), 0) == []
    assert nccl_rank_bytes(ParallelConfig(data=4), CPU) == [0, 0, 0, 0]
    assert nccl_bytes(ParallelConfig(data=4, backend="gloo"), 0, H100) == 0
    assert nccl_bytes(ParallelConfig(data=4), 0, H100) > 0


def test_a_connection_is_every_protocols_buffer_in_cumem_granules():
    # LL 512 KiB + LL128 4,800 KiB + Simple 4 MiB = 9.1875 MiB, in 2 MiB granules 10 MiB
    # (nccl#1685's 10,485,760-byte allocations); the send side's header one 2 MiB granule.
    assert DEFAULTS.connection_bytes() == 12 * MiB
    no_cumem = NcclSettings(cumem=False)
    assert no_cumem.connection_bytes() == 512 * 1024 + 4_915_200 + 4 * MiB + 4096


def test_within_ten_percent_of_nccl_964_on_four_a100s():
    """nccl#964: 4 x A100 with NVLink, one 4 MB all-reduce per group: 544 MB for a group of
    2, 688 MB for groups of 3 and 4 (read as MiB, as PyTorch users print memory)."""
    measured = {2: 544, 3: 688, 4: 688}
    for n, mib in measured.items():
        got = nccl_bytes(ParallelConfig(data=n), 0, A100, settings=DEFAULTS) / MiB
        assert abs(got - mib) / mib < 0.10, (n, got)


def test_scales_with_channels_ranks_and_buffer_size():
    ring_tree = {
        n: nccl_bytes(ParallelConfig(data=n), 0, A100, settings=DEFAULTS) for n in (2, 4, 8)
    }
    conn, channels = DEFAULTS.connection_bytes(), DEFAULTS.channels(A100)
    # Ring: one connection per channel; tree: 2 (n-1)/n neighbours, each a connection.
    for n, got in ring_tree.items():
        assert got == channels * conn + channels * conn * 2 * (n - 1) // n
    half = NcclSettings(max_channels=channels // 2)
    assert nccl_bytes(ParallelConfig(data=4), 0, A100, settings=half) == ring_tree[4] // 2
    big = NcclSettings(buffsize=8 * MiB)  # 13.1875 MiB received: 14 MiB, + the 2 MiB header
    assert big.connection_bytes() == 16 * MiB
    assert nccl_bytes(ParallelConfig(data=2), 0, A100, settings=big) == ring_tree[2] * 16 // 12


def test_nvls_on_hopper_with_more_than_two_local_ranks():
    par = ParallelConfig(data=8)
    with_nvls = nccl_bytes(par, 0, H100, settings=DEFAULTS)
    without = nccl_bytes(par, 0, H100, settings=NcclSettings(nvls=False))
    # 16 NVLS channels x 2 x (128 KiB chunk x 8 steps) for each of the node's 8 ranks.
    assert with_nvls - without == 16 * 2 * MiB * 8
    pair = ParallelConfig(data=2)
    assert (nccl_bytes(pair, 0, H100, settings=DEFAULTS)
            == nccl_bytes(pair, 0, H100, settings=NcclSettings(nvls=False)))
    # The A100 has no NVLS: its total is ring and tree alone.
    assert (nccl_bytes(par, 0, A100, settings=DEFAULTS)
            == nccl_bytes(par, 0, A100, settings=NcclSettings(nvls=False)))


def test_each_group_of_a_layout_adds_its_communicator():
    par = ParallelConfig(data=2, tensor=2, pipeline=2, microbatches=2)
    names = [g.name for g in process_groups(par, 0)]
    assert names == ["world", "tensor", "data", "pipeline"]
    total = nccl_bytes(par, 0, H100, settings=DEFAULTS)
    parts = [communicator_bytes(g, H100, DEFAULTS) for g in process_groups(par, 0)]
    assert total == sum(parts) and all(p > 0 for p in parts)
    # Same world, data parallelism alone: one communicator.
    assert nccl_bytes(ParallelConfig(data=8), 0, H100, settings=DEFAULTS) == parts[0] < total


def test_pipeline_ends_talk_to_one_neighbour_and_the_middle_to_two():
    par = ParallelConfig(pipeline=4, microbatches=4)
    per_rank = nccl_rank_bytes(par, H100, settings=DEFAULTS)
    world = communicator_bytes(process_groups(par, 0)[0], H100, DEFAULTS)
    p2p = [b - world for b in per_rank]
    assert p2p[1] == p2p[2] == 2 * p2p[0] == 2 * p2p[3] > 0
    looped = ParallelConfig(pipeline=4, microbatches=8, schedule="interleaved-1f1b")
    assert len(set(nccl_rank_bytes(looped, H100, settings=DEFAULTS))) == 1
    # Across nodes a peer gets NCCL_NCHANNELS_PER_NET_PEER channels, not the node's.
    spread = nccl_rank_bytes(par, H100, gpus_per_node=1, settings=DEFAULTS)
    group = process_groups(par, 0, gpus_per_node=1)[1]
    assert group.crosses_nodes
    assert communicator_bytes(group, H100, DEFAULTS) == 2 * DEFAULTS.connection_bytes()
    assert spread[0] < per_rank[0]


def test_settings_come_from_the_environment():
    env = {"NCCL_BUFFSIZE": "8388608", "NCCL_NVLS_ENABLE": "0", "NCCL_MAX_NCHANNELS": "8",
           "NCCL_ALGO": "Ring", "NCCL_NCHANNELS_PER_NET_PEER": "4"}
    s = NcclSettings.from_env(env)
    assert (s.buffsize, s.nvls, s.channels(H100), s.algorithms, s.net_channels_per_peer) == (
        8 * MiB, False, 8, frozenset({"ring"}), 4)
    # Ring only, 8 channels, 16 MiB connections.
    assert nccl_bytes(ParallelConfig(data=8), 0, H100, settings=s) == 8 * 16 * MiB
    assert NcclSettings.from_env({"NCCL_ALGO": "^nvls,tree"}).algorithms == frozenset({"ring"})
    assert NcclSettings.from_env({}) == DEFAULTS


def test_nccl_buffsize_in_the_environment_reaches_the_prediction(monkeypatch):
    par = ParallelConfig(data=2)
    before = nccl_bytes(par, 0, A100)
    assert nccl_rank_bytes(par, A100) == [before] * 2
    monkeypatch.setenv("NCCL_BUFFSIZE", str(8 * MiB))
    assert nccl_bytes(par, 0, A100) == before * 16 // 12
    assert nccl_rank_bytes(par, A100) == [before * 16 // 12] * 2  # not a cached answer
    monkeypatch.setenv("NCCL_BUFFSIZE", "lots")
    with pytest.raises(ValueError, match=r"^NCCL_BUFFSIZE must be a whole number >= 1, got 'lots'$"):
        nccl_bytes(par, 0, A100)


def test_rank_target_puts_the_communicators_in_the_overhead():
    par = ParallelConfig(data=4)
    on = rank_target(H100, par, 0, settings=DEFAULTS)
    assert on.nccl_bytes == nccl_bytes(par, 0, H100, settings=DEFAULTS) > 0
    assert on.overhead_bytes == H100.overhead_bytes + on.nccl_bytes
    assert on.budget_bytes == H100.budget_bytes - on.nccl_bytes
    assert rank_target(on, par, 0, settings=DEFAULTS) is on  # set, never added twice
    assert rank_target(H100, ParallelConfig(), 0).nccl_bytes == 0


runner = CliRunner()


@pytest.mark.parametrize("device", ["h100", "cpu"])
def test_profile_world_size_json_counts_each_ranks_nccl_share(tmp_path, device, monkeypatch):
    monkeypatch.delenv("NCCL_BUFFSIZE", raising=False)
    out = tmp_path / "ranks.json"
    res = runner.invoke(app, ["profile", "--model", "gpt2-tiny", "-b", "2", "-l", "16",
                              "--dry-run", "--device", device, "--world-size", "2",
                              "--json", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    expected = nccl_rank_bytes(ParallelConfig(data=2), get_device(device))
    assert data["nccl_bytes"] == expected
    assert (min(expected) > 0) == (device == "h100")
    for r in ("0", "1"):
        rep = data["reports"][r]
        assert rep["nccl_bytes"] == expected[int(r)]
        # The rank's device total: the allocator's reserve, the context and workspaces, and
        # its communicators.
        fixed = get_device(device).overhead_bytes if device == "h100" else 0
        total = rep["peak_reserved_bytes"] + fixed + expected[int(r)]
        assert rep["predicted_device_total_bytes"] == total
        assert data["predicted_device_total_bytes"][int(r)] == total


def test_profile_world_size_refuses_a_bad_nccl_setting(monkeypatch):
    monkeypatch.setenv("NCCL_MAX_NCHANNELS", "0")
    res = runner.invoke(app, ["profile", "--model", "gpt2-tiny", "-b", "2", "-l", "16",
                              "--dry-run", "--device", "h100", "--world-size", "2"])
    assert res.exit_code == 2
    assert "NCCL_MAX_NCHANNELS must be a whole number >= 1, got '0'" in res.output
    assert "Traceback" not in res.output
