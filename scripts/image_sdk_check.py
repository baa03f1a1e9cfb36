#!/usr/bin/env python3
"""Images through a running NInfer server with the official `openai` and `anthropic` SDKs.

    python3 scripts/image_sdk_check.py --base-url http://127.0.0.1:8080 --image PNG \
        --image-tokens N [--model NAME] [--image-url URL]

Sends the image (a PNG file) to a model that sees images: OpenAI chat with an `image_url` data
URL (streamed and not), the Responses API with an `input_image`, Anthropic messages with a base64
`image` block and its count_tokens. Each must answer, and the prompt counts must exceed the same
request's count without the image by the image's `--image-tokens` (its placeholder run). A
truncated copy of the image and an http(s) URL must be refused by each SDK as a bad request
naming the problem; so must each hostile image (a decompression bomb's header, a 20,000 x
20,000 PNG header, a truncated file, an SVG, a PNG declared as JPEG). With `--image-url` (the same image at a URL of a host the server was told to
fetch from, `--image-url-hosts`), OpenAI chat and Anthropic messages send the URL instead and
must count the image's tokens as for the inline image; a URL of another host is then refused.

`--hostile-rounds N` sends only the hostile images, N rounds through both SDKs (for a caller that
measures the server's memory around it).

Ends with the line `N passed, M failed` and exits 1 on any failure; exits 77 (skipped) when the
SDKs are not installed.
"""

import argparse
import base64
import struct
import sys
import traceback
import zlib

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


def png_header_only(width, height):
    """A PNG whose header claims width x height RGB pixels and whose pixel data is a zlib stream
    that ends at once: a decompression bomb's shape, a few dozen bytes."""

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">II", width, height) + bytes([8, 2, 0, 0, 0])
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", bytes([0x78, 0x9C, 0x03, 0x00, 0x00, 0x00, 0x00, 0x01])) + chunk(b"IEND", b""))


def hostile_images(image):
    """(what, declared media type, bytes, what the refusal must name) for each hostile image."""
    encode = lambda raw: base64.b64encode(raw).decode()
    svg = b'<svg xmlns="http://www.w3.org/2000/svg" width="20000" height="20000"/>'
    return [
        ("bomb", "image/png", encode(png_header_only(12_000, 12_000)), "pixels"),
        ("20k x 20k", "image/png", encode(png_header_only(20_000, 20_000)), "20000x20000"),
        ("truncated", "image/png", encode(image[: len(image) // 2]), "truncated"),
        ("SVG", "image/svg+xml", encode(svg), "image/svg+xml"),
        ("wrong declared type", "image/jpeg", encode(image), "declared as `image/jpeg`"),
    ]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--model", default=None)
    parser.add_argument("--image", required=True)
    parser.add_argument("--image-tokens", type=int, required=True)
    parser.add_argument("--image-url", default=None)
    parser.add_argument("--hostile-rounds", type=int, default=0)
    args = parser.parse_args()

    image = open(args.image, "rb").read()
    data = base64.b64encode(image).decode()
    hostile = hostile_images(image)
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
        cases = [(what, f"data:{media};base64,{raw}", named) for what, media, raw, named in hostile]
        cases.append(("remote URL", "https://example.com/cat.png", not_fetched))
        for what, url, named in cases:
            try:
                oa.chat.completions.create(model=model, messages=openai_messages(url), max_tokens=4)
            except openai.BadRequestError as error:
                expect(named in str(error), f"{what}: {error}")
            else:
                raise AssertionError(f"{what}: answered")
        return f"{len(cases)} refused"

    def anthropic_refusals():
        for what, media, raw, named in hostile:
            source = {"type": "base64", "media_type": media, "data": raw}
            try:
                an.messages.create(model=model, max_tokens=4, messages=anthropic_message(source))
            except anthropic.BadRequestError as error:
                expect(named in str(error), f"{what}: {error}")
            else:
                raise AssertionError(f"{what}: answered")
        return f"{len(hostile)} refused"

    def finish():
        failed = sum(1 for _, ok in RESULTS if not ok)
        print(f"{len(RESULTS) - failed} passed, {failed} failed")
        sys.exit(1 if failed else 0)

    if args.hostile_rounds:
        for round_ in range(args.hostile_rounds):
            check(f"round {round_}: openai refuses hostile images", openai_refusals)
            check(f"round {round_}: anthropic refuses hostile images", anthropic_refusals)
        finish()

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
    finish()


if __name__ == "__main__":
    main()
