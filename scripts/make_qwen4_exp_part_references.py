#!/usr/bin/env python3
"""Reference values for two self-contained pieces of the Qwen4-Exp (`qwen4_exp`) text model,
computed with transformers' own modules, for the engine's tests:

* `qsa_indexer.json`: the QSA indexer's token selection. For each case a tiny random
  `Qwen4ExpTextQSAIndexer` runs over random hidden states of one unpadded sequence with a causal
  mask; we record the raw indexer projection (`index_qk_proj` output, all queries' heads then the
  single raw key per token), the two norm weights, the RoPE settings, and for every query the
  sorted token indices the returned mask lets through.
* `ngram_hash.json`: the PLE layer's hashed n-gram row ids (`Qwen4ExpTextNGramEmbedding.forward`
  with the embedding lookup replaced by the identity, so the ids themselves come back), for the
  default hashing configuration (vocab 248320, base 20 000 000, seed 1234) and a few token
  sequences, including ones fed in two chunks through the cache's id history.

Usage (repo root, transformers 5.17 + torch on CPU):
    python3 scripts/make_qwen4_exp_part_references.py --out tests/fixtures/qwen4_exp_parts
"""

import argparse
import json
import os

import torch
import transformers
from transformers.models.qwen4_exp import modeling_qwen4_exp as modeling
from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig


def indexer_config(budget, ratio, index_heads, index_head_dim, head_dim, partial_rotary_factor):
    return Qwen4ExpTextConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=head_dim,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": partial_rotary_factor,
            "mrope_section": [11, 11, 10],
        },
        indexer_n_heads=index_heads,
        indexer_kv_heads=1,
        indexer_head_dim=index_head_dim,
        indexer_budget=budget,
        indexer_compress_ratio=ratio,
        rms_norm_eps=1e-6,
    )


def indexer_case(seed, length, budget, ratio, index_heads, index_head_dim, head_dim, partial):
    config = indexer_config(budget, ratio, index_heads, index_head_dim, head_dim, partial)
    generator = torch.Generator().manual_seed(seed)
    indexer = modeling.Qwen4ExpTextQSAIndexer(config, layer_idx=3).eval()
    with torch.no_grad():
        for parameter in (indexer.index_qk_proj.weight,):
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
        for parameter in (indexer.q_layernorm.weight, indexer.k_layernorm.weight):
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    hidden = torch.randn((1, length, config.hidden_size), generator=generator)
    rotary = modeling.Qwen4ExpTextRotaryEmbedding(config)
    position_ids = torch.arange(length).view(1, 1, length).expand(3, 1, length)
    cos, sin = rotary(hidden, position_ids)
    causal = torch.ones((length, length), dtype=torch.bool).tril().view(1, 1, length, length)
    with torch.no_grad():
        mask = indexer(hidden, (cos, sin), causal, None)
        projection = indexer.index_qk_proj(hidden)[0]
    selections = [torch.nonzero(mask[0, 0, query]).flatten().tolist() for query in range(length)]
    return {
        "seed": seed,
        "length": length,
        "budget": budget,
        "compress_ratio": ratio,
        "index_heads": index_heads,
        "index_head_dim": index_head_dim,
        "rotary_dim": int(head_dim * partial),
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "projection": projection.flatten().tolist(),
        "query_norm_weight": indexer.q_layernorm.weight.tolist(),
        "key_norm_weight": indexer.k_layernorm.weight.tolist(),
        "selected_tokens": selections,
    }


def topk_tie_cases():
    """`torch.topk` on CPU over values full of ties (as QSA's ReLU-summed scores are): which
    indices it keeps, through both of its paths (partial sort when 64·k ≤ n, else selection)."""
    generator = torch.Generator().manual_seed(2100)
    cases = []
    for case in range(240):
        length = int(torch.randint(1, 1500, (1,), generator=generator))
        if case % 2 == 0:
            k = int(torch.randint(1, max(2, length // 64 + 1), (1,), generator=generator))
        else:
            k = int(torch.randint(1, length + 1, (1,), generator=generator))
        k = min(k, length)
        levels = torch.tensor([0.0, 0.0, 0.0, 0.5, 1.0])
        values = levels[torch.randint(0, 5, (length,), generator=generator)]
        noisy = torch.rand(length, generator=generator) < 0.2
        fine = torch.randint(0, 1024, (length,), generator=generator).float() / 1024
        values = torch.where(noisy, fine, values)
        indices = sorted(values.topk(k, dim=0).indices.tolist())
        cases.append({"values": values.tolist(), "k": k, "indices": indices})
    return cases


class IdentityEmbedding(torch.nn.Module):
    """Stands in for the (hundreds of millions of rows) n-gram table: returns the row ids."""

    def __init__(self, rows, width):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1), requires_grad=False)

    def forward(self, ids):
        return ids.unsqueeze(-1)


def ngram_cases():
    eos = 248044
    config = Qwen4ExpTextConfig(vocab_size=248320, eos_token_id=eos, ple_layer_ids=[])
    real_embedding = modeling.nn.Embedding
    modeling.nn.Embedding = IdentityEmbedding
    try:
        embeddings = {
            index: modeling.Qwen4ExpTextNGramEmbedding(config, 2048, layer_idx=0, ple_layer_index=index)
            for index in (0, 1, 3)
        }
    finally:
        modeling.nn.Embedding = real_embedding
    sequences = [
        [100, 200, 300, eos, 400, 500],
        [7],
        [eos, eos, 5, 6, 7, eos, 248319, 0, 1],
        [248319, 12345, 99, 99, 99, 2, eos, 3],
    ]
    cases = []
    for index, embedding in embeddings.items():
        tables = {
            "ple_layer_index": index,
            "multipliers": embedding.layer_multipliers.tolist(),
            "head_sizes": embedding.ngram_heads_vocab_sizes.tolist(),
            "head_offsets": embedding.ngram_heads_offsets.tolist(),
        }
        divisor = config.make_ngram_vocab_size_divisible_by
        tables["padded_rows"] = -(-embedding.total_vocab_size // divisor) * divisor
        for tokens in sequences:
            ids = torch.tensor([tokens])
            whole = embedding(ids, None)[0].tolist()
            cases.append({**tables, "previous_context": None, "tokens": tokens, "row_ids": whole})
        # A sequence fed in two chunks: the second sees the first's last ids through the history.
        tokens = sequences[2]
        for split in (1, 3, 5):
            history = ([eos, eos] + tokens[:split])[-2:]
            chunk = torch.tensor([tokens[split:]])
            cache = HistoryOnlyCache(index_layer=0, history=history)
            rows = embedding(chunk, cache)[0].tolist()
            cases.append({**tables, "previous_context": history, "tokens": tokens[split:], "row_ids": rows})
    return {"eos_token_id": eos, "vocab_size": 248320, "seed": config.seed, "cases": cases}


class HistoryOnlyCache:
    """The two cache calls the n-gram embedding makes, holding a given id history."""

    class Layer:
        def __init__(self, history):
            self.conv_states = {2: torch.tensor([history])}

    def __init__(self, index_layer, history):
        self.layers = {index_layer: HistoryOnlyCache.Layer(history)}

    def has_previous_state(self, layer_idx, state_idx):
        return True

    def update_conv_state(self, *args, **kwargs):
        return None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    arguments = parser.parse_args()
    torch.set_num_threads(1)
    os.makedirs(arguments.out, exist_ok=True)
    cases = [
        indexer_case(2001, 37, 8, 4, 3, 16, 16, 0.5),
        indexer_case(2002, 96, 12, 4, 2, 16, 16, 1.0),
        indexer_case(2003, 50, 6, 2, 4, 8, 16, 0.5),
        indexer_case(2004, 23, 16, 4, 2, 16, 16, 0.25),
        indexer_case(2005, 200, 16, 4, 3, 16, 32, 0.25),
    ]
    provenance = {"transformers": transformers.__version__, "torch": torch.__version__}
    with open(os.path.join(arguments.out, "qsa_indexer.json"), "w") as file:
        json.dump({"provenance": provenance, "cases": cases}, file)
    with open(os.path.join(arguments.out, "topk_ties.json"), "w") as file:
        json.dump({"provenance": provenance, "cases": topk_tie_cases()}, file)
    with open(os.path.join(arguments.out, "ngram_hash.json"), "w") as file:
        json.dump({"provenance": provenance, **ngram_cases()}, file)


if __name__ == "__main__":
    main()
