#pragma once
// How a model's shapes split over a tensor-parallel group, and whether they can: attention heads
// and MLP columns (and experts' intermediate columns) are divided between the ranks; KV heads
// too, or, with fewer KV heads than ranks, each is replicated on tp / num_kv_heads ranks (as
// vLLM does for grouped-query attention); the vocabulary is split in ceil(vocab / tp) rows.

#include "loraplex/model/config.h"

namespace loraplex::model {

/// Throws loraplex::Error naming the value and the rule when `config` cannot be split over `tp`
/// ranks (tp < 1, heads not divisible by tp, KV heads neither divisible by tp nor dividing it,
/// intermediate size not divisible by tp, a vocabulary too small for one row per rank; fully
/// sharded LoRA also splits the hidden size).
void check_shard_layout(const ModelConfig& config, int tp, bool fully_sharded_loras);

/// `config` as one rank of `tp` sees it: num_heads, num_kv_heads and intermediate_size are
/// this rank's (hidden size, vocabulary and everything else stay whole). Call
/// check_shard_layout first.
ModelConfig rank_config(const ModelConfig& config, int tp);

}  // namespace loraplex::model
