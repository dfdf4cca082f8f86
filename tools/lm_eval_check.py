#!/usr/bin/env python3
"""lm-eval-harness's `local-completions` model against a running `vireo serve`, checked against
transformers: the loglikelihoods lm-eval computes from vireo's echo + logprobs responses, and
the same continuations scored by transformers (float32, eager) on the model directory.

Not part of CI (lm-eval and torch are large); run by hand:

    python3 -m venv /tmp/lmenv && /tmp/lmenv/bin/pip install "lm-eval[api]" -r tools/requirements-fixtures.txt
    vireo serve --model models/vireo-demo --port 8377 &
    /tmp/lmenv/bin/python tools/lm_eval_check.py --port 8377 --model-dir models/vireo-demo
"""
import argparse

import torch
from lm_eval.api.instance import Instance
from lm_eval.models.openai_completions import LocalCompletionsAPI
from transformers import AutoModelForCausalLM, AutoTokenizer

PAIRS = [("The Python interpreter", " is a program"), ("The Python interpreter", " banana split"), ("import", " os"),
         ("Unicode strings are", " sequences of code points")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8377)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--model", default="", help="the served model name (default: the directory's name)")
    a = ap.parse_args()
    name = a.model or a.model_dir.rstrip("/").split("/")[-1]
    lm = LocalCompletionsAPI(base_url=f"http://127.0.0.1:{a.port}/v1/completions", model=name,
                             tokenizer_backend="huggingface", tokenizer=a.model_dir, num_concurrent=1, max_retries=1)
    got = lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(PAIRS)])
    tok = AutoTokenizer.from_pretrained(a.model_dir)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    worst = 0.0
    for (ctx, cont), (ll, greedy) in zip(PAIRS, got):
        ci = tok(ctx, add_special_tokens=False).input_ids
        full = tok(ctx + cont, add_special_tokens=False).input_ids
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([full])).logits[0].float(), -1)
        want = sum(lp[i - 1, full[i]].item() for i in range(len(ci), len(full)))
        worst = max(worst, abs(ll - want))
        print(f"{ctx!r} + {cont!r}: vireo via lm-eval {ll:.7f} (greedy {greedy}), transformers {want:.7f}")
    print(f"max |difference| {worst:.2e}")
    out = lm.generate_until([Instance("generate_until", {}, (PAIRS[0][0], {"until": ["\n"], "max_gen_toks": 16}), 0)])
    print("generate_until:", repr(out[0]))


if __name__ == "__main__":
    main()
