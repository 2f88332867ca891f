"""A dry run of the disk tier: the device side exactly as the real run, disk bytes exactly, and
host bytes as an estimate (two window halves instead of every master and all the state)."""

from __future__ import annotations

import json

import pytest

import memfit

CONFIG = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64,
          "n_layer": 2, "n_head": 2, "vocab_size": 256, "n_positions": 64}  # fmt: skip


@pytest.mark.parametrize("window", [None, 1 << 19])
def test_dry_run_of_the_disk_tier(tmp_path, window):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    disk = tmp_path / "state"
    disk.mkdir()
    off = {"optimizer": "disk", "disk_dir": str(disk), "host_window_bytes": window}
    plan = memfit.Plan(offload=off)
    real = memfit.measure(str(path), plan, batch_size=2, seq_len=16)
    dry = memfit.dry_run(str(path), plan, batch_size=2, seq_len=16)
    assert dry.peak_by_tier["device"] == real.peak_by_tier["device"]
    assert dry.peak_by_category == real.peak_by_category
    assert dry.peak_by_tier["disk"] == real.peak_by_tier["disk"] > 0
    assert dry.meta["disk_tier"]["estimate"] is True
    # The host estimate: within 1% of the real tier's host peak (its first step and read
    # buffers differ), and below what the host tier would hold.
    host = memfit.dry_run(str(path), memfit.Plan(offload="host"), batch_size=2, seq_len=16)
    assert dry.peak_by_tier["host"] == pytest.approx(real.peak_by_tier["host"], rel=0.01)
    if window is not None:
        assert dry.peak_by_tier["host"] < host.peak_by_tier["host"]
