"""The demo's distillation teacher (builtin:tiny-qwen2.5-vl-teacher) can score the student's samples:
same tokenizer and processor as the student, a larger model, trained on the demo's own task.

The teacher's warm start takes minutes, so these tests build only the two bases (a second or two
each): a warm start saves its base's tokenizer and processor unchanged (easyvlm.builtin.warm_start._save).
"""

from pathlib import Path

import pytest
import yaml

from easyvlm.builtin.models import BUILTIN_MODELS, materialize_model, spec_key
from easyvlm.builtin.warm_start import WARM_STARTS

REPO = Path(__file__).resolve().parents[2]
TEACHER, STUDENT = WARM_STARTS["tiny-qwen2.5-vl-teacher"], WARM_STARTS["tiny-qwen2.5-vl-synthetic"]


@pytest.fixture(scope="module")
def processors(easyvlm_cache_dir):
    from transformers import AutoConfig, AutoProcessor

    dirs = [materialize_model(warm.base, cache_dir=easyvlm_cache_dir) for warm in (TEACHER, STUDENT)]
    return [(AutoProcessor.from_pretrained(d), AutoConfig.from_pretrained(d)) for d in dirs]


def test_teacher_shares_the_students_tokenizer_and_processor(processors):
    (teacher, teacher_config), (student, student_config) = processors
    # token ids: the teacher's log-probs are read at the student's sampled ids
    assert teacher.tokenizer.get_vocab() == student.tokenizer.get_vocab()
    assert teacher.tokenizer.chat_template == student.tokenizer.chat_template
    assert teacher_config.text_config.vocab_size == student_config.text_config.vocab_size
    # images: the same prompt gives the same patches, image tokens and mRoPE positions in both models
    # (patch, temporal patch and merge sizes, pixel limits, normalisation)
    assert teacher.image_processor.to_dict() == student.image_processor.to_dict()
    assert teacher.video_processor.to_dict() == student.video_processor.to_dict()
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        assert getattr(teacher_config, key) == getattr(student_config, key), key
    assert teacher_config.vision_config.spatial_merge_size == student_config.vision_config.spatial_merge_size


def test_teacher_is_larger_and_trained_on_the_demo_task():
    teacher, student = BUILTIN_MODELS[TEACHER.base], BUILTIN_MODELS[STUDENT.base]
    assert spec_key(teacher) != spec_key(student)
    assert teacher.hidden_size > student.hidden_size and teacher.num_hidden_layers > student.num_hidden_layers
    assert teacher.vision_hidden_size > student.vision_hidden_size
    # true answers of the demo's training set (examples/config.yaml's data.train_files)
    train_files = yaml.safe_load((REPO / "examples" / "config.yaml").read_text())["data"]["train_files"]
    assert train_files == f"builtin:{TEACHER.dataset}@train" and TEACHER.answer_rate == 1.0
