#pragma once
// Launch-shape knobs of the CUDA LoRA kernels (decode paths, prefill shrink, expand grid). The
// defaults are the shapes measured best on an H200 (BENCHMARKS.md); `loraplex bench kernels --tune`
// sweeps them. Plain C++ (no CUDA headers): it is compiled in every build, the CUDA launchers read
// it.

#include <string>
#include <utility>
#include <vector>

#include "loraplex/core/status.h"

namespace loraplex::kernels::cuda {

struct KernelTuning {
  /// Decode kernel: producer items along K per A row group, at most (a power of two, 1..16).
  int decode_k_chunks = 16;
  /// Decode kernel: output columns per consumer item, at most (a power of two, 8..256).
  int decode_cols = 128;
  /// Prefill shrink: CTAs that split K, at most (1, 2, 4 or 8); 0: 4 for mma.sync, 8 for wgmma
  /// (above 64 A rows fewer, of any count, so that its one-per-SM grid stays within 128 CTAs).
  int prefill_k_split = 0;
  /// Prefill shrink: K is split until the grid has about this many CTAs per SM (1..8).
  int prefill_ctas_per_sm = 2;
  /// Prefill shrink: cp.async ring depth (3..6); 0: 4 where three stages hold at most 36 KB
  /// (56 KB for wgmma), and for the wgmma form above 64 A rows; else 3.
  int prefill_stages = 0;
  /// Prefill shrink: at most this many CTAs per SM (1..4, by padding shared memory); 0: as many
  /// as fit.
  int prefill_max_ctas_per_sm = 0;
  /// Prefill shrink: where the split-K partial sums meet. 1: in a thread-block cluster's shared
  /// memory; 2: in global memory (the metadata's scratch, the last CTA of a tile adds them)
  /// wherever the scratch holds them, so that the CTAs need no co-scheduling; 0: global memory
  /// where the grid's bound brings more than one CTA per SM (small variant), else clusters.
  int prefill_reduce = 0;
  /// Prefill shrink: the MMA. 1: mma.sync on 64-token tiles; 2: wgmma (sm_90a) on 128-token
  /// tiles up to 256 A rows; 0: wgmma where it measured faster (prefill_shrink.cu,
  /// choose_plan), else mma.sync.
  int prefill_mma = 0;
  /// Prefill shrink with its split-K parts in global memory: 1 sums them in each tile's last
  /// CTA; 2 in a second kernel launched with PDL (many CTAs per tile); 0: the second kernel for
  /// the wgmma form from 2048 tokens.
  int prefill_sum = 0;
  /// Tensor-core expands: grid of this many CTAs per SM at most (1..16), each taking a
  /// contiguous run of work items; 0: four, and five for the pipelined expand up to rank 16 where
  /// the items are at least ten per SM (expand_pipelined.cu).
  int expand_ctas_per_sm = 0;
  /// Expand up to max_rank 64: 1 runs the tensor-core expand one item at a time; 0 (default)
  /// and 2 the software-pipelined one (expand_pipelined.cu).
  int expand_pipelined = 0;
  /// Decode kernel: CTAs per SM at most (1..4); 0: every CTA that fits (one wave).
  int decode_ctas_per_sm = 0;
  /// Decode-sized layers: 0 runs the per-token kernel pair chained with PDL where it applies,
  /// 1 always the persistent decode kernel.
  int decode_persistent = 0;
  /// Per-token pair: consecutive tokens of the sorted order per shrink CTA (1, 2 or 4), which
  /// share the A rows they load when they share a slot; 0: 2 up to max_rank 16, else 1.
  int gather_group = 0;
  /// Per-token pair: used while tokens x max_rank is at most this (1..2^30). The pair reads
  /// each token's A rows once per token (no grouping by slot); on the H200 it measured slower
  /// than the persistent kernel at rank 64 x 64 tokens (4096) and faster below.
  int gather_max_token_ranks = 2048;
  /// Per-token pair: the shrink's arithmetic. 1: FMA; 2: tensor cores; 0: tensor cores where
  /// groups of tokens share a slot (gather_lora.cu, mma_for).
  int gather_shrink = 0;
  /// Per-token pair: A rows per shrink CTA (8 or 16); 0: gather_lora.cu's rows_for (8 above
  /// rank 16 on grids of up to two 16-row CTAs per SM, else 16).
  int gather_rows = 0;
  /// Layers up to 256 tokens: the one-kernel cluster path (cluster_lora.cu). 0: never; 1: where
  /// it measured faster than the other paths (decode_lora.cu, use_cluster); 2: wherever it
  /// applies (for tests and comparisons).
  int decode_cluster = 1;
  /// Decode-sized layers (the per-token pair, the cluster path): the layer's first kernel with
  /// programmatic dependent launch, so that it is resident and waits in-kernel
  /// (griddepcontrol.wait, before it reads anything) while the kernel before it finishes (the
  /// layer's last kernel lets its dependents launch at its start). 0: never; 1: where it
  /// measured faster (small grids: gather_lora.cu, cluster_lora.cu); 2: always.
  int layer_pdl = 1;
  /// Where a layer's first kernel is launched with PDL and the metadata is settled
  /// (LoraMetaView::settled): 1 reads the metadata and the slots' A rows before its
  /// griddepcontrol.wait, 0 reads nothing before it.
  int meta_early = 1;
  /// The decode pair with early reads: 1 lets the shrink start the expand at its own start (the
  /// expand then reads y after its wait and starts the next kernel only then), 0 after its wait.
  int pair_launch_first = 1;
  /// Cluster path: CTAs per cluster (1..16, a power of two), which split K for the shrink and
  /// the output columns for the expand; 0: about 256 of K per CTA.
  int cluster_size = 0;
  /// Split path (the prefill shrink, then the pipelined expand): 1 launches the expand with PDL,
  /// the shrink (and its sum kernel) letting it start at their own start, so that its first y
  /// and B tiles load while the shrink finishes; 0 launches it after the shrink.
  int split_pdl = 1;
  /// Prefill shrink, wgmma form: 1 issues each stage's MMAs before the copies of the stage to
  /// come, so that the tensor cores and the copies' address arithmetic overlap (rank 64 q/k/v
  /// 6-10% faster at 256-4096 tokens on an H100, twelfth session); 0 the copies first.
  int prefill_mma_first = 1;
};

/// The knobs in force.
KernelTuning kernel_tuning();
/// Replaces the knobs after checking each against its range (an error names the field and the
/// value). Not thread-safe against launches: for benchmarks and tests, between steps.
Status set_kernel_tuning(const KernelTuning& tuning);
/// Parses "key=value,key=value" over the field names above, starting from the defaults.
Status parse_kernel_tuning(const std::string& text, KernelTuning& out);
/// Every field as (name, value), in declaration order (for reports).
std::vector<std::pair<std::string, int>> kernel_tuning_values(const KernelTuning& tuning);

}  // namespace loraplex::kernels::cuda
