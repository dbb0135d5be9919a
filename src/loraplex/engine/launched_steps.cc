#include "loraplex/engine/launched_steps.h"

#include <utility>

#include "loraplex/core/error.h"

namespace loraplex::engine {

void LaunchedSteps::push(LaunchedStep step) {
  newest_rows_.clear();
  for (size_t i = 0; i < step.sampled.size(); ++i) {
    newest_rows_.emplace(step.sampled[i], static_cast<int32_t>(i));
  }
  steps_.push_back(std::move(step));
}

LaunchedStep LaunchedSteps::pop() {
  LORAPLEX_CHECK(!steps_.empty(), "engine: no step in flight to collect (internal error)");
  LaunchedStep step = std::move(steps_.front());
  steps_.pop_front();
  if (steps_.empty()) newest_rows_.clear();
  return step;
}

int32_t LaunchedSteps::feed_row(uint64_t id) const {
  const auto it = newest_rows_.find(id);
  return it == newest_rows_.end() ? -1 : it->second;
}

bool LaunchedSteps::host_tokens_needed() const {
  for (const LaunchedStep& s : steps_)
    if (s.host_tokens_needed) return true;
  return false;
}

}  // namespace loraplex::engine
