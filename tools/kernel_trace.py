#!/usr/bin/env python3
"""Reads tools/kernel_trace.cpp's CSV: the recorded decode step, kernel by kernel, as the GPU ran it.

    python3 tools/kernel_trace.py trace.csv[.gz] [--graph N] [--all]

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
name; then the stretches inside the step with no kernel running (which node's end opened each,
which node's start closed it), and what ran between replays outside the graph (the pick's
kernels, the copies), each pattern seen between at least a quarter of the replays. Times in us. `--self-test` checks that arithmetic on a made-up recording (CTest runs it).
"""
import argparse
import bisect
import csv
import gzip
import re
import shutil
import signal
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
    if name.startswith(("memcpy ", "memset ")):  # kernel_trace.cpp's names of copies
        return name
    s = name.replace("(anonymous namespace)::", "")
    s = re.sub(r"\(.*$", "", s)  # arguments
    s = re.sub(r"^void ", "", s)
    s = re.sub(r"[A-Za-z_0-9]+::|\(anonymous namespace\)::", "", s)
    s = s.replace(" ", "")
    return s[:60]


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # quiet when piped into head
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--graph", type=int, help="only this graph id")
    ap.add_argument("--min-replays", type=int, default=8)
    ap.add_argument("--all", action="store_true", help="every node, not only those advancing >= 0.5 us")
    a = ap.parse_args()
    for line in report(a.csv, a.graph, a.min_replays, a.all):
        print(line)


def report(path, graph=None, min_replays=8, show_all=False):
    """The printed report of the CSV at `path`, as lines."""
    out = []
    rows = []
    try:
        with (gzip.open(path, "rt", newline="") if path.endswith(".gz") else open(path, newline="")) as f:
            for r in csv.DictReader(f):
                rows.append(r)
    except (OSError, EOFError, csv.Error, KeyError, UnicodeDecodeError) as e:
        sys.exit(f"kernel_trace.py: cannot read {path}: {e}")
    if not rows:
        sys.exit(f"kernel_trace.py: {path} holds no kernels")
    want = {"start_ns", "end_ns", "graph_id", "graph_node_id", "correlation_id", "grid", "name"}
    if not want <= set(rows[0].keys()):
        sys.exit(f"kernel_trace.py: {path}: missing columns {sorted(want - set(rows[0].keys()))}")
    names = demangle(sorted({r["name"] for r in rows}))

    # graph id -> correlation id (one replay) -> [(start, end, node, name)]
    replays = defaultdict(lambda: defaultdict(list))
    eager = []  # outside any graph (argmax, copies): (start, end, name)
    for n, r in enumerate(rows, start=2):
        try:
            g = int(r["graph_id"])
            if g == 0:
                eager.append((int(r["start_ns"]), int(r["end_ns"]), short(names[r["name"]])))
                continue
            replays[g][int(r["correlation_id"])].append(
                (int(r["start_ns"]), int(r["end_ns"]), int(r["graph_node_id"]), short(names[r["name"]]), r["grid"]))
        except (KeyError, TypeError, ValueError) as e:
            sys.exit(f"kernel_trace.py: {path} line {n}: expected kernel_trace.cpp's columns, got {e!r}")
    if not replays:
        sys.exit(f"kernel_trace.py: {path} holds no recorded (graph) kernels")
    eager.sort()

    for g, reps in sorted(replays.items()):
        if graph is not None and g != graph:
            continue
        if len(reps) < min_replays:
            continue
        steps = sorted(reps.values(), key=lambda ks: min(k[0] for k in ks))
        # The first two replays warm up; use the rest.
        steps = steps[2:] if len(steps) > 4 else steps
        spans, idles, gaps = [], [], []
        per_node = defaultdict(lambda: {"s": [], "e": [], "name": "", "grid": ""})
        # (node whose end opens an idle stretch, node whose start closes it) -> [us]
        holes = defaultdict(list)
        between = []  # per pair of consecutive replays: [(start - previous end, duration, name)]
        prev_end = None
        for ks in steps:
            t0 = min(k[0] for k in ks)
            t1 = max(k[1] for k in ks)
            spans.append((t1 - t0) / 1e3)
            if prev_end is not None:
                gaps.append((t0 - prev_end) / 1e3)
                first = bisect.bisect_left(eager, (prev_end,))
                between.append(((t0 - prev_end) / 1e3, [((s - prev_end) / 1e3, (e - s) / 1e3, name)
                                                        for s, e, name in eager[first:bisect.bisect_left(eager, (t0,))]
                                                        if e <= t0]))
            prev_end = t1
            busy, cur_s, cur_e, cur_node = 0, None, None, None
            for s, e, node, name, _ in sorted(ks):
                if cur_e is None or s > cur_e:
                    if cur_e is not None:
                        busy += cur_e - cur_s
                        holes[(cur_node, node)].append((s - cur_e) / 1e3)
                    cur_s, cur_e, cur_node = s, e, node
                elif e > cur_e:
                    cur_e, cur_node = e, node
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
        out.append(f"graph {g}: {len(nodes)} kernels, {len(steps)} replays; span {med(spans):.1f} us "
                   f"(min {min(spans):.1f}), no kernel running {med(idles):.1f} us, "
                   f"host gap between replays {med(gaps) if gaps else 0:.1f} us")
        out.append(f"{'end':>8} {'start':>8} {'dur':>7} {'advance':>8}  kernel [grid]")
        frontier = 0.0
        by_name = defaultdict(lambda: [0, 0.0, 0.0])
        for s, e, name, grid in nodes:
            adv = max(0.0, e - frontier)
            frontier = max(frontier, e)
            b = by_name[name]
            b[0] += 1
            b[1] += adv
            b[2] += e - s
            if show_all or adv >= 0.5:
                out.append(f"{e:8.1f} {s:8.1f} {e - s:7.1f} {adv:8.1f}  {name} [{grid}]")
        out.append(f"\n{'advance':>8} {'dur':>8} {'n':>4}  kernel (sums over the step)")
        for name, (n, adv, dur) in sorted(by_name.items(), key=lambda kv: -kv[1][1]):
            out.append(f"{adv:8.1f} {dur:8.1f} {n:4d}  {name}")
        # Where the step's idle time sits: stretches with no kernel running, by the node whose end
        # opened one and the node whose start closed it (median length over the replays that had
        # it; a stretch in fewer than half the replays is left out).
        at = {node: (med(d["s"]), d["name"]) for node, d in per_node.items()}
        common = [(med(v), a, b) for (a, b), v in holes.items() if len(v) * 2 >= len(steps) and med(v) >= 0.5]
        if common:
            out.append(f"\n{'idle':>8} {'at':>8}  no kernel running inside the step (after -> before)")
            for us, a, b in sorted(common, reverse=True)[:8]:
                out.append(f"{us:8.1f} {at[b][0]:8.1f}  {at[a][1]} -> {at[b][1]}")
        # Between replays: what ran outside the graph (the pick's kernels, copies), in order; one
        # list for each sequence of names seen between at least a quarter of the replays (vireo
        # bench has two: its timed steps, and its steps replayed back to back).
        patterns = defaultdict(list)
        for gap, b in between:
            if b:
                patterns[tuple(x[2] for x in b)].append((gap, b))
        for names_seen, same in sorted(patterns.items(), key=lambda kv: -len(kv[1])):
            if len(same) * 4 < len(between):
                continue
            out.append(f"\n{'start':>8} {'dur':>8}  outside the graph, from the previous replay's end "
                       f"({len(same)} of {len(between)} gaps, {med([g for g, _ in same]):.1f} us each)")
            for i, name in enumerate(names_seen):
                out.append(f"{med([b[i][0] for _, b in same]):8.1f} {med([b[i][1] for _, b in same]):8.1f}  {name}")
        out.append("")
    return out


def self_test():
    """A made-up recording: graph 7 replayed 12 times 100 us apart, each replay kernel a 0-10 us,
    kernel b 5-20 (under a, then alone), kernel c 25-30 (after 5 us with nothing running); between
    replays a pick kernel 2-5 us after each replay's end and a 4-byte copy 10-11 us after it; and
    an unrecorded kernel long before (graph 0), which the report leaves out."""
    import os
    import tempfile
    lines = ["start_ns,end_ns,graph_id,graph_node_id,correlation_id,stream_id,grid,block,name"]
    for r in range(12):
        t = 1_000_000 + r * 100_000
        for node, (s, e, name) in enumerate([(0, 10, "_Z1av"), (5, 20, "_Z1bv"), (25, 30, "_Z1cv")]):
            lines.append(f"{t + s * 1000},{t + e * 1000},7,{node},{500 + r},13,132x1x1,512x1x1,\"{name}\"")
        lines.append(f"{t + 32_000},{t + 35_000},0,0,{900 + r},13,1x1x1,32x1x1,\"_Z4pickv\"")
        lines.append(f"{t + 40_000},{t + 41_000},0,0,{950 + r},13,0x0x0,0x0x0,\"memcpy 4 B kind 2\"")
    lines.append("10,20,0,0,1,13,1x1x1,32x1x1,\"_Z5eagerv\"")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "t.csv")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        got = report(path)
    want_head = "graph 7: 3 kernels, 10 replays; span 30.0 us (min 30.0), no kernel running 5.0 us, " \
                "host gap between replays 70.0 us"
    # end, start, duration, advance
    want_rows = [("10.0", "0.0", "10.0", "10.0"), ("20.0", "5.0", "15.0", "10.0"), ("30.0", "25.0", "5.0", "10.0")]
    rows = [tuple(l.split()[:4]) for l in got[2:5]]
    # the idle stretch (length, where it ends, b -> c) and what ran between replays
    want_idle = "     5.0     25.0  b -> c"
    want_between = ["(9 of 9 gaps, 70.0 us each)", "     2.0      3.0  pick", "    10.0      1.0  memcpy 4 B kind 2"]
    text = "\n".join(got)
    ok = got and got[0] == want_head and rows == want_rows and "eager" not in text and want_idle in got
    ok = ok and want_between[0] in text and all(w in got for w in want_between[1:])
    if not ok:
        sys.exit("kernel_trace.py self-test failed:\n" + text)
    print("kernel_trace.py self-test: ok")


if __name__ == "__main__":
    main()
