// Properties every CPU op keeps, checked bit for bit: permuting the tokens permutes the
// outputs; a token's result does not depend on which other tokens or adapters share its batch;
// rows of base-only (slot -1) tokens are untouched.

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

#include "kernels_cpu/op_cases.h"

namespace loraplex::test {
namespace {

const Device kCpu = Device::cpu();

// Rows idx[i] * group .. + group of t along `dim`, in the order of idx.
Tensor gather(const Tensor& t, int64_t dim, const std::vector<int>& idx, int64_t group = 1) {
  Shape shape = t.shape();
  shape[static_cast<size_t>(dim)] = static_cast<int64_t>(idx.size()) * group;
  Tensor out = Tensor::empty(shape, t.dtype());
  for (size_t i = 0; i < idx.size(); ++i) {
    out.narrow(dim, static_cast<int64_t>(i) * group, group)
        .copy_from(t.narrow(dim, idx[i] * group, group));
  }
  return out;
}

template <typename T>
std::vector<T> gather(const std::vector<T>& v, const std::vector<int>& idx, int group = 1) {
  std::vector<T> out;
  for (int i : idx) {
    for (int g = 0; g < group; ++g) out.push_back(v[static_cast<size_t>(i * group + g)]);
  }
  return out;
}

LinearProblem take_tokens(const LinearProblem& p, const std::vector<int>& idx) {
  LinearProblem q = p;
  q.c.num_tokens = static_cast<int>(idx.size());
  q.slots = gather(p.slots, idx);
  q.x = gather(p.x, 0, idx);
  q.mid = gather(p.mid, 1, idx);
  q.y0 = gather(p.y0, 0, idx);
  return q;
}

EmbeddingProblem take_tokens(const EmbeddingProblem& p, const std::vector<int>& idx) {
  EmbeddingProblem q = p;
  q.c.num_tokens = static_cast<int>(idx.size());
  q.slots = gather(p.slots, idx);
  q.token_ids = gather(p.token_ids, idx);
  q.y0 = gather(p.y0, 0, idx);
  return q;
}

MoeProblem take_tokens(const MoeProblem& p, const std::vector<int>& idx) {
  MoeProblem q = p;
  const int k = p.c.top_k;
  q.c.num_tokens = static_cast<int>(idx.size());
  q.slots = gather(p.slots, idx);
  q.topk_ids = gather(p.topk_ids, idx, k);
  q.topk_weights = gather(p.topk_weights, idx, k);
  q.x = p.c.projection == MoeProjection::kW13 ? gather(p.x, 0, idx) : gather(p.x, 0, idx, k);
  q.y0 = gather(p.y0, 0, idx);
  return q;
}

std::vector<int> permutation(int n, uint64_t seed) {
  std::vector<int> perm(static_cast<size_t>(n));
  std::iota(perm.begin(), perm.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(perm.begin(), perm.end(), rng);
  return perm;
}

// Some LoRA tokens of a batch (first, last and a few in between).
std::vector<int> sample_lora_tokens(const std::vector<int32_t>& slots, size_t count) {
  std::vector<int> lora;
  for (size_t t = 0; t < slots.size(); ++t) {
    if (slots[t] >= 0) lora.push_back(static_cast<int>(t));
  }
  if (lora.size() <= count) return lora;
  if (count == 1) return {lora[lora.size() / 2]};
  std::vector<int> out;
  for (size_t i = 0; i < count; ++i) out.push_back(lora[i * (lora.size() - 1) / (count - 1)]);
  return out;
}

// Results of every linear op of a problem, each on the CPU.
std::vector<Tensor> linear_outputs(const LinearProblem& p) {
  const DType out = p.c.dtype;
  return {
      run_shrink(p, OpForm::kSgmv, shrink_output_before(p, DType::kF32), kCpu),
      run_shrink(p, OpForm::kBgmv, shrink_output_before(p, out), kCpu),
      run_expand(p, OpForm::kSgmv, p.mid, true, kCpu),
      run_expand(p, OpForm::kBgmv, p.mid.to(out), false, kCpu),
      run_lora_linear(p, kCpu),
  };
}
// The token dimension of each linear_outputs() entry.
constexpr int64_t kLinearTokenDim[] = {1, 1, 0, 0, 0};

std::vector<LinearCase> property_linear_cases() {
  const auto& all = linear_cases();
  return {all[1], all[4], all[9], all[15], all[17]};
}

TEST(LoraOpsProperty, PermutingTokensPermutesLinearOutputs) {
  for (const LinearCase& c : property_linear_cases()) {
    const LinearProblem p = make_linear_problem(c);
    const std::vector<int> perm = permutation(c.num_tokens, 99);
    // The shrink "before" buffers are drawn from the seed: permute them as well.
    LinearProblem q = take_tokens(p, perm);
    const std::vector<Tensor> base = linear_outputs(p);
    const std::vector<Tensor> shuffled = {
        run_shrink(q, OpForm::kSgmv, gather(shrink_output_before(p, DType::kF32), 1, perm), kCpu),
        run_shrink(q, OpForm::kBgmv, gather(shrink_output_before(p, c.dtype), 1, perm), kCpu),
        run_expand(q, OpForm::kSgmv, q.mid, true, kCpu),
        run_expand(q, OpForm::kBgmv, q.mid.to(c.dtype), false, kCpu),
        run_lora_linear(q, kCpu),
    };
    for (size_t i = 0; i < base.size(); ++i) {
      EXPECT_TRUE(bit_identical(shuffled[i], gather(base[i], kLinearTokenDim[i], perm)))
          << case_name(c) << " output " << i;
    }
  }
}

TEST(LoraOpsProperty, TokenResultIndependentOfTheRestOfTheBatch) {
  for (const LinearCase& c : property_linear_cases()) {
    const LinearProblem p = make_linear_problem(c);
    const std::vector<Tensor> full = {run_expand(p, OpForm::kSgmv, p.mid, true, kCpu),
                                      run_lora_linear(p, kCpu)};
    // Alone in a batch of one.
    for (int t : sample_lora_tokens(p.slots, 4)) {
      const LinearProblem alone = take_tokens(p, {t});
      EXPECT_TRUE(bit_identical(run_expand(alone, OpForm::kSgmv, alone.mid, true, kCpu),
                                gather(full[0], 0, {t})))
          << case_name(c) << " token " << t;
      EXPECT_TRUE(bit_identical(run_lora_linear(alone, kCpu), gather(full[1], 0, {t})))
          << case_name(c) << " token " << t;
    }
    // The same batch with every other token moved to another adapter (or to none).
    const std::vector<int> keep = sample_lora_tokens(p.slots, 1);
    if (keep.empty()) continue;
    LinearProblem other = p;
    std::mt19937_64 rng(5);
    std::uniform_int_distribution<int32_t> slot(-1, c.max_loras - 1);
    for (size_t t = 0; t < other.slots.size(); ++t) {
      if (static_cast<int>(t) != keep[0]) other.slots[t] = slot(rng);
    }
    // The moved tokens' intermediates must be readable for their new ranks.
    other.mid = p.mid.clone();
    other.mid.fill_(0.5);
    other.mid.narrow(1, keep[0], 1).copy_from(p.mid.narrow(1, keep[0], 1));
    EXPECT_TRUE(
        bit_identical(gather(run_expand(other, OpForm::kSgmv, other.mid, true, kCpu), 0, keep),
                      gather(full[0], 0, keep)))
        << case_name(c);
    EXPECT_TRUE(
        bit_identical(gather(run_lora_linear(other, kCpu), 0, keep), gather(full[1], 0, keep)))
        << case_name(c);
  }
}

TEST(LoraOpsProperty, EmbeddingAndFusedMoePermuteAndBatchIndependently) {
  for (const EmbeddingCase& c : embedding_cases()) {
    if (c.num_tokens < 3) continue;
    const EmbeddingProblem p = make_embedding_problem(c);
    const Tensor full = run_embedding(p, kCpu);
    const std::vector<int> perm = permutation(c.num_tokens, 7);
    EXPECT_TRUE(bit_identical(run_embedding(take_tokens(p, perm), kCpu), gather(full, 0, perm)))
        << case_name(c);
    for (int t : sample_lora_tokens(p.slots, 3)) {
      EXPECT_TRUE(bit_identical(run_embedding(take_tokens(p, {t}), kCpu), gather(full, 0, {t})))
          << case_name(c) << " token " << t;
    }
  }
  for (const MoeCase& c : moe_cases()) {
    if (c.num_tokens < 3 || c.num_tokens > 200) continue;
    const MoeProblem p = make_moe_problem(c);
    const Tensor full = run_fused_moe(p, kCpu);
    const std::vector<int> perm = permutation(c.num_tokens, 8);
    EXPECT_TRUE(bit_identical(run_fused_moe(take_tokens(p, perm), kCpu), gather(full, 0, perm)))
        << case_name(c);
    for (int t : sample_lora_tokens(p.slots, 3)) {
      EXPECT_TRUE(bit_identical(run_fused_moe(take_tokens(p, {t}), kCpu), gather(full, 0, {t})))
          << case_name(c) << " token " << t;
    }
  }
}

// Rows (along dim 0 of `got`, or dim 1 when `token_dim` is 1) of slot -1 tokens equal `before`.
::testing::AssertionResult base_rows_untouched(const Tensor& got, const Tensor& before,
                                               const std::vector<int32_t>& slots,
                                               int64_t token_dim = 0) {
  for (size_t t = 0; t < slots.size(); ++t) {
    if (slots[t] != -1) continue;
    const std::vector<int> row = {static_cast<int>(t)};
    ::testing::AssertionResult same =
        bit_identical(gather(got, token_dim, row), gather(before, token_dim, row));
    if (!same) return ::testing::AssertionFailure() << "token " << t << ": " << same.message();
  }
  return ::testing::AssertionSuccess();
}

TEST(LoraOpsProperty, BaseOnlyRowsAreBitIdenticalAfterEveryOp) {
  LinearCase c = linear_cases()[15];
  c.none_fraction = 0.5;
  const LinearProblem p = make_linear_problem(c);
  const Tensor before = shrink_output_before(p, DType::kF32);
  EXPECT_TRUE(base_rows_untouched(run_shrink(p, OpForm::kSgmv, before, kCpu), before, p.slots, 1));
  EXPECT_TRUE(base_rows_untouched(run_shrink(p, OpForm::kBgmv, before, kCpu), before, p.slots, 1));
  for (bool add : {true, false}) {
    EXPECT_TRUE(base_rows_untouched(run_expand(p, OpForm::kSgmv, p.mid, add, kCpu), p.y0, p.slots));
    EXPECT_TRUE(base_rows_untouched(run_expand(p, OpForm::kBgmv, p.mid, add, kCpu), p.y0, p.slots));
    EXPECT_TRUE(base_rows_untouched(run_expand_slice(p, 1, 3, add, kCpu), p.y0, p.slots));
  }
  EXPECT_TRUE(base_rows_untouched(run_lora_linear(p, kCpu), p.y0, p.slots));
  EXPECT_TRUE(base_rows_untouched(run_lora_logits(p, kCpu), p.y0, p.slots));

  EmbeddingCase e = embedding_cases()[1];
  e.none_fraction = 0.5;
  const EmbeddingProblem pe = make_embedding_problem(e);
  EXPECT_TRUE(base_rows_untouched(run_embedding(pe, kCpu), pe.y0, pe.slots));

  for (Fp8Case f : fp8_cases()) {
    f.none_fraction = 0.5;
    f.add_inputs = false;
    const Fp8Problem pf = make_fp8_problem(f);
    EXPECT_TRUE(
        base_rows_untouched(run_expand_fp8(pf, fp8_expand_input(pf, kCpu), kCpu), pf.y0, pf.slots))
        << case_name(f);
  }

  for (MoeCase m : {moe_cases()[0], moe_cases()[5]}) {
    m.none_fraction = 0.5;
    m.add_inputs = false;
    const MoeProblem pm = make_moe_problem(m);
    EXPECT_TRUE(base_rows_untouched(run_fused_moe(pm, kCpu), pm.y0, pm.slots)) << case_name(m);
  }
}

}  // namespace
}  // namespace loraplex::test
