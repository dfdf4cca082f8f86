#!/usr/bin/env python3
"""Load generator for `vireo serve`: throughput, time to first token and inter-token latency at
several concurrency levels, over streaming /v1/completions (standard library only).

Each level runs `--requests` requests (default 4 x concurrency, at least 8) through a closed loop of
`concurrency` clients; every request sends a fixed-length prompt (deterministic token ids) and asks
for exactly --max-tokens tokens (ignore_eos), one SSE chunk per token (return_token_ids), so token
counts and timings are exact.

  python3 tools/loadgen.py --vireo build/vireo --model-dir models/vireo-demo --levels 1,8,32
  python3 tools/loadgen.py --base-url http://127.0.0.1:8000 --levels 1,8,32
"""
import argparse
import http.client
import json
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def one_request(base, model, prompt, max_tokens, api_key):
    u = urllib.parse.urlparse(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "ignore_eos": True, "return_token_ids": True})
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = "Bearer " + api_key
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body, headers=headers)
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    times = []  # arrival time of each token
    while True:
        line = resp.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            break
        now = time.perf_counter()
        chunk = json.loads(data)
        for ch in chunk.get("choices", []):
            times.extend([now] * len(ch.get("token_ids") or []))
    conn.close()
    if len(times) != max_tokens:
        raise RuntimeError(f"expected {max_tokens} tokens, got {len(times)}")
    return {"ttft": times[0] - t0, "itl": [b - a for a, b in zip(times, times[1:])], "tokens": len(times),
            "latency": times[-1] - t0}


def run_level(base, model, concurrency, n_requests, prompts, max_tokens, api_key):
    results, errors = [], []
    lock = threading.Lock()
    next_i = [0]

    def client():
        while True:
            with lock:
                i = next_i[0]
                next_i[0] += 1
            if i >= n_requests:
                return
            try:
                r = one_request(base, model, prompts[i % len(prompts)], max_tokens, api_key)
                with lock:
                    results.append(r)
            except Exception as e:  # noqa: BLE001 - reported, and the run fails
                with lock:
                    errors.append(str(e))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    itl = [x for r in results for x in r["itl"]]
    ttft = [r["ttft"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    return {"concurrency": concurrency, "requests": len(results), "wall_s": wall, "gen_tok_s": tokens / wall,
            "req_s": len(results) / wall, "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p90_ms": 1e3 * pct(ttft, 90),
            "ttft_p99_ms": 1e3 * pct(ttft, 99), "itl_p50_ms": 1e3 * pct(itl, 50), "itl_p90_ms": 1e3 * pct(itl, 90),
            "itl_p99_ms": 1e3 * pct(itl, 99), "itl_mean_ms": 1e3 * statistics.fmean(itl) if itl else float("nan")}


def spawn(vireo, model_dir, max_batch, context, extra):
    model_args = ["-m", model_dir] if model_dir else []  # none: the model comes from --serve-arg (--synthetic)
    cmd = [vireo, "serve", *model_args, "--host", "127.0.0.1", "--port", "0", "--max-batch", str(max_batch),
           "--context", str(context), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    port = None
    for line in proc.stderr:
        sys.stderr.write(line)
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        if m:
            port = int(m.group(1))
        if "serving" in line:
            break
    if port is None:
        proc.kill()
        raise RuntimeError("vireo serve did not start")
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    return proc, f"http://127.0.0.1:{port}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", help="a running server")
    ap.add_argument("--vireo", help="start this vireo binary instead (with --model-dir)")
    ap.add_argument("--model-dir", help="model directory for --vireo")
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--serve-arg", action="append", default=[], help="extra argument for vireo serve (repeatable)")
    ap.add_argument("--model", help="model id (default: the server's only model)")
    ap.add_argument("--api-key")
    ap.add_argument("--levels", default="1,8,32", help="comma-separated concurrency levels")
    ap.add_argument("--requests", type=int, default=0, help="requests per level (default 4 x concurrency, >= 8)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=8000, help="prompt ids are drawn from [0, vocab)")
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()

    proc = None
    base = a.base_url
    if a.vireo:
        proc, base = spawn(a.vireo, a.model_dir, a.max_batch, a.context, a.serve_arg)
    if not base:
        ap.error("give --base-url or --vireo with --model-dir")
    try:
        req = urllib.request.Request(base + "/v1/models",
                                     headers={"Authorization": "Bearer " + a.api_key} if a.api_key else {})
        model = a.model or json.load(urllib.request.urlopen(req))["data"][0]["id"]
        rng = random.Random(0)
        prompts = [[rng.randrange(a.vocab) for _ in range(a.prompt_tokens)] for _ in range(64)]
        one_request(base, model, prompts[0], 4, a.api_key)  # warm-up
        rows = []
        for c in [int(x) for x in a.levels.split(",")]:
            n = a.requests or max(8, 4 * c)
            r = run_level(base, model, c, n, prompts, a.max_tokens, a.api_key)
            rows.append(r)
            print(f"concurrency {c}: {r['gen_tok_s']:.1f} tok/s, TTFT p50 {r['ttft_p50_ms']:.1f} ms, "
                  f"ITL p50 {r['itl_p50_ms']:.1f} ms", file=sys.stderr)
        print(f"\nmodel {model}, prompt {a.prompt_tokens} tokens, {a.max_tokens} generated tokens per request\n")
        print("| concurrency | requests | generated tok/s | requests/s | TTFT p50 / p90 / p99 (ms) "
              "| ITL p50 / p90 / p99 (ms) | ITL mean (ms) |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['concurrency']} | {r['requests']} | {r['gen_tok_s']:.1f} | {r['req_s']:.2f} | "
                  f"{r['ttft_p50_ms']:.1f} / {r['ttft_p90_ms']:.1f} / {r['ttft_p99_ms']:.1f} | "
                  f"{r['itl_p50_ms']:.1f} / {r['itl_p90_ms']:.1f} / {r['itl_p99_ms']:.1f} | {r['itl_mean_ms']:.1f} |")
        # serve --mtp: the drafts its steps kept and rejected (over every level and the warm-up).
        metrics = urllib.request.urlopen(base + "/metrics").read().decode()
        drafts = dict(re.findall(r'^vireo_mtp_drafts_total\{outcome="(\w+)"\} (\d+)', metrics, re.M))
        if int(drafts.get("kept", 0)) + int(drafts.get("rejected", 0)) > 0:
            kept, rejected = int(drafts["kept"]), int(drafts["rejected"])
            print(f"\nMTP drafts kept: {kept} of {kept + rejected} ({100 * kept / (kept + rejected):.1f}%)")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"model": model, "prompt_tokens": a.prompt_tokens, "max_tokens": a.max_tokens,
                           "levels": rows}, f, indent=1)
    finally:
        if proc:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)


if __name__ == "__main__":
    main()
