#!/usr/bin/env python3
"""Build the golden test fixtures under tests/fixtures/ (tiny random Qwen checkpoints + references).

Four Hugging Face-style checkpoint directories are produced:

  qwen3_moe/    Qwen3MoeForCausalLM                  (model_type qwen3_moe), per-expert expert tensors on disk
  qwen3_next/   Qwen3NextForCausalLM                 (model_type qwen3_next), per-expert expert tensors on disk
  qwen3_5_moe/  Qwen3_5MoeForConditionalGeneration   (model_type qwen3_5_moe, multimodal release layout),
                fused expert tensors on disk, tiny vision tower, random MTP block (mtp.*)
  qwen3_5/      Qwen3_5ForConditionalGeneration      (model_type qwen3_5, the dense Qwen3.5/3.6 in the multimodal
                release layout): every layer a dense SwiGLU MLP, tiny vision tower, random MTP block with a
                dense MLP
  qwen4_exp/    Qwen4ExpForConditionalGeneration     (model_type qwen4_exp, multimodal release layout): three
                hyper-connection residual streams, two PLE layers whose n-gram tables are split into row shards
                on disk, QSA sparse attention with a small budget, a sigmoid GDN output gate; its NLL text
                (QWEN4_EXP_NLL_TEXT, EOS tokens inside) runs far past the dense regime. No bf16 references and
                no numpy --check for it (the golden test holds it to the float32 references).

Each holds config.json, model.safetensors (float32), tokenizer.json, tokenizer_config.json,
chat_template.jinja, generation_config.json and reference.json (logits / NLL / greedy tokens computed with
transformers in float32, eager attention, eager experts, on CPU, from the checkpoint as re-loaded from disk).

Needs torch + transformers 5.17 + tokenizers + safetensors. Deterministic (fixed seeds, one CPU thread).

Each reference.json also holds `bf16_weights`: the same NLL / last-logits references with the weights rounded to
bf16 the way `ninfer-convert --experts-dtype bf16 --dense-dtype bf16` stores them (BF16_ROUNDING_RULE).

Usage (repo root):
    CUDA_VISIBLE_DEVICES= python3 scripts/make_fixtures.py --out tests/fixtures [--tar fixtures.tar.gz]
    CUDA_VISIBLE_DEVICES= python3 scripts/make_fixtures.py --bf16-references   # only (re)compute `bf16_weights`
                                                 # in the committed reference.json files from the committed
                                                 # model.safetensors; every other value stays as it is
    python3 scripts/make_fixtures.py --check     # numpy + safetensors only: independent float64 forward
                                                 # (docs/MODELS.md formulas) on the committed files vs reference.json
Pinned versions: scripts/fixtures_requirements.txt.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import io
import json
import math
import os
import platform
import shutil
import sys
import tarfile
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATE_PATH = os.path.join(REPO, "tests", "fixtures", "qwen3_5_chat_template.jinja")

SEEDS = {"tokenizer": 0, "qwen3_moe": 1001, "qwen3_next": 1002, "qwen3_5_moe": 1003, "qwen3_5": 1004, "qwen4_exp": 1005}
# Generation order; `--only` picks a subset (the README is rewritten only when all are built).
FIXTURES = ["qwen3_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5", "qwen4_exp"]
# Fixtures the numpy `--check` forward and the bf16-weights references cover.
NUMPY_CHECKED = ["qwen3_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5"]
# Multimodal release layout: text config under `text_config`, text weights under `model.language_model.`.
MULTIMODAL = ("qwen3_5_moe", "qwen3_5", "qwen4_exp")
FLOAT_DIGITS = 9  # significant digits written for floats (f32 round-trips with 9)

# ----------------------------------------------------------------------------------------------------------
# Text
# ----------------------------------------------------------------------------------------------------------

TRAIN_TEXT = """\
The river town woke slowly in the early morning. Fishermen pushed their boats into the grey water while the
baker opened the shutters of her small shop and set the first loaves of bread on the counter. Children walked
to school in pairs, talking about the weather, the market, and the old bridge that needed repairs before winter.

In the afternoon the wind turned to the west and the clouds broke apart. The teacher asked the class to write a
short story about a journey. One student wrote about a ship that sailed to the edge of the map; another wrote
about a train that crossed the mountains at night. The best stories were read aloud, and everyone agreed that a
good journey needs a reason to leave and a reason to return.

A computer program is a list of instructions. Each instruction tells the machine what to do with numbers stored
in memory. Modern programs are written in languages such as Rust, Python, and C, and they are translated into
machine code by a compiler or run by an interpreter. A careful programmer tests the code, measures how fast it
runs, and keeps the design simple so that other people can read it and change it later.

Large language models predict the next token of a text. A token is a short piece of a word, a whole word, or a
symbol. The model reads the tokens of the prompt, computes a probability for every token in its vocabulary, and
then picks one. Repeating this step produces an answer one token at a time. A mixture of experts model sends
each token to a few expert networks chosen by a router, so only a small part of the weights is used for each
step, which makes the model cheaper to run on a single machine with limited memory.

The library kept records of every book that was borrowed and returned. On Monday there were forty-two visitors;
on Tuesday there were thirty-seven. The librarian counted them carefully: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10. She
liked numbers, quiet rooms, and the smell of old paper. When the lights went out during the storm, she lit a
candle and kept reading until the power came back at nine o'clock.

Question: What is the capital of France? Answer: The capital of France is Paris.
Question: How many days are there in a week? Answer: There are seven days in a week.
Question: Why is the sky blue? Answer: Sunlight is scattered by the air, and blue light is scattered the most.
User: Please write a function that adds two numbers. Assistant: Here is a simple function that returns the sum.
User: Thank you! Can you explain how it works? Assistant: It takes two inputs and returns their total.

Water boils at one hundred degrees at sea level, and it freezes at zero. The farmer measured the rain each
day and wrote the results in a notebook. In spring the fields were green, in summer they were golden, and in
autumn the leaves of the trees turned red and yellow before they fell to the ground. The seasons change, but the
work of the farm continues through the whole year, from the first light of the morning to the last light of the
evening.
"""

NLL_TEXT = (
    "The teacher opened the old notebook and read the first page aloud. It described a small town by a river, "
    "where the baker sold bread and the children learned to count. Later that evening, the power went out, so "
    "everyone talked about strange machines."
)

PLAIN_PROMPT = "The librarian counted the visitors and wrote the numbers in her notebook because"

# qwen4_exp's NLL text: a few hundred tokens with end-of-sequence tokens inside (the PLE n-gram contexts stop at
# them), so the evaluation runs far past QSA's dense regime and across segments.
QWEN4_EXP_NLL_TEXT = (
    NLL_TEXT
    + "<|im_end|>"
    + TRAIN_TEXT.split("\n\n")[2].replace("\n", " ")
    + "<|im_end|>"
    + PLAIN_PROMPT
)

CHAT_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France? Please answer in one short sentence."},
]

# Qwen special tokens (order = id order after the BPE vocabulary). special=False mirrors the real Qwen tokenizer.
ADDED_TOKENS = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<think>", False),
    ("</think>", False),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
]

# Same regex as transformers' Qwen2Tokenizer (models/qwen2/tokenization_qwen2.py: PRETOKENIZE_REGEX).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
BPE_TRAIN_VOCAB = 480  # includes the 256-symbol byte alphabet

# ----------------------------------------------------------------------------------------------------------
# Model dims (shared)
# ----------------------------------------------------------------------------------------------------------

H = 64
NH = 4
NKV = 2
HD = 32
I_DENSE = 96
E = 8
TOPK = 2
IM = 32
IS = 32
NK = 2
NV = 4
DK = 16
DV = 16
KC = 4
N_LAYERS = 4
ROPE_THETA = 10000.0
EPS = 1e-6
MAX_POS = 4096

# qwen4_exp only (MODELS.md §5): streams, mixer rank, QSA and PLE sizes.
Q4_HC = 3
Q4_HC_RANK = 8
Q4_INDEXER_HEADS = 2
Q4_INDEXER_DIM = 16
Q4_BUDGET = 8  # with ratio 4: dense up to 11 visible tokens
Q4_RATIO = 4
Q4_PLE_IDS = [1, 3]  # 1-indexed, both linear-attention layers
Q4_PLE_DIM = 32
Q4_NGRAM_BASE = 500
Q4_NGRAM_DIVISOR = 64
Q4_SPLIT_PARTS = 3
Q4_IM = 8

LM_HEAD_GAIN = 3.5  # lm_head std = gain / sqrt(H): final-norm output has unit RMS -> logit std ~ gain
ROUTER_GAIN = 2.0  # router logits std ~ 2 -> decisive top-k


def fnum(x: float) -> float:
    """Round a float to FLOAT_DIGITS significant digits (exact f32 round-trip)."""
    if x != x or x in (float("inf"), float("-inf")):
        raise ValueError(f"non-finite value {x}")
    return float(f"{x:.{FLOAT_DIGITS}g}")


def flist(t) -> list:
    return [fnum(v) for v in t.detach().double().reshape(-1).tolist()]


def log(*a):
    print(*a, flush=True)


# ----------------------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------------------


def build_tokenizer(workdir: str):
    """Train a small byte-level BPE with the Qwen2 pipeline; return (tokenizer_json_str, ids dict, size)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(
        models.BPE(
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_TRAIN_VOCAB,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator([TRAIN_TEXT], trainer=trainer)
    n_bpe = tok.get_vocab_size(with_added_tokens=False)
    for content, special in ADDED_TOKENS:
        at = AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special)
        if special:
            tok.add_special_tokens([at])
        else:
            tok.add_tokens([at])
    ids = {c: tok.token_to_id(c) for c, _ in ADDED_TOKENS}
    for i, (c, _) in enumerate(ADDED_TOKENS):
        assert ids[c] == n_bpe + i, (c, ids[c], n_bpe + i)
    size = tok.get_vocab_size(with_added_tokens=True)
    path = os.path.join(workdir, "tokenizer.json")
    tok.save(path, pretty=True)
    with open(path, encoding="utf-8") as f:
        tj = f.read()
    return tj, ids, size, n_bpe


def tokenizer_config(ids: dict, template: str) -> dict:
    added = {}
    for c, special in ADDED_TOKENS:
        added[str(ids[c])] = {
            "content": c,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": MAX_POS,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def generation_config(ids: dict, tf_version: str) -> dict:
    return {
        "bos_token_id": ids["<|endoftext|>"],
        "do_sample": True,
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
        "transformers_version": tf_version,
    }


# ----------------------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------------------


def multimodal_config(config_class, vision_class, text, ids: dict, hidden: int):
    """The multimodal release layout around a text config: a tiny vision tower and the image and
    video token ids (the converter skips the tower)."""
    vision = vision_class(
        depth=1,
        hidden_size=32,
        hidden_act="gelu_pytorch_tanh",
        intermediate_size=64,
        num_heads=2,
        in_channels=3,
        patch_size=8,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=hidden,
        num_position_embeddings=16,
    )
    return config_class(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def make_config(name: str, vocab: int, ids: dict):
    import transformers as T

    common = dict(
        vocab_size=vocab,
        hidden_size=H,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=NH,
        num_key_value_heads=NKV,
        head_dim=HD,
        hidden_act="silu",
        max_position_embeddings=MAX_POS,
        rms_norm_eps=EPS,
        tie_word_embeddings=False,
        attention_bias=False,
        num_experts=E,
        num_experts_per_tok=TOPK,
        moe_intermediate_size=IM,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
    )
    if name == "qwen3_moe":
        return T.Qwen3MoeConfig(
            **common,
            intermediate_size=I_DENSE,
            rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        )
    linear = dict(
        linear_conv_kernel_dim=KC,
        linear_key_head_dim=DK,
        linear_value_head_dim=DV,
        linear_num_key_heads=NK,
        linear_num_value_heads=NV,
        shared_expert_intermediate_size=IS,
    )
    if name == "qwen3_next":
        return T.Qwen3NextConfig(
            **common,
            **linear,
            intermediate_size=I_DENSE,
            rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA, "partial_rotary_factor": 0.25},
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        )
    if name == "qwen3_5":
        # Qwen3_5TextConfig has no expert fields: pass none (extra keys would land in config.json).
        dense_common = {
            k: v
            for k, v in common.items()
            if k not in ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
        }
        dense_linear = {k: v for k, v in linear.items() if k != "shared_expert_intermediate_size"}
        text = T.Qwen3_5TextConfig(
            **dense_common,
            **dense_linear,
            intermediate_size=I_DENSE,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": ROPE_THETA,
                "partial_rotary_factor": 0.25,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
            mtp_num_hidden_layers=1,
            mtp_use_dedicated_embeddings=False,
        )
        return multimodal_config(T.Qwen3_5Config, T.Qwen3_5VisionConfig, text, ids, H)
    if name == "qwen3_5_moe":
        text = T.Qwen3_5MoeTextConfig(
            **common,
            **linear,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": ROPE_THETA,
                "partial_rotary_factor": 0.25,
                "mrope_section": [2, 1, 1],  # rot = 8 -> 4 frequencies (T,H,W); text-only: all equal
                "mrope_interleaved": True,
            },
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            mtp_num_hidden_layers=1,
            mtp_use_dedicated_embeddings=False,
        )
        return multimodal_config(T.Qwen3_5MoeConfig, T.Qwen3_5MoeVisionConfig, text, ids, H)
    if name == "qwen4_exp":
        text = T.Qwen4ExpTextConfig(
            **{**common, "moe_intermediate_size": Q4_IM},
            **linear,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": ROPE_THETA,
                "partial_rotary_factor": 0.25,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            output_gate_type="sigmoid",
            norm_topk_prob=True,
            hc_count=Q4_HC,
            hc_lowrank=Q4_HC_RANK,
            ple_layer_ids=Q4_PLE_IDS,
            ple_embed_dim=Q4_PLE_DIM,
            ple_conv_kernel_size=4,
            ngram_size=3,
            heads_per_ngram=2,
            ngram_vocab_size_base=Q4_NGRAM_BASE,
            make_ngram_vocab_size_divisible_by=Q4_NGRAM_DIVISOR,
            split_ngram_parts=Q4_SPLIT_PARTS,
            seed=1234,
            indexer_n_heads=Q4_INDEXER_HEADS,
            indexer_kv_heads=1,
            indexer_head_dim=Q4_INDEXER_DIM,
            indexer_budget=Q4_BUDGET,
            indexer_compress_ratio=Q4_RATIO,
        )
        return multimodal_config(T.Qwen4ExpConfig, T.Qwen4ExpVisionConfig, text, ids, H)
    raise ValueError(name)


MODEL_CLASS = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen4_exp": "Qwen4ExpForConditionalGeneration",
}
# The text-only class of each multimodal fixture (cross-check: it loads the multimodal checkpoint).
TEXT_ONLY_CLASS = {
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen4_exp": "Qwen4ExpForCausalLM",
}

# ----------------------------------------------------------------------------------------------------------
# Weight randomisation
# ----------------------------------------------------------------------------------------------------------


def randomise_module(root, gen, plain_norms: bool, report: dict, prefix: str = ""):
    """Re-randomise every parameter of `root` (in place), rule chosen by module kind. Returns nothing.

    plain_norms=True: RMSNorm weights are plain scales (Qwen3-MoE) -> 1 + 0.1 N.
    plain_norms=False: (1+w) zero-centred RMSNorm -> 0.1 N; the GDN gated norm (plain w) -> 1 + 0.1 N.
    """
    import torch
    from torch import nn

    def normal(p, std, mean=0.0):
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std + mean)

    done = set()
    for mname, mod in sorted(root.named_modules(), key=lambda kv: kv[0]):
        cls = type(mod).__name__
        full = (prefix + mname) if mname else prefix.rstrip(".")
        own = {n: p for n, p in mod.named_parameters(recurse=False)}
        if not own:
            continue
        for pname in sorted(own):
            p = own[pname]
            key = f"{full}.{pname}" if full else pname
            if id(p) in done:
                continue
            done.add(id(p))
            rule = None
            if cls.endswith("RMSNormGated"):
                normal(p, 0.1, 1.0)
                rule = "1+0.1N (gated norm, plain w)"
            elif "RMSNorm" in cls:
                if plain_norms:
                    normal(p, 0.1, 1.0)
                    rule = "1+0.1N (plain norm)"
                else:
                    normal(p, 0.1)
                    rule = "0.1N (zero-centred 1+w norm)"
            elif isinstance(mod, nn.LayerNorm):
                if pname == "weight":
                    normal(p, 0.1, 1.0)
                    rule = "1+0.1N (LayerNorm w)"
                else:
                    normal(p, 0.1)
                    rule = "0.1N (LayerNorm b)"
            elif isinstance(mod, nn.Embedding):
                std = 1.0 if "embed_tokens" in key else 0.02
                normal(p, std)
                rule = f"N(0,{std}) (embedding)"
            elif cls.endswith("GatedDeltaNet") and pname == "A_log":
                with torch.no_grad():
                    u = torch.rand(p.shape, generator=gen, dtype=torch.float32)
                    p.copy_(math.log(0.1) + u * (math.log(2.0) - math.log(0.1)))
                rule = "log U(0.1, 2) (A_log)"
            elif cls.endswith("GatedDeltaNet") and pname == "dt_bias":
                normal(p, 0.5)
                rule = "0.5N (dt_bias)"
            elif cls.endswith("Experts"):
                fan_in = p.shape[-1]
                normal(p, 1.0 / math.sqrt(fan_in))
                rule = f"N(0,1/sqrt({fan_in})) (experts)"
            elif cls.endswith("TopKRouter"):
                normal(p, ROUTER_GAIN / math.sqrt(p.shape[-1]))
                rule = f"N(0,{ROUTER_GAIN}/sqrt(H)) (router)"
            elif isinstance(mod, nn.Conv1d):
                normal(p, 0.5)
                rule = "0.5N (GDN conv1d)"
            elif isinstance(mod, nn.Linear):
                if pname == "bias":
                    normal(p, 0.02)
                    rule = "0.02N (bias)"
                elif key.endswith("lm_head.weight"):
                    normal(p, LM_HEAD_GAIN / math.sqrt(p.shape[1]))
                    rule = f"N(0,{LM_HEAD_GAIN}/sqrt(H)) (lm_head)"
                else:
                    normal(p, 1.0 / math.sqrt(p.shape[1]))
                    rule = "N(0,1/sqrt(fan_in)) (linear)"
            else:
                normal(p, 0.02)
                rule = f"0.02N (fallback, module {cls})"
            report.setdefault(rule, 0)
            report[rule] += 1
            if rule.startswith("0.02N (fallback"):
                log(f"    fallback init: {key} {tuple(p.shape)} ({cls})")


# ----------------------------------------------------------------------------------------------------------
# On-disk layout
# ----------------------------------------------------------------------------------------------------------


def split_experts(sd: dict, gate_up_key: str, down_key: str, out_prefix: str, out: dict):
    gu = sd[gate_up_key]
    dn = sd[down_key]
    n_exp, two_im, _ = gu.shape
    im = two_im // 2
    for e in range(n_exp):
        out[f"{out_prefix}{e}.gate_proj.weight"] = gu[e, :im].clone().contiguous()
        out[f"{out_prefix}{e}.up_proj.weight"] = gu[e, im:].clone().contiguous()
        out[f"{out_prefix}{e}.down_proj.weight"] = dn[e].clone().contiguous()


def sd_buffers_int64(model) -> dict:
    """The integer buffers of `model`'s state dict, as they are (the float conversion above would change them)."""
    import torch

    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items() if v.dtype == torch.int64}


def disk_state_dict(name: str, model, gen, rand_report: dict) -> dict:
    """Tensors exactly as they go into model.safetensors (float32)."""
    import torch

    sd = {
        k: v.detach().contiguous() if v.dtype == torch.int64 else v.detach().to(torch.float32).contiguous()
        for k, v in model.state_dict().items()
    }
    out = {}
    if name in ("qwen3_moe", "qwen3_next"):
        for k, v in sd.items():
            if k.endswith(".mlp.experts.gate_up_proj"):
                base = k[: -len("gate_up_proj")]
                split_experts(sd, k, base + "down_proj", base, out)
            elif k.endswith(".mlp.experts.down_proj"):
                continue
            else:
                out[k] = v.clone()
        return out
    if name == "qwen4_exp":
        # As in memory (multimodal names, fused experts, the PLE hash buffers), except each n-gram table, which is
        # split into row shards the way transformers saves it (torch.chunk along rows, `split_ngram_parts`).
        parts = model.config.get_text_config().split_ngram_parts
        for k, v in sd.items():
            if k.endswith("ngram_embedding.weight"):
                base = k[: -len("weight")]
                for index, shard in enumerate(torch.chunk(v, parts, dim=0)):
                    out[f"{base}shard_{index}.weight"] = shard.clone().contiguous()
            elif v.dtype == torch.int64:
                out[k] = sd_buffers_int64(model)[k]
            else:
                out[k] = v.clone()
        return out
    # qwen3_5_moe / qwen3_5: as in memory (multimodal names; qwen3_5_moe's experts fused), plus a random MTP
    # block whose layer is a copy of a full-attention layer (qwen3_5: with its dense MLP), re-randomised.
    for k, v in sd.items():
        out[k] = v.clone()
    text = model.model.language_model
    cfg = text.config
    full_idx = cfg.layer_types.index("full_attention")
    mtp_layer = copy.deepcopy(text.layers[full_idx])
    randomise_module(mtp_layer, gen, plain_norms=False, report=rand_report, prefix="mtp.layers.0.")
    lsd = {k: v.detach().to(torch.float32).contiguous() for k, v in mtp_layer.state_dict().items()}
    for k, v in lsd.items():
        if k == "mlp.experts.gate_up_proj":
            split_experts(lsd, k, "mlp.experts.down_proj", "mtp.layers.0.mlp.experts.", out)
        elif k == "mlp.experts.down_proj":
            continue
        else:
            out["mtp.layers.0." + k] = v.clone()

    def rn(shape, std):
        return (torch.randn(shape, generator=gen, dtype=torch.float32) * std).contiguous()

    h = cfg.hidden_size
    out["mtp.fc.weight"] = rn((h, 2 * h), 1.0 / math.sqrt(2 * h))
    out["mtp.pre_fc_norm_embedding.weight"] = rn((h,), 0.1)
    out["mtp.pre_fc_norm_hidden.weight"] = rn((h,), 0.1)
    out["mtp.norm.weight"] = rn((h,), 0.1)
    return out


# ----------------------------------------------------------------------------------------------------------
# References
# ----------------------------------------------------------------------------------------------------------


def entropy_stats(logits):
    import torch

    lp = torch.log_softmax(logits.double(), dim=-1)
    ent = -(lp.exp() * lp).sum(-1)
    return ent


def greedy_manual(model, ids, n):
    """Argmax loop, full re-forward (no cache) each step. Returns (tokens, top1-top2 margins)."""
    import torch

    seq = list(ids)
    toks, margins = [], []
    for _ in range(n):
        with torch.no_grad():
            lg = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1]
        top2 = torch.topk(lg.double(), 2)
        t = int(top2.indices[0])
        toks.append(t)
        margins.append(fnum(float(top2.values[0] - top2.values[1])))
        seq.append(t)
    return toks, margins


def compute_reference(name, model, tok, tok_json, ids, meta):
    import torch
    import transformers

    ref = dict(meta)
    vocab = model.config.get_text_config().vocab_size

    # --- raw tokenizers vs HF tokenizer agreement (the Rust side will read tokenizer.json directly)
    from tokenizers import Tokenizer

    raw = Tokenizer.from_str(tok_json)

    def enc(text):
        hf_ids = tok(text, add_special_tokens=False)["input_ids"]
        raw_ids = raw.encode(text, add_special_tokens=False).ids
        return hf_ids, raw_ids

    # --- NLL text
    nll_text = QWEN4_EXP_NLL_TEXT if name == "qwen4_exp" else NLL_TEXT
    nll_ids, nll_raw = enc(nll_text)
    x = torch.tensor([nll_ids])
    tb = text_backbone(model)
    captured = []

    def hook(mod, inp, out):
        captured.append((out[0] if isinstance(out, tuple) else out).detach())

    handles = [tb.embed_tokens.register_forward_hook(hook)]
    handles += [layer.register_forward_hook(hook) for layer in tb.layers]
    # qwen4_exp has no final norm: its final stream mixer gives the input of lm_head.
    final = tb.hyper_connection_mixer if name == "qwen4_exp" else tb.norm
    handles.append(final.register_forward_hook(hook))
    try:
        with torch.no_grad():
            logits = model(input_ids=x, use_cache=False).logits[0]
    finally:
        for hd in handles:
            hd.remove()
    assert len(captured) == len(tb.layers) + 2, len(captured)
    n_pos = len(nll_ids)
    ref["nll_text_hidden_states"] = {
        "description": "residual stream for the NLL text forward: [0] = embed_tokens output, [i] = output of "
        "decoder layer i-1 (i = 1..num_layers), [last] = after the final norm (input of lm_head)",
        "positions": [0, n_pos - 1],
        "values": [[flist(hs[0, pos]) for pos in (0, n_pos - 1)] for hs in captured],
    }
    assert logits.shape == (len(nll_ids), vocab), logits.shape
    lp = torch.log_softmax(logits.double(), dim=-1)
    token_nll = [-float(lp[i - 1, nll_ids[i]]) for i in range(1, len(nll_ids))]
    ent = entropy_stats(logits)
    ref["nll_text"] = nll_text
    ref["nll_token_ids"] = nll_ids
    ref["token_nll"] = [fnum(v) for v in token_nll]
    ref["mean_nll"] = fnum(sum(token_nll) / len(token_nll))
    ref["nll_text_logit_stats"] = {
        "max_abs_logit": fnum(float(logits.abs().max())),
        "mean_std_logit_per_position": fnum(float(logits.double().std(dim=-1).mean())),
        "mean_entropy_nats": fnum(float(ent.mean())),
        "log_vocab_nats": fnum(math.log(vocab)),
    }

    # --- prefill/decode consistency (record only)
    n = len(nll_ids)
    full_last = logits[-1]
    pdc = {"n_tokens": n, "prefill_tokens": n - 1}
    try:
        with torch.no_grad():
            out1 = model(input_ids=x[:, : n - 1], use_cache=True)
            out2 = model(input_ids=x[:, n - 1 :], past_key_values=out1.past_key_values, use_cache=True)
        dec_last = out2.logits[0, -1]
        pdc["full_forward_last_logits"] = flist(full_last)
        pdc["incremental_last_logits"] = flist(dec_last)
        pdc["max_abs_diff"] = fnum(float((dec_last - full_last).abs().max()))
        pdc["cache_class"] = type(out1.past_key_values).__name__
    except Exception as ex:  # record, don't fail the fixture
        pdc["error"] = f"{type(ex).__name__}: {ex}"
    ref["prefill_decode_check"] = pdc

    # --- prompts
    chat_text = tok.apply_chat_template(CHAT_MESSAGES, add_generation_prompt=True, tokenize=False)
    prompts = []
    tokenizer_agrees = nll_ids == nll_raw
    for kind, text in (("plain", PLAIN_PROMPT), ("chat", chat_text)):
        p_ids, p_raw = enc(text)
        tokenizer_agrees = tokenizer_agrees and (p_ids == p_raw)
        xi = torch.tensor([p_ids])
        with torch.no_grad():
            lg = model(input_ids=xi, use_cache=False).logits[0, -1]
        # generate(): greedy, no EOS so exactly 24 tokens come out
        gc = copy.deepcopy(model.generation_config)
        gc.do_sample = False
        gc.temperature = None
        gc.top_p = None
        gc.top_k = None
        gc.eos_token_id = None
        gc.max_new_tokens = 24
        gc.min_new_tokens = None
        gc.pad_token_id = ids["<|endoftext|>"]
        saved_gc = model.generation_config
        model.generation_config = gc
        try:
            with torch.no_grad():
                g = model.generate(
                    input_ids=xi, attention_mask=torch.ones_like(xi), do_sample=False, max_new_tokens=24
                )
        finally:
            model.generation_config = saved_gc
        gen_ids = [int(t) for t in g[0, len(p_ids) :].tolist()]
        man_ids, margins = greedy_manual(model, p_ids, 24)
        ent_last = float(entropy_stats(lg[None])[0])
        entry = {
            "kind": kind,
            "text": text,
            "prompt_token_ids": p_ids,
            "last_logits": flist(lg),
            "last_logits_entropy_nats": fnum(ent_last),
            "last_logits_max_abs": fnum(float(lg.abs().max())),
            "greedy_token_ids": gen_ids,
            "greedy_text": tok.decode(gen_ids, skip_special_tokens=False),
            "greedy_method": "model.generate(do_sample=False, max_new_tokens=24) with generation_config.eos_token_id=None "
            "(no EOS stopping, no logits processors), KV/linear-attention cache on",
            "greedy_matches_no_cache_argmax_loop": gen_ids == man_ids,
            "greedy_top1_top2_margins_no_cache": margins,
        }
        if gen_ids != man_ids:
            entry["greedy_token_ids_no_cache_argmax_loop"] = man_ids
        if kind == "chat":
            entry["messages"] = CHAT_MESSAGES
            entry["render"] = "tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)"
        prompts.append(entry)
        log(
            f"  [{name}] prompt {kind}: {len(p_ids)} tokens, last max|logit| {float(lg.abs().max()):.3f}, "
            f"entropy {ent_last:.3f} nats; greedy==no-cache-argmax: {gen_ids == man_ids}; "
            f"min margin {min(margins):.4f}; greedy text {tok.decode(gen_ids)!r}"
        )
    ref["prompts"] = prompts
    ref["tokenizer_json_agrees_with_hf_tokenizer"] = tokenizer_agrees
    return ref


# ----------------------------------------------------------------------------------------------------------
# bf16-weights references: the same forward with the weights rounded the way `ninfer-convert --experts-dtype bf16
# --dense-dtype bf16` stores them (services/lib/convert/src/plan.rs), so a bf16 artifact can be judged against
# transformers on the *same* weights (the f32 references above differ from it by the weights' rounding alone).
# ----------------------------------------------------------------------------------------------------------

BF16_ROUNDING_RULE = (
    "as ninfer-convert --experts-dtype bf16 --dense-dtype bf16 stores the weights (services/lib/convert/src/plan.rs): "
    "every parameter with >= 2 dims is rounded float32 -> bfloat16 -> float32, round to nearest, ties to even "
    "(tensor.to(torch.bfloat16).to(torch.float32)): embed_tokens, lm_head, attention q/k/v/o_proj, Gated DeltaNet "
    "in_proj_* and out_proj, dense MLP, shared expert gate/up/down_proj, routed experts (fused or per-expert); "
    "EXCEPT, kept float32: every 1-D tensor (RMSNorm weights incl. q_norm/k_norm and the GDN gated norm, A_log, "
    "dt_bias), linear_attn.conv1d.weight, the router mlp.gate.weight and mlp.shared_expert_gate.weight, and the "
    "vision tower model.visual.* (the converter keeps its checkpoint dtype; unused by the text forward). "
    "Activations and the whole forward stay float32."
)


def bf16_rounded(name: str, ndim: int) -> bool:
    """Whether the converter stores checkpoint/parameter `name` (with `ndim` dims) as bf16 (see BF16_ROUNDING_RULE)."""
    if ndim < 2:
        return False
    if name.startswith(("model.visual.", "visual.")):
        return False
    if ".conv1d." in name:
        return False
    if name.endswith((".mlp.gate.weight", ".mlp.shared_expert_gate.weight")):
        return False
    return True


def compute_bf16_reference(model, ref: dict, versions: dict) -> dict:
    """`bf16_weights` entry of reference.json: token NLL of `nll_token_ids` and both prompts' last-position logits
    from a copy of the float32 `model` (as loaded from the fixture directory) whose weights are bf16-rounded."""
    import torch

    nll_ids = ref["nll_token_ids"]

    def nll_of(m):
        with torch.no_grad():
            lg = m(input_ids=torch.tensor([nll_ids]), use_cache=False).logits[0]
        lp = torch.log_softmax(lg.double(), dim=-1)
        return [-float(lp[i - 1, nll_ids[i]]) for i in range(1, len(nll_ids))]

    # The float32 model reproduces the committed f32 references (same loading path; recorded, since another CPU's
    # float32 kernels may differ in the last bits).
    f32_again = nll_of(model)
    f32_repro = max(abs(a - b) for a, b in zip(f32_again, ref["token_nll"]))
    if f32_repro > 1e-3:
        raise RuntimeError(f"float32 reload does not reproduce token_nll (max diff {f32_repro})")

    m = copy.deepcopy(model)
    m.eval()
    rounded, kept_matrices, kept_1d = [], [], 0
    with torch.no_grad():
        for pname, p in m.named_parameters():
            if bf16_rounded(pname, p.dim()):
                p.copy_(p.to(torch.bfloat16).to(torch.float32))
                rounded.append(pname)
            elif p.dim() < 2:
                kept_1d += 1
            elif not pname.startswith(("model.visual.", "visual.")):
                kept_matrices.append(pname)
    routers = [n for n in kept_matrices if n.endswith(".mlp.gate.weight")]
    has_experts = any(n.endswith(".mlp.gate.weight") for n, _ in m.named_parameters())
    if has_experts and (
        not routers or not any(".experts." in n or n.endswith("experts.gate_up_proj") for n in rounded)
    ):
        raise RuntimeError(f"bf16 rounding rule matched no router or no expert tensor: {kept_matrices}")
    if not has_experts and not any(n.endswith(".mlp.down_proj.weight") for n in rounded):
        raise RuntimeError(f"bf16 rounding rule matched no dense MLP tensor: {kept_matrices}")

    token_nll = nll_of(m)
    f32_nll = ref["token_nll"]
    diffs = [abs(a - b) for a, b in zip(token_nll, f32_nll)]
    prompts = []
    for p in ref["prompts"]:
        with torch.no_grad():
            lg = m(input_ids=torch.tensor([p["prompt_token_ids"]]), use_cache=False).logits[0, -1]
        ref_lg = torch.tensor(p["last_logits"], dtype=torch.float64)
        prompts.append(
            {
                "kind": p["kind"],
                "last_logits": flist(lg),
                "last_logits_max_abs_diff_vs_f32_reference": fnum(float((lg.double() - ref_lg).abs().max())),
            }
        )
    entry = {
        "description": "references for the weights rounded to bf16 as the converter's bf16 artifact stores them "
        "(`rounding`), computed like the float32 references above (transformers, float32 forward, eager attention, "
        "eager experts, CPU, from the checkpoint loaded from this directory with from_pretrained, then rounded in "
        "memory): token_nll over nll_token_ids, mean_nll, and each prompt's last-position logits",
        "rounding": BF16_ROUNDING_RULE,
        "transformers_version": versions["transformers"],
        "torch_version": versions["torch"],
        "rounded_parameters": len(rounded),
        "float32_1d_parameters": kept_1d,
        "float32_matrices": sorted(kept_matrices),
        "float32_reload_reproduces_token_nll_max_abs_diff": fnum(f32_repro),
        "token_nll": [fnum(v) for v in token_nll],
        "mean_nll": fnum(sum(token_nll) / len(token_nll)),
        "vs_f32_reference": {
            "mean_abs_token_nll_diff": fnum(sum(diffs) / len(diffs)),
            "max_abs_token_nll_diff": fnum(max(diffs)),
            "mean_nll_diff": fnum(sum(token_nll) / len(token_nll) - sum(f32_nll) / len(f32_nll)),
        },
        "prompts": prompts,
    }
    log(
        f"  bf16 weights: {len(rounded)} rounded, {len(kept_matrices)} matrices + {kept_1d} 1-D kept f32; mean NLL "
        f"{entry['mean_nll']:.6f}; vs f32 reference mean|ΔNLL| {entry['vs_f32_reference']['mean_abs_token_nll_diff']:.3e}"
        f" max {entry['vs_f32_reference']['max_abs_token_nll_diff']:.3e}; f32 reload repro {f32_repro:.2e}"
    )
    return entry


def write_reference(d: str, ref: dict):
    with open(os.path.join(d, "reference.json"), "w", encoding="utf-8") as f:
        json.dump(ref, f, indent=1, ensure_ascii=False)
        f.write("\n")


def add_bf16_references(out_root: str, names: list, versions: dict) -> list:
    """--bf16-references: add/replace `bf16_weights` in each committed fixture's reference.json; nothing else
    changes. Returns the names that failed."""
    import torch
    import transformers as T

    failed = []
    for name in names:
        d = os.path.join(out_root, name)
        log(f"== {name}: bf16-weights references from {d}")
        try:
            with open(os.path.join(d, "reference.json"), encoding="utf-8") as f:
                ref = json.load(f)
            cls = getattr(T, MODEL_CLASS[name])
            model = cls.from_pretrained(
                d, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
            )
            model.eval()
            ref.pop("bf16_weights", None)
            ref["bf16_weights"] = compute_bf16_reference(model, ref, versions)
            write_reference(d, ref)
        except Exception:
            import traceback

            traceback.print_exc()
            failed.append(name)
            log(f"!! {name}: bf16-weights references FAILED")
    return failed


# ----------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------


def text_backbone(model):
    m = model.model
    return m.language_model if hasattr(m, "language_model") else m


def build_fixture(name, out_root, tok_json, ids, vocab, n_tok, template, versions, summary):
    import torch
    import transformers as T
    from safetensors.torch import save_file

    t0 = time.time()
    seed = SEEDS[name]
    log(f"== {name} (seed {seed})")
    cfg = make_config(name, vocab, ids)
    cls = getattr(T, MODEL_CLASS[name])
    torch.manual_seed(seed)
    model = cls._from_config(cfg, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager")
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    rand_report = {}
    randomise_module(model, gen, plain_norms=(name == "qwen3_moe"), report=rand_report)
    # Vocabulary padding rows (ids >= tokenizer size) are zero in embed_tokens and lm_head: their logit is then
    # exactly 0, far below the top of the random logits, so greedy decoding never emits an id the tokenizer lacks.
    with torch.no_grad():
        tb = text_backbone(model)
        tb.embed_tokens.weight[n_tok:].zero_()
        model.lm_head.weight[n_tok:].zero_()
        if name == "qwen4_exp":
            # The embedding rule's N(0, 0.02) would make the PLE blocks all but invisible: unit rows instead.
            for layer in tb.layers:
                if layer.ple is not None:
                    table = layer.ple.ple_embedding.ngram_embedding.weight
                    table.copy_(torch.randn(table.shape, generator=gen, dtype=torch.float32))

    d = os.path.join(out_root, name)
    os.makedirs(d, exist_ok=True)

    # What does transformers' own save_pretrained write? (recorded; its weights file is replaced below)
    with tempfile.TemporaryDirectory() as td:
        from safetensors import safe_open

        try:
            model.save_pretrained(td)
        except Exception as ex:  # record and fall back to the config alone
            log(f"  save_pretrained FAILED: {type(ex).__name__}: {ex}")
            for fn in os.listdir(td):
                os.remove(os.path.join(td, fn))
            model.config.save_pretrained(td)

        hf_files = sorted(os.listdir(td))
        hf_keys = []
        for fn in hf_files:
            if fn.endswith(".safetensors"):
                with safe_open(os.path.join(td, fn), "pt") as f:
                    hf_keys += list(f.keys())
        expert_keys = sorted(k for k in hf_keys if ".experts." in k)
        save_note = {
            "files": hf_files,
            "n_tensors": len(hf_keys),
            "expert_key_samples": expert_keys[:4] + expert_keys[-2:],
            "fused_on_save": any(k.endswith("experts.gate_up_proj") for k in hf_keys),
        }
        with open(os.path.join(td, "config.json"), encoding="utf-8") as f:
            cfg_json = json.load(f)
    log(f"  save_pretrained wrote {save_note}")
    # Release-style spellings (the loader must accept both; the reload below proves transformers does too):
    # transformers 5.17 writes Qwen3-MoE's expert count as `num_local_experts` (attribute_map) and the rope as
    # `rope_parameters`; the released Qwen3-MoE config.json files use `num_experts` and top-level `rope_theta`.
    config_edits = []
    if "num_local_experts" in cfg_json and "num_experts" not in cfg_json:
        cfg_json["num_experts"] = cfg_json.pop("num_local_experts")
        config_edits.append("renamed num_local_experts -> num_experts")
    if name == "qwen3_moe" and "rope_parameters" in cfg_json:
        rp = cfg_json.pop("rope_parameters")
        assert rp == {"rope_type": "default", "rope_theta": ROPE_THETA}, rp
        cfg_json["rope_theta"] = rp["rope_theta"]
        cfg_json["rope_scaling"] = None
        config_edits.append("rope_parameters {rope_type: default, rope_theta} -> top-level rope_theta + rope_scaling null")
    save_note["config_json_edits_after_save_pretrained"] = config_edits
    if config_edits:
        log(f"  config.json edits: {config_edits}")

    # config.json (as transformers wrote it), our safetensors, tokenizer files, generation config
    with open(os.path.join(d, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg_json, f, indent=2, sort_keys=True)
        f.write("\n")
    disk = disk_state_dict(name, model, gen, rand_report)
    save_file(disk, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tok_json)
    with open(os.path.join(d, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_config(ids, template), f, indent=2, ensure_ascii=False)
        f.write("\n")
    with open(os.path.join(d, "chat_template.jinja"), "w", encoding="utf-8", newline="") as f:
        f.write(template)
    with open(os.path.join(d, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump(generation_config(ids, versions["transformers"]), f, indent=2)
        f.write("\n")

    # Re-load from disk (exercises the on-disk layout through transformers' loader) and compare.
    ld_kwargs = dict(dtype=torch.float32, attn_implementation="eager", experts_implementation="eager")
    loaded, info = cls.from_pretrained(d, output_loading_info=True, **ld_kwargs)
    loaded.eval()
    info = {k: sorted(v) if isinstance(v, (set, list)) else str(v) for k, v in info.items()}
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "mismatched_keys") and v}
    if bad:
        raise RuntimeError(f"{name}: loading problems {bad}")
    tok = T.AutoTokenizer.from_pretrained(d)
    x = torch.tensor([tok(NLL_TEXT, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        a = model(input_ids=x, use_cache=False).logits
        b = loaded(input_ids=x, use_cache=False).logits
    reload_diff = float((a - b).abs().max())
    log(f"  reload max|Δlogit| = {reload_diff:.3e}; unexpected keys ignored: {len(info.get('unexpected_keys', []))}")
    if reload_diff > 1e-4:
        raise RuntimeError(f"{name}: reloaded model differs from in-memory model ({reload_diff})")

    extra = {}
    if name in TEXT_ONLY_CLASS:
        # Cross-check: the text-only class loads the multimodal checkpoint (PrefixChange language_model).
        text_only = TEXT_ONLY_CLASS[name]
        try:
            tl = getattr(T, text_only).from_pretrained(d, **ld_kwargs)
            tl.eval()
            with torch.no_grad():
                c = tl(input_ids=x, use_cache=False).logits
            extra[f"text_only_{text_only}_max_abs_diff"] = fnum(float((c - b).abs().max()))
        except Exception as ex:
            extra[f"text_only_{text_only}_error"] = f"{type(ex).__name__}: {ex}"
        log(f"  text-only class cross-check: {extra}")

    meta = {
        "fixture": name,
        "model_class": MODEL_CLASS[name],
        "transformers_version": versions["transformers"],
        "torch_version": versions["torch"],
        "tokenizers_version": versions["tokenizers"],
        "safetensors_version": versions["safetensors"],
        "python_version": platform.python_version(),
        "seeds": {"model": seed, "tokenizer_training": SEEDS["tokenizer"], "torch_num_threads": 1},
        "dtype": "float32",
        "attn_implementation": "eager",
        "experts_implementation": "eager",
        "device": "cpu",
        "references_computed_from": "the checkpoint re-loaded from this directory with from_pretrained",
        "reload_vs_in_memory_max_abs_logit_diff": fnum(reload_diff),
        "load_info": info,
        "randomisation": rand_report,
        "transformers_save_pretrained_behaviour": save_note,
        **extra,
    }
    ref = compute_reference(name, loaded, tok, tok_json, ids, meta)
    ref["tensors"] = {k: list(v.shape) for k, v in sorted(disk.items())}
    if name in NUMPY_CHECKED:
        ref["bf16_weights"] = compute_bf16_reference(loaded, ref, versions)
    write_reference(d, ref)
    st = ref["nll_text_logit_stats"]
    summary[name] = {
        "mean_nll": ref["mean_nll"],
        **st,
        "prefill_decode_max_abs_diff": ref["prefill_decode_check"].get("max_abs_diff"),
        "n_tensors": len(disk),
        "nll_tokens": len(ref["nll_token_ids"]),
        "safetensors_bytes": os.path.getsize(os.path.join(d, "model.safetensors")),
        "greedy_ok": [p["greedy_matches_no_cache_argmax_loop"] for p in ref["prompts"]],
        "config_json": cfg_json,
        "tensor_samples": sample_names(disk),
        "save_note": save_note,
        **(
            {"bf16_weights": {"mean_nll": ref["bf16_weights"]["mean_nll"], **ref["bf16_weights"]["vs_f32_reference"]}}
            if "bf16_weights" in ref
            else {}
        ),
        **extra,
    }
    log(
        f"  mean NLL {ref['mean_nll']:.4f}, max|logit| {st['max_abs_logit']:.3f}, mean entropy "
        f"{st['mean_entropy_nats']:.3f} (log V {st['log_vocab_nats']:.3f}), prefill/decode diff "
        f"{summary[name]['prefill_decode_max_abs_diff']}, {time.time() - t0:.1f}s"
    )


def sample_names(disk: dict) -> list:
    keys = sorted(disk)
    picks = []
    want = [
        "embed_tokens",
        "layers.0.",
        "layers.1.mlp",
        "layers.2.",
        "experts.0.",
        "experts.gate_up_proj",
        "experts.down_proj",
        "linear_attn",
        "shared_expert",
        "visual",
        "mtp.",
        "ngram_embedding.shard",
        "hyper_connection",
        "indexer",
        "lm_head",
        "norm.weight",
    ]
    for w in want:
        hits = [k for k in keys if w in k and k not in picks][:2]
        picks += hits
    return [f"{k} {list(disk[k].shape)}" for k in picks]


QWEN3_5_BULLET = (
    "`qwen3_5`: the dense Qwen3.5/3.6 (every layer a dense SwiGLU MLP of width 96, no experts), built as "
    "`Qwen3_5ForConditionalGeneration` with the same tiny vision config and saved in the same multimodal release "
    "layout as `qwen3_5_moe` (`model_type` qwen3_5, text config `qwen3_5_text` under `text_config`, `layer_types` "
    "[linear, linear, full, linear], `mrope_section` [2,1,1], `mtp_num_hidden_layers` 1, text weights "
    "`model.language_model.*`, dense MLPs `...mlp.{gate,up,down}_proj.weight`). Random MTP block `mtp.*` whose "
    "layer is a full-attention layer with a dense MLP. Generated alone (`--only qwen3_5`, after the other three), "
    "so its figures are in `qwen3_5/README.md`."
)


def text_only_lines(name: str, s: dict) -> list:
    """README lines on the text-only class cross-check of a multimodal fixture (none for the others)."""
    text_only = TEXT_ONLY_CLASS.get(name)
    if text_only is None:
        return []
    if f"text_only_{text_only}_max_abs_diff" in s:
        return ["", f"`{text_only}.from_pretrained` (text-only class) on this directory gives the same logits "
                f"(max diff {s[f'text_only_{text_only}_max_abs_diff']})."]
    if f"text_only_{text_only}_error" in s:
        return ["", f"`{text_only}.from_pretrained` on this directory failed: "
                f"`{s[f'text_only_{text_only}_error'][:300]}`"]
    return []


def write_fixture_readme(out_root, name, versions, summary, argv):
    """README.md inside one fixture directory: what it is and its figures (for a fixture generated alone)."""
    s = summary[name]
    b = s["bf16_weights"]
    lines = [
        f"# Golden fixture `{name}`",
        "",
        "Generated by `scripts/make_fixtures.py`; do not edit by hand. Regenerate with (repo root, torch + "
        "transformers 5.17 installed; CPU is enough and is what was used):",
        "",
        "```",
        f"CUDA_VISIBLE_DEVICES= python3 scripts/make_fixtures.py --out tests/fixtures --only {name}",
        "```",
        "",
        f"Versions used: transformers {versions['transformers']}, torch {versions['torch']}, tokenizers "
        f"{versions['tokenizers']}, safetensors {versions['safetensors']}, Python {platform.python_version()}. "
        f"Model seed {SEEDS[name]}; the tokenizer (seed {SEEDS['tokenizer']}) and every other convention — files, "
        "dims, weight randomisation, `reference.json` fields, bf16 rounding, the numpy `--check` — are those of "
        "`../README.md`.",
        "",
        "* " + QWEN3_5_BULLET.replace(" so its figures are in `qwen3_5/README.md`.", " so its figures are here."),
        "",
        "| mean NLL (nats) | max abs logit | mean logit std | mean entropy (nats) | log V | prefill/decode max diff "
        "| tensors | model.safetensors bytes |",
        "|---|---|---|---|---|---|---|---|",
        f"| {s['mean_nll']} | {s['max_abs_logit']} | {s['mean_std_logit_per_position']} | {s['mean_entropy_nats']} | "
        f"{s['log_vocab_nats']} | {s['prefill_decode_max_abs_diff']} | {s['n_tensors']} | {s['safetensors_bytes']} |",
        "",
        "bf16-rounded weights (`bf16_weights`): mean NLL "
        f"{b['mean_nll']} (− f32 mean NLL: {b['mean_nll_diff']}), mean abs ΔNLL per token "
        f"{b['mean_abs_token_nll_diff']}, max {b['max_abs_token_nll_diff']}.",
        "",
        "Tensor name samples (on disk):",
        "",
    ]
    lines += [f"* `{t}`" for t in s["tensor_samples"]]
    lines += text_only_lines(name, s)
    lines += ["", f"Command line of this generation: `{' '.join(argv)}`", ""]
    with open(os.path.join(out_root, name, "README.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines))


def write_qwen4_exp_readme(out_root, versions, summary, argv):
    """README.md of the qwen4_exp fixture: what it exercises and its figures."""
    s = summary["qwen4_exp"]
    lines = [
        "# Golden fixture `qwen4_exp`",
        "",
        "Generated by `scripts/make_fixtures.py`; do not edit by hand. Regenerate with (repo root, torch + "
        "transformers 5.17 installed; CPU is enough and is what was used):",
        "",
        "```",
        "CUDA_VISIBLE_DEVICES= python3 scripts/make_fixtures.py --out tests/fixtures --only qwen4_exp",
        "```",
        "",
        f"Versions used: transformers {versions['transformers']}, torch {versions['torch']}, tokenizers "
        f"{versions['tokenizers']}, safetensors {versions['safetensors']}, Python {platform.python_version()}. "
        f"Model seed {SEEDS['qwen4_exp']}; tokenizer, files and weight randomisation as in `../README.md`, except "
        "that the n-gram tables are N(0, 1) (the embedding rule's N(0, 0.02) would hide the PLE blocks).",
        "",
        "Built as `Qwen4ExpForConditionalGeneration` (tiny vision tower) and saved in the multimodal release layout "
        "(`model_type` qwen4_exp, text config `qwen4_exp_text` under `text_config`, text weights "
        "`model.language_model.*`, fused routed experts, the PLE hash buffers as int64 tensors). Text model: hidden "
        f"{H}, 4 layers [linear, QSA, linear, QSA], heads {NH}/{NKV}, head_dim {HD}, partial rotary 0.25 (rot 8), "
        f"{Q4_HC} residual streams with mixer rank {Q4_HC_RANK}, QSA indexer {Q4_INDEXER_HEADS} heads of "
        f"{Q4_INDEXER_DIM}, budget {Q4_BUDGET}, compress ratio {Q4_RATIO} (dense up to {Q4_BUDGET + Q4_RATIO - 1} "
        f"visible tokens), PLE on layer ids {Q4_PLE_IDS} (embed {Q4_PLE_DIM}, trigram hashing, 2 heads per n-gram, "
        f"table base {Q4_NGRAM_BASE}, rows padded to {Q4_NGRAM_DIVISOR}), each n-gram table split into "
        f"{Q4_SPLIT_PARTS} row shards `...ngram_embedding.shard_{{i}}.weight`, GDN output gate sigmoid, experts "
        f"{E} top-{TOPK} of width {Q4_IM} plus a shared expert of {IS}, eos `<|im_end|>` "
        "(the NLL text holds two).",
        "",
        "References as in `../README.md` (float32, eager attention, eager experts, CPU, from the checkpoint re-loaded "
        "from this directory), with `QWEN4_EXP_NLL_TEXT` as the NLL text. There are no `bf16_weights` references and "
        "the numpy `--check` does not cover this architecture.",
        "",
        "| NLL tokens | mean NLL (nats) | max abs logit | mean entropy (nats) | log V | prefill/decode max diff | "
        "tensors | model.safetensors bytes |",
        "|---|---|---|---|---|---|---|---|",
        f"| {s['nll_tokens']} | {s['mean_nll']} | {s['max_abs_logit']} | {s['mean_entropy_nats']} | "
        f"{s['log_vocab_nats']} | {s['prefill_decode_max_abs_diff']} | {s['n_tensors']} | {s['safetensors_bytes']} |",
        "",
        "Tensor name samples (on disk):",
        "",
    ]
    lines += [f"* `{t}`" for t in s["tensor_samples"]]
    lines += text_only_lines("qwen4_exp", s)
    lines += ["", f"Command line of this generation: `{' '.join(argv)}`", ""]
    with open(os.path.join(out_root, "qwen4_exp", "README.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines))


def write_readme(out_root, versions, summary, vocab, n_bpe, ids, argv):
    lines = []
    A = lines.append
    A("# Golden fixtures (tiny random Qwen MoE checkpoints)")
    A("")
    A("Generated by `scripts/make_fixtures.py`; do not edit by hand. Regenerate with (repo root, torch +")
    A("transformers 5.17 installed; CPU is enough and is what was used):")
    A("")
    A("```")
    A("CUDA_VISIBLE_DEVICES= python3 scripts/make_fixtures.py --out tests/fixtures")
    A("CUDA_VISIBLE_DEVICES= python3 scripts/make_fixtures.py --bf16-references   # only (re)compute `bf16_weights`")
    A("```")
    A("")
    A(f"Versions used: transformers {versions['transformers']}, torch {versions['torch']}, tokenizers "
      f"{versions['tokenizers']}, safetensors {versions['safetensors']}, Python {platform.python_version()}.")
    A(f"Seeds: tokenizer training {SEEDS['tokenizer']} (BPE training is deterministic), models "
      f"qwen3_moe {SEEDS['qwen3_moe']}, qwen3_next {SEEDS['qwen3_next']}, qwen3_5_moe {SEEDS['qwen3_5_moe']} "
      "(`torch.Generator().manual_seed(seed)`, parameters re-randomised in sorted module-name order); "
      "`torch.set_num_threads(1)`.")
    A("")
    A("Everything is float32: weights on disk, and the references were computed with transformers in float32, "
      "`attn_implementation=\"eager\"`, `experts_implementation=\"eager\"`, on CPU, from the checkpoint *re-loaded "
      "from the fixture directory* with `from_pretrained` (so the on-disk layout is proven loadable by transformers; "
      "the re-loaded model's logits equal the in-memory model's, recorded as `reload_vs_in_memory_max_abs_logit_diff`).")
    A("")
    A("`reference.json` → `bf16_weights` repeats the NLL and last-logits references for the same weights rounded to "
      "bf16 the way the converter's bf16 artifact stores them (below); the forward is float32 there too. "
      "`--bf16-references` adds it to the committed fixtures from their `model.safetensors` and changes nothing "
      "else; a full regeneration writes it as well.")
    A("")
    A("## Files in each fixture directory")
    A("")
    A("| file | content |")
    A("|---|---|")
    A("| `config.json` | written by transformers' `save_pretrained` (all `__post_init__` keys included) |")
    A("| `model.safetensors` | float32 weights, written by the script (layouts below), metadata `format=pt` |")
    A("| `tokenizer.json` | the shared byte-level BPE (same file in all four) |")
    A("| `tokenizer_config.json` | `tokenizer_class` Qwen2Tokenizer, `eos_token` `<|im_end|>`, `pad_token` `<|endoftext|>`, `chat_template` = Qwen3.5 template |")
    A("| `chat_template.jinja` | byte-identical copy of `tests/fixtures/qwen3_5_chat_template.jinja` (the template released with Qwen3.5, sha256 a4aee8af…f715) |")
    A("| `generation_config.json` | eos `[<|im_end|>, <|endoftext|>]`, temperature 0.6, top_p 0.95, top_k 20, do_sample true |")
    A("| `reference.json` | references (below) + provenance + `tensors` (name → shape of every tensor in model.safetensors) |")
    A("")
    A("## Tokenizer")
    A("")
    A(f"Byte-level BPE trained with `tokenizers` on ~4 KB of English embedded in the script (`TRAIN_TEXT`), "
      f"trainer vocab {BPE_TRAIN_VOCAB} (256 byte symbols + merges, min_frequency 2) → {n_bpe} BPE tokens, then "
      f"{len(ADDED_TOKENS)} added tokens → {n_bpe + len(ADDED_TOKENS)} tokens; model `vocab_size` = {vocab} "
      "(rounded up to a multiple of 64; ids past the tokenizer are never produced but have logits). Pipeline = "
      "transformers' Qwen2Tokenizer: NFC normaliser, `Split(Qwen2 regex, isolated)` + `ByteLevel(add_prefix_space="
      "false, use_regex=false)` pre-tokenizer, ByteLevel decoder, no post-processor. (transformers 5 rebuilds "
      "Qwen2Tokenizer from vocab/merges with exactly this pipeline; `reference.json` records "
      "`tokenizer_json_agrees_with_hf_tokenizer` = raw `tokenizers` encoding of tokenizer.json equals the HF "
      "tokenizer's for every reference text.)")
    A("")
    A("Added tokens (id, special):")
    A("")
    A(", ".join(f"`{c}` {ids[c]} ({'special' if s else 'not special'})" for c, s in ADDED_TOKENS))
    A("")
    A("## Model dims (all four)")
    A("")
    A(f"hidden {H}, 4 layers, heads {NH}, kv heads {NKV}, head_dim {HD}, dense intermediate {I_DENSE}, experts {E}, "
      f"top-k {TOPK}, moe_intermediate {IM}, shared_expert_intermediate {IS} (Next/3.5), linear k-heads {NK}, "
      f"v-heads {NV}, linear key/value head dim {DK}/{DV}, conv kernel {KC}, rope_theta {ROPE_THETA:g} "
      f"(partial_rotary_factor 0.25 for Next/3.5 → rot 8; Qwen3-MoE full rot), rms_norm_eps {EPS:g}, "
      f"max_position_embeddings {MAX_POS}, tie_word_embeddings false, vocab {vocab}.")
    A("")
    A("* `qwen3_moe`: `Qwen3MoeForCausalLM`, `norm_topk_prob` false, `mlp_only_layers` [1] (layer 1 dense MLP), "
      "explicit `head_dim` 32. Experts **per-expert** on disk.")
    A("* `qwen3_next`: `Qwen3NextForCausalLM`, `layer_types` [linear, linear, full, linear], `norm_topk_prob` true, "
      "`mlp_only_layers` [1], nk=2 / nv=4 (r=2: grouped `in_proj_qkvz` / `in_proj_ba` re-ordering exercised). "
      "Experts **per-expert** on disk.")
    A("* `qwen3_5_moe`: built as `Qwen3_5MoeForConditionalGeneration` (real class, tiny vision config: depth 1, "
      "hidden 32, 2 heads, patch 8, temporal patch 2, merge 2, out_hidden 64, 16 position embeddings) and saved in "
      "the multimodal release layout: `model_type` qwen3_5_moe, text config under `text_config` (model_type "
      "qwen3_5_moe_text, `layer_types` [linear, full, linear, full], `mrope_section` [2,1,1], "
      "`mtp_num_hidden_layers` 1), text weights `model.language_model.*`, vision `model.visual.*` (real, random), "
      "`lm_head.weight` top level, routed experts **fused** (`...mlp.experts.gate_up_proj [E, 2·Im, H]`, "
      "`...mlp.experts.down_proj [E, H, Im]`, no `.weight`; gate = first Im rows). Random MTP block `mtp.*` "
      "(the MTP tensor names of docs/MODELS.md; `mtp.layers.0` is a full-attention layer with **per-expert** experts, shared expert "
      "and router). transformers ignores `mtp.*` (and the text-only class ignores `model.visual.*`), so the "
      "references do not involve them; there is no MTP reference.")
    A("* " + QWEN3_5_BULLET)
    A("")
    A(f"Vocabulary padding rows (ids {n_bpe + len(ADDED_TOKENS)}..{vocab - 1}) of `embed_tokens` and `lm_head` are zero, "
      "so their logits are exactly 0 and greedy decoding never produces them.")
    A("")
    A("## Weight randomisation")
    A("")
    A("After construction every parameter is re-drawn (float32): linear weights N(0, 1/fan_in) (std 1/sqrt(fan_in)); "
      f"expert tensors the same per expert matrix; router N(0, ({ROUTER_GAIN}/sqrt(H))²); `embed_tokens` N(0,1); "
      f"`lm_head` std {LM_HEAD_GAIN}/sqrt(H) (logit std ≈ {LM_HEAD_GAIN}); plain RMSNorm weights (Qwen3-MoE) "
      "1+0.1·N; zero-centred (1+w) RMSNorms (Next/3.5: layer norms, final norm, q_norm/k_norm, MTP norms) 0.1·N; "
      "GDN gated norm (plain w) 1+0.1·N; GDN conv1d 0.5·N; `A_log` = log U(0.1, 2); `dt_bias` 0.5·N; LayerNorm "
      "(vision) w 1+0.1·N, b 0.1·N; biases 0.02·N; vision patch/pos embeddings 0.02·N. Counts per rule are in "
      "`reference.json` → `randomisation`.")
    A("")
    A("## reference.json")
    A("")
    A("* `nll_text`, `nll_token_ids` (HF tokenizer, no special tokens), `token_nll[i-1]` = −log p(token_i | "
      "tokens_<i) for i = 1..n−1 (log-softmax in float64 of the float32 logits), `mean_nll`, "
      "`nll_text_logit_stats` (max |logit|, mean per-position logit std, mean entropy vs log V).")
    A("* `prompts[0]` plain text, `prompts[1]` chat: `text` is the rendered string of "
      "`apply_chat_template(messages, add_generation_prompt=True, tokenize=False)` (ends with "
      "`<|im_start|>assistant\\n<think>\\n`), `prompt_token_ids`, `last_logits` (all `vocab_size` logits of the last "
      "prompt position), `greedy_token_ids` (24 tokens from `generate(do_sample=False, max_new_tokens=24)` with "
      "`generation_config.eos_token_id=None`, so exactly 24 tokens and no logits processor), "
      "`greedy_matches_no_cache_argmax_loop` (the same 24 tokens from a plain argmax loop with full re-forward), "
      "`greedy_top1_top2_margins_no_cache` (how far each greedy pick is from a tie).")
    A("* `nll_text_hidden_states`: residual stream at positions 0 and n−1 of the NLL text: embeddings, the output of each "
      "decoder layer, and the final-norm output (for layer-by-layer debugging).")
    A("* `prefill_decode_check`: last-position logits of the NLL text from the full forward and from prefill n−1 "
      "tokens + 1 decode step through the cache (GDN: chunked prefill then recurrent step), and their max |diff|.")
    A("* `bf16_weights`: references for the weights rounded as `ninfer-convert --experts-dtype bf16 --dense-dtype "
      "bf16` stores them (`rounding` states the rule: every weight tensor with ≥ 2 dims f32 → bf16 → f32, round to "
      "nearest even, i.e. `tensor.to(torch.bfloat16).to(torch.float32)`, except 1-D tensors (norm weights, `A_log`, "
      "`dt_bias`), `linear_attn.conv1d.weight`, the router `mlp.gate.weight` and `mlp.shared_expert_gate.weight`, "
      "which stay f32, as in the artifact), computed like the f32 references (transformers, float32 forward, eager, "
      "CPU): `token_nll`, `mean_nll`, `prompts[i].last_logits`; plus `vs_f32_reference` (how far the rounding alone "
      "moves the NLL), `float32_matrices` (the ≥ 2-D weights kept f32), parameter counts and versions. The engine's "
      "golden test judges its bf16 artifact against these and only prints its drift from the f32 references.")
    A(f"* floats are written with {FLOAT_DIGITS} significant digits.")
    A("")
    A("## Independent check")
    A("")
    A("`python3 scripts/make_fixtures.py --check` (numpy + safetensors only, no torch) re-implements the forward "
      "pass of docs/MODELS.md in float64 directly on the fixture files (per-expert and fused expert "
      "layouts, Qwen3-Next grouped `in_proj_qkvz`/`in_proj_ba`, GDN recurrence, gated attention, partial RoPE) and "
      "compares `token_nll`, `nll_text_hidden_states` and both prompts' `last_logits` with the references "
      "(tolerance 1e-3; observed max differences ~1e-5, i.e. float32 rounding of transformers' forward). It "
      "repeats the forward with the weights bf16-rounded by the same rule (`bf16_rounded()`, numpy bit-level "
      "round-to-nearest-even) and compares `bf16_weights.token_nll` and its `last_logits` likewise (observed ~1e-5).")
    A("")
    A("## Results")
    A("")
    A("| fixture | mean NLL (nats) | max abs logit | mean logit std | mean entropy (nats) | log V | prefill/decode max diff | tensors | model.safetensors bytes |")
    A("|---|---|---|---|---|---|---|---|---|")
    for n in FIXTURES:
        s = summary[n]
        A(f"| {n} | {s['mean_nll']} | {s['max_abs_logit']} | {s['mean_std_logit_per_position']} | "
          f"{s['mean_entropy_nats']} | {s['log_vocab_nats']} | {s['prefill_decode_max_abs_diff']} | "
          f"{s['n_tensors']} | {s['safetensors_bytes']} |")
    A("")
    A("bf16-rounded weights (`bf16_weights`), and how far the rounding alone moves the per-token NLL from the f32 "
      "references:")
    A("")
    A("| fixture | mean NLL, bf16 weights (nats) | mean NLL − f32 mean NLL | mean abs ΔNLL per token | max abs ΔNLL per token |")
    A("|---|---|---|---|---|")
    for n in FIXTURES:
        b = summary[n]["bf16_weights"]
        A(f"| {n} | {b['mean_nll']} | {b['mean_nll_diff']} | {b['mean_abs_token_nll_diff']} | "
          f"{b['max_abs_token_nll_diff']} |")
    A("")
    for n in FIXTURES:
        s = summary[n]
        A(f"### {n}: tensor name samples (on disk)")
        A("")
        for t in s["tensor_samples"]:
            A(f"* `{t}`")
        sn = s["save_note"]
        A("")
        A(f"transformers' own `save_pretrained` (not used for the weights) would write "
          f"{'FUSED' if sn['fused_on_save'] else 'PER-EXPERT'} experts, e.g. " +
          ", ".join(f"`{k}`" for k in sn["expert_key_samples"][:3]) + ".")
        if sn.get("config_json_edits_after_save_pretrained"):
            A("")
            A("`config.json` edits after `save_pretrained` (release-style spellings; transformers re-loads it "
              "identically): " + "; ".join(sn["config_json_edits_after_save_pretrained"]) + ".")
        lines.extend(text_only_lines(n, s))
        A("")
    A(f"Command line of this generation: `{' '.join(argv)}`")
    A("")
    with open(os.path.join(out_root, "README.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines))


# ----------------------------------------------------------------------------------------------------------
# Independent check (numpy + safetensors only, no torch/transformers): re-implements the forward pass from
# docs/MODELS.md in float64 directly on the fixture files and compares with reference.json.
# ----------------------------------------------------------------------------------------------------------


def bf16_round_np(a):
    """float32 array -> nearest bfloat16 (ties to even), returned as float32 (finite inputs)."""
    import numpy as np

    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


def numpy_forward(fixture_dir: str, name: str, ids: list, bf16_weights: bool = False):
    """float64 forward on the fixture files; bf16_weights=True first rounds the weights by bf16_rounded()."""
    import numpy as np
    from safetensors.numpy import load_file

    def rms(x, eps):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)

    def silu(x):
        return x / (1 + np.exp(-x))

    def sigmoid(x):
        return 1 / (1 + np.exp(-x))

    def softplus(x):
        return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))

    def rope(x, pos, rot, theta):  # x [L, heads, hd]; rotate-half on the first `rot` dims
        inv = 1.0 / theta ** (np.arange(0, rot, 2, dtype=np.float64) / rot)
        f = pos[:, None] * inv[None]
        c, s_ = np.cos(f)[:, None], np.sin(f)[:, None]
        a, b = x[..., : rot // 2], x[..., rot // 2 : rot]
        out = x.copy()
        out[..., : rot // 2] = a * c - b * s_
        out[..., rot // 2 : rot] = b * c + a * s_
        return out

    W = {
        k: (bf16_round_np(v) if bf16_weights and bf16_rounded(k, v.ndim) else v).astype(np.float64)
        for k, v in load_file(os.path.join(fixture_dir, "model.safetensors")).items()
    }
    with open(os.path.join(fixture_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    if name in MULTIMODAL:
        cfg, pre = cfg["text_config"], "model.language_model."
    else:
        pre = "model."
    plain = name == "qwen3_moe"
    if "rope_parameters" in cfg:
        theta = cfg["rope_parameters"]["rope_theta"]
        prf = cfg["rope_parameters"].get("partial_rotary_factor", 1.0)
    else:
        theta, prf = cfg["rope_theta"], cfg.get("partial_rotary_factor", 1.0)
    if plain:
        prf = 1.0  # Qwen3-MoE ignores partial_rotary_factor
    eps = cfg["rms_norm_eps"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def nrm(x, w):
        return rms(x, eps) * (w if plain else (1 + w))

    def attn(x, p):
        L = x.shape[0]
        if plain:
            q = (x @ W[p + "q_proj.weight"].T).reshape(L, nh, hd)
        else:
            qg = (x @ W[p + "q_proj.weight"].T).reshape(L, nh, 2 * hd)
            q, gate = qg[..., :hd], qg[..., hd:].reshape(L, nh * hd)
        k = (x @ W[p + "k_proj.weight"].T).reshape(L, nkv, hd)
        v = (x @ W[p + "v_proj.weight"].T).reshape(L, nkv, hd)
        q, k = nrm(q, W[p + "q_norm.weight"]), nrm(k, W[p + "k_norm.weight"])
        pos = np.arange(L, dtype=np.float64)
        rot = int(hd * prf)
        q, k = rope(q, pos, rot, theta), rope(k, pos, rot, theta)
        o = np.zeros((L, nh, hd))
        mask = np.triu(np.full((L, L), -np.inf), 1)
        for h in range(nh):
            sc = q[:, h] @ k[:, h // (nh // nkv)].T * hd**-0.5 + mask
            sc = np.exp(sc - sc.max(-1, keepdims=True))
            o[:, h] = (sc / sc.sum(-1, keepdims=True)) @ v[:, h // (nh // nkv)]
        o = o.reshape(L, nh * hd)
        if not plain:
            o = o * sigmoid(gate)
        return o @ W[p + "o_proj.weight"].T

    def gdn(x, p):
        L = x.shape[0]
        nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
        dk, dv, kc = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]
        r = nv // nk
        if name == "qwen3_next":  # grouped-by-key-head layout
            qkvz = (x @ W[p + "in_proj_qkvz.weight"].T).reshape(L, nk, 2 * dk + 2 * r * dv)
            q_, k_ = qkvz[..., :dk].reshape(L, -1), qkvz[..., dk : 2 * dk].reshape(L, -1)
            v_ = qkvz[..., 2 * dk : 2 * dk + r * dv].reshape(L, -1)
            z = qkvz[..., 2 * dk + r * dv :].reshape(L, nv, dv)
            ba = (x @ W[p + "in_proj_ba.weight"].T).reshape(L, nk, 2 * r)
            b, a = ba[..., :r].reshape(L, nv), ba[..., r:].reshape(L, nv)
            qkv = np.concatenate([q_, k_, v_], -1)
        else:
            qkv = x @ W[p + "in_proj_qkv.weight"].T
            z = (x @ W[p + "in_proj_z.weight"].T).reshape(L, nv, dv)
            b, a = x @ W[p + "in_proj_b.weight"].T, x @ W[p + "in_proj_a.weight"].T
        cw = W[p + "conv1d.weight"][:, 0]
        padded = np.concatenate([np.zeros((kc - 1, qkv.shape[1])), qkv], 0)
        y = silu(np.stack([(padded[t : t + kc] * cw.T).sum(0) for t in range(L)]))
        q = np.repeat(y[:, : nk * dk].reshape(L, nk, dk), r, axis=1)
        k = np.repeat(y[:, nk * dk : 2 * nk * dk].reshape(L, nk, dk), r, axis=1)
        v = y[:, 2 * nk * dk :].reshape(L, nv, dv)
        beta = sigmoid(b)
        g = -np.exp(W[p + "A_log"]) * softplus(a + W[p + "dt_bias"])
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * dk**-0.5
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
        o = np.zeros((L, nv, dv))
        for h in range(nv):
            S = np.zeros((dk, dv))
            for t in range(L):
                S = np.exp(g[t, h]) * S
                u = beta[t, h] * (v[t, h] - S.T @ k[t, h])
                S = S + np.outer(k[t, h], u)
                o[t, h] = S.T @ q[t, h]
        o = rms(o, eps) * W[p + "norm.weight"] * silu(z)
        return o.reshape(L, nv * dv) @ W[p + "out_proj.weight"].T

    def mlp(x, p):
        return (silu(x @ W[p + "gate_proj.weight"].T) * (x @ W[p + "up_proj.weight"].T)) @ W[p + "down_proj.weight"].T

    def moe(x, p):
        logits = x @ W[p + "gate.weight"].T
        pr = np.exp(logits - logits.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        renorm = cfg.get("norm_topk_prob", True) if name != "qwen3_5_moe" else True
        out = np.zeros_like(x)
        for t in range(x.shape[0]):
            idx = np.argsort(-pr[t], kind="stable")[: cfg["num_experts_per_tok"]]
            w = pr[t, idx] / (pr[t, idx].sum() if renorm else 1.0)
            for e, we in zip(idx, w):
                if p + "experts.gate_up_proj" in W:  # fused [E, 2Im, H]: gate = first half
                    gu = W[p + "experts.gate_up_proj"][e]
                    G, U, Dn = gu[: gu.shape[0] // 2], gu[gu.shape[0] // 2 :], W[p + "experts.down_proj"][e]
                else:
                    G, U, Dn = (W[f"{p}experts.{e}.{n}_proj.weight"] for n in ("gate", "up", "down"))
                out[t] += we * ((silu(x[t] @ G.T) * (x[t] @ U.T)) @ Dn.T)
        if p + "shared_expert_gate.weight" in W:
            out += sigmoid(x @ W[p + "shared_expert_gate.weight"].T) * mlp(x, p + "shared_expert.")
        return out

    h = W[pre + "embed_tokens.weight"][ids]
    hidden = [h]
    layer_types = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"{pre}layers.{i}."
        x = nrm(h, W[p + "input_layernorm.weight"])
        h = h + (attn(x, p + "self_attn.") if layer_types[i] == "full_attention" else gdn(x, p + "linear_attn."))
        x = nrm(h, W[p + "post_attention_layernorm.weight"])
        dense = name == "qwen3_5" or i in (cfg.get("mlp_only_layers") or [])
        h = h + (mlp(x, p + "mlp.") if dense else moe(x, p + "mlp."))
        hidden.append(h)
    h = nrm(h, W[pre + "norm.weight"])
    hidden.append(h)
    return h @ W["lm_head.weight"].T, hidden


def check_fixtures(out_root: str, names=None) -> bool:
    import numpy as np

    ok = True
    for name in names or NUMPY_CHECKED:
        d = os.path.join(out_root, name)
        with open(os.path.join(d, "reference.json"), encoding="utf-8") as f:
            ref = json.load(f)
        ids = ref["nll_token_ids"]
        lg, hidden = numpy_forward(d, name, ids)
        lp = lg - lg.max(-1, keepdims=True)
        lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
        nll = np.array([-lp[i - 1, ids[i]] for i in range(1, len(ids))])
        d_nll = float(np.abs(nll - np.array(ref["token_nll"])).max())
        hs = ref["nll_text_hidden_states"]
        d_h = max(
            float(np.abs(hidden[j][pos] - np.array(hs["values"][j][pi])).max())
            for j in range(len(hidden))
            for pi, pos in enumerate(hs["positions"])
        )
        d_p = []
        for pr in ref["prompts"]:
            lgp, _ = numpy_forward(d, name, pr["prompt_token_ids"])
            d_p.append(float(np.abs(lgp[-1] - np.array(pr["last_logits"])).max()))
        good = d_nll < 1e-3 and d_h < 1e-3 and max(d_p) < 1e-3
        ok = ok and good
        log(
            f"{name}: numpy(f64) vs reference: max|Δtoken_nll| {d_nll:.2e}, max|Δhidden| {d_h:.2e}, "
            f"max|Δlast_logits| plain {d_p[0]:.2e} chat {d_p[1]:.2e}, mean NLL {nll.mean():.6f} vs {ref['mean_nll']} "
            f"-> {'OK' if good else 'MISMATCH'}"
        )
        b16 = ref.get("bf16_weights")
        if b16 is None:
            log(f"{name}: no bf16_weights references (run --bf16-references) -> MISSING")
            ok = False
            continue
        lg, _ = numpy_forward(d, name, ids, bf16_weights=True)
        lp = lg - lg.max(-1, keepdims=True)
        lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
        nll16 = np.array([-lp[i - 1, ids[i]] for i in range(1, len(ids))])
        d_nll16 = float(np.abs(nll16 - np.array(b16["token_nll"])).max())
        d_p16 = []
        for pr, pr16 in zip(ref["prompts"], b16["prompts"]):
            lgp, _ = numpy_forward(d, name, pr["prompt_token_ids"], bf16_weights=True)
            d_p16.append(float(np.abs(lgp[-1] - np.array(pr16["last_logits"])).max()))
        good16 = d_nll16 < 1e-3 and max(d_p16) < 1e-3
        ok = ok and good16
        log(
            f"{name}: numpy(f64, bf16-rounded weights) vs bf16_weights: max|Δtoken_nll| {d_nll16:.2e}, "
            f"max|Δlast_logits| plain {d_p16[0]:.2e} chat {d_p16[1]:.2e}, mean NLL {nll16.mean():.6f} vs "
            f"{b16['mean_nll']} (f32 weights {ref['mean_nll']}; mean|ΔNLL| bf16 vs f32 weights "
            f"{float(np.abs(nll16 - np.array(ref['token_nll'])).mean()):.3e}) -> {'OK' if good16 else 'MISMATCH'}"
        )
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(REPO, "tests", "fixtures"))
    ap.add_argument("--tar", default=None, help="also write a .tar.gz of the generated files")
    ap.add_argument("--only", default=None, help="comma-separated subset of fixtures (debug)")
    ap.add_argument(
        "--check",
        action="store_true",
        help="only verify existing fixtures with the independent numpy forward (needs numpy + safetensors, no torch)",
    )
    ap.add_argument(
        "--bf16-references",
        action="store_true",
        help="only add/replace the `bf16_weights` references (bf16-rounded weights) in each existing fixture's "
        "reference.json, from its committed model.safetensors; nothing else is changed (needs torch + transformers)",
    )
    args = ap.parse_args()
    if args.check:
        sys.exit(0 if check_fixtures(args.out) else 1)
    names = list(FIXTURES)
    if args.only:
        names = [n for n in names if n in args.only.split(",")]

    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    import safetensors
    import tokenizers
    import torch
    import transformers

    torch.set_num_threads(1)
    versions = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "tokenizers": tokenizers.__version__,
        "safetensors": safetensors.__version__,
    }
    log(f"versions: {versions}")
    if args.bf16_references:
        names = [n for n in names if n in NUMPY_CHECKED]
        failed = add_bf16_references(args.out, names, versions)
        if names == NUMPY_CHECKED and not failed and not check_fixtures(args.out):
            failed.append("numpy-check")
        if failed:
            log(f"FAILED: {failed}")
        sys.exit(1 if failed else 0)
    with open(TEMPLATE_PATH, encoding="utf-8", newline="") as f:
        template = f.read()
    log(f"chat template sha256 {hashlib.sha256(template.encode()).hexdigest()}")

    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as td:
        tok_json, ids, size, n_bpe = build_tokenizer(td)
    vocab = ((size + 63) // 64) * 64
    log(f"tokenizer: {n_bpe} BPE + {len(ADDED_TOKENS)} added = {size}; vocab_size {vocab}; ids {ids}")

    summary = {}
    failed = []
    for n in names:
        try:
            build_fixture(n, args.out, tok_json, ids, vocab, size, template, versions, summary)
        except Exception:
            import traceback

            traceback.print_exc()
            failed.append(n)
            log(f"!! fixture {n} FAILED")
    checked = [n for n in names if n in NUMPY_CHECKED]
    if not failed and checked and not check_fixtures(args.out, checked):
        failed.append("numpy-check")
    if "qwen4_exp" in summary:
        write_qwen4_exp_readme(args.out, versions, summary, ["python3", "scripts/make_fixtures.py"] + sys.argv[1:])
    if "qwen3_5" in summary:
        write_fixture_readme(args.out, "qwen3_5", versions, summary,
                             ["python3", "scripts/make_fixtures.py"] + sys.argv[1:])
    if all(n in summary for n in NUMPY_CHECKED):
        write_readme(args.out, versions, summary, vocab, n_bpe, ids, ["python3", "scripts/make_fixtures.py"] + sys.argv[1:])
    with open(os.path.join(args.out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
    if args.tar:
        with tarfile.open(args.tar, "w:gz") as tf:
            for n in names:
                tf.add(os.path.join(args.out, n), arcname=n)
            for extra in ("README.md", "summary.json"):
                p = os.path.join(args.out, extra)
                if os.path.exists(p):
                    tf.add(p, arcname=extra)
        log(f"wrote {args.tar} ({os.path.getsize(args.tar)} bytes)")
    if failed:
        log(f"FAILED fixtures: {failed}")
        sys.exit(1)


if __name__ == "__main__":
    main()
