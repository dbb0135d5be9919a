#pragma once
// Helpers of the CUDA op tests: every test runs an op on the GPU and the CPU reference on
// the same inputs and compares. Without a GPU the tests skip (support/gpu_check.h).

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "loraplex/core/device.h"
#include "loraplex/core/stream.h"
#include "loraplex/core/tensor.h"
#include "support/gpu_check.h"
#include "support/random_data.h"

namespace loraplex::test {

inline Device gpu() { return Device::cuda(0); }

/// A copy on the GPU (same dtype and shape).
inline Tensor on_gpu(const Tensor& t, const Stream& stream) { return t.to(gpu(), stream); }

/// A copy on the CPU, after the stream has finished.
inline Tensor on_cpu(const Tensor& t, const Stream& stream) {
  stream.synchronize();
  Tensor h = t.to(Device::cpu(), stream);
  stream.synchronize();
  return h;
}

/// int32 tensor from a vector (CPU).
inline Tensor int_tensor(const std::vector<int32_t>& v) {
  return Tensor::from_vector(v, {static_cast<int64_t>(v.size())});
}

/// Expects a GPU result (any device) to match the CPU reference tensor within rtol/atol.
inline void expect_matches(const Tensor& got, const Tensor& ref, const Stream& stream, double rtol,
                           double atol, const std::string& what) {
  const Tensor g = got.device().is_cpu() ? got : on_cpu(got, stream);
  ASSERT_EQ(g.shape(), ref.shape()) << what;
  expect_close(g, ref.to_double_vector(), rtol, atol, what);
}

/// Expects bit-identical contents (int and fp8 tensors).
inline void expect_identical(const Tensor& got, const Tensor& ref, const Stream& stream,
                             const std::string& what) {
  const Tensor g = got.device().is_cpu() ? got : on_cpu(got, stream);
  ASSERT_EQ(g.shape(), ref.shape()) << what;
  ASSERT_EQ(g.dtype(), ref.dtype()) << what;
  const auto* a = static_cast<const unsigned char*>(g.data_ptr());
  const auto* b = static_cast<const unsigned char*>(ref.data_ptr());
  const size_t esize = g.element_size();
  for (size_t i = 0; i < g.nbytes(); ++i) {
    if (a[i] != b[i]) {
      ADD_FAILURE() << what << ": first difference at element " << i / esize;
      return;
    }
  }
}

}  // namespace loraplex::test
