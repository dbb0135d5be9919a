#pragma once
// One model step as the scheduler describes it: for each sequence, the tokens to run now (a
// whole prompt, a chunk of one, or the one token of a decode), where they sit in the
// sequence, its KV-cache blocks, its adapter slot and, when the step ends a sequence's prompt
// or decodes it, how to sample its next token. The model runs the step and returns only the
// sampled token ids (and their log-probabilities): logits never leave the device.

#include <cstdint>
#include <vector>

namespace loraplex::model {

/// Banned token ids per sampled row (min_tokens bans the stop tokens until it is reached).
inline constexpr int kMaxBannedTokens = 8;

/// A change of one logit before sampling, in vLLM's order: l = logit + bias (logit_bias, or
/// -inf to ban the id: bad_words, allowed_token_ids); then the repetition penalty (l / r when
/// l > 0, else l * r); then l -= subtract (frequency_penalty * count + presence_penalty).
struct LogitAdjustment {
  int32_t id = 0;
  float bias = 0.0f;
  float repetition = 1.0f;
  float subtract = 0.0f;
};

/// How one sequence picks its next token. The rule, the same on the CPU and the GPU:
///  * temperature == 0 (or top_k == 1): the largest logit, ties to the lowest id, NaN never.
///  * otherwise l = logit / temperature (NaN = -inf, banned ids = -inf); top_k > 0 keeps the
///    ids whose l is >= the k-th largest l (ties at the threshold kept); top_p < 1 then keeps
///    the most probable ids whose probability mass first reaches top_p (ties at the threshold
///    kept); the id is the first one, in ascending id order over the kept ids, at which the
///    running sum of exp(l - max l) exceeds uniform * (sum over the kept ids).
struct SamplingParams {
  float temperature = 0.0f;  // 0 = greedy
  int top_k = 0;             // 0 = all tokens
  float top_p = 1.0f;        // 1 = all tokens
  // 0 = all tokens; else only ids whose probability is at least min_p times the largest
  // (vLLM's min_p, applied before top-k and top-p, which then see only what it kept).
  float min_p = 0.0f;
};

struct SequenceStep {
  /// Tokens to run in this step, in position order: positions start_position, +1, ...
  std::vector<int32_t> tokens;
  /// Position of tokens[0]; the KV cache already holds positions 0 .. start_position - 1.
  int32_t start_position = 0;
  /// The sequence's KV-cache blocks in position order; must cover start_position +
  /// tokens.size() positions.
  std::vector<int32_t> blocks;
  /// LoRA slot (an AdapterManager lease's slot), -1 = the base model.
  int32_t lora_slot = -1;
  /// >= 0: the last of `tokens` is not known on the host yet (its value there is ignored): it
  /// is the id sampled at this row of the step launched just before (ModelExecutor::launch),
  /// which the device puts in place. How asynchronous scheduling plans a decode before the
  /// previous step's ids have come back.
  int32_t feed_row = -1;
  /// Sample a token after the last one of `tokens` (false for a prompt chunk that does not
  /// end the prompt).
  bool sample = false;
  SamplingParams sampling;
  /// The sequence's uniform draw in [0, 1) for this step (from its own seeded generator, so
  /// a request samples the same tokens whatever else shares its batch); unused when greedy.
  double uniform = 0.0;
  /// Ids that may not be sampled in this step (at most kMaxBannedTokens).
  std::vector<int32_t> banned;
  /// Applied to the logits before sampling (each id at most once); with `only_listed` every id
  /// without an entry becomes -inf first (allowed_token_ids). Log-probabilities are then those
  /// of the adjusted logits.
  std::vector<LogitAdjustment> adjust;
  bool only_listed = false;
};

struct StepBatch {
  std::vector<SequenceStep> seqs;
  /// Also return the log-probability of each sampled token under the raw model distribution
  /// (log-softmax of the logits, before temperature and filtering), as vLLM does.
  bool want_logprobs = false;
  /// Also return, for every sampled row, the ids of its this many largest logits and their
  /// log-probabilities (0: none; at most ops::kMaxTopLogprobs), before any adjustment.
  int top_logprobs = 0;
};

struct StepResult {
  /// One per sequence with sample == true, in the order of StepBatch::seqs.
  std::vector<int32_t> token_ids;
  /// Same order; empty unless StepBatch::want_logprobs.
  std::vector<float> logprobs;
  /// [sampled rows, StepBatch::top_logprobs], rows in the same order; empty unless asked for.
  std::vector<int32_t> top_ids;
  std::vector<float> top_logprobs;
};

}  // namespace loraplex::model
