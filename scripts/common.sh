# Shared by the scripts: timing of stages and the CUDA toolkit on PATH when it is installed.
stage_start=0
stage() {
  local now
  now=$(date +%s)
  if [ "$stage_start" -ne 0 ]; then echo "=== stage done in $((now - stage_start)) s"; fi
  stage_start=$now
  echo "=== [$(date +%H:%M:%S)] $*"
}
if [ -d /usr/local/cuda/bin ] && ! command -v nvcc >/dev/null 2>&1; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
jobs=$(nproc)
