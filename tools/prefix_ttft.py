#!/usr/bin/env python3
"""Time to first token of repeated prompts against a running `vireo serve` (what prefix reuse saves).

Sends, one at a time, a prompt of the first CHARS characters of FILE, the same prompt again, the
same with one more line (a chat's next turn), and a prompt from elsewhere in the file; each asks
for one token, so the time is the prompt's prefill plus one step. Prints each one's prompt tokens
and wall time, and the server's reused-token count.

    vireo serve --model models/vireo-demo --port 8377 [--prefix-reuse on|off] &
    python3 tools/prefix_ttft.py --port 8377 --file README.md --chars 4000
"""
import argparse
import json
import time
import urllib.request


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8377)
    ap.add_argument("--file", required=True)
    ap.add_argument("--chars", type=int, default=6000)
    a = ap.parse_args()
    text = open(a.file, encoding="utf-8").read()
    base = f"http://127.0.0.1:{a.port}"

    def ask(prompt):
        body = json.dumps({"prompt": prompt, "max_tokens": 1, "temperature": 0}).encode()
        t = time.time()
        req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
        r = json.load(urllib.request.urlopen(req))
        return time.time() - t, r["usage"]["prompt_tokens"]

    head = text[: a.chars]
    for label, p in [("first", head), ("same again", head), ("one more line", head + "\nAnother line follows."),
                     ("elsewhere", text[a.chars: 2 * a.chars])]:
        dt, n = ask(p)
        print(f"{label:14s} {n:5d} prompt tokens  {dt * 1000:7.1f} ms")
    metrics = urllib.request.urlopen(base + "/metrics").read().decode()
    print(next(l for l in metrics.splitlines() if l.startswith("vireo_prefix_tokens_reused_total")))


if __name__ == "__main__":
    main()
