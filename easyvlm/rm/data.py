"""Preference pairs ``{prompt, images, chosen, rejected[, margin]}``, read and checked as RL prompts are, collated
into the workers' Batch layout: a pair is two consecutive rows of one prompt, so shared-prompt forwards run it once."""

from __future__ import annotations

import math
from typing import Any

import torch

from easyvlm.data.settings import DataConfig
from easyvlm.data.batch import Batch
from easyvlm.data.collate import collate_prompts
from easyvlm.data.dataset import RLDataset, RowError
from easyvlm.rm.config import PreferenceDataConfig
from easyvlm.rollout.postprocess import build_rollout_batch


def prompt_data_config(d: PreferenceDataConfig) -> DataConfig:
    """The RL data settings that encode a pair's prompt (the chosen column stands in for the answer column)."""
    return DataConfig(
        prompt_key=d.prompt_key, answer_key=d.chosen_key, image_key=d.image_key, image_dir=d.image_dir,
        max_prompt_length=d.max_prompt_length, max_response_length=d.max_response_length,
        format_prompt=d.format_prompt, system_prompt=d.system_prompt, min_pixels=d.min_pixels,
        max_pixels=d.max_pixels, filter_overlong_prompts=d.filter_overlong_prompts,
        filter_overlong_prompts_workers=1, on_bad_row=d.on_bad_row,
    )


class PreferenceDataset(RLDataset):
    """``dataset[i]``: RLDataset's prompt sample plus ``chosen_ids`` / ``rejected_ids`` (each ending with
    the end-of-turn token unless cut at max_response_length) and ``margin`` (float)."""

    def __init__(self, files: str, config: PreferenceDataConfig, tokenizer: Any, processor: Any, model_config: Any,
                 end_of_turn_id: int, key: str = "data.train_files", name: str = "train"):
        self.pairs = config
        self.end_of_turn_id = end_of_turn_id
        super().__init__(files, prompt_data_config(config), tokenizer, processor, model_config, key=key, name=name)

    def _check_row(self, job: tuple[int, int]) -> tuple[str, str | None]:
        source_id, row_id = job
        try:
            self._responses(dict(self.sources[source_id].rows[row_id]))
        except RowError as err:
            return "bad", str(err)
        return super()._check_row(job)

    def _responses(self, row: dict) -> tuple[list[int], list[int], float]:
        d = self.pairs
        ids = []
        for key in (d.chosen_key, d.rejected_key):
            text = row.get(key)
            if not isinstance(text, str):
                got = "missing" if key not in row else f"a {type(text).__name__}"
                raise RowError(f"the response column {key!r} is {got}; a preference row needs the strings "
                               f"{d.chosen_key!r} and {d.rejected_key!r} (the row has {sorted(row)})")
            tokens = self.encoder.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.end_of_turn_id]
            ids.append(tokens[: d.max_response_length])
        margin = 0.0
        if d.margin_key is not None:
            value = row.get(d.margin_key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise RowError(f"the margin column {d.margin_key!r} (data.margin_key) must be a number >= 0, got {value!r}")
            margin = float(value)
        return ids[0], ids[1], margin

    def __getitem__(self, i: int) -> dict[str, Any]:
        sample = super().__getitem__(i)
        source_id, row_id, _ = self.index[i]
        sample["chosen_ids"], sample["rejected_ids"], sample["margin"] = self._responses(dict(self.sources[source_id].rows[row_id]))
        return sample


def collate_pairs(samples: list[dict[str, Any]], pad_token_id: int, response_length: int) -> Batch:
    """N pairs -> a Batch of 2N rows (row 2i chosen, 2i + 1 rejected): ``input_ids``, ``attention_mask``,
    ``position_ids`` over prompt + response, ``responses``, ``response_mask``, ``multi_modal_inputs``
    and a (2N,) ``margin``."""
    doubled = [s for s in samples for _ in range(2)]
    prompts = collate_prompts(doubled, pad_token_id)
    responses = [r for s in samples for r in (s["chosen_ids"], s["rejected_ids"])]
    length = min(response_length, max(len(r) for r in responses))
    # no EOS id here: every token of a response is real (the end-of-turn token is its last one)
    batch = build_rollout_batch(prompts, responses, [[0.0] * len(r) for r in responses], length, pad_token_id, ())
    batch["margin"] = torch.tensor([s["margin"] for s in doubled], dtype=torch.float32)
    return batch
