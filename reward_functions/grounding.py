"""Reward for visual grounding: IoU of the predicted and the true box.

The model answers with a box [x1, y1, x2, y2] in pixels of the image it saw (Qwen2.5-VL's absolute
coordinates), inside <answer></answer> (or anywhere, for accuracy, if there is no <answer>); the
first four-number list there is the box, so Qwen's {"bbox_2d": [...]} JSON works too. The ground
truth is [x1, y1, x2, y2] (a list or its JSON string) in pixels of the original image.

The model saw the image resized, so the predicted box is rescaled to the original image first:
x * width / resized_width, y * height / resized_height, with (width, height) from the input's
``original_image_sizes`` and the resized size from ``images[0].size``. Without
``original_image_sizes`` it raises, unless reward_function_kwargs.rescale=false (for data sets
whose boxes are already in the resized image's pixels).

Returned keys, per sample:
  iou       intersection over union of the two boxes (0 for no box or an empty box).
  accuracy  1 if iou >= iou_threshold (0.5), else 0.
  format    1 if the response has an <answer></answer> with a box in it, else 0.
  overall   (1 - format_weight) * iou + format_weight * format (format_weight = 0.1).

Format prompt: format_prompts/grounding.jinja.
"""

import json
import re

REWARD_NAME = "grounding"
REWARD_TYPE = "batch"

_NUMBER = r"\s*(-?\d+(?:\.\d+)?)\s*"
_BOX = re.compile(r"\[" + ",".join([_NUMBER] * 4) + r"\]")
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def parse_box(text: str) -> list[float] | None:
    match = _BOX.search(text)
    return [float(v) for v in match.groups()] if match else None


def _area(box: list[float]) -> float:
    return max(0.0, box[2] - box[0]) * max(0.0, box[3] - box[1])


def iou(a: list[float], b: list[float]) -> float:
    inter = _area([max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3])])
    union = _area(a) + _area(b) - inter
    return inter / union if union > 0 else 0.0


def _true_box(ground_truth) -> list[float]:
    box = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    if not (isinstance(box, (list, tuple)) and len(box) == 4):
        raise ValueError(f"ground truth {ground_truth!r} is not a box [x1, y1, x2, y2]")
    return [float(v) for v in box]


def _to_original(box: list[float], item: dict, rescale: bool) -> list[float]:
    if not rescale or not item["images"]:
        return box
    if item["original_image_sizes"] is None:
        raise ValueError(
            "grounding.py needs original_image_sizes to rescale the predicted box from the resized image to "
            "the original one; the data pipeline did not provide them. If the ground-truth boxes are in "
            "pixels of the resized image, set worker.reward.reward_function_kwargs.rescale=false."
        )
    width, height = item["original_image_sizes"][0]
    resized_width, resized_height = item["images"][0].size
    sx, sy = width / resized_width, height / resized_height
    return [box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy]


def compute_score(
    reward_inputs: list[dict], format_weight: float = 0.1, iou_threshold: float = 0.5, rescale: bool = True
) -> list[dict[str, float]]:
    scores = []
    for item in reward_inputs:
        answers = _ANSWER.findall(item["response"])
        box = parse_box(answers[-1] if answers else item["response"])
        fmt = float(bool(answers) and box is not None)
        value = iou(_to_original(box, item, rescale), _true_box(item["ground_truth"])) if box else 0.0
        scores.append({
            "overall": (1 - format_weight) * value + format_weight * fmt,
            "iou": value,
            "accuracy": float(value >= iou_threshold),
            "format": fmt,
        })
    return scores
