#!/usr/bin/env bash
# What each CUDA kernel costs inside the recorded decode step: `vireo bench` with every launch of
# one kernel dropped (VIREO_SKIP_KERNELS, cuda_internal.h), against the bench unchanged, the runs
# interleaved (base, k1, k2, .., base, k1, ..) on one machine. Per kernel and decode context: the
# median tok/s, and the time it saves a step and a layer. ncu times a kernel alone; here it is what
# the step loses to it, PDL and branches included (BENCHMARKS.md, "Session 20").
#
#   tools/kernel-costs.sh [-r ROUNDS] [-o DIR] [KERNEL...] [-- BENCH ARGS]
#
# KERNEL is a kernel's name as the source writes it (rope_kernel: every instance of it); with none
# given, every kernel the recorded decode step launches (a first run with VIREO_SKIP_KERNELS=none
# lists them; with --no-graph, every kernel the bench launches).
# BENCH ARGS default to the fp8 decode of BENCHMARKS.md's CUDA tables:
#   --device cuda --synthetic glm5 --layers 8 --experts 16 --dtype fp8 --decode 64 --math fast-fp8 --math-only
# "a layer" divides by --layers. The dropped runs compute wrong results by design, so a kernel whose
# output sizes later work reads as costing that work too (the indexer's top-k: the attention then
# reads stale key counts), and one whose output indexes memory may make the run fail (the router:
# reported as failed, the others go on). With 2 or more rounds it also prints how far the unchanged
# bench's rounds lie apart: a kernel that "saves" less saved nothing these runs can tell. ~14 s a
# run at 8 layers on an H200. VIREO: the binary.
ROUNDS=1 DIR=./kernel-costs-out
source "$(dirname "$0")/bench-args.sh"
KERNELS=(${POSITIONAL[@]+"${POSITIONAL[@]}"})
for k in ${KERNELS[@]+"${KERNELS[@]}"}; do
  [[ $k =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || { echo "kernel-costs: '$k' is not a kernel name (letters, digits, _)" >&2; exit 2; }
done
LAYERS=0
for ((i = 0; i + 1 < ${#BENCH[@]}; ++i)); do [ "${BENCH[$i]}" = "--layers" ] && LAYERS=${BENCH[$((i + 1))]}; done
[[ $LAYERS =~ ^[0-9]+$ ]] || LAYERS=0
[ -x "$VIREO" ] || { echo "kernel-costs: no vireo binary at $VIREO (build first, or set VIREO=path)" >&2; exit 2; }
mkdir -p "$DIR"

if [ ${#KERNELS[@]} -eq 0 ]; then
  if ! VIREO_SKIP_KERNELS=none "$VIREO" bench "${BENCH[@]}" >"$DIR/list.txt" 2>&1; then
    echo "kernel-costs: the listing run failed: $(tail -1 "$DIR/list.txt")" >&2
    exit 1
  fi
  # The kernels the recorded decode step launches (prefill's and setup's run outside it, and
  # dropping them times nothing but the spread); with no recorded step (--no-graph), every kernel.
  mapfile -t KERNELS < <(awk '/^VIREO_SKIP_KERNELS: launching .* in a recorded graph$/ { print $3 }' "$DIR/list.txt" | sort -u)
  if [ ${#KERNELS[@]} -gt 0 ]; then
    echo "kernels launched in the recorded decode step: ${KERNELS[*]}"
  else
    mapfile -t KERNELS < <(awk '/^VIREO_SKIP_KERNELS: launching / { print $3 }' "$DIR/list.txt" | sort -u)
    if [ ${#KERNELS[@]} -eq 0 ]; then
      echo "kernel-costs: the listing run named no kernels (not a CUDA run? see $DIR/list.txt)" >&2
      exit 1
    fi
    echo "kernels launched (no recorded decode step, so every kernel of the run): ${KERNELS[*]}"
  fi
fi

# "label<TAB>tok/s" for each "decode ctx N ... X tok/s" line of one run.
tps_points() {
  awk '/^decode ctx [0-9]+ / { for (i = 4; i < NF; ++i) if ($(i + 1) == "tok/s") { print "ctx " $3 "\t" $i; break } }' "$1"
}
run() {  # name env-value round
  local out="$DIR/$1_$3.txt"
  if [ -n "$2" ]; then VIREO_SKIP_KERNELS=$2 "$VIREO" bench "${BENCH[@]}" >"$out" 2>&1
  else "$VIREO" bench "${BENCH[@]}" >"$out" 2>&1; fi || { mv "$out" "$DIR/$1_$3.failed"; return 1; }
  [ -n "$(tps_points "$out")" ] || { mv "$out" "$DIR/$1_$3.failed"; return 1; }
}
for ((r = 1; r <= ROUNDS; ++r)); do
  run base "" "$r" || { echo "kernel-costs: the unchanged bench failed: $(tail -1 "$DIR/base_$r.failed")" >&2; exit 1; }
  for k in "${KERNELS[@]}"; do run "$k" "$k" "$r" || true; done
done

# Median tok/s a label over the rounds of one name: "label<TAB>median<TAB>min<TAB>max" lines.
medians() {
  for ((r = 1; r <= ROUNDS; ++r)); do [ -f "$DIR/$1_$r.txt" ] && tps_points "$DIR/$1_$r.txt"; done | medians_by_label
}
medians base >"$DIR/base.median"
echo "median of $ROUNDS round(s); saved: us a step (and a layer, of $LAYERS) against the unchanged bench"
printf '%-32s' "(unchanged)"
awk -F'\t' '{ printf "  %s %.1f tok/s", $1, $2 }' "$DIR/base.median"
echo
# How far the unchanged bench's rounds lie apart: a kernel "saving" less than this saved nothing
# that these runs can tell (one round: see the kernels that run outside the step, or use -r 3).
if [ "$ROUNDS" -gt 1 ]; then
  printf '%-32s' "(its spread over $ROUNDS rounds)"
  awk -F'\t' -v L="$LAYERS" '{ d = 1e6 / $3 - 1e6 / $4; printf "  %s %.0f us", $1, d; if (L > 0) printf " (%.1f a layer)", d / L }' \
    "$DIR/base.median"
  echo
fi
for k in "${KERNELS[@]}"; do
  printf '%-32s' "$k"
  if [ -z "$(medians "$k")" ]; then
    f=$(ls "$DIR/${k}"_*.failed 2>/dev/null | head -1)
    echo "  failed: $( [ -n "$f" ] && tail -1 "$f")"
    continue
  fi
  medians "$k" | awk -F'\t' -v L="$LAYERS" 'NR == FNR { base[$1] = $2; next }
    ($1 in base) { d = 1e6 / base[$1] - 1e6 / $2
                   printf "  %s %.1f tok/s saved %.0f us", $1, $2, d; if (L > 0) printf " (%.1f a layer)", d / L }' \
    "$DIR/base.median" -
  echo
done
