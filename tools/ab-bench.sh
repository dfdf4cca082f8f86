#!/usr/bin/env bash
# Same-call A/B runs of `vireo bench`: each variant runs ROUNDS times, interleaved (A B C A B C ..),
# so that the machine's drift over the call falls on every variant alike; then one line a variant
# with the median of each decode (and CUDA prefill) line's percentage and, with 2+ rounds, the
# rounds' range; and for the CUDA bench one line a variant with its median us a greedy step and
# that step's percentage of the call's median copy bandwidth (each run's own percentage divides by
# the copy it measured itself, which moves ~0.5% from run to run). H200s differ by 1.5-3
# points of decode from machine to machine (BENCHMARKS.md), so compare only variants of one call.
#
#   tools/ab-bench.sh [-r ROUNDS] [-o DIR] VARIANT... [-- BENCH ARGS]
#
# A variant is `-` (as it is) or a comma-separated list of environment assignments
# (`VIREO_SHORT_ATTENTION=0,VIREO_NORM_CLUSTER=0`), one of which may be `bin=PATH` (another vireo
# binary, e.g. the parent commit's, run with the other assignments: `bin=old/vireo,VIREO_X=1`; a
# PATH with a comma is not supported). BENCH ARGS default to the fp8 decode of BENCHMARKS.md's CUDA tables:
#   --device cuda --synthetic glm5 --layers 8 --experts 16 --dtype fp8 --decode 64 --math fast-fp8 --math-only
# Each run's whole output goes to DIR (default ./ab-bench-out) as <variant index>_<round>.txt.
ROUNDS=2 DIR=./ab-bench-out
source "$(dirname "$0")/bench-args.sh"
VARIANTS=(${POSITIONAL[@]+"${POSITIONAL[@]}"})
if [ ${#VARIANTS[@]} -eq 0 ]; then echo "ab-bench: no variants given (e.g. - VIREO_SHORT_ATTENTION=0)" >&2; exit 2; fi
# A variant's binary (bin=PATH among its items, else $VIREO) and its environment assignments.
split_variant() {  # VARIANT -> sets vbin, venvs
  vbin=$VIREO venvs=()
  [ "$1" = - ] && return 0
  local items a nbin=0
  IFS=, read -r -a items <<<"$1"
  for a in "${items[@]}"; do
    if [[ $a == bin=* ]]; then vbin=${a#bin=} nbin=$((nbin + 1)); else venvs+=("$a"); fi
  done
  [ $nbin -le 1 ] || { echo "ab-bench: variant '$1': more than one bin=" >&2; return 2; }
}
for v in "${VARIANTS[@]}"; do
  case $v in
    -) ;;
    *=*) split_variant "$v" || exit 2
         for a in ${venvs[@]+"${venvs[@]}"}; do
           [[ $a =~ ^[A-Za-z_][A-Za-z0-9_]*=.*$ ]] || { echo "ab-bench: variant '$v': '$a' is not NAME=VALUE" >&2; exit 2; }
         done
         [ "$vbin" = "$VIREO" ] || [ -x "$vbin" ] || { echo "ab-bench: variant '$v': no executable at $vbin" >&2; exit 2; } ;;
    *) echo "ab-bench: variant '$v': expected -, or NAME=VALUE[,NAME=VALUE...] with at most one bin=PATH" >&2; exit 2 ;;
  esac
done
[ -x "$VIREO" ] || { echo "ab-bench: no vireo binary at $VIREO (build first, or set VIREO=path)" >&2; exit 2; }
mkdir -p "$DIR"

# The decode and prefill lines of one run as "label<TAB>percent": CUDA prints "decode ctx 0 ... =
# 75.4% of copy bandwidth" and "prefill 512 fast-fp8 ... = 41.9% of bf16 GEMM peak", the CPU
# "decode  N tokens ... = 75% of bandwidth".
decode_points() {
  awk '/^decode/ && match($0, /= *[0-9.]+%/) {
         pct = substr($0, RSTART, RLENGTH); gsub(/[= %]/, "", pct)
         label = "decode"; if (match($0, /^decode ctx [0-9]+/)) label = substr($0, 8, RLENGTH - 7)
         print label "\t" pct }
       /^prefill [0-9]+ / && match($0, /= *[0-9.]+% of bf16 GEMM peak/) {
         pct = substr($0, RSTART, RLENGTH); sub(/% of.*/, "", pct); gsub(/[= ]/, "", pct)
         print "prefill " $2 "\t" pct }' "$1"
}

# A run's greedy decode lines as "ctx N<TAB>us a step<TAB>GB a token" ("decode ctx 0  greedy/device
# 586.18 tok/s  6.022 GB/token ..."), and its copy bandwidth in GB/s.
decode_steps() {
  awk '$1 == "decode" && $2 == "ctx" && $4 == "greedy/device" && $6 == "tok/s" && $8 == "GB/token" {
         printf "ctx %s\t%.1f\t%s\n", $3, 1e6 / $5, $7 }' "$1"
}
copy_gbs() { awk '/^copy bandwidth/ { print $3; exit }' "$1"; }

status=0
for ((r = 1; r <= ROUNDS; ++r)); do
  for i in "${!VARIANTS[@]}"; do
    v=${VARIANTS[$i]}
    split_variant "$v"
    out=$DIR/${i}_$r.txt
    if ! env ${venvs[@]+"${venvs[@]}"} "$vbin" bench "${BENCH[@]}" >"$out" 2>&1; then
      echo "ab-bench: variant '$v' round $r failed: $(tail -1 "$out")" >&2
      status=1
      continue
    fi
    echo "round $r  $(printf '%-40s' "$v")  $(decode_points "$out" | awk -F'\t' '{printf "%s %s%%  ", $1, $2}')"
  done
done

# With 2+ rounds each median is followed by the rounds' range: on an H200 one binary's prefill at
# 2 layers spans 4 points over rounds, decode 1-3, so a difference inside the ranges is no result.
echo "median of $ROUNDS round(s)$([ "$ROUNDS" -gt 1 ] && echo ' (lowest-highest)'), % of bandwidth (decode) or of the GEMM peak (prefill):"
for i in "${!VARIANTS[@]}"; do
  line=$(for ((r = 1; r <= ROUNDS; ++r)); do [ -f "$DIR/${i}_$r.txt" ] && decode_points "$DIR/${i}_$r.txt"; done |
         medians_by_label | awk -F'\t' -v range=$((ROUNDS > 1)) '{
           if (range) printf "%s %.1f%% (%.1f-%.1f)  ", $1, $2, $3, $4; else printf "%s %.1f%%  ", $1, $2 }')
  echo "  $(printf '%-40s' "${VARIANTS[$i]}")  ${line:-no decode lines (see $DIR/${i}_*.txt)}"
done
# Each run divides by the copy bandwidth it measured itself, which moves ~0.5% from run to run: a
# smaller difference between variants shows in their step times, not always in their percentages
# (session 52). So also: us a greedy step, and its percentage of one copy bandwidth for the whole
# call (the median of every run's).
call_copy=$(for f in "$DIR"/*_*.txt; do copy_gbs "$f"; done | awk 'NF { print "copy\t" $1 }' | medians_by_label | cut -f2)
if [ -n "$call_copy" ]; then
  echo "median us a greedy step$([ "$ROUNDS" -gt 1 ] && echo ' (lowest-highest)'), and its % of the call's copy bandwidth ($call_copy GB/s, every run's median):"
  for i in "${!VARIANTS[@]}"; do
    rows=$(for ((r = 1; r <= ROUNDS; ++r)); do [ -f "$DIR/${i}_$r.txt" ] && decode_steps "$DIR/${i}_$r.txt"; done)
    line=$(printf '%s\n' "$rows" | awk -F'\t' 'NF == 3 { print $1 "\t" $2 }' | medians_by_label |
           awk -F'\t' -v range=$((ROUNDS > 1)) -v copy="$call_copy" -v gbs="$(printf '%s\n' "$rows" | cut -f1,3 | tr '\n' ';')" '
             BEGIN { n = split(gbs, g, ";"); for (k = 1; k <= n; ++k) if (split(g[k], f, "\t") == 2) gb[f[1]] = f[2] }
             { pct = copy > 0 && ($1 in gb) ? 100 * gb[$1] * 1e6 / $2 / copy : 0
               if (range) printf "%s %.1f us (%.1f-%.1f) %.1f%%  ", $1, $2, $3, $4, pct
               else printf "%s %.1f us %.1f%%  ", $1, $2, pct }')
    echo "  $(printf '%-40s' "${VARIANTS[$i]}")  ${line:-no greedy decode lines}"
  done
fi
exit $status
