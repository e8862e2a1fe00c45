#!/usr/bin/env bash
# Lead-side: unpack a device result archive into .gpuq/results/<job>/ and retire the jobs that ran.
set -eu
cd "$(git rev-parse --show-toplevel)"
ARCH=$1
tmp=$(mktemp -d); tar xzf "$ARCH" -C "$tmp"
stamp=$(date +%H%M%S)
cp "$tmp/_summary.txt" ".gpuq/results/_summary_$stamp.txt"; cp "$tmp/_gpu.txt" ".gpuq/results/_gpu_$stamp.txt" 2>/dev/null || true
for d in "$tmp"/*/; do
  name=$(basename "$d")
  rm -rf ".gpuq/results/$name"; mkdir -p ".gpuq/results/$name"; cp -r "$d"/. ".gpuq/results/$name/"
  [ -f ".gpuq/jobs/$name.sh" ] && mv ".gpuq/jobs/$name.sh" ".gpuq/done/$name.sh"
  [ -f .gpuq/STATUS.md ] && cat .gpuq/STATUS.md >> ".gpuq/results/$name/log.txt"
  touch ".gpuq/results/$name/done"
done
grep SKIPPED "$tmp/_summary.txt" || true
cat "$tmp/_summary.txt"
rm -rf "$tmp"
