#!/usr/bin/env python3
"""Reads tools/kernel_trace.cpp's CSV: the recorded decode step, kernel by kernel, as the GPU ran it.

    python3 tools/kernel_trace.py trace.csv [--graph N] [--all]

For each recorded graph (one per decode context bound) replayed at least --min-replays times:
the step's span (first kernel's start to last kernel's end, median over replays), the time inside
it with no kernel running, the host's gap between replays, and each kernel node in the order its
end is reached (median over replays): start and end from the step's start, its duration, and the
*advance*: how far the step's frontier (the latest end so far) moved when it ended. The advances add
up to the span; a kernel whose advance is far below its duration ran under another (PDL, a
branch), one whose advance is above it waited for its inputs (or for SMs: its start says which).
An advance is not a place on the critical path: a kernel ending last may be waited on by nothing,
while another chain ends just behind it (session 34: the cache appends' advance was absorb_q's
chain, which took their place when they moved). A closing table sums the advances by kernel
name. Times in us.
"""
import argparse
import csv
import re
import shutil
import statistics
import subprocess
import sys
from collections import defaultdict


def demangle(names):
    tool = shutil.which("c++filt")
    if not tool:
        return {n: n for n in names}
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
    return {n: (out[i] if i < len(out) and out[i] else n) for i, n in enumerate(names)}


def short(name):
    """`void vireo::cuda::(anonymous namespace)::gemv_kernel<2, true>(...)` -> `gemv_kernel<2,true>`."""
    s = name.replace("(anonymous namespace)::", "")
    s = re.sub(r"\(.*$", "", s)  # arguments
    s = re.sub(r"^void ", "", s)
    s = re.sub(r"[A-Za-z_0-9]+::|\(anonymous namespace\)::", "", s)
    s = s.replace(" ", "")
    return s[:60]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--graph", type=int, help="only this graph id")
    ap.add_argument("--min-replays", type=int, default=8)
    ap.add_argument("--all", action="store_true", help="every node, not only those advancing >= 0.5 us")
    a = ap.parse_args()

    rows = []
    try:
        with open(a.csv, newline="") as f:
            for r in csv.DictReader(f):
                rows.append(r)
    except (OSError, csv.Error, KeyError) as e:
        sys.exit(f"kernel_trace.py: cannot read {a.csv}: {e}")
    if not rows:
        sys.exit(f"kernel_trace.py: {a.csv} holds no kernels")
    want = {"start_ns", "end_ns", "graph_id", "graph_node_id", "correlation_id", "grid", "name"}
    if not want <= set(rows[0].keys()):
        sys.exit(f"kernel_trace.py: {a.csv}: missing columns {sorted(want - set(rows[0].keys()))}")
    names = demangle(sorted({r["name"] for r in rows}))

    # graph id -> correlation id (one replay) -> [(start, end, node, name)]
    replays = defaultdict(lambda: defaultdict(list))
    for n, r in enumerate(rows, start=2):
        try:
            g = int(r["graph_id"])
            if g == 0:
                continue
            replays[g][int(r["correlation_id"])].append(
                (int(r["start_ns"]), int(r["end_ns"]), int(r["graph_node_id"]), short(names[r["name"]]), r["grid"]))
        except (KeyError, TypeError, ValueError) as e:
            sys.exit(f"kernel_trace.py: {a.csv} line {n}: expected kernel_trace.cpp's columns, got {e!r}")
    if not replays:
        sys.exit(f"kernel_trace.py: {a.csv} holds no recorded (graph) kernels")

    for g, reps in sorted(replays.items()):
        if a.graph is not None and g != a.graph:
            continue
        if len(reps) < a.min_replays:
            continue
        steps = sorted(reps.values(), key=lambda ks: min(k[0] for k in ks))
        # The first two replays warm up; use the rest.
        steps = steps[2:] if len(steps) > 4 else steps
        spans, idles, gaps = [], [], []
        per_node = defaultdict(lambda: {"s": [], "e": [], "name": "", "grid": ""})
        prev_end = None
        for ks in steps:
            t0 = min(k[0] for k in ks)
            t1 = max(k[1] for k in ks)
            spans.append((t1 - t0) / 1e3)
            if prev_end is not None:
                gaps.append((t0 - prev_end) / 1e3)
            prev_end = t1
            busy, cur_s, cur_e = 0, None, None
            for s, e, *_ in sorted(ks):
                if cur_e is None or s > cur_e:
                    if cur_e is not None:
                        busy += cur_e - cur_s
                    cur_s, cur_e = s, e
                else:
                    cur_e = max(cur_e, e)
            busy += cur_e - cur_s
            idles.append((t1 - t0 - busy) / 1e3)
            for s, e, node, name, grid in ks:
                d = per_node[node]
                d["s"].append((s - t0) / 1e3)
                d["e"].append((e - t0) / 1e3)
                d["name"], d["grid"] = name, grid
        med = statistics.median
        nodes = sorted(((med(d["s"]), med(d["e"]), d["name"], d["grid"]) for d in per_node.values()),
                       key=lambda n: n[1])
        print(f"graph {g}: {len(nodes)} kernels, {len(steps)} replays; span {med(spans):.1f} us "
              f"(min {min(spans):.1f}), no kernel running {med(idles):.1f} us, "
              f"host gap between replays {med(gaps) if gaps else 0:.1f} us")
        print(f"{'end':>8} {'start':>8} {'dur':>7} {'advance':>8}  kernel [grid]")
        frontier = 0.0
        by_name = defaultdict(lambda: [0, 0.0, 0.0])
        for s, e, name, grid in nodes:
            adv = max(0.0, e - frontier)
            frontier = max(frontier, e)
            b = by_name[name]
            b[0] += 1
            b[1] += adv
            b[2] += e - s
            if a.all or adv >= 0.5:
                print(f"{e:8.1f} {s:8.1f} {e - s:7.1f} {adv:8.1f}  {name} [{grid}]")
        print(f"\n{'advance':>8} {'dur':>8} {'n':>4}  kernel (sums over the step)")
        for name, (n, adv, dur) in sorted(by_name.items(), key=lambda kv: -kv[1][1]):
            print(f"{adv:8.1f} {dur:8.1f} {n:4d}  {name}")
        print()


if __name__ == "__main__":
    main()
