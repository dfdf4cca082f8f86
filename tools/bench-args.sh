# Sourced by tools/ab-bench.sh and tools/kernel-costs.sh: the vireo binary and their common
# arguments. In: ROUNDS and DIR (defaults), then the caller's "$@" (-h prints the caller's
# leading comment block). Out: VIREO (the environment's, else build/vireo, else
# build-cuda/vireo), ROUNDS, DIR (-r, -o), BENCH (what follows the first "--"; default the fp8
# decode of BENCHMARKS.md's CUDA tables) and POSITIONAL (the rest); medians_by_label.
set -u
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VIREO=${VIREO:-$ROOT/build/vireo}
[ -x "$VIREO" ] || VIREO=$ROOT/build-cuda/vireo
TOOL=$(basename "$0" .sh)
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit "$1"; }
# BENCH ARGS apart first (getopts would take a "--" that directly follows the options as its own).
POSITIONAL=() BENCH=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do POSITIONAL+=("$1"); shift; done
[ $# -gt 0 ] && shift
BENCH=("$@")
set -- ${POSITIONAL[@]+"${POSITIONAL[@]}"}
while getopts "r:o:h" opt; do
  case $opt in
    r) ROUNDS=$OPTARG ;;
    o) DIR=$OPTARG ;;
    h) usage 0 ;;
    *) usage 2 ;;
  esac
done
shift $((OPTIND - 1))
POSITIONAL=("$@")
[ ${#BENCH[@]} -eq 0 ] && BENCH=(--device cuda --synthetic glm5 --layers 8 --experts 16 --dtype fp8 --decode 64
                                 --math fast-fp8 --math-only)
if ! [[ $ROUNDS =~ ^[1-9][0-9]*$ ]]; then echo "$TOOL: -r expects a positive count, got '$ROUNDS'" >&2; exit 2; fi

# "label<TAB>value" lines on stdin (one a run) -> "label<TAB>median<TAB>min<TAB>max", labels in the
# order first seen (an even count's median: the mean of the middle two).
medians_by_label() {
  awk -F'\t' '{ v[$1] = v[$1] " " $2; if (!($1 in seen)) { seen[$1] = 1; order[++n] = $1 } }
    END { for (k = 1; k <= n; ++k) {
            c = split(v[order[k]], a, " "); for (x = 1; x <= c; ++x) for (y = x + 1; y <= c; ++y)
              if (a[y] + 0 < a[x] + 0) { t = a[x]; a[x] = a[y]; a[y] = t }
            printf "%s\t%s\t%s\t%s\n", order[k], c % 2 ? a[(c + 1) / 2] : (a[c / 2] + a[c / 2 + 1]) / 2, a[1], a[c] } }'
}
