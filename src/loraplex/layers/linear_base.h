#pragma once
// The base GEMM of every layer, y = x W^T (+ bias), on the tensor's device: the blocked CPU
// GEMM (kernels/gemm.h, through punica/op_dispatch) or cuBLASLt (fp32 compute; TF32 off for f32;
// f16/bf16 with fp32 accumulation).

#include "loraplex/core/stream.h"
#include "loraplex/core/tensor.h"

namespace loraplex {

/// y = x W^T (+ bias), or y += ... with `accumulate`.
/// x: [m, k] in, rows contiguous (row stride may exceed k); w: [n, k] in, contiguous;
/// bias: [n] in, or an undefined tensor; y: [m, n] out, rows contiguous.
/// All on one device, one dtype (f32, f16 or bf16). Throws loraplex::Error on bad arguments.
void linear_base(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y,
                 const Stream& stream, bool accumulate = false);

}  // namespace loraplex
