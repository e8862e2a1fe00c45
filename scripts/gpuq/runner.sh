#!/usr/bin/env bash
# Device-side runner of the GPU job queue (lead-owned). Runs every .gpuq/jobs/*.sh in mtime order,
# each under `timeout <budget>` (first line "# budget: N"), within a global deadline; logs + each
# job's $JOB_OUT files are tarred into $OUT/res.tgz. Usage: bash scripts/gpuq/runner.sh DEADLINE_S
set -u
DEADLINE=${1:-540}
MODE=${2:-dsl}   # dsl: jobs without "# carry: peers"; peers: only those (second call, .peers carried)
T0=$(date +%s)
export PYTHONUNBUFFERED=1
# apache-tvm-ffi (the CuTe DSL's fast call path) travels as a wheel in .tvmffi/ (not in the DSL bundle)
if ls .tvmffi/*.whl >/dev/null 2>&1 && [ ! -d /tmp/tvmffi-site/tvm_ffi ]; then
  mkdir -p /tmp/tvmffi-site && python3 -m zipfile -e .tvmffi/*.whl /tmp/tvmffi-site/ ; fi
[ -d /tmp/tvmffi-site/tvm_ffi ] && export PYTHONPATH=$PYTHONPATH:/tmp/tvmffi-site
RES=/tmp/gpuq_res; rm -rf "$RES"; mkdir -p "$RES"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv,noheader > "$RES/_gpu.txt" 2>&1
python3 -c "import torch;print(torch.__version__, torch.cuda.get_device_name())" >> "$RES/_gpu.txt" 2>&1
for f in $(ls -tr .gpuq/jobs/*.sh 2>/dev/null); do
  name=$(basename "$f" .sh)
  if head -3 "$f" | grep -q '^# carry: peers'; then jm=peers; else jm=dsl; fi
  [ "$jm" = "$MODE" ] || continue
  b=$(head -3 "$f" | sed -n 's/^# budget: *\([0-9]*\).*/\1/p' | head -1); b=${b:-120}; (( b > ${JOB_CAP:-150} )) && b=${JOB_CAP:-150}
  now=$(( $(date +%s) - T0 ))
  if (( now + b > DEADLINE )); then echo "$name SKIPPED (needs ${b}s, ${now}s used of ${DEADLINE})" >> "$RES/_summary.txt"; continue; fi
  mkdir -p "$RES/$name"; export JOB_OUT="$RES/$name"
  s=$(date +%s)
  timeout -k 10 "$b" bash "$f" > "$RES/$name/log.txt" 2>&1; rc=$?
  echo "$rc" > "$RES/$name/rc"
  echo "$name rc=$rc $(( $(date +%s) - s ))s (budget $b) at +${now}s" >> "$RES/_summary.txt"
done
echo "total $(( $(date +%s) - T0 ))s" >> "$RES/_summary.txt"
# keep the returned archive small: truncate huge logs
find "$RES" -type f -size +3M -exec sh -c 'tail -c 3000000 "$1" > "$1.tail" && mv "$1.tail" "$1"' _ {} \;
tar czf "$OUT/res.tgz" -C "$RES" .
cat "$RES/_summary.txt"
