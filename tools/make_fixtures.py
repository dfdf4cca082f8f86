#!/usr/bin/env python3
"""Generate tiny random GLM-DSA / DeepSeek checkpoints plus the oracle's expected outputs.

The oracle is Hugging Face transformers (eager attention, float32, CPU). For each fixture this
script builds a random model, stores it as a standard HF checkpoint directory in the official
per-expert layout (optionally BF16, sharded, or FP8 with 128x128 block scales), and writes:

  expected.json   tokens, greedy prompt/continuation, minimal selection margins, versions
  logits.npy      float32 [T, vocab]: logits of one full forward over `tokens` (no cache)

Selections (indexer top-k, router top-k, group top-k, greedy argmax) are discrete: a near-tie makes
an exact comparison meaningless, so every draw is checked and re-drawn until all margins are
comfortable. See tests/fixtures/README.md.

    /work/pyenv/bin/python tools/make_fixtures.py --out tests/fixtures [--only NAME ...]
"""

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

torch.set_num_threads(1)  # the generation machine is shared; tiny matmuls gain nothing from threads

# Minimal margins a draw must have to be accepted (the brief asks for ~1e-4 / ~1e-4 / ~1e-3).
MIN_INDEXER_REL = 1e-4  # (k-th - (k+1)-th index score) / max |score| of that query row
MIN_ROUTER = 1e-4  # absolute gap of selection scores (sigmoid + bias, in [0, ~1.3])
MIN_GREEDY = 1e-3  # top-1 minus top-2 logit

# ----------------------------------------------------------------------------------------------
# Fixture definitions
# ----------------------------------------------------------------------------------------------

F32_BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=48,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=32,
    index_head_dim=32,
    index_n_heads=8,
    index_topk=12,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    bos_token_id=0,
)

FIXTURES = [
    dict(
        name="glm_dsa_full_f32",
        model_type="glm_moe_dsa",
        store="f32",
        cfg=dict(
            F32_BASE,
            num_hidden_layers=4,
            first_k_dense_replace=1,
            indexer_types=["full"] * 4,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 1.0e6},
            eos_token_id=[1, 2],
        ),
        gen_eos=[1, 2],
        T=64,
        prompt_len=20,
        seed=1000,
        notes="GLM-5 style: every layer's indexer full (indexer_types explicit), layer 0 dense, "
        "layers 1-3 MoE (8 routed experts, top-2, 1 shared). Interleaved RoPE in MLA and indexer.",
    ),
    dict(
        name="glm_dsa_shared_f32",
        model_type="glm_moe_dsa",
        store="f32",
        cfg=dict(
            F32_BASE,
            num_hidden_layers=7,
            first_k_dense_replace=1,
            mlp_layer_types=["dense", "sparse", "dense", "sparse", "sparse", "dense", "sparse"],
            index_topk=8,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 8.0e6},
            eos_token_id=1,
        ),
        # written to config.json instead of indexer_types (GLM-5.2 style)
        schedule=dict(index_topk_freq=4, index_skip_topk_offset=3),
        expect_indexer_types=["full", "full", "full", "shared", "shared", "shared", "full"],
        gen_eos=[2, 3],  # differs from config.json's eos (1): the union {1, 2, 3} matters
        T=48,
        prompt_len=16,
        seed=2000,
        notes="GLM-5.2 style indexer schedule given only as index_topk_freq=4, index_skip_topk_offset=3 "
        "(no indexer_types in config.json): full layers 0,1,2,6; shared 3,4,5 (no indexer weights). "
        "mlp_layer_types explicit and not a dense prefix: dense,sparse,dense,sparse,sparse,dense,sparse. "
        "config.json eos 1, generation_config.json eos [2,3]: stop set is the union {1,2,3}.",
    ),
    dict(
        name="dsv32_f32",
        model_type="deepseek_v32",
        store="f32",
        cfg=dict(
            F32_BASE,
            num_hidden_layers=4,
            first_k_dense_replace=1,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            index_topk=16,
            index_n_heads=8,
            rms_norm_eps=1e-6,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 40.0,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
            max_position_embeddings=163840,
            eos_token_id=1,
        ),
        legacy_rope=True,  # config.json carries rope_theta + rope_scaling (as the official file)
        gen_eos=[1],
        T=48,
        prompt_len=24,
        seed=3000,
        notes="DeepSeek-V3.2 style: half-split (NeoX) RoPE in the indexer, interleaved in MLA; "
        "16 experts in 4 groups, topk_group 2, top-4; YaRN factor 40 (orig 4096, beta 32/1, "
        "mscale = mscale_all_dim = 1) given as legacy top-level rope_theta + rope_scaling.",
    ),
    dict(
        name="dsv3_f32",
        model_type="deepseek_v3",
        store="f32",
        cfg=dict(
            {k: v for k, v in F32_BASE.items() if not k.startswith("index_")},
            num_hidden_layers=4,
            first_k_dense_replace=1,
            q_lora_rank=None,
            n_group=2,
            topk_group=1,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            eos_token_id=1,
        ),
        gen_eos=[1],
        T=48,
        prompt_len=16,
        seed=4000,
        notes="DeepSeek-V3 style: no indexer (dense causal attention), q_lora_rank null (plain "
        "self_attn.q_proj), 8 experts in 2 groups, topk_group 1, top-2.",
    ),
    dict(
        name="glm_dsa_bf16",
        model_type="glm_moe_dsa",
        store="bf16",
        shards=2,
        cfg=dict(
            F32_BASE,
            hidden_size=256,
            intermediate_size=192,
            moe_intermediate_size=32,
            q_lora_rank=192,
            kv_lora_rank=160,
            qk_nope_head_dim=32,
            v_head_dim=32,
            index_head_dim=32,
            index_n_heads=8,
            index_topk=10,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            indexer_types=["full"] * 3,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 1.0e6},
            eos_token_id=[1, 2],
            dtype="bfloat16",
        ),
        gen_eos=[1, 2],
        T=48,
        prompt_len=16,
        seed=5000,
        notes="BF16 weights (e_score_correction_bias F32), sharded in 2 files with "
        "model.safetensors.index.json; expected outputs computed in f32 on the bf16-rounded weights.",
    ),
    dict(
        name="glm_dsa_fp8",
        model_type="glm_moe_dsa",
        store="fp8",
        cfg=dict(
            F32_BASE,
            hidden_size=320,
            intermediate_size=400,
            moe_intermediate_size=64,
            q_lora_rank=192,
            kv_lora_rank=160,
            qk_nope_head_dim=32,
            v_head_dim=48,
            index_head_dim=64,
            index_n_heads=8,
            index_topk=10,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            indexer_types=["full"] * 3,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 1.0e6},
            eos_token_id=[1, 2],
            dtype="bfloat16",
        ),
        gen_eos=[1, 2],
        T=48,
        prompt_len=16,
        seed=6000,
        notes="GLM-5-FP8 style: linear weights F8_E4M3 with 128x128 block scales weight_scale_inv (F32); "
        "embed_tokens, lm_head, norms, mlp.gate.weight, indexer.weights_proj, indexer.k_norm in BF16; "
        "e_score_correction_bias F32. hidden 320 / intermediate 400 / q_lora 192 / kv_lora 160 give "
        "partial blocks. Expected outputs: f32 on the dequantized weights; logits_f32ref.npy: the "
        "unquantized f32 weights.",
    ),
]

GREEDY_NEW = 40

# ----------------------------------------------------------------------------------------------
# Model construction and initialization
# ----------------------------------------------------------------------------------------------


def make_config(fx):
    cfg = dict(fx["cfg"])
    cfg.pop("dtype", None)
    config = AutoConfig.for_model(fx["model_type"], **cfg, **fx.get("schedule", {}))
    config._attn_implementation = "eager"
    return config


@torch.no_grad()
def init_weights(model, config, gen):
    """Random weights with unit-variance activations and peaked next-token distributions."""
    H = config.hidden_size

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    kv_lora = config.kv_lora_rank
    for name, p in model.named_parameters():
        shape = tuple(p.shape)
        if name.endswith("k_norm.bias"):
            v = 0.1 * randn(*shape)
        elif "norm" in name:  # RMSNorm / LayerNorm weights
            v = 1.0 + 0.1 * randn(*shape)
        elif name.endswith("embed_tokens.weight"):
            v = randn(*shape)
        elif name.endswith("lm_head.weight"):
            v = randn(*shape) * (8.0 / math.sqrt(H))
        elif name.endswith("experts.gate_up_proj"):  # [E, 2I, H]
            v = randn(*shape) / math.sqrt(shape[2])
        elif name.endswith("experts.down_proj"):  # [E, H, I]
            v = randn(*shape) / math.sqrt(shape[2])
        elif p.dim() == 2:
            v = randn(*shape) / math.sqrt(shape[1])
            # Small pre-norm activations make the eps of q_a/kv_a_layernorm (1e-6 in the oracle)
            # and of the indexer's k_norm LayerNorm (1e-6) observable.
            if name.endswith("q_a_proj.weight") or name.endswith("indexer.wk.weight"):
                v *= 0.05
            elif name.endswith("kv_a_proj_with_mqa.weight"):
                v[:kv_lora] *= 0.05
        else:
            raise RuntimeError(f"unhandled parameter {name} {shape}")
        p.copy_(v)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.2 * randn(*b.shape))


def build_model(fx):
    config = make_config(fx)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    return model, config


def reinit(model, config, seed):
    init_weights(model, config, torch.Generator().manual_seed(seed))
    return model


# ----------------------------------------------------------------------------------------------
# Checkpoint layout: fused (transformers 5 in memory) <-> official per-expert names
# ----------------------------------------------------------------------------------------------


def to_official(state_dict, config):
    out = {}
    I = config.moe_intermediate_size
    for k, v in state_dict.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            pre = k[: -len("gate_up_proj")]
            for e in range(v.shape[0]):
                out[f"{pre}{e}.gate_proj.weight"] = v[e, :I].contiguous()
                out[f"{pre}{e}.up_proj.weight"] = v[e, I:].contiguous()
        elif k.endswith("mlp.experts.down_proj"):
            pre = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{pre}{e}.down_proj.weight"] = v[e].contiguous()
        else:
            out[k] = v.contiguous()
    return out


def from_official(sd, config):
    out = {}
    experts = {}
    for k, v in sd.items():
        if ".mlp.experts." in k:
            pre, rest = k.split(".mlp.experts.")
            e, proj, _ = rest.split(".")
            experts.setdefault(pre, {}).setdefault(int(e), {})[proj] = v
        else:
            out[k] = v
    for pre, ex in experts.items():
        E = len(ex)
        out[f"{pre}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([ex[e]["gate_proj"], ex[e]["up_proj"]], 0) for e in range(E)]
        )
        out[f"{pre}.mlp.experts.down_proj"] = torch.stack([ex[e]["down_proj"] for e in range(E)])
    return out


# ----------------------------------------------------------------------------------------------
# Storage precision: BF16 rounding, FP8 block quantization
# ----------------------------------------------------------------------------------------------

FP8_KEEP = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "e_score_correction_bias", "weights_proj")


def fp8_quantizable(name, t):
    return t.dim() == 2 and name.endswith(".weight") and not any(s in name for s in FP8_KEEP)


def fp8_quantize(w, block=128):
    """w [out, in] f32 -> (q float8_e4m3fn [out, in], scale_inv f32 [ceil(out/128), ceil(in/128)])."""
    out_f, in_f = w.shape
    nb_o, nb_i = -(-out_f // block), -(-in_f // block)
    q = torch.empty(out_f, in_f, dtype=torch.float8_e4m3fn)
    s = torch.empty(nb_o, nb_i, dtype=torch.float32)
    for i in range(nb_o):
        for j in range(nb_i):
            blk = w[i * block : (i + 1) * block, j * block : (j + 1) * block]
            amax = blk.abs().max().clamp(min=1e-12)
            scale = (amax / 448.0).to(torch.float32)
            s[i, j] = scale
            q[i * block : (i + 1) * block, j * block : (j + 1) * block] = (blk / scale).clamp(-448, 448).to(
                torch.float8_e4m3fn
            )
    return q, s


def fp8_dequantize(q, s, block=128):
    sx = s.repeat_interleave(block, 0)[: q.shape[0]].repeat_interleave(block, 1)[:, : q.shape[1]]
    return q.to(torch.float32) * sx


def storage_dict(official_f32, store):
    """Returns (tensors to write, f32 dict of the values the engine must see)."""
    stored, effective = {}, {}
    for k, v in official_f32.items():
        if store == "f32" or k.endswith("e_score_correction_bias"):
            stored[k] = v.to(torch.float32)
            effective[k] = stored[k]
        elif store == "bf16":
            stored[k] = v.to(torch.bfloat16)
            effective[k] = stored[k].to(torch.float32)
        elif store == "fp8":
            if fp8_quantizable(k, v):
                q, s = fp8_quantize(v)
                stored[k] = q
                stored[k + "_scale_inv"] = s
                effective[k] = fp8_dequantize(q, s)
            else:
                stored[k] = v.to(torch.bfloat16)
                effective[k] = stored[k].to(torch.float32)
        else:
            raise ValueError(store)
    return stored, effective


# ----------------------------------------------------------------------------------------------
# Margin probes: recompute the oracle's selection scores from the modules' inputs
# ----------------------------------------------------------------------------------------------


class Probes:
    def __init__(self, model):
        self.model = model
        self.handles = []
        self.indexer_min = math.inf
        self.router_min = math.inf
        self.group_min = math.inf
        self.indexer_checked = 0
        for name, mod in model.named_modules():
            cls = type(mod).__name__
            if cls.endswith("Indexer"):
                self.handles.append(mod.register_forward_hook(self.indexer_hook, with_kwargs=True))
            elif cls.endswith("TopkRouter"):
                self.handles.append(mod.register_forward_hook(self.router_hook))

    def close(self):
        for h in self.handles:
            h.remove()

    @torch.no_grad()
    def indexer_hook(self, m, args, kwargs, output):
        hidden_states, q_resid, position_embeddings, attention_mask = args[:4]
        modeling = sys.modules[type(m).__module__]
        B, S, _ = hidden_states.shape
        assert B == 1 and kwargs.get("past_key_values") is None, "probe expects one full forward"
        cos, sin = position_embeddings
        q = m.wq_b(q_resid).view(B, S, m.n_heads, m.head_dim)
        q_rot, q_pass = torch.split(q, [m.qk_rope_head_dim, m.head_dim - m.qk_rope_head_dim], dim=-1)
        k = m.k_norm(m.wk(hidden_states)).unsqueeze(2)
        k_rot, k_pass = torch.split(k, [m.qk_rope_head_dim, m.head_dim - m.qk_rope_head_dim], dim=-1)
        if hasattr(modeling, "apply_rotary_pos_emb") and "DeepseekV32" in type(m).__name__:
            q_rot, k_rot = modeling.apply_rotary_pos_emb(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
        else:
            q_rot, k_rot = modeling.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q_pass], dim=-1)
        k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
        scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * m.softmax_scale)
        w = m.weights_proj(hidden_states.to(m.weights_proj.weight.dtype)).float() * (m.n_heads**-0.5)
        I = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)[0]  # [S, S]
        sel = output[0]  # [S, topk]
        K = m.index_topk
        for t in range(S):
            row = I[t, : t + 1]
            if t + 1 <= K:
                continue
            srt = torch.sort(row, descending=True).values
            gap = (srt[K - 1] - srt[K]).item()
            scale = row.abs().max().item()
            rel = gap / scale if scale > 0 else 0.0
            self.indexer_min = min(self.indexer_min, rel)
            self.indexer_checked += 1
            # the probe must reproduce the oracle's own choice
            mine = set(torch.topk(row, K).indices.tolist())
            theirs = set(sel[t].tolist())
            if mine != theirs:  # only possible at an exact tie; such a draw is rejected
                assert gap == 0.0, f"indexer probe disagrees at t={t} with gap {gap}"
                self.indexer_min = -1.0

    @torch.no_grad()
    def router_hook(self, m, args, output):
        x = args[0].reshape(-1, m.hidden_dim)
        logits = F.linear(x.float(), m.weight.float())
        s = logits.sigmoid() + m.e_score_correction_bias
        ng, tg, k = m.num_group, m.topk_group, m.top_k
        per = m.num_experts // ng
        g = s.view(-1, ng, per).topk(2, dim=-1)[0].sum(-1)
        if tg < ng:
            gs = torch.sort(g, dim=-1, descending=True).values
            self.group_min = min(self.group_min, (gs[:, tg - 1] - gs[:, tg]).min().item())
        keep = torch.zeros_like(g).scatter_(1, torch.topk(g, tg, dim=-1)[1], 1).bool()
        keep = keep.unsqueeze(-1).expand(-1, ng, per).reshape(-1, m.num_experts)
        sm = s.masked_fill(~keep, float("-inf"))
        ss = torch.sort(sm, dim=-1, descending=True).values
        self.router_min = min(self.router_min, (ss[:, k - 1] - ss[:, k]).min().item())
        theirs = torch.sort(output[2], dim=-1).values
        mine = torch.sort(torch.topk(sm, k, dim=-1)[1], dim=-1).values
        if not torch.equal(mine, theirs):  # only possible at an exact tie; such a draw is rejected
            self.router_min = -1.0


def top2_gap(logits):
    t2 = torch.topk(logits, 2, dim=-1).values
    return (t2[..., 0] - t2[..., 1]).min().item()


@torch.no_grad()
def probed_forward(model, ids):
    probes = Probes(model)
    try:
        out = model(torch.tensor([ids]), use_cache=False)
    finally:
        probes.close()
    return out.logits[0].float(), probes


# ----------------------------------------------------------------------------------------------
# One attempt: draw tokens, run, measure
# ----------------------------------------------------------------------------------------------


def draw_tokens(rng, n, vocab, forbidden):
    out = []
    while len(out) < n:
        t = int(rng.integers(3, vocab))
        if t not in forbidden:
            out.append(t)
    return out


@torch.no_grad()
def greedy(model, prompt, eos):
    gc = GenerationConfig(
        do_sample=False,
        max_new_tokens=GREEDY_NEW,
        eos_token_id=eos,
        pad_token_id=eos[0],
        output_logits=True,
        return_dict_in_generate=True,
    )
    out = model.generate(torch.tensor([prompt]), generation_config=gc)
    new = out.sequences[0, len(prompt) :].tolist()
    step_logits = torch.stack([l[0] for l in out.logits]).float()
    return new, step_logits


def evaluate(model, fx, seed, eos_union):
    vocab = fx["cfg"]["vocab_size"]
    rng = np.random.default_rng(seed)
    tokens = draw_tokens(rng, fx["T"], vocab, eos_union)
    prompt = draw_tokens(rng, fx["prompt_len"], vocab, eos_union)
    logits, pr1 = probed_forward(model, tokens)
    has_indexer = fx["model_type"] != "deepseek_v3"
    if (
        min(pr1.router_min, pr1.group_min) <= MIN_ROUTER
        or top2_gap(logits) <= MIN_GREEDY
        or (has_indexer and pr1.indexer_min <= MIN_INDEXER_REL)
    ):  # cheap early rejection before generating
        return False, dict(eos_free=None, argmax_ok=None, indexer=pr1.indexer_min,
                           router=min(pr1.router_min, pr1.group_min), greedy=top2_gap(logits))
    new, step_logits = greedy(model, prompt, fx["gen_eos"])
    full, pr2 = probed_forward(model, prompt + new)
    P = len(prompt)
    gen_full = full[P - 1 : P - 1 + len(new)]
    argmax_ok = gen_full.argmax(-1).tolist() == new
    res = dict(
        tokens=tokens,
        prompt=prompt,
        new=new,
        logits=logits,
        argmax_ok=argmax_ok,
        cached_vs_full=(step_logits - gen_full).abs().max().item() if len(new) else float("nan"),
        eos_free=len(new) == GREEDY_NEW and not (set(new) & set(eos_union)),
        indexer=min(pr1.indexer_min, pr2.indexer_min),
        indexer_checked=pr1.indexer_checked + pr2.indexer_checked,
        router=min(pr1.router_min, pr2.router_min, pr1.group_min, pr2.group_min),
        group=min(pr1.group_min, pr2.group_min),
        greedy=min(top2_gap(logits), top2_gap(gen_full)),
        top1_tf=torch.softmax(logits, -1).max(-1).values,
        top1_gen=torch.softmax(gen_full, -1).max(-1).values,
    )
    ok = (
        res["eos_free"]
        and argmax_ok
        and res["greedy"] > MIN_GREEDY
        and res["router"] > MIN_ROUTER
        and (not has_indexer or (res["indexer"] > MIN_INDEXER_REL and res["indexer_checked"] > 0))
    )
    return ok, res


# ----------------------------------------------------------------------------------------------
# Writing and verification
# ----------------------------------------------------------------------------------------------


def write_checkpoint(model, config, fx, stored, d):
    os.makedirs(d, exist_ok=True)
    # config.json via transformers, then adjusted to the official shape
    tmp = tempfile.mkdtemp()
    try:
        config.save_pretrained(tmp)
        with open(os.path.join(tmp, "config.json")) as f:
            cj = json.load(f)
    finally:
        shutil.rmtree(tmp)
    cj["architectures"] = [type(model).__name__]
    cj["dtype"] = fx["cfg"].get("dtype", "float32")
    if "mlp_layer_types" not in fx["cfg"]:
        # as in the official files: the dense prefix comes from first_k_dense_replace alone
        cj.pop("mlp_layer_types", None)
    if "schedule" in fx:
        cj.pop("indexer_types", None)
        cj.update(fx["schedule"])
    if fx.get("legacy_rope"):
        rp = dict(cj.pop("rope_parameters"))
        cj["rope_theta"] = rp.pop("rope_theta")
        rp["type"] = rp.pop("rope_type")
        cj["rope_scaling"] = rp
    if fx["store"] == "fp8":
        cj["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "weight_block_size": [128, 128],
            "activation_scheme": "dynamic",
        }
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cj, f, indent=2, sort_keys=True)
        f.write("\n")
    gcj = {"_from_model_config": False, "bos_token_id": cj.get("bos_token_id"), "eos_token_id": fx["gen_eos"]
           if len(fx["gen_eos"]) > 1 else fx["gen_eos"][0], "do_sample": False,
           "transformers_version": transformers.__version__}
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump(gcj, f, indent=2, sort_keys=True)
        f.write("\n")

    meta = {"format": "pt"}
    shards = fx.get("shards", 1)
    if shards == 1:
        save_file(stored, os.path.join(d, "model.safetensors"), metadata=meta)
    else:
        L = config.num_hidden_layers

        def shard_of(k):
            if k.startswith("model.layers."):
                return 0 if int(k.split(".")[2]) < (L + 1) // 2 else 1
            return 0 if k.startswith("model.embed_tokens") else 1

        names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
        parts = [{} for _ in range(shards)]
        for k, v in stored.items():
            parts[shard_of(k)][k] = v
        weight_map = {}
        total = 0
        for i, p in enumerate(parts):
            save_file(p, os.path.join(d, names[i]), metadata=meta)
            for k, v in p.items():
                weight_map[k] = names[i]
                total += v.numel() * v.element_size()
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f,
                      indent=2)
            f.write("\n")


def read_checkpoint(d):
    sd = {}
    for fn in sorted(os.listdir(d)):
        if fn.endswith(".safetensors"):
            sd.update(load_file(os.path.join(d, fn)))
    return sd


@torch.no_grad()
def verify_reload(d, fx, ref_logits, tokens, prompt, new, effective_official):
    """Reload with from_pretrained: no missing/unexpected keys, same logits, same greedy tokens."""
    if fx["store"] == "fp8":
        # transformers' fp8 loader is not the oracle here: dequantize ourselves into a temp f32 dir
        # with the same names (minus *_scale_inv), and check the files dequantize to what we used.
        sd = read_checkpoint(d)
        deq = {}
        for k, v in sd.items():
            if k.endswith("_scale_inv"):
                continue
            if v.dtype == torch.float8_e4m3fn:
                deq[k] = fp8_dequantize(v, sd[k + "_scale_inv"])
            else:
                deq[k] = v.to(torch.float32)
        assert set(deq) == set(effective_official)
        for k in deq:
            assert torch.equal(deq[k], effective_official[k]), k
        tmp = tempfile.mkdtemp()
        for fn in ("config.json", "generation_config.json"):
            shutil.copy(os.path.join(d, fn), tmp)
        with open(os.path.join(tmp, "config.json")) as f:
            cj = json.load(f)
        cj.pop("quantization_config")
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cj, f)
        save_file(deq, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        load_dir = tmp
    else:
        load_dir, tmp = d, None
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            load_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
        )
        model.eval()
        problems = {k: v for k, v in info.items() if v}
        assert not problems, f"loading info: {problems}"
        mlp_types = ["sparse" if hasattr(layer.mlp, "experts") else "dense" for layer in model.model.layers]
        assert mlp_types == list(config_mlp_types(fx)), mlp_types
        if "expect_indexer_types" in fx:
            assert list(model.config.indexer_types) == fx["expect_indexer_types"], model.config.indexer_types
        logits = model(torch.tensor([tokens]), use_cache=False).logits[0]
        diff = (logits - ref_logits).abs().max().item()
        assert diff == 0.0 or diff < 1e-5, f"reloaded logits differ by {diff}"
        # generation_config.json must be picked up: generate with the model's own config
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=GREEDY_NEW)
        assert out[0, len(prompt) :].tolist() == new, "reloaded greedy differs"
        assert list(np.atleast_1d(model.generation_config.eos_token_id)) == fx["gen_eos"]
        return diff, model.config
    finally:
        if tmp:
            shutil.rmtree(tmp)


def config_mlp_types(fx):
    c = fx["cfg"]
    if "mlp_layer_types" in c:
        return c["mlp_layer_types"]
    n = c["num_hidden_layers"]
    k = min(c["first_k_dense_replace"], n)
    return ["dense"] * k + ["sparse"] * (n - k)


def dir_size(d):
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


# ----------------------------------------------------------------------------------------------


def quality(res, has_indexer):
    """Worst margin relative to its acceptance threshold (bigger is better)."""
    q = min(res["router"] / MIN_ROUTER, res["greedy"] / MIN_GREEDY)
    if has_indexer:
        q = min(q, res["indexer"] / MIN_INDEXER_REL)
    return q


def make_fixture(fx, out_root, attempts=80, enough=3.0, min_scan=10):
    """Scans seeds and keeps the acceptable draw with the most comfortable margins: stops at the
    first draw whose worst margin is `enough` times its threshold, or after `min_scan` draws if one
    is acceptable, else after `attempts` draws."""
    t0 = time.time()
    cfg_eos = fx["cfg"]["eos_token_id"]
    cfg_eos = [cfg_eos] if isinstance(cfg_eos, int) else list(cfg_eos)
    eos_union = sorted(set(cfg_eos) | set(fx["gen_eos"]))
    best = None
    has_indexer = fx["model_type"] != "deepseek_v3"
    for attempt in range(attempts):
        seed = fx["seed"] + attempt
        if attempt == 0:
            f32_model, config = build_model(fx)
            eff_model = build_model(fx)[0] if fx["store"] != "f32" else None
        reinit(f32_model, config, seed)
        official = to_official(f32_model.state_dict(), config)
        stored, effective = storage_dict(official, fx["store"])
        if eff_model is not None:
            eff_model.load_state_dict(from_official(effective, config), strict=True)
            model, ref_model = eff_model, f32_model
        else:
            model, ref_model = f32_model, None
        ok, res = evaluate(model, fx, seed, eos_union)
        print(
            f"  [{fx['name']}] seed {seed}: ok={ok} eos_free={res['eos_free']} argmax_ok={res['argmax_ok']} "
            f"indexer={res['indexer']:.2e} router={res['router']:.2e} greedy={res['greedy']:.2e}",
            flush=True,
        )
        if ok and (best is None or quality(res, has_indexer) > best[0]):
            best = (quality(res, has_indexer), seed, None, None, config, stored, effective, res)
        if best is not None and (best[0] >= enough or attempt + 1 >= min_scan):
            break
    if best is None:
        raise RuntimeError(f"{fx['name']}: no acceptable draw in {attempts} attempts")
    _, seed, _, _, config, stored, effective, res = best
    # rebuild the chosen draw (the models were reused by later attempts)
    reinit(f32_model, config, seed)
    if eff_model is not None:
        eff_model.load_state_dict(from_official(effective, config), strict=True)
        model, ref_model = eff_model, f32_model
    else:
        model, ref_model = f32_model, None
    with torch.no_grad():
        again = model(torch.tensor([res["tokens"]]), use_cache=False).logits[0].float()
    assert torch.equal(again, res["logits"]), "rebuilt draw differs"

    d = os.path.join(out_root, fx["name"])
    if os.path.isdir(d):
        shutil.rmtree(d)
    write_checkpoint(model, config, fx, stored, d)
    logits = res["logits"]
    np.save(os.path.join(d, "logits.npy"), logits.numpy().astype(np.float32))
    extra = ""
    if ref_model is not None and fx["store"] == "fp8":
        with torch.no_grad():
            ref = ref_model(torch.tensor([res["tokens"]]), use_cache=False).logits[0].float()
        np.save(os.path.join(d, "logits_f32ref.npy"), ref.numpy().astype(np.float32))
        err = (ref - logits).abs().max().item()
        agree = (ref.argmax(-1) == logits.argmax(-1)).float().mean().item()
        extra = f" fp8-vs-f32 max|dlogit|={err:.3f} argmax agreement={agree:.2f}"
    reload_diff, cfg2 = verify_reload(d, fx, logits, res["tokens"], res["prompt"], res["new"], effective)

    margins = {
        "indexer": float(res["indexer"]) if has_indexer else None,
        "router": float(res["router"]),
        "greedy_logit": float(res["greedy"]),
    }
    notes = fx["notes"] + (
        f" Seed {seed}. min_margins.indexer is relative ((k-th - (k+1)-th score) / max|score| of the query "
        f"row, over every full layer and every query with more than index_topk causal keys, on both "
        f"`tokens` and greedy_prompt+greedy_new); router is absolute (selection-score gap at the "
        f"top-k boundary, and group-score gap at the topk_group boundary); greedy_logit is top1-top2 "
        f"over all teacher-forced positions and all generated steps. HF cached generate agrees with "
        f"argmax of a fresh full forward at every step (max |cached - full| logit diff "
        f"{res['cached_vs_full']:.1e})."
    )
    if not has_indexer:
        notes += " No indexer: min_margins.indexer is null."
    expected = {
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "model_type": fx["model_type"],
        "dtype": fx["store"],
        "tokens": res["tokens"],
        "greedy_prompt": res["prompt"],
        "greedy_new": res["new"],
        "min_margins": margins,
        "notes": notes,
    }
    with open(os.path.join(d, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")
    t1, tg = res["top1_tf"], res["top1_gen"]
    print(
        f"{fx['name']}: {dir_size(d) / 1e6:.2f} MB, T={len(res['tokens'])}, "
        f"index_topk={fx['cfg'].get('index_topk')}, prompt={len(res['prompt'])}, new={len(res['new'])}, "
        f"margins={margins}, top1 prob teacher-forced median {t1.median():.2f} min {t1.min():.2f} "
        f"frac>0.5 {(t1 > 0.5).float().mean():.2f}; generated median {tg.median():.2f}; "
        f"distinct generated {len(set(res['new']))}; cached-vs-full {res['cached_vs_full']:.1e}; "
        f"reload diff {reload_diff:.1e};{extra} ({time.time() - t0:.1f}s)",
        flush=True,
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures")
    ap.add_argument("--only", nargs="*")
    a = ap.parse_args()
    transformers.logging.set_verbosity_error()
    for fx in FIXTURES:
        if a.only and fx["name"] not in a.only:
            continue
        make_fixture(fx, a.out)


if __name__ == "__main__":
    main()
