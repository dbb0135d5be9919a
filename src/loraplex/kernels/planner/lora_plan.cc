#include "loraplex/kernels/planner/lora_plan.h"

#include <algorithm>
#include <cstdint>
#include <iterator>

namespace loraplex::kernels::planner {
namespace {

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
bool is_pow2(int v) { return v > 0 && (v & (v - 1)) == 0; }
bool half_dtype(DType d) { return d == DType::kBF16 || d == DType::kF16; }
bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// The shrink and expand describe one layer that the one-launch decode paths can take: bf16 or
// f16 throughout, the same slices, slots, ranks and tokens, and the sum added to y.
bool one_half_layer(const ShrinkShape& s, const ExpandShape& e) {
  return half_dtype(s.dtype) && e.dtype == s.dtype && e.add_inputs &&
         e.num_slices == s.num_slices && e.max_rank == s.max_rank && e.max_loras == s.max_loras &&
         e.tokens == s.tokens;
}

// ---------------------------------------------------------------------------------------------
// Decode-sized layers.

// A shrink the decode paths take: 16-bit, rank a power of two from 8 to 256, aligned rows, up to
// decode_max_tokens tokens, within the metadata limits they were measured with.
bool decode_shrink_ok(const ShrinkShape& s, const LoraTuning& t) {
  using namespace decode_layer;
  if (!half_dtype(s.dtype) || !is_pow2(s.max_rank) || s.max_rank < 8) return false;
  if (s.max_rank > kStageB / 16) return false;
  if (s.hidden % 8 != 0 || s.x_row_stride % 8 != 0 || !s.x_aligned16) return false;
  if (s.tokens <= 0 || s.tokens > kMaxTokens || s.tokens > t.decode_max_tokens) return false;
  if (s.max_loras + 1 > kMaxEntries) return false;
  if (int64_t{s.num_slices} * s.max_loras > kMaxRankTable) return false;
  return s.a_aligned16;
}

// Its expand: the same slices, slots, ranks and tokens, 8-column aligned slices and rows.
bool decode_expand_ok(const ShrinkShape& s, const ExpandShape& e) {
  if (e.dtype != s.dtype || e.num_slices != s.num_slices || e.max_rank != s.max_rank ||
      e.max_loras != s.max_loras || e.tokens != s.tokens)
    return false;
  if (e.y_row_stride % 8 != 0 || e.offset_start % 8 != 0 || !e.y_aligned16) return false;
  for (int i = 0; i < e.num_slices; ++i) {
    if (e.slice_width[i] % 8 != 0) return false;
  }
  return e.b_aligned16;
}

// ---------------------------------------------------------------------------------------------
// The per-token pair.

int64_t gather_k_chunks(int64_t hidden) { return ceil_div(hidden, gather_kernel::kKChunk); }

bool gather_applies(const ShrinkShape& s, const ExpandShape& e) {
  using namespace gather_kernel;
  if (!one_half_layer(s, e)) return false;
  if (s.max_rank % 8 != 0 || s.max_rank > kMaxRank) return false;
  if (s.hidden % 8 != 0 || s.x_row_stride % 8 != 0 || !s.x_aligned16) return false;
  if (e.y_row_stride % kColsPerThread != 0 || e.offset_start % kColsPerThread != 0 || !e.y_aligned8)
    return false;
  if (!s.a_aligned16 || !e.b_aligned16) return false;
  for (int i = 0; i < s.num_slices; ++i) {
    if (e.slice_width[i] % kColsPerThread != 0) return false;
  }
  return s.tokens <= 65535;  // decode sizes: index arithmetic stays in int
}

// Tokens per shrink CTA: up to rank 16 two (pairs of a slot's tokens share their A rows) except
// at 2-16 tokens, where one token per CTA is faster now that the A rows load before the PDL
// wait (a pair straddling two slots loads theirs one after the other); above rank 16 one.
int gather_group(const LoraTuning& t, const ShrinkShape& s) {
  if (t.gather_group > 0) return t.gather_group;
  if (s.max_rank > 16) return 1;
  return s.tokens >= 2 && s.tokens <= 16 ? 1 : 2;
}

// The shrink on tensor cores where groups of tokens share a slot (groups of two, at least two
// tokens per slot that can be active, from 32 tokens); FMA otherwise, where the extra barrier
// of the tensor-core form is not paid back.
bool gather_mma(const LoraTuning& t, int group, int64_t tokens, int max_loras) {
  if (t.gather_shrink > 0) return t.gather_shrink == 2;
  return group >= 2 && tokens >= 32 && tokens >= 2 * std::min<int64_t>(tokens, max_loras);
}

// A rows per shrink CTA: 8 where the slots' A rows load after the PDL wait (above rank 16:
// their latency is on the layer's path, and half the rows halve the bytes each CTA waits for)
// and the grid of 16-row CTAs is at most two per SM; else 16.
int gather_rows(const LoraTuning& t, const ShrinkShape& s, int group, int sms) {
  using namespace gather_kernel;
  if (t.gather_rows > 0) return t.gather_rows;
  const int64_t ctas16 = ceil_div(s.tokens, group) * s.num_slices * ceil_div(s.max_rank, kRowsMax) *
                         gather_k_chunks(s.hidden);
  return s.max_rank > kPreRanks && ctas16 <= 2 * int64_t{sms} ? 8 : kRowsMax;
}

GatherPlan plan_gather(const LinearShape& shape, const LoraDevice& dev) {
  using namespace gather_kernel;
  const ShrinkShape& s = shape.shrink;
  const ExpandShape& e = shape.expand;
  const int sms = dev.limits.sm_count;
  GatherPlan g;
  g.k_chunks = static_cast<int>(gather_k_chunks(s.hidden));
  const int64_t cols_per_cta = int64_t{kThreads} * kColsPerThread;
  g.chunk_begin[0] = 0;
  for (int i = 0; i < s.num_slices; ++i) {
    g.chunk_begin[i + 1] =
        g.chunk_begin[i] + static_cast<int>(ceil_div(e.slice_width[i], cols_per_cta));
  }
  g.group = gather_group(dev.tuning, s);
  g.rows = gather_rows(dev.tuning, s, g.group, sms);
  g.mma = gather_mma(dev.tuning, g.group, s.tokens, s.max_loras);
  const int row_groups = static_cast<int>(ceil_div(s.max_rank, g.rows));
  g.shrink_grid[0] = static_cast<unsigned>(ceil_div(s.tokens, g.group));
  g.shrink_grid[1] = static_cast<unsigned>(s.num_slices * row_groups);
  g.shrink_grid[2] = static_cast<unsigned>(g.k_chunks);
  g.expand_grid[0] = static_cast<unsigned>(s.tokens);
  g.expand_grid[1] = static_cast<unsigned>(g.chunk_begin[s.num_slices]);
  const int64_t shrink_ctas =
      int64_t{g.shrink_grid[0]} * g.shrink_grid[1] * int64_t{g.shrink_grid[2]};
  // PDL for the shrink (layer_pdl 1): where its grid is under three quarters of the SMs, and at
  // any size where it reads its A rows before its wait (settled metadata, up to rank 16): a
  // larger grid waiting in-kernel held SMs the kernel before it needed.
  const bool small = 4 * shrink_ctas < 3 * int64_t{sms};
  const bool early_rows = shape.settled && s.max_rank <= kPreRanks;
  const int pdl = dev.tuning.layer_pdl;
  g.shrink_pdl = pdl == 2 || (pdl == 1 && (small || early_rows));
  // Without PDL nothing runs before the shrink's wait returns, and reading early would only
  // move its trigger later.
  g.early = shape.settled && g.shrink_pdl;
  g.launch_first = g.early;
  // The expand's early B ranks: all of them unpacked in registers up to rank 16; up to rank 64
  // staged in shared memory where every CTA of the pair can have an SM of its own (with shrink
  // CTAs on every SM, the expand CTAs' 49 KB waited for SMs the shrink had configured for less
  // shared memory); else loaded after the wait.
  const int64_t ctas = shrink_ctas + int64_t{g.expand_grid[0]} * g.expand_grid[1];
  if (s.max_rank <= kPreRanks) {
    g.mode = GatherExpandMode::kRegs;
  } else if (s.max_rank <= kStagedRanks && ctas <= sms) {
    g.mode = GatherExpandMode::kStaged;
    g.expand_smem = kStagedBytes;
  } else {
    g.mode = GatherExpandMode::kLoop;
  }
  return g;
}

// ---------------------------------------------------------------------------------------------
// The cluster layer.

// The expand's columns over the cluster: every slice gets at least one CTA, the rest go one at a
// time to the slice with the most 8-column tiles per CTA; a slice's tiles are split evenly.
void split_columns(const ExpandShape& e, ClusterPlan& sh) {
  int ctas[kMaxSlices];
  int64_t tiles[kMaxSlices];
  for (int i = 0; i < e.num_slices; ++i) {
    ctas[i] = 1;
    tiles[i] = e.slice_width[i] / 8;
  }
  for (int left = sh.cluster - e.num_slices; left > 0; --left) {
    int best = 0;
    for (int i = 1; i < e.num_slices; ++i) {
      if (ceil_div(tiles[i], ctas[i]) > ceil_div(tiles[best], ctas[best])) best = i;
    }
    ++ctas[best];
  }
  cluster_kernel::Layout& l = sh.layout;
  int c = 0;
  sh.cols_per_cta = 0;
  for (int i = 0; i < e.num_slices; ++i) {
    const int64_t per = ceil_div(tiles[i], ctas[i]);
    for (int k = 0; k < ctas[i]; ++k, ++c) {
      const int64_t first = std::min<int64_t>(tiles[i], k * per);
      const int64_t count = std::min<int64_t>(tiles[i] - first, per);
      l.cta_slice[c] = i;
      l.cta_col0[c] = static_cast<int>(first * 8);
      l.cta_cols[c] = static_cast<int>(count * 8);
      sh.cols_per_cta = std::max(sh.cols_per_cta, l.cta_cols[c]);
    }
  }
}

ClusterPlan cluster_shape(const ShrinkShape& s, const ExpandShape& e, int cluster) {
  using namespace cluster_kernel;
  ClusterPlan sh;
  sh.cluster = cluster;
  sh.k_chunk = static_cast<int>(ceil_div(ceil_div(s.hidden, cluster), 16) * 16);
  split_columns(e, sh);
  Layout& l = sh.layout;
  const int r16 = static_cast<int>(ceil_div(s.max_rank, 16) * 16);
  const int rows = s.num_slices * r16;
  l.x_pitch = sh.k_chunk + kPad;
  l.b_pitch = r16 + kPad;
  l.inter_pitch = rows + kPad;
  int off = kUnitTokens * l.x_pitch * 2;
  l.off_a = off;
  // A's rows, and after the shrink the per-warp partial sums (at most 8 parts of 16 columns,
  // or one part of all rows).
  off += std::max(rows * l.x_pitch * 2, kUnitTokens * std::max(kWarps * 16, rows) * 4);
  l.off_b = off;
  off += sh.cols_per_cta * l.b_pitch * 2;
  l.off_inter = off;
  off += kUnitTokens * l.inter_pitch * 2;
  l.off_recv = off;
  // Each CTA owns at most ceil(elements / C) + 2 partial sums, received from every CTA.
  off += static_cast<int>(ceil_div(int64_t{kUnitTokens} * rows, cluster) + 2) * cluster * 4;
  sh.smem = off;
  return sh;
}

// The cluster size: the tuning's, or the power of two that gives each CTA about kTargetKChunk
// of K; at least one CTA per slice, grown while the shared memory does not fit.
ClusterPlan choose_cluster_shape(const ShrinkShape& s, const ExpandShape& e,
                                 const LoraDevice& dev) {
  using namespace cluster_kernel;
  int c = dev.tuning.cluster_size;
  if (c == 0) {
    c = 1;
    while (c < kMaxCluster && int64_t{c} * 2 * kTargetKChunk <= s.hidden) c *= 2;
  }
  while (c < e.num_slices) c *= 2;
  ClusterPlan sh = cluster_shape(s, e, c);
  while ((sh.smem > dev.limits.smem_per_block_optin || sh.cols_per_cta > kMaxCtaCols) &&
         sh.cluster < kMaxCluster) {
    sh = cluster_shape(s, e, sh.cluster * 2);
  }
  return sh;
}

bool cluster_applies(const ShrinkShape& s, const ExpandShape& e, const LoraDevice& dev) {
  using namespace cluster_kernel;
  if (!one_half_layer(s, e)) return false;
  // Every A row of the unit is staged and each warp holds two 16-row shrink tiles: the slices'
  // ranks, each rounded up to 16, add up to 256 at most.
  if (s.max_rank % 8 != 0 || s.num_slices * ceil_div(s.max_rank, 16) * 16 > kMaxRows) return false;
  if (s.hidden % 8 != 0 || s.hidden > (1 << 30) || s.x_row_stride % 8 != 0 || !s.x_aligned16)
    return false;
  if (e.y_row_stride % 8 != 0 || e.offset_start % 8 != 0 || !e.y_aligned16) return false;
  if (!s.a_aligned16 || !e.b_aligned16) return false;
  int64_t cols = 0;
  for (int i = 0; i < s.num_slices; ++i) {
    if (e.slice_width[i] % 8 != 0) return false;
    cols += e.slice_width[i];
  }
  if (cols > (1 << 30)) return false;
  if (s.tokens > 65535) return false;  // decode sizes: index arithmetic stays in int
  const ClusterPlan sh = choose_cluster_shape(s, e, dev);
  return sh.smem <= dev.limits.smem_per_block_optin && sh.cols_per_cta <= kMaxCtaCols;
}

// Where the cluster layer runs (decode_cluster 1): where it measured faster than the other paths
// both with the layers back to back (its PDL launch overlaps the kernel before it, which the
// benchmark's graphs measure) and without PDL (as after a GEMM in a model). `rows` = the slices'
// A rows (ranks rounded to 16), `slots` = the slots that can be active:
// * 64 to 256 tokens, at least 8 per slot, rows <= 64 (at most 48 above 64 tokens); above 64
//   tokens at rank 64 the split path is faster;
// * 16 to 63 tokens above rank 16 with rows <= 64 and at most 16 clusters (tokens / 16 + slots),
//   faster than the pair with and without PDL (rank 16 at 16 tokens gains only with PDL);
// * 33 to 64 tokens with more rows (q/k/v at rank 64) and at least 16 tokens per slot, against
//   the split path.
// The margins are in docs/decisions.md ("Kernel details measured").
bool use_cluster(const LinearShape& shape, const LoraDevice& dev) {
  const ShrinkShape& s = shape.shrink;
  const int mode = dev.tuning.decode_cluster;
  const int64_t t = s.tokens;
  if (mode == 0 || t <= 0) return false;
  if (mode == 1) {
    if (t > 256) return false;
    const int64_t rows = s.num_slices * ((s.max_rank + 15) / 16 * 16);
    const int64_t slots = std::min<int64_t>(t, s.max_loras);
    bool faster = false;
    if (rows <= 64 && t >= 64 && t <= 256) {
      faster = t >= 8 * slots && (t == 64 || rows <= 48);
    } else if (rows <= 64 && t >= 16) {
      faster = s.max_rank > 16 && t / 16 + slots <= 16;
    } else if (rows > 64) {
      faster = t > 32 && t <= 64 && t >= 16 * slots;
    }
    if (!faster) return false;
  }
  return cluster_applies(s, shape.expand, dev);
}

ClusterPlan plan_cluster(const LinearShape& shape, const LoraDevice& dev) {
  const ShrinkShape& s = shape.shrink;
  ClusterPlan c = choose_cluster_shape(s, shape.expand, dev);
  // Units at most: sum over active slots of ceil(tokens / 16) <= tokens / 16 + active slots.
  const int64_t t = s.tokens;
  c.units = static_cast<int>(
      std::min<int64_t>(t, t / cluster_kernel::kUnitTokens + std::min<int64_t>(t, s.max_loras)));
  // PDL up to 64 tokens, and at any size with the early reads (settled metadata); without them
  // a larger grid waiting in-kernel measured slower at 256 tokens.
  const int pdl = dev.tuning.layer_pdl;
  c.pdl = pdl == 2 || (pdl == 1 && (t <= 64 || shape.settled));
  // Without PDL nothing runs before the wait returns: early reads would only move the next
  // layer's launch later.
  c.early = shape.settled && c.pdl;
  return c;
}

// ---------------------------------------------------------------------------------------------
// The prefill shrink.

bool prefill_cache_ranks(const ShrinkShape& s) {
  return s.num_slices * s.max_loras <= kMaxCachedRanks;
}

// Whether the wgmma form may run this shrink (prefill_mma 0 or 2, up to 256 A rows); the
// automatic choice also looks at the grid (choose_prefill).
bool wgmma_allowed(const ShrinkShape& s, const LoraTuning& t) {
  using namespace prefill_kernel;
  return t.prefill_mma != 1 && s.num_slices * s.max_rank <= kWgCols[std::size(kWgCols) - 1];
}

// The wgmma form's N for an item of a_rows A rows: the smallest instantiated width that holds it.
int wg_cols(int a_rows) {
  using namespace prefill_kernel;
  for (const int n : kWgCols) {
    if (a_rows <= n) return n;
  }
  return kWgCols[std::size(kWgCols) - 1];
}

// Floats per row of the partial tile: its a_rows (a multiple of 8) and 8 or 16 more, so that the
// pitch is 8 or 24 mod 32 and the accumulators' 8-byte stores hit 32 distinct banks.
int red_pitch(int a_rows) {
  const int pitch = a_rows + 8;
  return pitch % 16 == 0 ? pitch + 8 : pitch;
}

// Bytes a CTA keeps in flight at most (stages beyond the one being multiplied) when the ring
// depth is automatic: deeper rings measured slower, not faster. The wgmma form's 128-token
// stages take four up to 24 KB a stage, two CTAs per SM still fitting.
constexpr int kMaxInFlightBytes = 36 * 1024;
constexpr int kMaxInFlightBytesWg = 72 * 1024;

PrefillPlan make_prefill(const ShrinkShape& s, bool wg, const LoraDevice& dev) {
  using namespace prefill_kernel;
  PrefillPlan plan;
  plan.wg = wg;
  plan.m = wg ? kTileWg : kTileMma;
  plan.a_rows = s.num_slices * s.max_rank;
  plan.cols = wg ? wg_cols(plan.a_rows) : (plan.a_rows <= kSmallRows ? kSmallRows : kMaxRows) / 16;
  plan.stage_bytes = wg ? (plan.m + plan.cols) * kWgRowBytes : (plan.m + plan.a_rows) * kPitch * 2;
  plan.red_pitch = red_pitch(plan.a_rows);
  plan.cache_ranks = prefill_cache_ranks(s);
  const int red_bytes = plan.m * plan.red_pitch * 4;
  const int ints = s.max_loras + 2 + plan.m + kMaxSlices + 2 * kMaxTiles + 1 +
                   3 * (s.max_loras + 1) + (plan.cache_ranks ? s.num_slices * s.max_loras : 0);
  // Ring depth: four stages while three of them in flight stay within the byte budget, else
  // three, unless the tuning says otherwise; lowered until the shared memory fits (down to 3).
  // The wgmma form above 64 A rows (one CTA per SM, latency-bound) takes four.
  const int in_flight = wg ? kMaxInFlightBytesWg : kMaxInFlightBytes;
  const bool one_per_sm = wg && plan.a_rows > kSmallRows;
  const int auto_stages = 3 * plan.stage_bytes <= in_flight || one_per_sm ? 4 : 3;
  plan.stages = dev.tuning.prefill_stages != 0 ? dev.tuning.prefill_stages : auto_stages;
  if (wg) plan.stages = std::min(plan.stages, 4);
  const int slack = wg ? kWgAlign - 16 : 0;  // the kernel aligns its stages to 1024 bytes
  for (;; --plan.stages) {
    plan.region =
        static_cast<int>(ceil_div(std::max(plan.stages * plan.stage_bytes, red_bytes), 16) * 16);
    plan.off_rows = plan.region + static_cast<int>(ceil_div(int64_t{ints} * 4, 16) * 16);
    plan.smem = plan.off_rows + (plan.m + kMaxRows) * 8 + slack;
    if (plan.smem <= dev.limits.smem_per_block_optin || plan.stages == 3) return plan;
  }
}

// Tiles at most: one per m tokens plus each active slot's last partial tile. K is split until
// the grid has about prefill_ctas_per_sm CTAs per SM, keeping at least 512 K elements per CTA.
// The large variants (more than 64 A rows: their MMAs, not their loads, set their time) split
// only while the full tiles fill one CTA per SM. The wgmma form's tiles are twice as long, so it
// splits up to 8 by default; above 64 A rows into fewer parts, of any count, rather than a
// second wave.
void choose_grid(const ShrinkShape& s, PrefillPlan& plan, const LoraDevice& dev) {
  using namespace prefill_kernel;
  const LoraTuning& t = dev.tuning;
  const int sms = dev.limits.sm_count;
  plan.tiles = ceil_div(s.tokens, plan.m) + std::min<int64_t>(s.tokens, s.max_loras);
  const bool small = plan.a_rows <= kSmallRows;
  const int max_split = t.prefill_k_split != 0 ? t.prefill_k_split : plan.wg ? 8 : 4;
  plan.k_split = 1;
  while (plan.k_split < max_split && plan.tiles * plan.k_split < t.prefill_ctas_per_sm * sms &&
         (small || ceil_div(s.tokens, plan.m) * plan.k_split * 2 <= sms) &&
         s.hidden >= int64_t{plan.k_split} * 2 * 512) {
    plan.k_split *= 2;
  }
  const int64_t one_wave = sms - t.prefill_wave_spare_sms;
  if (plan.wg && !small && t.prefill_k_split == 0 && plan.tiles * plan.k_split > one_wave) {
    plan.k_split = static_cast<int>(std::max<int64_t>(1, one_wave / plan.tiles));
  }
}

// The form (prefill_mma 0): up to 64 A rows wgmma (faster everywhere measured); above, wgmma
// where its grid of one CTA per SM fits one wave with K split in at least three parts.
PrefillPlan choose_form(const ShrinkShape& s, const LoraDevice& dev) {
  using namespace prefill_kernel;
  PrefillPlan mma = make_prefill(s, false, dev);
  if (!wgmma_allowed(s, dev.tuning)) {
    choose_grid(s, mma, dev);
    return mma;
  }
  PrefillPlan wg = make_prefill(s, true, dev);
  choose_grid(s, wg, dev);
  if (dev.tuning.prefill_mma == 2 || wg.a_rows <= kSmallRows) return wg;
  const int64_t one_wave = dev.limits.sm_count - dev.tuning.prefill_wave_spare_sms;
  if (wg.tiles * wg.k_split <= one_wave && wg.k_split >= 3) return wg;
  choose_grid(s, mma, dev);
  return mma;
}

bool prefill_applies(const ShrinkShape& s, const LoraDevice& dev) {
  using namespace prefill_kernel;
  if (!half_dtype(s.dtype) || s.max_rank % 8 != 0 || s.num_slices * s.max_rank > kMaxRows) {
    return false;
  }
  if (s.hidden % 8 != 0 || s.x_row_stride % 8 != 0 || !s.x_aligned16) return false;
  if (!s.a_aligned16) return false;
  const int limit = dev.limits.smem_per_block_optin;
  return make_prefill(s, false, dev).smem <= limit &&
         (!wgmma_allowed(s, dev.tuning) || make_prefill(s, true, dev).smem <= limit);
}

PrefillPlan plan_prefill(const ShrinkShape& s, const LoraDevice& dev, bool expand_follows) {
  using namespace prefill_kernel;
  PrefillPlan p = choose_form(s, dev);
  p.expand_follows = expand_follows;
  p.k_chunk = static_cast<int>(ceil_div(ceil_div(s.hidden, p.k_split), kBK) * kBK);
  // The split-K parts meet in a cluster's shared memory, or in global memory when the small
  // variant's grid bound brings more than one CTA per SM (clusters of 4 could not use every SM:
  // some ran 3 CTAs, or a second wave ran). With fewer, and for the large variant, the cluster
  // reduction (no fence, counter or L2 round trips) measured faster.
  const LoraTuning& t = dev.tuning;
  const bool small = p.a_rows <= kSmallRows;
  const bool many = small && p.tiles * p.k_split > dev.limits.sm_count;
  p.global_reduce = (t.prefill_reduce == 2 || (t.prefill_reduce == 0 && many)) && p.k_split > 1;
  // The parts summed by a second kernel for the wgmma form from 2048 tokens, where full 128-row
  // tiles made the last CTA's sum of every part a long tail; below, its launch cost more than
  // it saved.
  p.defer_sum = p.global_reduce && s.max_loras <= kMaxLorasForSum &&
                (t.prefill_sum == 2 || (t.prefill_sum == 0 && p.wg && s.tokens >= 2048));
  p.sum_grid = static_cast<unsigned>(p.tiles * (p.m / kSumRows));
  return p;
}

// ---------------------------------------------------------------------------------------------
// Expands.

bool pipelined_applies(const ExpandShape& a) {
  if (!half_dtype(a.dtype) || a.max_rank % 8 != 0 || a.max_rank > expand_kernel::kPipelinedMaxRank)
    return false;
  if (a.y_row_stride % 8 != 0 || a.offset_start % 8 != 0 || !a.y_aligned16 || !a.in_aligned16)
    return false;
  for (int s = 0; s < a.num_slices; ++s) {
    if (a.slice_width[s] % 8 != 0) return false;
  }
  return a.b_aligned16;
}

bool tensor_core_expand_applies(const ExpandShape& a) {
  if (!half_dtype(a.dtype) || a.max_rank % 8 != 0 || a.y_row_stride % 8 != 0 ||
      a.offset_start % 8 != 0 || !a.y_aligned16 || !a.in_aligned16)
    return false;
  for (int s = 0; s < a.num_slices; ++s) {
    if (a.slice_width[s] % 8 != 0) return false;
  }
  return a.b_aligned16;
}

int table_bytes(const ExpandShape& a, const ExpandPlan& p) {
  return (a.max_loras + 2) * 4 + 3 * (a.max_loras + 1) * 4 +
         (p.cache_ranks ? a.num_slices * a.max_loras * 4 : 0) +
         (p.cache_sorted ? static_cast<int>(a.tokens) * 4 + 12 : 0);
}

}  // namespace

// ---------------------------------------------------------------------------------------------

ShrinkShape shrink_shape(const ShrinkArgs& a) {
  ShrinkShape s;
  s.dtype = a.dtype;
  s.out_dtype = a.out_dtype;
  s.tokens = a.num_tokens;
  s.hidden = a.hidden;
  s.x_row_stride = a.x_row_stride;
  s.num_slices = a.num_slices;
  s.max_loras = a.max_loras;
  s.max_rank = a.max_rank;
  s.x_aligned16 = aligned16(a.x);
  for (int i = 0; i < a.num_slices && i < kMaxSlices; ++i) {
    s.a_aligned16 = s.a_aligned16 && aligned16(a.lora_a[i]);
  }
  return s;
}

ExpandShape expand_shape(const ExpandArgs& a) {
  ExpandShape e;
  e.dtype = a.dtype;
  e.in_dtype = a.in_dtype;
  e.tokens = a.num_tokens;
  e.num_slices = a.num_slices;
  for (int i = 0; i < a.num_slices && i < kMaxSlices; ++i) {
    e.slice_width[i] = a.slice_width[i];
    e.b_aligned16 = e.b_aligned16 && aligned16(a.lora_b[i]);
  }
  e.max_loras = a.max_loras;
  e.max_rank = a.max_rank;
  e.y_row_stride = a.y_row_stride;
  e.offset_start = a.offset_start;
  e.add_inputs = a.add_inputs;
  e.y_aligned16 = aligned16(a.y);
  e.y_aligned8 = (reinterpret_cast<uintptr_t>(a.y) & 7u) == 0;
  e.in_aligned16 = aligned16(a.in);
  return e;
}

LinearShape linear_shape(const ShrinkArgs& shrink, const ExpandArgs& expand,
                         const LoraMetaView& meta) {
  return {shrink_shape(shrink), expand_shape(expand), meta.settled};
}

const char* path_name(LinearPath path) {
  switch (path) {
    case LinearPath::kCluster:
      return "cluster";
    case LinearPath::kGather:
      return "gather";
    case LinearPath::kSplit:
      return "split";
    case LinearPath::kGeneric:
      return "generic";
  }
  return "?";
}

ShrinkPlan plan_lora_shrink(const ShrinkShape& s, const LoraDevice& dev, bool expand_follows) {
  ShrinkPlan p;
  if (prefill_applies(s, dev)) {
    p.kernel = ShrinkKernel::kPrefill;
    p.prefill = plan_prefill(s, dev, expand_follows);
  } else {
    p.kernel = ShrinkKernel::kGeneric;
    p.generic_grid[0] = static_cast<unsigned>(s.tokens);
    p.generic_grid[1] = static_cast<unsigned>(s.num_slices);
  }
  return p;
}

Workspace shrink_workspace(const ShrinkPlan& p, const ShrinkShape& s) {
  if (p.kernel == ShrinkKernel::kPrefill && p.prefill.global_reduce) {
    return {int64_t{p.prefill.k_split} * s.tokens * p.prefill.a_rows, p.prefill.tiles};
  }
  return {};
}

ExpandPlan plan_lora_expand(const ExpandShape& a, const LoraDevice& dev, bool after_prefill) {
  using namespace expand_kernel;
  ExpandPlan p;
  const int sms = dev.limits.sm_count;
  p.ntile_begin[0] = 0;
  for (int s = 0; s < a.num_slices; ++s) {
    p.ntile_begin[s + 1] =
        p.ntile_begin[s] + static_cast<int>(ceil_div(a.slice_width[s], kTileCols));
  }
  const int64_t tiles =
      ceil_div(a.tokens, int64_t{kTileRows}) + std::min<int64_t>(a.tokens, a.max_loras);
  p.items = tiles * p.ntile_begin[a.num_slices];
  p.cache_ranks = a.num_slices * a.max_loras <= kMaxCachedRanks;
  const int knob = dev.tuning.expand_ctas_per_sm;
  if (pipelined_applies(a)) {
    // Up to rank 16 five CTAs fit beside each other and are faster where each gets two items or
    // more; with fewer items per CTA four were as fast or faster.
    p.kernel = ExpandKernel::kPipelined;
    p.pdl = after_prefill;
    p.cache_sorted = false;  // the token indices are loaded an item ahead
    p.balanced = true;
    const bool small = a.max_rank <= 16;
    p.steps = small ? 1 : 4;
    const int per_sm = knob > 0 ? knob : small && p.items >= 10 * int64_t{sms} ? 5 : 4;
    p.grid = static_cast<unsigned>(std::min<int64_t>(p.items, int64_t{per_sm} * sms));
    p.smem = pipelined_fixed_bytes(p.steps) + table_bytes(a, p);
  } else if (tensor_core_expand_applies(a)) {
    p.kernel = ExpandKernel::kTensorCore;
    p.cache_sorted = a.tokens <= kCachedTokens;
    const int per_sm = knob > 0 ? knob : 4;
    p.grid = static_cast<unsigned>(std::min<int64_t>(p.items, int64_t{per_sm} * sms));
    p.smem = tc_fixed_bytes() + table_bytes(a, p);
  } else {
    p.kernel = ExpandKernel::kGeneric;
    int64_t total = 0;
    for (int s = 0; s < a.num_slices; ++s) total += a.slice_width[s];
    p.generic_col_blocks = ceil_div(total, kGenericThreads);
  }
  return p;
}

LinearPlan plan_lora_linear(const LinearShape& shape, const LoraDevice& dev) {
  const ShrinkShape& s = shape.shrink;
  const ExpandShape& e = shape.expand;
  LinearPlan p;
  if (use_cluster(shape, dev)) {
    p.path = LinearPath::kCluster;
    p.cluster = plan_cluster(shape, dev);
    return p;
  }
  // The pair while tokens x max_rank is small: it reads each token's A rows once per token,
  // with no grouping by slot, and the split kernels win above (bench kernels' path comparison).
  if (decode_shrink_ok(s, dev.tuning) && decode_expand_ok(s, e) &&
      s.tokens * s.max_rank <= dev.tuning.gather_max_token_ranks && gather_applies(s, e)) {
    p.path = LinearPath::kGather;
    p.gather = plan_gather(shape, dev);
    p.workspace = {int64_t{p.gather.k_chunks} * s.num_slices * s.tokens * s.max_rank, 0};
    return p;
  }
  p.path = half_dtype(s.dtype) ? LinearPath::kSplit : LinearPath::kGeneric;
  // The expand under PDL right after the prefill shrink: its first y and B tiles load while the
  // shrink finishes.
  const bool pdl = pipelined_applies(e);
  p.shrink = plan_lora_shrink(s, dev, pdl);
  p.expand = plan_lora_expand(e, dev, pdl && p.shrink.kernel == ShrinkKernel::kPrefill);
  p.workspace = shrink_workspace(p.shrink, s);
  return p;
}

int64_t lora_scratch_floats(int64_t n, const LoraTuning& t) {
  // The pair: tokens up to decode_max_tokens (and 2048), ceil(K / 1024) chunks (64 at
  // K = 65536) x 8 slices x tokens x max_rank, with tokens x max_rank at most
  // gather_max_token_ranks.
  const int64_t td = std::min<int64_t>({n, t.decode_max_tokens, decode_layer::kMaxTokens});
  const int64_t gather =
      64 * int64_t{kMaxSlices} * std::min<int64_t>(256 * td, t.gather_max_token_ranks);
  const int64_t rows =
      t.prefill_reduce == 2 ? prefill_kernel::kMaxRows : prefill_kernel::kSmallRows;
  const int64_t prefill = int64_t{prefill_kernel::kMaxParts} * rows * n;
  return std::max(gather, prefill);
}

int64_t lora_counters(int64_t n, int max_loras) {
  return std::max<int64_t>((int64_t{max_loras} + 1) * kMaxSlices, (n + 63) / 64 + max_loras + 1);
}

}  // namespace loraplex::kernels::planner
