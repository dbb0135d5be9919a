#pragma once
// The one place that decides how the CUDA LoRA kernels run a call: which path a layer takes
// (the cluster layer, the per-token pair, shrink + expand kernels, or the generic kernels), and
// every launch's shape (grid, threads, shared memory, template arguments, PDL and cluster
// attributes), from the call's sizes and alignments, the device's limits and the tuning table. The
// launchers (kernels/cuda/lora_launch.h) run a plan; the tests and the benchmark read it. Plain C++
// (no CUDA headers, its own library, loraplex_lora_planner): compiled in every build, so the
// decisions are tested without a GPU (tests/kernels_cpu/lora_plan_test.cc).
//
// A plan states the workspace it needs (LoraMetaView's scratch floats and counters); a launch
// whose metadata holds less fails with an error naming both, instead of taking another path.

#include <cstdint>

#include "loraplex/core/dtype.h"
#include "loraplex/kernels/lora_ops.h"
#include "loraplex/kernels/planner/lora_tuning.h"

namespace loraplex::kernels::planner {

/// What the planner knows of the device, read from cudaGetDeviceProperties
/// (kernels::cuda::lora_device). The defaults are an H100 SXM's (and an H200's).
struct DeviceLimits {
  int cc_major = 9;
  int cc_minor = 0;
  int sm_count = 132;
  int smem_per_block_optin = 227 * 1024;  // dynamic shared memory one block may opt in to
  int smem_per_sm = 228 * 1024;           // all blocks of an SM together
  int reserved_smem_per_block = 1024;     // the system's share of each block
};

/// The device a plan is made for: its limits and the tuning table in force (a CUDA device's:
/// kernels::cuda::lora_device).
struct LoraDevice {
  DeviceLimits limits;
  LoraTuning tuning;
};

// ---------------------------------------------------------------------------------------------
// Kernel shapes the planner and the kernels share.

/// The layer shapes the decode paths (the per-token pair) take: the limits they were measured
/// and recorded within.
namespace decode_layer {
inline constexpr int kStageB = 4096;        // columns x max_rank of B staged at most
inline constexpr int kMaxEntries = 64;      // metadata entries (max_loras + 1)
inline constexpr int kMaxTokens = 2048;     // tokens
inline constexpr int kMaxRankTable = 8192;  // ranks [num_slices, max_loras]
}  // namespace decode_layer

/// The per-token kernel pair (gather_lora.cu).
namespace gather_kernel {
inline constexpr int kThreads = 128;
inline constexpr int kKChunk = kThreads * 8;  // K per shrink CTA: 8 per thread
inline constexpr int kRowsMax = 16;           // A rows per shrink CTA at most
inline constexpr int kColsPerThread = 4;      // expand: y columns per thread
inline constexpr int kPreRanks = 16;          // expand: B ranks loaded before the wait
inline constexpr int kMaxRank = 256;          // expand: the intermediate row in shared memory
inline constexpr int kStagedRanks = 64;       // kStaged expands up to this max_rank
inline constexpr int kStagedChunks = (kStagedRanks - kPreRanks) / 8;  // 16-byte chunks a column
inline constexpr int kStagedBytes = kStagedChunks * kColsPerThread * kThreads * 16;
}  // namespace gather_kernel

/// The one-kernel cluster layer (cluster_lora.cu).
namespace cluster_kernel {
inline constexpr int kThreads = 256;
inline constexpr int kWarps = kThreads / 32;
inline constexpr int kUnitTokens = 16;     // tokens per unit: the M of one mma tile
inline constexpr int kMaxCluster = 16;     // a non-portable cluster size, allowed on sm_90
inline constexpr int kPad = 8;             // elements of padding per shared row
inline constexpr int kTargetKChunk = 256;  // K per CTA that the automatic cluster size aims at
inline constexpr int kMaxWarpTiles = 8;    // expand: 8-column tiles per warp
inline constexpr int kMaxCtaCols = kWarps * kMaxWarpTiles * 8;
inline constexpr int kMaxRows = kWarps * 2 * 16;  // shrink: two 16-row tiles of A per warp
/// The shared-memory layout and the expand's column runs (ClusterParams' host-set fields).
struct Layout {
  int x_pitch = 0;  // elements
  int b_pitch = 0;
  int inter_pitch = 0;
  int off_a = 0;  // bytes (x at 0)
  int off_b = 0;
  int off_inter = 0;
  int off_recv = 0;
  // The expand's columns of CTA c: [cta_col0[c], + cta_cols[c]) of slice cta_slice[c].
  int cta_slice[kMaxCluster] = {};
  int cta_col0[kMaxCluster] = {};
  int cta_cols[kMaxCluster] = {};
};
}  // namespace cluster_kernel

/// The tensor-core prefill shrink (prefill_shrink.cu).
namespace prefill_kernel {
inline constexpr int kThreads = 256;
inline constexpr int kTileMma = 64;  // tokens per tile, mma.sync form
inline constexpr int kTileWg = 128;  // tokens per tile, wgmma form
inline constexpr int kBK = 64;       // K elements per stage
inline constexpr int kWgRowBytes = kBK * 2;
inline constexpr int kWgAlign = 1024;   // the 128-byte swizzle repeats every 8 rows
inline constexpr int kPitch = kBK + 8;  // padded rows of the mma.sync form
inline constexpr int kMaxRows = 256;    // A rows of all slices of one slot at most
inline constexpr int kMaxTiles = kMaxRows / 8;
inline constexpr int kSmallRows = 64;        // at most this many A rows: the small variant
inline constexpr int kMaxParts = 8;          // K split in at most this many parts
inline constexpr int kMaxLorasForSum = 512;  // the sum kernel's metadata in static shared memory
inline constexpr int kSumThreads = 128;
inline constexpr int kSumRows = 16;
/// Column counts of the wgmma form (N of m64nNk16), each instantiated.
inline constexpr int kWgCols[] = {16, 32, 64, 128, 192, 256};
}  // namespace prefill_kernel

/// The tensor-core expands (shrink_expand.cu one item at a time, expand_pipelined.cu).
namespace expand_kernel {
inline constexpr int kThreads = 128;
inline constexpr int kTileRows = 64;           // tokens per item
inline constexpr int kTileCols = 128;          // output columns per item
inline constexpr int kYPitch = kTileCols + 8;  // staged y rows, 16-bit elements
inline constexpr int kCachedTokens = 2048;     // sorted indices copied to shared memory
inline constexpr int kPipelinedMaxRank = 64;   // the pipelined expand's max_rank
inline constexpr int kTokSets = 3;             // pipelined: token-index sets in rotation
/// The pipelined expand's B row pitch for kSteps 16-deep rank steps (1 or 4).
constexpr int pipelined_b_pitch(int steps) { return steps == 1 ? 16 : 80; }
/// The pipelined expand's shared memory besides the item tables: two y tiles, B, token sets.
constexpr int pipelined_fixed_bytes(int steps) {
  return 2 * kTileRows * kYPitch * 2 + kTileCols * pipelined_b_pitch(steps) * 2 +
         kTokSets * kTileRows * 4;
}
/// The one-item-at-a-time expand's shared memory besides the item tables (64 ranks a chunk).
constexpr int tc_fixed_bytes() {
  constexpr int kBK = 64;
  return (kTileRows * kYPitch + kTileRows * (kBK + 8) + kTileCols * (kBK + 8)) * 2 + kTileRows * 4;
}
}  // namespace expand_kernel

/// The generic kernels (any dtype and strides; shrink_expand.cu).
inline constexpr int kGenericThreads = 256;

/// Rank tables ([num_slices, max_loras] ints) up to this many entries are copied to shared
/// memory by the prefill shrink and the tensor-core expands.
inline constexpr int kMaxCachedRanks = 4096;

// ---------------------------------------------------------------------------------------------
// What a plan is made from.

/// The sizes and alignments of a shrink (ShrinkArgs without its pointers).
struct ShrinkShape {
  DType dtype = DType::kBF16;
  DType out_dtype = DType::kF32;
  int64_t tokens = 0;
  int64_t hidden = 0;
  int64_t x_row_stride = 0;
  int num_slices = 1;
  int max_loras = 0;
  int max_rank = 0;
  bool x_aligned16 = true;
  bool a_aligned16 = true;  // every slice's A
};

/// The sizes and alignments of an expand (ExpandArgs without its pointers).
struct ExpandShape {
  DType dtype = DType::kBF16;
  DType in_dtype = DType::kF32;
  int64_t tokens = 0;
  int num_slices = 1;
  int64_t slice_width[kMaxSlices] = {};
  int max_loras = 0;
  int max_rank = 0;
  int64_t y_row_stride = 0;
  int64_t offset_start = 0;
  bool add_inputs = true;
  bool y_aligned16 = true;
  bool y_aligned8 = true;
  bool in_aligned16 = true;
  bool b_aligned16 = true;  // every slice's B
};

/// One layer: its shrink and expand, and whether the metadata is settled (LoraMetaView).
struct LinearShape {
  ShrinkShape shrink;
  ExpandShape expand;
  bool settled = false;
};

ShrinkShape shrink_shape(const ShrinkArgs& args);
ExpandShape expand_shape(const ExpandArgs& args);
LinearShape linear_shape(const ShrinkArgs& shrink, const ExpandArgs& expand,
                         const LoraMetaView& meta);

// ---------------------------------------------------------------------------------------------
// Plans.

/// LoraMetaView scratch and counters a plan uses.
struct Workspace {
  int64_t scratch_floats = 0;
  int64_t counters = 0;
};

/// How the pair's expand holds B's ranks before its wait (gather_lora.cu's template argument):
/// kRegs up to rank 16, all of them unpacked in registers (the shrink then also loads its A rows
/// before it knows the slot's rank); kStaged up to rank 64 in shared memory; kLoop after the wait.
enum class GatherExpandMode { kLoop = 0, kRegs = 1, kStaged = 2 };

/// The per-token shrink + expand pair.
struct GatherPlan {
  int group = 1;     // tokens per shrink CTA
  bool mma = false;  // the shrink on tensor cores
  int rows = 16;     // A rows per shrink CTA
  GatherExpandMode mode = GatherExpandMode::kLoop;
  int k_chunks = 1;
  int chunk_begin[kMaxSlices + 1] = {};  // prefix of 512-column expand chunks per slice
  unsigned shrink_grid[3] = {1, 1, 1};
  unsigned expand_grid[2] = {1, 1};
  int expand_smem = 0;      // dynamic shared memory of the expand
  bool shrink_pdl = false;  // the shrink launched with PDL
  bool early = false;       // the shrink reads settled metadata before its wait
  bool launch_first = false;
};

/// The one-kernel cluster layer.
struct ClusterPlan {
  int cluster = 1;
  int k_chunk = 0;
  int cols_per_cta = 0;
  int smem = 0;
  cluster_kernel::Layout layout;
  int units = 0;  // clusters of the grid
  bool pdl = false;
  bool early = false;
};

/// The tensor-core prefill shrink (and its split-K sum kernel).
struct PrefillPlan {
  bool wg = false;  // the wgmma form
  int m = 0;        // tokens per tile
  int cols = 0;     // wgmma: N; mma.sync: column tiles per warp at most
  int stages = 0;
  int stage_bytes = 0;
  int smem = 0;
  int a_rows = 0;
  int region = 0;
  int off_rows = 0;
  int red_pitch = 0;
  bool cache_ranks = false;
  int64_t tiles = 0;  // work tiles at most
  int k_split = 1;
  int k_chunk = 0;
  bool global_reduce = false;  // split-K parts in global memory instead of a cluster
  bool defer_sum = false;      // ... summed by the sum kernel
  bool expand_follows = false;
  unsigned sum_grid = 0;
};

/// Which kernel runs a shrink.
enum class ShrinkKernel { kPrefill, kGeneric };
struct ShrinkPlan {
  ShrinkKernel kernel = ShrinkKernel::kGeneric;
  PrefillPlan prefill;
  unsigned generic_grid[2] = {1, 1};
};

/// Which kernel runs an expand: the pipelined tensor-core expand up to max_rank 64, the one that
/// takes one item at a time above it, the generic one where neither applies.
enum class ExpandKernel { kPipelined, kTensorCore, kGeneric };
struct ExpandPlan {
  ExpandKernel kernel = ExpandKernel::kGeneric;
  int steps = 1;     // pipelined: 16-deep rank steps (1 or 4)
  bool pdl = false;  // pipelined, after this layer's prefill shrink
  bool cache_ranks = false;
  bool cache_sorted = false;
  bool balanced = false;
  int ntile_begin[kMaxSlices + 1] = {};  // prefix of 128-column tiles per slice
  int64_t items = 0;
  unsigned grid = 0;
  int smem = 0;
  int64_t generic_col_blocks = 0;
};

enum class LinearPath { kCluster, kGather, kSplit, kGeneric };
/// "cluster", "gather", "split" or "generic".
const char* path_name(LinearPath path);

/// One layer: the path and the plan of each kernel it launches.
struct LinearPlan {
  LinearPath path = LinearPath::kGeneric;
  ClusterPlan cluster;  // kCluster
  GatherPlan gather;    // kGather
  ShrinkPlan shrink;    // kSplit, kGeneric
  ExpandPlan expand;    // kSplit, kGeneric
  Workspace workspace;
};

LinearPlan plan_lora_linear(const LinearShape& shape, const LoraDevice& device);
ShrinkPlan plan_lora_shrink(const ShrinkShape& shape, const LoraDevice& device,
                            bool expand_follows = false);
ExpandPlan plan_lora_expand(const ExpandShape& shape, const LoraDevice& device,
                            bool after_prefill_shrink = false);
Workspace shrink_workspace(const ShrinkPlan& plan, const ShrinkShape& shape);

/// LoraMetaView scratch floats that cover every plan of `tuning` for up to max_num_tokens
/// tokens with K up to 65536 (LoraBatchMeta's size): the pair's split-K partial sums (up to
/// decode_max_tokens tokens) and the prefill shrink's parts in global memory (8 x 64 A rows per
/// token; 8 x 256 where prefill_reduce 2 sends the large variant there too).
int64_t lora_scratch_floats(int64_t max_num_tokens, const LoraTuning& tuning);
/// Counters that cover every plan for up to max_num_tokens tokens and max_loras slots.
int64_t lora_counters(int64_t max_num_tokens, int max_loras);

}  // namespace loraplex::kernels::planner
