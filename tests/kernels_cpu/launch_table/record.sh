#!/usr/bin/env bash
# Records the CUDA LoRA launches of a CUDA build on the fake runtime (no GPU needed), and dumps
# the build's kernel machine code. See README.md.
#
#   record.sh BUILD_DIR OUT_DIR [table|full] [old]
#
# BUILD_DIR: a CUDA build with the loraplex_kernels and loraplex_core targets built. OUT_DIR gets
# launches.tsv (record_launches' lines), kernels.txt (parameter sizes, registers) and kernels.sass
# (kernel_info.py sass). "old" builds the recorder against the KernelTuning API that preceded
# kernels/planner/lora_plan.h. Needs cuobjdump and nvdisasm on PATH.
set -euo pipefail
build=$1
out=$2
grid=${3:-table}
api=${4:-new}
here=$(cd "$(dirname "$0")" && pwd)
src=$(cd "$here/../../../src" && pwd)
objs=$(ls "$build"/src/loraplex/kernels/CMakeFiles/loraplex_kernels.dir/cuda/*.cu.o)
mkdir -p "$out"
python3 "$here/kernel_info.py" info $objs > "$out/kernels.txt"
python3 "$here/kernel_info.py" sass $objs > "$out/kernels.sass"
defs=""
if [ "$api" = old ]; then defs="-DRECORD_OLD_API"; fi
# The headers of the build's sources (SRC_DIR, default: the tree BUILD_DIR was configured from).
srcdir=${SRC_DIR:-$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$build/CMakeCache.txt")}
# The planner has its own library (kernels/planner/) in builds since it moved there.
libs="$build/src/loraplex/kernels/libloraplex_kernels.a"
planner="$build/src/loraplex/kernels/planner/libloraplex_lora_planner.a"
if [ -f "$planner" ]; then libs="$libs $planner"; fi
g++ -std=c++20 -O1 $defs -I"$here" -I"$srcdir/src" -I/usr/local/cuda/include \
  "$here/record_launches.cc" "$here/fake_cudart.cc" \
  $libs "$build/src/loraplex/core/libloraplex_core.a" \
  -lpthread -o "$out/record_launches"
"$out/record_launches" "$out/kernels.txt" "$grid" > "$out/launches.tsv"
echo "$(wc -l < "$out/launches.tsv") lines in $out/launches.tsv"
