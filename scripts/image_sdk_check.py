#!/usr/bin/env python3
"""Images through a running NInfer server with the official `openai` and `anthropic` SDKs.

    python3 scripts/image_sdk_check.py --base-url http://127.0.0.1:8080 --image PNG \
        --image-tokens N [--model NAME] [--image-url URL]

Sends the image (a PNG file) to a model that sees images: OpenAI chat with an `image_url` data
URL (streamed and not), the Responses API with an `input_image`, Anthropic messages with a base64
`image` block and its count_tokens. Each must answer, and the prompt counts must exceed the same
request's count without the image by the image's `--image-tokens` (its placeholder run). A
truncated copy of the image and an http(s) URL must be refused by each SDK as a bad request
naming the problem. With `--image-url` (the same image at a URL of a host the server was told to
fetch from, `--image-url-hosts`), OpenAI chat and Anthropic messages send the URL instead and
must count the image's tokens as for the inline image; a URL of another host is then refused.

Ends with the line `N passed, M failed` and exits 1 on any failure; exits 77 (skipped) when the
SDKs are not installed.
"""

import argparse
import base64
import sys
import traceback

try:
    import anthropic
    import openai
except ImportError as missing:
    print(f"SKIPPED: {missing} (pip install openai anthropic)")
    sys.exit(77)

RESULTS = []


def check(name, function):
    try:
        detail = function()
        RESULTS.append((name, True))
        print(f"PASS {name} {detail or ''}")
    except Exception as error:  # report and go on with the other checks
        RESULTS.append((name, False))
        print(f"FAIL {name}: {error!r}")
        traceback.print_exc()


def expect(condition, message):
    if not condition:
        raise AssertionError(message)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--model", default=None)
    parser.add_argument("--image", required=True)
    parser.add_argument("--image-tokens", type=int, required=True)
    parser.add_argument("--image-url", default=None)
    args = parser.parse_args()

    image = open(args.image, "rb").read()
    data = base64.b64encode(image).decode()
    truncated = base64.b64encode(image[: len(image) // 2]).decode()
    oa = openai.OpenAI(base_url=args.base_url + "/v1", api_key=args.api_key, max_retries=0)
    an = anthropic.Anthropic(base_url=args.base_url, api_key=args.api_key, max_retries=0)
    model = args.model or oa.models.list().data[0].id

    def openai_messages(url):
        content = [{"type": "text", "text": "What is in this picture?"}]
        if url is not None:
            content.append({"type": "image_url", "image_url": {"url": url}})
        return [{"role": "user", "content": content}]

    def openai_chat():
        seen = oa.chat.completions.create(model=model, messages=openai_messages(f"data:image/png;base64,{data}"), max_tokens=8, temperature=0)
        blind = oa.chat.completions.create(model=model, messages=openai_messages(None), max_tokens=8, temperature=0)
        expect(seen.choices[0].message.content is not None or seen.choices[0].message.reasoning_content, "no answer")
        grown = seen.usage.prompt_tokens - blind.usage.prompt_tokens
        expect(grown == args.image_tokens + 2, f"the image added {grown} prompt tokens, not {args.image_tokens} + its two markers")
        return f"prompt {seen.usage.prompt_tokens} tokens, {seen.usage.completion_tokens} generated"

    def openai_stream():
        stream = oa.chat.completions.create(model=model, messages=openai_messages(f"data:image/png;base64,{data}"), max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        usage = [c.usage for c in chunks if c.usage is not None]
        expect(usage and usage[-1].completion_tokens > 0, "no usage with tokens")
        return f"{len(chunks)} chunks"

    def responses():
        answer = oa.responses.create(model=model, max_output_tokens=8, temperature=0, input=[{"role": "user", "content": [
            {"type": "input_text", "text": "What is in this picture?"},
            {"type": "input_image", "image_url": f"data:image/png;base64,{data}"}]}])
        expect(answer.usage.input_tokens > args.image_tokens, f"input tokens {answer.usage.input_tokens}")
        return f"input {answer.usage.input_tokens} tokens"

    def anthropic_message(source):
        return [{"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": "What is in this picture?"}]}]

    def anthropic_messages():
        source = {"type": "base64", "media_type": "image/png", "data": data}
        answer = an.messages.create(model=model, max_tokens=8, messages=anthropic_message(source))
        counted = an.messages.count_tokens(model=model, messages=anthropic_message(source))
        expect(answer.usage.input_tokens == counted.input_tokens, f"{answer.usage.input_tokens} != count_tokens {counted.input_tokens}")
        expect(answer.usage.input_tokens > args.image_tokens, f"input tokens {answer.usage.input_tokens}")
        return f"input {answer.usage.input_tokens} tokens, stop {answer.stop_reason}"

    def openai_refusals():
        not_fetched = "not one this server fetches images from" if args.image_url else "not fetched"
        for url, named in [(f"data:image/png;base64,{truncated}", "truncated"), ("https://example.com/cat.png", not_fetched)]:
            try:
                oa.chat.completions.create(model=model, messages=openai_messages(url), max_tokens=4)
            except openai.BadRequestError as error:
                expect(named in str(error), f"{error}")
            else:
                raise AssertionError(f"{named}: answered")

    def anthropic_refusals():
        for source, named in [({"type": "base64", "media_type": "image/png", "data": truncated}, "truncated"), ({"type": "base64", "media_type": "image/jpeg", "data": data}, "declared as")]:
            try:
                an.messages.create(model=model, max_tokens=4, messages=anthropic_message(source))
            except anthropic.BadRequestError as error:
                expect(named in str(error), f"{error}")
            else:
                raise AssertionError(f"{named}: answered")

    def image_by_url():
        inline = oa.chat.completions.create(model=model, messages=openai_messages(f"data:image/png;base64,{data}"), max_tokens=4, temperature=0)
        fetched = oa.chat.completions.create(model=model, messages=openai_messages(args.image_url), max_tokens=4, temperature=0)
        expect(fetched.usage.prompt_tokens == inline.usage.prompt_tokens, f"openai: {fetched.usage.prompt_tokens} prompt tokens by URL, {inline.usage.prompt_tokens} inline")
        source = {"type": "url", "url": args.image_url}
        inline_source = {"type": "base64", "media_type": "image/png", "data": data}
        answer = an.messages.create(model=model, max_tokens=4, messages=anthropic_message(source))
        counted = an.messages.count_tokens(model=model, messages=anthropic_message(inline_source))
        expect(answer.usage.input_tokens == counted.input_tokens, f"anthropic: {answer.usage.input_tokens} input tokens by URL, {counted.input_tokens} inline")
        return f"prompt {fetched.usage.prompt_tokens} tokens (openai), {answer.usage.input_tokens} (anthropic)"

    check("openai chat with an image", openai_chat)
    check("openai chat with an image, streamed", openai_stream)
    check("responses with an input_image", responses)
    check("anthropic messages with an image", anthropic_messages)
    check("openai refuses hostile images", openai_refusals)
    check("anthropic refuses hostile images", anthropic_refusals)
    if args.image_url:
        check("openai and anthropic with an image URL", image_by_url)
    failed = sum(1 for _, ok in RESULTS if not ok)
    print(f"{len(RESULTS) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
