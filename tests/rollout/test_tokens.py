"""Blocked ids (vision placeholders, padded LM-head rows) and EOS ids, read from tokenizer + config."""

from __future__ import annotations

import pytest
from transformers import AutoConfig, AutoTokenizer

from easyvlm.rollout.tokens import blocked_token_ids, eos_token_ids


@pytest.fixture(scope="module")
def tokenizer_and_config(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path), AutoConfig.from_pretrained(tiny_model_path)


def test_blocked_ids_are_the_vision_tokens(tokenizer_and_config):
    tokenizer, config = tokenizer_and_config
    vision = ["<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
    expected = sorted(tokenizer.convert_tokens_to_ids(vision))
    # the config names the same ids the tokenizer does
    assert {config.image_token_id, config.video_token_id, config.vision_start_token_id} <= set(expected)
    # the built-in model's LM head has exactly len(tokenizer) rows: nothing else is blocked
    assert config.text_config.vocab_size == len(tokenizer)
    assert blocked_token_ids(tokenizer, config) == expected


def test_blocked_ids_include_padded_lm_head_rows(tokenizer_and_config):
    tokenizer, config = tokenizer_and_config
    padded = AutoConfig.from_pretrained(config._name_or_path, text_config={"vocab_size": len(tokenizer) + 3})
    blocked = blocked_token_ids(tokenizer, padded)
    n = len(tokenizer)
    assert blocked[-3:] == [n, n + 1, n + 2]
    assert blocked[:-3] == blocked_token_ids(tokenizer, config)


def test_a_tokenizer_of_another_model_is_refused(tokenizer_and_config, tmp_path):
    _, config = tokenizer_and_config
    config.save_pretrained(tmp_path)
    empty = AutoTokenizer.from_pretrained(tmp_path)  # transformers 5: no tokenizer files -> 1 token, no error
    assert len(empty) == 1
    with pytest.raises(ValueError, match="tokenizer has 1 tokens but the model's LM head has"):
        blocked_token_ids(empty, config)


def test_the_plan_names_the_key_of_a_tokenizer_that_does_not_fit(tiny_model_path, tmp_path):
    """Where a user meets the check above: the driver builds the plan (every role's ids) before Ray
    starts, and reports the tokenizer that does not fit the model as a config error of its key."""
    from plan_testing import plan_for

    from easyvlm.config.errors import ConfigError

    AutoConfig.from_pretrained(tiny_model_path).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tmp_path).save_pretrained(tmp_path)  # transformers 5: an empty tokenizer
    with pytest.raises(ConfigError) as err:
        plan_for(tiny_model_path, "worker.rollout.n=2", f"worker.actor.model.tokenizer_path={tmp_path}")
    [problem] = err.value.problems
    assert problem.key == "worker.actor.model.tokenizer_path"
    assert "tokenizer has 1 tokens but the model's LM head has 264 rows: it is not this model's tokenizer" in problem.message


def test_eos_needs_some_source():
    class NoEos:
        eos_token_id = None

    with pytest.raises(ValueError, match="no EOS token"):
        eos_token_ids(NoEos(), None)
