// The MoE expert block table and the expert GEMMs over it (layer_ops::moe_expert_blocks and
// layer_ops::moe_expert_gemm). The block table is checked against its definition on named
// routings (every routed pair listed once, in a block of its expert; used blocks first in expert
// order, ceil(count / 16) of them per expert; the rest -1), never by rebuilding it. The GEMM is
// checked against a double-precision loop over the already-rounded inputs, for f32, bf16 and
// f16, odd sizes, token and pair rows, with and without row scales, and strided x and out whose
// unlisted rows and outside columns must keep their values. The CUDA versions run the same cases
// and the tensor-core shapes against the CPU op (skipped without a GPU).

#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "loraplex/core/device.h"
#include "loraplex/core/error.h"
#include "loraplex/core/status.h"
#include "loraplex/core/stream.h"
#include "loraplex/core/tensor.h"
#include "loraplex/kernels/layer_ops.h"
#include "loraplex/layers/embedding_moe_ops.h"
#include "support/gpu_check.h"
#include "support/random_data.h"

namespace loraplex {
namespace {

constexpr int64_t kRows = kernels::kMoeExpertBlockRows;
// What the block tensors hold before the op runs, so that entries it leaves unwritten show.
constexpr int32_t kGarbage = 12345;
// What out holds before the GEMM: exact in f32 and f16, 776 in bf16.
constexpr double kSentinel = -777.0;

template <typename... Args>
std::string str(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

Stream stream_for(Device dev) { return dev.is_cpu() ? Stream() : Stream::create(dev); }

Tensor int_tensor(const std::vector<int32_t>& v, Device dev, const Stream& stream) {
  return Tensor::from_vector(v, {static_cast<int64_t>(v.size())}).to(dev, stream);
}

std::vector<int32_t> ints_of(const Tensor& t, const Stream& stream) {
  const Tensor h = t.to(Device::cpu(), stream).contiguous();
  const int32_t* d = h.data<int32_t>();
  return std::vector<int32_t>(d, d + h.numel());
}

// True when `word` occurs in `text` as a whole: not inside a longer number or name.
bool mentions(const std::string& text, const std::string& word) {
  auto alnum = [](char ch) { return std::isalnum(static_cast<unsigned char>(ch)) != 0; };
  for (size_t at = text.find(word); at != std::string::npos; at = text.find(word, at + 1)) {
    const size_t end = at + word.size();
    const bool starts = !alnum(word.front()) || at == 0 || !alnum(text[at - 1]);
    const bool ends = !alnum(word.back()) || end == text.size() || !alnum(text[end]);
    if (starts && ends) return true;
  }
  return false;
}

void expect_error_naming(const std::function<void()>& fn, const std::vector<std::string>& words,
                         const std::string& what) {
  try {
    fn();
    ADD_FAILURE() << what << ": expected loraplex::Error";
  } catch (const Error& e) {
    for (const std::string& w : words) {
      EXPECT_TRUE(mentions(e.what(), w))
          << what << ": the message does not name '" << w << "': " << e.what();
    }
  }
}

// ---------------------------------------------------------------- routings

// Pair t * top_k + j goes to the j-th of top_k distinct experts of token t (as a router picks
// them); then a fraction `unrouted` of the pairs gets an id outside [0, experts), alternately -1
// and `experts`.
std::vector<int32_t> topk_routing(int tokens, int top_k, int experts, double unrouted,
                                  std::mt19937_64& rng) {
  std::vector<int32_t> ids;
  std::vector<int32_t> order(static_cast<size_t>(experts));
  std::iota(order.begin(), order.end(), 0);
  for (int t = 0; t < tokens; ++t) {
    std::shuffle(order.begin(), order.end(), rng);
    ids.insert(ids.end(), order.begin(), order.begin() + top_k);
  }
  std::bernoulli_distribution drop(unrouted);
  bool low = true;
  for (int32_t& id : ids) {
    if (unrouted > 0 && drop(rng)) {
      id = low ? -1 : experts;
      low = !low;
    }
  }
  return ids;
}

std::vector<int32_t> repeated(const std::vector<std::pair<int32_t, int>>& counts,
                              std::mt19937_64& rng) {
  std::vector<int32_t> ids;
  for (const auto& [expert, count] : counts) ids.insert(ids.end(), count, expert);
  std::shuffle(ids.begin(), ids.end(), rng);
  return ids;
}

// 7 experts with one pair and one with 33: ceil(33 / 16) + 7 = 10 = moe_expert_max_blocks(40, 8).
std::vector<int32_t> worst_case_routing() {
  std::mt19937_64 rng(3);
  return repeated({{0, 1}, {1, 1}, {2, 1}, {3, 1}, {4, 33}, {5, 1}, {6, 1}, {7, 1}}, rng);
}

struct Routing {
  std::string name;
  int experts = 0;
  std::vector<int32_t> ids;
};

std::vector<Routing> block_routings() {
  std::mt19937_64 rng(7);
  auto uniform = [&](int64_t pairs, int32_t lo, int32_t hi) {
    std::uniform_int_distribution<int32_t> pick(lo, hi);
    std::vector<int32_t> ids(static_cast<size_t>(pairs));
    for (int32_t& id : ids) id = pick(rng);
    return ids;
  };
  std::vector<Routing> r;
  r.push_back({"37 tokens top-2 of 8 experts", 8, topk_routing(37, 2, 8, 0.0, rng)});
  r.push_back({"74 ids uniform over 8 experts", 8, uniform(74, 0, 7)});
  r.push_back({"50 pairs all on expert 5", 8, std::vector<int32_t>(50, 5)});
  {
    std::vector<int32_t> ids = uniform(60, 0, 2);
    for (int32_t& id : ids) id = id == 0 ? 0 : id == 1 ? 3 : 15;
    r.push_back({"only experts 0, 3 and 15 of 16 have pairs", 16, ids});
  }
  r.push_back({"experts with 40, 17, 16, 1, 33 and 32 pairs", 8,
               repeated({{2, 40}, {5, 17}, {0, 16}, {7, 1}, {3, 33}, {6, 32}}, rng)});
  r.push_back({"one pair on 7 experts and 33 on one", 8, worst_case_routing()});
  {
    std::vector<int32_t> ids = uniform(64, 0, 7);
    const int32_t outside[] = {
        -1,  8, 9, -2, std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max(),
        1000};
    for (size_t i = 0; i < ids.size(); i += 3) ids[i] = outside[(i / 3) % 7];
    r.push_back({"ids outside [0, 8) mixed in", 8, ids});
  }
  r.push_back({"all ids outside [0, 4)", 4, {-1, 4, -1, 7, 4, -1}});
  r.push_back({"3 pairs over 128 experts", 128, {127, 0, 127}});
  r.push_back({"3 tokens top-8 of 128 experts", 128, topk_routing(3, 8, 128, 0.0, rng)});
  r.push_back({"40 tokens top-8 of 128 experts", 128, topk_routing(40, 8, 128, 0.1, rng)});
  r.push_back({"one pair", 1, {0}});
  r.push_back({"no pairs", 4, {}});
  return r;
}

// ---------------------------------------------------------------- block table

struct BlockTable {
  std::vector<int32_t> expert;  // [max_blocks]
  std::vector<int32_t> pairs;   // [max_blocks * kRows]
};

// moe_expert_blocks on `dev`, over block tensors that start out as kGarbage.
BlockTable build_blocks(const std::vector<int32_t>& ids, int experts, int64_t max_blocks,
                        Device dev) {
  const Stream stream = stream_for(dev);
  Tensor be = Tensor::empty({max_blocks}, DType::kI32);
  Tensor bp = Tensor::empty({max_blocks * kRows}, DType::kI32);
  be.fill_(kGarbage);
  bp.fill_(kGarbage);
  Tensor be_dev = be.to(dev, stream);
  Tensor bp_dev = bp.to(dev, stream);
  layer_ops::moe_expert_blocks(int_tensor(ids, dev, stream), experts, be_dev, bp_dev, stream);
  stream.synchronize();
  return {ints_of(be_dev, stream), ints_of(bp_dev, stream)};
}

// Checks `t` against the definition of the block table of `ids` over `experts` experts
// (kernels::MoeExpertBlocksArgs), reporting every kind of violation; returns the used blocks.
int64_t expect_block_table(const std::vector<int32_t>& ids, int experts, const BlockTable& t,
                           const std::string& what) {
  const auto max_blocks = static_cast<int64_t>(t.expert.size());
  const auto num_pairs = static_cast<int64_t>(ids.size());
  if (static_cast<int64_t>(t.pairs.size()) != max_blocks * kRows) {
    ADD_FAILURE() << what << ": " << t.pairs.size() << " pair entries for " << max_blocks
                  << " blocks";
    return 0;
  }
  std::vector<std::string> errors;
  auto fail = [&](const std::string& s) { errors.push_back(s); };
  auto valid = [&](int32_t e) { return e >= 0 && e < experts; };

  int64_t used = 0;
  while (used < max_blocks && t.expert[used] != -1) ++used;
  for (int64_t b = used; b < max_blocks; ++b) {
    if (t.expert[b] != -1) {
      fail(str("block ", b, " names expert ", t.expert[b], " after unused block ", used));
    }
    for (int64_t i = 0; i < kRows; ++i) {
      if (t.pairs[b * kRows + i] != -1) {
        fail(str("unused block ", b, " entry ", i, " holds ", t.pairs[b * kRows + i]));
      }
    }
  }
  std::vector<int64_t> count(static_cast<size_t>(experts), 0);
  std::vector<int64_t> blocks(static_cast<size_t>(experts), 0);
  std::vector<int64_t> seen(static_cast<size_t>(num_pairs), 0);
  for (int32_t id : ids) {
    if (valid(id)) ++count[static_cast<size_t>(id)];
  }
  // Nondecreasing experts over the used blocks also make each expert's blocks contiguous.
  for (int64_t b = 0; b < used; ++b) {
    const int32_t e = t.expert[b];
    if (!valid(e)) {
      fail(str("used block ", b, " names expert ", e));
      continue;
    }
    if (b > 0 && t.expert[b - 1] > e) {
      fail(str("block ", b, " of expert ", e, " follows a block of expert ", t.expert[b - 1]));
    }
    ++blocks[static_cast<size_t>(e)];
    for (int64_t i = 0; i < kRows; ++i) {
      const int32_t q = t.pairs[b * kRows + i];
      if (q == -1) continue;
      if (q < 0 || q >= num_pairs) {
        fail(str("block ", b, " entry ", i, " holds ", q, ", not a pair or -1"));
        continue;
      }
      ++seen[static_cast<size_t>(q)];
      if (ids[static_cast<size_t>(q)] != e) {
        fail(str("block ", b, " of expert ", e, " lists pair ", q, " routed to ",
                 ids[static_cast<size_t>(q)]));
      }
    }
  }
  for (int e = 0; e < experts; ++e) {
    const int64_t want = (count[static_cast<size_t>(e)] + kRows - 1) / kRows;
    if (blocks[static_cast<size_t>(e)] != want) {
      fail(str("expert ", e, " has ", count[static_cast<size_t>(e)], " pairs in ",
               blocks[static_cast<size_t>(e)], " blocks, expected ", want));
    }
  }
  for (int64_t p = 0; p < num_pairs; ++p) {
    const int64_t want = valid(ids[static_cast<size_t>(p)]) ? 1 : 0;
    if (seen[static_cast<size_t>(p)] != want) {
      fail(str("pair ", p, " (id ", ids[static_cast<size_t>(p)], ") listed ",
               seen[static_cast<size_t>(p)], " times, expected ", want));
    }
  }
  std::string first;
  for (size_t i = 0; i < errors.size() && i < 8; ++i) first += "\n  " + errors[i];
  EXPECT_TRUE(errors.empty()) << what << ": " << errors.size() << " violations" << first;
  return used;
}

void check_routings(Device dev) {
  for (const Routing& r : block_routings()) {
    const auto pairs = static_cast<int64_t>(r.ids.size());
    const int64_t need = kernels::moe_expert_max_blocks(pairs, r.experts);
    for (int64_t spare : {int64_t{0}, int64_t{5}}) {
      const std::string what = str(r.name, ", ", need + spare, " blocks on ", dev);
      const BlockTable t = build_blocks(r.ids, r.experts, need + spare, dev);
      expect_block_table(r.ids, r.experts, t, what);
      if (dev.is_cuda()) {
        // The block experts follow from the counts alone; only the pairs' order may differ.
        EXPECT_EQ(t.expert, build_blocks(r.ids, r.experts, need + spare, Device::cpu()).expert)
            << what;
      }
    }
  }
}

void check_too_few_blocks(Device dev) {
  const Stream stream = stream_for(dev);
  const std::string where = str(" on ", dev);
  auto run = [&](const std::vector<int32_t>& ids, int experts, int64_t blocks, int64_t entries) {
    Tensor be = Tensor::empty({blocks}, DType::kI32, dev);
    Tensor bp = Tensor::empty({entries}, DType::kI32, dev);
    layer_ops::moe_expert_blocks(int_tensor(ids, dev, stream), experts, be, bp, stream);
  };
  const std::vector<int32_t> worst = worst_case_routing();
  expect_error_naming([&] { run(worst, 8, 9, 9 * kRows); }, {"9", "40", "8", "10"},
                      "9 blocks for 40 pairs over 8 experts" + where);
  expect_error_naming(
      [&] {
        run({127, 0, 127}, 128, 2, 2 * kRows);
      },
      {"2", "3", "128"}, "2 blocks for 3 pairs over 128 experts" + where);
  expect_error_naming([&] { run(worst, 0, 50, 50 * kRows); }, {"0", "40"}, "no experts" + where);
  expect_error_naming([&] { run(worst, 8, 10, 10 * kRows - 1); }, {"160", "[159]"},
                      "block pairs one short" + where);
}

TEST(MoeExpertBlocks, ListsEveryRoutedPairOnceInBlocksOfItsExpert) {
  check_routings(Device::cpu());
}

TEST(MoeExpertBlocks, WorstCaseRoutingFillsEveryBlockOfTheBound) {
  const std::vector<int32_t> ids = worst_case_routing();
  ASSERT_EQ(ids.size(), 40u);
  ASSERT_EQ(kernels::moe_expert_max_blocks(40, 8), 10);
  const BlockTable t = build_blocks(ids, 8, 10, Device::cpu());
  EXPECT_EQ(expect_block_table(ids, 8, t, "worst case"), 10);
  EXPECT_EQ(t.expert, (std::vector<int32_t>{0, 1, 2, 3, 4, 4, 4, 5, 6, 7}));
}

TEST(MoeExpertBlocks, TooFewBlocksThrowNamingTheCounts) {
  check_too_few_blocks(Device::cpu());
  // The launcher guards its writes without the tensor layer.
  const std::vector<int32_t> ids = worst_case_routing();
  std::vector<int32_t> be(9, kGarbage);
  std::vector<int32_t> bp(9 * kRows, kGarbage);
  kernels::MoeExpertBlocksArgs a;
  a.topk_ids = ids.data();
  a.num_pairs = 40;
  a.num_experts = 8;
  a.max_blocks = 9;
  a.block_expert = be.data();
  a.block_pairs = bp.data();
  const Status s = kernels::cpu::moe_expert_blocks(a);
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(mentions(s.message(), "9") && mentions(s.message(), "10")) << s.message();
}

// ---------------------------------------------------------------- expert GEMM

struct GemmCase {
  GemmCase& pair_rows() {
    x_rows_are_pairs = true;
    return *this;
  }
  GemmCase& no_scale() {
    row_scale = false;
    return *this;
  }
  // x is columns [col0, col0 + k) of a [rows, col0 + k + pad] tensor.
  GemmCase& x_within(int64_t col0, int64_t pad) {
    x_col0 = col0;
    x_pad = pad;
    return *this;
  }
  // out is columns [col0, col0 + n) of a [pairs, col0 + n + pad] tensor.
  GemmCase& out_within(int64_t col0, int64_t pad) {
    out_col0 = col0;
    out_pad = pad;
    return *this;
  }
  GemmCase& all_routed() {
    unrouted = 0.0;
    return *this;
  }
  GemmCase& spare_blocks(int64_t b) {
    spare = b;
    return *this;
  }
  std::string describe() const {
    return str(dtype, " ", tokens, " tokens top-", top_k, " of ", experts, " experts, n ", n,
               ", k ", k, x_rows_are_pairs ? ", pair rows" : ", token rows",
               row_scale ? ", scaled" : "", ", x cols ", x_col0, "+", k, "+", x_pad, ", out cols ",
               out_col0, "+", n, "+", out_pad, ", unrouted ", unrouted, ", spare blocks ", spare);
  }

  DType dtype = DType::kF32;
  int tokens = 0, top_k = 1, experts = 0;
  int64_t n = 0, k = 0;
  uint64_t seed = 0;
  bool x_rows_are_pairs = false;
  bool row_scale = true;
  int64_t x_col0 = 0, x_pad = 0, out_col0 = 0, out_pad = 0;
  double unrouted = 0.15;
  int64_t spare = 0;
};

GemmCase gemm_case(DType dtype, int tokens, int top_k, int experts, int64_t n, int64_t k,
                   uint64_t seed) {
  GemmCase c;
  c.dtype = dtype;
  c.tokens = tokens;
  c.top_k = top_k;
  c.experts = experts;
  c.n = n;
  c.k = k;
  c.seed = seed;
  return c;
}

struct GemmProblem {
  GemmCase c;
  int64_t pairs = 0;
  int64_t width = 0;  // of out's wider tensor
  std::vector<int32_t> ids;
  Tensor x_wide;    // [tokens or pairs, x_col0 + k + x_pad]
  Tensor w;         // [experts, n, k]
  Tensor scale;     // float32 [pairs], or undefined
  Tensor out_init;  // [pairs, width], kSentinel
};

GemmProblem make_gemm_problem(const GemmCase& c) {
  std::mt19937_64 rng(c.seed);
  GemmProblem p;
  p.c = c;
  p.pairs = int64_t{c.tokens} * c.top_k;
  p.width = c.out_col0 + c.n + c.out_pad;
  p.ids = topk_routing(c.tokens, c.top_k, c.experts, c.unrouted, rng);
  const int64_t x_rows = c.x_rows_are_pairs ? p.pairs : c.tokens;
  p.x_wide = test::random_tensor({x_rows, c.x_col0 + c.k + c.x_pad}, c.dtype, rng);
  p.w = test::random_tensor({c.experts, c.n, c.k}, c.dtype, rng, 0.5f);
  if (c.row_scale) p.scale = test::random_tensor({p.pairs}, DType::kF32, rng);
  p.out_init = Tensor::empty({p.pairs, p.width}, c.dtype);
  p.out_init.fill_(kSentinel);
  return p;
}

// The expert each pair's output row is computed with, -1 where no block lists it.
std::vector<int32_t> routed_experts(const GemmProblem& p) {
  std::vector<int32_t> e = p.ids;
  for (int32_t& id : e) {
    if (id < 0 || id >= p.c.experts) id = -1;
  }
  return e;
}

struct Reference {
  std::vector<int32_t> expert;    // [pairs], -1 = the row is not listed
  std::vector<double> value;      // [pairs * n]: scale[p] * sum_c x[row(p)][c] * w[e][j][c]
  std::vector<double> magnitude;  // [pairs * n]: |scale[p]| * sum_c |x[row(p)][c] * w[e][j][c]|
};

Reference reference(const GemmProblem& p, const std::vector<int32_t>& expert) {
  const GemmCase& c = p.c;
  const std::vector<double> x = p.x_wide.narrow(1, c.x_col0, c.k).to_double_vector();
  const std::vector<double> w = p.w.to_double_vector();
  const std::vector<double> s =
      p.scale.defined() ? p.scale.to_double_vector() : std::vector<double>();
  Reference r;
  r.expert = expert;
  r.value.assign(static_cast<size_t>(p.pairs * c.n), 0.0);
  r.magnitude.assign(static_cast<size_t>(p.pairs * c.n), 0.0);
  for (int64_t q = 0; q < p.pairs; ++q) {
    const int32_t e = expert[static_cast<size_t>(q)];
    if (e < 0) continue;
    const int64_t row = c.x_rows_are_pairs ? q : q / c.top_k;
    const double scale = s.empty() ? 1.0 : s[static_cast<size_t>(q)];
    for (int64_t j = 0; j < c.n; ++j) {
      double acc = 0.0;
      double mag = 0.0;
      for (int64_t i = 0; i < c.k; ++i) {
        const double term = x[static_cast<size_t>(row * c.k + i)] *
                            w[static_cast<size_t>((int64_t{e} * c.n + j) * c.k + i)];
        acc += term;
        mag += std::fabs(term);
      }
      r.value[static_cast<size_t>(q * c.n + j)] = scale * acc;
      r.magnitude[static_cast<size_t>(q * c.n + j)] = std::fabs(scale) * mag;
    }
  }
  return r;
}

double unit_roundoff(DType dtype) {
  switch (dtype) {
    case DType::kF16:
      return std::ldexp(1.0, -11);
    case DType::kBF16:
      return std::ldexp(1.0, -8);
    default:
      return std::ldexp(1.0, -24);
  }
}

struct Mismatches {
  int64_t count = 0;
  std::string first;  // the first few, one a line
};

// Compares `got` ([pairs, width], CPU) with `want` ([pairs * n]) on the listed rows' n columns:
// |got - want| <= out_units * u(dtype) * |want| + acc_units * (k + 1) * u(f32) * magnitude, the
// output rounding plus the bound of a float accumulation in any order (acc_units 2 leaves room
// for accumulators that truncate). Every other element must keep out_init's value exactly.
Mismatches gemm_mismatches(const GemmProblem& p, const Reference& ref,
                           const std::vector<double>& want, const Tensor& got, double out_units,
                           double acc_units) {
  const GemmCase& c = p.c;
  const std::vector<double> g = got.to_double_vector();
  const std::vector<double> init = p.out_init.to_double_vector();
  Mismatches m;
  if (g.size() != init.size()) {
    m.count = 1;
    m.first = str("\n  out is ", got.describe(), ", expected ", p.out_init.describe());
    return m;
  }
  const double u_out = unit_roundoff(c.dtype);
  const double u_acc = (static_cast<double>(c.k) + 1) * unit_roundoff(DType::kF32);
  const double atol = c.dtype == DType::kF16 ? std::ldexp(1.0, -24) : 0.0;
  int shown = 0;
  for (int64_t q = 0; q < p.pairs; ++q) {
    const bool listed = ref.expert[static_cast<size_t>(q)] >= 0;
    for (int64_t col = 0; col < p.width; ++col) {
      const double v = g[static_cast<size_t>(q * p.width + col)];
      const int64_t j = col - c.out_col0;
      std::string bad;
      if (listed && j >= 0 && j < c.n) {
        const auto idx = static_cast<size_t>(q * c.n + j);
        const double tol = out_units * u_out * std::fabs(want[idx]) +
                           acc_units * u_acc * ref.magnitude[idx] + atol;
        if (!(std::fabs(v - want[idx]) <= tol)) {
          bad = str("pair ", q, " (expert ", ref.expert[static_cast<size_t>(q)], ") column ", j,
                    ": ", v, ", expected ", want[idx], " +- ", tol);
        }
      } else if (v != init[static_cast<size_t>(q * p.width + col)]) {
        bad = str(listed ? "pair " : "unlisted pair ", q, " wide column ", col, ": ", v,
                  ", it held ", init[static_cast<size_t>(q * p.width + col)]);
      }
      if (!bad.empty()) {
        ++m.count;
        if (shown++ < 6) m.first += "\n  " + bad;
      }
    }
  }
  return m;
}

void expect_gemm_output(const GemmProblem& p, const Reference& ref, const std::vector<double>& want,
                        const Tensor& got, double out_units, double acc_units,
                        const std::string& what) {
  const Mismatches m = gemm_mismatches(p, ref, want, got, out_units, acc_units);
  EXPECT_EQ(m.count, 0) << what << " [" << p.c.describe() << "]" << m.first;
}

// The listed columns of a [pairs, width] result as [pairs * n].
std::vector<double> listed_columns(const GemmProblem& p, const Tensor& wide) {
  return wide.narrow(1, p.c.out_col0, p.c.n).to_double_vector();
}

struct GemmRun {
  Tensor out;  // [pairs, width] on the CPU
  BlockTable table;
};

// Builds the block table on `dev` (or uploads `given`) and runs the expert GEMM there.
GemmRun run_gemm(const GemmProblem& p, Device dev, const BlockTable* given = nullptr) {
  const GemmCase& c = p.c;
  const Stream stream = stream_for(dev);
  Tensor be;
  Tensor bp;
  if (given != nullptr) {
    be = int_tensor(given->expert, dev, stream);
    bp = int_tensor(given->pairs, dev, stream);
  } else {
    const int64_t max_blocks = kernels::moe_expert_max_blocks(p.pairs, c.experts) + c.spare;
    be = Tensor::empty({max_blocks}, DType::kI32, dev);
    bp = Tensor::empty({max_blocks * kRows}, DType::kI32, dev);
    layer_ops::moe_expert_blocks(int_tensor(p.ids, dev, stream), c.experts, be, bp, stream);
  }
  const Tensor x = p.x_wide.to(dev, stream).narrow(1, c.x_col0, c.k);
  const Tensor w = p.w.to(dev, stream);
  const Tensor scale = p.scale.defined() ? p.scale.to(dev, stream) : Tensor();
  Tensor out_wide = dev.is_cpu() ? p.out_init.clone() : p.out_init.to(dev, stream);
  Tensor out = out_wide.narrow(1, c.out_col0, c.n);
  layer_ops::moe_expert_gemm(x, c.x_rows_are_pairs, c.top_k, w, be, bp, scale, out, stream);
  stream.synchronize();
  return {out_wide.to(Device::cpu(), stream), {ints_of(be, stream), ints_of(bp, stream)}};
}

// Odd sizes: n and k of 1, 7, 37, 130 and 200 (k a multiple of 8 and not), top_k 1, 2, 3 and 8,
// token and pair rows, unscaled rows, strided and offset x and out, spare blocks, experts with
// more than 32 pairs, fewer pairs than experts.
std::vector<GemmCase> odd_cases(DType dt) {
  return {
      gemm_case(dt, 5, 1, 4, 1, 200, 1).no_scale(),
      gemm_case(dt, 6, 1, 3, 130, 1, 2).out_within(0, 2),
      gemm_case(dt, 9, 2, 8, 7, 37, 3).pair_rows().out_within(0, 3),
      gemm_case(dt, 13, 3, 5, 37, 7, 4).x_within(1, 2).out_within(2, 5).spare_blocks(3),
      gemm_case(dt, 4, 8, 16, 130, 200, 5).out_within(0, 6),
      gemm_case(dt, 40, 2, 2, 200, 130, 6).pair_rows().no_scale().x_within(0, 3).all_routed(),
      gemm_case(dt, 3, 8, 128, 37, 64, 7).out_within(0, 8),
      gemm_case(dt, 17, 1, 2, 130, 8, 8).pair_rows().out_within(1, 0).all_routed(),
      gemm_case(dt, 33, 2, 8, 200, 136, 9).no_scale().out_within(0, 56).spare_blocks(1),
  };
}

void check_against_reference(const GemmCase& c) {
  const GemmProblem p = make_gemm_problem(c);
  const Reference ref = reference(p, routed_experts(p));
  const GemmRun run = run_gemm(p, Device::cpu());
  expect_gemm_output(p, ref, ref.value, run.out, 1.0, 2.0, "cpu vs double reference");
}

TEST(MoeExpertGemm, MatchesDoubleReferenceF32) {
  for (const GemmCase& c : odd_cases(DType::kF32)) check_against_reference(c);
}
TEST(MoeExpertGemm, MatchesDoubleReferenceBf16) {
  for (const GemmCase& c : odd_cases(DType::kBF16)) check_against_reference(c);
}
TEST(MoeExpertGemm, MatchesDoubleReferenceF16) {
  for (const GemmCase& c : odd_cases(DType::kF16)) check_against_reference(c);
}

// The comparison itself must be able to fail: it rejects an output that leaves out one term of
// k, and a single stray write to an unlisted row or outside column.
TEST(MoeExpertGemm, OutputCheckCatchesAMissingTermAndStrayWrites) {
  for (DType dt : {DType::kF32, DType::kBF16}) {
    const GemmCase c = gemm_case(dt, 20, 2, 8, 37, 200, 31).out_within(1, 2);
    const GemmProblem p = make_gemm_problem(c);
    const Reference ref = reference(p, routed_experts(p));
    const GemmRun run = run_gemm(p, Device::cpu());
    ASSERT_EQ(gemm_mismatches(p, ref, ref.value, run.out, 1.0, 2.0).count, 0);
    // Leave out term k - 1 of every listed element: most elements must fail.
    GemmCase shorter = c;
    shorter.k = c.k - 1;
    shorter.x_pad = c.x_pad + 1;
    GemmProblem cut = p;
    cut.c = shorter;
    cut.w = p.w.narrow(2, 0, c.k - 1).contiguous();
    const GemmRun cut_run = run_gemm(cut, Device::cpu());
    const Mismatches m = gemm_mismatches(p, ref, ref.value, cut_run.out, 1.0, 2.0);
    int64_t listed = 0;
    for (int32_t e : ref.expert) listed += e >= 0 ? c.n : 0;
    EXPECT_GT(m.count, listed / 2) << dt << ": " << m.count << " of " << listed;
    // One stray write to an unlisted row and one to a column outside the narrow.
    int64_t unlisted = -1;
    for (int64_t q = 0; q < p.pairs && unlisted < 0; ++q) {
      if (ref.expert[static_cast<size_t>(q)] < 0) unlisted = q;
    }
    ASSERT_GE(unlisted, 0);
    Tensor stray = run.out.clone();
    stray.narrow(0, unlisted, 1).narrow(1, 5, 1).fill_(1.0);
    stray.narrow(0, 0, 1).narrow(1, 0, 1).fill_(1.0);
    EXPECT_EQ(gemm_mismatches(p, ref, ref.value, stray, 1.0, 2.0).count, 2) << dt;
  }
}

// Blanks every third entry the table lists (a hole inside a block); those pairs leave the
// reference's listed rows.
BlockTable with_holes(const BlockTable& t, std::vector<int32_t>& expert) {
  BlockTable h = t;
  int64_t listed = 0;
  for (int32_t& q : h.pairs) {
    if (q >= 0 && listed++ % 3 == 0) {
      expert[static_cast<size_t>(q)] = -1;
      q = -1;
    }
  }
  return h;
}

TEST(MoeExpertGemm, PairsTheTableDoesNotListKeepTheirRows) {
  for (DType dt : {DType::kF32, DType::kBF16}) {
    const GemmCase c = gemm_case(dt, 20, 2, 4, 37, 64, 41).out_within(2, 3).spare_blocks(2);
    const GemmProblem p = make_gemm_problem(c);
    const BlockTable t = build_blocks(
        p.ids, c.experts, kernels::moe_expert_max_blocks(p.pairs, c.experts) + 2, Device::cpu());
    std::vector<int32_t> expert = routed_experts(p);
    const BlockTable holes = with_holes(t, expert);
    const Reference ref = reference(p, expert);
    const GemmRun run = run_gemm(p, Device::cpu(), &holes);
    expect_gemm_output(p, ref, ref.value, run.out, 1.0, 2.0, "cpu with holes in the table");
  }
}

// A problem whose tensors the bad-input cases replace one at a time.
struct SmallProblem {
  SmallProblem() {
    std::mt19937_64 rng(5);
    ids = topk_routing(6, 2, 4, 0.0, rng);
    x = test::random_tensor({6, 37}, DType::kBF16, rng);
    w = test::random_tensor({4, 7, 37}, DType::kBF16, rng);
    scale = test::random_tensor({12}, DType::kF32, rng);
    out = Tensor::empty({12, 7}, DType::kBF16);
    const int64_t blocks = kernels::moe_expert_max_blocks(12, 4);
    be = Tensor::empty({blocks}, DType::kI32);
    bp = Tensor::empty({blocks * kRows}, DType::kI32);
    layer_ops::moe_expert_blocks(Tensor::from_vector(ids, {12}), 4, be, bp, Stream());
  }
  void run() { layer_ops::moe_expert_gemm(x, pair_rows, 2, w, be, bp, scale, out, Stream()); }
  std::vector<int32_t> ids;
  bool pair_rows = false;
  Tensor x, w, scale, out, be, bp;
};

TEST(MoeExpertGemm, RejectsBadShapesNamingThem) {
  {
    SmallProblem s;
    s.run();  // the unchanged problem runs
  }
  std::mt19937_64 rng(6);
  const auto bf16 = DType::kBF16;
  const std::string f16_name(dtype_name(DType::kF16));
  const std::string bf16_name(dtype_name(bf16));
  {
    SmallProblem s;
    s.w = test::random_tensor({4, 7, 38}, bf16, rng);
    expect_error_naming([&] { s.run(); }, {"[4, 7, 38]", "[6, 37]"}, "w with k 38");
  }
  {
    SmallProblem s;
    s.w = test::random_tensor({4, 8, 37}, bf16, rng);
    expect_error_naming([&] { s.run(); }, {"[4, 8, 37]", "[12, 7]"}, "w with n 8");
  }
  {
    SmallProblem s;
    s.w = test::random_tensor({7, 37}, bf16, rng);
    expect_error_naming([&] { s.run(); }, {"[7, 37]"}, "2-D w");
  }
  {
    SmallProblem s;
    s.w = test::random_tensor({4, 37, 7}, bf16, rng).transpose(1, 2);
    expect_error_naming([&] { s.run(); }, {"[4, 7, 37]"}, "w not contiguous");
  }
  {
    SmallProblem s;
    s.w = test::random_tensor({4, 7, 37}, DType::kF16, rng);
    expect_error_naming([&] { s.run(); }, {f16_name, bf16_name, "[4, 7, 37]"}, "float16 w");
  }
  {
    SmallProblem s;
    s.out = Tensor::empty({12, 7}, DType::kF32);
    expect_error_naming([&] { s.run(); }, {"float32", bf16_name, "[12, 7]"}, "float32 out");
  }
  {
    SmallProblem s;
    s.scale = test::random_tensor({11}, DType::kF32, rng);
    expect_error_naming([&] { s.run(); }, {"[11]", "12"}, "row_scale of 11");
  }
  {
    SmallProblem s;
    s.scale = test::random_tensor({12}, bf16, rng);
    expect_error_naming([&] { s.run(); }, {bf16_name + "[12]"}, "bfloat16 row_scale");
  }
  {
    SmallProblem s;
    s.x = test::random_tensor({5, 37}, bf16, rng);
    expect_error_naming([&] { s.run(); }, {"[5, 37]", "[12, 7]", "2"}, "5 token rows for 12");
  }
  {
    SmallProblem s;
    s.pair_rows = true;
    expect_error_naming([&] { s.run(); }, {"[6, 37]", "[12, 7]"}, "6 pair rows for 12 pairs");
  }
  {
    SmallProblem s;
    s.bp = Tensor::empty({s.bp.numel() - 1}, DType::kI32);
    expect_error_naming([&] { s.run(); }, {str(s.bp.numel() + 1), str("[", s.bp.numel(), "]")},
                        "block pairs one short");
  }
}

TEST(MoeExpertGemm, CpuRejectsTableEntriesOutsideTheProblem) {
  auto with_entry = [](int64_t at, int32_t value, bool expert) {
    SmallProblem s;
    (expert ? s.be : s.bp).data<int32_t>()[at] = value;
    s.run();
  };
  expect_error_naming([&] { with_entry(3, 12, false); }, {"12"}, "pair 12 of 12");
  expect_error_naming([&] { with_entry(0, -2, false); }, {"-2"}, "pair -2");
  expect_error_naming([&] { with_entry(0, 4, true); }, {"4"}, "expert 4 of 4");
}

// ---------------------------------------------------------------- CUDA against the CPU

void check_cuda_case(const GemmCase& c) {
  const GemmProblem p = make_gemm_problem(c);
  const Reference ref = reference(p, routed_experts(p));
  const GemmRun cpu = run_gemm(p, Device::cpu());
  const GemmRun gpu = run_gemm(p, Device::cuda(0));
  expect_block_table(p.ids, c.experts, gpu.table, "cuda block table [" + c.describe() + "]");
  EXPECT_EQ(gpu.table.expert, cpu.table.expert) << c.describe();
  expect_gemm_output(p, ref, ref.value, cpu.out, 1.0, 2.0, "cpu vs double reference");
  expect_gemm_output(p, ref, ref.value, gpu.out, 1.0, 2.0, "cuda vs double reference");
  expect_gemm_output(p, ref, listed_columns(p, cpu.out), gpu.out, 2.0, 4.0, "cuda vs cpu");
}

// The tensor-core shapes: k a multiple of 8, n not a multiple of 128, 8 experts top-2 and 128
// experts top-8, aligned and (last) odd row strides and offsets.
std::vector<GemmCase> tensor_core_cases(DType dt) {
  return {
      gemm_case(dt, 1, 2, 8, 200, 64, 11),
      gemm_case(dt, 5, 2, 8, 384, 136, 12).no_scale().out_within(0, 8),
      gemm_case(dt, 33, 2, 8, 1000, 520, 13),
      gemm_case(dt, 100, 2, 8, 200, 136, 14).pair_rows().spare_blocks(4),
      gemm_case(dt, 100, 2, 8, 384, 64, 15).all_routed().x_within(0, 8).out_within(8, 8),
      gemm_case(dt, 3, 8, 128, 200, 520, 16),
      gemm_case(dt, 40, 8, 128, 384, 136, 17).out_within(0, 24),
      gemm_case(dt, 33, 2, 8, 200, 64, 18).x_within(3, 1).out_within(5, 2),
  };
}

TEST(MoeExpertBlocks, Cuda_SameDefinitionAsCpu) {
  LORAPLEX_REQUIRE_GPU();
  check_routings(Device::cuda(0));
  check_too_few_blocks(Device::cuda(0));
}

TEST(MoeExpertGemm, Cuda_OddShapesMatchCpu) {
  LORAPLEX_REQUIRE_GPU();
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (const GemmCase& c : odd_cases(dt)) check_cuda_case(c);
  }
}

TEST(MoeExpertGemm, Cuda_TensorCoreShapesBf16) {
  LORAPLEX_REQUIRE_GPU();
  for (const GemmCase& c : tensor_core_cases(DType::kBF16)) check_cuda_case(c);
}

TEST(MoeExpertGemm, Cuda_TensorCoreShapesF16) {
  LORAPLEX_REQUIRE_GPU();
  for (const GemmCase& c : tensor_core_cases(DType::kF16)) check_cuda_case(c);
}

TEST(MoeExpertGemm, Cuda_TensorCoreShapesF32) {
  LORAPLEX_REQUIRE_GPU();
  for (const GemmCase& c : tensor_core_cases(DType::kF32)) check_cuda_case(c);
}

TEST(MoeExpertGemm, Cuda_KNotMultipleOf8Bf16) {
  LORAPLEX_REQUIRE_GPU();
  check_cuda_case(gemm_case(DType::kBF16, 33, 2, 8, 200, 130, 21));
  check_cuda_case(gemm_case(DType::kBF16, 40, 8, 128, 384, 37, 22).no_scale().out_within(0, 8));
  check_cuda_case(gemm_case(DType::kBF16, 5, 2, 8, 1000, 7, 23).pair_rows());
}

TEST(MoeExpertGemm, Cuda_PairsTheTableDoesNotListKeepTheirRows) {
  LORAPLEX_REQUIRE_GPU();
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    const GemmCase c = gemm_case(dt, 50, 2, 4, 200, 64, 42).out_within(0, 8).spare_blocks(2);
    const GemmProblem p = make_gemm_problem(c);
    const BlockTable t = build_blocks(
        p.ids, c.experts, kernels::moe_expert_max_blocks(p.pairs, c.experts) + 2, Device::cpu());
    std::vector<int32_t> expert = routed_experts(p);
    const BlockTable holes = with_holes(t, expert);
    const Reference ref = reference(p, expert);
    const GemmRun cpu = run_gemm(p, Device::cpu(), &holes);
    const GemmRun gpu = run_gemm(p, Device::cuda(0), &holes);
    expect_gemm_output(p, ref, ref.value, gpu.out, 1.0, 2.0, "cuda with holes vs reference");
    expect_gemm_output(p, ref, listed_columns(p, cpu.out), gpu.out, 2.0, 4.0,
                       "cuda with holes vs cpu");
  }
}

}  // namespace
}  // namespace loraplex
