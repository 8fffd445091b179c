"""Format prompts, <image> placeholders, system prompt, chat template override."""

from __future__ import annotations

import pytest

from easyvlm.data.prompts import (
    PromptError,
    build_content,
    build_messages,
    render_prompt,
    resolve_chat_template,
)


def test_placeholders_split_in_order():
    assert build_content("a <image> b <image>", 2) == [
        {"type": "text", "text": "a "},
        {"type": "image"},
        {"type": "text", "text": " b "},
        {"type": "image"},
    ]
    # adjacent placeholders: no empty text items between them
    assert build_content("<image><image>x", 2) == [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "x"}]


def test_images_without_placeholders_go_first():
    assert build_content("what?", 2) == [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "what?"}]
    assert build_content("what?", 0) == [{"type": "text", "text": "what?"}]


def test_placeholder_count_mismatch():
    with pytest.raises(PromptError, match=r"2 <image> placeholder\(s\) but the row has 3 image\(s\)"):
        build_content("<image> and <image>", 3)
    with pytest.raises(PromptError, match=r"1 <image> placeholder\(s\) but the row has 0 image\(s\)"):
        build_content("<image>", 0)


def test_videos_and_images_placed_by_their_own_placeholders():
    video, image = {"type": "video"}, {"type": "image"}
    assert build_content("<video> what happens?", 0, 1) == [video, {"type": "text", "text": " what happens?"}]
    assert build_content("a <image> b <video> c <image>", 2, 1) == [
        {"type": "text", "text": "a "}, image, {"type": "text", "text": " b "}, video,
        {"type": "text", "text": " c "}, image,
    ]
    # videos without placeholders go first (after images without placeholders); placed images stay put
    assert build_content("x <image>", 1, 2) == [video, video, {"type": "text", "text": "x "}, image]
    assert build_content("x", 1, 1) == [image, video, {"type": "text", "text": "x"}]
    with pytest.raises(PromptError, match=r"1 <video> placeholder\(s\) but the row has 0 video\(s\)"):
        build_content("<video> what happens?", 0)
    with pytest.raises(PromptError, match=r"2 <video> placeholder\(s\) but the row has 1 video\(s\)"):
        build_content("<video><video>", 0, 1)


def test_format_prompt_sees_content_and_row_fields(tmp_path):
    template = tmp_path / "fmt.jinja"
    template.write_text("{{ content | trim }} Options: {{ options | join(', ') }}. Think first.")
    row = {"problem": "  Which shape?  ", "options": ["circle", "square"], "answer": "circle"}
    assert render_prompt(row["problem"], row, str(template)) == "Which shape? Options: circle, square. Think first."
    assert render_prompt("as is", row, None) == "as is"


def test_format_prompt_undefined_name_is_an_error(tmp_path):
    template = tmp_path / "fmt.jinja"
    template.write_text("{{ content }} {{ hint }}")
    with pytest.raises(PromptError, match=r"uses a name this row does not have \('hint' is undefined\)"):
        render_prompt("q", {"problem": "q"}, str(template))


def test_system_prompt_and_text_only_messages():
    assert build_messages("hi <image>", 1, system_prompt="be brief") == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "image"}]},
    ]
    assert build_messages("hi", 0, multimodal=False) == [{"role": "user", "content": "hi"}]
    with pytest.raises(PromptError, match="no image processor"):
        build_messages("hi <image>", 1, multimodal=False)


def test_override_chat_template_string_or_file(tmp_path):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert resolve_chat_template(template) == template
    path = tmp_path / "chat.jinja"
    path.write_text(template)
    assert resolve_chat_template(str(path)) == template
    assert resolve_chat_template(None) is None
    with pytest.raises(FileNotFoundError, match="neither a Jinja template string nor an existing file"):
        resolve_chat_template(str(tmp_path / "missing.jinja"))
