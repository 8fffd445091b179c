"""The model's tool calls in the Hermes format (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``),
parsed forgiving about layout and strict about content: an unreadable call becomes a :class:`ToolCall`
with ``error`` set, which the model is told."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CALL_CLOSE) + r"|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Any = field(default_factory=dict)
    error: str | None = None  # why the call could not be read (the model gets this as the tool's answer)
    text: str = ""  # the call as the model wrote it, between the tags


def tool_call_format(chat_template: str | None) -> str | None:
    """"hermes" when the template writes ``<tool_call>`` tags, else None (the run is refused)."""
    return "hermes" if chat_template and TOOL_CALL_OPEN in chat_template else None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>...</tool_call>`` in one turn's text, in order; an unclosed last call is read
    too (the turn may have hit its token budget right after it)."""
    calls = []
    for match in _CALL_RE.finditer(text):
        body = match.group(1).strip()
        try:
            value = json.loads(body)
        except json.JSONDecodeError as err:
            calls.append(ToolCall(name="", error=f"the tool call is not valid JSON ({err.msg} at character {err.pos})", text=body))
            continue
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            calls.append(ToolCall(name="", error='a tool call must be a JSON object {"name": ..., "arguments": {...}}', text=body))
            continue
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        calls.append(ToolCall(name=value["name"], arguments=arguments, text=body))
    return calls
