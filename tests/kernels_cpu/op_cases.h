#pragma once
// The multi-LoRA op test cases as data, their random inputs, double-precision references
// written directly from the inputs (never through the library's ops), and runners that execute
// an op of a case on any device through the op routers (kernels/dispatch, punica/lora_dispatch.h,
// the Punica wrapper) and return the result on the CPU. The CPU tests (tests/kernels_cpu) run every
// case on the CPU; a CUDA test links this library (loraplex_op_cases) and runs the same cases on
// the GPU, comparing with the reference and with the CPU result.
//
// Inputs follow the op contract strictly: weights past a slot's rank and intermediate columns
// past a slot's rank (and rows of slot -1 tokens) hold NaN, so an op that reads them, or relies
// on zero padding, produces NaN and fails. Output elements an op must not write are compared
// bit for bit with their value before the call.

#include <gtest/gtest.h>

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "loraplex/core/status.h"
#include "loraplex/core/stream.h"
#include "loraplex/core/tensor.h"
#include "loraplex/kernels/lora_ops.h"
#include "support/random_data.h"

namespace loraplex::test {

// ---------------------------------------------------------------------------------------------
// Comparison

/// Expected value of every output element: `value` (the double reference, or the value before
/// the call for elements the op must not write), `magnitude` (the sum of |terms| that made the
/// value, which bounds fp32 accumulation error) and whether the op writes the element.
struct Reference {
  std::vector<double> value;
  std::vector<double> magnitude;
  std::vector<bool> written;
};

/// |got - value| <= out_rel * |value| + acc_rel * magnitude + abs for written elements.
struct Tolerance {
  double out_rel = 0;  // rounding of the stored output (unit roundoff of its dtype)
  double acc_rel = 0;  // fp32 accumulation (and intermediate rounding) relative to magnitude
  double abs = 1e-30;
};

/// Unit roundoff of a stored value: 2^-24 f32, 2^-11 f16, 2^-8 bf16, 2^-4 e4m3, 2^-3 e5m2.
double unit_roundoff(DType dtype);

/// Checks `got` (contiguous CPU tensor) against the reference: written elements within the
/// tolerance, every other element bit-identical to `before` (same shape and dtype).
::testing::AssertionResult matches_reference(const Tensor& got, const Tensor& before,
                                             const Reference& ref, const Tolerance& tol);
/// Checks two results of the same op bit for bit (CPU tensors of one shape and dtype).
::testing::AssertionResult bit_identical(const Tensor& a, const Tensor& b);

/// A Stream for `device`: the CPU stream or a new CUDA stream.
Stream stream_for(Device device);

// ---------------------------------------------------------------------------------------------
// Linear ops: shrink, expand, BGMV forms, lora_linear, logits

struct LinearCase {
  DType dtype;
  int num_tokens;
  int max_loras;
  int max_rank;  // rank of the stacked weights
  int rank;      // every slot's rank, or 0: mixed, random in 0..max_rank per (slice, slot)
  int64_t hidden;
  std::vector<int64_t> widths;  // output width of each slice
  SlotDistribution dist;
  double none_fraction;  // tokens set to slot -1 (1.0: the whole batch is base-only)
  int64_t offset;        // expand offset_start (columns left of the slices are untouched)
};

/// Readable and unique: "bf16_t77_l4_r16of32_h61_w40x9_zipf_none20".
std::string case_name(const LinearCase& c);
/// GoogleTest prints test parameters with PrintTo: the case name instead of raw bytes.
inline void PrintTo(const LinearCase& c, std::ostream* os) { *os << case_name(c); }
/// The shrink/expand case table: every dtype x rank x slice count pair at least once (ranks
/// 1, 8, 16, 64, 128 and mixed), tokens 1, 3, 77, 199, 1024, max_loras 1, 4, 32, every slot
/// distribution, small odd hidden sizes and one 4096, base-only tokens mixed in.
const std::vector<LinearCase>& linear_cases();
/// Logits cases: one slice as wide as a small odd vocabulary; tokens are sampled rows.
const std::vector<LinearCase>& logits_cases();

struct LinearProblem {
  LinearCase c;
  uint64_t seed = 0;
  std::vector<int32_t> slots;  // [num_tokens]
  std::vector<int32_t> ranks;  // [num_slices, max_loras]
  float scale = 1.0f;
  Tensor x;               // [num_tokens, hidden] dtype
  std::vector<Tensor> a;  // per slice [max_loras, max_rank, hidden] dtype, NaN past the rank
  std::vector<Tensor> b;  // per slice [max_loras, n_s, max_rank] dtype, NaN past the rank
  // [num_slices, num_tokens, max_rank] float32 expand input: random where a slot's rank
  // reaches, NaN elsewhere (and on slot -1 rows).
  Tensor mid;
  Tensor y0;  // [num_tokens, offset + sum n_s + 2] dtype: the output before expand
  int num_slices() const { return static_cast<int>(c.widths.size()); }
  int32_t rank(int slice, int32_t slot) const { return ranks[slice * c.max_loras + slot]; }
};

/// Deterministic inputs of a case (seeded from its name).
LinearProblem make_linear_problem(const LinearCase& c);

/// Shrink reference over the output [num_slices, num_tokens, max_rank]; `before` is the
/// output's content before the call.
Reference reference_shrink(const LinearProblem& p, const Tensor& before);
/// Expand reference over y (p.y0) from `mid` (p.mid, or the same values in another dtype),
/// slices `first_slice`..`first_slice + num_slices`, the first at column `offset`.
Reference reference_expand(const LinearProblem& p, const Tensor& mid, bool add_inputs,
                           int first_slice, int num_slices, int64_t offset);
/// Shrink then expand (add) into y0[:, offset : offset + sum n_s], in double throughout.
Reference reference_linear(const LinearProblem& p);
Tolerance shrink_tolerance(const LinearProblem& p, DType out_dtype);
Tolerance expand_tolerance(const LinearProblem& p, DType mid_dtype);
/// For the whole shrink+expand chain; `mid_dtype` is the dtype the intermediate is kept in.
Tolerance linear_tolerance(const LinearProblem& p, DType mid_dtype);

enum class OpForm { kSgmv, kBgmv };

/// vLLM's per-token gather forms (bgmv_shrink / bgmv_expand): the same math as the SGMV ops,
/// driven by the mapping alone ([num_tokens] slots, in), on the stream's device. Only the tests
/// run them, so they route here rather than in the library.
Status bgmv_shrink_on(const kernels::ShrinkArgs& args, const int32_t* token_lora_mapping,
                      const Stream& stream);
Status bgmv_expand_on(const kernels::ExpandArgs& args, const int32_t* token_lora_mapping,
                      const Stream& stream);

/// The shrink output before the call: random values, so untouched elements are visible.
Tensor shrink_output_before(const LinearProblem& p, DType out_dtype);
/// lora_shrink (SGMV, with batch metadata) or bgmv_shrink on `device` into a copy of
/// `before`; returns the output on the CPU.
Tensor run_shrink(const LinearProblem& p, OpForm form, const Tensor& before, Device device);
/// lora_expand or bgmv_expand of all slices at p.c.offset from `mid` into a copy of p.y0.
Tensor run_expand(const LinearProblem& p, OpForm form, const Tensor& mid, bool add_inputs,
                  Device device);
/// vLLM's bgmv_expand_slice: one slice into y0 at column `offset`.
Tensor run_expand_slice(const LinearProblem& p, int slice, int64_t offset, bool add_inputs,
                        Device device);
/// PunicaWrapper::add_lora_linear into y0's slice columns (a strided view of y0).
Tensor run_lora_linear(const LinearProblem& p, Device device);
/// PunicaWrapper::add_lora_logits with the sampler mapping p.slots (one slice).
Tensor run_lora_logits(const LinearProblem& p, Device device);

// ---------------------------------------------------------------------------------------------
// Embedding LoRA

struct EmbeddingCase {
  DType dtype;
  int num_tokens;
  int max_loras;
  int max_rank;
  int rank;  // 0: mixed
  int64_t vocab;
  int64_t hidden;
  SlotDistribution dist;
  double none_fraction;
};
std::string case_name(const EmbeddingCase& c);
/// GoogleTest prints test parameters with PrintTo: the case name instead of raw bytes.
inline void PrintTo(const EmbeddingCase& c, std::ostream* os) { *os << case_name(c); }
const std::vector<EmbeddingCase>& embedding_cases();

struct EmbeddingProblem {
  EmbeddingCase c;
  std::vector<int32_t> slots;
  std::vector<int32_t> ranks;      // [max_loras]
  std::vector<int32_t> token_ids;  // [num_tokens]; base-only tokens may be >= vocab
  float scale = 1.0f;
  Tensor a;   // [max_loras, vocab, max_rank] (PEFT's lora_embedding_A transposed), NaN past rank
  Tensor b;   // [max_loras, hidden, max_rank], NaN past rank
  Tensor y0;  // [num_tokens, hidden]
};
EmbeddingProblem make_embedding_problem(const EmbeddingCase& c);
Reference reference_embedding(const EmbeddingProblem& p);
Tolerance embedding_tolerance(const EmbeddingProblem& p);
/// PunicaWrapper::add_lora_embedding on `device`.
Tensor run_embedding(const EmbeddingProblem& p, Device device);

// ---------------------------------------------------------------------------------------------
// FP8 LoRA-B expand

enum class Fp8Intermediate { kF32, kActivation, kW8A8PerToken, kW8A8PerTensor };

struct Fp8Case {
  DType dtype;         // of y (and of the intermediate for kActivation)
  DType weight_dtype;  // kF8E4M3 or kF8E5M2
  kernels::Fp8ScaleKind scale_kind;
  int group_n;
  int group_k;
  Fp8Intermediate intermediate;
  DType in_fp8_dtype;  // W8A8 only
  int num_tokens;
  int max_loras;
  int max_rank;
  int rank;  // 0: mixed
  std::vector<int64_t> widths;
  SlotDistribution dist;
  double none_fraction;
  bool add_inputs;
};
std::string case_name(const Fp8Case& c);
/// GoogleTest prints test parameters with PrintTo: the case name instead of raw bytes.
inline void PrintTo(const Fp8Case& c, std::ostream* os) { *os << case_name(c); }
const std::vector<Fp8Case>& fp8_cases();

struct Fp8Problem {
  Fp8Case c;
  std::vector<int32_t> slots;
  std::vector<int32_t> ranks;   // [num_slices, max_loras]
  std::vector<Tensor> b;        // per slice fp8 [max_loras, n_s, max_rank], NaN past rank
  std::vector<Tensor> b_scale;  // per slice float32, layout per scale_kind, positive
  Tensor mid;                   // float32 [S, T, max_rank], NaN where not to be read
  Tensor y0;                    // [num_tokens, sum n_s + 3]
  int num_slices() const { return static_cast<int>(c.widths.size()); }
  int32_t rank(int slice, int32_t slot) const { return ranks[slice * c.max_loras + slot]; }
};
Fp8Problem make_fp8_problem(const Fp8Case& c);
/// The intermediate actually fed to the expand: mid itself (f32), mid rounded to the
/// activation dtype, or mid quantised by quantize_intermediate_fp8 on `device` (W8A8, with
/// `in_scale`). Returned on the CPU.
struct Fp8Input {
  Tensor mid;
  Tensor in_scale;  // W8A8 only: [S, T] or [S]
};
Fp8Input fp8_expand_input(const Fp8Problem& p, Device device);
/// Checks a W8A8 quantisation of p.mid: every LoRA element dequantises (q * scale) to within
/// fp8 rounding of its value, the row (or slice) maximum to within fp8 rounding of
/// amax, and untouched elements are unchanged.
::testing::AssertionResult check_quantized(const Fp8Problem& p, const Fp8Input& in);
Reference reference_expand_fp8(const Fp8Problem& p, const Fp8Input& in);
Tolerance expand_fp8_tolerance(const Fp8Problem& p);
/// PunicaWrapper::add_expand_fp8 into a copy of y0 (slices start at column 1).
Tensor run_expand_fp8(const Fp8Problem& p, const Fp8Input& in, Device device);

// ---------------------------------------------------------------------------------------------
// Fused MoE LoRA

enum class MoeProjection { kW13, kW2 };
enum class MoeBlocks { kAuto, kAligned, kNaive };

struct MoeCase {
  DType dtype;
  MoeProjection projection;
  int num_tokens;
  int top_k;
  int num_experts;
  int max_loras;
  int max_rank;
  int rank;           // 0: mixed
  int64_t hidden_in;  // K of the shrink (hidden for w13, intermediate for w2)
  int64_t n;          // width of each slice (intermediate for w13, hidden for w2)
  int block_size;
  MoeBlocks blocks;
  bool some_disabled;   // adapter_enabled has zeros
  bool some_non_local;  // some routed experts are -1 (expert parallelism)
  int64_t offset;
  bool add_inputs;
  SlotDistribution dist;
  double none_fraction;
};
std::string case_name(const MoeCase& c);
/// GoogleTest prints test parameters with PrintTo: the case name instead of raw bytes.
inline void PrintTo(const MoeCase& c, std::ostream* os) { *os << case_name(c); }
const std::vector<MoeCase>& moe_cases();

struct MoeProblem {
  MoeCase c;
  std::vector<int32_t> slots;            // [num_tokens]
  std::vector<int32_t> ranks;            // [num_slices, max_loras]
  std::vector<int32_t> topk_ids;         // [num_tokens, top_k]
  std::vector<float> topk_weights;       // [num_tokens, top_k]
  std::vector<int32_t> adapter_enabled;  // [max_loras]
  Tensor x;                              // [num_tokens or num_tokens * top_k, hidden_in]
  std::vector<Tensor> a;  // per slice [max_loras, E, max_rank, hidden_in], NaN past rank
  std::vector<Tensor> b;  // per slice [max_loras, E, n, max_rank], NaN past rank
  Tensor y0;              // [num_tokens, top_k, offset + slices * n + 1]
  int num_slices() const { return c.projection == MoeProjection::kW13 ? 2 : 1; }
  int32_t rank(int slice, int32_t slot) const { return ranks[slice * c.max_loras + slot]; }
  bool enabled(int32_t slot) const { return slot >= 0 && adapter_enabled[slot] != 0; }
};
MoeProblem make_moe_problem(const MoeCase& c);
Reference reference_fused_moe(const MoeProblem& p);
Tolerance fused_moe_tolerance(const MoeProblem& p);
/// Aligns on `device` (PunicaWrapper::moe_lora_align_block_size, naive per the case) and
/// runs add_lora_moe_w13 / add_lora_moe_w2 (or add_lora_fused_moe with the case's
/// add_inputs) into a copy of y0.
Tensor run_fused_moe(const MoeProblem& p, Device device);

/// Inputs and outputs of one moe_lora_align_block_size call, on the CPU.
struct MoeAlignment {
  int64_t num_tokens = 0;
  int top_k = 0;
  int num_experts = 0;
  int block_size = 0;
  int max_loras = 0;
  std::vector<int32_t> slots, topk_ids, adapter_enabled;
  int64_t max_num_tokens_padded = 0;  // row length of sorted_ids
  int64_t max_num_m_blocks = 0;       // row length of expert_ids
  std::vector<int32_t> sorted_ids, expert_ids, num_tokens_post_pad;
};
/// Checks an alignment against vLLM's definition, written out here: per enabled slot the
/// experts in ascending order, each group padded to whole blocks of block_size, blocks past
/// the padded count unused (-1, padding ids), every (token, k) pair of the slot routed to a
/// local expert listed exactly once, in its expert's blocks. The order of pairs inside a group
/// is free (vLLM's CUDA kernel does not fix it).
::testing::AssertionResult check_alignment(const MoeAlignment& al);
/// Runs moe_lora_align_block_size on `device` through punica/lora_dispatch.h with buffers of the
/// sizes moe_align_sizes() gives, and copies everything back.
MoeAlignment run_moe_align(int64_t num_tokens, int top_k, int num_experts, int block_size,
                           int max_loras, const std::vector<int32_t>& slots,
                           const std::vector<int32_t>& topk_ids,
                           const std::vector<int32_t>& adapter_enabled, Device device);

}  // namespace loraplex::test
