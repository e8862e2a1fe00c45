#!/usr/bin/env bash
# Lead-side: block until at least one job is pending (max $1 s), print the queue.
cd "$(git rev-parse --show-toplevel)"
end=$(( $(date +%s) + ${1:-540} ))
while (( $(date +%s) < end )); do
  n=$(ls .gpuq/jobs/*.sh 2>/dev/null | wc -l)
  (( n > 0 )) && break
  sleep 15
done
for f in $(ls -tr .gpuq/jobs/*.sh 2>/dev/null); do
  echo "$(basename $f) age=$(( $(date +%s) - $(stat -c %Y $f) ))s $(head -3 $f | tr '\n' ' ')"
done
