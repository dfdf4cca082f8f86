#!/usr/bin/env python3
"""Train vireo's embedded demo model: a small GLM-5-architecture (glm_moe_dsa) model with an MTP layer.

  python train.py prepare --out .devcarry/demo            # corpus + tokenizer + token ids (CPU, ~1 min)
  python train.py train --data .devcarry/demo --out OUT   # model training (GPU: ~8 min on one H200)
  python train.py export --ckpt OUT --data .devcarry/demo --out models/vireo-demo

See README.md in this folder.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import demo_model as D  # noqa: E402

# GLM-4 / GLM-5 (and cl100k) pre-tokenizer split; the ByteLevel step that follows uses no regex of its own.
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
HELDOUT_FILE = "howto/unicode.rst.txt"
HELDOUT_CHARS = 4000


# ---------------------------------------------------------------------------------------- prepare

def train_tokenizer(texts):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=D.VOCAB_SIZE - len(D.SPECIAL_TOKENS), min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[], show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in D.SPECIAL_TOKENS])
    assert tok.get_vocab_size() == D.VOCAB_SIZE, tok.get_vocab_size()
    return tok


def heldout_text(held):
    """The first ~4000 characters of howto/unicode (held out), cut at a paragraph end."""
    text = dict(held)[HELDOUT_FILE]
    paras, out = text.split("\n\n"), ""
    for p in paras:
        if len(out) + len(p) > HELDOUT_CHARS and out:
            break
        out += p + "\n\n"
    return out.rstrip("\n") + "\n"


def cmd_prepare(a):
    import corpus
    os.makedirs(a.out, exist_ok=True)
    train, held = corpus.build()
    ver = subprocess.run(["dpkg-query", "-W", "-f=${Version}", corpus.DEBIAN_PACKAGE],
                         capture_output=True, text=True).stdout.strip()
    t0 = time.time()
    tok = train_tokenizer([t for _, t in train])
    print(f"tokenizer trained in {time.time() - t0:.1f}s", flush=True)
    tok.save(os.path.join(a.out, "tokenizer.json"))
    eos = tok.token_to_id(D.ENDOFTEXT)

    def encode(docs):
        ids = []
        for enc in tok.encode_batch([t for _, t in docs], add_special_tokens=False):
            ids.extend(enc.ids)
            ids.append(eos)
        return np.array(ids, dtype=np.uint16)

    tr, he = encode(train), encode(held)
    np.save(os.path.join(a.out, "train.npy"), tr)
    np.save(os.path.join(a.out, "heldout.npy"), he)
    with open(os.path.join(a.out, "heldout.txt"), "w", encoding="utf-8") as f:
        f.write(heldout_text(held))
    manifest = {
        "package": corpus.DEBIAN_PACKAGE, "package_version": ver, "sources": corpus.SOURCES,
        "train_files": [r for r, _ in train], "heldout_files": [r for r, _ in held],
        "train_chars": sum(len(t) for _, t in train), "heldout_chars": sum(len(t) for _, t in held),
        "train_tokens": int(len(tr)), "heldout_tokens": int(len(he)), "eos_id": eos,
    }
    with open(os.path.join(a.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    print(json.dumps({k: v for k, v in manifest.items() if not k.endswith("files")}), flush=True)


# ------------------------------------------------------------------------------------------ train

def build(eos, small, device, experts_impl):
    cfg = D.make_config(eos, small=small)
    cfg._attn_implementation = "eager"  # the indexer loss needs the attention probabilities
    torch.manual_seed(1234)
    model = D.GlmMoeDsaForCausalLM(cfg)
    mtp = D.MTPLayer(cfg)
    D.init_mtp(mtp, cfg.initializer_range)
    model.config._experts_implementation = experts_impl
    mtp.cfg._experts_implementation = experts_impl
    return cfg, model.to(device), mtp.to(device)


def forward_losses(model, mtp, ids):
    """ids [B, T]: main next-token loss over T-1 targets, MTP next-next-token loss over T-2."""
    B, T = ids.shape
    h = model.model(input_ids=ids).last_hidden_state  # final-norm hidden states
    logits = model.lm_head(h)
    lm = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    pos = torch.arange(T - 1, device=ids.device)
    ml = mtp(model, h[:, :-1], ids[:, 1:], pos)  # row t: h_t, token t+1 -> predicts t+2
    mt = F.cross_entropy(ml[:, :-1].flatten(0, 1).float(), ids[:, 2:].flatten())
    acc = (ml[:, :-1].argmax(-1) == logits[:, 1:-1].argmax(-1)).float().mean()
    return lm, mt, acc


def cmd_train(a):
    dev = torch.device(a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    man = json.load(open(os.path.join(a.data, "manifest.json")))
    train = torch.from_numpy(np.load(os.path.join(a.data, "train.npy")).astype(np.int64))
    held = torch.from_numpy(np.load(os.path.join(a.data, "heldout.npy")).astype(np.int64))
    os.makedirs(a.out, exist_ok=True)
    log = {"args": vars(a), "device": str(dev), "torch": torch.__version__}
    import transformers
    log["transformers"] = transformers.__version__
    if dev.type == "cuda":
        log["gpu"] = torch.cuda.get_device_name(0)
        torch.backends.cuda.matmul.allow_tf32 = True
    print(json.dumps(log), flush=True)

    impl = a.experts
    if impl == "auto":
        impl = "grouped_mm" if dev.type == "cuda" else "eager"
    cfg, model, mtp = build(man["eos_id"], a.small, dev, impl)
    if impl != "eager":  # check the fast experts path once against eager; fall back if it fails
        try:
            ids = train[: 2 * 128].view(2, 128).to(dev)
            amp0 = torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda" or a.cpu_amp)
            with amp0:
                l_fast = forward_losses(model, mtp, ids)[0]
            l_fast.backward()
            model.config._experts_implementation = mtp.cfg._experts_implementation = "eager"
            with torch.no_grad(), amp0:
                l_eager = forward_losses(model, mtp, ids)[0]
            print(f"experts {impl}: loss {float(l_fast):.5f} vs eager {float(l_eager):.5f}", flush=True)
            assert abs(float(l_fast) - float(l_eager)) < 0.05
            model.config._experts_implementation = mtp.cfg._experts_implementation = impl
        except Exception as ex:  # noqa: BLE001
            print(f"experts {impl} unusable ({type(ex).__name__}: {str(ex)[:200]}); using eager", flush=True)
            impl = "eager"
            model.config._experts_implementation = mtp.cfg._experts_implementation = impl
        model.zero_grad(set_to_none=True), mtp.zero_grad(set_to_none=True)
    main_p, mtp_p = D.count_params(model, mtp)
    print(f"params: main {main_p}, mtp {mtp_p}, total {main_p + mtp_p}", flush=True)

    itap = D.IndexerTap(model, mtp)
    rtap = D.RouterTap(model, mtp)
    decay = [p for n, p in list(model.named_parameters()) + list(mtp.named_parameters()) if p.dim() >= 2]
    nodecay = [p for n, p in list(model.named_parameters()) + list(mtp.named_parameters()) if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.wd}, {"params": nodecay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=dev.type == "cuda")
    use_amp = dev.type == "cuda" or a.cpu_amp
    amp = torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=use_amp)
    g = torch.Generator().manual_seed(0)
    T, B = a.seq, a.batch

    def batch():
        starts = torch.randint(0, len(train) - T - 1, (B,), generator=g)
        return torch.stack([train[s:s + T] for s in starts]).to(dev, non_blocking=True)

    ev_starts = torch.linspace(0, len(held) - T - 1, a.eval_windows).long()
    ev_batch = torch.stack([held[s:s + T] for s in ev_starts]).to(dev)

    def evaluate():
        model.eval(), mtp.eval()
        itap.enabled = False
        with torch.no_grad(), amp:
            r = [forward_losses(model, mtp, ev_batch[i:i + B]) for i in range(0, len(ev_batch), B)]
        itap.enabled = True
        itap.rec = {}
        rtap.loads = {}
        model.train(), mtp.train()
        return [float(sum(x[j] for x in r) / len(r)) for j in range(3)]

    max_steps = a.steps if a.steps else int(a.max_epochs * len(train) / (B * T))
    total = max_steps
    dense_until = None
    t_start = time.time()
    hist, evals = [], []
    best = (float("inf"), None, -1)
    step = 0
    sparse = False
    ema = None
    while step < total:
        if dense_until is None or step == 0:
            dense_until = int(a.dense_frac * total)
        if step < dense_until and not sparse:
            D.set_index_topk(model, mtp, 1 << 30)  # dense warm-up: all keys attended, indexer learns by KL
        elif not sparse:
            sparse = True
            D.set_index_topk(model, mtp, cfg.index_topk)
            print(f"step {step}: sparse stage (index_topk {cfg.index_topk})", flush=True)
        lr = a.lr * min(1.0, (step + 1) / a.warmup)
        if step >= a.warmup:
            pr = (step - a.warmup) / max(1, total - a.warmup)
            lr = a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(pr, 1.0))))
        for pg in opt.param_groups:
            pg["lr"] = lr
        ids = batch()
        with amp:
            lm, mt, acc = forward_losses(model, mtp, ids)
            kl = itap.loss(sparse)
        loss = lm + a.mtp_weight * mt + a.kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(list(model.parameters()) + list(mtp.parameters()), 1.0)
        opt.step()
        imb = rtap.update(a.bias_gamma)
        step += 1
        if step == 20 and a.time_budget and dev.type == "cuda":
            torch.cuda.synchronize()
            per = (time.time() - t_start) / 20
            fit = int(20 + (a.time_budget - (time.time() - t_start)) / (per * 1.08))
            total = max(40, min(max_steps, fit))
            dense_until = int(a.dense_frac * total)
            print(f"{per * 1000:.0f} ms/step -> {total} steps (cap {max_steps})", flush=True)
        if step % a.log_every == 0 or step == total:
            vals = [float(x.detach()) if torch.is_tensor(x) else float(x) for x in (lm, mt, kl, acc)]
            ema = vals if ema is None else [0.9 * e + 0.1 * v for e, v in zip(ema, vals)]
            hist.append({"step": step, "lm": vals[0], "mtp": vals[1], "kl": vals[2], "acc": vals[3],
                         "lr": lr, "gnorm": float(gn), "imbalance": imb, "t": time.time() - t_start})
            print(f"step {step}/{total} lm {vals[0]:.3f} mtp {vals[1]:.3f} kl {vals[2]:.3f} acc {vals[3]:.3f} "
                  f"lr {lr:.2e} gn {float(gn):.2f} imb {imb:.2f} t {time.time() - t_start:.0f}s", flush=True)
        if step % max(1, total // a.evals) == 0 or step == total:
            e = evaluate()
            evals.append({"step": step, "heldout_lm": e[0], "heldout_mtp": e[1], "heldout_acc": e[2],
                          "sparse": sparse})
            print(f"  eval step {step}: heldout lm {e[0]:.3f} (ppl {math.exp(e[0]):.1f}) mtp {e[1]:.3f} "
                  f"acc {e[2]:.3f}", flush=True)
            if sparse and e[0] < best[0]:
                best = (e[0], ({k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
                               {k: v.detach().cpu().clone() for k, v in mtp.state_dict().items()}), step)
    train_time = time.time() - t_start
    if best[1] is not None:
        model.load_state_dict(best[1][0])
        mtp.load_state_dict(best[1][1])
    # final train loss: mean over 8 fresh training batches, sparse, eval mode, at the kept weights
    model.eval(), mtp.eval()
    itap.enabled = False
    with torch.no_grad(), amp:
        tl = [forward_losses(model, mtp, batch()) for _ in range(8)]
    final_train = [float(sum(x[j] for x in tl) / len(tl)) for j in range(3)]
    fe = evaluate()
    log.update({"params_main": main_p, "params_mtp": mtp_p, "experts_impl": impl, "steps": step,
                "dense_steps": dense_until, "train_seconds": train_time, "kept_step": best[2],
                "final_train": final_train, "final_heldout": fe, "history": hist, "evals": evals,
                "tokens_per_step": B * T, "config": cfg.to_dict()})
    print(f"done: {step} steps in {train_time:.0f}s; kept step {best[2]}; train lm {final_train[0]:.3f} "
          f"heldout lm {fe[0]:.3f} mtp acc {fe[2]:.3f}", flush=True)
    sd = D.export_state_dict(model, mtp)
    from safetensors.torch import save_file
    keys = list(sd)
    half = len(keys) // 2
    save_file({k: sd[k] for k in keys[:half]}, os.path.join(a.out, "ckpt_part0.safetensors"))
    save_file({k: sd[k] for k in keys[half:]}, os.path.join(a.out, "ckpt_part1.safetensors"))
    with open(os.path.join(a.out, "train_log.json"), "w") as f:
        json.dump(log, f, indent=1, default=str)


# ----------------------------------------------------------------------------------------- export

def chat_template():
    here = os.path.dirname(os.path.abspath(__file__))
    p = os.path.join(here, "..", "..", "tests", "data", "chat", "glm5_template.jinja")
    if os.path.exists(p):
        return open(p, encoding="utf-8").read(), "tests/data/chat/glm5_template.jinja"
    t = ("[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endfor %}"
         "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    return t, "simple GLM-style template (train.py)"


def cmd_export(a):
    from safetensors.torch import load_file, save_file
    log = json.load(open(os.path.join(a.ckpt, "train_log.json")))
    man = json.load(open(os.path.join(a.data, "manifest.json")))
    sd = {}
    for p in sorted(os.listdir(a.ckpt)):
        if p.startswith("ckpt_part") and p.endswith(".safetensors"):
            sd.update(load_file(os.path.join(a.ckpt, p)))
    os.makedirs(a.out, exist_ok=True)
    cfg = D.make_config(man["eos_id"], small=log["args"]["small"])
    d = cfg.to_dict()
    for k in ("_attn_implementation", "_experts_implementation", "transformers_version", "dtype", "torch_dtype",
              "_name_or_path", "chunk_size_feed_forward", "id2label", "label2id", "is_encoder_decoder",
              "output_attentions", "output_hidden_states", "problem_type", "return_dict", "layer_types",
              "qk_head_dim", "output_router_logits", "use_cache"):
        d.pop(k, None)
    d["architectures"] = ["GlmMoeDsaForCausalLM"]
    d["num_nextn_predict_layers"] = 1
    d["dtype"] = "bfloat16"
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(d, f, indent=2, sort_keys=True)
    with open(os.path.join(a.out, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": man["eos_id"], "pad_token_id": man["eos_id"], "do_sample": False}, f, indent=2)
    save_file(sd, os.path.join(a.out, "model.safetensors"), metadata={"format": "pt"})
    import shutil
    shutil.copy(os.path.join(a.data, "tokenizer.json"), os.path.join(a.out, "tokenizer.json"))
    tmpl, src = chat_template()
    tc = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": D.ENDOFTEXT, "pad_token": D.ENDOFTEXT,
          "bos_token": None, "unk_token": None, "add_bos_token": False, "add_eos_token": False,
          "clean_up_tokenization_spaces": False, "model_max_length": cfg.max_position_embeddings,
          "extra_special_tokens": [t for t in D.SPECIAL_TOKENS if t != D.ENDOFTEXT],
          "chat_template": tmpl}
    with open(os.path.join(a.out, "tokenizer_config.json"), "w") as f:
        json.dump(tc, f, indent=2)
    print(f"exported {len(sd)} tensors to {a.out}; chat template: {src}")
    verify(a.out, sd, cfg)


def verify(out, sd, cfg):
    """Reload with transformers: no missing keys, and the same logits as a model built from our tensors."""
    from transformers import AutoModelForCausalLM
    m, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager",
                                                   output_loading_info=True)
    n = cfg.num_hidden_layers
    assert not info["missing_keys"], info["missing_keys"]
    unexpected = sorted(info["unexpected_keys"])
    assert all(k.startswith(f"model.layers.{n}.") for k in unexpected), unexpected[:5]
    ref = D.GlmMoeDsaForCausalLM(D.make_config(cfg.eos_token_id, small=cfg.hidden_size < 256))
    ref.config._attn_implementation = "eager"
    rsd = ref.state_dict()
    for k in rsd:
        if k.endswith("experts.gate_up_proj"):
            base = k[: -len("gate_up_proj")]
            rsd[k] = torch.stack([torch.cat([sd[f"{base}{e}.gate_proj.weight"], sd[f"{base}{e}.up_proj.weight"]])
                                  for e in range(cfg.n_routed_experts)]).float()
        elif k.endswith("experts.down_proj"):
            base = k[: -len("down_proj")]
            rsd[k] = torch.stack([sd[f"{base}{e}.down_proj.weight"] for e in range(cfg.n_routed_experts)]).float()
        else:
            rsd[k] = sd[k].float()
    ref.load_state_dict(rsd, strict=True)
    ref.eval(), m.eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 150), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        d = (m(ids).logits - ref(ids).logits).abs().max().item()
    print(f"reload check: {len(unexpected)} unexpected keys (the MTP layer), max |logit diff| {d:.2e}")
    assert d < 1e-4


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--out", default=".devcarry/demo")
    t = sub.add_parser("train")
    t.add_argument("--data", default=".devcarry/demo")
    t.add_argument("--out", required=True)
    t.add_argument("--device", default="auto")
    t.add_argument("--small", action="store_true", help="smaller dims (CPU smoke run / CPU fallback)")
    t.add_argument("--cpu-amp", action="store_true", help="bf16 autocast on CPU too (smoke-tests the GPU path)")
    t.add_argument("--experts", default="auto", help="transformers experts implementation for training")
    t.add_argument("--steps", type=int, default=0, help="fixed step count (default: max-epochs / time budget)")
    t.add_argument("--max-epochs", type=float, default=12.0)
    t.add_argument("--time-budget", type=float, default=450.0, help="seconds of training on GPU")
    t.add_argument("--batch", type=int, default=16)
    t.add_argument("--seq", type=int, default=512)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--wd", type=float, default=0.1)
    t.add_argument("--warmup", type=int, default=100)
    t.add_argument("--dense-frac", type=float, default=0.3)
    t.add_argument("--mtp-weight", type=float, default=0.3)
    t.add_argument("--kl-weight", type=float, default=1.0)
    t.add_argument("--bias-gamma", type=float, default=1e-3)
    t.add_argument("--evals", type=int, default=20)
    t.add_argument("--eval-windows", type=int, default=32)
    t.add_argument("--log-every", type=int, default=25)
    e = sub.add_parser("export")
    e.add_argument("--ckpt", required=True)
    e.add_argument("--data", default=".devcarry/demo")
    e.add_argument("--out", default="models/vireo-demo")
    a = ap.parse_args()
    {"prepare": cmd_prepare, "train": cmd_train, "export": cmd_export}[a.cmd](a)


if __name__ == "__main__":
    main()
