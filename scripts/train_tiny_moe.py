#!/usr/bin/env python3
"""Train the small Qwen3.5-MoE fixture (with its MTP layer) and write its transformers references.

The model is a `qwen3_5_moe_text` model of the Qwen3.5 family saved in the Hugging Face layout of the real
multimodal release (`Qwen3_5MoeForConditionalGeneration`: `model.language_model.*` names, fused routed experts,
`lm_head.weight` at the top level, a tiny random vision tower, per-expert `mtp.*` weights, a chat template).
It is trained from scratch, deterministically (seeds and hyper-parameters pinned below), on the Python
standard library of the interpreter that runs this script: every `.py` file (code, comments, docstrings; test
packages left out) plus the English help texts of `pydoc_data/topics.py`. Every Python installation has that
corpus, so nothing has to be downloaded or shipped, and it mixes code with English prose, which gives the
router something to specialise on. The corpus is pinned by its file list and a SHA-256 recorded in
`corpus.json`; a different Python version gives a different corpus (and hash), which `--expect-corpus-sha256`
refuses.

The MTP layer (MODELS.md §7) is trained with the next-next-token loss: the pair (final-norm hidden state at t,
embedding of token t+1) predicts token t+2. transformers has no MTP forward, so `MultiTokenPredictor` below is
the reference one, written from MODELS.md §7.2 with transformers' own decoder layer and norms.

Outputs (`--out DIR`): the fixture directory (config.json, model-0000N-of-0000M.safetensors + index, tokenizer
files, chat_template.jinja, generation_config.json, reference.json, corpus.json) and `train_log.json`.

Usage (repo root; a GPU trains in minutes, the references are computed on the CPU in float32):
    python3 scripts/train_tiny_moe.py --out tests/fixtures/qwen3_5_moe_trained --time-budget 150
    python3 scripts/train_tiny_moe.py --out /tmp/again --steps N --reproduce-only   # same N: reproduction
    python3 scripts/train_tiny_moe.py --out /tmp/smoke --smoke                        # tiny CPU check
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures as mf  # noqa: E402  (tokenizer pipeline, special tokens, chat template, number format)

# ---------------------------------------------------------------------------------------------------------------
# Pinned hyper-parameters
# ---------------------------------------------------------------------------------------------------------------

SEED = 20261203
VOCAB = 8192  # BPE trainer vocabulary 8179 (256 byte symbols + merges) + 13 added tokens
H = 192
N_LAYERS = 8
LAYER_TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2
NH, NKV, HD = 4, 2, 64  # rot = 16 (partial_rotary_factor 0.25): 8 frequencies, mrope_section [3, 3, 2]
NK, NV, DK, DV, KC = 2, 4, 32, 32, 4
E, TOPK, IM, IS = 32, 4, 32, 64
MAX_POS = 4096
ROPE_THETA = 10000.0

SEQ = 512
BATCH = 64
LR = 3e-3
MIN_LR_FRACTION = 0.1
WARMUP = 100
WEIGHT_DECAY = 0.1
MTP_LOSS_WEIGHT = 0.5
BALANCE_LOSS_WEIGHT = 0.01
CLIP = 1.0
RATE_PROBE_STEPS = (10, 30)  # steps/s measured between these steps fixes the step count under --time-budget

HELDOUT_EVERY, HELDOUT_PHASE = 40, 7  # document i is held out when i % 40 == 7 (code and docs alike)
TOKENIZER_EVERY = 4  # the BPE is trained on every 4th training document
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
TOPICS = "pydoc_data/topics.py"

NLL_TOKENS = 512  # per reference text
GREEDY = 32
CODE_PROMPTS = [
    "def read_lines(path):\n    with open(path",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "def main():\n    import argparse\n    parser = argparse.ArgumentParser(",
]
TEXT_PROMPT = "The with statement is used to"
CHAT_MESSAGES = [{"role": "user", "content": "How do I open a file in Python?"}]
MTP_DRAFTS = 3
MTP_OPENINGS = 6  # held-out documents of each kind whose openings are continued greedily
MTP_PROMPT_TOKENS = 48
MTP_GREEDY = 96
REUSE_WINDOWS = (1, 4, 16)

SMOKE = dict(H=32, N_LAYERS=4, E=8, TOPK=2, IM=16, IS=16, SEQ=64, BATCH=4, VOCAB=600, HD=16, DK=8, DV=8)


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


# ---------------------------------------------------------------------------------------------------------------
# Corpus
# ---------------------------------------------------------------------------------------------------------------


def corpus_documents(stdlib: str, max_files: int | None):
    """[(kind, name, text)] in the pinned order: stdlib `.py` files by relative path, then the help topics."""
    files = []
    for root, dirs, names in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in EXCLUDED_DIRS)
        for n in names:
            if n.endswith(".py"):
                rel = os.path.relpath(os.path.join(root, n), stdlib).replace(os.sep, "/")
                files.append(rel)
    files.sort()
    if max_files:
        files = files[:max_files] + ([TOPICS] if TOPICS in files else [])
    docs, skipped = [], []
    for rel in files:
        with open(os.path.join(stdlib, rel), "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(rel)
            continue
        if rel == TOPICS:
            continue
        docs.append(("code", rel, text))
    topics_path = os.path.join(stdlib, TOPICS)
    if os.path.exists(topics_path):
        with open(topics_path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in tree.body:
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "topics":
                topics = ast.literal_eval(node.value)
                for key in sorted(topics)[: (20 if max_files else None)]:
                    docs.append(("docs", f"{TOPICS}:{key}", topics[key]))
    return docs, skipped


def corpus_manifest(docs, skipped, stdlib):
    h = hashlib.sha256()
    entries = []
    for i, (kind, name, text) in enumerate(docs):
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        h.update(f"{kind}\0{name}\0{digest}\n".encode())
        entries.append([name, len(text.encode("utf-8")), digest[:16], "heldout" if heldout(i) else "train"])
    return {
        "source": "Python standard library of the interpreter that ran the training (sysconfig stdlib path)",
        "python": platform.python_version(),
        "stdlib_path": stdlib,
        "rule": (
            "every *.py under the stdlib, directories named "
            + ", ".join(sorted(EXCLUDED_DIRS))
            + " skipped, sorted by relative path, undecodable files skipped; pydoc_data/topics.py is replaced by"
            " its help texts (ast.literal_eval of `topics`, sorted by key); document i is held out when"
            f" i % {HELDOUT_EVERY} == {HELDOUT_PHASE}"
        ),
        "sha256": h.hexdigest(),
        "hash_rule": "sha256 over lines kind\\0name\\0sha256(utf-8 text)\\n in document order",
        "documents": len(docs),
        "bytes": sum(e[1] for e in entries),
        "skipped_undecodable": skipped,
        "files": entries,
    }


def heldout(i: int) -> bool:
    return i % HELDOUT_EVERY == HELDOUT_PHASE


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer (the Qwen2 byte-level BPE pipeline of make_fixtures.py, fixtures/tokenizer.py, trained on the corpus)
# ---------------------------------------------------------------------------------------------------------------


def build_tokenizer(texts, vocab: int, workdir: str):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(dropout=None, unk_token=None, continuing_subword_prefix="", end_of_word_suffix="",
                               fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(mf.QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab - len(mf.ADDED_TOKENS), min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(texts, trainer=trainer)
    n_bpe = tok.get_vocab_size(with_added_tokens=False)
    for content, special in mf.ADDED_TOKENS:
        at = AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special)
        (tok.add_special_tokens if special else tok.add_tokens)([at])
    ids = {c: tok.token_to_id(c) for c, _ in mf.ADDED_TOKENS}
    path = os.path.join(workdir, "tokenizer.json")
    tok.save(path, pretty=True)
    return tok, ids, tok.get_vocab_size(with_added_tokens=True), n_bpe


# ---------------------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------------------


def make_config(d: dict, ids: dict):
    import transformers as T

    text = T.Qwen3_5MoeTextConfig(
        vocab_size=d["VOCAB"], hidden_size=d["H"], num_hidden_layers=d["N_LAYERS"], num_attention_heads=NH,
        num_key_value_heads=NKV, head_dim=d["HD"], hidden_act="silu", max_position_embeddings=MAX_POS,
        rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, num_experts=d["E"],
        num_experts_per_tok=d["TOPK"], moe_intermediate_size=d["IM"], shared_expert_intermediate_size=d["IS"],
        linear_conv_kernel_dim=KC, linear_key_head_dim=d["DK"], linear_value_head_dim=d["DV"],
        linear_num_key_heads=NK, linear_num_value_heads=NV,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA, "partial_rotary_factor": 0.25,
                         "mrope_section": mrope_section(d["HD"]), "mrope_interleaved": True},
        layer_types=(LAYER_TYPES * 2)[: d["N_LAYERS"]], mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False,
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
    )
    vision = T.Qwen3_5MoeVisionConfig(depth=1, hidden_size=32, hidden_act="gelu_pytorch_tanh", intermediate_size=64,
                                      num_heads=2, in_channels=3, patch_size=8, spatial_merge_size=2,
                                      temporal_patch_size=2, out_hidden_size=d["H"], num_position_embeddings=16)
    return T.Qwen3_5MoeConfig(text_config=text.to_dict(), vision_config=vision.to_dict(),
                              image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                              vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                              tie_word_embeddings=False)


def mrope_section(hd: int):
    half = int(hd * 0.25) // 2  # frequencies; text positions are equal in all three rows
    a = (half + 2) // 3
    return [a, a, half - 2 * a]


class MultiTokenPredictor:
    """The MTP block of MODELS.md §7.2 (vLLM's Qwen3_5MultiTokenPredictor), built from transformers' modules.

    u = concat(norm_e(embed(x_{t+1})), norm_h(h_t)) · fcᵀ  →  one full-attention decoder layer at position t
    →  mtp.norm  →  the main model's lm_head gives the draft logits for x_{t+2}.
    """

    def __new__(cls, text_config, full_layer_index: int):
        import torch.nn as nn
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as M

        h = text_config.hidden_size
        block = nn.Module()
        block.pre_fc_norm_embedding = M.Qwen3_5MoeRMSNorm(h, eps=text_config.rms_norm_eps)
        block.pre_fc_norm_hidden = M.Qwen3_5MoeRMSNorm(h, eps=text_config.rms_norm_eps)
        block.fc = nn.Linear(2 * h, h, bias=False)
        block.layers = nn.ModuleList([M.Qwen3_5MoeDecoderLayer(text_config, full_layer_index)])
        block.norm = M.Qwen3_5MoeRMSNorm(h, eps=text_config.rms_norm_eps)
        return block


def mtp_forward(mtp, text_model, hidden, next_ids=None, next_embeds=None, positions=None):
    """hidden [B,T,H] (after the main model's final norm), next tokens [B,T] → MTP output d [B,T,H] (after mtp.norm)."""
    import torch
    from transformers.masking_utils import create_causal_mask

    emb = text_model.embed_tokens(next_ids) if next_embeds is None else next_embeds
    u = torch.cat([mtp.pre_fc_norm_embedding(emb), mtp.pre_fc_norm_hidden(hidden)], dim=-1)
    u = mtp.fc(u)
    b, t, _ = u.shape
    if positions is None:
        positions = torch.arange(t, device=u.device)[None].expand(b, t)
    pe = text_model.rotary_emb(u, positions[None].expand(3, b, t))
    mask = create_causal_mask(config=text_model.config, inputs_embeds=u, attention_mask=None,
                              past_key_values=None, position_ids=positions)
    u = mtp.layers[0](u, position_embeddings=pe, attention_mask=mask, position_ids=positions)
    return mtp.norm(u)


def init_mtp(mtp, model):
    for m in mtp.modules():
        model._init_weights(m)


# ---------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------


def train(args, d, model, mtp, stream, device, steps_note: dict):
    import torch
    import torch.nn.functional as F

    text_model = model.model.language_model
    routers = [layer.mlp.gate for layer in text_model.layers] + [mtp.layers[0].mlp.gate]
    captured = []
    hooks = [r.register_forward_hook(lambda mod, inp, out: captured.append(out[0])) for r in routers]
    params = [p for p in list(text_model.parameters()) + list(model.lm_head.parameters()) + list(mtp.parameters())]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), eps=1e-8, fused=(device.type == "cuda"))
    gen = torch.Generator().manual_seed(SEED + 1)
    stream_t = torch.tensor(stream, dtype=torch.long)
    seq, batch = d["SEQ"], d["BATCH"]
    total = args.steps
    history = []
    t0 = time.time()
    rate_t = {}
    step = 0
    model.train()
    mtp.train()
    while step < total:
        lr_scale = min(1.0, (step + 1) / WARMUP)
        if step >= WARMUP:
            progress = (step - WARMUP) / max(1, total - WARMUP)
            lr_scale = MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        for g in opt.param_groups:
            g["lr"] = LR * lr_scale
        starts = torch.randint(0, len(stream) - seq - 2, (batch,), generator=gen)
        window = torch.stack([stream_t[s : s + seq + 2] for s in starts.tolist()]).to(device)
        captured.clear()
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            hidden = text_model(input_ids=window[:, :seq]).last_hidden_state
            logits = model.lm_head(hidden)
            main_loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), window[:, 1 : seq + 1].reshape(-1))
            d_out = mtp_forward(mtp, text_model, hidden, next_ids=window[:, 1 : seq + 1])
            mtp_logits = model.lm_head(d_out)
            mtp_loss = F.cross_entropy(mtp_logits.float().reshape(-1, mtp_logits.shape[-1]),
                                       window[:, 2 : seq + 2].reshape(-1))
        # Switch-style balance loss per router: E · Σ_e f_e · P_e (f = share of top-k slots, P = mean probability).
        balance = 0.0
        for rl in captured:
            p = torch.softmax(rl.float(), dim=-1)
            top = torch.topk(p, d["TOPK"], dim=-1).indices
            f = torch.zeros_like(p).scatter_(1, top, 1.0).mean(0) / d["TOPK"]
            balance = balance + d["E"] * (f * p.mean(0)).sum()
        balance = balance / len(captured)
        loss = main_loss + MTP_LOSS_WEIGHT * mtp_loss + BALANCE_LOSS_WEIGHT * balance
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        step += 1
        if step in RATE_PROBE_STEPS:
            if device.type == "cuda":
                torch.cuda.synchronize()
            rate_t[step] = time.time()
        if step == RATE_PROBE_STEPS[1] and args.time_budget and not args.steps_fixed:
            rate = (RATE_PROBE_STEPS[1] - RATE_PROBE_STEPS[0]) / (rate_t[RATE_PROBE_STEPS[1]] - rate_t[RATE_PROBE_STEPS[0]])
            total = max(RATE_PROBE_STEPS[1] + 1, min(args.steps, int(args.time_budget * rate)))
            steps_note.update(rate_steps_per_s=rate, chosen_steps=total)
            log(f"{rate:.2f} steps/s -> {total} steps")
            if args.steps_file:
                with open(args.steps_file, "w") as f:
                    f.write(str(total))
        if step == RATE_PROBE_STEPS[1] and args.steps_from_file:
            while not os.path.exists(args.steps_from_file) and time.time() - t0 < 600:
                time.sleep(0.5)
            with open(args.steps_from_file) as f:
                total = int(f.read().strip())
            steps_note.update(steps_from_file=total)
        if step % 50 == 0 or step == total or step <= 3:
            rec = dict(step=step, loss=main_loss.item(), mtp_loss=mtp_loss.item(), balance=float(balance),
                       grad_norm=float(gnorm), lr=LR * lr_scale, seconds=round(time.time() - t0, 1))
            history.append(rec)
            log(json.dumps(rec))
    for h_ in hooks:
        h_.remove()
    model.eval()
    mtp.eval()
    steps_note.update(steps=total, train_seconds=round(time.time() - t0, 1), tokens=total * batch * seq)
    return history


# ---------------------------------------------------------------------------------------------------------------
# Saving in the release layout
# ---------------------------------------------------------------------------------------------------------------


def save_checkpoint(out, model, mtp, config, tok_json_path, ids, max_shard_bytes):
    import shutil

    import torch
    from safetensors.torch import save_file

    tensors = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    msd = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in mtp.state_dict().items()}
    # The MTP experts per expert, as in Qwen3.5-35B-A3B's checkpoint.
    mf.split_experts(msd, "layers.0.mlp.experts.gate_up_proj", "layers.0.mlp.experts.down_proj",
                     "mtp.layers.0.mlp.experts.", tensors)
    for k, v in msd.items():
        if not k.startswith("layers.0.mlp.experts."):
            tensors["mtp." + k] = v
    tensors = {k: v.contiguous() for k, v in sorted(tensors.items())}
    shards, current, size = [], {}, 0
    for k, v in tensors.items():
        nbytes = v.numel() * v.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[k] = v
        size += nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    total_size = sum(v.numel() * v.element_size() for v in tensors.values())
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total_size}, "weight_map": weight_map}, f, indent=2)
    config.save_pretrained(out)
    template = open(mf.TEMPLATE_PATH, encoding="utf-8").read()
    shutil.copyfile(tok_json_path, os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        cfg = mf.tokenizer_config(ids, template)
        json.dump(cfg, f, indent=2, ensure_ascii=False)
    with open(os.path.join(out, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(template)
    import transformers

    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump(mf.generation_config(ids, transformers.__version__), f, indent=2)
    return {k: list(v.shape) for k, v in tensors.items()}, total_size


def load_mtp(out, text_config, full_idx):
    """The MTP block read back from the saved shards (per-expert tensors fused again), float32."""
    import torch
    from safetensors.torch import load_file

    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    sd = {}
    for name in files:
        sd.update({k: v for k, v in load_file(os.path.join(out, name)).items() if k.startswith("mtp.")})
    mtp = MultiTokenPredictor(text_config, full_idx)
    e_count = text_config.num_experts
    pre = "mtp.layers.0.mlp.experts."
    state = {k[len("mtp."):]: v.float() for k, v in sd.items() if not k.startswith(pre)}
    state["layers.0.mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([sd[f"{pre}{e}.gate_proj.weight"], sd[f"{pre}{e}.up_proj.weight"]], 0) for e in range(e_count)]).float()
    state["layers.0.mlp.experts.down_proj"] = torch.stack([sd[f"{pre}{e}.down_proj.weight"] for e in range(e_count)]).float()
    mtp.load_state_dict(state, strict=True)
    return mtp.float().eval()


# ---------------------------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------------------------


def token_nll(model, ids, device):
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0].double()
    lp = torch.log_softmax(logits[:-1], dim=-1)
    return (-lp.gather(1, torch.tensor(ids[1:], device=device)[:, None])[:, 0]).cpu().tolist(), logits


def heldout_nll(model, docs_ids, device, seq, max_windows):
    """Mean NLL over non-overlapping windows of the held-out documents (first max_windows windows)."""
    import torch
    import torch.nn.functional as F

    total, count, windows = 0.0, 0, 0
    per_kind = {}
    for kind, ids in docs_ids:
        for s in range(0, max(1, len(ids) - 1), seq):
            w = ids[s : s + seq + 1]
            if len(w) < 2 or windows >= max_windows:
                continue
            windows += 1
            with torch.no_grad():
                lg = model(input_ids=torch.tensor([w[:-1]], device=device), use_cache=False).logits[0].float()
            nll = F.cross_entropy(lg, torch.tensor(w[1:], device=device), reduction="sum").item()
            total += nll
            count += len(w) - 1
            k = per_kind.setdefault(kind, [0.0, 0])
            k[0] += nll
            k[1] += len(w) - 1
    return total / count, count, {k: v[0] / v[1] for k, v in per_kind.items()}


def routing_statistics(model, docs_ids, device, n_experts, top_k, max_tokens):
    """Per layer: expert popularity (entropy) and how often a token's experts were used by the previous w tokens."""
    import torch

    text_model = model.model.language_model
    per_layer = [[] for _ in text_model.layers]
    hooks = []
    for li, layer in enumerate(text_model.layers):
        hooks.append(layer.mlp.gate.register_forward_hook(
            lambda mod, inp, out, li=li: per_layer[li].append(out[2].cpu())))
    seen = 0
    doc_bounds = []
    for _, ids in docs_ids:
        for s in range(0, len(ids), 512):
            w = ids[s : s + 512]
            if len(w) < 32 or seen >= max_tokens:
                continue
            with torch.no_grad():
                model(input_ids=torch.tensor([w], device=device), use_cache=False)
            doc_bounds.append(len(w))
            seen += len(w)
    for h in hooks:
        h.remove()
    gen = torch.Generator().manual_seed(SEED + 2)
    layers = []
    for li, chunks in enumerate(per_layer):
        counts = torch.zeros(n_experts)
        reuse = {w: [0, 0] for w in REUSE_WINDOWS}
        shuffled_reuse = {w: [0, 0] for w in REUSE_WINDOWS}
        for idx in chunks:
            counts += torch.bincount(idx.reshape(-1), minlength=n_experts).float()
            for target, sel in ((reuse, idx), (shuffled_reuse, idx[torch.randperm(idx.shape[0], generator=gen)])):
                onehot = torch.zeros(sel.shape[0], n_experts, dtype=torch.bool)
                onehot.scatter_(1, sel, True)
                csum = torch.cat([torch.zeros(1, n_experts), onehot.float().cumsum(0)])
                for w in REUSE_WINDOWS:
                    t = torch.arange(w, sel.shape[0])
                    used = (csum[t] - csum[t - w]) > 0  # experts used by tokens t-w .. t-1
                    hit = used.gather(1, sel[w:]).float()
                    target[w][0] += hit.sum().item()
                    target[w][1] += hit.numel()
        p = counts / counts.sum()
        entropy = float(-(p[p > 0] * p[p > 0].log()).sum())
        ranked = sorted(p.tolist(), reverse=True)
        layers.append({
            "layer": li,
            "popularity_entropy_nats": entropy,
            "popularity_entropy_fraction_of_uniform": entropy / math.log(n_experts),
            "top_expert_share": ranked[0],
            "least_expert_share": ranked[-1],
            "share_by_rank": ranked,
            "reuse": {str(w): reuse[w][0] / max(1, reuse[w][1]) for w in REUSE_WINDOWS},
            "reuse_tokens_shuffled": {str(w): shuffled_reuse[w][0] / max(1, shuffled_reuse[w][1]) for w in REUSE_WINDOWS},
            "reuse_uniform_router": {str(w): 1 - (1 - top_k / n_experts) ** w for w in REUSE_WINDOWS},
        })
    return {"tokens": seen, "windows": len(doc_bounds), "top_k": top_k, "experts": n_experts, "layers": layers,
            "definition": "reuse[w] = fraction of (token, chosen expert) pairs whose expert was also chosen by at least one"
                          " of the previous w tokens of the same 512-token window, same layer; shuffled = the same"
                          " tokens' choices in a random order (popularity alone, no temporal order); uniform = a"
                          " router choosing k of E uniformly and independently"}


def mtp_drafts(model, mtp, seq_ids, n_drafts):
    """Chained MTP drafts at every position of `seq_ids`, teacher-forced main-model states (MODELS.md §7.2).

    For position t (0 ≤ t ≤ L-2): draft 1 from (h_t, x_{t+1}) at position t; draft j+1 from (d_j, draft_j) at
    position t+j, the MTP layer attending to the true pairs 0..t and the earlier drafts of the same chain.
    Returns drafts[j][t] (token ids) and the main model's argmax after each prefix.
    """
    import torch

    text_model = model.model.language_model
    ids = torch.tensor([seq_ids])
    with torch.no_grad():
        hidden = text_model(input_ids=ids, use_cache=False).last_hidden_state  # [1, L, H]
        main_argmax = model.lm_head(hidden)[0].argmax(-1).tolist()
        L = len(seq_ids)
        n = L - 1  # chains start at t = 0..L-2
        emb = text_model.embed_tokens(ids)  # [1, L, H]
        # Row t of the batch: positions 0..t are the true pairs (h_s, x_{s+1}); positions t+1.. are the chain.
        length = n + n_drafts
        hid = torch.zeros(n, length, hidden.shape[-1])
        nxt = torch.zeros(n, length, hidden.shape[-1])
        hid[:, :n] = hidden[0, :n]
        nxt[:, :n] = emb[0, 1 : n + 1]
        drafts = []
        rows = torch.arange(n)
        positions = torch.arange(length)[None].expand(n, length)
        for j in range(n_drafts):
            if j == 0:  # causal: the chains' first steps are the true pairs' outputs, one pass over the sequence
                out = mtp_forward(mtp, text_model, hidden[:, :n], next_embeds=emb[:, 1 : n + 1])[0]
            else:
                out = mtp_forward(mtp, text_model, hid, next_embeds=nxt, positions=positions)[rows, rows + j]  # the chain's step j output at position t+j
            tok = model.lm_head(out).argmax(-1)
            drafts.append(tok.tolist())
            if j + 1 < n_drafts:
                hid[rows, rows + j + 1] = out
                nxt[rows, rows + j + 1] = text_model.embed_tokens(tok)
    return drafts, main_argmax


def acceptance_counts(drafts, target, n_drafts):
    """Greedy verification: draft j of the chain at t predicts token t+2+j and is accepted when it equals
    target[t+2+j] and every earlier draft of the chain was accepted. Returns {k: [chains, accepted at depth 1..k]}."""
    n = len(drafts[0])
    counts = {}
    for k in range(1, n_drafts + 1):
        chains, prefix = 0, [0] * k
        for t in range(n):
            if t + 1 + k >= len(target) or any(target[t + 2 + j] is None for j in range(k)):
                continue
            chains += 1
            for j in range(k):
                if drafts[j][t] != target[t + 2 + j]:
                    break
                prefix[j] += 1
        counts[k] = [chains, prefix]
    return counts


def acceptance_rates(per_sequence, n_drafts):
    rates = {}
    for k in range(1, n_drafts + 1):
        chains = sum(c[k][0] for c in per_sequence)
        prefix = [sum(c[k][1][j] for c in per_sequence) for j in range(k)]
        m = max(1, chains)
        rates[str(k)] = {"chains": chains, "all_accepted": prefix[-1] / m,
                         "accepted_by_depth": [x / m for x in prefix],
                         "mean_accepted_drafts": sum(prefix) / m, "tokens_per_main_step": 1 + sum(prefix) / m}
    return rates


# ---------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=4000, help="training steps (the upper bound under --time-budget)")
    ap.add_argument("--time-budget", type=float, default=0.0,
                    help="seconds of training: the step count is fixed from the rate between steps 10 and 30")
    ap.add_argument("--steps-file", help="write the chosen step count here")
    ap.add_argument("--steps-from-file", help="take the step count from this file at step 30 (a concurrent run)")
    ap.add_argument("--reproduce-only", action="store_true", help="train and measure held-out NLL only")
    ap.add_argument("--references-only", action="store_true",
                    help="recompute the references from OUT/fixture and OUT/heldout.json (no corpus or training)")
    ap.add_argument("--deterministic", action="store_true",
                    help="deterministic CUDA kernels (index_add_ through sorted index_put_, cuBLAS workspace, eager"
                         " attention), so two runs give the same weights")
    ap.add_argument("--skip-references", action="store_true", help="save the checkpoint and heldout.json only")
    ap.add_argument("--expect-corpus-sha256")
    ap.add_argument("--smoke", action="store_true", help="tiny dims, few files: a CPU check of the whole pipeline")
    ap.add_argument("--heldout-windows", type=int, default=400)
    ap.add_argument("--routing-tokens", type=int, default=100000)
    args = ap.parse_args()
    args.steps_fixed = not args.time_budget
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: deterministic cuBLAS
    if args.references_only:
        write_references(args, os.path.join(args.out, "fixture"), os.path.join(args.out, "heldout.json"))
        return

    import torch
    import transformers

    torch.manual_seed(SEED)
    if args.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    d = dict(H=H, N_LAYERS=N_LAYERS, E=E, TOPK=TOPK, IM=IM, IS=IS, SEQ=SEQ, BATCH=BATCH, VOCAB=VOCAB, HD=HD, DK=DK, DV=DV)
    if args.smoke:
        d.update(SMOKE)
    os.makedirs(args.out, exist_ok=True)
    work = os.path.join(args.out, ".work")
    os.makedirs(work, exist_ok=True)
    t_start = time.time()
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__, "device": str(device),
                "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None}
    log("versions", versions)

    stdlib = sysconfig.get_paths()["stdlib"]
    docs, skipped = corpus_documents(stdlib, 40 if args.smoke else None)
    manifest = corpus_manifest(docs, skipped, stdlib)
    log(f"corpus: {manifest['documents']} documents, {manifest['bytes']} bytes, sha256 {manifest['sha256']}")
    if args.expect_corpus_sha256 and args.expect_corpus_sha256 != manifest["sha256"]:
        sys.exit(f"corpus sha256 {manifest['sha256']} differs from the expected {args.expect_corpus_sha256}")
    train_docs = [(k, t) for i, (k, _, t) in enumerate(docs) if not heldout(i)]
    held_docs = [(k, n, t) for i, (k, n, t) in enumerate(docs) if heldout(i)]

    tok, ids, n_tok, n_bpe = build_tokenizer([t for i, (_, t) in enumerate(train_docs) if i % TOKENIZER_EVERY == 0],
                                             d["VOCAB"], work)
    assert n_tok <= d["VOCAB"], (n_tok, d["VOCAB"])
    eot = ids["<|endoftext|>"]
    enc = tok.encode_batch([t for _, t in train_docs], add_special_tokens=False)
    stream = []
    for e in enc:
        stream.extend(e.ids)
        stream.append(eot)
    held_ids = [(k, e.ids) for (k, _, _), e in zip(held_docs, tok.encode_batch([t for _, _, t in held_docs],
                                                                                add_special_tokens=False))]
    counts = torch.bincount(torch.tensor(stream), minlength=d["VOCAB"]).double()
    p_uni = counts / counts.sum()
    unigram_entropy = float(-(p_uni[p_uni > 0] * p_uni[p_uni > 0].log()).sum())
    log(f"tokenizer: {n_bpe} BPE + {len(mf.ADDED_TOKENS)} added; train stream {len(stream)} tokens;"
        f" unigram entropy {unigram_entropy:.4f} nats")

    config = make_config(d, ids)
    if args.deterministic:  # SDPA's fused backward kernels accumulate in a nondeterministic order
        config.text_config._attn_implementation = "eager"
    torch.manual_seed(SEED)
    model = transformers.Qwen3_5MoeForConditionalGeneration(config)
    text_config = model.model.language_model.config
    full_idx = text_config.layer_types.index("full_attention")
    mtp = MultiTokenPredictor(text_config, full_idx)
    init_mtp(mtp, model.model.language_model)
    model.to(device)
    mtp.to(device)
    n_params = sum(p.numel() for p in model.parameters()) + sum(p.numel() for p in mtp.parameters())
    log(f"parameters {n_params}")
    note = {}
    history = train(args, d, model, mtp, stream, device, note)
    log("trained", note)

    # Held-out NLL of the trained weights as stored (bf16), float32 forward on the training device.
    model.to(torch.bfloat16).float()
    mtp.to(torch.bfloat16).float()
    mean_heldout, n_heldout, heldout_by_kind = heldout_nll(model, held_ids, device, d["SEQ"], args.heldout_windows)
    log(f"held-out NLL {mean_heldout:.5f} over {n_heldout} tokens {heldout_by_kind}")
    summary = {"versions": versions, "corpus_sha256": manifest["sha256"], "training": note,
               "heldout_mean_nll": mean_heldout, "heldout_tokens": n_heldout, "heldout_by_kind": heldout_by_kind,
               "unigram_entropy": unigram_entropy, "history": history, "parameters": n_params,
               "argv": sys.argv[1:]}
    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump(summary, f, indent=1)
    if args.reproduce_only:
        return

    fixture = os.path.join(args.out, "fixture")
    os.makedirs(fixture, exist_ok=True)
    shapes, total_size = save_checkpoint(fixture, model.cpu(), mtp.cpu(), config, os.path.join(work, "tokenizer.json"),
                                         ids, 12 * 1024 * 1024)
    with open(os.path.join(fixture, "corpus.json"), "w") as f:
        json.dump(manifest, f, indent=0)
    # What the references need besides the checkpoint, so they can be recomputed anywhere (--references-only).
    with open(os.path.join(args.out, "heldout.json"), "w") as f:
        json.dump({"documents": [[k, n, e] for (k, n, _), (_, e) in zip(held_docs, held_ids)],
                   "train_log": summary, "full_idx": full_idx, "dims": d}, f)
    del model, mtp
    if args.skip_references:
        return
    write_references(args, fixture, os.path.join(args.out, "heldout.json"))


def write_references(args, fixture, heldout_path):
    """References from the saved checkpoint: transformers re-loads it (float32, eager, CPU)."""
    import torch
    import transformers

    t_start = time.time()
    with open(heldout_path) as f:
        saved = json.load(f)
    held_docs = [(k, n, None) for k, n, _ in saved["documents"]]
    held_ids = [(k, e) for k, _, e in saved["documents"]]
    summary, full_idx, d = saved["train_log"], saved["full_idx"], saved["dims"]
    versions = summary["versions"]
    mean_heldout, n_heldout, heldout_by_kind = (summary["heldout_mean_nll"], summary["heldout_tokens"],
                                                summary["heldout_by_kind"])
    unigram_entropy, note, n_params = summary["unigram_entropy"], summary["training"], summary["parameters"]
    with open(os.path.join(fixture, "model.safetensors.index.json")) as f:
        total_size = json.load(f)["metadata"]["total_size"]
    from safetensors import safe_open

    shapes = {}
    for name in sorted(os.listdir(fixture)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(fixture, name), "pt") as sf:
                for k in sf.keys():
                    shapes[k] = list(sf.get_slice(k).get_shape())
    shapes = dict(sorted(shapes.items()))
    with open(os.path.join(fixture, "corpus.json")) as f:
        manifest = json.load(f)
    device = torch.device("cpu")

    # References: the checkpoint re-loaded by transformers, float32, eager, CPU.
    torch.set_num_threads(8)
    ref_model = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(
        fixture, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager").eval()
    ref_mtp = load_mtp(fixture, ref_model.model.language_model.config, full_idx)
    hf_tok = transformers.AutoTokenizer.from_pretrained(fixture)
    cpu = torch.device("cpu")
    if torch.cuda.is_available():  # statistics only: the GPU's float32 forward is close enough and much faster
        import copy

        routing = routing_statistics(copy.deepcopy(ref_model).cuda(), held_ids, torch.device("cuda"), d["E"],
                                     d["TOPK"], args.routing_tokens)
    else:
        routing = routing_statistics(ref_model, held_ids, cpu, d["E"], d["TOPK"], args.routing_tokens)
    for layer in routing["layers"]:
        log(f"layer {layer['layer']}: entropy {layer['popularity_entropy_fraction_of_uniform']:.3f}"
            f" reuse {layer['reuse']} shuffled {layer['reuse_tokens_shuffled']}")
    texts = []
    for kind in ("code", "docs"):
        name, ids_ = next((n, e) for (k, n, _), (_, e) in zip(held_docs, held_ids) if k == kind and len(e) > NLL_TOKENS)
        window = ids_[:NLL_TOKENS]
        nll, _ = token_nll(ref_model, window, cpu)
        texts.append({"kind": kind, "document": name, "token_ids": window, "text": hf_tok.decode(window),
                      "token_nll": [mf.fnum(x) for x in nll], "mean_nll": mf.fnum(sum(nll) / len(nll))})
        log(f"reference NLL {kind} {name}: {sum(nll) / len(nll):.5f}")
    prompts = []
    for text in CODE_PROMPTS + [TEXT_PROMPT] + [None]:
        if text is None:
            text = hf_tok.apply_chat_template(CHAT_MESSAGES, add_generation_prompt=True, tokenize=False)
        p_ids = hf_tok(text, add_special_tokens=False)["input_ids"]
        ref_model.generation_config.eos_token_id = None
        with torch.no_grad():
            out = ref_model.generate(input_ids=torch.tensor([p_ids]), do_sample=False, max_new_tokens=GREEDY,
                                     min_new_tokens=GREEDY)
        greedy = out[0, len(p_ids):].tolist()
        manual, margins = mf.greedy_manual(ref_model, p_ids, GREEDY)
        with torch.no_grad():
            last = ref_model(input_ids=torch.tensor([p_ids]), use_cache=False).logits[0, -1]
        prompts.append({"text": text, "prompt_token_ids": p_ids, "greedy_token_ids": greedy,
                        "greedy_text": hf_tok.decode(greedy), "greedy_matches_no_cache_argmax_loop": manual == greedy,
                        "greedy_top1_top2_margins_no_cache": margins, "last_logits": mf.flist(last)})
        log(f"greedy {text!r} -> {hf_tok.decode(greedy)!r}")

    # MTP: drafts on the main model's own greedy continuations of held-out openings (what speculative decoding
    # verifies against, exact at every depth), and depth 1 on held-out text (target: the main model's argmax after
    # each true prefix; deeper drafts would need the drafted prefix, so only depth 1 is meaningful there).
    mtp_ref = {"drafts": MTP_DRAFTS, "sequences": []}
    per_greedy, per_text = [], []
    openings = [e for (k, _, _), (_, e) in zip(held_docs, held_ids) if k == "code" and len(e) > 200][:MTP_OPENINGS]
    openings += [e for (k, _, _), (_, e) in zip(held_docs, held_ids) if k == "docs" and len(e) > 200][:MTP_OPENINGS]
    for opening in openings:
        p_ids = opening[:MTP_PROMPT_TOKENS]
        with torch.no_grad():
            out = ref_model.generate(input_ids=torch.tensor([p_ids]), do_sample=False, max_new_tokens=MTP_GREEDY,
                                     min_new_tokens=MTP_GREEDY)
        seq_ids = out[0].tolist()
        drafts, main_argmax = mtp_drafts(ref_model, ref_mtp, seq_ids, MTP_DRAFTS)
        start = len(p_ids) - 1  # chains whose drafts are generated tokens
        per_greedy.append(acceptance_counts([dd[start:] for dd in drafts], seq_ids[start:], MTP_DRAFTS))
        mtp_ref["sequences"].append({"prompt_tokens": len(p_ids), "token_ids": seq_ids, "drafts": drafts})
    for t in texts:
        drafts, main_argmax = mtp_drafts(ref_model, ref_mtp, t["token_ids"], 1)
        per_text.append(acceptance_counts(drafts, [None] + main_argmax[:-1], 1))
        t["mtp_drafts"] = drafts
        t["main_argmax"] = main_argmax
    mtp_ref["acceptance_on_greedy_continuations"] = acceptance_rates(per_greedy, MTP_DRAFTS)
    mtp_ref["acceptance_depth1_on_heldout_text_vs_main_argmax"] = acceptance_rates(per_text, 1)
    mtp_ref["rule"] = ("chain at t: draft 1 from (h_t, x_{t+1}) at position t, draft j+1 from (d_j, draft_j) at"
                       " position t+j; drafts[j][t] predicts token t+2+j; a draft is accepted when it equals the"
                       " main model's greedy token and all earlier drafts of its chain were accepted")
    log("MTP acceptance (greedy)", json.dumps(mtp_ref["acceptance_on_greedy_continuations"]))
    log("MTP acceptance (held-out text, depth 1)", json.dumps(mtp_ref["acceptance_depth1_on_heldout_text_vs_main_argmax"]))

    reference = {
        "description": "transformers references of the trained Qwen3.5-MoE fixture: float32, eager attention and"
                       " experts, CPU, from the re-loaded checkpoint (bf16 on disk, so the bf16 artifact holds the"
                       " same weights as the f32 one)",
        "versions": versions, "model_class": "Qwen3_5MoeForConditionalGeneration",
        "reference_versions": {"python": platform.python_version(), "torch": torch.__version__,
                               "transformers": transformers.__version__, "device": "cpu",
                               "threads": torch.get_num_threads()},
        "parameters": n_params, "checkpoint_bytes": total_size, "tensors": shapes,
        "unigram_entropy_nats": unigram_entropy, "heldout": {"mean_nll": mean_heldout, "tokens": n_heldout,
                                                             "by_kind": heldout_by_kind,
                                                             "rule": f"non-overlapping {d['SEQ']}-token windows of the"
                                                                     " held-out documents, first"
                                                                     f" {args.heldout_windows} windows, float32"
                                                                     f" forward on {versions['device']}"},
        "nll_texts": texts, "prompts": prompts, "mtp": mtp_ref, "routing": routing, "training": note,
        "hyper_parameters": {"seed": SEED, "seq": d["SEQ"], "batch": d["BATCH"], "lr": LR, "warmup": WARMUP,
                             "min_lr_fraction": MIN_LR_FRACTION, "weight_decay": WEIGHT_DECAY,
                             "mtp_loss_weight": MTP_LOSS_WEIGHT, "balance_loss_weight": BALANCE_LOSS_WEIGHT,
                             "clip": CLIP, "dims": d},
        "corpus_sha256": manifest["sha256"], "argv": summary["argv"], "references_argv": sys.argv[1:],
        "reference_seconds": round(time.time() - t_start, 1),
    }
    with open(os.path.join(fixture, "reference.json"), "w") as f:
        json.dump(reference, f, indent=0)
    log(f"done in {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
