"""Helpers of the multi-turn tests: a run plan with tools, prompts through the data pipeline, and a
scripted engine (the model's turns given as text) that returns exactly what an engine's generate
would for them."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from PIL import Image

from easyvlm.agents.setup import build_multi_turn
from easyvlm.data.batch import Batch
from easyvlm.data.collate import collate_prompts
from easyvlm.data.dataset import PromptEncoder
from easyvlm.data.images import LazyImages
from easyvlm.rollout.specs import Sampling
from easyvlm.rollout.postprocess import build_rollout_batch

LOGPROB = -0.25  # what the scripted engine reports for every token it "samples"


def tool_plan(model_path: str, response_length: int, *overrides: str) -> Any:
    from plan_testing import plan_for

    return plan_for(model_path, "data.max_prompt_length=256", f"data.max_response_length={response_length}", *overrides)


def encoder_of(plan: Any) -> PromptEncoder:
    bundle = plan.bundle
    schemas = plan.agent.tool_schemas if plan.agent is not None else ()
    return PromptEncoder(plan.data, bundle.tokenizer, bundle.processor, bundle.policy.hf_config, schemas)


def two_colour_image(path: Any) -> str:
    """A 112x112 image: top half red, bottom half blue, saved as PNG; returns the path."""
    image = Image.new("RGB", (112, 112), (255, 0, 0))
    image.paste((0, 0, 255), (0, 56, 112, 112))
    image.save(path)
    return str(path)


def prompt_batch(encoder: PromptEncoder, rows: Sequence[dict], base_dir: Any) -> Batch:
    """Rows through the data pipeline (chat template with the tools, images fitted), collated."""
    samples = []
    for i, row in enumerate(rows):
        enc = encoder.encode(row, base_dir)
        samples.append({
            "input_ids": __import__("torch").tensor(enc.input_ids), "position_ids": encoder.position_ids(enc),
            "raw_prompt_ids": enc.raw_prompt_ids, "images": enc.images, "original_image_sizes": enc.original_image_sizes,
            "videos": enc.videos, "multi_modal_inputs": enc.multi_modal_inputs, "ground_truth": row["answer"],
            "uid": f"u{i}", "prompt_text": enc.prompt_text, "extra": {"id": i},
            "original_images": LazyImages(tuple(encoder.raw_images(row)), (str(base_dir),)),
        })
    return collate_prompts(samples, encoder.pad_token_id)


class ScriptedEngine:
    """A generate function whose "model" writes ``script[row][turn]`` (text; EOS appended unless the
    text ends with ``...``, which means: cut by the token budget). Records each call's sampling."""

    def __init__(self, tokenizer: Any, eos_id: int, pad_id: int, response_length: int, script: list[list[str]]):
        self.tokenizer, self.eos_id, self.pad_id, self.T = tokenizer, eos_id, pad_id, response_length
        self.script = script
        self.calls: list[tuple[int, Sampling]] = []
        self.seen: list[Batch] = []

    def tokens(self, text: str, budget: int) -> list[int]:
        if text.endswith("..."):
            return self.tokenizer(text[:-3], add_special_tokens=False)["input_ids"][:budget]
        return (self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.eos_id])[:budget]

    def __call__(self, batch: Batch, sampling: Sampling) -> Batch:
        # every call advances every sample still going by one turn, so the call index is the turn
        turn = len(self.calls)
        self.calls.append((len(batch), sampling))
        self.seen.append(batch)
        responses = [self.tokens(self.script[self._row_of(raw)][turn], sampling.max_tokens) for raw in batch["raw_prompt_ids"]]
        logprobs = [[LOGPROB] * len(r) for r in responses]
        return build_rollout_batch(batch, responses, logprobs, self.T, self.pad_id, [self.eos_id])

    prompts: list[list[int]] = []

    def _row_of(self, raw: list[int]) -> int:
        """Which scripted row a context belongs to: the prompt it starts with."""
        for row, prompt in enumerate(self.prompts):
            if list(raw[: len(prompt)]) == prompt:
                return row
        raise AssertionError("context of no known prompt")


def end_of_turn(plan: Any) -> int:
    """The EOS the chat template ends an assistant turn with (``<|im_end|>``), one of the plan's EOS ids."""
    token = plan.bundle.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert token in plan.rollout.tokens.eos
    return token


def multi_turn_of(plan: Any, encoder: PromptEncoder) -> Any:
    return build_multi_turn(plan, encoder)


def run_scripted(plan: Any, encoder: PromptEncoder, prompts: Batch, script: list[list[str]],
                 sampling_changes: dict | None = None, wrap: Callable | None = None) -> tuple[Batch, ScriptedEngine]:
    """The multi-turn loop over ``script``'s turns; ``wrap(engine)``: what the loop calls instead of the
    engine (e.g. one that tags each call's output as the rollout service does)."""
    import dataclasses

    tokens = plan.rollout.tokens
    engine = ScriptedEngine(encoder.tokenizer, end_of_turn(plan), tokens.pad, plan.rollout.response_length, script)
    engine.prompts = [list(r) for r in prompts["raw_prompt_ids"]]
    sampling = dataclasses.replace(plan.rollout.sampling, n=1, **(sampling_changes or {}))
    generate = wrap(engine) if wrap is not None else engine
    return multi_turn_of(plan, encoder).generate(prompts, sampling, generate), engine


Generate = Callable[[Batch, Sampling], Batch]


HANGING_ENV = '''
import time

class Hanging:
    def reset(self, row):
        pass

    def step(self, action):
        time.sleep(30)
        return "late", False
'''
"""An environment file whose steps never answer in time (class ``Hanging``)."""
