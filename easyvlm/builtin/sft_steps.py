"""The warm starts' supervised steps (the base model and its optimizer, seeded; one step), shared by
the recipes of ``easyvlm.builtin.warm_start`` and ``easyvlm.builtin.gui_warm_start``, and what their
multi-turn recipes share: episodes through the RL rollout loop with the model's turns given."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


def start_training(spec: Any, base: str):
    """(the base model in training mode, its AdamW, the recipe's sampling RNG), seeded."""
    import torch
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(spec.seed)
    rng = random.Random(spec.seed)
    model = AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32)
    model.train()
    return model, torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0), rng


def train_step(model, optimizer, **inputs) -> float:
    """One supervised step on ``inputs`` (with ``labels``); returns the loss."""
    loss = model(**inputs).loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


@dataclass(frozen=True)
class Episodes:
    """A multi-turn recipe's train prompts, encoded as RL encodes them, and the rollout loop that plays
    them with given turns, so the warm start trains on exactly the tokens, positions and images RL sees."""

    dataset: Any  # easyvlm.data.dataset.RLDataset of the train rows
    rows: list[dict]  # the rows' columns, in file order
    loop: Any  # easyvlm.agents.loop.MultiTurnRollout
    tokenizer: Any
    eos: int
    length: int  # the loop's response length

    def sample(self, rng: random.Random, batch_size: int) -> tuple[list[int], list[dict]]:
        """``batch_size`` distinct random prompts: their dataset indices and their rows' columns."""
        picked = rng.sample(range(len(self.dataset)), batch_size)
        return picked, [self.rows[self.dataset.index[i][1]] for i in picked]

    def play(self, picked: list[int], turn_texts: Callable[[int], list[str]]) -> dict:
        """The loop's output for prompts ``picked`` where the model's k-th turn (k = 0, 1, ...) of the
        samples still going, in batch order, is ``turn_texts(k)`` (each text + EOS)."""
        from easyvlm.data.collate import collate_prompts
        from easyvlm.rollout.postprocess import build_rollout_batch
        from easyvlm.rollout.specs import Sampling

        pad, turn = self.dataset.pad_token_id, [0]

        def given(batch, _sampling):
            texts = turn_texts(turn[0])
            assert len(texts) == len(batch), (len(texts), len(batch))
            targets = [self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.eos] for text in texts]
            turn[0] += 1
            return build_rollout_batch(batch, targets, [[0.0] * len(t) for t in targets], self.length, pad, [self.eos])

        sampling = Sampling(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=self.length, ignore_eos=False)
        return self.loop.generate(collate_prompts([self.dataset[i] for i in picked], pad), sampling, given)

    def play_scripts(self, picked: list[int], scripts: list[list[str]]) -> dict:
        """``play`` where sample j's turns are ``scripts[j]``: the samples still going at turn k are
        those whose script is longer than k (in batch order)."""
        return self.play(picked, lambda k: [script[k] for script in scripts if len(script) > k])


def episodes_of(spec: Any, processor, model_config, data_file: Path, prompt_file: Path, length: int,
                max_turns: int | None = None, tools: dict | None = None, environment: type | None = None) -> Episodes:
    """The recipe's train rows (``data_file``, format prompt ``prompt_file``, ``spec.max_pixels``) and
    a rollout loop over them with ``tools`` or an ``environment``; ``max_turns`` None: the rows'
    largest ``max_steps`` (an environment's step limit)."""
    import json

    from easyvlm.agents.loop import MultiTurnRollout
    from easyvlm.agents.render import TurnRenderer
    from easyvlm.agents.settings import AgentSettings
    from easyvlm.data.dataset import RLDataset
    from easyvlm.data.settings import DataConfig

    tokenizer = processor.tokenizer
    cfg = DataConfig(format_prompt=str(prompt_file), prompt_key="problem", min_pixels=None, max_pixels=spec.max_pixels)
    schemas = [tool.schema for tool in (tools or {}).values()]
    dataset = RLDataset(str(data_file), cfg, tokenizer, processor, model_config, tools=schemas)
    rows = [json.loads(line) for line in data_file.read_text().splitlines() if line.strip()]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    turns = max(row["max_steps"] for row in rows) if max_turns is None else max_turns
    loop = MultiTurnRollout(AgentSettings(max_turns=turns, max_tokens_per_turn=None, tool_timeout=30.0),
                            TurnRenderer(dataset.encoder), model_config, [eos], dataset.pad_token_id, length,
                            tools=tools, environment=environment)
    return Episodes(dataset, rows, loop, tokenizer, eos, length)


def episode_labels(out: dict):
    """The rollout loop's output ``out`` as labels: -100 on the prompt and on every token not the model's."""
    import torch

    return torch.cat([torch.full_like(out["prompts"], -100), torch.where(out["response_mask"], out["responses"], -100)], dim=1)


def train_on_episodes(model, optimizer, out: dict) -> float:
    """One supervised step on the rollout loop's output ``out``, the loss on the model's turns only."""
    import torch

    from easyvlm.data.collate import concat_multi_modal_inputs
    from easyvlm.models.position_ids import to_model_layout

    labels = episode_labels(out)
    return train_step(
        model, optimizer, input_ids=out["input_ids"], attention_mask=out["attention_mask"].long(),
        position_ids=to_model_layout(out["position_ids"]), labels=labels,
        **concat_multi_modal_inputs(out["multi_modal_inputs"]),
    )
