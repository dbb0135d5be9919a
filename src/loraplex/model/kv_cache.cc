#include "loraplex/model/kv_cache.h"

#include "loraplex/core/error.h"

namespace loraplex::model {

KvCache::KvCache(const ModelConfig& config, int64_t num_blocks, int64_t block_size, DType dtype,
                 Device device)
    : num_blocks_(num_blocks),
      block_size_(block_size),
      num_kv_heads_(config.num_kv_heads),
      head_dim_(config.head_dim),
      dtype_(dtype) {
  LORAPLEX_CHECK(num_blocks >= 1 && block_size >= 1, "KV cache: ", num_blocks, " blocks of ",
                 block_size, " tokens, expected at least one block of at least one token");
  // One block more than the pool: padding rows of CUDA-graph steps read and attend to it.
  // Zeroed, so that what they compute stays finite.
  const Shape shape{num_blocks + 1, block_size, num_kv_heads_, head_dim_};
  const Stream stream = Stream::default_for(device);
  for (int64_t l = 0; l < config.num_layers; ++l) {
    k_.push_back(Tensor::zeros(shape, dtype, device, stream));
    v_.push_back(Tensor::zeros(shape, dtype, device, stream));
  }
  stream.synchronize();
}

ops::KvCacheView KvCache::view(int64_t layer) const {
  LORAPLEX_CHECK(layer >= 0 && layer < static_cast<int64_t>(k_.size()), "KV cache: layer ", layer,
                 ", expected 0..", k_.size() - 1);
  ops::KvCacheView v;
  v.num_blocks = num_blocks_ + 1;
  v.block_size = block_size_;
  v.num_kv_heads = num_kv_heads_;
  v.head_dim = head_dim_;
  v.k = k_[static_cast<size_t>(layer)].data_ptr();
  v.v = v_[static_cast<size_t>(layer)].data_ptr();
  return v;
}

}  // namespace loraplex::model
