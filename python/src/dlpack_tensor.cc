#include "dlpack_tensor.h"

#include <vector>

#include "loraplex/core/error.h"

namespace loraplex::python {
namespace {

using nb::dlpack::dtype_code;

DType array_dtype(const nb::dlpack::dtype& t, const char* what) {
  const auto code = static_cast<dtype_code>(t.code);
  if (t.lanes == 1) {
    if (code == dtype_code::Float && t.bits == 32) return DType::kF32;
    if (code == dtype_code::Float && t.bits == 16) return DType::kF16;
    if (code == dtype_code::Bfloat && t.bits == 16) return DType::kBF16;
    if (code == dtype_code::Float8_E4M3FN && t.bits == 8) return DType::kF8E4M3;
    if (code == dtype_code::Float8_E5M2 && t.bits == 8) return DType::kF8E5M2;
    if (code == dtype_code::Int && t.bits == 32) return DType::kI32;
    if (code == dtype_code::Int && t.bits == 64) return DType::kI64;
    if ((code == dtype_code::UInt || code == dtype_code::Bool) && t.bits == 8) return DType::kU8;
  }
  LORAPLEX_FAIL(what, ": unsupported DLPack dtype (code ", static_cast<int>(t.code), ", ",
                static_cast<int>(t.bits), " bits, ", t.lanes,
                " lanes); expected float32, float16, bfloat16, float8, int32, int64 or uint8");
}

nb::dlpack::dtype dlpack_dtype(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return nb::dtype<float>();
    case DType::kI32:
      return nb::dtype<int32_t>();
    case DType::kI64:
      return nb::dtype<int64_t>();
    case DType::kU8:
      return nb::dtype<bool>();
    default:
      break;
  }
  LORAPLEX_FAIL("array_of: dtype ", dtype, " is not exported");
}

}  // namespace

Device array_device(const nb::ndarray<>& array, const char* what) {
  switch (array.device_type()) {
    case nb::device::cpu::value:
    case nb::device::cuda_host::value:
      return Device::cpu();
    case nb::device::cuda::value:
      return Device::cuda(array.device_id());
    default:
      break;
  }
  LORAPLEX_FAIL(what, ": arrays on DLPack device type ", array.device_type(),
                " are not supported (CPU or CUDA)");
}

Tensor tensor_view(const nb::ndarray<>& array, const char* what) {
  const DType dtype = array_dtype(array.dtype(), what);
  const Device device = array_device(array, what);
  const size_t ndim = array.ndim();
  Shape shape(ndim);
  for (size_t i = 0; i < ndim; ++i) shape[i] = static_cast<int64_t>(array.shape(i));
  void* data = array.data();
  // Strides of dimensions of size 1 mean nothing (torch reports arbitrary ones there).
  bool contiguous = true;
  int64_t expected = 1;
  for (size_t i = ndim; i-- > 0;) {
    if (shape[i] != 1 && array.stride(i) != expected) contiguous = false;
    expected *= shape[i];
  }
  if (contiguous) return Tensor::from_blob(data, shape, dtype, device);
  if (ndim == 2 && (array.stride(1) == 1 || shape[1] == 1) && array.stride(0) >= shape[1]) {
    // Rows of a wider array: the view spans whole rows of the stride and keeps the width.
    return Tensor::from_blob(data, {shape[0], array.stride(0)}, dtype, device)
        .narrow(1, 0, shape[1]);
  }
  std::string strides;
  for (size_t i = 0; i < ndim; ++i) {
    strides += (i ? ", " : "") + std::to_string(array.stride(i));
  }
  LORAPLEX_FAIL(what, " must be contiguous (or 2-D with contiguous rows), got shape ",
                shape_str(shape), " with strides [", strides, "]");
}

nb::ndarray<nb::array_api> array_of(const void* data, DType dtype, int64_t count, Device device,
                                    nb::handle owner) {
  const size_t shape[1] = {static_cast<size_t>(count)};
  return nb::ndarray<nb::array_api>(
      const_cast<void*>(data), 1, shape, owner, nullptr, dlpack_dtype(dtype),
      device.is_cuda() ? nb::device::cuda::value : nb::device::cpu::value, device.index);
}

}  // namespace loraplex::python
