"""Can a base model learn the GUI demo's first click from the screen? A cheap check before a warm start
or RL is worth its time (docs/benchmarks.md, "The GUI demo's first click").

Supervised steps on single screens: the first turn's prompt (the GUI format prompt) with one
screenshot, the target one ``click(N)`` token and EOS. Half the screens show the task's first state,
half a random tick state; the target is a box whose state differs from the goal (``--targets any``:
one at random, as the warm start's expert; ``first``: the lowest label), else OK. Every ``--every``
steps the greedy first click is scored on the data set's val rows.

    PYTHONPATH=. python bench/gui_first_click.py --dataset synthetic-gui-row-red --steps 600 --targets first
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import time
from pathlib import Path

import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from easyvlm.agents.gui import GuiTask, make_task, task_of_row
from easyvlm.builtin.gui_warm_start import first_turn_text, screen_sample, train_on_screens
from easyvlm.builtin.models import materialize_model
from easyvlm.builtin.synthetic_gui import DATASETS, materialize_dataset


def training_screen(rng: random.Random, layout: str, colour: str | None, targets: str) -> tuple[GuiTask, frozenset, int]:
    """(task, ticked boxes on the screen, the target label) for one supervised sample: the warm start's
    (``first``), or a random box among those that differ from the goal (``any``)."""
    if targets == "first":
        return screen_sample(rng, layout, colour)
    task = make_task(rng.getrandbits(31), rng.choice(["tick", "untick"]), layout=layout, colour=colour)
    boxes = [w.label for w in task.widgets if w.kind == "checkbox"]
    ticked = task.initial if rng.random() < 0.5 else frozenset(b for b in boxes if rng.random() < 0.5)
    wrong = sorted(ticked ^ task.goal)
    return task, ticked, rng.choice(wrong) if wrong else task.button("OK").label


def score_first_clicks(model, processor, rows: list[dict], images: list[Image.Image]) -> dict:
    """Greedy first click (argmax over the click tokens) on each val row: the share that toggles a box
    that needs it, and how often each label was chosen."""
    click_ids = [processor.tokenizer.convert_tokens_to_ids(f"click({label})") for label in range(1, 8)]
    right, chosen = 0, collections.Counter()
    model.eval()
    with torch.no_grad():
        for row, image in zip(rows, images):
            task = task_of_row(row)
            inputs = processor(text=[first_turn_text(processor.tokenizer, task)], images=[image], return_tensors="pt")
            label = int(model(**inputs).logits[0, -1, click_ids].argmax()) + 1
            chosen[label] += 1
            right += label in (task.initial ^ task.goal)
    model.train()
    return {"first_click_right": round(right / len(rows), 3), "chosen": dict(sorted(chosen.items()))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="synthetic-gui-row-red", choices=sorted(DATASETS))
    parser.add_argument("--base", default="tiny-qwen2.5-vl-clicks")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--targets", choices=["any", "first"], default="first")
    parser.add_argument("--every", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", default=None, help="a directory for the trained model (bench/gui_episode_sft.py --init)")
    args = parser.parse_args()

    layout, colour = DATASETS[args.dataset]
    base = args.base if Path(args.base).is_dir() else materialize_model(args.base)
    processor = AutoProcessor.from_pretrained(base)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    model = AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    val = materialize_dataset("val", name=args.dataset)
    rows = [json.loads(line) for line in val.read_text().splitlines() if line.strip()]
    images = [Image.open(val.parent / row["images"][0]).convert("RGB") for row in rows]
    print(json.dumps({"step": 0, **score_first_clicks(model, processor, rows, images)}), flush=True)
    start = time.time()
    for step in range(1, args.steps + 1):
        loss = train_on_screens(model, optimizer, processor,
                                [training_screen(rng, layout, colour, args.targets) for _ in range(args.batch)])
        if step % args.every == 0 or step == args.steps:
            scores = score_first_clicks(model, processor, rows, images)
            print(json.dumps({"step": step, "loss": round(loss, 3), "seconds": round(time.time() - start), **scores}),
                  flush=True)
    if args.save:
        model.save_pretrained(args.save)
        processor.save_pretrained(args.save)


if __name__ == "__main__":
    main()
