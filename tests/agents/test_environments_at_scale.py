"""Environments at scale: a failing environment (raises, hangs, answers something malformed, cannot
start) ends its sample out of the loss and counted, never the run; the samples of a turn step at
the same time; the image budget (worker.rollout.max_images_in_context). The engine is scripted (the
model's turns given as text, agent_helpers.ScriptedEngine)."""

from __future__ import annotations

import time

import pytest
import torch
from agent_helpers import HANGING_ENV, LOGPROB, encoder_of, end_of_turn, prompt_batch, run_scripted, tool_plan

from easyvlm.agents.loop import trajectory_metrics
from easyvlm.agents.render import IMAGE_PLACEHOLDER
from easyvlm.agents.tools import run_concurrently
from easyvlm.algorithms.aggregation import aggregate_loss
from easyvlm.config.loader import load_config
from easyvlm.config.validate import find_problems

T = 320


def rows(*answers: str) -> list[dict]:
    """Text-only rows; the answer (``ground_truth``) tells the test environments what to do."""
    return [{"prompt": f"Task {i}.", "answer": answer, "images": []} for i, answer in enumerate(answers)]


def env_plan(tiny_model_path, tmp_path, source: str, cls: str, *overrides: str, response_length: int = T):
    path = tmp_path / f"{cls.lower()}.py"
    path.write_text(source)
    plan = tool_plan(tiny_model_path, response_length, f"worker.rollout.environment={path}:{cls}", *overrides)
    return plan, encoder_of(plan)


def token_count(encoder, text: str) -> int:
    return len(encoder.tokenizer(text, add_special_tokens=False)["input_ids"])


FAILING = '''
import time

class Failing:
    """Per row's ground truth: ok (two steps, reward 1 at the end), raise / hang / malformed at the
    first step, or a reset that raises."""
    def reset(self, row):
        self.mode = row["ground_truth"]
        if self.mode == "reset":
            raise ValueError("no such task")

    def step(self, action):
        if self.mode == "raise":
            raise RuntimeError("the browser crashed")
        if self.mode == "hang":
            time.sleep(30)
        if self.mode == "malformed":
            return {"screen": 1}, False
        return ("fine", False, 0.5) if action == "go" else (None, True, 1.0)
'''


def test_a_failing_environment_ends_its_sample_out_of_the_loss_and_counted(tiny_model_path, tmp_path):
    plan, enc = env_plan(tiny_model_path, tmp_path, FAILING, "Failing", "worker.rollout.tool_timeout=0.5")
    modes = ["ok", "raise", "hang", "malformed", "reset"]
    prompts = prompt_batch(enc, rows(*modes), tmp_path)
    out, engine = run_scripted(plan, enc, prompts, [["go", "stop"]] * len(modes))
    trajectories = out["trajectory"]
    assert [t["finish"] for t in trajectories] == ["done", "error", "error", "error", "error"]
    assert [t["environment_error"] for t in trajectories] == [
        None,
        "environment step failed: RuntimeError: the browser crashed",
        "environment step timed out after 0.5 s",
        "environment step returned a dict; an observation is text, a PIL image, a list of both, or None",
        "environment reset failed: ValueError: no such task",
    ]
    # the reset failure never reaches the engine: turn 1 generates 4 samples, turn 2 the one left
    assert [rows_ for rows_, _ in engine.calls] == [4, 1]
    assert [t["num_turns"] for t in trajectories] == [2, 1, 1, 1, 0]
    assert [t["untrained_turns"] for t in trajectories] == [0, 1, 1, 1, 0]
    P = prompts["input_ids"].shape[1]
    mask, attention = out["response_mask"], out["attention_mask"][:, P:].bool()
    # ok: "go" + EOS trained, the observation not, "stop" + EOS trained
    go, stop = token_count(enc, "go") + 1, token_count(enc, "stop") + 1
    n_ok = int(attention[0].sum())
    assert mask[0, :n_ok].tolist() == [True] * go + [False] * (n_ok - go - stop) + [True] * stop
    # the failed samples keep their tokens in the sequence, none in the loss, the KL or the advantages
    assert [int(attention[k].sum()) for k in range(1, 5)] == [go, go, go, 0]
    assert not mask[1:].any() and not out["rollout_logprobs"][1:].any()
    assert torch.equal(out["rollout_logprobs"][0], LOGPROB * mask[0].float())
    assert (out["turn_index"][1:] == -1).all()  # their steps join no step group (gigpo)
    assert out["step_rewards"].tolist() == [[0.5, 1.0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    # no gradient reaches a failed sample's tokens: the token-mean policy loss -A * log p over the batch
    logprobs = torch.zeros(mask.shape, requires_grad=True)
    aggregate_loss(-torch.ones(mask.shape) * logprobs, mask, "token-mean").backward()
    assert not logprobs.grad[1:].any() and (logprobs.grad[0][mask[0]] == -1 / (go + stop)).all()
    metrics = trajectory_metrics(trajectories)
    # 4 of 5 failed; untrained turns (0 + 1 + 1 + 1 + 0) / 5; turns (2 + 1 + 1 + 1 + 0) / 5
    assert metrics["multi_turn/finish/error"] == 4 / 5 and metrics["multi_turn/finish/done"] == 1 / 5
    assert metrics["multi_turn/untrained_turns/mean"] == 3 / 5 and metrics["multi_turn/turns/mean"] == 5 / 5
    assert metrics["multi_turn/tool_calls/mean"] == 0.0  # an environment's steps are not tool calls


N_SAMPLES = 16
TIMEOUT = 1.0


def test_hanging_environments_cost_one_timeout_not_one_each(tiny_model_path, tmp_path):
    plan, enc = env_plan(tiny_model_path, tmp_path, HANGING_ENV, "Hanging", f"worker.rollout.tool_timeout={TIMEOUT}")
    prompts = prompt_batch(enc, rows(*["x"] * N_SAMPLES), tmp_path)
    start = time.perf_counter()
    out, _ = run_scripted(plan, enc, prompts, [["go"]] * N_SAMPLES)
    elapsed = time.perf_counter() - start
    assert [t["finish"] for t in out["trajectory"]] == ["error"] * N_SAMPLES
    # 16 steps at once wait one timeout (1 s) plus the scripted turn (~0.1 s); one after another they
    # would wait 16 s, and any grouping of 3 or more in a row at least 3 s
    assert TIMEOUT <= elapsed < 3 * TIMEOUT


MEETING = '''
import random
import threading
import time

class Meeting:
    """Every sample's step waits for all N_SAMPLES steps to be running at once (a barrier, 5 s);
    steps one after another would break it. Each answers with its row and the action."""
    barrier = threading.Barrier(N_SAMPLES)

    def reset(self, row):
        self.task = row["ground_truth"]

    def step(self, action):
        time.sleep(random.random() / 10)  # finish in a random order
        self.barrier.wait(timeout=5)
        return f"{self.task} after {action}", action == "stop", float(self.task[-1])
'''


def test_the_steps_of_a_turn_run_at_the_same_time_and_the_result_keeps_the_sample_order(tiny_model_path, tmp_path):
    plan, enc = env_plan(tiny_model_path, tmp_path, MEETING.replace("N_SAMPLES", str(N_SAMPLES)), "Meeting",
                         "worker.rollout.tool_timeout=10")
    prompts = prompt_batch(enc, rows(*[f"task {i % 10}" for i in range(N_SAMPLES)]), tmp_path)
    script = [["go", "stop"]] * N_SAMPLES
    first, _ = run_scripted(plan, enc, prompts, script)
    again, _ = run_scripted(plan, enc, prompts, script)
    assert [t["finish"] for t in first["trajectory"]] == ["done"] * N_SAMPLES  # the barrier was met, twice
    assert [t["messages"][1]["content"] for t in first["trajectory"]] == [f"task {i % 10} after go" for i in range(N_SAMPLES)]
    assert [t["environment_reward"] for t in first["trajectory"]] == [2.0 * (i % 10) for i in range(N_SAMPLES)]
    for key in ("responses", "response_mask", "attention_mask", "position_ids", "step_anchors"):
        assert torch.equal(first[key], again[key]), key


def test_run_concurrently_keeps_the_order_of_the_calls():
    delays = [0.3, 0.2, 0.1, 0.0]  # the last call finishes first

    def call(i: int):
        return lambda: (time.sleep(delays[i]), i)[1]

    start = time.perf_counter()
    assert run_concurrently([call(i) for i in range(4)]) == [0, 1, 2, 3]
    assert time.perf_counter() - start < 0.3 + 0.2  # at once: the longest call, not the sum 0.6
    assert run_concurrently([call(i) for i in range(4)], max_workers=1) == [0, 1, 2, 3]


SCREENS = '''
from PIL import Image

COLOURS = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0)]

class Screens:
    """Step k (from 1) shows screen k: a 56x56 screenshot of colour COLOURS[k - 1] and the text
    "screen k"; done at step 4."""
    def reset(self, row):
        self.steps = 0

    def step(self, action):
        self.steps += 1
        if self.steps == 4:
            return None, True, 1.0
        return [Image.new("RGB", (56, 56), COLOURS[self.steps - 1]), f"screen {self.steps}"], False
'''
COLOURS = [(255, 0, 0), (0, 255, 0), (0, 0, 255)]
VISION = "<|vision_start|><|image_pad|><|vision_end|>"


def observation(text: str) -> str:
    """An observation as the template renders it after the model's <|im_end|> (raw: one pad per image)."""
    return f"\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def test_the_image_budget_keeps_the_last_k_images_and_trains_what_was_sampled_in_the_kept_context(tiny_model_path, tmp_path):
    plan, enc = env_plan(tiny_model_path, tmp_path, SCREENS, "Screens", "worker.rollout.max_images_in_context=2")
    prompts = prompt_batch(enc, rows("x"), tmp_path)
    out, engine = run_scripted(plan, enc, prompts, [["a", "b", "c", "d"]])
    tok, eos = enc.tokenizer, "<|im_end|>"

    def seen(turn):  # the context of a turn's generation call: raw text (one pad per image) and images
        return tok.decode(engine.seen[turn]["raw_prompt_ids"][0]), engine.seen[turn]["images"][0]

    # turn 3 saw screens 1 and 2 (k = 2 not exceeded); turn 4, after the 3rd, sees 2 and 3, and the
    # placeholder where screen 1 was
    text3, images3 = seen(2)
    assert text3.endswith(f"a{eos}" + observation(f"{VISION}screen 1") + f"b{eos}" + observation(f"{VISION}screen 2"))
    assert [image.getpixel((0, 0)) for image in images3] == COLOURS[:2]
    text4, images4 = seen(3)
    assert text4.endswith(f"a{eos}" + observation(f"{IMAGE_PLACEHOLDER}screen 1") + f"b{eos}"
                          + observation(f"{VISION}screen 2") + f"c{eos}" + observation(f"{VISION}screen 3"))
    assert IMAGE_PLACEHOLDER == "[image removed]" and text4.count("<|image_pad|>") == 2
    assert [image.getpixel((0, 0)) for image in images4] == COLOURS[1:]
    # the trained sequence is turn 4's context, then turn 4 (vision tokens expanded; its images' inputs)
    context4 = engine.seen[3]["input_ids"][0][engine.seen[3]["attention_mask"][0].bool()].tolist()
    turn4 = tok("d", add_special_tokens=False)["input_ids"] + [end_of_turn(plan)]
    assert out["input_ids"][0][out["attention_mask"][0].bool()].tolist() == context4 + turn4
    seen_inputs, trained_inputs = engine.seen[3]["multi_modal_inputs"][0], out["multi_modal_inputs"][0]
    assert torch.equal(trained_inputs["pixel_values"], seen_inputs["pixel_values"])
    # screens 2 and 3, each fitted up to data.min_pixels (512 x 512): 16 x 16 patches
    assert trained_inputs["image_grid_thw"].tolist() == [[1, 16, 16]] * 2
    # turns 2 and 3 were sampled seeing screen 1: out of the loss; turn 1 (the prompt) and turn 4 trained
    lengths = {turn: token_count(enc, turn) + 1 for turn in "abcd"}
    index = out["turn_index"][0]
    assert index[index >= 0].tolist() == [0] * lengths["a"] + [3] * lengths["d"]
    assert torch.equal(index >= 0, out["response_mask"][0])
    trajectory = out["trajectory"][0]
    assert (trajectory["finish"], trajectory["untrained_turns"], trajectory["images_removed"]) == ("done", 2, 1)
    assert len(trajectory["images"]) == 3  # the viewer still gets every screen
    metrics = trajectory_metrics(out["trajectory"])
    assert metrics["multi_turn/images_removed/mean"] == 1.0 and metrics["multi_turn/untrained_turns/mean"] == 2.0


def test_an_image_budget_of_zero_shows_no_returned_image_and_trains_every_turn(tiny_model_path, tmp_path):
    plan, enc = env_plan(tiny_model_path, tmp_path, SCREENS, "Screens", "worker.rollout.max_images_in_context=0")
    prompts = prompt_batch(enc, rows("x"), tmp_path)
    out, engine = run_scripted(plan, enc, prompts, [["a", "b", "c", "d"]])
    text4 = enc.tokenizer.decode(engine.seen[3]["raw_prompt_ids"][0])
    assert text4.count(IMAGE_PLACEHOLDER) == 3 and "<|image_pad|>" not in text4 and engine.seen[3]["images"][0] == []
    trajectory = out["trajectory"][0]
    # removed as they arrived: no turn ever saw them, every turn is trained
    assert (trajectory["untrained_turns"], trajectory["images_removed"]) == (0, 3)
    assert out["response_mask"][0].sum() == sum(token_count(enc, turn) + 1 for turn in "abcd")


def test_the_image_budget_lets_a_long_episode_fit_the_response_length(tiny_model_path, tmp_path):
    # Tokens (this tokenizer spells text a character a token): a turn "a" + EOS = 2; an observation
    # with its screen 94 (16 x 16 patches / 4 = 64 vision tokens + 2 markers + 28 of template and
    # "screen k"), with the placeholder instead 28 + 15 = 43. All screens kept: before screen 3
    # 2 + 94 + 2 + 94 + 2 = 194, and 194 + 94 + 1 > 200 ends the sample (max_tokens). One kept:
    # 2 + 43 + 2 + 43 + 2 + 94 + 2 = 188 <= 200, the episode ends (done).
    lengths = {}
    for k in ("null", "1"):
        plan, enc = env_plan(tiny_model_path, tmp_path, SCREENS, "Screens", f"worker.rollout.max_images_in_context={k}",
                             response_length=RESPONSE_LENGTH)
        out, _ = run_scripted(plan, enc, prompt_batch(enc, rows("x"), tmp_path), [["a", "b", "c", "d"]])
        lengths[k] = out["trajectory"][0]["finish"]
    assert lengths == {"null": "max_tokens", "1": "done"}


RESPONSE_LENGTH = 200


BASE = [
    "data.train_files=builtin:synthetic@train", "data.val_files=builtin:synthetic@val",
    "worker.actor.model.model_path=builtin:tiny-qwen2.5-vl", "worker.reward.reward_function=./reward.py:score",
]


@pytest.mark.parametrize("overrides,message", [
    (["worker.rollout.max_images_in_context=2"], "acts only with worker.rollout.tools or worker.rollout.environment"),
    (["worker.rollout.environment=env.py:Game", "worker.rollout.max_images_in_context=-1"], "must be >= 0"),
])
def test_the_config_check_refuses_an_image_budget_that_cannot_act(overrides, message):
    problems = find_problems(load_config(BASE + overrides))
    assert [p.key for p in problems if message in p.message] == ["worker.rollout.max_images_in_context"]
