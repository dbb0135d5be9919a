#pragma once
// The float arithmetic of the sampling rule (step_batch.h) that the CPU sampler (sampler.cc) and
// the GPU sampler (cuda/sampling_ops_cuda.cu) must compute bit for bit alike: the exponential of
// a scaled logit's distance to the row's maximum. A library exp differs between the host and
// the device by an ulp or two, which would move the boundaries between tokens (and the top-p
// threshold) by about 1e-7 of the mass: a few tokens in a thousand at vocab 128k would differ
// between the two samplers. This exp uses only IEEE-rounded additions, multiplications and
// fused multiply-adds and floor (each correctly rounded on both sides: fmaf is exact in C and
// in CUDA), each one a separate operation, so both sides compute the same bits.
//
// Include it only from sampler.cc (built with -ffp-contract=off, so that the host compiler
// fuses no other multiply and add) and from the CUDA sampler (which uses the _rn intrinsics,
// never contracted). `Arith` supplies the operations: see HostArith in sampler.cc and
// DeviceArith in the CUDA file.

#include <cstdint>

#if defined(__CUDACC__)
#define LORAPLEX_SAMPLING_HD __host__ __device__
#else
#define LORAPLEX_SAMPLING_HD
#endif

namespace loraplex::model::sampling_detail {

/// exp(x) for x <= 0 (or -inf), rounded to float; relative error below 1e-7 on normal results,
/// never above 1 (x = 0 gives exactly 1). Cody-Waite reduction x = k ln2 + r, |r| <= ln2 / 2,
/// and Cephes' degree-7 polynomial for exp(r) in Horner form (Moshier, "Methods and Programs
/// for Mathematical Functions"), then scaling by 2^k in one rounding (two steps below 2^-126,
/// the first exact).
template <typename Arith>
LORAPLEX_SAMPLING_HD inline float exp_nonpositive(float x) {
  // e^-104 < 2^-150: rounds to zero (and so does -inf; NaN never reaches here).
  if (!(x >= -104.0f)) return 0.0f;
  const float kf = Arith::floor(Arith::fma(x, 1.44269504088896341f, 0.5f));
  // x - kf ln2 in two steps; kf * 0.693359375f is exact (kf has at most 8 bits, the constant 9).
  float r = Arith::fma(kf, -0.693359375f, x);
  r = Arith::fma(kf, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = Arith::fma(p, r, 1.3981999507e-3f);
  p = Arith::fma(p, r, 8.3334519073e-3f);
  p = Arith::fma(p, r, 4.1665795894e-2f);
  p = Arith::fma(p, r, 1.6666665459e-1f);
  p = Arith::fma(p, r, 5.0000001201e-1f);
  const float y = Arith::add(Arith::fma(p, Arith::mul(r, r), r), 1.0f);
  const int k = static_cast<int>(kf);  // in [-150, 0]
  if (k >= -126) {
    return Arith::mul(y, Arith::from_bits(static_cast<uint32_t>(k + 127) << 23));
  }
  const float scaled = Arith::mul(y, Arith::from_bits(static_cast<uint32_t>(k + 64 + 127) << 23));
  return Arith::mul(scaled, Arith::from_bits(static_cast<uint32_t>(-64 + 127) << 23));
}

/// The probability weight of a kept id: exp(l - m) where m is the row's largest scaled logit;
/// 1 at the maximum itself (also when m is +inf, where l - m would be NaN).
template <typename Arith>
LORAPLEX_SAMPLING_HD inline float weight(float l, float m) {
  return l == m ? 1.0f : exp_nonpositive<Arith>(Arith::sub(l, m));
}

}  // namespace loraplex::model::sampling_detail
