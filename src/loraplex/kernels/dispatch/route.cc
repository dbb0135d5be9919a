#include "loraplex/kernels/dispatch/route.h"

#include "loraplex/core/error.h"

namespace loraplex::kernels {

Status select_device(const Stream& stream) {
  try {
    const int want = stream.device().index;
    if (cuda_rt::current_device() != want) cuda_rt::set_device(want);
  } catch (const Error& e) {
    return Status(StatusCode::kCudaError, e.what());
  }
  return Status();
}

}  // namespace loraplex::kernels
