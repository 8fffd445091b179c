"""Reward for the built-in zoom task (builtin:synthetic-zoom, examples/tools.yaml): a multi-turn run
where the model calls image_zoom and then answers with a colour word.

Returned keys, per sample:
  accuracy      1 if the last turn (``response``) is the right colour, else 0. The only key that
                trains (``overall``): the zoom calls are rewarded only through the answers they allow.
  zoom_correct  1 if the first zoom call's box is the quadrant with the stripes (the row's ``box``
                column), else 0. Logged, not trained on.
  zoom_used     1 if the model called image_zoom at all.
  overall       = accuracy.

Multi-turn inputs (easyvlm): ``tool_calls`` lists the calls with their arguments; EasyR1-style
single-turn inputs have no such key and score zoom_used = zoom_correct = 0.
"""

import re

REWARD_NAME = "zoom"
REWARD_TYPE = "batch"


def _word(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", str(text).lower()).split())


def compute_score(reward_inputs: list[dict]) -> list[dict[str, float]]:
    scores = []
    for item in reward_inputs:
        accuracy = float(_word(item["response"]) == _word(item["ground_truth"]))
        zooms = [c for c in item.get("tool_calls", []) if c["name"] == "image_zoom"]
        first_box = zooms[0]["arguments"].get("box") if zooms and isinstance(zooms[0]["arguments"], dict) else None
        correct = float(first_box is not None and list(first_box) == list(item.get("box") or []))
        scores.append({"overall": accuracy, "accuracy": accuracy, "zoom_correct": correct, "zoom_used": float(bool(zooms))})
    return scores
