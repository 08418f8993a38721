"""The benchmark scripts' tables and timing (`modern_jax.report`)."""

import csv

import pytest

from modern_jax.report import fmt, median_seconds, write_table


@pytest.mark.quick
def test_a_table_is_written_as_markdown_and_csv_that_reads_back(tmp_path):
    rows = [{"impl": "reference", "ms": 1.25, "tokens": 4096, "error": 3e-7},
            {"impl": "pallas", "ms": 123456.0, "tokens": 8192, "error": 0.0}]
    path = write_table(rows, tmp_path / "out", "bench", title="attention")
    assert path == tmp_path / "out" / "bench.md"
    assert path.read_text().splitlines() == [
        "### attention", "", "| impl | ms | tokens | error |", "|---|---|---|---|",
        "| reference | 1.2500 | 4096 | 3e-07 |", "| pallas | 1.23e+05 | 8192 | 0.0000 |"]
    with open(tmp_path / "out" / "bench.csv", newline="") as f:
        back = list(csv.DictReader(f))
    assert back == [{k: str(v) for k, v in row.items()} for row in rows]  # the CSV keeps every digit


@pytest.mark.quick
def test_fmt_and_median_seconds():
    assert [fmt(v) for v in (0.5, 0.001234, 2e5, 0.0, 7, "x")] == ["0.5000", "0.00123", "2e+05", "0.0000", "7", "x"]
    calls = []
    assert median_seconds(lambda n: calls.append(n) or n, 3, repeats=4) >= 0
    assert calls == [3] * 5  # one warm-up call, then the timed ones
