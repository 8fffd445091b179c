"""Plot a run's ``reward/*`` and ``val/*`` keys (counts aside) in two panels (docs/tracking.md):
``python -m easyvlm.run.plot <run dir>/experiment_log.jsonl [OUT.png]``, by default ``learning_curve.png``
next to the log."""

from __future__ import annotations

import json
import sys
from pathlib import Path

PANELS = (("reward/", "training rewards (sampled responses)"), ("val/", "validation"))
# Left out of the panels: multi-turn counts (turns per sample up to max_turns, calls per sample) and
# every other count (reward/error_count) share no scale with rewards; they stay in the JSONL log.
NOT_PLOTTED = ("val/multi_turn/",)


def is_plotted(key: str, prefix: str) -> bool:
    return key.startswith(prefix) and not key.startswith(NOT_PLOTTED) and not key.endswith("count")
CURVE_FILE = "learning_curve.png"


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def curve_points(rows: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of every row that logged ``key`` as a number (validation: every val_freq steps)."""
    return [(r["step"], float(r[key])) for r in rows if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]


def panel_series(rows: list[dict]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """{panel prefix: {key: points}} of every numeric key of the rows under ``reward/`` and ``val/``, in key order."""
    keys = sorted({k for r in rows for k in r})
    series: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for prefix, _ in PANELS:
        found = {k: curve_points(rows, k) for k in keys if is_plotted(k, prefix)}
        series[prefix] = {k: points for k, points in found.items() if points}
    return series


def plot_rows(rows: list[dict], out_path: Path, title: str) -> Path | None:
    """Draw ``rows`` (experiment_log.jsonl's) to ``out_path``; None when they hold no reward or validation key."""
    series = panel_series(rows)
    if not any(series.values()):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(prefix, label) for prefix, label in PANELS if series[prefix]]  # no empty panel
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), dpi=110, squeeze=False)
    for ax, (prefix, label) in zip(axes[0], panels):
        values = []
        for key, points in series[prefix].items():
            steps, ys = zip(*points)
            values += ys
            ax.plot(steps, ys, marker="o" if len(points) < 30 else None, markersize=3, label=key.removeprefix(prefix))
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if values and 0 <= min(values) and max(values) <= 1:  # scores in [0, 1]: a fixed scale compares runs
            ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=7, loc="best")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path)
    plt.close(fig)
    return out_path


def write_learning_curve(save_dir: Path, rows: list[dict] | None = None) -> Path | None:
    """``<save_dir>/learning_curve.png`` from ``rows``, else from ``<save_dir>/experiment_log.jsonl``
    (the file logger's); None when there is nothing to plot."""
    save_dir = Path(save_dir)
    if rows is None:
        log = save_dir / "experiment_log.jsonl"
        rows = read_log(log) if log.is_file() else []
    return plot_rows(rows, save_dir / CURVE_FILE, save_dir.name)


def plot(log_path: Path, out_path: Path) -> Path | None:
    return plot_rows(read_log(log_path), out_path, log_path.parent.name)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (1, 2):
        raise SystemExit("usage: python -m easyvlm.run.plot LOG.jsonl [OUT.png]")
    log = Path(argv[0])
    if not log.is_file():
        raise SystemExit(f"easyvlm.run.plot: no log at {log}; a run writes <save_checkpoint_path>/experiment_log.jsonl")
    out = Path(argv[1]) if len(argv) == 2 else log.parent / CURVE_FILE
    written = plot(log, out)
    if written is None:
        raise SystemExit(f"easyvlm.run.plot: {log} has no reward/ or val/ values to plot")
    print(f"wrote {written}")


if __name__ == "__main__":
    main()
