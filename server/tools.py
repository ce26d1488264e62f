"""Tool calling: which call format the model writes, the tool definitions in the prompt where the chat template has
no tools section, the structural tag that constrains calls, and the parser that turns the generated text back into
OpenAI tool calls, streamed or whole.

A call is `begin(name) + arguments JSON + end`, e.g. Hermes `<tool_call>\\n{"name": "f", "arguments": {...}}\\n
</tool_call>`. Under tool_choice "required" or a named function the whole output is calls; under "auto" free text
may come first and a call is constrained from its trigger (`<tool_call>`) on, so a started call always completes
with arguments that validate against the function's parameters.
"""

import functools
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True, slots=True)
class ToolCallFormat:
    name: str
    trigger: str  # the text that starts a call
    prefix: str  # begin = prefix + function name + infix
    infix: str
    end: str
    separator: str  # between calls when the output is only calls

    def begin(self, function: str) -> str:
        return self.prefix + function + self.infix

    def call_text(self, function: str, arguments: str) -> str:
        return self.begin(function) + arguments + self.end


FORMATS = {
    # Hermes / Qwen 2.5+ / NousResearch: the default where a template declares nothing
    "hermes": ToolCallFormat(
        "hermes", "<tool_call>", '<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>", "\n"
    ),
    # Llama 3.1-3.3 JSON tool calls
    "llama3_json": ToolCallFormat("llama3_json", '{"name": ', '{"name": "', '", "parameters": ', "}", "; "),
    # Mistral v3+ ([TOOL_CALLS] then a JSON list)
    "mistral": ToolCallFormat("mistral", "[TOOL_CALLS]", '[TOOL_CALLS][{"name": "', '", "arguments": ', "}]", ""),
}


@dataclass(frozen=True, slots=True)
class ToolSetup:
    format: ToolCallFormat
    template_renders_tools: bool  # the chat template has a tools section: it gets `tools=` and the history as is


@functools.lru_cache(maxsize=8)
def tool_setup(chat_template: str | None, parser: str) -> ToolSetup:
    template = chat_template or ""
    renders = "tools" in template and "tool_calls" in template
    if parser != "auto":
        return ToolSetup(FORMATS[parser], renders)
    if "[TOOL_CALLS]" in template:
        return ToolSetup(FORMATS["mistral"], renders)
    if "<|python_tag|>" in template or ('"parameters"' in template and "<|eot_id|>" in template):
        return ToolSetup(FORMATS["llama3_json"], renders)
    return ToolSetup(FORMATS["hermes"], renders and "<tool_call>" in template)


def function_parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def structural_tag(tools: list[dict[str, Any]], choice: str, parallel: bool, fmt: ToolCallFormat) -> str:
    """The xgrammar structural tag (JSON) for tool_choice "auto", "required" or one function's name."""
    # imported here: xgrammar takes ~0.8 s to import, which a start that answers before any tool call need not pay
    from xgrammar.structural_tag import (
        JSONSchemaFormat,
        StructuralTag,
        TagFormat,
        TagsWithSeparatorFormat,
        TriggeredTagsFormat,
    )

    chosen = [t for t in tools if choice in ("auto", "required") or t["function"]["name"] == choice]
    tags = [
        TagFormat(
            begin=fmt.begin(t["function"]["name"]),
            content=JSONSchemaFormat(json_schema=function_parameters(t)),
            end=fmt.end,
        )
        for t in chosen
    ]
    if choice == "auto":
        body: Any = TriggeredTagsFormat(triggers=[fmt.trigger], tags=tags, stop_after_first=not parallel)
    else:  # nothing but calls: at least one, one only for a named function
        body = TagsWithSeparatorFormat(
            tags=tags, separator=fmt.separator, at_least_one=True, stop_after_first=not parallel or choice != "required"
        )
    return StructuralTag(format=body).model_dump_json()


def tools_prompt(tools: list[dict[str, Any]], fmt: ToolCallFormat) -> str:
    """Tool definitions and the call format for a template without a tools section (Hermes' wording)."""
    signatures = "\n".join(
        json.dumps({"type": "function", "function": t["function"]}, ensure_ascii=False) for t in tools
    )
    example = fmt.call_text("<function-name>", "<args-json-object>").replace('"<function-name>"', "<function-name>")
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{signatures}\n</tools>\n\n"
        f"For each function call, return a json object with function name and arguments like this:\n{example}"
    )


def template_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, setup: ToolSetup
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Messages (OpenAI shape, tool_calls' arguments as JSON strings) and extra template arguments.

    A template with a tools section gets `tools=` and calls with arguments as objects, as Hugging Face templates
    expect. Otherwise the definitions go into the system message, past calls become their text in the call format
    and tool results become user turns in <tool_response> tags."""
    if setup.template_renders_tools:
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [
                    {**c, "function": {**c["function"], "arguments": _as_object(c["function"]["arguments"])}}
                    for c in m["tool_calls"]
                ]
            out.append(m)
        return out, ({"tools": tools} if tools else {})
    fmt = setup.format
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        elif m.get("tool_calls"):
            calls = fmt.separator.join(
                fmt.call_text(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]
            )
            out.append({"role": "assistant", "content": ((m.get("content") or "") + calls)})
        else:
            out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")})
    if tools:
        prompt = tools_prompt(tools, fmt)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def _as_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except (TypeError, ValueError):
        return arguments


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(slots=True)
class ToolCallDelta:
    """One piece of a streamed call: the first carries id and name, the rest pieces of the arguments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass(slots=True)
class ParsedCall:
    id: str
    name: str
    arguments: str = ""


@dataclass
class ToolCallParser:
    """Splits generated text into content and tool calls as it streams. Text that may be the start of a call is held
    back until it is known, so no part of a call shows up as content; the arguments' pieces concatenate to exactly
    the arguments of the whole call."""

    format: ToolCallFormat
    calls: list[ParsedCall] = field(default_factory=list)
    _buffer: str = ""
    _state: str = "text"  # text -> header -> arguments -> text ...
    _emitted: int = 0  # characters of the current call's arguments already sent
    _header: re.Pattern[str] = field(init=False)

    def __post_init__(self) -> None:
        self._header = re.compile(
            re.escape(self.format.prefix) + r"([A-Za-z0-9_-]{1,64})" + re.escape(self.format.infix)
        )

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buffer += text
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        progressed = True
        while progressed:
            progressed = self._step(content, deltas, final=False)
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """At the end of generation: held-back text is content; a call cut short keeps the arguments it has."""
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while self._step(content, deltas, final=True):
            pass
        if self._state == "arguments" and len(self._buffer) > self._emitted:
            deltas.append(ToolCallDelta(len(self.calls) - 1, self._buffer[self._emitted :]))
            self.calls[-1].arguments += self._buffer[self._emitted :]
        elif self._state == "text":
            self._emit_text(self._buffer, content)
        self._buffer, self._emitted = "", 0  # a half-written call header is dropped, never shown as text
        return "".join(content), deltas

    def _step(self, content: list[str], deltas: list[ToolCallDelta], final: bool) -> bool:
        fmt = self.format
        if self._state == "text":
            at = self._buffer.find(fmt.trigger)
            if at >= 0:
                self._emit_text(self._buffer[:at], content)
                self._buffer, self._state = self._buffer[at:], "header"
                return True
            if not final:
                keep = _held_back(self._buffer, fmt.trigger)
                head = self._buffer[: len(self._buffer) - keep].strip()
                if self.calls and fmt.separator.strip().startswith(head):
                    return False  # a separator between calls, or whitespace: content only if real text follows
                self._emit_text(self._buffer[: len(self._buffer) - keep], content)
                self._buffer = self._buffer[len(self._buffer) - keep :]
            return False
        if self._state == "header":
            match = self._header.match(self._buffer)
            if match is None:
                if len(self._buffer) > len(fmt.prefix) + 64 + len(fmt.infix):  # not a call after all (unconstrained)
                    self._state = "text"
                    content.append(self._buffer[: len(fmt.trigger)])
                    self._buffer = self._buffer[len(fmt.trigger) :]
                    return True
                return False
            call = ParsedCall(new_call_id(), match.group(1))
            self.calls.append(call)
            deltas.append(ToolCallDelta(len(self.calls) - 1, "", call.id, call.name))
            self._buffer, self._state, self._emitted = self._buffer[match.end() :], "arguments", 0
            return True
        # arguments: complete once they parse as JSON and the end marker follows
        end = _json_end(self._buffer)
        if end is not None and self._buffer[end:].startswith(fmt.end):
            self._send_arguments(end, deltas)
            self._buffer, self._state = self._buffer[end + len(fmt.end) :], "text"
            return True
        if not final:
            self._send_arguments(len(self._buffer) - _held_back(self._buffer, fmt.end), deltas)
        return False

    def _send_arguments(self, upto: int, deltas: list[ToolCallDelta]) -> None:
        if upto > self._emitted:
            piece = self._buffer[self._emitted : upto]
            self.calls[-1].arguments += piece
            deltas.append(ToolCallDelta(len(self.calls) - 1, piece))
            self._emitted = upto

    def _emit_text(self, text: str, content: list[str]) -> None:
        if text and not (self.calls and text.strip() in ("", self.format.separator.strip())):
            content.append(text)


def _held_back(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker` (it may still become the marker)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


_DECODER = json.JSONDecoder()


def _json_end(text: str) -> int | None:
    start = len(text) - len(text.lstrip())
    try:
        _, end = _DECODER.raw_decode(text, start)
    except ValueError:
        return None
    return end
