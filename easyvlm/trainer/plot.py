"""Plot the learning curve of a run from its experiment_log.jsonl.

    python -m easyvlm.trainer.plot checkpoints/easyvlm/demo/experiment_log.jsonl curve.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CURVES = (
    ("reward/accuracy", "train accuracy (sampled)"),
    ("val/accuracy_reward", "validation accuracy (held-out prompts)"),
    ("reward/overall", "train reward (overall)"),
)


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def curve_points(rows: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of every row that logged ``key`` (validation runs only every val_freq steps)."""
    return [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]


def plot(log_path: Path, out_path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_log(log_path)
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    for key, label in CURVES:
        points = curve_points(rows, key)
        if points:
            steps, values = zip(*points)
            ax.plot(steps, values, marker="o" if key.startswith("val/") else None, markersize=3, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("score")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(log_path.parent.name)
    fig.tight_layout()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path)
    return out_path


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        raise SystemExit("usage: python -m easyvlm.trainer.plot LOG.jsonl OUT.png")
    if not Path(argv[0]).is_file():
        raise SystemExit(f"easyvlm.trainer.plot: no log at {argv[0]}; a run writes <save_checkpoint_path>/experiment_log.jsonl")
    print(f"wrote {plot(Path(argv[0]), Path(argv[1]))}")


if __name__ == "__main__":
    main()
