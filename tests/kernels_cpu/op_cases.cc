#include "kernels_cpu/op_cases.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <sstream>

#include "loraplex/core/error.h"
#include "loraplex/kernels/cpu/lora_ops_cpu.h"
#include "loraplex/kernels/cuda/lora_ops_cuda.h"
#include "loraplex/kernels/dispatch/route.h"
#include "loraplex/punica/batch_meta.h"
#include "loraplex/punica/lora_dispatch.h"
#include "loraplex/punica/punica_wrapper.h"

namespace loraplex::test {
namespace {

using SD = SlotDistribution;
constexpr DType kF32 = DType::kF32;
constexpr DType kF16 = DType::kF16;
constexpr DType kBF16 = DType::kBF16;
constexpr double kEps32 = 1.0 / (1 << 24);

// FNV-1a: a seed that depends on the case name only (stable across compilers, unlike
// std::hash), so a failing case reproduces anywhere.
uint64_t seed_of(const std::string& name) {
  uint64_t h = 1469598103934665603ull;
  for (char ch : name) {
    h ^= static_cast<unsigned char>(ch);
    h *= 1099511628211ull;
  }
  return h;
}

std::string short_dtype(DType d) {
  switch (d) {
    case DType::kF32:
      return "f32";
    case DType::kF16:
      return "f16";
    case DType::kBF16:
      return "bf16";
    case DType::kF8E4M3:
      return "e4m3";
    case DType::kF8E5M2:
      return "e5m2";
    default:
      return std::string(dtype_name(d));
  }
}

// Names are built with streams: GCC 12 reports a false -Wrestrict on chained
// std::string concatenation at -O3.
std::string rank_name(int rank, int max_rank) {
  std::ostringstream os;
  if (rank == 0) {
    os << "rmixed" << max_rank;
  } else {
    os << "r" << rank;
    if (rank != max_rank) os << "of" << max_rank;
  }
  return os.str();
}

std::string widths_name(const std::vector<int64_t>& widths) {
  std::ostringstream os;
  os << "w";
  for (size_t i = 0; i < widths.size(); ++i) os << (i ? "x" : "") << widths[i];
  return os.str();
}

std::string none_name(double fraction) {
  std::ostringstream os;
  if (fraction > 0) os << "_none" << static_cast<int>(fraction * 100 + 0.5);
  return os.str();
}

// Ranks [num_slices, max_loras]: all `rank`, or mixed: random in 0..max_rank with, per slice,
// one slot at max_rank and (with 4+ slots) one at 0 and one at 1.
std::vector<int32_t> make_ranks(int num_slices, int max_loras, int max_rank, int rank,
                                std::mt19937_64& rng) {
  std::vector<int32_t> ranks(static_cast<size_t>(num_slices) * max_loras, rank);
  if (rank != 0) return ranks;
  std::uniform_int_distribution<int32_t> any(0, max_rank);
  for (int s = 0; s < num_slices; ++s) {
    int32_t* row = ranks.data() + s * max_loras;
    for (int k = 0; k < max_loras; ++k) row[k] = any(rng);
    row[s % max_loras] = max_rank;
    if (max_loras >= 4) {
      row[(s + 1) % max_loras] = 0;
      row[(s + 2) % max_loras] = 1;
    }
  }
  return ranks;
}

// Sets w[k, ..., rank_of(k):, ...] (dimension `rank_dim` counts the rank) to NaN.
void poison_past_rank(Tensor& w, int rank_dim, const std::vector<int32_t>& ranks_of_slot) {
  const int64_t max_rank = w.size(rank_dim);
  for (size_t k = 0; k < ranks_of_slot.size(); ++k) {
    const int64_t r = ranks_of_slot[k];
    if (r < max_rank) {
      w.narrow(0, static_cast<int64_t>(k), 1).narrow(rank_dim, r, max_rank - r).fill_(NAN);
    }
  }
}

std::vector<int32_t> slice_ranks(const std::vector<int32_t>& ranks, int slice, int max_loras) {
  return std::vector<int32_t>(ranks.begin() + slice * max_loras,
                              ranks.begin() + (slice + 1) * max_loras);
}

// [S, T, R] float32: random, NaN past each token's slot rank and on slot -1 rows.
Tensor make_mid(int num_slices, const std::vector<int32_t>& slots, int max_loras, int max_rank,
                const std::vector<int32_t>& ranks, std::mt19937_64& rng) {
  const int64_t t_count = static_cast<int64_t>(slots.size());
  Tensor mid = random_tensor({num_slices, t_count, max_rank}, kF32, rng, 2.0f);
  float* m = mid.data<float>();
  for (int s = 0; s < num_slices; ++s) {
    for (int64_t t = 0; t < t_count; ++t) {
      const int32_t slot = slots[static_cast<size_t>(t)];
      const int32_t rank = slot < 0 ? 0 : ranks[s * max_loras + slot];
      for (int r = rank; r < max_rank; ++r) m[(s * t_count + t) * max_rank + r] = NAN;
    }
  }
  return mid;
}

Tensor to_device(const Tensor& t, Device device, const Stream& stream) {
  // A fresh copy even on the CPU, so that the caller's tensor is never written.
  return t.clone().to(device, stream);
}

Tensor int_tensor(const std::vector<int32_t>& v, const Shape& shape, Device device,
                  const Stream& stream) {
  return Tensor::from_vector(v, shape).to(device, stream);
}

SlotRanks slot_ranks(const std::vector<int32_t>& ranks, int num_slices, int max_loras, int max_rank,
                     Device device, const Stream& stream) {
  SlotRanks out(num_slices, max_loras, max_rank, device);
  for (int s = 0; s < num_slices; ++s) {
    for (int k = 0; k < max_loras; ++k) out.set(s, k, ranks[s * max_loras + k], stream);
  }
  return out;
}

int64_t sum_widths(const std::vector<int64_t>& widths) {
  return std::accumulate(widths.begin(), widths.end(), int64_t{0});
}

bool same_bits(const char* a, const char* b, size_t n) { return std::memcmp(a, b, n) == 0; }

}  // namespace

Status bgmv_shrink_on(const kernels::ShrinkArgs& args, const int32_t* token_lora_mapping,
                      const Stream& stream) {
  return kernels::route(
      stream, [&] { return kernels::cpu::bgmv_shrink(args, token_lora_mapping); },
      [&](cuda_rt::StreamHandle handle) {
        return kernels::cuda::bgmv_shrink(args, token_lora_mapping, handle);
      });
}

Status bgmv_expand_on(const kernels::ExpandArgs& args, const int32_t* token_lora_mapping,
                      const Stream& stream) {
  return kernels::route(
      stream, [&] { return kernels::cpu::bgmv_expand(args, token_lora_mapping); },
      [&](cuda_rt::StreamHandle handle) {
        return kernels::cuda::bgmv_expand(args, token_lora_mapping, handle);
      });
}

// ---------------------------------------------------------------------------------------------
// Comparison

double unit_roundoff(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return kEps32;
    case DType::kF16:
      return 1.0 / (1 << 11);
    case DType::kBF16:
      return 1.0 / (1 << 8);
    case DType::kF8E4M3:
      return 1.0 / (1 << 4);
    case DType::kF8E5M2:
      return 1.0 / (1 << 3);
    default:
      return 0.0;
  }
}

::testing::AssertionResult matches_reference(const Tensor& got, const Tensor& before,
                                             const Reference& ref, const Tolerance& tol) {
  if (got.shape() != before.shape() || got.dtype() != before.dtype() || !got.is_contiguous() ||
      !before.is_contiguous()) {
    return ::testing::AssertionFailure()
           << "output " << got.describe() << " does not match the input " << before.describe();
  }
  const std::vector<double> g = got.to_double_vector();
  if (g.size() != ref.value.size()) {
    return ::testing::AssertionFailure()
           << "reference has " << ref.value.size() << " elements, output " << g.size();
  }
  const size_t es = got.element_size();
  const char* gp = static_cast<const char*>(got.data_ptr());
  const char* bp = static_cast<const char*>(before.data_ptr());
  double worst = 0.0;
  size_t worst_i = 0;
  size_t written = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    if (!ref.written[i]) {
      if (!same_bits(gp + i * es, bp + i * es, es)) {
        return ::testing::AssertionFailure()
               << "element " << i << " must not be written but changed from " << ref.value[i]
               << " to " << g[i];
      }
      continue;
    }
    ++written;
    const double bound =
        tol.out_rel * std::fabs(ref.value[i]) + tol.acc_rel * ref.magnitude[i] + tol.abs;
    const double ratio = std::isfinite(g[i]) ? std::fabs(g[i] - ref.value[i]) / bound : INFINITY;
    if (ratio > worst || std::isnan(ratio)) {
      worst = std::isnan(ratio) ? INFINITY : ratio;
      worst_i = i;
    }
  }
  if (worst > 1.0) {
    return ::testing::AssertionFailure()
           << "element " << worst_i << " is " << g[worst_i] << ", reference " << ref.value[worst_i]
           << " (magnitude " << ref.magnitude[worst_i] << "): error / bound " << worst
           << " with out_rel " << tol.out_rel << ", acc_rel " << tol.acc_rel;
  }
  return ::testing::AssertionSuccess()
         << written << " written elements within " << worst << " of the bound";
}

::testing::AssertionResult bit_identical(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype() || !a.is_contiguous() ||
      !b.is_contiguous()) {
    return ::testing::AssertionFailure() << a.describe() << " vs " << b.describe();
  }
  const size_t es = a.element_size();
  const char* ap = static_cast<const char*>(a.data_ptr());
  const char* bp = static_cast<const char*>(b.data_ptr());
  for (int64_t i = 0; i < a.numel(); ++i) {
    if (!same_bits(ap + i * es, bp + i * es, es)) {
      const std::vector<double> av = a.to_double_vector();
      const std::vector<double> bv = b.to_double_vector();
      return ::testing::AssertionFailure() << "element " << i << ": " << av[i] << " vs " << bv[i];
    }
  }
  return ::testing::AssertionSuccess();
}

Stream stream_for(Device device) { return device.is_cpu() ? Stream() : Stream::create(device); }

// ---------------------------------------------------------------------------------------------
// Linear ops

std::string case_name(const LinearCase& c) {
  std::ostringstream os;
  os << short_dtype(c.dtype) << "_t" << c.num_tokens << "_l" << c.max_loras << "_"
     << rank_name(c.rank, c.max_rank) << "_h" << c.hidden << "_" << widths_name(c.widths) << "_"
     << distribution_name(c.dist) << none_name(c.none_fraction);
  if (c.offset) os << "_off" << c.offset;
  return os.str();
}

const std::vector<LinearCase>& linear_cases() {
  // Rows enumerate rank x dtype; the slice count (rank index + dtype index) % 3 + 1 covers
  // rank x slices and dtype x slices too. The other values are spread over the rows.
  static const std::vector<LinearCase> cases = {
      {kF32, 1, 1, 1, 1, 17, {24}, SD::kOneAdapter, 0.0, 0},
      {kF16, 77, 4, 1, 1, 61, {40, 9}, SD::kUniform, 0.2, 3},
      {kBF16, 199, 32, 1, 1, 33, {16, 7, 7}, SD::kZipf, 0.1, 0},
      {kF32, 3, 4, 16, 8, 127, {31, 33}, SD::kAllDistinct, 0.3, 5},
      {kF16, 1024, 32, 8, 8, 33, {48, 16, 16}, SD::kSkewed, 0.1, 0},
      {kBF16, 77, 1, 8, 8, 255, {129}, SD::kOneAdapter, 0.2, 1},
      {kF32, 199, 4, 16, 16, 4096, {64, 32, 32}, SD::kZipf, 0.15, 0},
      {kF16, 3, 32, 16, 16, 17, {5}, SD::kAllDistinct, 0.0, 2},
      {kBF16, 1024, 4, 32, 16, 61, {96, 96}, SD::kUniform, 0.1, 0},
      {kF32, 77, 32, 64, 64, 127, {100}, SD::kSkewed, 0.1, 7},
      {kF16, 199, 1, 64, 64, 65, {33, 17}, SD::kOneAdapter, 0.25, 0},
      {kBF16, 1, 4, 64, 64, 383, {20, 12, 12}, SD::kUniform, 0.0, 4},
      {kF32, 1024, 1, 128, 128, 33, {17, 15}, SD::kOneAdapter, 0.05, 0},
      {kF16, 77, 4, 128, 128, 255, {64, 16, 16}, SD::kZipf, 0.1, 3},
      {kBF16, 3, 32, 128, 128, 61, {257}, SD::kAllDistinct, 0.0, 0},
      {kF32, 199, 32, 64, 0, 61, {40, 24, 24}, SD::kUniform, 0.2, 1},
      {kF16, 1024, 4, 128, 0, 127, {63}, SD::kZipf, 0.1, 0},
      {kBF16, 77, 32, 16, 0, 33, {16, 48}, SD::kAllDistinct, 0.1, 6},
      // The whole batch base-only: nothing may be written.
      {kBF16, 77, 4, 16, 16, 61, {24, 8}, SD::kUniform, 1.0, 2},
  };
  return cases;
}

const std::vector<LinearCase>& logits_cases() {
  static const std::vector<LinearCase> cases = {
      {kF32, 1, 1, 8, 8, 33, {257}, SD::kOneAdapter, 0.0, 0},
      {kBF16, 7, 4, 16, 0, 65, {1001}, SD::kAllDistinct, 0.3, 0},
      {kF16, 33, 32, 64, 32, 127, {513}, SD::kZipf, 0.2, 0},
      {kBF16, 128, 4, 16, 16, 4096, {97}, SD::kSkewed, 0.1, 0},
  };
  return cases;
}

LinearProblem make_linear_problem(const LinearCase& c) {
  LinearProblem p;
  p.c = c;
  p.seed = seed_of(case_name(c));
  std::mt19937_64 rng(p.seed);
  const int slices = p.num_slices();
  p.slots = make_slots(c.dist, c.num_tokens, c.max_loras, rng, c.none_fraction);
  p.ranks = make_ranks(slices, c.max_loras, c.max_rank, c.rank, rng);
  p.scale = 0.375f;
  p.x = random_tensor({c.num_tokens, c.hidden}, c.dtype, rng);
  for (int s = 0; s < slices; ++s) {
    const std::vector<int32_t> rs = slice_ranks(p.ranks, s, c.max_loras);
    p.a.push_back(random_tensor({c.max_loras, c.max_rank, c.hidden}, c.dtype, rng));
    poison_past_rank(p.a.back(), 1, rs);
    p.b.push_back(random_tensor({c.max_loras, c.widths[s], c.max_rank}, c.dtype, rng));
    poison_past_rank(p.b.back(), 2, rs);
  }
  p.mid = make_mid(slices, p.slots, c.max_loras, c.max_rank, p.ranks, rng);
  p.y0 = random_tensor({c.num_tokens, c.offset + sum_widths(c.widths) + 2}, c.dtype, rng);
  return p;
}

Reference reference_shrink(const LinearProblem& p, const Tensor& before) {
  const LinearCase& c = p.c;
  Reference ref;
  ref.value = before.to_double_vector();
  ref.magnitude.assign(ref.value.size(), 0.0);
  ref.written.assign(ref.value.size(), false);
  const std::vector<double> x = p.x.to_double_vector();
  const int64_t k_dim = c.hidden;
  for (int s = 0; s < p.num_slices(); ++s) {
    const std::vector<double> a = p.a[s].to_double_vector();
    for (int64_t t = 0; t < c.num_tokens; ++t) {
      const int32_t slot = p.slots[static_cast<size_t>(t)];
      if (slot < 0) continue;
      for (int32_t r = 0; r < p.rank(s, slot); ++r) {
        double sum = 0.0;
        double mag = 0.0;
        for (int64_t i = 0; i < k_dim; ++i) {
          const double term = x[t * k_dim + i] * a[(slot * c.max_rank + r) * k_dim + i];
          sum += term;
          mag += std::fabs(term);
        }
        const size_t o = static_cast<size_t>((s * c.num_tokens + t) * c.max_rank + r);
        ref.value[o] = p.scale * sum;
        ref.magnitude[o] = std::fabs(p.scale) * mag;
        ref.written[o] = true;
      }
    }
  }
  return ref;
}

Reference reference_expand(const LinearProblem& p, const Tensor& mid, bool add_inputs,
                           int first_slice, int num_slices, int64_t offset) {
  const LinearCase& c = p.c;
  Reference ref;
  ref.value = p.y0.to_double_vector();
  ref.magnitude.assign(ref.value.size(), 0.0);
  ref.written.assign(ref.value.size(), false);
  const std::vector<double> m = mid.to_double_vector();
  const int64_t width = p.y0.size(1);
  int64_t col = offset;
  for (int s = first_slice; s < first_slice + num_slices; ++s) {
    const std::vector<double> b = p.b[s].to_double_vector();
    const int64_t n = c.widths[s];
    for (int64_t t = 0; t < c.num_tokens; ++t) {
      const int32_t slot = p.slots[static_cast<size_t>(t)];
      if (slot < 0) continue;
      const int32_t rank = p.rank(s, slot);
      if (rank == 0 && add_inputs) continue;  // exactly no effect
      for (int64_t j = 0; j < n; ++j) {
        double sum = 0.0;
        double mag = 0.0;
        for (int32_t r = 0; r < rank; ++r) {
          const double term =
              m[(s * c.num_tokens + t) * c.max_rank + r] * b[(slot * n + j) * c.max_rank + r];
          sum += term;
          mag += std::fabs(term);
        }
        const size_t o = static_cast<size_t>(t * width + col + j);
        const double base = add_inputs ? ref.value[o] : 0.0;
        ref.magnitude[o] = std::fabs(base) + mag;
        ref.value[o] = base + sum;
        ref.written[o] = true;
      }
    }
    col += n;
  }
  return ref;
}

Reference reference_linear(const LinearProblem& p) {
  const LinearCase& c = p.c;
  Reference ref;
  ref.value = p.y0.to_double_vector();
  ref.magnitude.assign(ref.value.size(), 0.0);
  ref.written.assign(ref.value.size(), false);
  const std::vector<double> x = p.x.to_double_vector();
  const int64_t width = p.y0.size(1);
  const int64_t k_dim = c.hidden;
  int64_t col = c.offset;
  for (int s = 0; s < p.num_slices(); ++s) {
    const std::vector<double> a = p.a[s].to_double_vector();
    const std::vector<double> b = p.b[s].to_double_vector();
    const int64_t n = c.widths[s];
    std::vector<double> mid(static_cast<size_t>(c.max_rank));
    std::vector<double> mid_mag(static_cast<size_t>(c.max_rank));
    for (int64_t t = 0; t < c.num_tokens; ++t) {
      const int32_t slot = p.slots[static_cast<size_t>(t)];
      if (slot < 0) continue;
      const int32_t rank = p.rank(s, slot);
      if (rank == 0) continue;
      for (int32_t r = 0; r < rank; ++r) {
        double sum = 0.0;
        double mag = 0.0;
        for (int64_t i = 0; i < k_dim; ++i) {
          const double term = x[t * k_dim + i] * a[(slot * c.max_rank + r) * k_dim + i];
          sum += term;
          mag += std::fabs(term);
        }
        mid[r] = p.scale * sum;
        mid_mag[r] = std::fabs(p.scale) * mag;
      }
      for (int64_t j = 0; j < n; ++j) {
        double sum = 0.0;
        double mag = 0.0;
        for (int32_t r = 0; r < rank; ++r) {
          const double bv = b[(slot * n + j) * c.max_rank + r];
          sum += mid[r] * bv;
          mag += mid_mag[r] * std::fabs(bv);
        }
        const size_t o = static_cast<size_t>(t * width + col + j);
        ref.magnitude[o] = std::fabs(ref.value[o]) + mag;
        ref.value[o] += sum;
        ref.written[o] = true;
      }
    }
    col += n;
  }
  return ref;
}

// Bounds with a factor 2 of slack over the worst-case analysis: a dot of K terms in 16 lanes
// accumulates about K/16 + 5 roundings per term (products included), a rank-r expand r + 2,
// the final add one more.
Tolerance shrink_tolerance(const LinearProblem& p, DType out_dtype) {
  return {unit_roundoff(out_dtype), 2.0 * (p.c.hidden / 16.0 + 8) * kEps32};
}

Tolerance expand_tolerance(const LinearProblem& p, DType) {
  return {unit_roundoff(p.c.dtype), 2.0 * (p.c.max_rank + 8) * kEps32};
}

Tolerance linear_tolerance(const LinearProblem& p, DType mid_dtype) {
  const double mid_round = mid_dtype == kF32 ? 0.0 : unit_roundoff(mid_dtype);
  return {unit_roundoff(p.c.dtype),
          2.0 * (p.c.hidden / 16.0 + p.c.max_rank + 16) * kEps32 + mid_round};
}

Tensor shrink_output_before(const LinearProblem& p, DType out_dtype) {
  std::mt19937_64 rng(p.seed ^ 0x5eed);
  return random_tensor({p.num_slices(), p.c.num_tokens, p.c.max_rank}, out_dtype, rng, 3.0f);
}

Tensor run_shrink(const LinearProblem& p, OpForm form, const Tensor& before, Device device) {
  const LinearCase& c = p.c;
  const Stream stream = stream_for(device);
  const Tensor x = to_device(p.x, device, stream);
  std::vector<Tensor> a;
  for (const Tensor& w : p.a) a.push_back(to_device(w, device, stream));
  Tensor out = to_device(before, device, stream);
  const Tensor ranks = int_tensor(p.ranks, {p.num_slices(), c.max_loras}, device, stream);
  kernels::ShrinkArgs args;
  args.dtype = c.dtype;
  args.num_tokens = c.num_tokens;
  args.hidden = c.hidden;
  args.x = x.data_ptr();
  args.x_row_stride = c.hidden;
  args.num_slices = p.num_slices();
  for (int s = 0; s < p.num_slices(); ++s) args.lora_a[s] = a[s].data_ptr();
  args.max_loras = c.max_loras;
  args.max_rank = c.max_rank;
  args.ranks = ranks.data<int32_t>();
  args.scale = p.scale;
  args.out_dtype = before.dtype();
  args.out = out.data_ptr();
  if (form == OpForm::kSgmv) {
    LoraBatchMeta meta(c.max_loras, c.num_tokens, device);
    meta.prepare(p.slots, stream);
    throw_if_error(dispatch_lora_shrink(args, meta.view(), stream));
  } else {
    const Tensor mapping = int_tensor(p.slots, {c.num_tokens}, device, stream);
    throw_if_error(bgmv_shrink_on(args, mapping.data<int32_t>(), stream));
  }
  return out.to(Device::cpu(), stream);
}

namespace {

kernels::ExpandArgs expand_args(const LinearProblem& p, const Tensor& mid, Tensor& y,
                                const std::vector<Tensor>& b, const Tensor& ranks, int first_slice,
                                int num_slices, int64_t offset, bool add_inputs) {
  kernels::ExpandArgs args;
  args.dtype = p.c.dtype;
  args.num_tokens = p.c.num_tokens;
  args.in_dtype = mid.dtype();
  args.in = mid.data_ptr();
  args.num_slices = num_slices;
  for (int s = 0; s < num_slices; ++s) {
    args.lora_b[s] = b[first_slice + s].data_ptr();
    args.slice_width[s] = p.c.widths[first_slice + s];
  }
  args.max_loras = p.c.max_loras;
  args.max_rank = p.c.max_rank;
  args.ranks = ranks.data<int32_t>();
  args.y = y.data_ptr();
  args.y_row_stride = y.size(1);
  args.offset_start = offset;
  args.add_inputs = add_inputs;
  return args;
}

}  // namespace

Tensor run_expand(const LinearProblem& p, OpForm form, const Tensor& mid, bool add_inputs,
                  Device device) {
  const LinearCase& c = p.c;
  const Stream stream = stream_for(device);
  const Tensor in = to_device(mid, device, stream);
  std::vector<Tensor> b;
  for (const Tensor& w : p.b) b.push_back(to_device(w, device, stream));
  Tensor y = to_device(p.y0, device, stream);
  const Tensor ranks = int_tensor(p.ranks, {p.num_slices(), c.max_loras}, device, stream);
  const kernels::ExpandArgs args =
      expand_args(p, in, y, b, ranks, 0, p.num_slices(), c.offset, add_inputs);
  if (form == OpForm::kSgmv) {
    LoraBatchMeta meta(c.max_loras, c.num_tokens, device);
    meta.prepare(p.slots, stream);
    throw_if_error(dispatch_lora_expand(args, meta.view(), stream));
  } else {
    const Tensor mapping = int_tensor(p.slots, {c.num_tokens}, device, stream);
    throw_if_error(bgmv_expand_on(args, mapping.data<int32_t>(), stream));
  }
  return y.to(Device::cpu(), stream);
}

Tensor run_expand_slice(const LinearProblem& p, int slice, int64_t offset, bool add_inputs,
                        Device device) {
  const LinearCase& c = p.c;
  const Stream stream = stream_for(device);
  // The slice's own intermediate [T, R] and ranks [max_loras], as vLLM passes one slice.
  const Tensor in = to_device(p.mid.select(0, slice).unsqueeze(0), device, stream);
  std::vector<Tensor> b(static_cast<size_t>(slice) + 1);
  b[slice] = to_device(p.b[slice], device, stream);
  Tensor y = to_device(p.y0, device, stream);
  const Tensor ranks =
      int_tensor(slice_ranks(p.ranks, slice, c.max_loras), {1, c.max_loras}, device, stream);
  kernels::ExpandArgs args = expand_args(p, in, y, b, ranks, slice, 1, offset, add_inputs);
  const Tensor mapping = int_tensor(p.slots, {c.num_tokens}, device, stream);
  throw_if_error(bgmv_expand_on(args, mapping.data<int32_t>(), stream));
  return y.to(Device::cpu(), stream);
}

Tensor run_lora_linear(const LinearProblem& p, Device device) {
  const LinearCase& c = p.c;
  const Stream stream = stream_for(device);
  PunicaWrapper wrapper(c.max_loras, c.num_tokens, 1, device);
  wrapper.update_metadata(p.slots, {}, stream);
  const SlotRanks ranks =
      slot_ranks(p.ranks, p.num_slices(), c.max_loras, c.max_rank, device, stream);
  std::vector<Tensor> a;
  std::vector<Tensor> b;
  for (int s = 0; s < p.num_slices(); ++s) {
    a.push_back(to_device(p.a[s], device, stream));
    b.push_back(to_device(p.b[s], device, stream));
  }
  const Tensor x = to_device(p.x, device, stream);
  Tensor y = to_device(p.y0, device, stream);
  // The layer's output columns as a strided view: rows of y are wider than the slices.
  Tensor y_view = y.narrow(1, c.offset, sum_widths(c.widths));
  Tensor workspace = Tensor::empty(
      {PunicaWrapper::workspace_elements(p.num_slices(), c.num_tokens, c.max_rank)}, kF32, device);
  wrapper.add_lora_linear(y_view, x, a, b, ranks, p.scale, workspace, stream);
  return y.to(Device::cpu(), stream);
}

Tensor run_lora_logits(const LinearProblem& p, Device device) {
  const LinearCase& c = p.c;
  const Stream stream = stream_for(device);
  // Sampled rows only: the token mapping of the step is empty.
  PunicaWrapper wrapper(c.max_loras, 1, c.num_tokens, device);
  wrapper.update_metadata({}, p.slots, stream);
  const SlotRanks ranks = slot_ranks(p.ranks, 1, c.max_loras, c.max_rank, device, stream);
  const Tensor x = to_device(p.x, device, stream);
  Tensor y = to_device(p.y0, device, stream);
  Tensor y_view = y.narrow(1, c.offset, c.widths[0]);
  Tensor workspace =
      Tensor::empty({PunicaWrapper::workspace_elements(1, c.num_tokens, c.max_rank)}, kF32, device);
  wrapper.add_lora_logits(y_view, x, to_device(p.a[0], device, stream),
                          to_device(p.b[0], device, stream), ranks, p.scale, workspace, stream);
  return y.to(Device::cpu(), stream);
}

// ---------------------------------------------------------------------------------------------
// Embedding LoRA

std::string case_name(const EmbeddingCase& c) {
  std::ostringstream os;
  os << short_dtype(c.dtype) << "_t" << c.num_tokens << "_l" << c.max_loras << "_"
     << rank_name(c.rank, c.max_rank) << "_v" << c.vocab << "_h" << c.hidden << "_"
     << distribution_name(c.dist) << none_name(c.none_fraction);
  return os.str();
}

const std::vector<EmbeddingCase>& embedding_cases() {
  static const std::vector<EmbeddingCase> cases = {
      {kF32, 1, 1, 8, 8, 97, 33, SD::kOneAdapter, 0.0},
      {kBF16, 77, 4, 16, 0, 301, 65, SD::kUniform, 0.2},
      {kF16, 199, 32, 64, 64, 1001, 127, SD::kZipf, 0.1},
      {kBF16, 1024, 4, 16, 16, 257, 61, SD::kSkewed, 0.1},
      {kF32, 3, 32, 128, 0, 50, 255, SD::kAllDistinct, 0.0},
      {kF16, 77, 4, 1, 1, 97, 4096, SD::kUniform, 0.3},
  };
  return cases;
}

EmbeddingProblem make_embedding_problem(const EmbeddingCase& c) {
  EmbeddingProblem p;
  p.c = c;
  std::mt19937_64 rng(seed_of(case_name(c)));
  p.slots = make_slots(c.dist, c.num_tokens, c.max_loras, rng, c.none_fraction);
  p.ranks = make_ranks(1, c.max_loras, c.max_rank, c.rank, rng);
  std::uniform_int_distribution<int32_t> id(0, static_cast<int32_t>(c.vocab) - 1);
  // Base-only tokens may carry ids past the LoRA vocabulary (added tokens): never looked up.
  std::uniform_int_distribution<int32_t> any_id(0, static_cast<int32_t>(c.vocab) + 50);
  for (int32_t slot : p.slots) p.token_ids.push_back(slot >= 0 ? id(rng) : any_id(rng));
  p.scale = 0.625f;
  p.a = random_tensor({c.max_loras, c.vocab, c.max_rank}, c.dtype, rng);
  poison_past_rank(p.a, 2, p.ranks);
  p.b = random_tensor({c.max_loras, c.hidden, c.max_rank}, c.dtype, rng);
  poison_past_rank(p.b, 2, p.ranks);
  p.y0 = random_tensor({c.num_tokens, c.hidden}, c.dtype, rng);
  return p;
}

Reference reference_embedding(const EmbeddingProblem& p) {
  const EmbeddingCase& c = p.c;
  Reference ref;
  ref.value = p.y0.to_double_vector();
  ref.magnitude.assign(ref.value.size(), 0.0);
  ref.written.assign(ref.value.size(), false);
  const std::vector<double> a = p.a.to_double_vector();
  const std::vector<double> b = p.b.to_double_vector();
  for (int64_t t = 0; t < c.num_tokens; ++t) {
    const int32_t slot = p.slots[static_cast<size_t>(t)];
    if (slot < 0 || p.ranks[slot] == 0) continue;
    const int64_t row = (slot * c.vocab + p.token_ids[static_cast<size_t>(t)]) * c.max_rank;
    for (int64_t j = 0; j < c.hidden; ++j) {
      double sum = 0.0;
      double mag = 0.0;
      for (int32_t r = 0; r < p.ranks[slot]; ++r) {
        const double term = p.scale * a[row + r] * b[(slot * c.hidden + j) * c.max_rank + r];
        sum += term;
        mag += std::fabs(term);
      }
      const size_t o = static_cast<size_t>(t * c.hidden + j);
      ref.magnitude[o] = std::fabs(ref.value[o]) + mag;
      ref.value[o] += sum;
      ref.written[o] = true;
    }
  }
  return ref;
}

Tolerance embedding_tolerance(const EmbeddingProblem& p) {
  return {unit_roundoff(p.c.dtype), 2.0 * (p.c.max_rank + 8) * kEps32};
}

Tensor run_embedding(const EmbeddingProblem& p, Device device) {
  const EmbeddingCase& c = p.c;
  const Stream stream = stream_for(device);
  PunicaWrapper wrapper(c.max_loras, c.num_tokens, 1, device);
  wrapper.update_metadata(p.slots, {}, stream);
  const SlotRanks ranks = slot_ranks(p.ranks, 1, c.max_loras, c.max_rank, device, stream);
  Tensor y = to_device(p.y0, device, stream);
  const Tensor ids = int_tensor(p.token_ids, {c.num_tokens}, device, stream);
  wrapper.add_lora_embedding(y, ids, to_device(p.a, device, stream), to_device(p.b, device, stream),
                             ranks, p.scale, stream);
  return y.to(Device::cpu(), stream);
}

// ---------------------------------------------------------------------------------------------
// FP8 LoRA-B expand

namespace {

const char* scale_kind_name(kernels::Fp8ScaleKind k) {
  switch (k) {
    case kernels::Fp8ScaleKind::kPerTensor:
      return "tensor";
    case kernels::Fp8ScaleKind::kPerChannel:
      return "channel";
    case kernels::Fp8ScaleKind::kPerBlock:
      return "block";
  }
  return "?";
}

const char* intermediate_name(Fp8Intermediate i) {
  switch (i) {
    case Fp8Intermediate::kF32:
      return "inf32";
    case Fp8Intermediate::kActivation:
      return "inact";
    case Fp8Intermediate::kW8A8PerToken:
      return "w8a8token";
    case Fp8Intermediate::kW8A8PerTensor:
      return "w8a8tensor";
  }
  return "?";
}

bool is_w8a8(Fp8Intermediate i) {
  return i == Fp8Intermediate::kW8A8PerToken || i == Fp8Intermediate::kW8A8PerTensor;
}

Shape fp8_scale_shape(const Fp8Case& c, int64_t n) {
  switch (c.scale_kind) {
    case kernels::Fp8ScaleKind::kPerTensor:
      return {c.max_loras};
    case kernels::Fp8ScaleKind::kPerChannel:
      return {c.max_loras, n};
    case kernels::Fp8ScaleKind::kPerBlock:
      return {c.max_loras, (n + c.group_n - 1) / c.group_n,
              (c.max_rank + c.group_k - 1) / c.group_k};
  }
  return {};
}

// The bits an untouched fp8 element keeps: a finite value that the quantisation of a NaN
// (0x7f) or of a real value at another position would not reproduce by accident.
constexpr uint8_t kFp8Untouched = 0x01;
constexpr float kScaleUntouched = -1.0f;

}  // namespace

std::string case_name(const Fp8Case& c) {
  std::ostringstream os;
  os << short_dtype(c.dtype) << "_" << short_dtype(c.weight_dtype) << "_"
     << scale_kind_name(c.scale_kind);
  if (c.scale_kind == kernels::Fp8ScaleKind::kPerBlock) os << c.group_n << "x" << c.group_k;
  os << "_" << intermediate_name(c.intermediate);
  if (is_w8a8(c.intermediate)) os << short_dtype(c.in_fp8_dtype);
  os << "_t" << c.num_tokens << "_l" << c.max_loras << "_" << rank_name(c.rank, c.max_rank) << "_"
     << widths_name(c.widths) << "_" << distribution_name(c.dist) << none_name(c.none_fraction)
     << (c.add_inputs ? "_add" : "_overwrite");
  return os.str();
}

const std::vector<Fp8Case>& fp8_cases() {
  using K = kernels::Fp8ScaleKind;
  using I = Fp8Intermediate;
  constexpr DType e4m3 = DType::kF8E4M3;
  constexpr DType e5m2 = DType::kF8E5M2;
  static const std::vector<Fp8Case> cases = {
      {kBF16,
       e4m3,
       K::kPerTensor,
       0,
       0,
       I::kF32,
       e4m3,
       77,
       4,
       16,
       16,
       {64},
       SD::kUniform,
       0.2,
       true},
      {kF16,
       e5m2,
       K::kPerChannel,
       0,
       0,
       I::kActivation,
       e4m3,
       199,
       32,
       64,
       0,
       {48, 16},
       SD::kZipf,
       0.1,
       true},
      {kF32,
       e4m3,
       K::kPerBlock,
       16,
       8,
       I::kW8A8PerToken,
       e4m3,
       3,
       4,
       16,
       16,
       {40, 24, 24},
       SD::kAllDistinct,
       0.0,
       false},
      {kBF16,
       e5m2,
       K::kPerBlock,
       32,
       16,
       I::kW8A8PerTensor,
       e5m2,
       1024,
       4,
       32,
       8,
       {33},
       SD::kSkewed,
       0.1,
       true},
      {kF16,
       e4m3,
       K::kPerChannel,
       0,
       0,
       I::kW8A8PerToken,
       e5m2,
       1,
       1,
       128,
       128,
       {97},
       SD::kOneAdapter,
       0.0,
       true},
      {kF32,
       e5m2,
       K::kPerTensor,
       0,
       0,
       I::kW8A8PerTensor,
       e4m3,
       77,
       32,
       16,
       0,
       {20, 12},
       SD::kUniform,
       0.3,
       true},
      {kBF16,
       e4m3,
       K::kPerBlock,
       128,
       128,
       I::kActivation,
       e4m3,
       199,
       4,
       64,
       0,
       {300, 100},
       SD::kZipf,
       0.1,
       false},
      {kF32,
       e4m3,
       K::kPerChannel,
       0,
       0,
       I::kF32,
       e4m3,
       1024,
       32,
       8,
       1,
       {65},
       SD::kAllDistinct,
       0.1,
       false},
  };
  return cases;
}

Fp8Problem make_fp8_problem(const Fp8Case& c) {
  Fp8Problem p;
  p.c = c;
  std::mt19937_64 rng(seed_of(case_name(c)));
  const int slices = p.num_slices();
  p.slots = make_slots(c.dist, c.num_tokens, c.max_loras, rng, c.none_fraction);
  p.ranks = make_ranks(slices, c.max_loras, c.max_rank, c.rank, rng);
  // Quantised values spread over most of the format's range; scales bring them to O(1).
  const float q_range = c.weight_dtype == DType::kF8E4M3 ? 400.0f : 40000.0f;
  for (int s = 0; s < slices; ++s) {
    p.b.push_back(
        random_tensor({c.max_loras, c.widths[s], c.max_rank}, c.weight_dtype, rng, q_range));
    poison_past_rank(p.b.back(), 2, slice_ranks(p.ranks, s, c.max_loras));
    Tensor scale = random_tensor(fp8_scale_shape(c, c.widths[s]), kF32, rng, 2.0f / q_range);
    float* sv = scale.data<float>();
    for (int64_t i = 0; i < scale.numel(); ++i) sv[i] = std::fabs(sv[i]);
    p.b_scale.push_back(scale);
  }
  p.mid = make_mid(slices, p.slots, c.max_loras, c.max_rank, p.ranks, rng);
  p.y0 = random_tensor({c.num_tokens, sum_widths(c.widths) + 3}, c.dtype, rng);
  return p;
}

Fp8Input fp8_expand_input(const Fp8Problem& p, Device device) {
  const Fp8Case& c = p.c;
  Fp8Input in;
  if (c.intermediate == Fp8Intermediate::kF32) {
    in.mid = p.mid;
    return in;
  }
  if (c.intermediate == Fp8Intermediate::kActivation) {
    in.mid = p.mid.to(c.dtype);
    return in;
  }
  const Stream stream = stream_for(device);
  PunicaWrapper wrapper(c.max_loras, c.num_tokens, 1, device);
  wrapper.update_metadata(p.slots, {}, stream);
  const SlotRanks ranks =
      slot_ranks(p.ranks, p.num_slices(), c.max_loras, c.max_rank, device, stream);
  Tensor q = Tensor::empty(p.mid.shape(), c.in_fp8_dtype);
  std::memset(q.data_ptr(), kFp8Untouched, q.nbytes());
  q = q.to(device, stream);
  const bool per_token = c.intermediate == Fp8Intermediate::kW8A8PerToken;
  Tensor scale =
      Tensor::empty(per_token ? Shape{p.num_slices(), c.num_tokens} : Shape{p.num_slices()}, kF32);
  scale.fill_(kScaleUntouched);
  scale = scale.to(device, stream);
  wrapper.quantize_intermediate_fp8(q, scale, to_device(p.mid, device, stream), ranks, stream);
  in.mid = q.to(Device::cpu(), stream);
  in.in_scale = scale.to(Device::cpu(), stream);
  return in;
}

::testing::AssertionResult check_quantized(const Fp8Problem& p, const Fp8Input& in) {
  const Fp8Case& c = p.c;
  const bool per_token = c.intermediate == Fp8Intermediate::kW8A8PerToken;
  const double qmax = c.in_fp8_dtype == DType::kF8E4M3 ? 448.0 : 57344.0;
  // Half the smallest subnormal: the absolute rounding error near zero, in units of scale.
  const double tiny =
      c.in_fp8_dtype == DType::kF8E4M3 ? std::ldexp(1.0, -10) : std::ldexp(1.0, -17);
  const double u = unit_roundoff(c.in_fp8_dtype);
  const std::vector<double> mid = p.mid.to_double_vector();
  const std::vector<double> q = in.mid.to_double_vector();
  const uint8_t* bits = static_cast<const uint8_t*>(in.mid.data_ptr());
  const std::vector<double> scale = in.in_scale.to_double_vector();
  const int64_t t_count = c.num_tokens;
  for (int s = 0; s < p.num_slices(); ++s) {
    double slice_amax = 0.0;
    for (int64_t t = 0; t < t_count; ++t) {
      const int32_t slot = p.slots[static_cast<size_t>(t)];
      const int32_t rank = slot < 0 ? 0 : p.rank(s, slot);
      for (int r = 0; r < rank; ++r) {
        slice_amax = std::max(slice_amax, std::fabs(mid[(s * t_count + t) * c.max_rank + r]));
      }
    }
    for (int64_t t = 0; t < t_count; ++t) {
      const int32_t slot = p.slots[static_cast<size_t>(t)];
      const int32_t rank = slot < 0 ? 0 : p.rank(s, slot);
      const int64_t row = (s * t_count + t) * c.max_rank;
      double amax = 0.0;
      for (int r = 0; r < rank; ++r) amax = std::max(amax, std::fabs(mid[row + r]));
      const double got_scale = per_token ? scale[s * t_count + t] : scale[s];
      if (per_token && slot < 0 && got_scale != kScaleUntouched) {
        return ::testing::AssertionFailure()
               << "slice " << s << " token " << t << " (slot -1) got scale " << got_scale;
      }
      const double want_scale = (per_token ? amax : slice_amax) / qmax;
      if (rank > 0 && want_scale > 0 &&
          std::fabs(got_scale - want_scale) > 4 * kEps32 * want_scale) {
        return ::testing::AssertionFailure() << "slice " << s << " token " << t << " scale "
                                             << got_scale << ", expected " << want_scale;
      }
      for (int r = 0; r < c.max_rank; ++r) {
        if (r >= rank) {
          if (bits[row + r] != kFp8Untouched) {
            return ::testing::AssertionFailure() << "slice " << s << " token " << t << " column "
                                                 << r << " (past rank " << rank << ") written";
          }
          continue;
        }
        const double deq = q[row + r] * got_scale;
        const double want = mid[row + r];
        if (!(std::fabs(deq - want) <= u * std::fabs(want) + tiny * got_scale + 1e-30)) {
          return ::testing::AssertionFailure()
                 << "slice " << s << " token " << t << " column " << r << " dequantises to " << deq
                 << ", value " << want << " (scale " << got_scale << ")";
        }
      }
    }
  }
  return ::testing::AssertionSuccess();
}

Reference reference_expand_fp8(const Fp8Problem& p, const Fp8Input& in) {
  const Fp8Case& c = p.c;
  Reference ref;
  ref.value = p.y0.to_double_vector();
  ref.magnitude.assign(ref.value.size(), 0.0);
  ref.written.assign(ref.value.size(), false);
  const std::vector<double> m = in.mid.to_double_vector();
  const std::vector<double> in_scale =
      in.in_scale.defined() ? in.in_scale.to_double_vector() : std::vector<double>();
  const bool per_token = c.intermediate == Fp8Intermediate::kW8A8PerToken;
  const int64_t width = p.y0.size(1);
  int64_t col = 1;
  for (int s = 0; s < p.num_slices(); ++s) {
    const int64_t n = c.widths[s];
    const std::vector<double> q = p.b[s].to_double_vector();
    const std::vector<double> sc = p.b_scale[s].to_double_vector();
    const int64_t blocks_n = c.group_n ? (n + c.group_n - 1) / c.group_n : 0;
    const int64_t blocks_k = c.group_k ? (c.max_rank + c.group_k - 1) / c.group_k : 0;
    auto b_scale = [&](int32_t slot, int64_t j, int32_t r) {
      switch (c.scale_kind) {
        case kernels::Fp8ScaleKind::kPerTensor:
          return sc[slot];
        case kernels::Fp8ScaleKind::kPerChannel:
          return sc[slot * n + j];
        case kernels::Fp8ScaleKind::kPerBlock:
          return sc[(slot * blocks_n + j / c.group_n) * blocks_k + r / c.group_k];
      }
      return 0.0;
    };
    for (int64_t t = 0; t < c.num_tokens; ++t) {
      const int32_t slot = p.slots[static_cast<size_t>(t)];
      if (slot < 0) continue;
      const int32_t rank = p.rank(s, slot);
      if (rank == 0 && c.add_inputs) continue;
      double v_scale = 1.0;
      if (is_w8a8(c.intermediate))
        v_scale = per_token ? in_scale[s * c.num_tokens + t] : in_scale[s];
      for (int64_t j = 0; j < n; ++j) {
        double sum = 0.0;
        double mag = 0.0;
        for (int32_t r = 0; r < rank; ++r) {
          const double v = m[(s * c.num_tokens + t) * c.max_rank + r] * v_scale;
          const double term = v * q[(slot * n + j) * c.max_rank + r] * b_scale(slot, j, r);
          sum += term;
          mag += std::fabs(term);
        }
        const size_t o = static_cast<size_t>(t * width + col + j);
        const double base = c.add_inputs ? ref.value[o] : 0.0;
        ref.magnitude[o] = std::fabs(base) + mag;
        ref.value[o] = base + sum;
        ref.written[o] = true;
      }
    }
    col += n;
  }
  return ref;
}

Tolerance expand_fp8_tolerance(const Fp8Problem& p) {
  // Dequantising weight and intermediate adds two fp32 roundings per term.
  return {unit_roundoff(p.c.dtype), 2.0 * (p.c.max_rank + 12) * kEps32};
}

Tensor run_expand_fp8(const Fp8Problem& p, const Fp8Input& in, Device device) {
  const Fp8Case& c = p.c;
  const Stream stream = stream_for(device);
  PunicaWrapper wrapper(c.max_loras, c.num_tokens, 1, device);
  wrapper.update_metadata(p.slots, {}, stream);
  const SlotRanks ranks =
      slot_ranks(p.ranks, p.num_slices(), c.max_loras, c.max_rank, device, stream);
  std::vector<Tensor> weights;
  std::vector<Tensor> scales;
  for (int s = 0; s < p.num_slices(); ++s) {
    weights.push_back(to_device(p.b[s], device, stream));
    scales.push_back(to_device(p.b_scale[s], device, stream));
  }
  Fp8LoraB b;
  b.weights = weights;
  b.scales = scales;
  b.scale_kind = c.scale_kind;
  b.group_n = c.group_n;
  b.group_k = c.group_k;
  Tensor y = to_device(p.y0, device, stream);
  const Tensor x = to_device(in.mid, device, stream);
  const Tensor x_scale = in.in_scale.defined() ? to_device(in.in_scale, device, stream) : Tensor();
  wrapper.add_expand_fp8(y, x, b, ranks, 1, c.add_inputs, stream, x_scale);
  return y.to(Device::cpu(), stream);
}

// ---------------------------------------------------------------------------------------------
// Fused MoE LoRA

std::string case_name(const MoeCase& c) {
  std::ostringstream os;
  os << short_dtype(c.dtype) << (c.projection == MoeProjection::kW13 ? "_w13" : "_w2") << "_t"
     << c.num_tokens << "_k" << c.top_k << "_e" << c.num_experts << "_l" << c.max_loras << "_"
     << rank_name(c.rank, c.max_rank) << "_h" << c.hidden_in << "_n" << c.n << "_b" << c.block_size
     << (c.blocks == MoeBlocks::kAuto    ? "_auto"
         : c.blocks == MoeBlocks::kNaive ? "_naive"
                                         : "_aligned")
     << (c.some_disabled ? "_disabled" : "") << (c.some_non_local ? "_ep" : "")
     << (c.offset ? "_off" : "") << (c.offset ? std::to_string(c.offset) : "")
     << (c.add_inputs ? "" : "_overwrite") << "_" << distribution_name(c.dist)
     << none_name(c.none_fraction);
  return os.str();
}

const std::vector<MoeCase>& moe_cases() {
  using P = MoeProjection;
  using B = MoeBlocks;
  static const std::vector<MoeCase> cases = {
      // dtype proj tokens top_k E L Rmax r K n block blocks disabled ep offset add dist none
      {kBF16, P::kW13, 77, 2, 8, 4, 16, 16, 61, 24, 16, B::kAuto, false, false, 0, true,
       SD::kUniform, 0.2},
      {kBF16, P::kW2, 77, 2, 8, 4, 16, 16, 24, 61, 16, B::kAuto, false, false, 0, true,
       SD::kUniform, 0.2},
      {kF32, P::kW13, 3, 2, 16, 4, 8, 0, 33, 17, 16, B::kAuto, true, false, 0, true,
       SD::kAllDistinct, 0.0},
      {kF16, P::kW2, 1, 1, 8, 32, 64, 64, 127, 33, 16, B::kAuto, false, false, 0, true,
       SD::kOneAdapter, 0.0},
      {kF16, P::kW13, 199, 4, 16, 32, 32, 0, 33, 40, 32, B::kAligned, true, true, 3, true,
       SD::kZipf, 0.1},
      {kF32, P::kW2, 199, 4, 16, 32, 16, 8, 40, 33, 16, B::kNaive, false, true, 0, false,
       SD::kSkewed, 0.1},
      {kBF16, P::kW13, 1024, 2, 8, 1, 16, 16, 65, 16, 64, B::kAligned, false, false, 0, true,
       SD::kOneAdapter, 0.05},
      {kF32, P::kW2, 33, 6, 60, 4, 128, 0, 17, 45, 16, B::kAuto, true, false, 5, true, SD::kUniform,
       0.1},
      {kBF16, P::kW2, 77, 2, 8, 4, 16, 16, 24, 61, 16, B::kNaive, true, false, 0, true, SD::kZipf,
       0.2},
  };
  return cases;
}

MoeProblem make_moe_problem(const MoeCase& c) {
  MoeProblem p;
  p.c = c;
  std::mt19937_64 rng(seed_of(case_name(c)));
  const int slices = p.num_slices();
  p.slots = make_slots(c.dist, c.num_tokens, c.max_loras, rng, c.none_fraction);
  p.ranks = make_ranks(slices, c.max_loras, c.max_rank, c.rank, rng);
  p.adapter_enabled.assign(static_cast<size_t>(c.max_loras), 1);
  if (c.some_disabled) {
    // Disable the slot of the first LoRA token (so that disabling is visible) and every
    // third slot.
    for (int k = 0; k < c.max_loras; k += 3) p.adapter_enabled[static_cast<size_t>(k)] = 0;
    for (int32_t slot : p.slots) {
      if (slot >= 0) {
        p.adapter_enabled[static_cast<size_t>(slot)] = 0;
        break;
      }
    }
  }
  std::vector<int32_t> experts(static_cast<size_t>(c.num_experts));
  std::iota(experts.begin(), experts.end(), 0);
  std::bernoulli_distribution non_local(c.some_non_local ? 0.15 : 0.0);
  std::uniform_real_distribution<float> weight(0.05f, 1.0f);
  for (int64_t t = 0; t < c.num_tokens; ++t) {
    std::shuffle(experts.begin(), experts.end(), rng);
    for (int k = 0; k < c.top_k; ++k) {
      p.topk_ids.push_back(non_local(rng) ? -1 : experts[static_cast<size_t>(k)]);
      p.topk_weights.push_back(weight(rng));
    }
  }
  const int64_t x_rows =
      c.projection == MoeProjection::kW13 ? c.num_tokens : c.num_tokens * c.top_k;
  p.x = random_tensor({x_rows, c.hidden_in}, c.dtype, rng);
  for (int s = 0; s < slices; ++s) {
    const std::vector<int32_t> rs = slice_ranks(p.ranks, s, c.max_loras);
    p.a.push_back(
        random_tensor({c.max_loras, c.num_experts, c.max_rank, c.hidden_in}, c.dtype, rng));
    poison_past_rank(p.a.back(), 2, rs);
    p.b.push_back(random_tensor({c.max_loras, c.num_experts, c.n, c.max_rank}, c.dtype, rng));
    poison_past_rank(p.b.back(), 3, rs);
  }
  p.y0 = random_tensor({c.num_tokens, c.top_k, c.offset + slices * c.n + 1}, c.dtype, rng);
  return p;
}

Reference reference_fused_moe(const MoeProblem& p) {
  const MoeCase& c = p.c;
  Reference ref;
  ref.value = p.y0.to_double_vector();
  ref.magnitude.assign(ref.value.size(), 0.0);
  ref.written.assign(ref.value.size(), false);
  const std::vector<double> x = p.x.to_double_vector();
  const int64_t width = p.y0.size(2);
  const int64_t k_dim = c.hidden_in;
  const int64_t e_count = c.num_experts;
  const bool w2 = c.projection == MoeProjection::kW2;
  for (int s = 0; s < p.num_slices(); ++s) {
    const std::vector<double> a = p.a[s].to_double_vector();
    const std::vector<double> b = p.b[s].to_double_vector();
    std::vector<double> mid(static_cast<size_t>(c.max_rank));
    std::vector<double> mid_mag(static_cast<size_t>(c.max_rank));
    for (int64_t pair = 0; pair < c.num_tokens * c.top_k; ++pair) {
      const int64_t t = pair / c.top_k;
      const int32_t slot = p.slots[static_cast<size_t>(t)];
      const int32_t e = p.topk_ids[static_cast<size_t>(pair)];
      if (!p.enabled(slot) || e < 0) continue;
      const int32_t rank = p.rank(s, slot);
      if (rank == 0 && c.add_inputs) continue;
      const double w = w2 ? p.topk_weights[static_cast<size_t>(pair)] : 1.0;
      const int64_t x_row = w2 ? pair : t;
      const int64_t se = slot * e_count + e;
      for (int32_t r = 0; r < rank; ++r) {
        double sum = 0.0;
        double mag = 0.0;
        for (int64_t i = 0; i < k_dim; ++i) {
          const double term = x[x_row * k_dim + i] * a[(se * c.max_rank + r) * k_dim + i];
          sum += term;
          mag += std::fabs(term);
        }
        mid[r] = sum;
        mid_mag[r] = mag;
      }
      for (int64_t j = 0; j < c.n; ++j) {
        double sum = 0.0;
        double mag = 0.0;
        for (int32_t r = 0; r < rank; ++r) {
          const double bv = b[(se * c.n + j) * c.max_rank + r];
          sum += mid[r] * bv;
          mag += mid_mag[r] * std::fabs(bv);
        }
        const size_t o = static_cast<size_t>(pair * width + c.offset + s * c.n + j);
        const double base = c.add_inputs ? ref.value[o] : 0.0;
        ref.magnitude[o] = std::fabs(base) + std::fabs(w) * mag;
        ref.value[o] = base + w * sum;
        ref.written[o] = true;
      }
    }
  }
  return ref;
}

Tolerance fused_moe_tolerance(const MoeProblem& p) {
  return {unit_roundoff(p.c.dtype), 2.0 * (p.c.hidden_in / 16.0 + p.c.max_rank + 16) * kEps32};
}

Tensor run_fused_moe(const MoeProblem& p, Device device) {
  const MoeCase& c = p.c;
  const Stream stream = stream_for(device);
  PunicaWrapper wrapper(c.max_loras, c.num_tokens, 1, device);
  wrapper.update_metadata(p.slots, {}, stream);
  wrapper.reserve_moe_lora(c.num_experts, c.top_k, c.block_size);
  const SlotRanks ranks =
      slot_ranks(p.ranks, p.num_slices(), c.max_loras, c.max_rank, device, stream);
  const Tensor topk = int_tensor(p.topk_ids, {c.num_tokens, c.top_k}, device, stream);
  const Tensor enabled = int_tensor(p.adapter_enabled, {c.max_loras}, device, stream);
  MoeLoraAlignment alignment;
  if (c.blocks == MoeBlocks::kNaive) {
    alignment.topk_ids = topk;
    alignment.adapter_enabled = enabled;
    alignment.num_experts = c.num_experts;
    alignment.block_size = c.block_size;
    alignment.naive = true;
  } else {
    alignment = wrapper.moe_lora_align_block_size(topk, c.num_experts, c.block_size, enabled,
                                                  stream, c.blocks == MoeBlocks::kAuto);
  }
  std::vector<Tensor> a;
  std::vector<Tensor> b;
  for (int s = 0; s < p.num_slices(); ++s) {
    a.push_back(to_device(p.a[s], device, stream));
    b.push_back(to_device(p.b[s], device, stream));
  }
  const Tensor x = to_device(p.x, device, stream);
  Tensor y = to_device(p.y0, device, stream);
  const bool w2 = c.projection == MoeProjection::kW2;
  const Tensor weights =
      Tensor::from_vector(p.topk_weights, {c.num_tokens, c.top_k}).to(device, stream);
  if (!c.add_inputs) {
    FusedMoeLoraOptions options;
    options.mul_routed_weight = w2;
    options.offset = c.offset;
    options.add_inputs = false;
    wrapper.add_lora_fused_moe(y, x, a, b, ranks, weights, alignment, options, stream);
  } else if (w2) {
    wrapper.add_lora_moe_w2(y, x, a[0], b[0], ranks, weights, alignment, stream, c.offset);
  } else {
    wrapper.add_lora_moe_w13(y, x, a, b, ranks, alignment, stream, c.offset);
  }
  return y.to(Device::cpu(), stream);
}

::testing::AssertionResult check_alignment(const MoeAlignment& al) {
  const int64_t num_pairs = al.num_tokens * al.top_k;
  const int32_t pad = static_cast<int32_t>(num_pairs);
  for (int slot = 0; slot < al.max_loras; ++slot) {
    const bool enabled = al.adapter_enabled.empty() || al.adapter_enabled[slot] != 0;
    std::vector<std::vector<int32_t>> groups(static_cast<size_t>(al.num_experts));
    if (enabled) {
      for (int64_t p = 0; p < num_pairs; ++p) {
        const int32_t e = al.topk_ids[static_cast<size_t>(p)];
        if (al.slots[static_cast<size_t>(p / al.top_k)] == slot && e >= 0) {
          groups[static_cast<size_t>(e)].push_back(static_cast<int32_t>(p));
        }
      }
    }
    const int32_t* sorted = al.sorted_ids.data() + slot * al.max_num_tokens_padded;
    const int32_t* experts = al.expert_ids.data() + slot * al.max_num_m_blocks;
    int64_t pos = 0;
    for (int e = 0; e < al.num_experts; ++e) {
      std::vector<int32_t> want = groups[static_cast<size_t>(e)];
      if (want.empty()) continue;
      const int64_t padded =
          (static_cast<int64_t>(want.size()) + al.block_size - 1) / al.block_size * al.block_size;
      if (pos + padded > al.max_num_tokens_padded) {
        return ::testing::AssertionFailure() << "slot " << slot << " overflows sorted_ids";
      }
      want.resize(static_cast<size_t>(padded), pad);
      std::vector<int32_t> got(sorted + pos, sorted + pos + padded);
      std::sort(want.begin(), want.end());
      std::sort(got.begin(), got.end());
      if (got != want) {
        return ::testing::AssertionFailure()
               << "slot " << slot << " expert " << e << ": blocks at " << pos
               << " do not hold exactly its " << groups[static_cast<size_t>(e)].size()
               << " pairs plus padding";
      }
      for (int64_t blk = pos / al.block_size; blk < (pos + padded) / al.block_size; ++blk) {
        if (experts[blk] != e) {
          return ::testing::AssertionFailure() << "slot " << slot << " block " << blk
                                               << " has expert " << experts[blk] << ", want " << e;
        }
      }
      pos += padded;
    }
    if (al.num_tokens_post_pad[slot] != pos) {
      return ::testing::AssertionFailure() << "slot " << slot << " num_tokens_post_pad "
                                           << al.num_tokens_post_pad[slot] << ", want " << pos;
    }
    for (int64_t i = pos; i < al.max_num_tokens_padded; ++i) {
      if (sorted[i] != pad) {
        return ::testing::AssertionFailure() << "slot " << slot << " sorted_ids[" << i
                                             << "] past the padded count is " << sorted[i];
      }
    }
    for (int64_t blk = pos / al.block_size; blk < al.max_num_m_blocks; ++blk) {
      if (experts[blk] != -1) {
        return ::testing::AssertionFailure()
               << "slot " << slot << " unused block " << blk << " has expert " << experts[blk];
      }
    }
  }
  return ::testing::AssertionSuccess();
}

MoeAlignment run_moe_align(int64_t num_tokens, int top_k, int num_experts, int block_size,
                           int max_loras, const std::vector<int32_t>& slots,
                           const std::vector<int32_t>& topk_ids,
                           const std::vector<int32_t>& adapter_enabled, Device device) {
  const Stream stream = stream_for(device);
  MoeAlignment al;
  al.num_tokens = num_tokens;
  al.top_k = top_k;
  al.num_experts = num_experts;
  al.block_size = block_size;
  al.max_loras = max_loras;
  al.slots = slots;
  al.topk_ids = topk_ids;
  al.adapter_enabled = adapter_enabled;
  const kernels::MoeAlignSizes sizes =
      kernels::moe_align_sizes(num_tokens * top_k, num_experts, block_size);
  al.max_num_tokens_padded = sizes.max_num_tokens_padded;
  al.max_num_m_blocks = sizes.max_num_m_blocks;
  // Garbage in the outputs: the op must write every entry.
  std::vector<int32_t> junk_sorted(static_cast<size_t>(max_loras * sizes.max_num_tokens_padded),
                                   -7);
  std::vector<int32_t> junk_blocks(static_cast<size_t>(max_loras * sizes.max_num_m_blocks), 99);
  Tensor sorted = int_tensor(junk_sorted, {max_loras, sizes.max_num_tokens_padded}, device, stream);
  Tensor blocks = int_tensor(junk_blocks, {max_loras, sizes.max_num_m_blocks}, device, stream);
  Tensor post_pad = int_tensor(std::vector<int32_t>(static_cast<size_t>(max_loras), -3),
                               {max_loras}, device, stream);
  const int64_t n = std::max<int64_t>(num_tokens, 1);
  const Tensor mapping =
      int_tensor(num_tokens ? slots : std::vector<int32_t>{-1}, {n}, device, stream);
  const Tensor topk =
      int_tensor(num_tokens ? topk_ids : std::vector<int32_t>(static_cast<size_t>(top_k), 0),
                 {n * top_k}, device, stream);
  Tensor enabled;
  if (!adapter_enabled.empty()) enabled = int_tensor(adapter_enabled, {max_loras}, device, stream);
  kernels::MoeAlignArgs args;
  args.num_tokens = num_tokens;
  args.top_k = top_k;
  args.num_experts = num_experts;
  args.block_size = block_size;
  args.max_loras = max_loras;
  args.topk_ids = topk.data<int32_t>();
  args.token_lora_mapping = mapping.data<int32_t>();
  args.adapter_enabled = enabled.defined() ? enabled.data<int32_t>() : nullptr;
  args.max_num_tokens_padded = sizes.max_num_tokens_padded;
  args.max_num_m_blocks = sizes.max_num_m_blocks;
  args.sorted_ids = sorted.data<int32_t>();
  args.expert_ids = blocks.data<int32_t>();
  args.num_tokens_post_pad = post_pad.data<int32_t>();
  throw_if_error(dispatch_moe_lora_align(args, stream));
  auto back = [&](const Tensor& t) {
    const Tensor h = t.to(Device::cpu(), stream);
    const int32_t* d = h.data<int32_t>();
    return std::vector<int32_t>(d, d + h.numel());
  };
  al.sorted_ids = back(sorted);
  al.expert_ids = back(blocks);
  al.num_tokens_post_pad = back(post_pad);
  return al;
}

}  // namespace loraplex::test
