#!/usr/bin/env python3
"""Smoke test of a running NInfer gateway with the official `openai` and `anthropic` SDKs.

    python3 scripts/sdk_smoke.py --base-url http://127.0.0.1:8080 [--api-key KEY] [--model NAME]
        [--reference tests/fixtures/qwen3_moe/reference.json]

Checks chat and completions (streaming and not), usage counts, stop strings, `n`, Anthropic
messages (streaming event order, thinking blocks when present, stop_sequences, count_tokens) and
error types. Everything is greedy (temperature 0) so streamed and unstreamed answers must agree.
With --reference, a raw greedy completion of the fixture's plain prompt must equal the
fixture's reference greedy text. Works against the gateway + test engine
(services/gateway/tests/sdk_smoke.rs) and against the real stack.

Ends with the line `N passed, M failed` and exits 1 on any failure.
"""

import argparse
import json
import re
import sys
import traceback
import urllib.request

import anthropic
import openai

RESULTS = []
# Recent anthropic SDKs no longer take `temperature` as an argument; the gateway still reads it.
AN_GREEDY = {"temperature": 0.0}
# A 1x1 RGB PNG, base64.
PIXEL_PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGM4wcUFAAJ6AN1nJ0J9AAAAAElFTkSuQmCC"


def check(name):
    def wrap(function):
        def run(*args):
            try:
                detail = function(*args)
                RESULTS.append((name, True, detail or ""))
                print(f"PASS {name} {detail or ''}")
            except Exception as error:  # report and go on with the other checks
                RESULTS.append((name, False, repr(error)))
                print(f"FAIL {name}: {error!r}")
                traceback.print_exc()

        return run

    return wrap


def http_json(base_url, path, body, api_key):
    request = urllib.request.Request(base_url + path, data=json.dumps(body).encode(), headers={"content-type": "application/json", "authorization": f"Bearer {api_key}"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


WEATHER_OPENAI = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
WEATHER_ANTHROPIC = [{"name": "get_weather", "description": "Weather of a city", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


def tool_call_checks(oa, an, model):
    """Against a server whose every answer is one get_weather(city=Paris) call: a call cut by
    max_tokens is reported as cut (`length` / `max_tokens`), with no half call in the text; a
    whole call is a call."""
    ask = [{"role": "user", "content": "Weather in Paris?"}]

    @check("openai: a tool call cut by max_tokens is length, not a call, not text")
    def openai_cut():
        cut = oa.chat.completions.create(model=model, messages=ask, tools=WEATHER_OPENAI, max_tokens=6, temperature=0.0)
        choice = cut.choices[0]
        assert choice.finish_reason == "length", choice.finish_reason
        assert not choice.message.tool_calls, choice.message.tool_calls
        assert "<tool_call" not in (choice.message.content or ""), choice.message.content
        stream = oa.chat.completions.create(model=model, messages=ask, tools=WEATHER_OPENAI, max_tokens=6, temperature=0.0, stream=True)
        content, calls, finish = "", [], None
        for chunk in stream:
            for streamed in chunk.choices:
                content += streamed.delta.content or ""
                calls += streamed.delta.tool_calls or []
                finish = streamed.finish_reason or finish
        assert finish == "length" and not calls and "<tool_call" not in content, (finish, calls, content)
        whole = oa.chat.completions.create(model=model, messages=ask, tools=WEATHER_OPENAI, max_tokens=200, temperature=0.0)
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls", choice.finish_reason
        assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}
        return "length, then tool_calls"

    @check("anthropic: a tool call cut by max_tokens is max_tokens, no tool_use, no half call")
    def anthropic_cut():
        cut = an.messages.create(model=model, max_tokens=6, messages=ask, tools=WEATHER_ANTHROPIC, extra_body=AN_GREEDY)
        assert cut.stop_reason == "max_tokens", cut.stop_reason
        assert not [b for b in cut.content if b.type == "tool_use"], cut.content
        assert all("<tool_call" not in b.text for b in cut.content if b.type == "text"), cut.content
        with an.messages.stream(model=model, max_tokens=6, messages=ask, tools=WEATHER_ANTHROPIC, extra_body=AN_GREEDY) as stream:
            for _ in stream:
                pass
            final = stream.get_final_message()
        assert final.stop_reason == "max_tokens" and not [b for b in final.content if b.type == "tool_use"], final
        whole = an.messages.create(model=model, max_tokens=200, messages=ask, tools=WEATHER_ANTHROPIC, extra_body=AN_GREEDY)
        uses = [b for b in whole.content if b.type == "tool_use"]
        assert whole.stop_reason == "tool_use" and uses and uses[0].input == {"city": "Paris"}, whole
        return "max_tokens, then tool_use"

    openai_cut()
    anthropic_cut()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", required=True, help="gateway root, e.g. http://127.0.0.1:8080")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--model", default=None)
    parser.add_argument("--reference", default=None, help="fixture reference.json for the greedy check")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--claude-model", default=None, help="a Claude model name the gateway aliases (--model-alias) to check")
    parser.add_argument("--tool-call-answer", action="store_true", help="the server answers every chat with one get_weather(city=Paris) call: check calls cut by max_tokens and whole ones (only these checks run)")
    args = parser.parse_args()
    base = args.base_url.rstrip("/")
    oa = openai.OpenAI(base_url=base + "/v1", api_key=args.api_key, max_retries=0, timeout=120)
    an = anthropic.Anthropic(base_url=base, api_key=args.api_key, max_retries=0, timeout=120)
    model = args.model or oa.models.list().data[0].id
    print(f"model {model}")
    greedy = dict(temperature=0.0, seed=1)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is the capital of France?"}]
    state = {}

    @check("openai.models.list")
    def models_list():
        ids = [m.id for m in oa.models.list().data]
        assert model in ids, ids
        return f"{ids}"

    @check("openai.chat non-stream + usage")
    def chat_plain():
        response = oa.chat.completions.create(model=model, messages=messages, max_tokens=args.max_tokens, **greedy)
        choice = response.choices[0]
        assert choice.message.role == "assistant"
        assert isinstance(choice.message.content, str)
        assert choice.finish_reason in ("stop", "length"), choice.finish_reason
        usage = response.usage
        assert usage.prompt_tokens > 0 and usage.completion_tokens > 0
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert usage.completion_tokens <= args.max_tokens
        state["chat"] = (choice.message.content, getattr(choice.message, "reasoning_content", None), usage)
        return f"content={choice.message.content[:40]!r} usage={usage.prompt_tokens}+{usage.completion_tokens}"

    @check("openai.chat stream + include_usage equals non-stream")
    def chat_stream():
        stream = oa.chat.completions.create(model=model, messages=messages, max_tokens=args.max_tokens, stream=True, stream_options={"include_usage": True}, **greedy)
        content, reasoning, usage, finish = "", "", None, None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                content += choice.delta.content or ""
                reasoning += getattr(choice.delta, "reasoning_content", None) or (choice.delta.model_extra or {}).get("reasoning_content") or ""
                finish = choice.finish_reason or finish
        assert usage is not None, "no usage chunk"
        want_content, want_reasoning, want_usage = state["chat"]
        assert content == want_content, (content, want_content)
        assert reasoning == (want_reasoning or ""), (reasoning, want_reasoning)
        assert usage.completion_tokens == want_usage.completion_tokens and usage.prompt_tokens == want_usage.prompt_tokens
        assert finish in ("stop", "length")
        return f"{len(content)} chars"

    @check("openai.completions non-stream, stream, n=2")
    def completions():
        prompt = "The librarian counted the visitors and"
        plain = oa.completions.create(model=model, prompt=prompt, max_tokens=args.max_tokens, **greedy)
        text = plain.choices[0].text
        streamed = "".join(c.choices[0].text for c in oa.completions.create(model=model, prompt=prompt, max_tokens=args.max_tokens, stream=True, **greedy) if c.choices)
        assert streamed == text, (streamed, text)
        assert plain.usage.completion_tokens <= args.max_tokens
        two = oa.completions.create(model=model, prompt=prompt, max_tokens=4, n=2, **greedy)
        assert len(two.choices) == 2 and {c.index for c in two.choices} == {0, 1}
        state["completion"] = text
        return f"text={text[:40]!r}"

    @check("openai stop strings")
    def stop_strings():
        text = state.get("completion", "")
        visible = [i for i in range(len(text) // 3, len(text) - 2) if text[i:i + 2].strip() and text[i:i + 2].isprintable()]
        if not visible:
            return "skipped: completion too short for a stop string"
        start = visible[0]
        stop = text[start:start + 2]
        expected = text[:text.index(stop)]
        response = oa.completions.create(model=model, prompt="The librarian counted the visitors and", max_tokens=args.max_tokens, stop=[stop], **greedy)
        got = response.choices[0].text
        assert got == expected, (got, expected, stop)
        assert response.choices[0].finish_reason == "stop"
        assert stop not in got
        return f"stop={stop!r} -> {got[-20:]!r}"

    @check("openai unknown model -> NotFoundError")
    def unknown_model():
        try:
            oa.chat.completions.create(model="no-such-model-xyz", messages=messages, max_tokens=2)
        except openai.NotFoundError as error:
            return f"{error.status_code}"
        raise AssertionError("no error")

    @check("anthropic.messages non-stream + count_tokens")
    def messages_plain():
        response = an.messages.create(model=model, max_tokens=args.max_tokens, system="You are terse.", messages=[{"role": "user", "content": "What is the capital of France?"}], extra_body=AN_GREEDY)
        assert response.type == "message" and response.role == "assistant"
        assert response.stop_reason in ("end_turn", "max_tokens", "stop_sequence")
        assert response.usage.input_tokens > 0 and response.usage.output_tokens > 0
        counted = an.messages.count_tokens(model=model, system="You are terse.", messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert counted.input_tokens == response.usage.input_tokens, (counted.input_tokens, response.usage.input_tokens)
        state["message"] = response
        return f"blocks={[b.type for b in response.content]} usage={response.usage.input_tokens}+{response.usage.output_tokens}"

    @check("anthropic streaming event order")
    def messages_stream():
        events = list(an.messages.create(model=model, max_tokens=args.max_tokens, system="You are terse.", messages=[{"role": "user", "content": "What is the capital of France?"}], extra_body=AN_GREEDY, stream=True))
        kinds = [event.type for event in events]
        grammar = r"message_start( ping)*( content_block_start( ping)*( content_block_delta)*( ping)* content_block_stop)+( ping)* message_delta( ping)* message_stop"
        assert re.fullmatch(grammar, " ".join(kinds)), kinds
        text = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
        want = "".join(b.text for b in state["message"].content if b.type == "text")
        assert text == want, (text, want)
        indices = [e.index for e in events if e.type == "content_block_start"]
        assert indices == list(range(len(indices))), indices
        delta = next(e for e in events if e.type == "message_delta")
        assert delta.usage.output_tokens == state["message"].usage.output_tokens
        return " ".join(dict.fromkeys(kinds))

    @check("anthropic thinking blocks (stream helper)")
    def thinking():
        with an.messages.stream(model=model, max_tokens=args.max_tokens, messages=[{"role": "user", "content": "Think, then answer: 2+2?"}], thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
            for _ in stream:
                pass
            final = stream.get_final_message()
        kinds = [b.type for b in final.content]
        assert kinds and set(kinds) <= {"thinking", "text"}, kinds
        return f"blocks={kinds}"

    @check("anthropic stop_sequences")
    def stop_sequences():
        text = "".join(b.text for b in state["message"].content if b.type == "text")
        visible = [i for i in range(len(text) // 3, len(text) - 2) if text[i:i + 2].strip() and text[i:i + 2].isprintable()]
        if not visible:
            return "skipped: answer too short"
        stop = text[visible[0]:visible[0] + 2]
        response = an.messages.create(model=model, max_tokens=args.max_tokens, system="You are terse.", messages=[{"role": "user", "content": "What is the capital of France?"}], extra_body=AN_GREEDY, stop_sequences=[stop])
        got = "".join(b.text for b in response.content if b.type == "text")
        assert response.stop_reason == "stop_sequence" and response.stop_sequence == stop, (response.stop_reason, response.stop_sequence)
        assert got == text[:text.index(stop)], (got, text, stop)
        return f"stop={stop!r}"

    @check("anthropic unknown model -> NotFoundError")
    def anthropic_unknown():
        try:
            an.messages.create(model="no-such-model-xyz", max_tokens=2, messages=[{"role": "user", "content": "x"}])
        except anthropic.NotFoundError as error:
            return f"{error.status_code}"
        raise AssertionError("no error")

    @check("anthropic system message inside messages (Claude Code)")
    def system_in_messages():
        response = an.messages.create(model=model, max_tokens=4, messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}], extra_body=AN_GREEDY)
        assert response.type == "message", response
        return f"stop_reason={response.stop_reason}"

    # The sentences Claude Code parses to lower max_tokens or to compact the conversation.
    overflow_pattern = re.compile(r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+)")
    too_long_pattern = re.compile(r"prompt is too long: (\d+) tokens > (\d+) maximum")

    @check("anthropic context overflow in Anthropic's words")
    def context_overflow():
        context = http_json(base, "/tokenize", {"model": model, "prompt": "x"}, args.api_key)["max_model_len"]
        try:
            an.messages.create(model=model, max_tokens=context, messages=[{"role": "user", "content": "Hi"}])
            raise AssertionError("no error for max_tokens = the whole context")
        except anthropic.BadRequestError as error:
            found = overflow_pattern.search(str(error))
            assert found and int(found.group(2)) == context and int(found.group(3)) == context, str(error)
        try:
            an.messages.create(model=model, max_tokens=8, messages=[{"role": "user", "content": "word " * (context + 64)}])
            raise AssertionError("no error for a prompt longer than the context")
        except anthropic.BadRequestError as error:
            found = too_long_pattern.search(str(error))
            assert found and int(found.group(1)) > context and int(found.group(2)) == context, str(error)
        return f"context {context}"

    # A screenshot a tool read (a valid 1x1 PNG): an image to a model that sees images, a note to
    # one that reads text only; either way the request is answered.
    @check("anthropic image in a tool result does not fail the request")
    def image_tool_result():
        tools = [{"name": "Read", "description": "Reads a file", "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}}}]
        conversation = [
            {"role": "user", "content": "Look at shot.png"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "shot.png"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PIXEL_PNG}}]}]},
        ]
        response = an.messages.create(model=model, max_tokens=4, tools=tools, messages=conversation, extra_body=AN_GREEDY)
        return f"stop_reason={response.stop_reason}"

    @check("anthropic model alias")
    def model_alias():
        if not args.claude_model:
            return "skipped: no --claude-model given"
        response = an.messages.create(model=args.claude_model, max_tokens=4, messages=[{"role": "user", "content": "Hi"}], extra_body=AN_GREEDY)
        return f"{args.claude_model} -> {response.model}"

    @check("openai tool_choice naming an unknown function -> BadRequestError")
    def tool_choice_unknown():
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
        try:
            oa.chat.completions.create(model=model, messages=messages, max_tokens=4, tools=tools, tool_choice={"type": "function", "function": {"name": "no_such_tool"}})
        except openai.BadRequestError as error:
            return f"{error.status_code}"
        raise AssertionError("no error")

    @check("openai logit_bias accepted, out-of-range refused")
    def logit_bias():
        oa.chat.completions.create(model=model, messages=messages, max_tokens=4, logit_bias={"11": -100}, **greedy)
        try:
            oa.chat.completions.create(model=model, messages=messages, max_tokens=4, logit_bias={"11": 500})
        except openai.BadRequestError as error:
            return f"{error.status_code}"
        raise AssertionError("no error for a bias of 500")

    @check("openai.responses non-stream equals chat, stream events")
    def responses():
        response = oa.responses.create(model=model, instructions="You are terse.", input="What is the capital of France?", max_output_tokens=args.max_tokens, temperature=0.0)
        assert response.object == "response" and response.id.startswith("resp_")
        assert response.status in ("completed", "incomplete"), response.status
        want_content = state["chat"][0]
        assert response.output_text == want_content, (response.output_text, want_content)
        assert response.usage.input_tokens == state["chat"][2].prompt_tokens, response.usage
        events = list(oa.responses.create(model=model, instructions="You are terse.", input=[{"role": "user", "content": "What is the capital of France?"}], max_output_tokens=args.max_tokens, temperature=0.0, stream=True))
        kinds = [event.type for event in events]
        assert kinds[0] == "response.created" and kinds[1] == "response.in_progress", kinds
        assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
        assert [event.sequence_number for event in events] == list(range(len(events)))
        streamed = "".join(event.delta for event in events if event.type == "response.output_text.delta")
        assert streamed == want_content, (streamed, want_content)
        assert events[-1].response.output_text == want_content
        state["response_id"] = response.id
        return f"{len(events)} events"

    @check("openai.responses tool round trip and previous_response_id")
    def responses_tools():
        tools = [{"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
        items = [{"role": "user", "content": "Weather in Paris?"},
                 {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
                 {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"}]
        answer = oa.responses.create(model=model, input=items, tools=tools, max_output_tokens=args.max_tokens, temperature=0.0)
        assert answer.status in ("completed", "incomplete"), answer.status
        follow = oa.responses.create(model=model, previous_response_id=state["response_id"], input="And of Italy?", max_output_tokens=4, temperature=0.0)
        assert follow.previous_response_id == state["response_id"]
        assert follow.usage.input_tokens > state["chat"][2].prompt_tokens, follow.usage
        try:
            oa.responses.create(model=model, previous_response_id="resp_unknown", input="x", max_output_tokens=4)
            raise AssertionError("an unknown previous_response_id was accepted")
        except openai.BadRequestError as error:
            assert error.body and "previous_response_id" in json.dumps(error.body), error.body
        return f"answer={answer.output_text[:30]!r}"

    @check("reasoning_effort none turns thinking off; reasoning tokens counted")
    def reasoning_effort():
        thinking = oa.chat.completions.create(model=model, messages=messages, max_tokens=args.max_tokens, **greedy)
        reasoning = getattr(thinking.choices[0].message, "reasoning_content", None)
        details = thinking.usage.completion_tokens_details
        if reasoning:
            assert details is not None and 0 < details.reasoning_tokens <= thinking.usage.completion_tokens, thinking.usage
        off = oa.chat.completions.create(model=model, messages=messages, max_tokens=args.max_tokens, reasoning_effort="none", **greedy)
        assert not getattr(off.choices[0].message, "reasoning_content", None), off.choices[0].message
        assert off.usage.completion_tokens_details.reasoning_tokens == 0, off.usage
        # The template closed the thinking block itself: the prompt is longer by that block.
        assert off.usage.prompt_tokens > thinking.usage.prompt_tokens, (off.usage, thinking.usage)
        response = oa.responses.create(model=model, input="What is the capital of France?", max_output_tokens=args.max_tokens, temperature=0.0, reasoning={"effort": "none"})
        assert not [item for item in response.output if item.type == "reasoning"], response.output
        assert response.reasoning.effort == "none", response.reasoning
        try:
            oa.chat.completions.create(model=model, messages=messages, max_tokens=4, reasoning_effort="extreme")
            raise AssertionError("an unknown reasoning_effort was accepted")
        except openai.BadRequestError as error:
            assert "reasoning_effort" in json.dumps(error.body), error.body
        return f"reasoning_tokens={details.reasoning_tokens if details else None}"

    @check("openai.responses.retrieve returns the stored response")
    def responses_retrieve():
        created = oa.responses.create(model=model, input="What is the capital of France?", max_output_tokens=args.max_tokens, temperature=0.0)
        again = oa.responses.retrieve(created.id)
        assert again.id == created.id and again.output_text == created.output_text, (again, created)
        try:
            oa.responses.retrieve("resp_unknown")
            raise AssertionError("an unknown response id was found")
        except openai.NotFoundError:
            pass
        return created.id

    @check("temperatures outside each API's range -> BadRequestError")
    def temperature_ranges():
        try:
            oa.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=2.5)
            raise AssertionError("OpenAI temperature 2.5 was accepted")
        except openai.BadRequestError as error:
            assert "temperature" in json.dumps(error.body), error.body
        try:
            an.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": "hi"}], extra_body={"temperature": 1.5})
            raise AssertionError("Anthropic temperature 1.5 was accepted")
        except anthropic.BadRequestError as error:
            assert "temperature" in json.dumps(error.body), error.body
        # The top of each range is fine.
        oa.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=2.0)
        an.messages.create(model=model, max_tokens=2, messages=[{"role": "user", "content": "hi"}], extra_body={"temperature": 1.0})
        return "2.5 and 1.5 refused"

    @check("HEAD / answers")
    def head_root():
        request = urllib.request.Request(base + "/", method="HEAD")
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200, response.status
        return "200"

    if args.tool_call_answer:
        tool_call_checks(oa, an, model)
        passed = sum(ok for _, ok, _ in RESULTS)
        failed = len(RESULTS) - passed
        print(f"{passed} passed, {failed} failed")
        sys.exit(1 if failed else 0)

    for step in [reasoning_effort, responses_retrieve, temperature_ranges, head_root, tool_choice_unknown, logit_bias, models_list, chat_plain, chat_stream, completions, stop_strings, unknown_model, messages_plain, messages_stream, thinking, stop_sequences, anthropic_unknown, system_in_messages, context_overflow, image_tool_result, model_alias, responses, responses_tools]:
        step()

    if args.reference:
        # A real (random-weight) model: what the engine enforces on the tokens. Thinking is off
        # so the grammar applies from the first token (a random model may never close a block).
        no_think = {"chat_template_kwargs": {"enable_thinking": False}}

        @check("openai chat.completions.parse with a Pydantic schema")
        def structured_parse():
            from typing import List, Literal
            import pydantic

            class City(pydantic.BaseModel):
                name: pydantic.constr(max_length=16)
                population: pydantic.conint(ge=0, le=100000000)
                capital: bool
                tags: pydantic.conlist(Literal["old", "big", "river"], max_length=3)

            parsed = []
            for seed in range(3):
                completion = oa.chat.completions.parse(model=model, messages=[{"role": "user", "content": "Describe Paris."}], response_format=City, max_tokens=300, temperature=1.0, seed=seed, extra_body=no_think)
                message = completion.choices[0].message
                assert message.parsed is not None, message.content
                City.model_validate_json(message.content)
                parsed.append(message.parsed)
            objects = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "JSON please"}], response_format={"type": "json_object"}, max_tokens=300, seed=7, extra_body=no_think)
            assert isinstance(json.loads(objects.choices[0].message.content), dict)
            return f"{parsed[0]!r}"

        @check("forced tool calls always parse (OpenAI required / named, Anthropic any)")
        def forced_tools():
            tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city", "unit"]}}},
                     {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999}, "b": {"type": "integer", "minimum": 0, "maximum": 999}}, "required": ["a", "b"]}}}]
            names = set()
            for seed, choice in enumerate(["required", {"type": "function", "function": {"name": "add"}}, "required", "required"]):
                response = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "Use a tool."}], tools=tools, tool_choice=choice, parallel_tool_calls=False, max_tokens=300, temperature=1.0, seed=seed, extra_body=no_think)
                message = response.choices[0].message
                assert response.choices[0].finish_reason == "tool_calls", (response.choices[0].finish_reason, message.content)
                assert len(message.tool_calls) == 1, message.tool_calls
                call = message.tool_calls[0]
                arguments = json.loads(call.function.arguments)
                if isinstance(choice, dict):
                    assert call.function.name == "add"
                if call.function.name == "add":
                    assert set(arguments) == {"a", "b"} and all(isinstance(v, int) and 0 <= v <= 999 for v in arguments.values()), arguments
                else:
                    assert call.function.name == "get_weather" and arguments["unit"] in ("c", "f") and len(arguments["city"]) <= 20, arguments
                names.add(call.function.name)
            message = an.messages.create(model=model, max_tokens=300, messages=[{"role": "user", "content": "Use a tool."}],
                                         tools=[{"name": "lookup", "input_schema": {"type": "object", "properties": {"q": {"type": "string", "maxLength": 10}}, "required": ["q"]}}],
                                         tool_choice={"type": "any"})
            uses = [block for block in message.content if block.type == "tool_use"]
            assert message.stop_reason == "tool_use" and len(uses) >= 1 and uses[0].name == "lookup" and isinstance(uses[0].input["q"], str), message.content
            return f"tools {sorted(names)}"

        @check("n=3 unseeded samples differ")
        def three_samples():
            response = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say something."}], n=3, max_tokens=12, temperature=1.0, extra_body=no_think)
            texts = [choice.message.content for choice in response.choices]
            assert len(set(texts)) == 3, texts
            return f"{texts}"

        @check("anthropic thinking budget closes the thinking block")
        def thinking_budget():
            message = an.messages.create(model=model, max_tokens=64, messages=[{"role": "user", "content": "Think briefly."}], thinking={"type": "enabled", "budget_tokens": 8})
            kinds = [block.type for block in message.content]
            thinking_text = "".join(block.thinking for block in message.content if block.type == "thinking")
            # A random model left alone thinks to max_tokens; with the budget the block is closed
            # after 8 tokens and the answer follows (or the turn ends).
            assert kinds[0] == "thinking" and len(thinking_text) < 200, (kinds, thinking_text)
            assert "text" in kinds or message.stop_reason == "end_turn", (kinds, message.stop_reason)
            return f"blocks {kinds}, {len(thinking_text)} thinking chars, stop {message.stop_reason}"

        @check("openai.responses text.format json_schema")
        def responses_schema():
            response = oa.responses.create(model=model, input="A city as JSON.", max_output_tokens=300, temperature=1.0, extra_body=no_think,
                                           text={"format": {"type": "json_schema", "name": "city", "strict": True, "schema": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "big": {"type": "boolean"}}, "required": ["name", "big"], "additionalProperties": False}}})
            value = json.loads(response.output_text)
            assert set(value) == {"name", "big"} and isinstance(value["big"], bool), value
            return f"{value}"

        for step in [structured_parse, forced_tools, three_samples, thinking_budget, responses_schema]:
            step()

        @check("raw greedy completion equals the fixture reference")
        def reference_greedy():
            reference = json.load(open(args.reference))
            plain = next(p for p in reference["prompts"] if p["kind"] == "plain")
            ids = plain["greedy_token_ids"]
            response = oa.completions.create(model=model, prompt=plain["prompt_token_ids"], max_tokens=len(ids), temperature=0.0)
            expected = http_json(base, "/detokenize", {"model": model, "tokens": ids, "skip_special_tokens": True}, args.api_key)["prompt"]
            got = response.choices[0].text
            assert got == expected, (got, expected)
            # The gateway's detokenizer agrees with transformers' decode of the same ids.
            with_special = http_json(base, "/detokenize", {"model": model, "tokens": ids, "skip_special_tokens": False}, args.api_key)["prompt"]
            assert with_special == plain["greedy_text"], (with_special, plain["greedy_text"])
            # And the completion's tokens are the reference tokens (not merely the same text).
            assert response.usage.completion_tokens == len(ids), response.usage
            return f"{len(ids)} tokens"

        reference_greedy()

    passed = sum(ok for _, ok, _ in RESULTS)
    failed = len(RESULTS) - passed
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
