"""The shipped rewards (reward_functions/*.py) on hand-written right, wrong and malformed answers,
and their format prompts. Each expected score is worked out in the comment beside it."""

from __future__ import annotations

import jinja2
import pytest
from PIL import Image
from rewards_testing import PROMPTS, SHIPPED, inp

from easyvlm.rewards import RewardFunctionSpec, load_reward_function


def score(file: str, inputs: list, **kwargs) -> list[dict[str, float]]:
    """Call a shipped reward in this process, as a worker process would (main thread)."""
    reward = load_reward_function(RewardFunctionSpec(f"{SHIPPED / file}:compute_score", kwargs))
    assert reward.reward_type == "batch"
    return reward.fn([x.to_dict() for x in inputs], **reward.kwargs)


def test_synthetic():
    cases = [
        # response, truth -> (accuracy, format); overall = 0.9 accuracy + 0.1 format
        ("red", "red", 1, 1),
        (" Red. ", "red", 1, 1),  # case, spaces and one final period are fine
        ("Three", "3", 1, 1),  # number words count as digits
        ("grey", "gray", 1, 1),
        ("blue", "red", 0, 1),  # wrong but well-formed: 0.1
        ("red!!", "red", 1, 0),  # right, but not one clean word: 0.9
        ("It is red", "red", 0, 0),  # extra text is wrong
        ("", "red", 0, 0),
        ("<|im_end|>", "red", 0, 0),  # malformed
    ]
    scores = score("synthetic.py", [inp(r, t) for r, t, _, _ in cases])
    for (r, t, accuracy, fmt), s in zip(cases, scores):
        assert s == pytest.approx({"overall": 0.9 * accuracy + 0.1 * fmt, "accuracy": accuracy, "format": fmt}), r


def test_math():
    cases = [
        # response, truth -> (format, accuracy); overall = 0.9 accuracy + 0.1 format
        ("<think>2+2=4</think> The answer is \\boxed{4}.", "4", 1, 1),
        ("<think>half</think>\\boxed{\\frac{1}{2}}", "0.5", 1, 1),  # equal as numbers (math-verify)
        ("<think>x</think>\\boxed{x = 2}", "2", 1, 1),
        ("\\boxed{4}", "4", 0, 1),  # no <think>: 0.9
        ("<think>x</think> \\boxed{5}", "4", 1, 0),  # wrong: 0.1
        ("<think>x</think> 4", "4", 0, 0),  # no \boxed{}: 0
        ("<think>a</think><think>b</think>\\boxed{4}", "4", 0, 1),  # two think blocks
        ("<think>unclosed \\boxed{4", "4", 0, 0),  # malformed
        ("<think>first \\boxed{3}</think> then \\boxed{4}", "4", 1, 1),  # the last box counts
    ]
    scores = score("math.py", [inp(r, t) for r, t, _, _ in cases])
    for (r, t, fmt, accuracy), s in zip(cases, scores):
        assert s == pytest.approx({"overall": 0.9 * accuracy + 0.1 * fmt, "format": fmt, "accuracy": accuracy}), r


def test_math_format_weight_kwarg():
    (s,) = score("math.py", [inp("\\boxed{4}", "4")], format_weight=0.5)
    assert s["overall"] == 0.5  # format 0, accuracy 1: 0.5 * 1 + 0.5 * 0


def test_r1v():
    cases = [
        # response, truth -> (format, accuracy); overall = 0.5 accuracy + 0.5 format
        ("<think>it purrs</think><answer>cat</answer>", "cat", 1, 1),
        ("<think>r</think>\n<answer> Cat. </answer>\n", "cat", 1, 1),  # spaces, case, final period
        ("<think>r</think><answer>0.5</answer>", "\\frac{1}{2}", 1, 1),  # mathematics
        ("<think>r</think><answer>act</answer>", "cat", 1, 0),  # words are not algebra: c*a*t != a*c*t here
        ("<think>r</think><answer>3</answer>", "4", 1, 0),
        ("<answer>cat</answer>", "cat", 0, 1),  # no think block
        ("<think>r<answer>cat</answer>", "cat", 0, 1),  # unclosed think
        ("<think>r</think><answer>x</answer><answer>cat</answer>", "cat", 0, 1),  # two answers: the last counts
        ("<think>r</think><answer></answer>", "cat", 1, 0),
        ("cat", "cat", 0, 0),  # no tags at all
    ]
    scores = score("r1v.py", [inp(r, t) for r, t, _, _ in cases])
    for (r, t, fmt, accuracy), s in zip(cases, scores):
        assert s == pytest.approx({"overall": 0.5 * accuracy + 0.5 * fmt, "format": fmt, "accuracy": accuracy}), r


def test_dapo_answers():
    cases = [
        # response, truth -> right; overall = +1 / -1 (no length penalty without max_response_length)
        ("Step 1 ...\nAnswer: 42", "42", True),
        ("Answer: $\\boxed{42}$.", "42", True),
        ("Answer: 1,000", "1000", True),
        ("Answer: 5.0", "5", True),
        ("Answer: x = 3", "3", True),
        ("Answer: \\dfrac{1}{2}", "\\frac{1}{2}", True),
        ("Answer: 7\nwait, no.\nAnswer: 8", "8", True),  # the last Answer: line counts
        ("Answer: 41", "42", False),
        ("The answer is 42", "42", False),  # no Answer: line
        ("", "42", False),
    ]
    scores = score("dapo.py", [inp(r, t) for r, t, _ in cases])
    for (r, t, right), s in zip(cases, scores):
        assert s == {"overall": 1.0 if right else -1.0, "accuracy": float(right), "overlong_penalty": 0.0}, r


def test_dapo_overlong_penalty():
    # Lmax = 10, buffer Lc = 4: no penalty up to 6 tokens, then ((10 - 4) - L) / 4, -1 beyond 10
    lengths = [6, 8, 10, 12]
    expected_penalty = [0.0, (6 - 8) / 4, (6 - 10) / 4, -1.0]  # 0, -0.5, -1, -1
    inputs = [inp("Answer: 42", "42", response_length=n) for n in lengths]
    scores = score("dapo.py", inputs, max_response_length=10, overlong_buffer_length=4)
    assert [s["overlong_penalty"] for s in scores] == expected_penalty
    assert [s["overall"] for s in scores] == [1.0 + p for p in expected_penalty]
    (half,) = score("dapo.py", inputs[1:2], max_response_length=10, overlong_buffer_length=4, overlong_penalty_factor=0.5)
    assert half["overlong_penalty"] == -0.25


def _grounding_input(response: str, truth=(10, 10, 30, 30), sizes=((100, 100),)) -> object:
    # the model saw a 50x50 image resized from 100x100: its coordinates are half the original's
    return inp(response, truth if isinstance(truth, str) else list(truth), images=[Image.new("RGB", (50, 50))],
               original_image_sizes=None if sizes is None else list(sizes))


def test_grounding():
    cases = [
        # response -> (iou, format); overall = 0.9 iou + 0.1 format; accuracy = iou >= 0.5
        ("<think>cat</think><answer>[5, 5, 15, 15]</answer>", 1.0, 1),  # x2 = [10, 10, 30, 30]: exact
        # x2 = [20, 10, 40, 30]: overlap 10 x 20 = 200, union 400 + 400 - 200 = 600 -> 1/3
        ("<answer>[10, 5, 20, 15]</answer>", 1 / 3, 1),
        ('<answer>[{"bbox_2d": [5, 5, 15, 15], "label": "cat"}]</answer>', 1.0, 1),  # Qwen's JSON
        ("[5.0, 5.0, 15.0, 15.0]", 1.0, 0),  # right box, no <answer>
        ("<answer>[50, 50, 60, 60]</answer>", 0.0, 1),  # no overlap
        ("<answer>top left corner</answer>", 0.0, 0),  # malformed
        ("<answer>[5, 5, 15]</answer>", 0.0, 0),  # three numbers
    ]
    scores = score("grounding.py", [_grounding_input(r) for r, _, _ in cases])
    for (r, iou, fmt), s in zip(cases, scores):
        assert s == pytest.approx(
            {"overall": 0.9 * iou + 0.1 * fmt, "iou": iou, "accuracy": float(iou >= 0.5), "format": fmt}), r


def test_grounding_truth_as_json_string_and_no_rescale():
    (s,) = score("grounding.py", [_grounding_input("<answer>[5, 5, 15, 15]</answer>", truth="[10, 10, 30, 30]")])
    assert s["iou"] == 1.0
    # rescale=false: the box is compared as given; [10,10,30,30] vs itself
    (s,) = score("grounding.py", [_grounding_input("<answer>[10, 10, 30, 30]</answer>", sizes=None)], rescale=False)
    assert s["iou"] == 1.0


def test_grounding_without_original_sizes_is_an_error():
    with pytest.raises(ValueError, match=r"grounding\.py needs original_image_sizes .*reward_function_kwargs\.rescale=false"):
        score("grounding.py", [_grounding_input("<answer>[5, 5, 15, 15]</answer>", sizes=None)])


def test_grounding_malformed_truth_is_an_error():
    with pytest.raises(ValueError, match=r"ground truth \[1, 2\] is not a box \[x1, y1, x2, y2\]"):
        score("grounding.py", [_grounding_input("<answer>[5, 5, 15, 15]</answer>", truth=[1, 2])])


def test_multiple_choice():
    cases = [
        # response, truth -> (accuracy, format); overall = 0.9 accuracy + 0.1 format
        ("The answer is \\boxed{B}.", "B", 1, 1),
        ("<answer>(c) because it is bigger</answer>", "C", 1, 1),
        ("\\boxed{B. 42}", "(B)", 1, 1),
        ("\\boxed{A}", "B", 0, 1),
        ("\\boxed{A} no wait \\boxed{D}", "D", 1, 1),  # the last box counts
        ("The answer is B", "B", 0, 0),  # neither \boxed{} nor <answer>
        ("\\boxed{Because}", "B", 0, 0),  # a word, not a letter
        ("\\boxed{}", "B", 0, 0),
    ]
    scores = score("multiple_choice.py", [inp(r, t) for r, t, _, _ in cases])
    for (r, t, accuracy, fmt), s in zip(cases, scores):
        assert s == pytest.approx({"overall": 0.9 * accuracy + 0.1 * fmt, "accuracy": accuracy, "format": fmt}), r


def test_environment():
    def episode(reward, info):
        trajectory = {"messages": [], "tool_calls": [], "num_turns": 3, "finish": "done", "environment_reward": reward,
                      "environment_info": info}
        return inp("click(4)", "click(1) click(3) click(4)", trajectory=trajectory)

    cases = [
        # environment_reward, last step's info -> overall = the return, accuracy = success
        (2.0, {"state_key": "ticked 1,3", "outcome": "success", "success": True}, 2.0, 1.0),  # a solved GUI task
        (1 / 3, {"outcome": "failed", "success": False}, 1 / 3, 0.0),  # OK pressed too early after one toggle
        (0.5, {}, 0.5, 0.0),  # an environment that never says success: never accurate
        (-0.25, {"success": 1}, -0.25, 1.0),  # any truthy success counts
    ]
    scores = score("environment.py", [episode(reward, info) for reward, info, _, _ in cases])
    assert scores == [{"overall": overall, "accuracy": accuracy} for _, _, overall, accuracy in cases]
    with pytest.raises(ValueError, match="no environment_reward; set worker.rollout.environment"):
        score("environment.py", [inp("red", "red")])  # a single-turn run


@pytest.mark.parametrize("name", ["synthetic", "math", "r1v", "dapo", "grounding", "multiple_choice"])
def test_each_reward_has_a_format_prompt_with_content(name):
    assert (SHIPPED / f"{name}.py").is_file()
    source = (PROMPTS / f"{name}.jinja").read_text()
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=False)
    rendered = env.from_string(source).render(content="<image>What is it?")
    assert "<image>What is it?" in rendered and "{{" not in rendered


def test_synthetic_prompt_is_short():
    # the built-in model reads bytes: every character of the prompt is a token
    rendered = jinja2.Template((PROMPTS / "synthetic.jinja").read_text()).render(content="Q")
    assert rendered == "Q Answer with one word."
