#pragma once
// The tuned launch-shape values of the CUDA LoRA kernels, one table per GPU architecture, passed
// explicitly to the planner (lora_plan.h) with the device's limits. Plain C++ (no CUDA headers):
// compiled in every build, so the tables and their checks are tested without a GPU.
// `loraplex bench kernels --tune key=value,...` sweeps the fields.

#include <string>
#include <utility>
#include <vector>

#include "loraplex/core/status.h"

namespace loraplex::kernels::planner {

/// Launch-shape values of the LoRA kernels. The defaults are the sm_90 table, measured on
/// H100 and H200; 0 in a field documented as automatic picks by the planner's
/// measured rule.
struct LoraTuning {
  /// Largest batch (tokens) that runs the per-token pair; 0: never.
  int decode_max_tokens = 64;
  /// Layers up to 256 tokens: the one-kernel cluster layer (cluster_lora.cu). 0: never; 1: where
  /// it measured faster than the other paths (lora_plan.cc, use_cluster); 2: wherever it applies.
  int decode_cluster = 1;
  /// Decode-sized layers (the pair, the cluster layer): the layer's first kernel launched with
  /// programmatic dependent launch. 0: never (a layer after a GEMM); 1: where it measured
  /// faster; 2: always.
  int layer_pdl = 1;
  /// The per-token pair runs decode-sized layers while tokens x max_rank is at most this, the
  /// split kernels above it (0: never the pair).
  int gather_max_token_ranks = 2048;
  /// Pair: consecutive sorted tokens per shrink CTA (1 or 2); 0: 2 up to max_rank 16 except at
  /// 2-16 tokens, else 1.
  int gather_group = 0;
  /// Pair: A rows per shrink CTA (8 or 16); 0: 8 above rank 16 on grids of at most two 16-row
  /// CTAs per SM, else 16.
  int gather_rows = 0;
  /// Pair: the shrink's arithmetic. 1: FMA; 2: tensor cores; 0: tensor cores where groups of
  /// tokens share a slot.
  int gather_shrink = 0;
  /// Cluster layer: CTAs per cluster (a power of two, 1..16); 0: about 256 of K per CTA.
  int cluster_size = 0;
  /// Prefill shrink: the MMA. 1: mma.sync on 64-token tiles; 2: wgmma on 128-token tiles; 0:
  /// wgmma where it measured faster.
  int prefill_mma = 0;
  /// Prefill shrink: CTAs that split K at most (1, 2, 4 or 8); 0: 4 for mma.sync, 8 for wgmma
  /// (one wave of the large wgmma form: fewer, of any count).
  int prefill_k_split = 0;
  /// Prefill shrink: K is split until the grid has about this many CTAs per SM (1..8).
  int prefill_ctas_per_sm = 2;
  /// Prefill shrink: cp.async ring depth (3 or 4); 0: 4 where three stages in flight stay within
  /// a byte budget (and for the large wgmma form), else 3.
  int prefill_stages = 0;
  /// Prefill shrink: where the split-K parts meet. 1: a thread-block cluster; 2: global memory;
  /// 0: global memory where the small variant's grid brings more than one CTA per SM.
  int prefill_reduce = 0;
  /// Prefill shrink, parts in global memory: 1 sums them in each tile's last CTA; 2 in a second
  /// kernel launched with PDL; 0: the second kernel for the wgmma form from 2048 tokens.
  int prefill_sum = 0;
  /// SMs that one wave of the large wgmma shrink (one CTA per SM, in clusters) leaves unused:
  /// 132-SM parts placed 128 of its CTAs at once, so its grid stays within sm_count minus this.
  int prefill_wave_spare_sms = 4;
  /// Tensor-core expands: CTAs per SM at most (1..16); 0: four, and five for the pipelined
  /// expand up to rank 16 with at least ten items per SM.
  int expand_ctas_per_sm = 0;
};

/// The table for a compute capability. The kernels are built for sm_90a only, and every
/// architecture gets the sm_90 table (H100, H200).
LoraTuning lora_tuning_for(int cc_major, int cc_minor);
/// Checks every field against its range (an error names the field and the value).
Status check_lora_tuning(const LoraTuning& tuning);
/// Parses "key=value,key=value" over the field names above into `out`, starting from `out`,
/// and checks the result.
Status parse_lora_tuning(const std::string& text, LoraTuning& out);
/// Every field as (name, value), in declaration order (for reports).
std::vector<std::pair<std::string, int>> lora_tuning_values(const LoraTuning& tuning);

}  // namespace loraplex::kernels::planner
