#include "loraplex/model/shard_layout.h"

#include <algorithm>

#include "loraplex/core/error.h"

namespace loraplex::model {

void check_shard_layout(const ModelConfig& c, int tp, bool fully_sharded_loras) {
  LORAPLEX_CHECK(tp >= 1, "tensor-parallel size ", tp, ", expected >= 1");
  if (tp == 1) return;
  LORAPLEX_CHECK(c.num_heads % tp == 0, "tensor-parallel size ", tp, ": num_attention_heads ",
                 c.num_heads, " is not divisible by it");
  LORAPLEX_CHECK(
      c.num_kv_heads % tp == 0 || tp % c.num_kv_heads == 0, "tensor-parallel size ", tp,
      ": num_key_value_heads ", c.num_kv_heads,
      " is neither divisible by it nor a divisor of it (each rank needs whole KV heads)");
  LORAPLEX_CHECK(c.intermediate_size % tp == 0, "tensor-parallel size ", tp, ": intermediate_size ",
                 c.intermediate_size, " is not divisible by it");
  const int64_t vocab_shard = (c.vocab_size + tp - 1) / tp;
  LORAPLEX_CHECK((tp - 1) * vocab_shard < c.vocab_size, "tensor-parallel size ", tp,
                 ": vocab_size ", c.vocab_size, " leaves a rank without vocabulary rows");
  if (fully_sharded_loras) {
    LORAPLEX_CHECK(c.hidden_size % tp == 0, "tensor-parallel size ", tp,
                   " with fully sharded LoRA: hidden_size ", c.hidden_size,
                   " is not divisible by it (row layers split LoRA-B by output rows)");
  }
}

ModelConfig rank_config(const ModelConfig& config, int tp) {
  ModelConfig c = config;
  c.num_heads = config.num_heads / tp;
  c.num_kv_heads = std::max<int64_t>(1, config.num_kv_heads / tp);
  c.intermediate_size = config.intermediate_size / tp;
  return c;
}

}  // namespace loraplex::model
