#pragma once
// Zero-copy loraplex::Tensor views of DLPack arrays (torch, CuPy, numpy, JAX: whatever
// nanobind's ndarray caster accepts), and the other way for buffers loraplex owns.

#include <cstdint>
#include <string>

#include <nanobind/ndarray.h>

#include "loraplex/core/tensor.h"

namespace loraplex::python {

namespace nb = nanobind;

/// The device of a DLPack array: kDLCPU (and pinned kDLCUDAHost) is the CPU, kDLCUDA a GPU;
/// anything else throws naming `what`.
Device array_device(const nb::ndarray<>& array, const char* what);

/// A view of `array` (which must outlive it). Accepted layouts: contiguous, or 2-D with
/// contiguous rows (the row stride may exceed the width, as a column slice of a wider
/// array). Throws loraplex::Error naming `what` for other layouts and dtypes.
Tensor tensor_view(const nb::ndarray<>& array, const char* what);

/// An array (with __dlpack__, for numpy/torch/cupy from_dlpack) over `count` elements of a buffer
/// on `device` that `owner` keeps alive.
nb::ndarray<nb::array_api> array_of(const void* data, DType dtype, int64_t count, Device device,
                                    nb::handle owner);

}  // namespace loraplex::python
