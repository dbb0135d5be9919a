#pragma once
// The steps the engine has launched and not yet collected, oldest first (at most two: with
// asynchronous scheduling step n + 1 is launched before step n is collected). For each, what
// collecting it needs: which sequences it sampled, in row order, and what the rows carry; and
// for the newest, the row each sequence's pending token will come from, which the next step
// names as that sequence's fed token (model::SequenceStep::feed_row).

#include <cstddef>
#include <cstdint>
#include <deque>
#include <unordered_map>
#include <vector>

namespace loraplex::engine {

struct LaunchedStep {
  std::vector<uint64_t> seqs;     // every sequence of the step (its errors end them all)
  std::vector<uint64_t> sampled;  // the sampling sequences, in the order of the step's rows
  bool logprobs = false;          // the rows carry log-probabilities
  int top_logprobs = 0;           // and this many top logprobs each
  /// A sampled sequence plans its next step from its generated tokens (penalties, bad words):
  /// the step is collected before the next is planned.
  bool host_tokens_needed = false;
};

class LaunchedSteps {
 public:
  void push(LaunchedStep step);
  /// Removes and returns the oldest step.
  LaunchedStep pop();
  bool empty() const { return steps_.empty(); }
  size_t size() const { return steps_.size(); }
  /// The row at which the newest step samples sequence `id`, or -1.
  int32_t feed_row(uint64_t id) const;
  /// Any step in flight has host_tokens_needed.
  bool host_tokens_needed() const;

 private:
  std::deque<LaunchedStep> steps_;
  std::unordered_map<uint64_t, int32_t> newest_rows_;  // of steps_.back()
};

}  // namespace loraplex::engine
