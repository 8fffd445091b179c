"""Multi-turn rollouts in the driver around any engine's ``generate``: each turn is one generation
call over the samples still going. The Batch returned has ``RolloutEngine.generate``'s layout with
``responses`` = everything after the prompt (bounded by T), ``response_mask`` True only on trained
model tokens, a ``trajectory`` object per sample and, with an environment, the per-step fields
(docs/agents.md, "What is trained"). Tools or steps run at once, applied in sample order. Turn t of
sample j of a prompt seeded s is seeded ``mix_seeds(mix_seeds(s, j), t)``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Sequence

import torch

from easyvlm.agents.context import Answer, ModelTurn, Response, apply_removal, remove_oldest
from easyvlm.agents.environment import environment_reset, environment_step, state_anchor
from easyvlm.agents.parse import parse_tool_calls
from easyvlm.agents.settings import AgentSettings
from easyvlm.agents.render import TurnRenderer, content_of, without_images
from easyvlm.agents.tools import Tool, ToolResult, call_tool, run_concurrently
from easyvlm.data.batch import PROMPT_KEYS, PROMPT_TENSOR_KEYS, Batch
from easyvlm.data.collate import concat_multi_modal_inputs
from easyvlm.models.position_ids import get_position_ids
from easyvlm.rollout.base import SEED_KEY, is_greedy, mix_seeds
from easyvlm.rollout.specs import Sampling
from easyvlm.rollout.postprocess import pad_logprobs, pad_responses

TRAJECTORY_KEY = "trajectory"
ORIGINAL_IMAGES_KEY = "original_images"  # per-sample loaders of the row's full-resolution images
FINISH_REASONS = ("answer", "max_turns", "max_tokens", "done", "error")

GenerateFn = Callable[[Batch, Sampling], Batch]


@dataclass
class _Sample:
    row: int  # the prompt batch row (after repeating n times)
    prompt_ids: list[int]  # unpadded prompt, vision tokens expanded
    raw_prompt_ids: list[int]
    prompt_images: list  # fitted by the data pipeline
    prompt_inputs: dict  # the prompt's vision inputs
    seed: int | None
    response: Response = field(default_factory=Response)
    messages: list[dict] = field(default_factory=list)
    tool_calls: list[dict] = field(default_factory=list)
    num_turns: int = 0
    finish: str | None = None
    env: Any = None
    environment_reward: float = 0.0
    environment_info: dict = field(default_factory=dict)  # the last step's
    environment_error: str | None = None
    state: int = 0  # the environment's state (state_anchor) after the last reset or step
    step_rewards: list[float] = field(default_factory=list)  # per model turn
    step_anchors: list[int] = field(default_factory=list)  # per model turn: the state it acted from
    originals: list | None = None  # the row's full-resolution images, once a tool asked for them

    def context(self) -> tuple[list[int], list[int]]:
        return self.prompt_ids + self.response.ids(), self.raw_prompt_ids + self.response.raw_ids()

    def images(self) -> list:
        """What the model sees: the prompt's images, then those of the answers still shown."""
        return self.prompt_images + self.response.images()

    def multi_modal_inputs(self) -> dict:
        return concat_multi_modal_inputs([self.prompt_inputs, *self.response.multi_modal_inputs()])

    def fail(self, error: str) -> None:
        """The environment failed: the sample ends, none of its tokens is trained."""
        self.finish, self.environment_error = "error", error
        self.response.untrain()


@dataclass
class _Action:
    """What a model turn asks for: an environment step on ``text``, or ``calls`` (tools)."""

    text: str
    eos_text: str | None  # the turn's EOS as text, None if it was cut before one
    calls: list | None = None


class MultiTurnRollout:
    """Multi-turn generation with ``tools`` (by name) or an ``environment`` class, not both.
    model_config: for the position ids; eos_token_ids / pad_token_id / response_length: the engines'."""

    def __init__(
        self,
        settings: AgentSettings,
        renderer: TurnRenderer,
        model_config: Any,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        response_length: int,
        tools: dict[str, Tool] | None = None,
        environment: type | None = None,
    ):
        assert (tools is None) != (environment is None), "tools or an environment, not both"
        self.settings = settings
        self.renderer = renderer
        self.tokenizer = renderer.tokenizer
        self.model_config = model_config
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.response_length = response_length
        self.tools = tools
        self.environment = environment

    # ------------------------------------------------------------------ the loop
    def generate(self, prompts: Batch, sampling: Sampling, generate: GenerateFn) -> Batch:
        """Like ``RolloutEngine.generate(prompts, sampling)``: B*n rows, sample j of prompt i at i*n+j.
        ``generate(batch, sampling)`` runs one single-turn call (e.g. the worker group's dispatch)."""
        prompts.require(*PROMPT_KEYS)
        repeated = prompts.repeat(sampling.n, interleave=True)
        originals = repeated.pop(ORIGINAL_IMAGES_KEY)[ORIGINAL_IMAGES_KEY] if ORIGINAL_IMAGES_KEY in repeated else None
        samples = self._start(repeated, sampling)
        turn_sampling = dataclasses.replace(sampling, n=1)
        for turn in range(self.settings.max_turns):
            active = [s for s in samples if s.finish is None]
            if not active:
                break
            budgets = [self._budget(s) for s in active]
            # One call for all active samples, with the largest budget; each sample's turn is then
            # cut at its own budget. Tokens are sampled left to right, so the cut turn is exactly
            # what a call with that budget would have sampled (its log-probs too).
            out = generate(self._turn_batch(repeated, active, turn),
                           dataclasses.replace(turn_sampling, max_tokens=max(budgets)))
            pending = []
            versions = out["rollout_version"].tolist() if "rollout_version" in out else [-1] * len(active)
            for k, (sample, budget) in enumerate(zip(active, budgets)):
                mask = out["response_mask"][k].bool()
                ids, logprobs = out["responses"][k][mask].tolist(), out["rollout_logprobs"][k][mask].tolist()
                action = self._model_turn(sample, ids[:budget], logprobs[:budget], turn, versions[k])
                if action is not None:
                    pending.append((sample, action))
            # every sample's tools or environment step at once; the answers in sample order
            outcomes = run_concurrently([partial(self._act, s, action, repeated, originals) for s, action in pending])
            for (sample, action), outcome in zip(pending, outcomes):
                self._answer(sample, action, outcome)
        for s in samples:
            if s.finish is None:
                s.finish = "max_turns"
        return self._rollout_batch(repeated, samples)

    def _start(self, repeated: Batch, sampling: Sampling) -> list[_Sample]:
        n = sampling.n
        ids, mask = repeated["input_ids"], repeated["attention_mask"].bool()
        items = repeated.get("multi_modal_inputs") or [{}] * len(repeated)
        images = repeated.get("images") or [[]] * len(repeated)
        seeds = repeated.get(SEED_KEY)
        samples = []
        for row in range(len(repeated)):
            seed = None if seeds is None or is_greedy(sampling) else mix_seeds(seeds[row], row % n)
            samples.append(_Sample(row, ids[row][mask[row]].tolist(), list(repeated["raw_prompt_ids"][row]),
                                   list(images[row] or []), dict(items[row] or {}), seed))
        if self.environment is not None:  # every sample's environment starts at once
            extras = repeated.get("extra") or [None] * len(repeated)
            truths = repeated["ground_truth"] if "ground_truth" in repeated else [None] * len(repeated)
            rows = [{**(extras[row] or {}), "ground_truth": truths[row]} for row in range(len(repeated))]
            timeout = self.settings.tool_timeout
            started = run_concurrently([partial(environment_reset, self.environment, row, timeout) for row in rows])
            for sample, (env, info, error) in zip(samples, started):
                if error is not None:
                    sample.fail(error)
                else:
                    sample.env, sample.state = env, state_anchor(info)
        return samples

    def _budget(self, s: _Sample) -> int:
        left = self.response_length - len(s.response)
        per_turn = self.settings.max_tokens_per_turn
        return min(left, per_turn) if per_turn else left

    def _turn_batch(self, repeated: Batch, active: list[_Sample], turn: int) -> Batch:
        """The prompt Batch of one turn: each active sample's sequence so far, left padded."""
        contexts = [s.context() for s in active]
        length = max(len(ids) for ids, _ in contexts)
        input_ids = torch.full((len(active), length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros(len(active), length, dtype=torch.bool)
        for k, (ids, _) in enumerate(contexts):
            input_ids[k, length - len(ids):] = torch.tensor(ids, dtype=torch.long)
            attention_mask[k, length - len(ids):] = True
        items = [s.multi_modal_inputs() for s in active]
        objects: dict[str, list] = {
            "raw_prompt_ids": [raw for _, raw in contexts],
            "images": [s.images() for s in active],
            "multi_modal_inputs": items,
        }
        if "videos" in repeated:
            objects["videos"] = [repeated["videos"][s.row] for s in active]
        if any(s.seed is not None for s in active):
            objects[SEED_KEY] = [mix_seeds(s.seed, turn) for s in active]
        position_ids = self._position_ids(input_ids, attention_mask, items)
        return Batch({"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}, objects)

    def _position_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, items: list[dict]) -> torch.Tensor:
        mm = concat_multi_modal_inputs(items)
        return get_position_ids(input_ids, attention_mask, mm.get("image_grid_thw"), mm.get("video_grid_thw"),
                                self.model_config, mm.get("second_per_grid_ts"))

    # ------------------------------------------------------------------ one turn's outcome
    def _model_turn(self, s: _Sample, ids: list[int], logprobs: list[float], turn: int, version: int) -> _Action | None:
        """Record the model's turn (``version``: -1 unknown); what it asks for, or None when the sample ends."""
        s.response.pieces.append(ModelTurn(list(ids), list(logprobs), s.num_turns, version=version))
        s.num_turns += 1
        if self.environment is not None:  # the turn is a step from the current state, reward 0 until stepped
            s.step_anchors.append(s.state)
            s.step_rewards.append(0.0)
        ended = bool(ids) and ids[-1] in self.eos_token_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        s.messages.append({"role": "assistant", "content": text})
        eos_text = self.tokenizer.decode(ids[-1:], skip_special_tokens=False) if ended else None
        if len(s.response) >= self.response_length:  # the whole budget is spent: nothing can follow
            s.finish = "max_tokens"
            return None
        if self.environment is not None:
            return _Action(text, eos_text)
        calls = parse_tool_calls(text)
        if not calls:
            s.finish = "answer" if ended else "max_tokens"
            return None
        if turn + 1 >= self.settings.max_turns:
            s.finish = "max_turns"
            return None
        return _Action(text, eos_text, calls)

    def _act(self, s: _Sample, action: _Action, repeated: Batch, originals: list | None) -> Any:
        """The environment's step or the tool calls of one sample, in a thread: it changes nothing shared."""
        if action.calls is None:
            return environment_step(s.env, action.text, self.settings.tool_timeout)
        return [self._call(s, call, repeated, originals) for call in action.calls]

    def _answer(self, s: _Sample, action: _Action, outcome: Any) -> None:
        """Apply what ``_act`` returned: the step's reward and observation, or the tools' results."""
        if action.calls is None:
            observation, done, reward, info = outcome
            s.environment_reward += reward
            s.step_rewards[-1], s.environment_info = reward, info
            s.state = state_anchor(info, observation)
            if observation.error is not None:  # the environment raised, hung or answered something malformed
                s.fail(observation.error)
                return
            if done:
                s.finish = "done"
                return
            self._append(s, [{"role": "user", "content": content_of(observation.text, observation.images)}],
                         observation.images, action.eos_text, [_record("user", "environment", observation)], role="user")
            return
        for call, result in zip(action.calls, outcome):
            s.tool_calls.append({
                "name": call.name or "(malformed)",
                "arguments": call.arguments if call.error is None else call.text,
                "ok": result.ok,
                "error": result.error,
            })
        messages = [{"role": "tool", "content": content_of(r.text if r.ok else f"Error: {r.error}", r.images)}
                    for r in outcome]
        images = [image for r in outcome for image in r.images]
        records = [_record("tool", call.name or "(malformed)", r) for call, r in zip(action.calls, outcome)]
        self._append(s, messages, images, action.eos_text, records, role="tool")

    def _call(self, s: _Sample, call: Any, repeated: Batch, originals: list | None) -> ToolResult:
        if call.error is not None:
            return ToolResult(error=call.error)
        if call.name not in self.tools:
            return ToolResult(error=f"there is no tool {call.name!r}; tools: {', '.join(self.tools)}")
        tool = self.tools[call.name]
        # every image so far (those the image budget removed too, so that an image keeps its index)
        context: dict[str, Any] = {"images": s.prompt_images + [i for a in s.response.answers() for i in a.record_images]}
        if "original_images" in tool.reserved:
            if s.originals is None:  # read from disk once per sample, on its first use
                s.originals = originals[s.row].load() if originals is not None else []
            context["original_images"] = s.originals
        if "row" in tool.reserved:
            context["row"] = dict((repeated.get("extra") or [{}] * len(repeated))[s.row] or {})
        return call_tool(tool, call.arguments, context, self.settings.tool_timeout)

    def _append(self, s: _Sample, messages: list[dict], images: list, eos_text: str | None,
                records: list[dict], role: str) -> None:
        """Render ``messages`` after the model's turn if the budget has room, within the image budget;
        ``records``: what the trajectory keeps of them."""
        k = self.settings.max_images_in_context
        returned = list(images)
        own = 0 if k is None else max(0, len(images) - k)  # of these images, removed as they arrive
        try:
            segment = self.renderer.render(without_images(messages, own), images[own:], eos_text)
        except ValueError as err:  # e.g. an image the processor cannot take: the model is told
            error = f"Error: the result could not be shown ({err})"
            s.tool_calls.append({"name": "(render)", "arguments": None, "ok": False, "error": str(err)})
            messages, images, own = [{"role": role, "content": error}], [], 0
            segment = self.renderer.render(messages, [], eos_text)
        earlier = 0 if k is None else max(0, sum(a.shown for a in s.response.answers()) + len(images) - own - k)
        changes = remove_oldest(s.response, earlier, self.renderer)
        shrunk = sum(len(s.response.pieces[i].segment.input_ids) - len(a.segment.input_ids) for i, a in changes.items())
        if len(s.response) - shrunk + len(segment.input_ids) + 1 > self.response_length:
            s.finish = "max_tokens"  # no room for the model to read the result and answer
            return
        apply_removal(s.response, changes)
        shown = returned[:own] + segment.images if images else returned  # every image, as first shown
        s.response.pieces.append(Answer(segment, messages, images, eos_text, own, shown))
        s.messages += records

    # ------------------------------------------------------------------ the Batch
    def _rollout_batch(self, repeated: Batch, samples: list[_Sample]) -> Batch:
        T = self.response_length
        responses = pad_responses([s.response.ids() for s in samples], T, self.pad_token_id)
        response_mask = torch.zeros(len(samples), T, dtype=torch.bool)
        response_attention = torch.zeros(len(samples), T, dtype=torch.bool)
        for k, s in enumerate(samples):
            trained = s.response.trained_mask()
            response_mask[k, : len(trained)] = torch.tensor(trained, dtype=torch.bool)
            response_attention[k, : len(s.response)] = True
        rest = repeated.copy()
        prompt = rest.pop(*PROMPT_TENSOR_KEYS)
        input_ids = torch.cat([prompt["input_ids"], responses], dim=1)
        attention_mask = torch.cat([prompt["attention_mask"].bool(), response_attention], dim=1)
        items = [s.multi_modal_inputs() for s in samples]
        new = Batch(
            {
                "prompts": prompt["input_ids"],
                "responses": responses,
                "response_mask": response_mask,
                "rollout_logprobs": pad_logprobs([s.response.logprobs() for s in samples], T) * response_mask,
                "input_ids": input_ids,
                "attention_mask": attention_mask,
                "position_ids": self._position_ids(input_ids, attention_mask, items),
            },
            {"multi_modal_inputs": items, TRAJECTORY_KEY: [_trajectory(s) for s in samples]},
        )
        if self.environment is not None:
            new = new.union(self._step_batch(samples))
        if any(p.version >= 0 for s in samples for p in s.response.turns()):  # partial rollouts: per-token versions
            new["rollout_token_versions"] = pad_responses([s.response.versions() for s in samples], T, -1)
        if "multi_modal_inputs" in rest:
            rest.pop("multi_modal_inputs")
        return rest.union(new)

    def _step_batch(self, samples: list[_Sample]) -> Batch:
        """The per-step fields a step-level estimator (gigpo) reads."""
        B, S = len(samples), self.settings.max_turns
        turn_index = torch.full((B, self.response_length), -1, dtype=torch.long)
        step_rewards = torch.zeros(B, S, dtype=torch.float32)
        step_anchors = torch.zeros(B, S, dtype=torch.long)
        for k, s in enumerate(samples):
            index = s.response.turn_index()
            turn_index[k, : len(index)] = torch.tensor(index, dtype=torch.long)
            step_rewards[k, : len(s.step_rewards)] = torch.tensor(s.step_rewards, dtype=torch.float32)
            step_anchors[k, : len(s.step_anchors)] = torch.tensor(s.step_anchors, dtype=torch.long)
        return Batch({"turn_index": turn_index, "step_rewards": step_rewards, "step_anchors": step_anchors})


def _trajectory(s: _Sample) -> dict:
    answers = s.response.answers()
    return {
        "messages": s.messages,
        "tool_calls": s.tool_calls,
        "num_turns": s.num_turns,
        "finish": s.finish,
        "environment_reward": s.environment_reward,
        "environment_info": s.environment_info,
        "environment_error": s.environment_error,
        "images": [image for a in answers for image in a.record_images],
        "images_removed": sum(a.removed for a in answers),
        "untrained_turns": sum(not t.trained for t in s.response.turns()),
    }


def _record(role: str, name: str, result: ToolResult) -> dict:
    return {"role": role, "name": name, "content": result.text if result.ok else f"Error: {result.error}",
            "num_images": len(result.images), "error": result.error}


def trajectory_metrics(trajectories: Sequence[dict]) -> dict[str, float]:
    """``multi_turn/*`` metrics over a batch's ``trajectory`` objects (docs/agents.md, "Metrics")."""
    if not trajectories:
        return {}
    n = len(trajectories)
    turns = [t["num_turns"] for t in trajectories]
    metrics = {
        "multi_turn/turns/mean": sum(turns) / n,
        "multi_turn/turns/max": float(max(turns)),
        "multi_turn/tool_calls/mean": sum(len(t["tool_calls"]) for t in trajectories) / n,
        "multi_turn/untrained_turns/mean": sum(t.get("untrained_turns", 0) for t in trajectories) / n,
        "multi_turn/images_removed/mean": sum(t.get("images_removed", 0) for t in trajectories) / n,
    }
    by_tool: dict[str, list[bool]] = {}
    for t in trajectories:
        for call in t["tool_calls"]:
            by_tool.setdefault(call["name"], []).append(bool(call["ok"]))
    for name, oks in sorted(by_tool.items()):
        metrics[f"multi_turn/tool/{name}/success_rate"] = sum(oks) / len(oks)
        metrics[f"multi_turn/tool/{name}/error_rate"] = 1 - sum(oks) / len(oks)
    for reason in FINISH_REASONS:
        metrics[f"multi_turn/finish/{reason}"] = sum(t["finish"] == reason for t in trajectories) / n
    return metrics

