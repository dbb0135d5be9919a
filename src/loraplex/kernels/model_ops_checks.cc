// The argument checks that the CPU and CUDA versions of the decoder's ops share (model_ops.h).

#include "loraplex/kernels/model_ops.h"

namespace loraplex::kernels {
namespace {

Status check_cache(const KvCacheView& c, const char* op) {
  LORAPLEX_ENSURE(c.num_blocks >= 1 && c.block_size >= 1 && c.num_kv_heads >= 1 &&
                      c.head_dim >= 2 && c.k != nullptr && c.v != nullptr,
                  op, ": bad KV cache (blocks ", c.num_blocks, ", block size ", c.block_size,
                  ", kv heads ", c.num_kv_heads, ", head dim ", c.head_dim, ")");
  return Status();
}

}  // namespace

Status check_fused_lora_expand(const FusedLoraExpand& e, int64_t row_width, const char* op) {
  if (!e.active()) return Status();
  LORAPLEX_ENSURE(e.num_slices >= 1 && e.num_slices <= kMaxSlices && e.max_loras >= 1 &&
                      e.max_rank >= 1 && e.ranks != nullptr && e.shrink != nullptr &&
                      e.meta.max_loras == e.max_loras,
                  op, ": bad fused LoRA expand (", e.num_slices, " slices, max_loras ", e.max_loras,
                  ", max_rank ", e.max_rank, ", metadata for ", e.meta.max_loras, " slots)");
  LORAPLEX_ENSURE(e.num_slots >= 1 && e.num_slots <= e.max_loras &&
                      e.slot_cols >= int64_t{e.num_slices} * e.max_rank &&
                      e.shrink_row_stride >= int64_t{e.num_slots} * e.slot_cols,
                  op, ": fused LoRA expand: ", e.num_slots, " slots (max_loras ", e.max_loras,
                  ") of ", e.slot_cols, " intermediate columns (>= ", e.num_slices * e.max_rank,
                  ") need a row stride >= ", int64_t{e.num_slots} * e.slot_cols, ", got ",
                  e.shrink_row_stride);
  int64_t end = 0;
  for (int s = 0; s < e.num_slices; ++s) {
    LORAPLEX_ENSURE(e.lora_b[s] != nullptr && e.width[s] >= 1 && e.offset[s] >= end &&
                        e.offset[s] + e.width[s] <= row_width,
                    op, ": fused LoRA expand slice ", s, " (columns ", e.offset[s], " + ",
                    e.width[s], ") must follow the previous slice and fit the ", row_width,
                    " input columns");
    end = e.offset[s] + e.width[s];
  }
  return Status();
}

Status check_rope_kv_write_args(const RopeKvWriteArgs& a) {
  LORAPLEX_RETURN_IF_ERROR(check_cache(a.cache, "rope_kv_write"));
  const KvCacheView& c = a.cache;
  LORAPLEX_ENSURE(a.num_tokens >= 0 && a.num_heads >= 1 && c.head_dim % 2 == 0 &&
                      a.qkv_row_stride >= (a.num_heads + 2 * c.num_kv_heads) * c.head_dim,
                  "rope_kv_write: bad sizes (heads ", a.num_heads, ", kv heads ", c.num_kv_heads,
                  ", head dim ", c.head_dim, ", row stride ", a.qkv_row_stride, ")");
  return check_fused_lora_expand(a.lora, (a.num_heads + 2 * c.num_kv_heads) * c.head_dim,
                                 "rope_kv_write");
}

Status check_paged_attention_args(const PagedAttentionArgs& a) {
  LORAPLEX_RETURN_IF_ERROR(check_cache(a.cache, "paged_attention"));
  const KvCacheView& c = a.cache;
  LORAPLEX_ENSURE(
      a.num_heads >= 1 && a.num_heads % c.num_kv_heads == 0 && a.num_seqs >= 1 &&
          a.max_blocks_per_seq >= 1 && a.max_context <= a.max_blocks_per_seq * c.block_size,
      "paged_attention: bad sizes (heads ", a.num_heads, ", kv heads ", c.num_kv_heads, ", seqs ",
      a.num_seqs, ", blocks per seq ", a.max_blocks_per_seq, ", max context ", a.max_context, ")");
  return Status();
}

Status check_qk_rms_norm_args(const QkRmsNormArgs& a) {
  LORAPLEX_ENSURE(a.num_tokens >= 0 && a.num_heads >= 1 && a.num_kv_heads >= 1 && a.head_dim >= 1 &&
                      a.qkv_row_stride >= (a.num_heads + 2 * a.num_kv_heads) * a.head_dim &&
                      (a.num_tokens == 0 ||
                       (a.qkv != nullptr && a.q_weight != nullptr && a.k_weight != nullptr)),
                  "qk_rms_norm: bad arguments (heads ", a.num_heads, ", kv heads ", a.num_kv_heads,
                  ", head dim ", a.head_dim, ", row stride ", a.qkv_row_stride, ")");
  return Status();
}

Status check_feed_tokens_args(const FeedTokensArgs& a) {
  LORAPLEX_ENSURE(a.num_tokens >= 0 && a.num_sampled >= 0 &&
                      (a.num_tokens == 0 || (a.rows != nullptr && a.tokens != nullptr)) &&
                      (a.num_sampled == 0 || a.sampled != nullptr),
                  "feed_tokens: bad arguments (tokens ", a.num_tokens, ", sampled ", a.num_sampled,
                  ")");
  return Status();
}

}  // namespace loraplex::kernels
