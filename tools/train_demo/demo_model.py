"""The vireo demo model: transformers' GlmMoeDsaForCausalLM plus an MTP layer in the official
GLM-5 / DeepSeek-V3 layout (spec section 3.5), the indexer KL loss of spec section 3.6, and the
conversion between training names and the shipped checkpoint names."""
import copy
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as M

ENDOFTEXT = "<|endoftext|>"
# GLM-style special tokens, appended after the BPE vocabulary (ids vocab-len(SPECIAL) .. vocab-1).
SPECIAL_TOKENS = [ENDOFTEXT, "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
                  "<|assistant|>", "<|observation|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
                  "<tool_response>", "</tool_response>", "<arg_key>", "</arg_key>", "<arg_value>",
                  "</arg_value>"]
VOCAB_SIZE = 8192


def make_config(eos_id, small=False):
    if small:  # CPU smoke run / fallback
        dims = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=32, q_lora_rank=64,
                    kv_lora_rank=32, num_attention_heads=2)
    else:
        dims = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=48, q_lora_rank=128,
                    kv_lora_rank=64, num_attention_heads=4)
    cfg = GlmMoeDsaConfig(
        vocab_size=VOCAB_SIZE,
        num_hidden_layers=6,
        num_key_value_heads=dims["num_attention_heads"],
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        index_n_heads=4, index_head_dim=32, index_topk=64,
        indexer_types=["full", "full", "shared", "full", "shared", "shared"],
        mlp_layer_types=["dense"] + ["sparse"] * 5, first_k_dense_replace=1,
        n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, n_group=1, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True,
        max_position_embeddings=2048, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-5, initializer_range=0.02, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=eos_id, pad_token_id=None,
        attention_bias=False, attention_dropout=0.0,
        **dims)
    return cfg


class SharedHead(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.norm = M.GlmMoeDsaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPLayer(nn.Module):
    """u = eh_proj([enorm(embed(x_{t+1})) ; hnorm(h_t)]) -> decoder layer -> shared_head.norm -> lm_head.
    h_t is the main model's final-norm hidden state. Its own indexer is "full"; its MLP is MoE."""

    def __init__(self, cfg):
        super().__init__()
        n = cfg.num_hidden_layers
        c = copy.deepcopy(cfg)
        c.num_hidden_layers = n + 1
        c.indexer_types = list(cfg.indexer_types) + ["full"]
        c.mlp_layer_types = list(cfg.mlp_layer_types) + ["sparse"]
        c._attn_implementation = cfg._attn_implementation
        self.cfg = c
        self.enorm = M.GlmMoeDsaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = M.GlmMoeDsaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layer = M.GlmMoeDsaDecoderLayer(c, n)
        self.shared_head = SharedHead(cfg)

    def forward(self, model, h, next_ids, position_ids):
        """h: [B, T, H] final-norm hidden states at positions t; next_ids: [B, T] tokens t+1;
        position_ids: [T] the positions t. Returns the MTP logits [B, T, V] (predicting t+2)."""
        e = model.model.embed_tokens(next_ids)
        # the residual stream stays f32 under autocast, as in the main model (whose embeddings are f32)
        u = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h)], dim=-1)).float()
        T = u.shape[1]
        pos = position_ids.view(1, T)
        pe = model.model.rotary_emb(u, pos)
        mask = torch.full((T, T), torch.finfo(u.dtype).min, device=u.device, dtype=u.dtype).triu(1)
        mask = mask.view(1, 1, T, T)
        u, _ = self.layer(u, attention_mask=mask, position_embeddings=pe, position_ids=pos)
        return model.lm_head(self.shared_head.norm(u))


def init_mtp(mtp, std):
    for name, p in mtp.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name or "k_norm.weight" in name:
            nn.init.ones_(p)
        elif name.endswith("k_norm.bias"):
            nn.init.zeros_(p)
        else:
            nn.init.normal_(p, std=std)
    for name, b in mtp.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.zero_()


def attention_modules(model, mtp=None):
    mods = list(enumerate(l.self_attn for l in model.model.layers))
    if mtp is not None:
        mods.append((model.config.num_hidden_layers, mtp.layer.self_attn))
    return mods


def set_index_topk(model, mtp, k):
    for _, a in attention_modules(model, mtp):
        if a.indexer is not None:
            a.indexer.index_topk = k


def indexer_scores(ix, x, q_resid, cos, sin, causal):
    """The lightning indexer's scores I(t,u), with gradients (transformers' forward is no_grad).
    x: [B,T,H] (the attention input), q_resid: [B,T,q_lora]; returns [B,T,T] f32, -inf where u > t."""
    B, T, _ = x.shape
    q = ix.wq_b(q_resid).view(B, T, ix.n_heads, ix.head_dim)
    q_rot, q_pass = torch.split(q, [ix.qk_rope_head_dim, ix.head_dim - ix.qk_rope_head_dim], dim=-1)
    k = ix.k_norm(ix.wk(x)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [ix.qk_rope_head_dim, ix.head_dim - ix.qk_rope_head_dim], dim=-1)
    q_rot, k_rot = M.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1).float()
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2).float()
    with torch.autocast(device_type=x.device.type, enabled=False):  # scores in f32, as in the oracle
        s = F.relu(torch.einsum("bthd,bud->bhtu", q, k) * ix.softmax_scale)  # [B,h,T,T]
        w = F.linear(x.float(), ix.weights_proj.weight.float()) * (ix.n_heads ** -0.5)  # [B,T,h]
        I = torch.einsum("bth,bhtu->btu", w, s)
    return I.masked_fill(~causal, float("-inf"))


class IndexerTap:
    """Forward hooks that record, for each attention module, its input, q_resid, rotary tables,
    attention probabilities and the top-k used; then compute the indexer KL loss (spec 3.6)."""

    def __init__(self, model, mtp):
        self.mods = attention_modules(model, mtp)
        self.rec = {}
        self.handles = []
        self.enabled = True
        for li, a in self.mods:
            self.handles.append(a.register_forward_hook(self._attn_hook(li), with_kwargs=True))
            self.handles.append(a.q_a_layernorm.register_forward_hook(self._q_hook(li)))
        # which full layer's selection each layer uses
        self.owner = {}
        last = None
        types = list(model.config.indexer_types) + (["full"] if mtp is not None else [])
        for li, t in enumerate(types):
            if t == "full":
                last = li
            self.owner[li] = last

    def _q_hook(self, li):
        def hook(mod, inp, out):
            if self.enabled:
                self.rec.setdefault(li, {})["q_resid"] = out
        return hook

    def _attn_hook(self, li):
        def hook(mod, args, kwargs, out):
            if not self.enabled:
                return
            r = self.rec.setdefault(li, {})
            r["x"] = kwargs.get("hidden_states", args[0] if args else None)
            r["pe"] = kwargs["position_embeddings"]
            r["probs"] = out[1]
            r["topk"] = out[2]
        return hook

    def loss(self, sparse):
        """KL(target || softmax(I)) averaged over queries and full layers. target = attention
        probabilities of the full layer and the shared layers that reuse its selection, summed over
        heads and L1-normalised, detached. Dense stage: over all causal keys; sparse stage: over the
        selected keys. The indexer's inputs are detached from the main model."""
        total, n = 0.0, 0
        for li, a in self.mods:
            if a.indexer is None or li not in self.rec:
                continue
            r = self.rec[li]
            x, qr = r["x"].detach(), r["q_resid"].detach()
            B, T, _ = x.shape
            cos, sin = r["pe"]
            causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril().view(1, T, T)
            I = indexer_scores(a.indexer, x, qr, cos, sin, causal)
            tgt = torch.zeros(B, T, T, device=x.device, dtype=torch.float32)
            for lj, _ in self.mods:
                if self.owner.get(lj) == li and lj in self.rec and self.rec[lj].get("probs") is not None:
                    tgt = tgt + self.rec[lj]["probs"].detach().float().sum(1)
            tgt = tgt / tgt.sum(-1, keepdim=True).clamp_min(1e-20)
            if sparse:
                sel = torch.zeros(B, T, T, dtype=torch.bool, device=x.device)
                sel.scatter_(-1, r["topk"].long(), True)
                I = I.masked_fill(~(sel & causal), float("-inf"))
                tgt = tgt * (sel & causal)
                tgt = tgt / tgt.sum(-1, keepdim=True).clamp_min(1e-20)
            logq = torch.log_softmax(I, dim=-1)
            pos = tgt > 0
            kl = torch.where(pos, tgt * (torch.log(tgt.clamp_min(1e-30)) - logq), torch.zeros_like(tgt))
            total = total + kl.sum(-1).mean()
            n += 1
        self.rec = {}
        return total / max(n, 1)


class RouterTap:
    """Counts expert loads per MoE layer for the aux-loss-free balancing of DeepSeek-V3:
    e_score_correction_bias += gamma * sign(mean_load - load)."""

    def __init__(self, model, mtp):
        self.gates = [l.mlp.gate for l in model.model.layers if isinstance(l.mlp, M.GlmMoeDsaMoE)]
        if mtp is not None:
            self.gates.append(mtp.layer.mlp.gate)
        self.loads = {}
        for g in self.gates:
            g.register_forward_hook(self._hook(g))

    def _hook(self, g):
        def hook(mod, inp, out):
            idx = out[2].detach().reshape(-1)
            cnt = torch.bincount(idx, minlength=mod.num_experts).float()
            self.loads[id(mod)] = self.loads.get(id(mod), 0) + cnt
        return hook

    @torch.no_grad()
    def update(self, gamma):
        imb = []
        for g in self.gates:
            load = self.loads.get(id(g))
            if load is None:
                continue
            g.e_score_correction_bias += gamma * torch.sign(load.mean() - load)
            imb.append((load.max() / load.mean()).item())
        self.loads = {}
        return max(imb) if imb else 0.0


# ---- checkpoint names -------------------------------------------------------------------------

def export_state_dict(model, mtp, dtype=torch.bfloat16):
    """Official names: per-expert weights, the MTP layer as model.layers.{N}.*; bf16 except
    e_score_correction_bias (f32)."""
    n = model.config.num_hidden_layers
    out = {}

    def put(name, t):
        t = t.detach().cpu()
        if name.endswith("e_score_correction_bias"):
            out[name] = t.float().contiguous()
        else:
            out[name] = t.to(dtype).contiguous()

    def put_module(prefix, sd):
        for k, v in sd.items():
            if k.endswith("mlp.experts.gate_up_proj"):
                base = prefix + k[: -len("gate_up_proj")]
                I = v.shape[1] // 2
                for e in range(v.shape[0]):
                    put(f"{base}{e}.gate_proj.weight", v[e, :I])
                    put(f"{base}{e}.up_proj.weight", v[e, I:])
            elif k.endswith("mlp.experts.down_proj"):
                base = prefix + k[: -len("down_proj")]
                for e in range(v.shape[0]):
                    put(f"{base}{e}.down_proj.weight", v[e])
            else:
                put(prefix + k, v)

    sd = model.state_dict()
    put_module("", {k: v for k, v in sd.items()})
    if mtp is not None:
        msd = mtp.state_dict()
        for k, v in msd.items():
            if k.startswith("layer."):
                put_module(f"model.layers.{n}.", {k[len("layer."):]: v})
            else:
                put(f"model.layers.{n}.{k}", v)
    return out


def load_mtp_from_checkpoint(mtp, tensors, n):
    """Inverse of export_state_dict for the MTP part (fuses experts back)."""
    p = f"model.layers.{n}."
    sd = {}
    ex = {}
    for k, v in tensors.items():
        if not k.startswith(p):
            continue
        k = k[len(p):]
        if k.startswith("mlp.experts."):
            _, _, e, proj, _ = k.split(".")
            ex.setdefault(int(e), {})[proj] = v
        elif k.split(".")[0] in ("enorm", "hnorm", "eh_proj", "shared_head"):
            sd[k] = v
        else:
            sd["layer." + k] = v
    E = len(ex)
    sd["layer.mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([ex[e]["gate_proj"], ex[e]["up_proj"]], 0) for e in range(E)])
    sd["layer.mlp.experts.down_proj"] = torch.stack([ex[e]["down_proj"] for e in range(E)])
    sd = {k: v.float() for k, v in sd.items()}
    missing, unexpected = mtp.load_state_dict(sd, strict=True), None
    return missing


def count_params(model, mtp):
    main = sum(p.numel() for p in model.parameters())
    m = sum(p.numel() for p in mtp.parameters()) if mtp is not None else 0
    return main, m
