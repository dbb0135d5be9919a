#include "loraplex/model/paged_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "loraplex/core/allocator.h"
#include "loraplex/core/cuda_runtime.h"
#include "loraplex/core/error.h"

namespace loraplex::model {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

void use_device(Device device) {
  if (device.is_cuda() && cuda_rt::current_device() != device.index) {
    cuda_rt::set_device(device.index);
  }
}

flashinfer::Geometry geometry_of(const AttentionShape& s) {
  return flashinfer::Geometry{s.num_heads, s.num_kv_heads, s.head_dim, s.block_size, s.dtype};
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

PagedAttention::PagedAttention(AttentionShape shape, Device device, int64_t max_num_tokens,
                               int64_t max_num_seqs, int64_t max_pages_per_step)
    : shape_(shape),
      device_(device),
      max_num_tokens_(max_num_tokens),
      max_num_seqs_(max_num_seqs),
      max_pages_per_step_(max_pages_per_step) {
  LORAPLEX_CHECK(
      shape.num_heads >= 1 && shape.num_kv_heads >= 1 && shape.num_heads % shape.num_kv_heads == 0,
      "PagedAttention: ", shape.num_heads, " heads and ", shape.num_kv_heads,
      " kv heads, expected kv heads >= 1 dividing heads");
  LORAPLEX_CHECK(shape.head_dim >= 2 && shape.head_dim <= 1024, "PagedAttention: head_dim ",
                 shape.head_dim, ", expected 2..1024");
  LORAPLEX_CHECK(shape.block_size >= 1, "PagedAttention: block_size ", shape.block_size,
                 ", expected >= 1");
  LORAPLEX_CHECK(
      shape.dtype == DType::kF32 || shape.dtype == DType::kF16 || shape.dtype == DType::kBF16,
      "PagedAttention: dtype ", shape.dtype, ", expected float32, float16 or bfloat16");
  LORAPLEX_CHECK(max_num_tokens >= 1 && max_num_seqs >= 1 && max_pages_per_step >= 1,
                 "PagedAttention: limits (tokens ", max_num_tokens, ", sequences ", max_num_seqs,
                 ", pages ", max_pages_per_step, ") must be >= 1");
  LORAPLEX_CHECK(
      max_num_tokens <= kInt32Max / 2 && max_num_seqs <= kInt32Max / 4 &&
          max_pages_per_step <= kInt32Max / 2 && max_pages_per_step * shape.block_size <= kInt32Max,
      "PagedAttention: limits (tokens ", max_num_tokens, ", sequences ", max_num_seqs, ", pages ",
      max_pages_per_step, " of ", shape.block_size, " tokens) exceed 32-bit indexing");
  LORAPLEX_CHECK(device.is_cpu() || device.is_cuda(), "PagedAttention: device ", device);
  scale_ = 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
  flashinfer_ = device.is_cuda() && flashinfer::supports(shape.dtype, shape.head_dim);
  graph_plans_.resize(static_cast<size_t>(max_num_seqs + 1));
  graph_planned_.assign(static_cast<size_t>(max_num_seqs + 1), 0);

  const int64_t s = max_num_seqs;
  const int64_t array_ints =
      flashinfer_ ? 3 * s + 2 + max_pages_per_step : fallback_ints(max_pages_per_step);
  if (device.is_cpu()) {
    host_arrays_.assign(static_cast<size_t>(array_ints), 0);
    return;
  }
  use_device(device);
  step_arrays_ = Tensor::empty({array_ints}, DType::kI32, device);
  if (flashinfer_) {
    flashinfer::WorkspaceBytes ws;
    throw_if_error(flashinfer::workspace_bytes(geometry_of(shape), max_num_tokens, max_num_seqs,
                                               device.index, &ws));
    float_workspace_ = Tensor::empty({ceil_div(ws.float_bytes, 4)}, DType::kF32, device);
    int_workspace_ = Tensor::empty({ceil_div(ws.int_bytes, 4)}, DType::kI32, device);
    int_workspace_bytes_ = ws.int_bytes;
    int_staging_bytes_ = ceil_div(ws.int_bytes, 64) * 64;
  }
  for (int i = 0; i < kStagingSlots; ++i) {
    staging_.push_back(Tensor::empty_with({int_staging_bytes_ / 4 + array_ints}, DType::kI32,
                                          Device::cpu(), pinned_host_allocator()));
    staging_done_.push_back(std::make_unique<Event>());
  }
  staging_used_.assign(kStagingSlots, 0);
}

PagedAttention::~PagedAttention() = default;

int64_t PagedAttention::fallback_ints(int64_t num_pages) const {
  return 2 * max_num_tokens_ + max_num_seqs_ + 1 + num_pages;
}

void PagedAttention::validate(const AttentionStep& step, int64_t graph_batch) const {
  const int64_t n = static_cast<int64_t>(step.kv_len.size());
  LORAPLEX_CHECK(n <= max_num_seqs_, "PagedAttention: the step has ", n,
                 " sequences, more than max_num_seqs ", max_num_seqs_, " given at construction");
  LORAPLEX_CHECK(static_cast<int64_t>(step.qo_indptr.size()) == n + 1 &&
                     static_cast<int64_t>(step.page_indptr.size()) == n + 1,
                 "PagedAttention: qo_indptr has ", step.qo_indptr.size(), " and page_indptr ",
                 step.page_indptr.size(), " entries for ", n, " sequences, expected ", n + 1);
  LORAPLEX_CHECK(step.qo_indptr[0] == 0 && step.page_indptr[0] == 0,
                 "PagedAttention: qo_indptr[0] ", step.qo_indptr[0], " and page_indptr[0] ",
                 step.page_indptr[0], ", expected 0");
  const int64_t bs = shape_.block_size;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t qo_len = static_cast<int64_t>(step.qo_indptr[i + 1]) - step.qo_indptr[i];
    const int64_t kv_len = step.kv_len[i];
    const int64_t pages = static_cast<int64_t>(step.page_indptr[i + 1]) - step.page_indptr[i];
    LORAPLEX_CHECK(qo_len >= 1, "PagedAttention: sequence ", i, " has qo_len ", qo_len,
                   " (qo_indptr ", step.qo_indptr[i], " to ", step.qo_indptr[i + 1],
                   "), expected >= 1");
    LORAPLEX_CHECK(kv_len >= qo_len, "PagedAttention: sequence ", i, " has kv_len ", kv_len,
                   ", shorter than its qo_len ", qo_len,
                   " (its new tokens are part of its context)");
    LORAPLEX_CHECK(pages == ceil_div(kv_len, bs), "PagedAttention: sequence ", i, " has ", pages,
                   " pages for kv_len ", kv_len, ", expected ceil(", kv_len, " / ", bs,
                   ") = ", ceil_div(kv_len, bs));
    LORAPLEX_CHECK(graph_batch == 0 || qo_len == 1, "PagedAttention: sequence ", i, " has qo_len ",
                   qo_len, " in a graph_batch step, expected 1 (pure decode)");
  }
  const int64_t tokens = step.qo_indptr[static_cast<size_t>(n)];
  const int64_t pages = step.page_indptr[static_cast<size_t>(n)];
  LORAPLEX_CHECK(tokens <= max_num_tokens_, "PagedAttention: the step has ", tokens,
                 " tokens, more than max_num_tokens ", max_num_tokens_, " given at construction");
  LORAPLEX_CHECK(pages <= max_pages_per_step_, "PagedAttention: the step has ", pages,
                 " pages, more than max_pages_per_step ", max_pages_per_step_,
                 " given at construction");
  LORAPLEX_CHECK(static_cast<int64_t>(step.page_indices.size()) == pages,
                 "PagedAttention: page_indices has ", step.page_indices.size(),
                 " entries, page_indptr says ", pages);
  // An eager step's run() checks its blocks against the cache it is given; a graph replay
  // runs without run(), so a graph step's blocks must lie in the cache run() last saw.
  const int64_t limit = graph_batch > 0 && cache_blocks_seen_ > 0 ? cache_blocks_seen_ : kInt32Max;
  for (int64_t i = 0; i < n; ++i) {
    for (int32_t p = step.page_indptr[i]; p < step.page_indptr[i + 1]; ++p) {
      const int32_t block = step.page_indices[static_cast<size_t>(p)];
      LORAPLEX_CHECK(block >= 0 && block < limit, "PagedAttention: sequence ", i, " page ",
                     p - step.page_indptr[i], " is block ", block, ", expected 0..", limit - 1,
                     limit < kInt32Max ? " (the cache run() last saw)" : "");
    }
  }
  LORAPLEX_CHECK(graph_batch >= 0 && graph_batch <= max_num_seqs_, "PagedAttention: graph_batch ",
                 graph_batch, ", expected 0..", max_num_seqs_);
  LORAPLEX_CHECK(graph_batch == 0 || n == graph_batch, "PagedAttention: a graph_batch ",
                 graph_batch, " step has ", n, " sequences (pad it with dummy sequences)");
}

void PagedAttention::fill_fallback_arrays(const AttentionStep& step, int32_t* dst) const {
  const int64_t n = static_cast<int64_t>(step.kv_len.size());
  int32_t* positions = dst;
  int32_t* token_seq = dst + max_num_tokens_;
  int32_t* page_indptr = dst + 2 * max_num_tokens_;
  int32_t* page_indices = page_indptr + max_num_seqs_ + 1;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t first = step.kv_len[i] - (step.qo_indptr[i + 1] - step.qo_indptr[i]);
    for (int32_t r = step.qo_indptr[i]; r < step.qo_indptr[i + 1]; ++r) {
      positions[r] = first + (r - step.qo_indptr[i]);
      token_seq[r] = static_cast<int32_t>(i);
    }
  }
  std::copy(step.page_indptr.begin(), step.page_indptr.end(), page_indptr);
  std::copy(step.page_indices.begin(), step.page_indices.end(), page_indices);
}

int32_t* PagedAttention::acquire_staging() {
  // The slot's last upload was enqueued kStagingSlots plans ago; in steady state (a step
  // reads its sampled tokens back before the next plan) it has long finished.
  if (staging_used_[next_slot_]) staging_done_[next_slot_]->synchronize();
  return staging_[next_slot_].data<int32_t>();
}

void PagedAttention::release_staging(const Stream& stream) {
  staging_done_[next_slot_]->record(stream);
  staging_used_[next_slot_] = 1;
  next_slot_ = (next_slot_ + 1) % kStagingSlots;
}

void PagedAttention::plan(const AttentionStep& step, const Stream& stream, int64_t graph_batch) {
  LORAPLEX_CHECK(stream.device() == device_, "PagedAttention on ", device_,
                 " planned on a stream of ", stream.device());
  planned_ = false;
  validate(step, graph_batch);
  const int64_t n = static_cast<int64_t>(step.kv_len.size());
  num_seqs_ = n;
  num_tokens_ = step.qo_indptr.back();
  max_kv_len_ = n > 0 ? *std::max_element(step.kv_len.begin(), step.kv_len.end()) : 0;
  max_page_ = step.page_indices.empty()
                  ? -1
                  : *std::max_element(step.page_indices.begin(), step.page_indices.end());
  const int64_t num_pages = static_cast<int64_t>(step.page_indices.size());

  if (device_.is_cpu()) {
    fill_fallback_arrays(step, host_arrays_.data());
    planned_ = true;
    return;
  }
  use_device(device_);
  if (!flashinfer_) {
    int32_t* slot = acquire_staging();
    fill_fallback_arrays(step, slot);
    cuda_rt::memcpy_async(step_arrays_.data_ptr(), slot,
                          static_cast<size_t>(fallback_ints(num_pages)) * 4,
                          cuda_rt::CopyKind::kHostToDevice, stream.handle());
    release_staging(stream);
    planned_ = true;
    return;
  }

  const int64_t s = max_num_seqs_;
  int32_t* slot = acquire_staging();
  int32_t* arrays = slot + int_staging_bytes_ / 4;
  int32_t* qo_indptr = arrays;
  int32_t* page_indptr = arrays + s + 1;
  int32_t* last_page_len = arrays + 2 * s + 2;
  int32_t* page_indices = arrays + 3 * s + 2;
  std::copy(step.qo_indptr.begin(), step.qo_indptr.end(), qo_indptr);
  std::copy(step.page_indptr.begin(), step.page_indptr.end(), page_indptr);
  for (int64_t i = 0; i < n; ++i) {
    const int32_t pages = step.page_indptr[i + 1] - step.page_indptr[i];
    last_page_len[i] = step.kv_len[i] - (pages - 1) * static_cast<int32_t>(shape_.block_size);
  }
  std::copy(step.page_indices.begin(), step.page_indices.end(), page_indices);
  flashinfer::PlanInfo info{};
  if (n > 0) {
    flashinfer::PlanArgs pa;
    pa.geometry = geometry_of(shape_);
    pa.num_seqs = n;
    pa.num_tokens = num_tokens_;
    pa.qo_indptr = qo_indptr;
    pa.page_indptr = page_indptr;
    pa.cuda_graph = graph_batch > 0;
    pa.float_workspace = float_workspace_.data_ptr();
    pa.float_bytes = float_workspace_.nbytes();
    pa.int_workspace = int_workspace_.data_ptr();
    pa.int_bytes = int_workspace_bytes_;
    pa.int_staging = slot;
    throw_if_error(flashinfer::plan(pa, stream, &info));
  }
  cuda_rt::memcpy_async(step_arrays_.data_ptr(), arrays,
                        static_cast<size_t>(3 * s + 2 + num_pages) * 4,
                        cuda_rt::CopyKind::kHostToDevice, stream.handle());
  release_staging(stream);
  if (graph_batch > 0) {
    const auto b = static_cast<size_t>(graph_batch);
    if (!graph_planned_[b]) {
      graph_plans_[b] = info;
      graph_planned_[b] = 1;
    }
    // FlashInfer's graph plan depends on the batch size alone; a difference would make a
    // captured graph replay launch parameters that no longer fit the step.
    LORAPLEX_CHECK(graph_plans_[b] == info, "PagedAttention: the plan of a graph_batch ",
                   graph_batch, " step differs from the first plan of that size");
  }
  plan_info_ = info;
  planned_ = true;
}

void PagedAttention::run(const void* qkv, int64_t qkv_row_stride, const ops::KvCacheView& cache,
                         void* out, const Stream& stream) const {
  LORAPLEX_CHECK(planned_, "PagedAttention::run without a successful plan()");
  LORAPLEX_CHECK(stream.device() == device_, "PagedAttention on ", device_, " run on a stream of ",
                 stream.device());
  LORAPLEX_CHECK(cache.block_size == shape_.block_size &&
                     cache.num_kv_heads == shape_.num_kv_heads &&
                     cache.head_dim == shape_.head_dim && cache.k != nullptr && cache.v != nullptr,
                 "PagedAttention: cache of block size ", cache.block_size, ", ", cache.num_kv_heads,
                 " kv heads of dim ", cache.head_dim, ", expected ", shape_.block_size, ", ",
                 shape_.num_kv_heads, " and ", shape_.head_dim);
  LORAPLEX_CHECK(max_page_ < cache.num_blocks, "PagedAttention: the planned step uses block ",
                 max_page_, ", outside the cache's ", cache.num_blocks, " blocks");
  LORAPLEX_CHECK(qkv_row_stride >= shape_.num_heads * shape_.head_dim,
                 "PagedAttention: qkv row stride ", qkv_row_stride,
                 ", expected >= ", shape_.num_heads * shape_.head_dim);
  cache_blocks_seen_ = cache.num_blocks;
  if (num_tokens_ == 0) return;
  use_device(device_);

  if (flashinfer_) {
    const int64_t s = max_num_seqs_;
    const int32_t* arrays = step_arrays_.data<int32_t>();
    flashinfer::RunArgs ra;
    ra.geometry = geometry_of(shape_);
    ra.info = plan_info_;
    ra.num_seqs = num_seqs_;
    ra.scale = scale_;
    ra.q = qkv;
    ra.q_row_stride = qkv_row_stride;
    ra.k_cache = cache.k;
    ra.v_cache = cache.v;
    ra.qo_indptr = arrays;
    ra.page_indptr = arrays + s + 1;
    ra.last_page_len = arrays + 2 * s + 2;
    ra.page_indices = arrays + 3 * s + 2;
    ra.float_workspace = float_workspace_.data_ptr();
    ra.int_workspace = int_workspace_.data_ptr();
    ra.out = out;
    throw_if_error(flashinfer::run(ra, stream));
    return;
  }

  const int32_t* arrays = device_.is_cpu() ? host_arrays_.data() : step_arrays_.data<int32_t>();
  ops::PagedAttentionArgs a;
  a.dtype = shape_.dtype;
  a.num_tokens = num_tokens_;
  a.num_heads = shape_.num_heads;
  a.scale = scale_;
  a.qkv = qkv;
  a.qkv_row_stride = qkv_row_stride;
  a.positions = arrays;
  a.token_seq = arrays + max_num_tokens_;
  a.block_table_indptr = arrays + 2 * max_num_tokens_;
  a.block_tables = arrays + 2 * max_num_tokens_ + max_num_seqs_ + 1;
  a.num_seqs = num_seqs_;
  a.cache = cache;
  a.out = out;
  if (device_.is_cpu()) {
    // The CPU sizes its scratch by max_context: the step's own longest context.
    a.max_blocks_per_seq = ceil_div(max_kv_len_, shape_.block_size);
    a.max_context = max_kv_len_;
    throw_if_error(ops::cpu::paged_attention(a));
  } else {
    // Fixed bounds (the kernel only checks against them), so a captured launch stays valid.
    a.max_blocks_per_seq = max_pages_per_step_;
    a.max_context = max_pages_per_step_ * shape_.block_size;
    throw_if_error(ops::cuda::paged_attention(a, stream));
  }
}

}  // namespace loraplex::model
