#pragma once
// The paged KV cache: per layer, K and V of [num_blocks, block_size, kv_heads, head_dim]. A
// sequence owns a block table (its blocks in position order), the layout continuous batching
// needs: sequences grow and finish independently and blocks are reused. Which blocks are free is
// the engine's business (engine/block_manager.h: reference counts and the prefix cache).

#include <cstdint>
#include <vector>

#include "loraplex/core/tensor.h"
#include "loraplex/model/config.h"
#include "loraplex/model/decoder_ops.h"

namespace loraplex::model {

class KvCache {
 public:
  /// Allocates num_blocks blocks of block_size tokens for every layer of `config`.
  KvCache(const ModelConfig& config, int64_t num_blocks, int64_t block_size, DType dtype,
          Device device);

  /// Blocks sequences can use: ids 0 .. num_blocks() - 1.
  int64_t num_blocks() const { return num_blocks_; }
  /// A block outside the pool (id num_blocks()) for padding rows, which attend to it.
  int32_t pad_block() const { return static_cast<int32_t>(num_blocks_); }
  int64_t block_size() const { return block_size_; }
  DType dtype() const { return dtype_; }
  /// Raw view of one layer's K and V, for the attention ops (pad block included).
  ops::KvCacheView view(int64_t layer) const;

  /// Blocks needed to hold `tokens` tokens.
  int64_t blocks_for(int64_t tokens) const { return (tokens + block_size_ - 1) / block_size_; }

 private:
  int64_t num_blocks_;
  int64_t block_size_;
  int64_t num_kv_heads_;
  int64_t head_dim_;
  DType dtype_;
  std::vector<Tensor> k_;  // per layer [num_blocks, block_size, kv_heads, head_dim]
  std::vector<Tensor> v_;
};

}  // namespace loraplex::model
