#!/usr/bin/env python3
"""Greedy continuations under logit penalties, as Hugging Face transformers computes them.

For the f32 fixtures and the embedded demo model (float32, eager attention, CPU), greedy
`generate` with:
  - `repetition_penalty` (transformers' RepetitionPenaltyLogitsProcessor: every token of the prompt
    or generated so far, logit / r where > 0, else logit * r);
  - OpenAI's `frequency_penalty` f and `presence_penalty` p, which transformers lacks, as a logits
    processor after it: logit - f x (times generated) - p x (generated at all), counting only
    the generated tokens.
Each case records the tokens and the smallest top-1 minus top-2 gap of the penalized logits over
its steps (a near-tie would make an exact comparison meaningless; cases must keep >= 1e-3).

    /tmp/fxenv/bin/python tools/make_penalty_goldens.py --out tests/fixtures/penalties.json

Versions: tools/requirements-fixtures.txt (recorded in the output).
"""

import argparse
import json
import os

import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig, LogitsProcessor, LogitsProcessorList

torch.set_num_threads(1)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIN_GAP = 1e-3
NEW_TOKENS = 40


class OpenAIPenalties(LogitsProcessor):
    """logit -= f * count(generated) then -= p * (count > 0): vLLM's order, in float32."""

    def __init__(self, prompt_len, frequency, presence):
        self.prompt_len, self.f, self.p = prompt_len, frequency, presence

    def __call__(self, input_ids, scores):
        gen = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores)
        counts.scatter_add_(1, gen, torch.ones_like(gen, dtype=scores.dtype))
        scores = scores - torch.tensor(self.f, dtype=scores.dtype) * counts
        return scores - torch.tensor(self.p, dtype=scores.dtype) * (counts > 0).to(scores.dtype)


@torch.no_grad()
def greedy(model, prompt, rep, freq, pres, eos):
    gc = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, repetition_penalty=rep, eos_token_id=eos,
                          pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    procs = LogitsProcessorList([OpenAIPenalties(len(prompt), freq, pres)]) if (freq or pres) else None
    out = model.generate(torch.tensor([prompt]), generation_config=gc, logits_processor=procs)
    new = out.sequences[0, len(prompt):].tolist()
    gap = min(float((lambda t: t[0] - t[1])(torch.topk(s[0], 2).values)) for s in out.scores)
    return new, gap


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "tests/fixtures/penalties.json"))
    args = ap.parse_args()
    demo_cases = json.load(open(os.path.join(ROOT, "tests/fixtures/demo/expected.json")))["greedy"]["cases"]
    models = {
        "glm_dsa_full_f32": (os.path.join(ROOT, "tests/fixtures/glm_dsa_full_f32"),
                             json.load(open(os.path.join(ROOT, "tests/fixtures/glm_dsa_full_f32/expected.json")))["greedy_prompt"]),
        "vireo-demo": (os.path.join(ROOT, "models/vireo-demo"), demo_cases[0]["prompt_ids"]),
    }
    settings = [(1.3, 0.0, 0.0), (0.8, 0.0, 0.0), (1.0, 0.5, 0.3), (1.2, 0.4, -0.2)]
    cases = []
    for name, (d, prompt) in models.items():
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
        model.eval()
        for rep, freq, pres in settings:
            new, gap = greedy(model, prompt, rep, freq, pres, eos=[-1])
            print(f"{name} repetition {rep} frequency {freq} presence {pres}: gap {gap:.2e}")
            if gap < MIN_GAP:
                print("  near-tie: left out")
                continue
            cases.append(dict(model=name, prompt=prompt, repetition_penalty=rep, frequency_penalty=freq,
                              presence_penalty=pres, new=new, min_gap=gap))
    json.dump(dict(transformers_version=transformers.__version__, torch_version=torch.__version__,
                   definition="greedy generate (float32, eager), no EOS stop, " + str(NEW_TOKENS) +
                              " new tokens; frequency/presence as tools/make_penalty_goldens.py's OpenAIPenalties",
                   cases=cases), open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
