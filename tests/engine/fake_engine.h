#pragma once
// Fakes for driving the Scheduler without a model: adapter slots with host memory and
// background loads, and a model whose KV cache holds, per position, a hash of the sequence so
// far (its tokens and its adapter), read back through the block table. Any wrong block, position,
// chunk or prefix-cache hit changes the tokens that follow, which a reference chain computed
// without any cache predicts.

#include <cstdint>
#include <map>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "loraplex/engine/block_manager.h"
#include "loraplex/engine/scheduler.h"

namespace loraplex::test {

class FakeSlots : public engine::AdapterSlots {
 public:
  /// `max_loras` slots; at most `host_capacity` adapters in host memory (pinned ones included),
  /// the least recently used one dropped beyond that.
  FakeSlots(int max_loras, int host_capacity);

  /// Puts an adapter in host memory at once.
  void make_resident(const std::string& name);
  /// Drops an adapter from host memory (as an eviction); a pinned adapter keeps its slot.
  void evict(const std::string& name);
  /// Loads of `name` fail from now on.
  void fail_loads(const std::string& name) { failing_.insert(name); }
  /// Ticks a started load needs before it completes.
  void set_load_delay(int ticks) { load_delay_ = ticks; }
  /// Advances every load in flight by one tick.
  void tick();

  bool ready(const std::string& name) override;
  LoadState load(const std::string& name, std::string& error) override;
  int pin(const std::string& name) override;
  void unpin(const std::string& name) override;

  int num_pinned() const { return static_cast<int>(pinned_.size()); }
  bool pinned(const std::string& name) const { return pinned_.count(name) != 0; }
  int slot_of(const std::string& name) const {
    const auto it = pinned_.find(name);
    return it == pinned_.end() ? -1 : it->second;
  }
  int64_t loads_started() const { return loads_started_; }
  /// Set when the scheduler broke the contract (pin without a free slot or not ready, unpin of
  /// an adapter not pinned).
  const std::vector<std::string>& violations() const { return violations_; }

 private:
  void touch(const std::string& name);

  int max_loras_;
  int host_capacity_;
  int load_delay_ = 0;
  uint64_t tick_ = 0;
  std::map<std::string, uint64_t> resident_;  // name -> last use
  std::map<std::string, int> loading_;        // name -> ticks left
  std::map<std::string, int> pinned_;         // name -> slot
  std::set<std::string> failing_;
  int64_t loads_started_ = 0;
  std::vector<std::string> violations_;
};

class FakeModel {
 public:
  FakeModel(int64_t num_blocks, int64_t block_size, int32_t vocab);

  /// Runs a step: writes every scheduled position's state through the sequence's blocks (which
  /// must hold only that sequence: a shared cached block is never written) and returns the next
  /// token of every sampling sequence. A pending token (engine::kPendingToken, asynchronous
  /// steps) is the one this model sampled for the sequence in the run before, as the device
  /// feeds it. Problems are reported with ADD_FAILURE.
  std::vector<int32_t> run(const engine::StepPlan& plan, const engine::BlockManager& blocks);

  /// The tokens a sequence generates alone, with no cache: `count` of them after `prompt`.
  std::vector<int32_t> reference(std::span<const int32_t> prompt, uint64_t adapter_key,
                                 int64_t count) const;

 private:
  uint64_t step_state(uint64_t prev, int32_t token) const;
  int32_t token_of(uint64_t state) const;

  int64_t block_size_;
  int32_t vocab_;
  std::vector<uint64_t> kv_;                  // [num_blocks * block_size], 0 = never written
  std::map<uint64_t, int32_t> last_sampled_;  // sequence id -> its token of the last run
};

}  // namespace loraplex::test
