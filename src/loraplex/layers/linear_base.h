#pragma once
// The base GEMM of every layer, y = x W^T (+ bias), on the tensor's device: the blocked CPU
// GEMM (kernels/gemm.h, through kernels/dispatch/base_ops.h) or cuBLASLt (fp32 compute; TF32 off
// for f32; f16/bf16 with fp32 accumulation; fp8 weights as W8A8).

#include "loraplex/core/stream.h"
#include "loraplex/core/tensor.h"
#include "loraplex/layers/fp8_weight.h"

namespace loraplex {

/// y = x W^T (+ bias), or y += ... with `accumulate`.
/// x: [m, k] in, rows contiguous (row stride may exceed k); w: [n, k] in, contiguous;
/// bias: [n] in, or an undefined tensor; y: [m, n] out, rows contiguous.
/// All on one device, one dtype (f32, f16 or bf16). Throws loraplex::Error on bad arguments.
void linear_base(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y,
                 const Stream& stream, bool accumulate = false);

/// The same with w float8_e4m3 [n, k] and its scales (layers/fp8_weight.h), on w's device: the
/// CPU multiplies x by the dequantised weight; CUDA quantises x to e4m3 first (static or per
/// token, see kernels::GemmArgs) into `scratch` (u8, at least
/// kernels::fp8_gemm_scratch_bytes(m, k) bytes on CUDA; may be undefined on the CPU).
void linear_base_fp8(const Tensor& x, const Tensor& w, const Fp8Scales& scales, const Tensor& bias,
                     Tensor& y, const Tensor& scratch, const Stream& stream);

}  // namespace loraplex
