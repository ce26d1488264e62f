"""How tools and tool history reach the prompt: a template with its own tools section (Qwen 2.5's, Hermes format)
renders them itself; one without (the embedded SmolLM2's) gets them from server/tools.py. Rendered through
transformers' own apply_chat_template, with no server."""

import json
from pathlib import Path
from typing import Any

from model.tokenizer import Tokenizer
from server.tools import FORMATS, template_messages, tool_setup

QWEN = (Path(__file__).parent / "templates" / "qwen2_5_tools.jinja").read_text()
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "content": '{"celsius": 18}', "tool_call_id": "call_1"},
]


def render(tokenizer: Tokenizer, template: str | None) -> str:
    setup = tool_setup(template or tokenizer.hf.chat_template, "auto")
    messages, kwargs = template_messages(HISTORY, TOOLS, setup)
    text: str = tokenizer.hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, chat_template=template, **kwargs
    )
    return text


def test_a_template_with_a_tools_section_renders_them_itself(default_tokenizer: Tokenizer) -> None:
    setup = tool_setup(QWEN, "auto")
    assert setup.template_renders_tools and setup.format is FORMATS["hermes"]
    text = render(default_tokenizer, QWEN)
    assert json.dumps(TOOLS[0], ensure_ascii=False) in text  # the template's own tojson of the definition
    # arguments reach the template as an object, so its tojson writes them once, not as an escaped string
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<|im_start|>user\n<tool_response>\n{"celsius": 18}\n</tool_response><|im_end|>' in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_template_without_tools_gets_them_in_the_system_message(default_tokenizer: Tokenizer) -> None:
    setup = tool_setup(default_tokenizer.hf.chat_template, "auto")
    assert not setup.template_renders_tools and setup.format is FORMATS["hermes"]
    text = render(default_tokenizer, None)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n# Tools") and '"name": "get_weather"' in system
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in system
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        in text
    )
    assert '<|im_start|>user\n<tool_response>\n{"celsius": 18}\n</tool_response><|im_end|>' in text


def test_format_detection_and_override() -> None:
    assert (
        tool_setup("{{ '<|python_tag|>' }}{% for t in tools %}{% endfor %}{{ tool_calls }}", "auto").format.name
        == "llama3_json"
    )
    assert (
        tool_setup("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]{{ tool_calls }}", "auto").format.name
        == "mistral"
    )
    assert tool_setup("plain", "auto").format.name == "hermes"
    assert tool_setup("plain", "mistral").format.name == "mistral"
