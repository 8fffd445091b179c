"""Tools: schemas from Python functions, calls that never crash the run, the shipped tools, parsing."""

from __future__ import annotations

import time

import pytest
from PIL import Image

from easyvlm.agents.parse import parse_tool_calls, tool_call_format
from easyvlm.agents.shipped import calculator, image_zoom
from easyvlm.agents.tools import ToolError, call_tool, load_tool, load_tools, tool_schema


def lookup(city: str, days: int = 1, images: list = (), row: dict | None = None) -> str:
    """Look up the weather.

    Args:
        city: The city's name.
        days: How many days ahead.
    """
    return f"{city}:{days}:{len(images)}:{(row or {}).get('id')}"


def test_schema_hides_the_reserved_parameters():
    schema, reserved = tool_schema(lookup)
    assert reserved == ("images", "row")
    assert schema == {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up the weather.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "The city's name."},
                    "days": {"type": "integer", "description": "How many days ahead."},
                },
                "required": ["city"],
            },
        },
    }


def test_a_tool_without_docstring_or_hint_is_refused_with_its_name(tmp_path):
    def undocumented(x: int) -> int:
        return x

    with pytest.raises(ToolError, match="tool 'undocumented'.*docstring"):
        tool_schema(undocumented)
    file = tmp_path / "mytools.py"
    file.write_text("def f(x):\n    '''Do.\n\n    Args:\n        x: a value\n    '''\n    return x\n")
    with pytest.raises(ToolError, match="tool 'f'.*type hint"):
        load_tool(f"{file}:f")
    with pytest.raises(ToolError, match="has no function 'g'"):
        load_tool(f"{file}:g")
    with pytest.raises(ToolError, match="neither a shipped tool"):
        load_tool("image_zoomer")
    with pytest.raises(ToolError, match="two tools are named 'calculator'"):
        load_tools(["calculator", "calculator"])


def test_every_shipped_tool_name_loads_its_function():
    # the config accepts the names of easyvlm.config.names.SHIPPED_TOOLS; each must load
    from easyvlm.config.names import SHIPPED_TOOLS

    assert {name: load_tool(name).function for name in SHIPPED_TOOLS} == {"image_zoom": image_zoom, "calculator": calculator}


def _tool(function):
    schema, reserved = tool_schema(function)
    from easyvlm.agents.tools import Tool

    return Tool(function.__name__, function, schema, reserved, function.__name__)


def test_call_fills_reserved_parameters_and_checks_arguments():
    tool = _tool(lookup)
    context = {"images": [1, 2], "original_images": [], "row": {"id": 7}}
    assert call_tool(tool, {"city": "Oslo", "days": 3}, context, 5).text == "Oslo:3:2:7"
    assert call_tool(tool, {"days": 3}, context, 5).error == "lookup needs the argument(s) city"
    assert call_tool(tool, {"city": "Oslo", "weeks": 1}, context, 5).error == "lookup has no parameter weeks"
    assert call_tool(tool, ["Oslo"], context, 5).error == 'the arguments of lookup must be a JSON object, got ["Oslo"]'
    # the model cannot set a reserved parameter itself
    assert call_tool(tool, {"city": "Oslo", "row": {"id": 1}}, context, 5).error == "lookup has no parameter row"


def raises(x: int) -> str:
    """Fail.

    Args:
        x: anything
    """
    raise KeyError(x)


def hangs(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "woke"


def garbage(x: int) -> dict:
    """Return a dict.

    Args:
        x: anything
    """
    return {"x": x}


def test_raising_hanging_and_garbage_tools_become_errors_the_model_reads():
    assert call_tool(_tool(raises), {"x": 3}, {}, 5).error == "raises failed: KeyError: 3"
    result = call_tool(_tool(hangs), {"seconds": 30}, {}, 0.2)
    assert result.error == "hangs timed out after 0.2 s" and not result.ok
    assert call_tool(_tool(hangs), {"seconds": 0}, {}, 5).text == "woke"
    assert call_tool(_tool(garbage), {"x": 1}, {}, 5).error == (
        "tool garbage returned a dict; a tool returns text, images or a list of them"
    )


def test_calculator():
    assert calculator("(3 + 4) * 2") == "14"
    assert calculator("7 / 2") == "3.5"
    assert calculator("2 ** 10 - 1") == "1023"
    with pytest.raises(ValueError, match="only numbers"):
        calculator("__import__('os')")
    with pytest.raises(ValueError, match="exponents above 100"):
        calculator("9 ** 9 ** 9")
    result = call_tool(load_tool("calculator"), {"expression": "1 / 0"}, {}, 5)
    assert result.error == "calculator failed: ZeroDivisionError: division by zero"


def test_image_zoom_crops_the_full_resolution_original():
    # original 400x200: left half red, right half blue, with a 20x20 green square at (300..320, 40..60)
    original = Image.new("RGB", (400, 200), (255, 0, 0))
    original.paste((0, 0, 255), (200, 0, 400, 200))
    original.paste((0, 255, 0), (300, 40, 320, 60))
    seen = original.resize((100, 50))  # what the model saw: 4x smaller, the square is 5x5 there
    out = image_zoom([75, 10, 80, 15], images=[seen], original_images=[original])
    # the box maps to original pixels (300, 40, 320, 60): all green, enlarged to the seen area
    # (100 * 50 = 5000 px: a square of sqrt(5000) ~ 71 px)
    assert out.size == (71, 71)
    assert out.getpixel((35, 35)) == (0, 255, 0) and out.getpixel((2, 2)) == (0, 255, 0)
    # a tool image has no original: cropped as it is
    tool_image = Image.new("RGB", (20, 10), (9, 9, 9))
    assert image_zoom([0, 0, 10, 10], image_index=1, images=[seen, tool_image], original_images=[original]).getpixel((0, 0)) == (9, 9, 9)
    with pytest.raises(ValueError, match="holds no pixel"):
        image_zoom([120, 0, 130, 10], images=[seen], original_images=[original])
    with pytest.raises(ValueError, match="image_index must be an integer from 0 to 0"):
        image_zoom([0, 0, 5, 5], image_index=2, images=[seen])


def test_parse_tool_calls():
    assert tool_call_format("... <tool_call> ...") == "hermes" and tool_call_format("{{ messages }}") is None
    text = 'Look. <tool_call>\n{"name": "image_zoom", "arguments": {"box": [1, 2, 3, 4]}}\n</tool_call>' \
           '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>'
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("image_zoom", {"box": [1, 2, 3, 4]}, None),
        ("calculator", {"expression": "1+1"}, None),  # arguments written as a JSON string
    ]
    assert parse_tool_calls("The answer is red.") == []
    bad = parse_tool_calls('<tool_call>{"name": "zoom", </tool_call><tool_call>[1]</tool_call><tool_call>{"name": "x"}')
    assert [c.error for c in bad] == [
        "the tool call is not valid JSON (Expecting property name enclosed in double quotes at character 16)",
        'a tool call must be a JSON object {"name": ..., "arguments": {...}}',
        None,  # unclosed but complete: read
    ]
    assert bad[2].name == "x" and bad[2].arguments == {}
