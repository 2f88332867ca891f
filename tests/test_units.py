import pytest

from memfit.units import GiB, MiB, TiB, format_bytes, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4GiB", 4 * GiB),
        ("4GB", 4 * 10**9),
        ("4096MiB", 4 * GiB),
        ("0.5TiB", TiB // 2),
        ("123456", 123456),
        (" 2 gib ", 2 * GiB),
        (1024, 1024),
        ("1.5e3", 1500),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "4 parsecs", "GiB", "-1GiB", "0", "0GiB", "nan", "1..2GB"])
def test_parse_size_rejects_with_a_sentence(bad):
    with pytest.raises(ValueError, match="size"):
        parse_size(bad)


def test_format_bytes_uses_binary_units():
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * MiB) == "3.00 MiB"
    assert format_bytes(1.5 * GiB) == "1.50 GiB"
    assert format_bytes(-2 * MiB) == "-2.00 MiB"
