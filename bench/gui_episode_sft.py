"""Does a model that reads the GUI demo's first screen also play whole episodes once it has seen some?
Supervised steps on whole episodes of the GUI environment (the RL rollout loop with the expert's turns
given, as the warm start's second phase trains, with its expert), from ``--init`` (a model directory,
e.g. one saved by bench/gui_first_click.py --save, or a builtin name). Every ``--every`` steps the
expert's episodes on the data set's val rows are scored teacher-forced: an episode counts when the
model's argmax is the expert's token at every trained position, which is exactly "greedy play solves it
along the expert's path"; and the share right of its first clicks, of its later box clicks and of its OK
presses (docs/benchmarks.md).

    PYTHONPATH=. python bench/gui_first_click.py --base tiny-qwen3-vl-clicks --steps 1800 --lr 3e-4 --save /tmp/screens
    PYTHONPATH=. python bench/gui_episode_sft.py --init /tmp/screens --steps 300
    PYTHONPATH=. python bench/gui_episode_sft.py --init tiny-qwen3-vl-gui --steps 0   # the shipped warm start
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoConfig, AutoProcessor

from easyvlm.agents.gui import GuiEnvironment, task_of_row
from easyvlm.builtin.gui_warm_start import GUI_FORMAT_PROMPT, expert_actions
from easyvlm.builtin.models import materialize_model
from easyvlm.builtin.sft_steps import episode_labels, episodes_of, start_training, train_on_episodes
from easyvlm.builtin.synthetic_gui import DATASETS, materialize_dataset
from easyvlm.data.collate import concat_multi_modal_inputs
from easyvlm.models.position_ids import to_model_layout


def score(model, episodes, rows_per_batch: int = 16) -> dict:
    """Teacher-forced on the expert's val episodes: the share solved greedily, and the share of the
    expert's box clicks and OK presses that are the model's argmax (after the first turn's click)."""
    model.eval()
    solved, right, count = 0, {"first": 0, "box": 0, "ok": 0}, {"first": 0, "box": 0, "ok": 0}
    with torch.no_grad():
        for start in range(0, len(episodes.dataset), rows_per_batch):
            picked = list(range(start, min(start + rows_per_batch, len(episodes.dataset))))
            rows = [episodes.rows[episodes.dataset.index[i][1]] for i in picked]
            scripts = [expert_actions(task_of_row(row), random.Random(0), 1.0) for row in rows]
            out = episodes.play_scripts(picked, scripts)
            logits = model(input_ids=out["input_ids"], attention_mask=out["attention_mask"].long(),
                           position_ids=to_model_layout(out["position_ids"]),
                           **concat_multi_modal_inputs(out["multi_modal_inputs"])).logits
            target = episode_labels(out)[:, 1:]
            hit = (logits[:, :-1].argmax(-1) == target) | (target == -100)
            for j, (row, script) in enumerate(zip(rows, scripts)):
                solved += bool(hit[j].all())
                ok = f"click({task_of_row(row).button('OK').label})"
                positions = (target[j] != -100).nonzero().flatten().tolist()[::2]  # each turn: click(N), then EOS
                for turn, (p, action) in enumerate(zip(positions, script)):
                    kind = "first" if turn == 0 else "ok" if action == ok else "box"
                    right[kind] += bool(hit[j, p])
                    count[kind] += 1
    model.train()
    clicks = {f"{kind}_right": round(right[kind] / count[kind], 3) for kind in count}
    return {"greedy_solved": round(solved / len(episodes.dataset), 3), **clicks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="synthetic-gui-row-red", choices=sorted(DATASETS))
    parser.add_argument("--init", default="tiny-qwen3-vl-clicks", help="a model directory or a builtin model name")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--right-rate", type=float, default=1.0)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", default=None)
    args = parser.parse_args()

    init = args.init if Path(args.init).is_dir() else materialize_model(args.init)
    processor = AutoProcessor.from_pretrained(init)
    model_config = AutoConfig.from_pretrained(init)
    prompt_file = Path(tempfile.mkdtemp()) / "gui.jinja"
    prompt_file.write_text(GUI_FORMAT_PROMPT + "\n")
    spec = SimpleNamespace(seed=args.seed, lr=args.lr, max_pixels=None)
    split = {s: materialize_dataset(s, name=args.dataset) for s in ("train", "val")}
    train, val = (episodes_of(spec, processor, model_config, split[s], prompt_file, length=1024,
                              environment=GuiEnvironment) for s in ("train", "val"))
    model, optimizer, rng = start_training(spec, init)
    print(json.dumps({"step": 0, **score(model, val)}), flush=True)
    start = time.time()
    for step in range(1, args.steps + 1):
        picked, rows = train.sample(rng, args.batch)
        out = train.play_scripts(picked, [expert_actions(task_of_row(row), rng, args.right_rate) for row in rows])
        loss = train_on_episodes(model, optimizer, out)
        if step % args.every == 0 or step == args.steps:
            print(json.dumps({"step": step, "loss": round(loss, 3), "seconds": round(time.time() - start),
                              **score(model, val)}), flush=True)
    if args.save:
        model.save_pretrained(args.save)
        processor.save_pretrained(args.save)


if __name__ == "__main__":
    main()
