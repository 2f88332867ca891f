"""The length percentiles and the worst batch a plan must hold."""

from __future__ import annotations

import pytest

from memfit.train.lengths import LengthReport, length_report


class _Data:
    def __init__(self, lengths, wheres=None):
        self.lengths = lengths
        self.seq_len = 512
        self.truncated = 1
        self.dropped = 0
        if wheres is not None:
            self.wheres = wheres

    def __len__(self):
        return len(self.lengths)


def test_percentiles_are_nearest_rank_and_the_worst_batch_is_the_longest():
    lengths = list(range(1, 101))  # 1..100
    lengths[37], lengths[99] = 300, 38  # the longest is sample 37
    wheres = [f"f.jsonl line {i + 1}" for i in range(100)]
    report = length_report(_Data(lengths, wheres), 8)
    assert (report.p50, report.p90, report.p99, report.max) == (50, 90, 99, 300)
    assert report.mean == pytest.approx(sum(lengths) / 100)
    assert report.longest == 37 and report.longest_where == "f.jsonl line 38"
    assert report.worst_batch == (8, 300)
    text = report.summary()
    assert "p50 50, p90 90, p99 99, max 300 tokens" in text
    assert "1 truncated to 512 tokens" in text
    assert "Worst batch: 8 x 300 tokens, any batch holding sample 37" in text
    assert "f.jsonl line 38" in text
    assert report.to_dict()["worst_batch"] == [8, 300]


def test_a_batch_larger_than_the_data_is_the_data():
    report = length_report(_Data([5, 9]), 16, seq_len=64)
    assert report.worst_batch == (2, 9) and report.seq_len == 64 and report.longest_where is None
    assert isinstance(report, LengthReport)


def test_bad_inputs():
    with pytest.raises(ValueError, match="no samples"):
        length_report(_Data([]), 4)
    with pytest.raises(ValueError, match="batch size"):
        length_report(_Data([3]), 0)
