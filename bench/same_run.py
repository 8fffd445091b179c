"""Are two runs' logs the same run? Compares two ``experiment_log.jsonl`` files row by row, value by
value, leaving out what measures the machine rather than the run: ``timing_s/*``,
``timing_per_token_ms/*`` and ``perf/*`` (step time, throughput, memory).

    python bench/same_run.py <run_dir_or_log_a> <run_dir_or_log_b>

Prints the number of rows and values compared and every difference (step, key, a, b); exits 1 if
there is one. Used to check that a refactor leaves the demo's 301 rows as they were (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

MACHINE_PREFIXES = ("timing_s/", "timing_per_token_ms/", "perf/")


def read_rows(path: str) -> list[dict]:
    log = Path(path)
    if log.is_dir():
        log = log / "experiment_log.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def run_values(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(MACHINE_PREFIXES)}


def same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def differences(rows_a: list[dict], rows_b: list[dict]) -> list[tuple]:
    out: list[tuple] = []
    if len(rows_a) != len(rows_b):
        out.append(("rows", "count", len(rows_a), len(rows_b)))
    for a, b in zip(rows_a, rows_b):
        va, vb = run_values(a), run_values(b)
        for key in sorted(va.keys() | vb.keys()):
            if not same(va.get(key), vb.get(key)):
                out.append((a.get("step"), key, va.get(key), vb.get(key)))
    return out


def main(argv: list[str]) -> int:
    rows_a, rows_b = read_rows(argv[0]), read_rows(argv[1])
    diffs = differences(rows_a, rows_b)
    values = sum(len(run_values(r)) for r in rows_a)
    print(f"{len(rows_a)} / {len(rows_b)} rows, {values} run values compared (timings, throughput and memory aside): "
          f"{len(diffs)} differences")
    for diff in diffs[:50]:
        print("  step {}: {}: {!r} != {!r}".format(*diff))
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
