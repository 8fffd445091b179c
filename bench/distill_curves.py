"""On-policy distillation against GRPO on the demo task (issue 48): the validation accuracy of each
run against steps, the first step at 0.9, and the reverse KL to the teacher falling.

Run the trainer for each recipe (same student, same CPU), then summarise their logs:

    python -m easyvlm.trainer.main config=examples/config.yaml trainer.save_checkpoint_path=/tmp/grpo
    python -m easyvlm.trainer.main config=examples/distill.yaml trainer.save_checkpoint_path=/tmp/distill
    python -m easyvlm.trainer.main config=examples/distill.yaml algorithm.distill_only=false \\
        algorithm.distill_coef=0.1 trainer.save_checkpoint_path=/tmp/rl_distill
    python bench/distill_curves.py grpo=/tmp/grpo distill=/tmp/distill rl_distill=/tmp/rl_distill

Prints one JSON line per run: the validation curve, the first step whose validation accuracy
reached 0.9, the token-mean reverse KL (``distill/reverse_kl``) over the first and the last 10 steps,
and the median ``timing_s/step`` and ``timing_s/teacher``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def summary(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "experiment_log.jsonl").read_text().splitlines() if line.strip()]
    val = [(r["step"], round(r["val/accuracy_reward"], 3)) for r in rows if "val/accuracy_reward" in r]
    steps = [r for r in rows if r["step"] > 0 and "timing_s/step" in r]
    kl = [r["distill/reverse_kl"] for r in steps if "distill/reverse_kl" in r]

    def median(key: str) -> float | None:
        values = [r[key] for r in steps if key in r]
        return round(statistics.median(values), 3) if values else None

    return {
        "val_accuracy": val,
        "first_step_at_0.9": next((s for s, a in val if a >= 0.9), None),
        "reverse_kl_first_10": round(statistics.mean(kl[:10]), 3) if kl else None,
        "reverse_kl_last_10": round(statistics.mean(kl[-10:]), 3) if kl else None,
        "median_step_s": median("timing_s/step"),
        "median_teacher_s": median("timing_s/teacher"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="name=run_dir (a run's save_checkpoint_path)")
    for name, _, path in (run.partition("=") for run in parser.parse_args().runs):
        print(json.dumps({"run": name, **summary(Path(path))}))


if __name__ == "__main__":
    main()
