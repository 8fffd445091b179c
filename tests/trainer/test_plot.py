"""The demo's learning-curve plot reads the JSONL log the trainer writes."""

import json

import pytest

from easyvlm.trainer.plot import curve_points, main, read_log

ROWS = [
    {"step": 0, "val/accuracy_reward": 0.25},
    {"step": 1, "reward/accuracy": 0.5, "reward/overall": 0.55},
    {"step": 2, "reward/accuracy": 0.75, "val/accuracy_reward": 0.5},
]


def test_curve_points_take_only_the_steps_that_logged_the_key():
    # validation ran at steps 0 and 2 only; training metrics at steps 1 and 2
    assert curve_points(ROWS, "val/accuracy_reward") == [(0, 0.25), (2, 0.5)]
    assert curve_points(ROWS, "reward/accuracy") == [(1, 0.5), (2, 0.75)]
    assert curve_points(ROWS, "missing") == []


def test_main_writes_a_png_from_a_log_and_names_a_missing_log(tmp_path, capsys):
    log = tmp_path / "run" / "experiment_log.jsonl"
    log.parent.mkdir()
    log.write_text("".join(json.dumps(r) + "\n" for r in ROWS) + "\n")  # a trailing blank line is fine
    assert read_log(log) == ROWS
    out = tmp_path / "curve.png"
    main([str(log), str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit, match="no log at .*nothing.jsonl"):
        main([str(tmp_path / "nothing.jsonl"), str(out)])
