"""Multi-turn rollouts: the model writes, tools or an environment answer, the model goes on.

:class:`MultiTurnRollout` runs in the driver around any engine's ``generate`` (vLLM or transformers,
through the worker group): each turn is one generation call over the samples still going, so
samples at different turns generate together. A sample's sequence grows as

    prompt | model turn 1 | tool result 1 | model turn 2 | ... | model's answer

and the rollout Batch it returns has the single-turn layout (``RolloutEngine.generate``), with:

- ``responses``: everything after the prompt (model and tool tokens, tool images expanded), right
  padded to T = data.max_response_length, which bounds the whole trajectory;
- ``response_mask``: True on the tokens the model sampled (each turn's EOS included), False on the
  tool and environment tokens, so they are out of the loss, the KL and the advantages;
- ``attention_mask``: every token of the trajectory;
- ``rollout_logprobs``: the sampler's log-probs on the model's tokens, 0 elsewhere;
- ``position_ids``: computed over the whole sequence with its images (rows 1..3 equal
  transformers' ``get_rope_index`` on it), not extended as text;
- ``multi_modal_inputs``: the prompt's vision inputs followed by those of each tool image;
- ``trajectory`` (object): per sample, ``messages`` (the turns after the prompt, role ``assistant``
  / ``tool`` / ``user``), ``tool_calls`` (name, arguments, ok, error), ``num_turns``, ``finish``
  (``answer``, ``max_turns``, ``max_tokens``, ``done``), ``environment_reward`` and
  ``environment_info`` (the last step's info dict, {} with tools);
- with an environment, per model turn (a step; S = ``max_turns`` columns, 0 past the sample's turns):
  ``step_rewards`` (B, S) float, the step's reward (0 for a turn that ended the budget unstepped);
  ``step_anchors`` (B, S) int64, the state the turn acted from (``state_anchor``); and per response
  token ``turn_index`` (B, T) int64, the model turn it belongs to, -1 on observation and padding.

A sample stops when its turn calls no tool (tools) or the environment says done, at
``max_turns`` model turns, or when the response budget is spent (a tool result that leaves no
room for another model token ends it). A turn cut by ``max_tokens_per_turn`` before its EOS still
counts: its tool calls run (or the environment steps) and the template's end of turn follows it,
unsampled; cut without a call, it ends the sample (``max_tokens``).

Seeds: with per-request seeds, turn t of sample j of a prompt seeded s samples with
``mix_seeds(s, j, t)``, so a resumed run samples the same trajectories.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from easyvlm.agents.environment import environment_step, state_anchor
from easyvlm.agents.parse import parse_tool_calls
from easyvlm.agents.settings import AgentSettings
from easyvlm.agents.render import Segment, TurnRenderer, content_of
from easyvlm.agents.tools import Tool, ToolResult, call_tool
from easyvlm.data.batch import PROMPT_KEYS, PROMPT_TENSOR_KEYS, Batch
from easyvlm.data.collate import concat_multi_modal_inputs
from easyvlm.models.position_ids import get_position_ids
from easyvlm.rollout.base import SEED_KEY, is_greedy, mix_seeds
from easyvlm.rollout.specs import Sampling
from easyvlm.rollout.postprocess import pad_logprobs, pad_responses

TRAJECTORY_KEY = "trajectory"
ORIGINAL_IMAGES_KEY = "original_images"  # per-sample loaders of the row's full-resolution images

GenerateFn = Callable[[Batch, Sampling], Batch]


@dataclass
class _Sample:
    """One trajectory while it is being generated."""

    row: int  # the prompt batch row (after repeating n times)
    prompt_ids: list[int]  # unpadded prompt, vision tokens expanded
    raw_prompt_ids: list[int]
    images: list  # prompt images, then tool images (fitted)
    mm_items: list[dict]  # the prompt's vision inputs, then each segment's
    seed: int | None
    response: list[int] = field(default_factory=list)
    raw_response: list[int] = field(default_factory=list)
    model_mask: list[bool] = field(default_factory=list)
    turn_ids: list[int] = field(default_factory=list)  # per response token: its model turn, -1 if not the model's
    logprobs: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    tool_calls: list[dict] = field(default_factory=list)
    num_turns: int = 0
    finish: str | None = None
    env: Any = None
    environment_reward: float = 0.0
    environment_info: dict = field(default_factory=dict)  # the last step's
    state: int = 0  # the environment's state (state_anchor) after the last reset or step
    step_rewards: list[float] = field(default_factory=list)  # per model turn
    step_anchors: list[int] = field(default_factory=list)  # per model turn: the state it acted from
    originals: list | None = None  # the row's full-resolution images, once a tool asked for them
    num_prompt_images: int = 0

    def context(self) -> tuple[list[int], list[int]]:
        return self.prompt_ids + self.response, self.raw_prompt_ids + self.raw_response

    def add(self, ids: Sequence[int], raw_ids: Sequence[int], model: bool, logprobs: Sequence[float] = ()) -> None:
        self.response += list(ids)
        self.raw_response += list(raw_ids)
        self.model_mask += [model] * len(ids)
        self.turn_ids += [self.num_turns if model else -1] * len(ids)  # num_turns: the turn being added
        self.logprobs += list(logprobs) if model else [0.0] * len(ids)


class MultiTurnRollout:
    """Multi-turn generation with ``tools`` (by name) or an ``environment`` class (one of the two).

    renderer: tool results -> tokens. tokenizer: decodes the model's turns. model_config: for the
    position ids. eos_token_ids / pad_token_id / response_length: as the rollout engines'.
    """

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
            for k, (sample, budget) in enumerate(zip(active, budgets)):
                mask = out["response_mask"][k].bool()
                ids, logprobs = out["responses"][k][mask].tolist(), out["rollout_logprobs"][k][mask].tolist()
                self._after_turn(sample, ids[:budget], logprobs[:budget], turn, repeated, originals)
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
            sample = _Sample(row, ids[row][mask[row]].tolist(), list(repeated["raw_prompt_ids"][row]),
                             list(images[row] or []), [dict(items[row] or {})], seed,
                             num_prompt_images=len(images[row] or []))
            if self.environment is not None:
                extra = (repeated.get("extra") or [None] * len(repeated))[row] or {}
                truth = repeated["ground_truth"][row] if "ground_truth" in repeated else None
                sample.env = self.environment()
                info = sample.env.reset({**extra, "ground_truth": truth})
                sample.state = state_anchor(info if isinstance(info, dict) else {})
            samples.append(sample)
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
        items = [concat_multi_modal_inputs(s.mm_items) for s in active]
        objects: dict[str, list] = {
            "raw_prompt_ids": [raw for _, raw in contexts],
            "images": [list(s.images) for s in active],
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
    def _after_turn(self, s: _Sample, ids: list[int], logprobs: list[float], turn: int,
                    repeated: Batch, originals: list | None) -> None:
        s.add(ids, ids, model=True, logprobs=logprobs)
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
            return
        if self.environment is not None:
            observation, done, reward, info = environment_step(s.env, text, self.settings.tool_timeout)
            s.environment_reward += reward
            s.step_rewards[-1], s.environment_info = reward, info
            s.state = state_anchor(info, observation)
            if observation.error is not None:
                s.tool_calls.append({"name": "environment", "arguments": text, "ok": False, "error": observation.error})
            if done:
                s.finish = "done"
                return
            self._append(s, [{"role": "user", "content": content_of(observation.text, observation.images)}],
                         observation.images, eos_text, [_record("user", "environment", observation)], role="user")
            return
        calls = parse_tool_calls(text)
        if not calls:
            s.finish = "answer" if ended else "max_tokens"
            return
        if turn + 1 >= self.settings.max_turns:
            s.finish = "max_turns"
            return
        results = [self._call(s, call, repeated, originals) for call in calls]
        messages = [{"role": "tool", "content": content_of(r.text if r.ok else f"Error: {r.error}", r.images)}
                    for r in results]
        images = [image for r in results for image in r.images]
        records = [_record("tool", call.name or "(malformed)", r) for call, r in zip(calls, results)]
        self._append(s, messages, images, eos_text, records, role="tool")

    def _call(self, s: _Sample, call: Any, repeated: Batch, originals: list | None) -> ToolResult:
        if call.error is not None:
            result = ToolResult(error=call.error)
        elif call.name not in self.tools:
            result = ToolResult(error=f"there is no tool {call.name!r}; tools: {', '.join(self.tools)}")
        else:
            tool = self.tools[call.name]
            context: dict[str, Any] = {"images": list(s.images)}
            if "original_images" in tool.reserved:
                if s.originals is None:  # read from disk once per sample, on its first use
                    s.originals = originals[s.row].load() if originals is not None else []
                context["original_images"] = s.originals
            if "row" in tool.reserved:
                context["row"] = dict((repeated.get("extra") or [{}] * len(repeated))[s.row] or {})
            result = call_tool(tool, call.arguments, context, self.settings.tool_timeout)
        s.tool_calls.append({
            "name": call.name or "(malformed)",
            "arguments": call.arguments if call.error is None else call.text,
            "ok": result.ok,
            "error": result.error,
        })
        return result

    def _append(self, s: _Sample, messages: list[dict], images: list, eos_text: str | None,
                records: list[dict], role: str) -> None:
        """Render ``messages`` (with ``images``) after the model's turn, if the budget has room;
        ``records`` are what the trajectory keeps of them."""
        try:
            segment: Segment = self.renderer.render(messages, images, eos_text)
        except ValueError as err:  # e.g. an image the processor cannot take: the model is told
            error = f"Error: the result could not be shown ({err})"
            s.tool_calls.append({"name": "(render)", "arguments": None, "ok": False, "error": str(err)})
            segment = self.renderer.render([{"role": role, "content": error}], [], eos_text)
            images = []
        if len(s.response) + len(segment.input_ids) + 1 > self.response_length:
            s.finish = "max_tokens"  # no room for the model to read the result and answer
            return
        s.add(segment.input_ids, segment.raw_ids, model=False)
        s.images += segment.images
        if segment.multi_modal_inputs:
            s.mm_items.append(segment.multi_modal_inputs)
        s.messages += records

    # ------------------------------------------------------------------ the Batch
    def _rollout_batch(self, repeated: Batch, samples: list[_Sample]) -> Batch:
        T = self.response_length
        responses = pad_responses([s.response for s in samples], T, self.pad_token_id)
        response_mask = torch.zeros(len(samples), T, dtype=torch.bool)
        response_attention = torch.zeros(len(samples), T, dtype=torch.bool)
        for k, s in enumerate(samples):
            response_mask[k, : len(s.model_mask)] = torch.tensor(s.model_mask, dtype=torch.bool)
            response_attention[k, : len(s.response)] = True
        rest = repeated.copy()
        prompt = rest.pop(*PROMPT_TENSOR_KEYS)
        input_ids = torch.cat([prompt["input_ids"], responses], dim=1)
        attention_mask = torch.cat([prompt["attention_mask"].bool(), response_attention], dim=1)
        items = [concat_multi_modal_inputs(s.mm_items) for s in samples]
        new = Batch(
            {
                "prompts": prompt["input_ids"],
                "responses": responses,
                "response_mask": response_mask,
                "rollout_logprobs": pad_logprobs([s.logprobs for s in samples], T) * response_mask,
                "input_ids": input_ids,
                "attention_mask": attention_mask,
                "position_ids": self._position_ids(input_ids, attention_mask, items),
            },
            {
                "multi_modal_inputs": items,
                TRAJECTORY_KEY: [
                    {
                        "messages": s.messages,
                        "tool_calls": s.tool_calls,
                        "num_turns": s.num_turns,
                        "finish": s.finish,
                        "environment_reward": s.environment_reward,
                        "environment_info": s.environment_info,
                        "images": s.images[s.num_prompt_images:],
                    }
                    for s in samples
                ],
            },
        )
        if self.environment is not None:
            new = new.union(self._step_batch(samples))
        if "multi_modal_inputs" in rest:
            rest.pop("multi_modal_inputs")
        return rest.union(new)

    def _step_batch(self, samples: list[_Sample]) -> Batch:
        """``turn_index`` (B, T), ``step_rewards`` and ``step_anchors`` (B, max_turns): what a
        step-level estimator (gigpo) reads."""
        B, S = len(samples), self.settings.max_turns
        turn_index = torch.full((B, self.response_length), -1, dtype=torch.long)
        step_rewards = torch.zeros(B, S, dtype=torch.float32)
        step_anchors = torch.zeros(B, S, dtype=torch.long)
        for k, s in enumerate(samples):
            turn_index[k, : len(s.turn_ids)] = torch.tensor(s.turn_ids, dtype=torch.long)
            step_rewards[k, : len(s.step_rewards)] = torch.tensor(s.step_rewards, dtype=torch.float32)
            step_anchors[k, : len(s.step_anchors)] = torch.tensor(s.step_anchors, dtype=torch.long)
        return Batch({"turn_index": turn_index, "step_rewards": step_rewards, "step_anchors": step_anchors})


def _record(role: str, name: str, result: ToolResult) -> dict:
    """What a trajectory keeps of a tool result or an observation (its images are in ``images``)."""
    return {"role": role, "name": name, "content": result.text if result.ok else f"Error: {result.error}",
            "num_images": len(result.images), "error": result.error}


def trajectory_metrics(trajectories: Sequence[dict]) -> dict[str, float]:
    """Turns, tool calls and how samples ended, over a batch's ``trajectory`` objects.

    ``multi_turn/turns/{mean,max}``: model turns per sample; ``multi_turn/tool_calls/mean``: calls
    per sample (malformed ones included); ``multi_turn/tool/<name>/{success,error}_rate``: share of
    that tool's calls (``(malformed)``: calls that could not be read); ``multi_turn/finish/<reason>``:
    share of samples that ended that way.
    """
    if not trajectories:
        return {}
    n = len(trajectories)
    turns = [t["num_turns"] for t in trajectories]
    metrics = {
        "multi_turn/turns/mean": sum(turns) / n,
        "multi_turn/turns/max": float(max(turns)),
        "multi_turn/tool_calls/mean": sum(len(t["tool_calls"]) for t in trajectories) / n,
    }
    by_tool: dict[str, list[bool]] = {}
    for t in trajectories:
        for call in t["tool_calls"]:
            by_tool.setdefault(call["name"], []).append(bool(call["ok"]))
    for name, oks in sorted(by_tool.items()):
        metrics[f"multi_turn/tool/{name}/success_rate"] = sum(oks) / len(oks)
        metrics[f"multi_turn/tool/{name}/error_rate"] = 1 - sum(oks) / len(oks)
    for reason in ("answer", "max_turns", "max_tokens", "done"):
        metrics[f"multi_turn/finish/{reason}"] = sum(t["finish"] == reason for t in trajectories) / n
    return metrics

