#!/usr/bin/env python3
"""Counts the SASS instructions of a CUDA source's MMA loops, without a GPU.

Why: a tensor-core kernel's k-loop can be bound by the instructions a warp runs between its MMAs
(session 29: the FP8 grouped products' loop was 168 instructions a warp for 4 MMAs; trimmed to
144, the products ran ~3% faster). ncu shows that on a device; this shows the loop's length on the
build machine, so a change to a loop can be checked before a device call.

It takes the source's compile command from the build's ninja files, builds a cubin for it, runs
nvdisasm on it and lists, per kernel, the innermost loops (backward branches) that hold an MMA:
their instruction counts, MMAs, FFMAs, R2URs and S2Rs. -v prints the loops' instructions.

    python3 tools/sass_loops.py src/backend/cuda/cuda_grouped.cu [--build build-cuda]
        [--kernel SUBSTRING] [-v]

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


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # quiet when piped into head
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("source", help="a .cu file of the build, e.g. src/backend/cuda/cuda_grouped.cu")
    ap.add_argument("--build", default="build-cuda", help="the CUDA build folder (default build-cuda)")
    ap.add_argument("--kernel", default="", help="only kernels whose mangled name holds this")
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
        r = subprocess.run(cubin_command(cmd, cubin), cwd=a.build, capture_output=True, text=True)
        if r.returncode != 0:
            fail(f"building a cubin of {a.source} failed:\n{r.stderr}")
        r = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True)
        if r.returncode != 0:
            fail(f"nvdisasm failed: {r.stderr}")
    kernels, labels = parse(r.stdout)
    for name, ins in kernels.items():
        if a.kernel not in name:
            continue
        mmas = [i for i, (_, t) in enumerate(ins) if MMA.search(t)]
        loops = []
        for i, (_, t) in enumerate(ins):
            m = re.search(r"BRA\s+`\((\.L_x_\d+)\)", t)
            if not m or m.group(1) not in labels[name]:
                continue
            j = labels[name][m.group(1)]
            if j <= i and any(j <= k <= i for k in mmas):
                loops.append((j, i))
        # Each MMA's shortest loop only: the tile loops, and the barrier waits' retry branches
        # (placed at the function's end, jumping back), also span MMAs.
        def shortest(k):
            return min((l for l in loops if l[0] <= k <= l[1]), key=lambda l: l[1] - l[0])
        loops = sorted({shortest(k) for k in mmas if any(j <= k <= i for j, i in loops)})
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
