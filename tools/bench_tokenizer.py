#!/usr/bin/env python3
"""Encode throughput, one thread: vireo's tokenizer against the Python `tokenizers` package, in
the same run on the same documents, for the real tokenizers in ../shared/data/tokenizers.

The corpus is a few MB of English and code found on any Debian machine: license texts from
/usr/share/common-licenses and /usr/share/doc/*/copyright (English), Python standard-library
modules and C headers (code). Both sides encode each document without special tokens, after one
warm-up pass (both keep a word cache). Documents are ~4 KB pieces cut at line ends; the best of --runs timed passes counts. Time is process CPU time on both sides (one thread
each), so other load on a shared machine inflates neither number. The id streams are
compared by count and checksum.

Usage: /work/pyenv/bin/python tools/bench_tokenizer.py --bench build-tok/vireo_tokenizer_bench
"""
import os

os.environ["RAYON_NUM_THREADS"] = "1"          # before importing tokenizers
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import argparse
import glob
import gzip
import json
import platform
import subprocess
import tempfile
import time

import tokenizers
from tokenizers import Tokenizer


def read_files(paths, budget):
    docs, total = [], 0
    for p in paths:
        try:
            with open(p, "rb") as f:
                text = f.read().decode("utf-8", "replace").replace("\0", " ")
        except OSError:
            continue
        if not text.strip():
            continue
        text = text[: budget - total]
        docs.append(text)
        total += len(text.encode("utf-8"))
        if total >= budget:
            break
    return docs


def build_corpus(mb_english, mb_code, chunk):
    english = sorted(glob.glob("/usr/share/common-licenses/*")) + sorted(glob.glob("/usr/share/doc/*/copyright"))
    code = sorted(glob.glob("/usr/lib/python3*/*.py")) + sorted(glob.glob("/usr/include/*.h"))
    files = read_files(english, int(mb_english * 1e6)) + read_files(code, int(mb_code * 1e6))
    # Prompt-sized documents: whole files (some are hundreds of KB) would measure `tokenizers`'
    # superlinear cost on very long inputs rather than its throughput.
    docs = []
    for text in files:
        cur = ""
        for line in text.splitlines(keepends=True):
            cur += line
            if len(cur) >= chunk:
                docs.append(cur)
                cur = ""
        if cur:
            docs.append(cur)
    return docs


def fnv(ids_lists):
    h = 1469598103934665603
    n = 0
    for ids in ids_lists:
        for i in ids:
            h = ((h ^ i) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
        n += len(ids)
    return h, n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", required=True, help="path to the vireo_tokenizer_bench executable")
    ap.add_argument("--shared", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--mb-english", type=float, default=2.0)
    ap.add_argument("--mb-code", type=float, default=2.0)
    ap.add_argument("--chunk", type=int, default=4000, help="document size in characters (at line ends)")
    ap.add_argument("--tokenizers", default="qwen3,deepseek_v3,gemma3")
    args = ap.parse_args()

    docs = build_corpus(args.mb_english, args.mb_code, args.chunk)
    nbytes = sum(len(d.encode("utf-8")) for d in docs)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.txt")
        with open(corpus, "wb") as f:
            f.write(b"\0".join(d.encode("utf-8") for d in docs))
        print(f"corpus: {len(docs)} documents, {nbytes / 1e6:.2f} MB; tokenizers {tokenizers.__version__}; "
              f"{platform.processor() or platform.machine()}, {platform.python_version()}")
        rows = []
        for name in args.tokenizers.split(","):
            path = os.path.join(args.shared, "data/tokenizers", name, "tokenizer.json.gz")
            with gzip.open(path, "rt", encoding="utf-8") as f:
                tok = Tokenizer.from_str(f.read())
            out = [tok.encode(d, add_special_tokens=False).ids for d in docs]  # warm-up
            best = float("inf")
            for _ in range(args.runs):
                t0 = time.process_time()
                out = [tok.encode(d, add_special_tokens=False).ids for d in docs]
                best = min(best, time.process_time() - t0)
            py_sum, py_n = fnv(out)
            res = json.loads(subprocess.check_output([args.bench, path, corpus, str(args.runs)]))
            same = res["checksum"] == py_sum and res["ids"] == py_n
            py_mbps = nbytes / best / 1e6
            rows.append((name, py_mbps, res["mb_per_s"], py_n, same))
            print(f"{name}: tokenizers {py_mbps:.2f} MB/s, vireo {res['mb_per_s']:.2f} MB/s "
                  f"({res['mb_per_s'] / py_mbps:.2f}x), {py_n} ids, identical ids: {same}", flush=True)
        print("\n| tokenizer | `tokenizers` MB/s | vireo MB/s | speedup | ids | ids identical |")
        print("|---|---|---|---|---|---|")
        for name, p, v, n, same in rows:
            print(f"| {name} | {p:.2f} | {v:.2f} | {v / p:.2f}x | {n} | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
