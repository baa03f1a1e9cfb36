#!/usr/bin/env python3
"""Render chat-template test conversations with transformers and store the expected strings.

The gateway renders chat templates with minijinja; its test
(services/gateway/tests/chat_templates.rs) renders the same conversations and compares byte for
byte with what this script stores in tests/fixtures/chat_templates/expected_renders.json.

Usage (repo root):
    python3 scripts/render_templates.py --out tests/fixtures/chat_templates/expected_renders.json
        # needs transformers (5.17 was used); renders with tokenizer.apply_chat_template
    python3 scripts/render_templates.py --backend jinja2 --out /tmp/renders.json
        # development only: jinja2 configured the way transformers configures it (no transformers)

Templates: every tests/fixtures/chat_templates/*.jinja (byte-identical copies of the chat templates
released with Qwen3.5 / 3.6). Conversations: CASES below.
"""

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
TEMPLATE_DIR = ROOT / "tests" / "fixtures" / "chat_templates"
TOKENIZER_DIR = ROOT / "tests" / "fixtures" / "qwen3_moe"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city. Use <city> & 'country'; returns \"°C\".",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Zürich"},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "units": {"type": "string", "enum": ["metric", "imperial"]},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "number"}}, "required": ["query"]},
    },
}

CASES = [
    {"name": "single_user", "messages": [{"role": "user", "content": "Hello!"}]},
    {
        "name": "system_and_user",
        "messages": [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "What is 2+2?"}],
    },
    {
        "name": "multi_turn",
        "messages": [
            {"role": "system", "content": "  Be brief.  \n"},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another one, please."},
        ],
    },
    {"name": "thinking_off", "messages": [{"role": "user", "content": "Hi"}], "kwargs": {"enable_thinking": False}},
    {"name": "thinking_on", "messages": [{"role": "user", "content": "Hi"}], "kwargs": {"enable_thinking": True}},
    {
        "name": "reasoning_in_history",
        "messages": [
            {"role": "user", "content": "First question"},
            {"role": "assistant", "content": "First answer", "reasoning_content": "\nI should answer plainly.\n"},
            {"role": "user", "content": "Second question"},
            {"role": "assistant", "content": "Second answer", "reasoning_content": "Think again."},
        ],
        "add_generation_prompt": False,
    },
    {
        "name": "inline_think_in_history",
        "messages": [
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "<think>\nhidden reasoning\n</think>\n\nVisible answer"},
            {"role": "user", "content": "Q2"},
        ],
    },
    {
        "name": "preserve_thinking",
        "messages": [
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
            {"role": "user", "content": "Q2"},
        ],
        "kwargs": {"preserve_thinking": True},
    },
    {
        "name": "tools_and_tool_calls",
        "tools": [WEATHER_TOOL, SEARCH_TOOL],
        "messages": [
            {"role": "system", "content": "You can call tools."},
            {"role": "user", "content": "Weather in Zürich for 3 days?"},
            {
                "role": "assistant",
                "content": "Let me check.",
                "reasoning_content": "Need the weather tool.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": {"city": "Zürich", "days": 3, "detailed": True, "extra": {"b": [1, 2.5, None], "a": "x"}, "units": "metric"},
                        },
                    },
                    {"id": "call_2", "type": "function", "function": {"name": "search", "arguments": {"query": "Zürich \"forecast\"", "limit": 2.0}}},
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
            {"role": "tool", "tool_call_id": "call_2", "content": "No results."},
        ],
    },
    {
        "name": "tool_call_without_content",
        "tools": [WEATHER_TOOL],
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "content": "Cold."},
            {"role": "assistant", "content": "It is cold in Oslo."},
            {"role": "user", "content": "Thanks"},
        ],
        "kwargs": {"enable_thinking": False},
    },
    {
        "name": "tools_without_system",
        "tools": [SEARCH_TOOL],
        "messages": [{"role": "user", "content": "Find 'rust' tutorials"}],
    },
    {
        "name": "content_parts_and_unicode",
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Système: réponds en français. 🚀"}]},
            {"role": "user", "content": [{"type": "text", "text": "Line one\n"}, {"type": "text", "text": "Line two <b>&amp;</b> \"quoted\" \\ tab\t"}]},
        ],
    },
    {
        "name": "multi_step_tool_then_generation",
        "tools": [SEARCH_TOOL],
        "messages": [
            {"role": "user", "content": "Search twice"},
            {"role": "assistant", "content": "", "reasoning_content": "first search", "tool_calls": [{"function": {"name": "search", "arguments": {"query": "a"}}}]},
            {"role": "tool", "content": "result a"},
            {"role": "assistant", "content": "", "reasoning_content": "second search", "tool_calls": [{"function": {"name": "search", "arguments": {"query": "b", "limit": 1}}}]},
            {"role": "tool", "content": "result b"},
        ],
    },
    {"name": "error_no_user_query", "messages": [{"role": "system", "content": "Only a system message."}]},
    {
        "name": "error_system_not_first",
        "messages": [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Late system message."}],
    },
]


def make_jinja2_renderer():
    """jinja2 set up as transformers 5 sets it up (chat_template_utils._compile_jinja_template)."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from datetime import datetime

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now

    def render(template_text, case):
        template = env.from_string(template_text)
        return template.render(
            messages=case["messages"],
            tools=case.get("tools"),
            add_generation_prompt=case.get("add_generation_prompt", True),
            **case.get("kwargs", {}),
        )

    return render, {"backend": "jinja2", "jinja2_version": jinja2.__version__}


def make_transformers_renderer():
    import transformers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))

    def render(template_text, case):
        return tokenizer.apply_chat_template(
            case["messages"],
            tools=case.get("tools"),
            chat_template=template_text,
            tokenize=False,
            add_generation_prompt=case.get("add_generation_prompt", True),
            **case.get("kwargs", {}),
        )

    import jinja2

    return render, {"backend": "transformers", "transformers_version": transformers.__version__, "jinja2_version": jinja2.__version__}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--backend", choices=["transformers", "jinja2"], default="transformers")
    args = parser.parse_args()
    render, provenance = make_transformers_renderer() if args.backend == "transformers" else make_jinja2_renderer()
    templates = sorted(TEMPLATE_DIR.glob("*.jinja"))
    results = []
    for template_path in templates:
        template_text = template_path.read_text(encoding="utf-8")
        for case in CASES:
            entry = {"template": template_path.name, "case": case["name"]}
            try:
                entry["expected"] = render(template_text, case)
            except Exception as error:  # the template's raise_exception: record the message
                entry["error"] = str(error)
            results.append(entry)
    output = {"provenance": {**provenance, "python": sys.version.split()[0], "tokenizer_dir": str(TOKENIZER_DIR.relative_to(ROOT))},
              "cases": CASES, "renders": results}
    pathlib.Path(args.out).write_text(json.dumps(output, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"{len(results)} renders ({sum('error' in r for r in results)} errors) -> {args.out}")


if __name__ == "__main__":
    main()
