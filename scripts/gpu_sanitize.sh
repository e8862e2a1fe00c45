#!/usr/bin/env bash
# compute-sanitizer memcheck + racecheck + synccheck over the `sanitize` subset of every GPU test
# file (small shapes that launch every kernel of the file; the subset is the SANITIZE table in
# tests/conftest.py, selected with -m "gpu and sanitize").
#
# Per test file: one plain pytest run first (a baseline that also fills the on-disk CuTe DSL / NVRTC
# caches, so the sanitized processes load kernels instead of compiling them), then the three tools in
# parallel processes; all files in parallel. Each process has a deadline (SANITIZE_DEADLINE_S
# seconds after the start, default 135), so the script always ends with the table:
#   file | plain pytest | memcheck errors | racecheck hazards (errors) | synccheck errors
# and a cell is "TIMEOUT" / "rc=N" when a run did not finish / pytest failed. Kernel errors only:
# CUDA API errors (torch probing optional driver entry points) are not reported (--report-api-errors no);
# "(ours N, torch M)" splits the displayed error records by kernel (torch's own at::native kernels apart).
# Exit 1 if any tool found an error in one of this library's kernels.
#
# Usage (repo root, on a GPU machine): bash scripts/gpu_sanitize.sh [tests/test_x.py ...]
#   (default: every tests/test_*.py that has a GPU test). Logs: $OUT/sanitize/ (OUT defaults to
#   $JOB_OUT, else ./out). SANITIZE_TOOLS="memcheck racecheck synccheck" picks the tools,
#   SANITIZE_PLAIN=0 skips the plain runs, SANITIZE_MAXP (default 24) caps the sanitized processes.
# Measured (job conf-01, H200 host, 16 cores): all 19 files need more than the 135 s default box (DSL
# and NVRTC compiles of 19 files at once; racecheck is the slowest tool); give it ~10 min, or pass a
# few files at a time. Counts and findings: docs/status.md.
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
DEADLINE=$(( T0 + ${SANITIZE_DEADLINE_S:-135} ))
LOG=${OUT:-${JOB_OUT:-out}}/sanitize
mkdir -p "$LOG"
export DSV4_CACHE_DIR=${DSV4_CACHE_DIR:-/tmp/dsv4_sanitize_cache}
export CUTE_DSL_LINEINFO=1 PYTHONUNBUFFERED=1
TOOLS=${SANITIZE_TOOLS:-memcheck racecheck synccheck}
PY=${PYTHON:-python3}
PT=("$PY" -m pytest -q -m "gpu and sanitize" -p no:cacheprovider -rfE --durations=3)
if [ $# -gt 0 ]; then files=("$@"); else mapfile -t files < <(grep -l "mark.gpu" tests/test_*.py); fi

left() { local l=$(( DEADLINE - $(date +%s) )); (( l < 1 )) && l=1; echo $l; }
# at most SANITIZE_MAXP sanitized processes at once (host memory: each is a torch process plus the tool)
MAXP=${SANITIZE_MAXP:-24}
SLOTS=$(mktemp -d)
slot() { local i; while :; do for i in $(seq 1 "$MAXP"); do mkdir "$SLOTS/$i" 2>/dev/null && { echo "$i"; return; }; done; sleep 0.5; done; }

one_file() {  # plain run (SANITIZE_PLAIN=0: none, each tool process compiles itself), then the tools in parallel
  local f=$1 n; n=$(basename "$f" .py)
  if [ "${SANITIZE_PLAIN:-1}" != 0 ]; then
    timeout -k 5 "$(left)" "${PT[@]}" "$f" > "$LOG/$n.plain.log" 2>&1; echo $? > "$LOG/$n.plain.rc"
  fi
  for tool in $TOOLS; do
    ( s=$(slot)
      timeout -k 5 "$(left)" compute-sanitizer --tool "$tool" --report-api-errors no --target-processes all \
        --print-limit 20 --log-file "$LOG/$n.$tool.san.%p" "${PT[@]}" "$f" > "$LOG/$n.$tool.log" 2>&1
      echo $? > "$LOG/$n.$tool.rc"; rmdir "$SLOTS/$s" ) &
  done
  wait
}

( while sleep 10; do echo "t=$(( $(date +%s) - T0 ))s mem: $(free -g | awk '/Mem/{print $3"/"$2" GiB"}')" \
    "gpu: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader 2>/dev/null)"; done ) > "$LOG/_resources.log" &
mon=$!
pids=()
for f in "${files[@]}"; do one_file "$f" & pids+=($!); done
wait "${pids[@]}"
kill $mon 2>/dev/null
rm -rf "$SLOTS"

cell_pytest() {  # "N passed" / "F failed" / TIMEOUT from a pytest log + rc
  local log=$1 rc=$2 s
  s=$(grep -oE "[0-9]+ (passed|failed|error|errors|skipped)" "$log" | tr '\n' ' ' | sed 's/ $//')
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then echo "TIMEOUT ${s}"; elif [ "$rc" = 0 ]; then echo "ok ${s}"; else echo "rc=$rc ${s}"; fi
}
errs_of() {  # summed kernel errors over every sanitized process of one run ("?" = no summary)
  local n=$1 tool=$2 tot=0 seen=0 f v
  for f in "$LOG/$n.$tool.san."*; do
    [ -f "$f" ] || continue
    if [ "$tool" = racecheck ]; then
      v=$(grep -oE "RACECHECK SUMMARY: [0-9]+ hazards? displayed \([0-9]+ errors?" "$f" | grep -oE "\([0-9]+" | tr -d '(' |
          awk '{s += $1; n++} END {if (n) print s}')
    else
      v=$(grep -oE "ERROR SUMMARY: [0-9]+ errors?" "$f" | grep -oE "[0-9]+" | awk '{s += $1; n++} END {if (n) print s}')
    fi
    [ -n "$v" ] && { tot=$(( tot + v )); seen=1; }
  done
  (( seen )) && echo "$tot" || echo "?"
}

origin_of() {  # "ours torch": displayed error records of one run, by the kernel they are in (torch = at::/c10::/cub::)
  cat "$LOG/$1.$2.san."* 2>/dev/null | awk '
    function add(l) { if (l ~ /at::|c10::|cub::|thrust::/) t++; else o++; pend = 0 }
    /^========= (Invalid|Out-of-range|Misaligned|Barrier error|Error: Race|Warning: Race|Hazard|Uninitialized|Unspecified)/ {
      if (pend) add(""); if ($0 ~ / at /) add($0); else pend = 1; next }
    pend && /^=========     at / { add($0); next }
    END { if (pend) add(""); print o + 0, t + 0 }'
}

bad=0
printf '\n%-28s | %-22s | %-24s | %-24s | %-24s\n' "file (sanitize subset)" "plain pytest" memcheck racecheck synccheck
for f in "${files[@]}"; do
  n=$(basename "$f" .py)
  if [ -f "$LOG/$n.plain.rc" ]; then pc=$(cell_pytest "$LOG/$n.plain.log" "$(cat "$LOG/$n.plain.rc")"); else pc="-"; fi
  row=$(printf '%-28s | %-22s' "$n" "$pc")
  for tool in memcheck racecheck synccheck; do
    if [[ " $TOOLS " != *" $tool "* ]]; then row+=$(printf ' | %-16s' "-"); continue; fi
    rc=$(cat "$LOG/$n.$tool.rc" 2>/dev/null || echo '?')
    e=$(errs_of "$n" "$tool")
    read -r ours torch < <(origin_of "$n" "$tool")
    (( ours > 0 )) && bad=1
    [ "$e" != "?" ] && [ "$e" != 0 ] && [ "$torch" = 0 ] && bad=1
    case "$rc" in 0) st="";; 124|137) st=" TIMEOUT";; 139) st=" tool segv";; *) st=" rc=$rc";; esac
    org=""; (( ours + torch > 0 )) && org=" (ours $ours, torch $torch)"
    row+=$(printf ' | %-24s' "${e} err${org}${st}")
  done
  echo "$row"
done
echo "total $(( $(date +%s) - T0 ))s; logs in $LOG; first kernel errors:"
grep -hE "^========= (Invalid|Out-of-range|Misaligned|Race|Error|Barrier|Hazard|Warning)" "$LOG"/*.san.* 2>/dev/null | sort | uniq -c | sort -rn | head -8
grep -hE "^(FAILED|ERROR) " "$LOG"/*.plain.log 2>/dev/null | cut -c1-200 | head -12
echo "slowest plain test per file:"
for f in "${files[@]}"; do n=$(basename "$f" .py)
  grep -A1 "slowest 3 durations" "$LOG/$n.plain.log" 2>/dev/null | tail -1 | cut -c1-120 | sed "s/^/  /"; done
tail -2 "$LOG/_resources.log" 2>/dev/null
exit $bad
