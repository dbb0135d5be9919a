#pragma once
// Helpers shared by the layer implementations: tensor-parallel geometry, adapter validation
// and host-side slicing of full weights. Not part of the public layer API.

#include <cstdint>
#include <string>
#include <vector>

#include "loraplex/core/stream.h"
#include "loraplex/core/tensor.h"
#include "loraplex/dist/communicator.h"
#include "loraplex/layers/lora_layer.h"

namespace loraplex::layers_detail {

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline int comm_size(const Communicator* comm) { return comm == nullptr ? 1 : comm->size(); }
inline int comm_rank(const Communicator* comm) { return comm == nullptr ? 0 : comm->rank(); }

/// The part of a `size`-wide output that tensor-parallel rank `rank` of `tp` holds when it is
/// split by `units` indivisible units (attention heads; `size` itself for plain columns).
/// With fewer units than ranks each unit is replicated on tp / units ranks (KV heads).
struct Shard {
  int64_t start = 0;  // first column in the full output
  int64_t size = 0;   // columns held
  int groups = 1;     // distinct shards (min(tp, units))
  int index = 0;      // which of them this rank holds
};
Shard shard_of(int64_t size, int64_t units, int tp, int rank, const std::string& what);

/// Validates one adapter slice: both tensors defined or both undefined, 2-D, on the CPU,
/// floating; a [rank, in], b [out, rank], 1 <= rank <= max_rank. Returns the rank (0 when
/// undefined). Messages start with `where`.
int check_lora_pair(const LoraSliceWeights& w, int64_t in, int64_t out, int max_rank,
                    const std::string& where);

/// A base weight a layer on `device` in `dtype` can load: any float CPU tensor, or `dtype` on
/// `device` itself (random weights made on the GPU).
inline bool is_weight_source(const Tensor& t, Device device, DType dtype) {
  return t.defined() && ((t.device().is_cpu() && is_floating(t.dtype())) ||
                         (t.device() == device && t.dtype() == dtype));
}

/// Rows [r0, r0 + nr) and columns [c0, c0 + nc) of a 2-D CPU tensor as a new contiguous CPU
/// tensor in `dtype`.
Tensor host_block(const Tensor& t, int64_t r0, int64_t nr, int64_t c0, int64_t nc, DType dtype);
/// True when a GPU can upload the CPU tensor `t` as it is, without waiting or staging: pinned,
/// already in `dtype`, 2-D with contiguous rows.
bool uploadable(const Tensor& t, DType dtype);
/// The same block as a view of `t` itself when uploadable, else host_block's copy.
Tensor source_block(const Tensor& t, int64_t r0, int64_t nr, int64_t c0, int64_t nc, DType dtype);

/// The same block in float8_e4m3 with one float32 scale per row (amax / 448, 1 for a row of
/// zeros; kernels/fp8_quant.h's rule): codes [nr, nc] and scales [nr], new CPU tensors.
struct Fp8Block {
  Tensor codes;
  Tensor scales;
};
Fp8Block fp8_block(const Tensor& t, int64_t r0, int64_t nr, int64_t c0, int64_t nc);

/// A device write prepared by set_lora before anything is modified: dst (a view of a layer
/// stack) <- src (a CPU tensor of the same shape and dtype with contiguous rows), or dst <- 0
/// when src is undefined.
struct PendingWrite {
  Tensor dst;
  Tensor src;
};
/// Enqueues the writes on `stream` in order. Pinned sources are copied without waiting (the
/// caller keeps them alive until `stream` has passed the copies); a pageable source makes the
/// host wait for its copy (Tensor::copy_from).
void apply_writes(const std::vector<PendingWrite>& writes, const Stream& stream);

/// t[0] = value for an int32 [1] view of a layer table, in `stream` order without a host wait
/// (see SlotRanks).
void write_int32(Tensor& t, int32_t value, const Stream& stream);

/// Throws unless `stream` can carry uploads to a layer on `device` (`layer` names it).
void check_copy_stream(const Stream& stream, Device device, const std::string& layer);

/// The first `numel` elements of a flat workspace, viewed as `shape`.
Tensor workspace_view(const Tensor& flat, const Shape& shape);

/// A rank-cyclic shard of A for fully sharded column layers: this rank holds rows
/// k = j * tp + rank for j < ceil(rank_r / tp), zero rows where k >= rank_r. After an all-gather
/// that interleaves the ranks' columns (see LoraLinear), column k of the gathered intermediate
/// is exactly x . A[k], so B needs no permutation and the valid columns form a prefix.
Tensor cyclic_rank_rows(const Tensor& a_converted, int tp, int rank);

void check_activation(const Tensor& t, Device device, DType dtype, const char* layer,
                      const char* name);

}  // namespace loraplex::layers_detail
