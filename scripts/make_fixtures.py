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

import os
import sys

# The code lives in scripts/fixtures/, one module per job (see its __init__.py). Every name it defines is
# re-exported here, so `import make_fixtures` (scripts/train_tiny_moe.py) keeps working.
_SCRIPTS = os.path.dirname(os.path.abspath(__file__))
if _SCRIPTS not in sys.path:
    sys.path.insert(0, _SCRIPTS)

from fixtures.constants import (  # noqa: E402, F401
    DK,
    DV,
    E,
    EPS,
    FIXTURES,
    FLOAT_DIGITS,
    H,
    HD,
    I_DENSE,
    IM,
    IS,
    KC,
    LM_HEAD_GAIN,
    MAX_POS,
    MULTIMODAL,
    N_LAYERS,
    NH,
    NK,
    NKV,
    NUMPY_CHECKED,
    NV,
    Q4_BUDGET,
    Q4_HC,
    Q4_HC_RANK,
    Q4_IM,
    Q4_INDEXER_DIM,
    Q4_INDEXER_HEADS,
    Q4_NGRAM_BASE,
    Q4_NGRAM_DIVISOR,
    Q4_PLE_DIM,
    Q4_PLE_IDS,
    Q4_RATIO,
    Q4_SPLIT_PARTS,
    REPO,
    ROPE_THETA,
    ROUTER_GAIN,
    SEEDS,
    TEMPLATE_PATH,
    TOPK,
    flist,
    fnum,
    log,
)
from fixtures.texts import (  # noqa: E402, F401
    ADDED_TOKENS,
    BPE_TRAIN_VOCAB,
    CHAT_MESSAGES,
    NLL_TEXT,
    PLAIN_PROMPT,
    QWEN2_PRETOKENIZE_REGEX,
    QWEN4_EXP_NLL_TEXT,
    TRAIN_TEXT,
)
from fixtures.tokenizer import build_tokenizer, generation_config, tokenizer_config  # noqa: E402, F401
from fixtures.configs import MODEL_CLASS, TEXT_ONLY_CLASS, make_config, multimodal_config  # noqa: E402, F401
from fixtures.weight_randomisation import randomise_module  # noqa: E402, F401
from fixtures.disk_layout import disk_state_dict, sd_buffers_int64, split_experts  # noqa: E402, F401
from fixtures.references import compute_reference, entropy_stats, greedy_manual, text_backbone  # noqa: E402, F401
from fixtures.bf16_references import (  # noqa: E402, F401
    BF16_ROUNDING_RULE,
    add_bf16_references,
    bf16_rounded,
    compute_bf16_reference,
    write_reference,
)
from fixtures.build import build_fixture, sample_names  # noqa: E402, F401
from fixtures.readmes import (  # noqa: E402, F401
    QWEN3_5_BULLET,
    text_only_lines,
    write_fixture_readme,
    write_qwen4_exp_readme,
    write_readme,
)
from fixtures.numpy_check import bf16_round_np, check_fixtures, numpy_forward  # noqa: E402, F401
from fixtures.cli import main  # noqa: E402, F401

if __name__ == "__main__":
    main()
