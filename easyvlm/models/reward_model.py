"""Scalar reward models: transformers' sequence classification (``num_labels=1``), registered for the VL
families that lack one; workers read each sequence's score at its last attended token (:class:`ScalarHeadModel`).
docs/rewards.md, "Model-based rewards: a trained reward model"."""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

SEQUENCE_CLASSIFICATION_SUFFIX = "ForSequenceClassification"


@functools.cache
def register_sequence_classification() -> tuple[str, ...]:
    """Register a sequence-classification class per VL family transformers has none for; returns those model types."""
    from transformers import AutoConfig, AutoModel, AutoModelForImageTextToText, AutoModelForSequenceClassification
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
    from transformers.modeling_layers import GenericForSequenceClassification
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    from easyvlm.models.position_ids import MROPE_MODEL_TYPES

    registered = []
    for model_type in MROPE_MODEL_TYPES:
        if model_type in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES:
            continue
        try:
            config_class = type(AutoConfig.for_model(model_type))
        except ValueError:  # a family this transformers version does not have
            continue
        base_model = AutoModel._model_mapping[config_class]  # e.g. Qwen2_5_VLModel
        pretrained = next(c for c in base_model.__mro__ if c.__name__.endswith("PreTrainedModel"))
        name = pretrained.__name__.removesuffix("PreTrainedModel") + SEQUENCE_CLASSIFICATION_SUFFIX
        cls = type(name, (GenericForSequenceClassification, pretrained), {"__module__": __name__})
        AutoModelForSequenceClassification.register(config_class, cls, exist_ok=True)
        # the same module layout as the family's generation class (``model`` = the backbone): its
        # checkpoint key renames (older layouts such as ``visual.*``) apply to ours too
        generation_class = AutoModelForImageTextToText._model_mapping[config_class]
        renames = get_checkpoint_conversion_mapping(generation_class.__name__)
        if renames is not None:
            register_checkpoint_conversion_mapping(name, renames, overwrite=True)
        globals()[name] = cls  # picklable and importable by name
        registered.append(model_type)
    return tuple(registered)


class NotARewardModelError(ValueError):
    """A model directory whose config is not a scalar sequence-classification model."""


def is_sequence_classifier(hf_config: Any) -> bool:
    return any(a.endswith(SEQUENCE_CLASSIFICATION_SUFFIX) for a in getattr(hf_config, "architectures", None) or [])


def reward_model_problem(hf_config: Any, where: str) -> str | None:
    """Why the model of ``hf_config`` cannot serve as a reward model, or None: its config must name a
    ``...ForSequenceClassification`` architecture with one label."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if not is_sequence_classifier(hf_config):
        return (f"{where} is not a reward model: its config.json names architectures {architectures}, not a "
                f"...{SEQUENCE_CLASSIFICATION_SUFFIX} (a policy checkpoint has no trained score head); train one "
                "with `python -m easyvlm.rm` (docs/rewards.md) and give its huggingface/ export directory")
    num_labels = getattr(hf_config, "num_labels", 1)
    if num_labels != 1:
        return (f"{where} has a {num_labels}-way classification head (num_labels={num_labels}); a reward model "
                "has one scalar output (num_labels=1)")
    return None


class ScalarHeadModel(nn.Module):
    """A sequence-classification model's ``model`` and ``score`` with a per-token forward
    (``logits`` (B, L, 1), like the critic's); state dict names as in the checkpoint."""

    def __init__(self, sequence_classifier: nn.Module):
        super().__init__()
        prefix = getattr(sequence_classifier, "base_model_prefix", "model")
        self.model = getattr(sequence_classifier, prefix)
        self.score = sequence_classifier.score
        self._config = sequence_classifier.config
        if self.score.out_features != 1:
            raise NotARewardModelError(f"the score head has {self.score.out_features} outputs; a reward model has 1")

    @property
    def config(self) -> Any:
        return self._config

    def forward(self, **inputs: Any) -> Any:
        from transformers.modeling_outputs import TokenClassifierOutput

        hidden = self.model(**inputs).last_hidden_state  # (B, L, H)
        return TokenClassifierOutput(logits=self.score(hidden).clone())  # clone: see ValueHeadModel


def sequence_classification_config(hf_config: Any, pad_token_id: int) -> Any:
    """A copy of ``hf_config`` for a scalar reward model: ``num_labels=1``, the pad id transformers'
    pooling needs (on the text config too), ``architectures`` naming the sequence-classification class."""
    import copy

    from transformers import AutoModelForSequenceClassification

    register_sequence_classification()
    config = copy.deepcopy(hf_config)
    config.num_labels = 1
    config.get_text_config().pad_token_id = pad_token_id  # the config itself for text-only models
    cls = AutoModelForSequenceClassification._model_mapping[type(config)]
    config.architectures = [cls.__name__]
    return config
