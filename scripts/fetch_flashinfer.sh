#!/usr/bin/env bash
# Fetches the FlashInfer C++ headers that the CUDA backend's paged attention compiles against
# (src/loraplex/model/cuda/flashinfer_*.cu) into .cache/flashinfer (git-ignored):
#   include/flashinfer/       FlashInfer's top-level headers and attention/ (no subfolders)
#   cccl/libcudacxx/include/  the parts of FlashInfer's CCCL those headers include (it needs
#                             cuda::fast_mod_div, newer than the CUDA 13.0 toolkit's CCCL)
#   LICENSE, VERSION
# from the pinned flashinfer-python wheel on PyPI (62 MB, pure Python). Only these headers are
# kept, because the folder travels to the GPU machines with the repository under a size limit.
# The keep list is by folder; if a build includes a header from a folder not kept, nvcc would
# silently take the toolkit's older copy, so when nvcc is on PATH the script checks that every
# CCCL header the FlashInfer sources include resolves inside the kept folders.
#
# Usage: scripts/fetch_flashinfer.sh [DEST]   (default .cache/flashinfer; skips when DEST
#        already holds this version). LORAPLEX_FLASHINFER_WHEEL=path uses a local wheel.
set -euo pipefail
version=0.7.2.post1
root=$(cd "$(dirname "$0")/.." && pwd)
dest=${1:-$root/.cache/flashinfer}

if [[ -f "$dest/VERSION" && "$(cat "$dest/VERSION")" == "$version" ]]; then
  echo "flashinfer $version headers present in $dest"
  exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
wheel=${LORAPLEX_FLASHINFER_WHEEL:-}
if [[ -z "$wheel" ]]; then
  echo "downloading flashinfer-python==$version from PyPI"
  python3 -m pip download --quiet --no-deps --only-binary=:all: --dest "$work" \
    "flashinfer-python==$version"
  wheel=$(ls "$work"/flashinfer_python-"$version"-*.whl)
fi

# Folders kept under cccl/libcudacxx/include/cuda and cuda/std (besides their top-level files):
# the ones FlashInfer's attention headers include from (nvcc -M), whole.
python3 - "$wheel" "$work/out" "$version" <<'EOF'
import os, sys, zipfile
wheel, out, version = sys.argv[1:4]
cuda_dirs = {"__atomic", "__barrier", "__cmath", "__fwd", "__memcpy_async", "__memory", "__ptx",
             "__type_traits"}
std_dirs = {"__algorithm", "__atomic", "__barrier", "__bit", "__cccl", "__chrono", "__cmath",
            "__concepts", "__cstddef", "__cstdlib", "__cstring", "__exception",
            "__floating_point", "__functional", "__fwd", "__host_stdlib", "__internal",
            "__iterator", "__limits", "__memory", "__new", "__ranges", "__string", "__thread",
            "__tuple_dir", "__type_traits", "__utility", "detail"}
fi_prefix = "flashinfer/data/include/flashinfer/"
cccl_prefix = "flashinfer/data/cccl/libcudacxx/include/"
license_name = f"flashinfer_python-{version}.dist-info/licenses/LICENSE"

def target(name):
    if name.endswith("/"):
        return None
    if name == license_name:
        return "LICENSE"
    if name.startswith(fi_prefix):
        rest = name[len(fi_prefix):]
        parts = rest.split("/")
        if len(parts) == 1 or (len(parts) == 2 and parts[0] == "attention"):
            return "include/flashinfer/" + rest
        return None
    if name.startswith(cccl_prefix):
        rest = name[len(cccl_prefix):]
        parts = rest.split("/")
        keep = parts[0] == "nv" or (parts[0] == "cuda" and (
            len(parts) == 2 or parts[1] in cuda_dirs or
            (parts[1] == "std" and (len(parts) == 3 or parts[2] in std_dirs))))
        return "cccl/libcudacxx/include/" + rest if keep else None
    return None

count = 0
with zipfile.ZipFile(wheel) as z:
    for info in z.infolist():
        t = target(info.filename)
        if t is None:
            continue
        path = os.path.join(out, t)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with z.open(info) as src, open(path, "wb") as dst:
            dst.write(src.read())
        count += 1
if not os.path.exists(os.path.join(out, "include/flashinfer/attention/prefill.cuh")):
    sys.exit(f"{wheel} has no flashinfer/data/include/flashinfer/attention/prefill.cuh")
print(f"kept {count} files")
EOF

nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
if [[ -x "$nvcc" ]]; then
  for src in "$root"/src/loraplex/model/cuda/flashinfer_*.cu; do
    "$nvcc" -std=c++20 -M -isystem "$work/out/cccl/libcudacxx/include" \
      -isystem "$work/out/include" -I "$root/src" "$src" -o "$work/deps.d"
    # The toolkit's CCCL sits in .../include/cccl/: a header found there was left out here.
    leaked=$(tr ' \\' '\n\n' <"$work/deps.d" | grep '/include/cccl/' || true)
    if [[ -n "$leaked" ]]; then
      echo "error: $(basename "$src") includes CCCL headers that the keep list of" \
        "scripts/fetch_flashinfer.sh leaves out (nvcc took the toolkit's):" >&2
      echo "$leaked" | head -5 >&2
      exit 1
    fi
  done
fi

echo "$version" >"$work/out/VERSION"
rm -rf "$dest"
mkdir -p "$(dirname "$dest")"
mv "$work/out" "$dest"
echo "flashinfer $version headers in $dest: $(du -sh "$dest" | cut -f1)"
