#!/usr/bin/env bash
# compute-sanitizer memcheck + racecheck + synccheck over the `sanitize` subset of every GPU test
# file (small shapes that launch every kernel of the file; the subset is the SANITIZE table in
# tests/conftest.py, selected with -m "gpu and sanitize"; scripts/sanitize_kernels.py KERNELS maps
# every kernel of the library to the file whose subset launches it, tests/test_sanitize_coverage.py
# keeps both complete).
#
# Per unit (a test file, or one of its N shards: SANITIZE_SHARD=k/N in scripts/sanitize_kernels.py):
# one plain pytest run first (baseline; fills the on-disk CuTe DSL .o / NVRTC cubin caches under
# $DSV4_CACHE_DIR, so the sanitized processes load kernels instead of compiling them under the tool;
# records the kernels it launched), then the three tools in parallel processes; SANITIZE_UNITS units
# in flight, in the given order, at most SANITIZE_MAXP processes at once. Each process has a deadline
# (SANITIZE_DEADLINE_S seconds after the start, default 600), so the script always ends with the table
#   file | plain pytest | memcheck errors | racecheck hazards (errors) | synccheck errors
# ("TIMEOUT" / "rc=N" / "NOT-RUN": a run did not finish / pytest failed / the deadline came first; also written to
# $LOG/../summary.txt and printed LAST, after the other sections, so a transfer that keeps only the tail keeps it), the kernel coverage of the plain runs
# (every KERNELS entry launched?) and, with SANITIZE_PROBE=1 (default), the mbarrier ring probe
# (scripts/sanitize_mbarrier_probe.py) under racecheck. Kernel errors only: CUDA API errors (torch
# probing optional driver entry points) are not reported (--report-api-errors no); "(ours N, torch M)"
# splits the displayed error records by kernel (torch's own at::native kernels apart).
# Exit 1 if any tool found an error in one of this library's kernels.
#
# Usage (repo root, on a GPU machine): bash scripts/gpu_sanitize.sh [tests/test_x.py[+tests/test_y.py][:N] ...]
#   (default: every tests/test_*.py that has a GPU test, heavy files split as in SPLIT below; ":N" = N
#   shards, "a.py+b.py" = one pytest process over both files: one row, fewer process start-ups).
#   Logs: $OUT/sanitize/ (OUT defaults to $JOB_OUT, else ./out). SANITIZE_TOOLS="memcheck racecheck
#   synccheck" picks the tools, SANITIZE_PLAIN=0 skips the plain runs (each tool then compiles).
# Counts and findings: docs/status.md (sanitizer section).
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
DEADLINE=$(( T0 + ${SANITIZE_DEADLINE_S:-600} ))
LOG=${OUT:-${JOB_OUT:-out}}/sanitize
mkdir -p "$LOG"
export DSV4_CACHE_DIR=${DSV4_CACHE_DIR:-/tmp/dsv4_sanitize_cache}
export CUTE_DSL_LINEINFO=1 PYTHONUNBUFFERED=1
export PYTHONPATH=scripts${PYTHONPATH:+:$PYTHONPATH}
TOOLS=${SANITIZE_TOOLS:-memcheck racecheck synccheck}
PY=${PYTHON:-python3}
PT=("$PY" -m pytest -q -m "gpu and sanitize" -p no:cacheprovider -p sanitize_kernels -rfE --durations=8 --durations-min=1)
# default shards of the heavier subsets (one process per shard and tool)
SPLIT=${SANITIZE_SPLIT:-"test_quantize=3 test_kv_cache=3 test_indexer_dsl=2 test_moe_glue=3 test_moe_decode=2 test_indexer=2 test_sparse_attention=2 test_topk=4 test_moe=4 test_dsl_fp8_gemm=3"}
if [ $# -gt 0 ]; then specs=("$@"); else mapfile -t specs < <(grep -l "mark.gpu" tests/test_*.py); fi
name_of() { echo "$1" | tr '+' '\n' | xargs -n1 basename | sed 's/\.py$//' | paste -sd+; }
units=(); files=()
for s in "${specs[@]}"; do
  f=${s%%:*}; n=$(name_of "$f"); k=1
  if [[ "$s" == *:* ]]; then k=${s##*:}; else for e in $SPLIT; do [ "${e%%=*}" = "$n" ] && k=${e##*=}; done; fi
  files+=("$f"); for (( i = 0; i < k; i++ )); do units+=("$f:$i/$k"); done
done

left() { local l=$(( DEADLINE - $(date +%s) )); (( l < 1 )) && l=1; echo $l; }
MAXP=${SANITIZE_MAXP:-16}
SLOTS=$(mktemp -d)
slot() { local i; while :; do for i in $(seq 1 "$MAXP"); do mkdir "$SLOTS/$i" 2>/dev/null && { echo "$i"; return; }; done; sleep 0.3; done; }
# at most SANITIZE_UNITS units in flight (default MAXP / 3: whole units finish in the given order instead of
# every plain run starting first and the tools starving), and no process starts with < SANITIZE_MIN_LEFT s left
UNITS=${SANITIZE_UNITS:-$(( MAXP / 3 > 0 ? MAXP / 3 : 1 ))}
MIN_LEFT=${SANITIZE_MIN_LEFT:-15}
USLOTS=$(mktemp -d)
uslot() { local i; while :; do for i in $(seq 1 "$UNITS"); do mkdir "$USLOTS/$i" 2>/dev/null && { echo "$i"; return; }; done; sleep 0.3; done; }

one_unit() {  # plain run (records launched kernels), then the tools in parallel
  local f=${1%%:*} sh=${1##*:} n u us=$2; n=$(name_of "$f"); u="$n.k${sh%%/*}"
  if [ "${SANITIZE_PLAIN:-1}" != 0 ]; then
    s=$(slot); t=$(date +%s)
    if (( $(left) < MIN_LEFT )); then
      for k in plain $TOOLS; do echo skip > "$LOG/$u.$k.rc"; done; rmdir "$SLOTS/$s" "$USLOTS/$us"; return
    fi
    SANITIZE_SHARD=$sh SANITIZE_KERNELS_OUT="$LOG/$u.kernels.json" timeout -k 5 "$(left)" "${PT[@]}" ${f//+/ } \
      > "$LOG/$u.plain.log" 2>&1; echo $? > "$LOG/$u.plain.rc"; rmdir "$SLOTS/$s"
    echo "$(( t - T0 ))+$(( $(date +%s) - t ))" > "$LOG/$u.plain.time"
  fi
  for tool in $TOOLS; do
    ( s=$(slot); t=$(date +%s)
      if (( $(left) < MIN_LEFT )); then echo skip > "$LOG/$u.$tool.rc"; rmdir "$SLOTS/$s"; exit 0; fi
      SANITIZE_SHARD=$sh timeout -k 5 "$(left)" compute-sanitizer --tool "$tool" --report-api-errors no \
        --target-processes all --print-limit 20 --log-file "$LOG/$u.$tool.san.%p" "${PT[@]}" ${f//+/ } > "$LOG/$u.$tool.log" 2>&1
      echo $? > "$LOG/$u.$tool.rc"; rmdir "$SLOTS/$s"
      echo "$(( t - T0 ))+$(( $(date +%s) - t ))" > "$LOG/$u.$tool.time" ) &
  done
  wait
  rmdir "$USLOTS/$us"
}

probe() {  # the mbarrier ring probe: value check, then racecheck per variant
  local v
  for v in warp thread bar racy named partial single mbar wgmma cpwarp cpthread; do
    ( timeout -k 5 "$(left)" "$PY" scripts/sanitize_mbarrier_probe.py $v > "$LOG/_probe.$v.plain.log" 2>&1
      timeout -k 5 "$(left)" compute-sanitizer --tool racecheck --report-api-errors no --print-limit 4 \
        "$PY" scripts/sanitize_mbarrier_probe.py $v > "$LOG/_probe.$v.racecheck.log" 2>&1 ) &
  done
  wait
}

( while sleep 10; do echo "t=$(( $(date +%s) - T0 ))s load $(cut -d' ' -f1 /proc/loadavg) mem: $(free -g | awk '/Mem/{print $3"/"$2" GiB"}')" \
    "gpu: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader 2>/dev/null)"; done ) > "$LOG/_resources.log" &
mon=$!
pids=()
[ "${SANITIZE_PROBE:-1}" != 0 ] && { probe & pids+=($!); }
for u in "${units[@]}"; do us=$(uslot); one_unit "$u" "$us" & pids+=($!); done   # units start in the given order
wait "${pids[@]}"
kill $mon 2>/dev/null
rm -rf "$SLOTS" "$USLOTS"

cell_pytest() {  # "ok N passed" / "rc=.. F failed" / TIMEOUT over the shards of one file
  local n=$1 kind=$2 s rcs rc st="ok"
  s=$(cat "$LOG/$n".k*."$kind".log 2>/dev/null | grep -oE "[0-9]+ (passed|failed|errors?|skipped|xpassed|xfailed)" |
      awk '{c[$2] += $1} END {for (k in c) printf "%d %s ", c[k], k}' | sed 's/ $//')
  for rc in $(cat "$LOG/$n".k*."$kind".rc 2>/dev/null || echo '?'); do
    case "$rc" in 0|5) ;; 124|137) st="TIMEOUT";; skip) [ "$st" = ok ] && st="NOT-RUN";; *) [ "$st" = ok ] && st="rc=$rc";; esac
  done
  echo "$st ${s}"
}
errs_of() {  # summed kernel errors over every sanitized process of one file ("?" = no summary)
  local n=$1 tool=$2 tot=0 seen=0 f v
  for f in "$LOG/$n".k*."$tool".san.*; do
    [ -f "$f" ] || continue
    if [ "$tool" = racecheck ]; then
      v=$(grep -oE "RACECHECK SUMMARY: [0-9]+ hazards? displayed \([0-9]+ errors?" "$f" | grep -oE "\([0-9]+" | tr -d '(' |
          awk '{s += $1; n++} END {if (n) print s}')
    else
      v=$(grep -oE "ERROR SUMMARY: [0-9]+ errors?$" "$f" | grep -oE "[0-9]+" | awk '{s += $1; n++} END {if (n) print s}')
    fi
    [ -n "$v" ] && { tot=$(( tot + v )); seen=1; }
  done
  (( seen )) && echo "$tot" || echo "?"
}
origin_of() {  # "ours torch": displayed error records of one run, by the kernel they are in (torch = at::/c10::/cub::)
  cat "$LOG/$1".k*."$2".san.* 2>/dev/null | awk '
    function add(l) { if (l ~ /at::|c10::|cub::|thrust::/) t++; else o++; pend = 0 }
    /^========= (Invalid|Out-of-range|Misaligned|Barrier error|Error: Race|Warning: Race|Hazard|Uninitialized|Unspecified)/ {
      if (pend) add(""); if ($0 ~ / at /) add($0); else pend = 1; next }
    pend && /^=========     at / { add($0); next }
    END { if (pend) add(""); print o + 0, t + 0 }'
}

bad=0
SUM=$LOG/../summary.txt
printf '%-26s | %-26s | %-24s | %-24s | %-24s\n' "file (sanitize subset)" "plain pytest" memcheck racecheck synccheck > "$SUM"
for f in "${files[@]}"; do
  n=$(name_of "$f")
  if ls "$LOG/$n".k*.plain.rc > /dev/null 2>&1; then pc=$(cell_pytest "$n" plain); else pc="-"; fi
  row=$(printf '%-26s | %-26s' "$n" "$pc")
  for tool in memcheck racecheck synccheck; do
    if [[ " $TOOLS " != *" $tool "* ]]; then row+=$(printf ' | %-24s' "-"); continue; fi
    st=$(cell_pytest "$n" "$tool" | cut -d' ' -f1); [ "$st" = ok ] && st=""
    grep -qs "Segmentation fault" "$LOG/$n".k*."$tool".log && st+=" segv"
    e=$(errs_of "$n" "$tool")
    read -r ours torch < <(origin_of "$n" "$tool")
    (( ours > 0 )) && bad=1
    [ "$e" != "?" ] && [ "$e" != 0 ] && [ "$torch" = 0 ] && bad=1
    org=""; (( ours + torch > 0 )) && org=" (ours $ours, torch $torch)"
    row+=$(printf ' | %-24s' "${e} err${org}${st:+ $st}")
  done
  echo "$row" >> "$SUM"
done
echo "total $(( $(date +%s) - T0 ))s; logs in $LOG" >> "$SUM"
[ "${SANITIZE_PLAIN:-1}" != 0 ] && "$PY" scripts/sanitize_kernels.py report "$LOG" "${files[@]}"
if [ "${SANITIZE_PROBE:-1}" != 0 ]; then
  echo "mbarrier / named-barrier ring probe (scripts/sanitize_mbarrier_probe.py), racecheck hazards per variant:"
  for v in warp thread bar racy named partial single mbar wgmma cpwarp cpthread; do
    echo "  $v: $(grep -ho "ok=[A-Za-z]*" "$LOG/_probe.$v.plain.log" 2>/dev/null | head -1)" \
      "$(grep -hoE "RACECHECK SUMMARY: .*" "$LOG/_probe.$v.racecheck.log" 2>/dev/null | head -1)" \
      "$(grep -hoE "^========= (Error|Warning): Race reported between [A-Za-z]+ access at [^ ]+" "$LOG/_probe.$v.racecheck.log" 2>/dev/null | head -1 | cut -c11-)"
  done
fi
echo "kernel error records (first lines, by count):"
grep -hE "^========= (Invalid|Out-of-range|Misaligned|Race|Error|Barrier|Hazard|Warning)" "$LOG"/*.k*.san.* 2>/dev/null | sed -E 's/\+0x[0-9a-f]+//' | sort | uniq -c | sort -rn | head -10 | cut -c1-240
grep -hE "^(FAILED|ERROR) " "$LOG"/*.log 2>/dev/null | cut -c1-200 | sort | uniq | head -12
echo "wall times per unit, start+seconds (plain | memcheck | racecheck | synccheck):"
for u in "${units[@]}"; do f=${u%%:*} sh=${u##*:}; n=$(name_of "$f").k${sh%%/*}
  printf '  %-26s' "$n"; for k in plain memcheck racecheck synccheck; do printf ' | %-8s' "$(cat "$LOG/$n.$k.time" 2>/dev/null || echo -)"; done; echo
done
echo "slowest plain tests:"
grep -hE "^[0-9.]+s (call|setup) " "$LOG"/*.plain.log 2>/dev/null | sort -rn | head -12 | cut -c1-150 | sed "s/^/  /"
tail -2 "$LOG/_resources.log" 2>/dev/null
echo; cat "$SUM"          # the table last (also in $LOG/../summary.txt)
exit $bad
