#!/usr/bin/env python3
"""Counts the SASS instructions of a CUDA source's MMA loops, without a GPU.

Why: a tensor-core kernel's k-loop can be bound by the instructions a warp runs between its MMAs
(session 29: the FP8 grouped products' loop was 168 instructions a warp for 4 MMAs; trimmed to
144, the products ran ~3% faster). ncu shows that on a device; this shows the loop's length on the
build machine, so a change to a loop can be checked before a device call.

It takes the source's compile command from the build's ninja files, builds a cubin for it, runs
nvdisasm on it and lists, per kernel, the innermost loops (backward branches) that hold an MMA:
their instruction counts, MMAs, FFMAs, R2URs and S2Rs. -v prints the loops' instructions.

--loads does the same for the loops that stream 16-byte global loads (the decode GEMVs), with
each kernel's registers and spills (ptxas -v) and, per loop, its loads, its local-memory traffic
(LDL / STL: spills) and the most loads in flight at once (issued, their registers not yet read).
Why (session 35): at 64 registers the FP8 gate | up spilled 60 bytes and issued its eight loads a
trip two to four at a time, which only the machine code showed; with 128 registers and no spills
the same sums made the 8-layer fp8 decode step 3-4 points faster.

    python3 tools/sass_loops.py src/backend/cuda/cuda_grouped.cu [--build build-cuda]
        [--kernel SUBSTRING] [--loads] [-v]
    python3 tools/sass_loops.py --self-test     (the --loads analysis on a fixed listing)

nvdisasm is not in Debian's CUDA packages here: set NVDISASM, or put it on PATH (PyPI's
nvidia-cuda-nvdisasm wheel holds it: `pip download --no-deps nvidia-cuda-nvdisasm`, unzip,
nvidia/cu13/bin/nvdisasm).
"""
import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile

MMA = re.compile(r"\b(Q|H|I)?GMMA\b|\bHMMA\b|\bQMMA\b|\bIMMA\b")
WIDE_LOAD = re.compile(r"^(@!?U?P\w+\s+)?LDG\.\S*128")
REG = re.compile(r"\bR(\d+)(\.64)?\b")


def fail(msg):
    sys.exit(f"sass_loops: {msg}")


def compile_command(build, source):
    try:
        out = subprocess.run(["ninja", "-C", build, "-t", "commands"], check=True, capture_output=True,
                             text=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        fail(f"cannot read the build's commands in {build} (configured with -DVIREO_CUDA=ON?): {e}")
    for line in out.splitlines():
        if "nvcc" in line and any(t.endswith(source) for t in shlex.split(line)):
            return line
    fail(f"no nvcc command for {source} in {build}")


def cubin_command(cmd, cubin):
    args = shlex.split(cmd)
    out, skip = [], 0
    for i, a in enumerate(args):
        if skip:
            skip -= 1
            continue
        if a in ("-MD",):
            continue
        if a in ("-MT", "-MF"):
            skip = 1
            continue
        if a == "-o":
            out += ["-o", cubin]
            skip = 1
            continue
        out.append("-cubin" if a == "-c" else a)
    return out


def parse(sass):
    """{kernel: [(address, instruction)]} and {kernel: {label: index}}."""
    kernels, labels, name, pending = {}, {}, None, []
    for line in sass.splitlines():
        m = re.match(r"^\.text\.(\S+):", line)
        if m:
            name = m.group(1)
            kernels[name], labels[name], pending = [], {}, []
            continue
        if name is None:
            continue
        m = re.match(r"^(\.L_x_\d+):", line)
        if m:
            pending.append(m.group(1))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;", line)
        if m:
            for p in pending:
                labels[name][p] = len(kernels[name])
            pending = []
            kernels[name].append((int(m.group(1), 16), m.group(2)))
    return kernels, labels


def registers_read(text):
    """The registers an instruction reads: every R operand but a writing instruction's first (its
    destination); a .64 address names a pair. Stores, branches and barriers write none."""
    body = re.sub(r"^@!?U?P\w+\s+", "", text)
    op, _, operands = body.partition(" ")
    parts = [s.strip() for s in operands.split(",")] if operands else []
    if not re.match(r"(ST|RED|BRA|BAR|EXIT|RET|CALL|MEMBAR|WARPSYNC|ATOMS?\.POPC)", op) and parts:
        parts = parts[1:]
    regs = set()
    for s in parts:
        for m in REG.finditer(s):
            n = int(m.group(1))
            regs.update((n, n + 1) if m.group(2) else (n,))
    return regs


def innermost_loops(ins, labels, pattern):
    """The loops (backward branches) holding instructions that match `pattern`, as (first, last)
    indices: each such instruction's shortest loop only (outer loops, and barrier waits' retry
    branches placed at the function's end, jumping back, span them too)."""
    marked = [i for i, (_, t) in enumerate(ins) if pattern.search(t)]
    loops = []
    for i, (_, t) in enumerate(ins):
        m = re.search(r"BRA\s+`\((\.L_x_\d+)\)", t)
        if m and m.group(1) in labels and labels[m.group(1)] <= i:
            j = labels[m.group(1)]
            if any(j <= k <= i for k in marked):
                loops.append((j, i))
    return sorted({min((l for l in loops if l[0] <= k <= l[1]), key=lambda l: l[1] - l[0])
                   for k in marked if any(j <= k <= i for j, i in loops)})


def loads_in_flight(body):
    """The most 16-byte loads of a loop body issued and not yet read at any one instruction (a
    load is read where an instruction after it first reads one of its four registers)."""
    spans = []
    for i, t in enumerate(body):
        if not WIDE_LOAD.search(t):
            continue
        m = REG.search(t)
        dest = set(range(int(m.group(1)), int(m.group(1)) + 4)) if m else set()
        used = next((j for j in range(i + 1, len(body)) if registers_read(body[j]) & dest), len(body))
        spans.append((i, used))
    return max((sum(1 for a, b in spans if a < j <= b) for j in range(len(body))), default=0)


def ptxas_usage(stderr):
    """{mangled kernel: (registers, spill store bytes, spill load bytes)} from ptxas -v."""
    usage, name, spills = {}, None, (0, 0)
    for line in stderr.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            name, spills = m.group(1), (0, 0)
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and name:
            spills = (int(m.group(1)), int(m.group(2)))
        m = re.search(r"Used (\d+) registers", line)
        if m and name:
            usage[name] = (int(m.group(1)),) + spills
    return usage


def print_load_loops(name, ins, labels, usage, verbose):
    loops = innermost_loops(ins, labels, WIDE_LOAD)
    if not loops:
        return
    regs, st, ld = usage.get(name, (0, 0, 0))
    print(f"{name}: {regs} registers, {st} bytes spill stores, {ld} bytes spill loads")
    for j, i in loops:
        body = [t for _, t in ins[j:i + 1]]
        n_ldg = sum(1 for t in body if WIDE_LOAD.search(t))
        n_ldl, n_stl = (sum(1 for t in body if re.search(op, t)) for op in (r"\bLDL\b", r"\bSTL\b"))
        print(f"  loop {ins[j][0]:05x}..{ins[i][0]:05x}: {len(body)} instructions, {n_ldg} 16-byte loads, "
              f"at most {loads_in_flight(body)} in flight, {n_ldl} LDL, {n_stl} STL")
        if verbose:
            for addr, t in ins[j:i + 1]:
                print(f"    {addr:05x} {t}")


SELF_TEST = """
.text.k_batched:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDG.E.NA.128.CONSTANT R12, desc[UR4][R2.64] ;
        /*0020*/                   LDG.E.NA.128.CONSTANT R16, desc[UR4][R2.64+0x200] ;
        /*0030*/                   LDG.E.NA.128.CONSTANT R20, desc[UR4][R2.64+0x400] ;
        /*0040*/                   LDS.128 R24, [R5] ;
        /*0050*/                   FFMA R7, R12, R24, R7 ;
        /*0060*/                   FFMA R7, R16, R25, R7 ;
        /*0070*/                   FFMA R7, R20, R26, R7 ;
        /*0080*/               @!P0 BRA `(.L_x_0) ;
.text.k_serial:
.L_x_1:
        /*0000*/                   LDG.E.NA.128.CONSTANT R12, desc[UR4][R2.64] ;
        /*0010*/                   LDL.64 R8, [R1+0x8] ;
        /*0020*/                   FFMA R7, R15, R8, R7 ;
        /*0030*/                   LDG.E.NA.128.CONSTANT R12, desc[UR4][R8.64+0x200] ;
        /*0040*/                   STL [R1+0x4], R7 ;
        /*0050*/                   FFMA R7, R13, R9, R7 ;
        /*0060*/                   BRA `(.L_x_1) ;
"""


def self_test():
    kernels, labels = parse(SELF_TEST)
    got = {}
    for name, ins in kernels.items():
        (j, i), = innermost_loops(ins, labels[name], WIDE_LOAD)
        body = [t for _, t in ins[j:i + 1]]
        got[name] = (len(body), loads_in_flight(body), sum(1 for t in body if re.search(r"\bLDL\b", t)))
    want = {"k_batched": (8, 3, 0), "k_serial": (7, 1, 1)}
    usage = ptxas_usage("ptxas info    : Compiling entry function 'k_serial' for 'sm_90a'\n"
                        "    64 bytes stack frame, 60 bytes spill stores, 72 bytes spill loads\n"
                        "ptxas info    : Used 64 registers, used 1 barriers, 64 bytes cumulative stack size\n")
    checks = [(got, want), (usage, {"k_serial": (64, 60, 72)}),
              (registers_read("STL [R1+0x4], R7"), {1, 7}), (registers_read("@P0 FFMA R7, R15.reuse, R8, R7"), {15, 8, 7}),
              (registers_read("LDG.E.128 R12, desc[UR4][R8.64+0x200]"), {8, 9})]
    for have, expect in checks:
        if have != expect:
            fail(f"self-test: got {have}, expected {expect}")
    print("sass_loops self-test: ok")


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # quiet when piped into head
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    ap.add_argument("source", help="a .cu file of the build, e.g. src/backend/cuda/cuda_grouped.cu")
    ap.add_argument("--build", default="build-cuda", help="the CUDA build folder (default build-cuda)")
    ap.add_argument("--kernel", default="", help="only kernels whose mangled name holds this")
    ap.add_argument("--loads", action="store_true",
                    help="the loops of 16-byte global loads instead: loads in flight, spills, registers")
    ap.add_argument("-v", action="store_true", help="print each loop's instructions")
    a = ap.parse_args()
    nvdisasm = os.environ.get("NVDISASM") or shutil.which("nvdisasm")
    if not nvdisasm:
        fail("nvdisasm not found: set NVDISASM or put it on PATH (see --help)")
    if not os.path.isfile(a.source):
        fail(f"{a.source}: no such file")
    cmd = compile_command(a.build, a.source)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        r = subprocess.run(cubin_command(cmd, cubin) + ["-Xptxas", "-v"], cwd=a.build, capture_output=True, text=True)
        if r.returncode != 0:
            fail(f"building a cubin of {a.source} failed:\n{r.stderr}")
        usage = ptxas_usage(r.stderr)
        r = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True)
        if r.returncode != 0:
            fail(f"nvdisasm failed: {r.stderr}")
    kernels, labels = parse(r.stdout)
    for name, ins in kernels.items():
        if a.kernel not in name:
            continue
        if a.loads:
            print_load_loops(name, ins, labels[name], usage, a.v)
            continue
        loops = innermost_loops(ins, labels[name], MMA)
        if not loops:
            continue
        print(name)
        for j, i in loops:
            body = [t for _, t in ins[j:i + 1]]
            n_mma = sum(1 for t in body if MMA.search(t))
            n_ffma, n_r2ur, n_s2r = (sum(1 for t in body if re.search(op, t)) for op in (r"FFMA", r"R2UR", r"\bS2R\b"))
            print(f"  loop {ins[j][0]:05x}..{ins[i][0]:05x}: {len(body)} instructions, {n_mma} MMA, "
                  f"{n_ffma} FFMA, {n_r2ur} R2UR, {n_s2r} S2R")
            if a.v:
                for addr, t in ins[j:i + 1]:
                    print(f"    {addr:05x} {t}")


if __name__ == "__main__":
    main()
