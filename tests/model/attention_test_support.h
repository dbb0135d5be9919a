#pragma once
// Random steps for the PagedAttention tests (CPU and CUDA): sequences with cached context and
// new tokens, blocks drawn from a shuffled pool (non-contiguous, out of order), random q, K
// and V everywhere (unused blocks too), and references computed independently of
// PagedAttention's own array building.

#include <cstdint>
#include <random>
#include <vector>

#include "loraplex/core/tensor.h"
#include "loraplex/model/paged_attention.h"

namespace loraplex::test {

/// One sequence of a step: `past` tokens already cached, `now` new ones (kv_len = past +
/// now). A dummy sequence (graph padding) has one token in the spare block 0.
struct AttnSeq {
  int32_t past = 0;
  int32_t now = 1;
  bool dummy = false;
};

/// A dummy sequence: kv_len 1 on the spare block.
inline AttnSeq dummy_seq() { return AttnSeq{0, 1, true}; }

struct AttentionScenario {
  model::AttentionShape shape;
  int64_t num_blocks = 0;
  int64_t row_stride = 0;  // of q: wider than the q heads, as in a packed qkv row
  model::AttentionStep step;
  Tensor q;  // [tokens, row_stride] CPU
  Tensor k;  // [num_blocks, block_size, kv_heads, head_dim] CPU
  Tensor v;  // same
};

/// Blocks needed by `seqs` (the spare block 0 included).
int64_t blocks_needed(const std::vector<AttnSeq>& seqs, int64_t block_size);

/// A random step of `seqs` over a new random cache of num_blocks blocks (0 = just enough), or
/// over the cache of `same_cache` (its K and V tensors, shared); block 0 is the dummies'
/// spare block, the others are shuffled.
AttentionScenario make_attention_scenario(const model::AttentionShape& shape,
                                          const std::vector<AttnSeq>& seqs, std::mt19937_64& rng,
                                          int64_t num_blocks = 0,
                                          const AttentionScenario* same_cache = nullptr);

/// ops::cpu::paged_attention on the scenario, with a 2-D block table built here:
/// [tokens, heads * head_dim] in shape.dtype.
Tensor cpu_reference(const AttentionScenario& s);

/// Causal GQA attention in double precision over the scenario's (rounded) inputs.
std::vector<double> double_reference(const AttentionScenario& s);

/// Relative L2 error ||got - ref|| / ||ref|| over the whole output and the worst row.
struct RelativeError {
  double total = 0.0;
  double worst_row = 0.0;
  int64_t worst_row_index = -1;
};
RelativeError relative_error(const Tensor& got, const std::vector<double>& ref, int64_t row_len);

}  // namespace loraplex::test
