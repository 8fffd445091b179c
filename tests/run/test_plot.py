"""The demo's learning-curve plot reads the JSONL log the trainer writes."""

import json

import pytest

from easyvlm.run.plot import curve_points, main, panel_series, read_log, write_learning_curve

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


def test_every_reward_and_validation_key_gets_a_curve_in_its_panel():
    rows = [*ROWS, {"step": 3, "reward/format": 1.0, "val/reward_score": 2.5, "actor/pg_loss": 0.1, "val/flag": True,
                    "val/multi_turn/turns/max": 2.0, "reward/error_count": 7.0}]
    series = panel_series(rows)
    assert series == {
        "reward/": {"reward/accuracy": [(1, 0.5), (2, 0.75)], "reward/format": [(3, 1.0)], "reward/overall": [(1, 0.55)]},
        # a bool is not a score; actor/ keys belong to neither panel, counts (error_count, multi-turn) to none
        "val/": {"val/accuracy_reward": [(0, 0.25), (2, 0.5)], "val/reward_score": [(3, 2.5)]},
    }


def test_write_learning_curve_from_rows_or_the_log_and_none_without_values(tmp_path):
    from PIL import Image

    run = tmp_path / "run"
    path = write_learning_curve(run, ROWS)
    assert path == run / "learning_curve.png" and Image.open(path).size == (1210, 440)  # 11 x 4 in at 110 dpi
    path.unlink()
    (run / "experiment_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert write_learning_curve(run) == run / "learning_curve.png"
    assert write_learning_curve(tmp_path / "empty", [{"step": 1, "actor/pg_loss": 0.3}]) is None
    assert not (tmp_path / "empty" / "learning_curve.png").exists()


def test_a_run_without_validation_gets_the_training_panel_alone(tmp_path):
    from PIL import Image

    rows = [{"step": 1, "reward/overall": 0.5, "reward/error_count": 0.0}, {"step": 2, "reward/overall": 0.7}]
    path = write_learning_curve(tmp_path / "run", rows)
    assert Image.open(path).size == (605, 440)  # one 5.5 x 4 in panel at 110 dpi, not two with one empty


def test_main_without_out_writes_next_to_the_log(tmp_path):
    log = tmp_path / "experiment_log.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    main([str(log)])
    assert (tmp_path / "learning_curve.png").is_file()
