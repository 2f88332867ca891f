"""Device profiles: built-in GPUs, this CPU, custom descriptions, budgets."""

from __future__ import annotations

import json

import pytest

from memfit.targets import CUSTOM_FIELDS, DEVICES, get_device, parse_budget, parse_device
from memfit.units import GiB, MiB

L4 = (
    "name=l4,memory=22.5GiB,mem_bandwidth=300GB/s,host_bandwidth=32GB/s,"
    "compute_capability=8.9,bf16=true,bf16_tflops=121"
)


def test_builtin_gpus():
    h100 = get_device("H100")
    assert h100 is DEVICES["h100"]
    assert h100.is_cuda and h100.compute_capability == (9, 0) and h100.supports_bf16
    assert h100.workspace_bytes == 32 * MiB  # Hopper's cuBLAS workspace
    assert DEVICES["a100"].workspace_bytes == 4096 * 1024 * 2 + 16 * 1024 * 8  # ":4096:2:16:8"
    assert not DEVICES["t4"].supports_bf16 and DEVICES["t4"].compute_capability == (7, 5)
    # Two cuBLAS handles' workspaces (the forward's and the autograd thread's) and cuBLASLt's.
    assert h100.workspaces_bytes == 2 * 32 * MiB + 1 * MiB
    assert h100.budget_bytes == h100.memory_bytes - h100.context_bytes - h100.workspaces_bytes
    assert get_device("cpu").workspaces_bytes == 0
    assert get_device("cpu").kind == "cpu" and not get_device("cpu").is_cuda


def test_unknown_device_lists_the_known_ones():
    with pytest.raises(ValueError, match="not known") as e:
        get_device("v100")
    for name in ("cpu", *DEVICES):
        assert name in str(e.value)


def test_custom_device_inline_and_file(tmp_path):
    l4 = get_device(L4)
    assert l4.name == "l4" and l4.memory_bytes == int(22.5 * GiB)
    assert l4.mem_bandwidth == 300e9 and l4.host_bandwidth == 32e9
    assert l4.compute_capability == (8, 9) and l4.flops["bf16"] == 121e12
    path = tmp_path / "l4.json"
    fields = dict(part.split("=") for part in L4.split(","))
    path.write_text(json.dumps(fields))
    assert get_device(str(path)) == l4
    yaml_path = tmp_path / "l4.yaml"
    yaml_path.write_text("".join(f"{k}: {v}\n" for k, v in fields.items()))
    assert get_device(str(yaml_path)) == l4


@pytest.mark.parametrize("missing", CUSTOM_FIELDS)
def test_custom_device_lacking_a_field_names_it(missing):
    parts = [p for p in L4.split(",") if not p.startswith(missing + "=")]
    with pytest.raises(ValueError, match=f"lacks the field '{missing}'"):
        parse_device(",".join(parts))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ("memory=lots", "'memory' must be a size"),
        ("mem_bandwidth=fast", "'mem_bandwidth' must be bytes per second"),
        ("compute_capability=x", "compute_capability"),
        ("bf16=maybe", "'bf16' must be true or false"),
        ("colour=red", "unknown field 'colour'"),
    ],
)
def test_custom_device_bad_fields(change, match):
    key = change.split("=")[0]
    parts = [p for p in L4.split(",") if not p.startswith(key + "=")] + [change]
    with pytest.raises(ValueError, match=match):
        parse_device(",".join(parts))


def test_missing_description_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        get_device(str(tmp_path / "nope.json"))


def test_budgets():
    assert parse_budget("4GiB") == (4 * GiB, None)
    size, dev = parse_budget("a100-40gb")
    assert dev is DEVICES["a100-40gb"] and size == dev.memory_bytes
    with pytest.raises(ValueError, match="not understood"):
        parse_budget("lots")
