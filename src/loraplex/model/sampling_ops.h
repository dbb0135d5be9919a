#pragma once
// Token sampling over a batch of logit rows, by the rule of step_batch.h (SamplingParams), as a
// framework-free argument struct over raw pointers (as model_ops.h). Per row: greedy (largest
// logit, ties to the lowest id), or temperature with top-k and top-p, driven by one uniform
// draw that the host takes from the sequence's own generator; optionally the log-probability of
// the picked id under the raw logits. The CPU version (sampling_ops_cpu.cc, through
// sample_row) defines the semantics; the CUDA version (cuda/sampling_ops_cuda.cu) reads only
// device memory and writes only `ids` and `logprobs`: no host synchronisation, no allocation,
// so it can sit inside a captured CUDA graph, and the same inputs give the same bits on every
// run.
//
// GPU and CPU pick the same id except where the row's target (uniform * kept mass) lies within
// a tiny relative margin of a boundary between two ids, or top_p * mass within a tiny margin of
// the mass above a candidate threshold (both sides compute identical float weights; they differ
// only in the order and width of the sums): see the CUDA file's header for the bound.

#include <cstddef>
#include <cstdint>

#include "loraplex/core/dtype.h"
#include "loraplex/core/status.h"
#include "loraplex/core/stream.h"
#include "loraplex/model/step_batch.h"

namespace loraplex::model::ops {

/// One sampling step over `num_rows` rows of logits. Parameters per row follow SamplingParams:
/// temperature 0 (or top_k 1) = greedy; top_k 0 = off; top_p 1 = off. The CPU version rejects
/// out-of-range parameters; the CUDA version cannot read them on the host, so it treats a
/// temperature that is not > 0 as greedy, top_k < 0 as 0 and top_p outside (0, 1) as 1.
struct SampleArgs {
  DType dtype = DType::kF32;  // of logits: f32, f16 or bf16
  int64_t num_rows = 0;
  int64_t vocab = 0;
  const void* logits = nullptr;        // [num_rows, row_stride] in
  int64_t row_stride = 0;              // elements, >= vocab
  const float* temperature = nullptr;  // [num_rows] in (0 = greedy)
  const int32_t* top_k = nullptr;      // [num_rows] in (0 = off)
  const float* top_p = nullptr;        // [num_rows] in (1 = off)
  const float* min_p = nullptr;        // [num_rows] in (0 = off), or nullptr: off for all rows
  const double* uniform = nullptr;     // [num_rows] in [0, 1), unused by greedy rows
  const int32_t* banned = nullptr;  // [num_rows, kMaxBannedTokens] in, -1 (or out of range) = none
  int32_t* ids = nullptr;           // [num_rows] out
  float* logprobs = nullptr;        // [num_rows] out (log_softmax(logits)[id]), or nullptr
  void* workspace = nullptr;        // caller-owned scratch of sample_workspace_bytes()
  size_t workspace_bytes = 0;
};

/// Scratch that cpu::sample and cuda::sample need for up to `max_rows` rows of `vocab` logits
/// (the CPU converts and filters one row at a time; the GPU keeps each row in the shared
/// memory of a thread-block cluster and needs none today). Size it once at start-up.
size_t sample_workspace_bytes(int64_t max_rows, int64_t vocab);

/// The largest vocabulary cuda::sample handles (a row must fit the shared memory of one
/// cluster of 8 blocks).
inline constexpr int64_t kMaxGpuSampleVocab = 8 * 48 * 1024;

namespace cpu {
Status sample(const SampleArgs& a);
}  // namespace cpu

/// Pointers are device pointers. Without the CUDA backend: kUnsupported.
namespace cuda {
Status sample(const SampleArgs& a, const Stream& stream);
}  // namespace cuda

}  // namespace loraplex::model::ops
