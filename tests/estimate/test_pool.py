"""A worker process runs one of a prediction's shallow dry runs; the prediction is the same."""

from __future__ import annotations

import json

import pytest

import memfit
from memfit.estimate import pool as pool_module
from memfit.estimate.compose import predict_peak, rebuildable
from memfit.estimate.pool import DryRunPool
from memfit.workload import load_workload

# A GPT-2 with six blocks (composed from depths 2 and 3), from a config file: a worker
# process makes it again from the path alone.
CONFIG = {
    "model_type": "gpt2",
    "architectures": ["GPT2LMHeadModel"],
    "n_embd": 64,
    "n_layer": 6,
    "n_head": 2,
    "vocab_size": 512,
    "n_positions": 128,
    "bos_token_id": 0,
    "eos_token_id": 0,
}


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2-6") / "config.json"
    path.write_text(json.dumps(CONFIG))
    return load_workload(str(path), 8, 32)


@pytest.fixture
def answered(monkeypatch):
    got = []
    real = DryRunPool.result

    def counting(self):
        value = real(self)
        got.append(value is not None)
        return value

    monkeypatch.setattr(DryRunPool, "result", counting)
    return got


PLANS = [
    memfit.Plan(grad_accum_steps=4, optimizer="adafactor"),
    memfit.Plan(checkpointing="selective", precision="bf16-mixed"),
]


@pytest.mark.parametrize("plan", PLANS, ids=["accum-adafactor", "selective-bf16"])
def test_a_prediction_with_a_worker_equals_one_without(workload, plan, answered):
    alone = predict_peak(workload, plan)
    with DryRunPool() as pool:
        shared = predict_peak(workload, plan, pool=pool)
    assert answered == [True]  # the worker ran a depth...
    assert shared == alone  # ...and its answer is the one this process would have made
    assert shared.method == "composed"


def test_a_dead_worker_leaves_the_prediction_to_this_process(workload, answered):
    plan = memfit.Plan(optimizer="adafactor")
    alone = predict_peak(workload, plan)
    with DryRunPool() as pool:
        pool._proc.kill()
        pool._proc.wait()
        assert predict_peak(workload, plan, pool=pool) == alone
        assert not pool.alive
    assert answered in ([], [False])


def test_an_error_in_the_worker_is_met_again_here(workload, monkeypatch):
    # A job the worker cannot run (here: a SPEC that no longer exists) is answered None, and
    # the caller runs that depth itself.
    with DryRunPool() as pool:
        assert pool.submit(
            {"spec": "no-such-model", "batch_size": 1, "seq_len": 8, "depth": 2,
             "plan": memfit.Plan(), "device": None, "scale": 1.0, "threads": 1}
        )  # fmt: skip
        assert pool.result() is None
        assert pool.alive  # the worker itself goes on


def test_only_workloads_made_from_their_spec_go_to_a_worker(workload, monkeypatch):
    assert rebuildable(workload)
    changed = workload.replace(build_model=workload.build_model)
    assert not rebuildable(changed)
    sent = []
    monkeypatch.setattr(DryRunPool, "submit", lambda self, job: sent.append(job) or False)
    with DryRunPool() as pool:
        predict_peak(changed, memfit.Plan(), pool=pool)
    assert sent == []


def test_messages_survive_the_pipe(tmp_path):
    path = tmp_path / "m"
    with open(path, "wb") as f:
        pool_module.write_message(f, {"a": [1, 2.5, None]})
        pool_module.write_message(f, ("x",))
    with open(path, "rb") as f:
        assert pool_module.read_message(f) == {"a": [1, 2.5, None]}
        assert pool_module.read_message(f) == ("x",)
        with pytest.raises(EOFError):
            pool_module.read_message(f)
