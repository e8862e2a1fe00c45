#!/usr/bin/env bash
# Split the CuTe DSL bundle (.dsl/dsl-4.8.1.tar.xz, 61.75 MiB, built by ../shared/device/make_dsl_bundle.sh)
# into .dslA (the 193 MB _cutlass_ir extension, 47.9 MiB xz) and .dslB (everything else, 14.2 MiB): the
# one-piece bundle plus the tree no longer fit in the 64 MiB one device call carries. Use (same warm machine):
#   call 1: carry [".dslA"], command `bash .dslA/unpack.sh`
#   call 2: carry [".dslB", ...], command `source .dslB/activate.sh && export PYTHONPATH=.:$PYTHONPATH && ...`
#   later calls while warm: `export PYTHONPATH=.:/tmp/dsl-site-4.8.1:/tmp/dsl-site-4.8.1/nvidia_cutlass_dsl/dsl_packages`
# Takes ~10 min on 2 busy cores (xz -9). Run from the repo root.
set -euo pipefail
VER=4.8.1
SO=nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cu13.cpython-312-x86_64-linux-gnu.so
[[ -f .dsl/dsl-$VER.tar.xz ]] || { echo "build .dsl first: bash ../shared/device/make_dsl_bundle.sh"; exit 1; }
for d in .dslA .dslB; do grep -qxF "/$d/" .git/info/exclude || echo "/$d/" >> .git/info/exclude; done
w=$(mktemp -d); trap 'rm -rf "$w"' EXIT
tar -C "$w" -xJf .dsl/dsl-$VER.tar.xz
mkdir -p .dslA .dslB
tar -C "$w" -cf - "$SO" | xz -T2 -9 > .dslA/dsl-a.tar.xz &
tar -C "$w" --exclude="./$SO" -cf - . | xz -T2 -9 > .dslB/dsl-b.tar.xz &
wait
cat > .dslA/unpack.sh <<ACT
# call 1 of the split bundle: unpack the _cutlass_ir extension (see .dslB/activate.sh)
if [[ ! -d /tmp/dsl-site-$VER && ! -d /tmp/dsl-site-$VER.part-a ]]; then
  rm -rf /tmp/dsl-site-$VER.tmp-a && mkdir -p /tmp/dsl-site-$VER.tmp-a &&
  tar -C /tmp/dsl-site-$VER.tmp-a -xJf "\$(dirname "\${BASH_SOURCE[0]}")/dsl-a.tar.xz" &&
  mv /tmp/dsl-site-$VER.tmp-a /tmp/dsl-site-$VER.part-a
fi
ACT
cat > .dslB/activate.sh <<ACT
# call 2 of the split bundle (same warm machine as call 1): unpack the rest, assemble, put the DSL on PYTHONPATH
if [[ ! -d /tmp/dsl-site-$VER ]]; then
  if [[ ! -d /tmp/dsl-site-$VER.part-a ]]; then echo "activate: .dslA was not unpacked on this machine (call 1 first)" >&2; return 1; fi
  rm -rf /tmp/dsl-site-$VER.part && cp -al /tmp/dsl-site-$VER.part-a /tmp/dsl-site-$VER.part &&
  tar -C /tmp/dsl-site-$VER.part -xJf "\$(dirname "\${BASH_SOURCE[0]}")/dsl-b.tar.xz" &&
  mv /tmp/dsl-site-$VER.part /tmp/dsl-site-$VER
fi
export PYTHONPATH="/tmp/dsl-site-$VER:/tmp/dsl-site-$VER/nvidia_cutlass_dsl/dsl_packages\${PYTHONPATH:+:\$PYTHONPATH}"
ACT
ls -la .dslA .dslB
