"""The demo's warm start: same prompt as the RL run, format targets only."""

from pathlib import Path

from easyvlm.builtin.warm_start import SYNTHETIC_FORMAT_PROMPT, WARM_STARTS, WarmStartSpec, warm_start_key

REPO = Path(__file__).resolve().parents[2]


def test_warm_start_prompt_is_the_demo_format_prompt():
    # the warm start must see the tokens RL sees: same template text as format_prompts/synthetic.jinja
    assert (REPO / "format_prompts" / "synthetic.jinja").read_text().strip() == SYNTHETIC_FORMAT_PROMPT


def test_cache_key_changes_with_the_recipe():
    spec = WARM_STARTS["tiny-qwen2.5-vl-synthetic"]
    other = WarmStartSpec(spec.base, spec.dataset, spec.steps + 1, spec.batch_size, spec.lr, spec.answer_rate)
    assert warm_start_key(spec, "base1") != warm_start_key(other, "base1")
    assert warm_start_key(spec, "base1") == warm_start_key(WarmStartSpec(**vars(spec)), "base1")
    assert warm_start_key(spec, "base1") != warm_start_key(spec, "base2")  # a rebuilt base model rebuilds it


def test_zoom_warm_start_prompt_is_the_tools_demo_format_prompt():
    from easyvlm.builtin.warm_start import ZOOM_FORMAT_PROMPT

    assert (REPO / "format_prompts" / "zoom.jinja").read_text().strip() == ZOOM_FORMAT_PROMPT


def test_the_zoom_warm_start_trains_on_the_rl_loops_trajectories(tmp_path):
    """Two steps of the tools recipe: the trajectories come from the multi-turn loop with the turns
    given (the build asserts every one called the tool and answered), and a loadable model comes out."""
    import dataclasses

    import torch
    from transformers import AutoModelForImageTextToText

    from easyvlm.builtin.models import materialize_model
    from easyvlm.builtin.warm_start import build_warm_start

    spec = dataclasses.replace(WARM_STARTS["tiny-qwen2.5-vl-zoom"], steps=2, batch_size=2)
    lines = []
    build_warm_start(spec, materialize_model(spec.base), tmp_path / "model", log=lines.append)
    assert lines[0].startswith("easyvlm: warm start 1/2: loss ") and lines[-1].startswith("easyvlm: warm start 2/2: loss ")
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "model", dtype=torch.float32)
    assert (tmp_path / "model" / "format_prompt.jinja").read_text().strip() == (REPO / "format_prompts" / "zoom.jinja").read_text().strip()
    assert model.config.image_token_id is not None
