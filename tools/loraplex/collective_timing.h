#pragma once
// The collectives of one tensor-parallel decode step, timed alone (no model around them): what
// `bench e2e` adds to the weight-reading floor of a sharded model's step.

#include <cstdint>
#include <vector>

#include "loraplex/core/dtype.h"

namespace loraplex::cli {

/// Median over `repeats` of the time (ms, rank 0's stream) of `all_reduces` all-reduces of
/// [rows, hidden] and one all-gather of [rows, vocab_shard] in `dtype`, on one NCCL group over
/// `devices` (one thread per GPU), after a warm-up. Throws without CUDA.
double decode_collectives_ms(const std::vector<int>& devices, DType dtype, int64_t rows,
                             int64_t hidden, int64_t vocab_shard, int all_reduces, int repeats);

}  // namespace loraplex::cli
