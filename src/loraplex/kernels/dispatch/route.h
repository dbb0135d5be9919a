#pragma once
// How every op reaches a backend: the CPU reference when the stream is on the CPU, else the CUDA
// version on the stream's device and handle. base_ops.h (the base model's ops) and
// punica/lora_dispatch.h (the LoRA ops) route through it, so the one branch between the backends
// lives here.

#include "loraplex/core/cuda_runtime.h"
#include "loraplex/core/status.h"
#include "loraplex/core/stream.h"

namespace loraplex::kernels {

/// Makes the stream's device the calling thread's current one: kernels launch on it.
Status select_device(const Stream& stream);

/// Runs `cpu_op()` on a CPU stream, else `cuda_op(stream.handle())` on the stream's device.
template <typename CpuOp, typename CudaOp>
Status route(const Stream& stream, CpuOp&& cpu_op, CudaOp&& cuda_op) {
  if (stream.device().is_cpu()) return cpu_op();
  LORAPLEX_RETURN_IF_ERROR(select_device(stream));
  return cuda_op(stream.handle());
}

/// The common form: an op whose CPU version takes its arguments and whose CUDA version takes
/// them and a stream handle.
template <typename Args>
Status route(Status (*cpu_fn)(const Args&), Status (*cuda_fn)(const Args&, cuda_rt::StreamHandle),
             const Args& args, const Stream& stream) {
  return route(
      stream, [&] { return cpu_fn(args); },
      [&](cuda_rt::StreamHandle handle) { return cuda_fn(args, handle); });
}

}  // namespace loraplex::kernels
