"""The multi-turn loop: layout, masks, positions and images of the whole trajectory, against the chat
template rendering the whole conversation at once and transformers' own rope index; tool errors
and limits; environments. The engine is scripted here (the model's turns given as text);
test_multi_turn_engines.py runs the real engines."""

from __future__ import annotations

import json

import pytest
import torch
from agent_helpers import HANGING_ENV, LOGPROB, encoder_of, end_of_turn, prompt_batch, run_scripted, tool_plan, two_colour_image
from PIL import Image
from transformers import AutoModelForImageTextToText

from easyvlm.agents.environment import state_anchor
from easyvlm.agents.loop import trajectory_metrics
from easyvlm.agents.tools import ToolResult
from easyvlm.data.collate import concat_multi_modal_inputs
from easyvlm.rewards.actor import build_reward_inputs
from easyvlm.rollout.hf import mm_token_type_ids

T = 320
ZOOM_CALL = '<tool_call>{"name": "image_zoom", "arguments": {"box": [0, 0, 200, 100]}}</tool_call>'


@pytest.fixture(scope="module")
def plan(tiny_model_path):
    return tool_plan(tiny_model_path, T, "worker.rollout.tools=[image_zoom,calculator]")


@pytest.fixture(scope="module")
def encoder(plan):
    return encoder_of(plan)


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    two_colour_image(root / "a.png")
    return root


ROWS = [
    {"prompt": "<image>Which colour is on top?", "answer": "red", "images": ["a.png"]},
    {"prompt": "What is 6 * 7?", "answer": "42", "images": []},
]


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return AutoModelForImageTextToText.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


def expanded(encoder, text, images):
    """The processor's ids (vision tokens expanded) and vision inputs of ``text`` with ``images``."""
    if not images:
        return encoder.tokenizer(text, add_special_tokens=False)["input_ids"], {}
    out = encoder.processor(text=[text], images=images, do_resize=False, add_special_tokens=False, return_tensors="pt")
    return out["input_ids"][0].tolist(), {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def test_tool_turn_layout_equals_the_template_rendering_the_whole_conversation(plan, encoder, image_dir, model):
    prompts = prompt_batch(encoder, ROWS, image_dir)
    script = [[ZOOM_CALL, "red"], ['<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>', "42"]]
    out, engine = run_scripted(plan, encoder, prompts, script)
    tok = encoder.tokenizer
    eos = end_of_turn(plan)
    P = prompts["input_ids"].shape[1]

    for row in range(2):
        traj = out["trajectory"][row]
        assert [m["role"] for m in traj["messages"]] == ["assistant", "tool", "assistant"]
        assert traj["num_turns"] == 2 and traj["finish"] == "answer"
        zoomed = traj["images"]  # the tool's image, fitted to the pixel limits
        assert len(zoomed) == (1 if row == 0 else 0)
        # Independent: the chat template renders the whole conversation, the processor expands it
        tool_content = [{"type": "image"}] if row == 0 else "42"
        messages = [
            {"role": "user", "content": ([{"type": "image"}] if row == 0 else []) + [{"type": "text", "text": ROWS[row]["prompt"].replace("<image>", "")}]},
            {"role": "assistant", "content": script[row][0]},
            {"role": "tool", "content": tool_content},
            {"role": "assistant", "content": script[row][1]},
        ]
        text = encoder.processor.apply_chat_template(messages, tools=list(plan.agent.tool_schemas), tokenize=False)
        text = text[: text.rindex(script[row][1]) + len(script[row][1])] + tok.decode([eos])  # up to the answer's EOS
        ids, mm = expanded(encoder, text, prompts["images"][row] + zoomed)
        mask = out["attention_mask"][row].bool()
        assert out["input_ids"][row][mask].tolist() == ids
        # the model's tokens: its two turns (each with EOS); the rest of the response is the tool's
        first = tok(script[row][0], add_special_tokens=False)["input_ids"] + [eos]
        second = tok(script[row][1], add_special_tokens=False)["input_ids"] + [eos]
        n_resp = int(mask[P:].sum())
        expected_mask = [True] * len(first) + [False] * (n_resp - len(first) - len(second)) + [True] * len(second)
        assert out["response_mask"][row][:n_resp].tolist() == expected_mask
        assert not out["response_mask"][row][n_resp:].any()
        expected_lp = torch.tensor([LOGPROB if m else 0.0 for m in expected_mask])
        assert torch.equal(out["rollout_logprobs"][row][:n_resp], expected_lp)
        assert torch.equal(out["rollout_logprobs"][row][n_resp:], torch.zeros(T - n_resp))
        if row == 0:
            item = out["multi_modal_inputs"][row]
            assert torch.equal(item["image_grid_thw"], mm["image_grid_thw"])
            assert torch.equal(item["pixel_values"], mm["pixel_values"])
            assert "image_zoom" in json.dumps(traj["tool_calls"]) and traj["tool_calls"][0]["ok"]
        else:
            assert traj["messages"][1]["content"] == "42"

    # position ids: transformers' get_rope_index over the whole sequence, two images, one mid-way
    mm = concat_multi_modal_inputs(out["multi_modal_inputs"])
    ids, attention = out["input_ids"], out["attention_mask"].long()
    rope, _ = model.model.get_rope_index(ids, mm_token_type_ids(ids, model.config), image_grid_thw=mm["image_grid_thw"], attention_mask=attention)
    assert torch.equal(out["position_ids"].transpose(0, 1)[1:][:, attention.bool()], rope[:, attention.bool()])
    assert torch.equal(out["position_ids"][:, 0], (attention.cumsum(-1) - 1).clamp(min=0) * attention)

    # every turn's context: raw ids (one pad per image, for vLLM) expand to its input_ids
    image_id = encoder.image_token_id
    for batch in engine.seen:
        grids = concat_multi_modal_inputs(batch["multi_modal_inputs"]).get("image_grid_thw")
        tokens_per_image = iter((grids.prod(-1) // 4).tolist() if grids is not None else [])
        for raw, row_ids, row_mask in zip(batch["raw_prompt_ids"], batch["input_ids"], batch["attention_mask"]):
            expansion = [t for tok_id in raw for t in ([image_id] * next(tokens_per_image) if tok_id == image_id else [tok_id])]
            assert expansion == row_ids[row_mask.bool()].tolist()

    metrics = trajectory_metrics(out["trajectory"])
    assert metrics == {
        "multi_turn/turns/mean": 2.0, "multi_turn/turns/max": 2.0, "multi_turn/tool_calls/mean": 1.0,
        "multi_turn/tool/calculator/success_rate": 1.0, "multi_turn/tool/calculator/error_rate": 0.0,
        "multi_turn/tool/image_zoom/success_rate": 1.0, "multi_turn/tool/image_zoom/error_rate": 0.0,
        "multi_turn/finish/answer": 1.0, "multi_turn/finish/max_turns": 0.0, "multi_turn/finish/max_tokens": 0.0,
        "multi_turn/finish/done": 0.0, "multi_turn/finish/error": 0.0,
        "multi_turn/untrained_turns/mean": 0.0, "multi_turn/images_removed/mean": 0.0,
    }
    # rewards: the answer is the last turn; the trajectory comes along
    inputs = build_reward_inputs(out, encoder.tokenizer)
    assert [i.response for i in inputs] == ["red", "42"]
    first_input = inputs[0].to_dict()
    assert first_input["num_turns"] == 2 and first_input["tool_calls"][0]["name"] == "image_zoom"
    assert first_input["response_length"] == int(out["response_mask"][0].sum())


def test_tool_errors_are_shown_to_the_model_and_counted(tiny_model_path, image_dir):
    plan = tool_plan(tiny_model_path, 640, "worker.rollout.tools=[image_zoom,calculator]")
    encoder = encoder_of(plan)
    prompts = prompt_batch(encoder, ROWS, image_dir)
    script = [
        ['<tool_call>{"name": "image_zoom", "arguments": {"box": [0, 0]}}</tool_call>',  # raises in the tool
         '<tool_call>{"name": "magnifier", "arguments": {}}</tool_call>',  # no such tool
         "red"],
        ['<tool_call>{"name": "calculator", "arguments": {"expression": 6 * 7}}</tool_call>',  # not JSON
         '<tool_call>{"name": "calculator", "arguments": {"expression": "1 / 0"}}</tool_call>', "42"],
    ]
    out, engine = run_scripted(plan, encoder, prompts, script)
    tok = encoder.tokenizer
    P = prompts["input_ids"].shape[1]

    def tool_text(row):  # what the model read between its turns
        ids = out["responses"][row][~out["response_mask"][row] & out["attention_mask"][row, P:].bool()]
        return tok.decode(ids.tolist(), skip_special_tokens=True)

    assert "Error: image_zoom failed: ValueError: box must be four numbers [x1, y1, x2, y2]" in tool_text(0)
    assert "Error: there is no tool 'magnifier'; tools: image_zoom, calculator" in tool_text(0)
    assert "Error: the tool call is not valid JSON (Expecting ',' delimiter at character 53)" in tool_text(1)
    assert "Error: calculator failed: ZeroDivisionError: division by zero" in tool_text(1)
    assert [t["finish"] for t in out["trajectory"]] == ["answer", "answer"]
    metrics = trajectory_metrics(out["trajectory"])
    # 4 calls: image_zoom 1 (error), magnifier 1 (error), malformed 1, calculator 1 (error)
    assert metrics["multi_turn/tool_calls/mean"] == 2.0
    assert metrics["multi_turn/tool/image_zoom/error_rate"] == 1.0
    assert metrics["multi_turn/tool/magnifier/error_rate"] == 1.0
    assert metrics["multi_turn/tool/(malformed)/error_rate"] == 1.0
    assert metrics["multi_turn/tool/calculator/error_rate"] == 1.0


def test_limits_end_samples(plan, encoder, image_dir, tiny_model_path):
    prompts = prompt_batch(encoder, ROWS, image_dir)
    calc = '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>'
    # max_turns=2: the second call is not answered (no tool result after the last turn)
    limited = tool_plan(tiny_model_path, T, "worker.rollout.tools=[calculator]", "worker.rollout.max_turns=2",
                        "worker.rollout.max_tokens_per_turn=100")
    enc = encoder_of(limited)
    prompts = prompt_batch(enc, ROWS, image_dir)
    out, engine = run_scripted(limited, enc, prompts, [[calc, calc], [calc, "I am still wr..."]])
    assert [t["finish"] for t in out["trajectory"]] == ["max_turns", "max_tokens"]
    last = enc.tokenizer(calc, add_special_tokens=False)["input_ids"] + [end_of_turn(limited)]
    n0 = int(out["attention_mask"][0, prompts["input_ids"].shape[1]:].sum())
    assert out["responses"][0][n0 - len(last): n0].tolist() == last  # the trajectory ends with the model's call
    # one call per turn for all samples, max_tokens = the largest budget: min(max_tokens_per_turn, left of T)
    assert [(rows, s.max_tokens) for rows, s in engine.calls] == [(2, 100), (2, 100)]
    # a turn cut by max_tokens_per_turn after a complete call: the call runs, and the template's end
    # of turn (not sampled: out of the mask) closes the model's turn before the result
    cut = tool_plan(tiny_model_path, T, "worker.rollout.tools=[calculator]", "worker.rollout.max_tokens_per_turn=100")
    enc = encoder_of(cut)
    prompts = prompt_batch(enc, ROWS[1:], image_dir)
    out, _ = run_scripted(cut, enc, prompts, [[calc + " and then...", "1"]])
    turn = enc.tokenizer(calc + " and then", add_special_tokens=False)["input_ids"]
    P = prompts["input_ids"].shape[1]
    assert out["trajectory"][0]["finish"] == "answer" and out["trajectory"][0]["messages"][1]["content"] == "1"
    assert out["responses"][0][len(turn)].item() == end_of_turn(cut)  # the template's <|im_end|>, unsampled
    assert out["response_mask"][0][: len(turn) + 1].tolist() == [True] * len(turn) + [False]
    assert out["attention_mask"][0, P:].sum() > len(turn) + 1
    # a result that leaves no room for another model token ends the sample before it is shown
    tight = tool_plan(tiny_model_path, 90, "worker.rollout.tools=[calculator]")
    enc = encoder_of(tight)
    prompts = prompt_batch(enc, ROWS[1:], image_dir)
    out, _ = run_scripted(tight, enc, prompts, [[calc, "42"]])
    assert out["trajectory"][0]["finish"] == "max_tokens" and out["trajectory"][0]["num_turns"] == 1
    assert out["response_mask"][0].sum() == out["attention_mask"][0, prompts["input_ids"].shape[1]:].sum()


ENV_FILE = '''
from PIL import Image

class Counter:
    """Says how many turns the model took; shows a red square after the first; done after two."""
    def reset(self, row):
        self.turns, self.target = 0, row["ground_truth"]

    def step(self, action):
        self.turns += 1
        if self.turns == 1:
            return ["turn 1 seen", Image.new("RGB", (56, 56), (255, 0, 0))], False, 0.5
        return None, True, 1.0 if action == self.target else 0.0
'''


def test_environment_observations_and_rewards(tiny_model_path, image_dir, tmp_path):
    env_file = tmp_path / "env.py"
    env_file.write_text(ENV_FILE)
    env_plan = tool_plan(tiny_model_path, T, f"worker.rollout.environment={env_file}:Counter")
    enc = encoder_of(env_plan)
    prompts = prompt_batch(enc, ROWS, image_dir)
    out, _ = run_scripted(env_plan, enc, prompts, [["left", "red"], ["41", "43"]])
    trajectories = out["trajectory"]
    assert [t["finish"] for t in trajectories] == ["done", "done"]
    assert [t["environment_reward"] for t in trajectories] == [1.5, 0.5]
    assert [m["role"] for m in trajectories[0]["messages"]] == ["assistant", "user", "assistant"]
    assert trajectories[0]["messages"][1]["content"] == "turn 1 seen" and len(trajectories[0]["images"]) == 1
    # the observation is a user turn with its image, rendered by the template
    P = prompts["input_ids"].shape[1]
    ids = out["responses"][0][~out["response_mask"][0] & out["attention_mask"][0, P:].bool()]
    text = enc.tokenizer.decode(ids.tolist())
    assert text.startswith("\n<|im_start|>user\n<|vision_start|><|image_pad|>") and text.endswith(
        "<|vision_end|>turn 1 seen<|im_end|>\n<|im_start|>assistant\n")
    assert build_reward_inputs(out, enc.tokenizer)[0].to_dict()["environment_reward"] == 1.5
    # per step (max_turns = 4 columns): turn 1 earns 0.5; turn 2 1.0 for the target ("red") and 0 for "43"
    assert out["step_rewards"].tolist() == [[0.5, 1.0, 0.0, 0.0], [0.5, 0.0, 0.0, 0.0]]
    # Counter gives no state_key: turn 1 acts from the prompt, turn 2 from the observation's text and image
    seen = ToolResult("turn 1 seen", [Image.new("RGB", (56, 56), (255, 0, 0))])
    assert out["step_anchors"].tolist() == [[state_anchor({}), state_anchor({}, seen), 0, 0]] * 2
    assert state_anchor({}, seen) != state_anchor({}, ToolResult("turn 1 seen", [Image.new("RGB", (56, 56), (0, 0, 255))]))
    # each model token carries its turn; the observation's tokens and the padding -1
    for k, turns in enumerate([["left", "red"], ["41", "43"]]):
        lengths = [len(enc.tokenizer(t, add_special_tokens=False)["input_ids"]) + 1 for t in turns]  # + EOS
        index = out["turn_index"][k]
        assert index[index >= 0].tolist() == [0] * lengths[0] + [1] * lengths[1]
        assert torch.equal(index >= 0, out["response_mask"][k].bool())
    assert [t["environment_info"] for t in trajectories] == [{}, {}]


HANGING_TOOL = '''
import time

def wait(seconds: float) -> str:
    """Wait.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "done"
'''


def test_tool_timeout_comes_from_the_config(tiny_model_path, image_dir, tmp_path):
    tool_file = tmp_path / "slow.py"
    tool_file.write_text(HANGING_TOOL)
    plan = tool_plan(tiny_model_path, T, f"worker.rollout.tools=[{tool_file}:wait]", "worker.rollout.tool_timeout=0.3")
    enc = encoder_of(plan)
    prompts = prompt_batch(enc, ROWS[1:], image_dir)
    call = '<tool_call>{"name": "wait", "arguments": {"seconds": %s}}</tool_call>'
    out, _ = run_scripted(plan, enc, prompts, [[call % 30, call % 0, "42"]])
    results = [m["content"] for m in out["trajectory"][0]["messages"] if m["role"] == "tool"]
    assert results == ["Error: wait timed out after 0.3 s", "done"]



def test_an_environment_step_past_the_time_limit_ends_its_sample(tiny_model_path, image_dir, tmp_path):
    env_file = tmp_path / "slow_env.py"
    env_file.write_text(HANGING_ENV)
    plan = tool_plan(tiny_model_path, T, f"worker.rollout.environment={env_file}:Hanging", "worker.rollout.tool_timeout=0.2")
    enc = encoder_of(plan)
    out, _ = run_scripted(plan, enc, prompt_batch(enc, ROWS[1:], image_dir), [["go", "again"]])
    trajectory = out["trajectory"][0]
    assert trajectory["finish"] == "error" and trajectory["num_turns"] == 1
    assert trajectory["environment_error"] == "environment step timed out after 0.2 s"
    assert trajectory["tool_calls"] == [] and not out["response_mask"][0].any()
    assert trajectory_metrics(out["trajectory"])["multi_turn/finish/error"] == 1.0


def test_each_turn_keeps_the_version_of_the_weights_that_sampled_it(plan, encoder, image_dir):
    """Multi-turn partial rollouts: the rollout service tags each engine call with the version of the
    weights it ran on (``rollout_version``); every model token keeps its turn's, tool tokens and
    padding -1. Here turn 1 is sampled by version 3 and turn 2 by version 4."""
    prompts = prompt_batch(encoder, ROWS, image_dir)
    script = [[ZOOM_CALL, "red"], ['<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>', "42"]]
    versions, lengths = iter([3, 4]), []

    def tagged(engine):
        def generate(batch, sampling):
            out = engine(batch, sampling)
            out["rollout_version"] = torch.full((len(out),), next(versions), dtype=torch.long)
            lengths.append(out["response_mask"].sum(dim=1).tolist())  # each row's tokens in this turn
            return out
        return generate

    out, _ = run_scripted(plan, encoder, prompts, script, wrap=tagged)
    tagged, mask = out["rollout_token_versions"], out["response_mask"]
    for row in range(2):
        length = int(out["attention_mask"][row, prompts["input_ids"].shape[1]:].sum())  # the whole response
        first, second = lengths[0][row], lengths[1][row]
        expected = torch.full((T,), -1, dtype=torch.long)
        expected[:first] = 3  # the first model turn opens the response ...
        expected[length - second: length] = 4  # ... the second closes it; the tool's answer between is -1
        assert tagged[row].tolist() == expected.tolist()
        assert (tagged[row] >= 0).tolist() == mask[row].tolist()  # exactly the trained model tokens
