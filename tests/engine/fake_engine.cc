#include "fake_engine.h"

#include <gtest/gtest.h>

namespace loraplex::test {

FakeSlots::FakeSlots(int max_loras, int host_capacity)
    : max_loras_(max_loras), host_capacity_(host_capacity) {}

void FakeSlots::touch(const std::string& name) {
  resident_[name] = ++tick_;
  while (static_cast<int>(resident_.size()) > host_capacity_) {
    auto oldest = resident_.end();
    for (auto it = resident_.begin(); it != resident_.end(); ++it) {
      if (it->first == name) continue;
      if (oldest == resident_.end() || it->second < oldest->second) oldest = it;
    }
    if (oldest == resident_.end()) break;
    resident_.erase(oldest);
  }
}

void FakeSlots::make_resident(const std::string& name) { touch(name); }

void FakeSlots::evict(const std::string& name) { resident_.erase(name); }

void FakeSlots::tick() {
  for (auto it = loading_.begin(); it != loading_.end();) {
    if (it->second == 0 || --it->second > 0) {
      ++it;  // a failed load stays (at 0) until load() reports it
      continue;
    }
    if (failing_.count(it->first) != 0) {
      ++it;
      continue;
    }
    touch(it->first);
    it = loading_.erase(it);
  }
}

bool FakeSlots::ready(const std::string& name) {
  return pinned_.count(name) != 0 || resident_.count(name) != 0;
}

engine::AdapterSlots::LoadState FakeSlots::load(const std::string& name, std::string& error) {
  if (ready(name)) {
    loading_.erase(name);
    return LoadState::kReady;
  }
  const auto it = loading_.find(name);
  if (it != loading_.end()) {
    if (it->second > 0) return LoadState::kLoading;
    loading_.erase(it);
    if (failing_.count(name) != 0) {
      error = "adapter '" + name + "' failed to load";
      return LoadState::kFailed;
    }
    return LoadState::kLoading;
  }
  ++loads_started_;
  if (load_delay_ == 0 && failing_.count(name) == 0) {
    touch(name);
    return LoadState::kReady;
  }
  loading_[name] = std::max(load_delay_, 1);
  return LoadState::kLoading;
}

int FakeSlots::pin(const std::string& name) {
  if (pinned_.count(name) != 0) {
    violations_.push_back("pin of '" + name + "', which is pinned already");
    return pinned_[name];
  }
  if (static_cast<int>(pinned_.size()) >= max_loras_) {
    violations_.push_back("pin of '" + name + "' with every slot pinned");
    return -1;
  }
  if (!ready(name)) return -1;
  touch(name);
  std::set<int> used;
  for (const auto& [n, s] : pinned_) used.insert(s);
  int slot = 0;
  while (used.count(slot) != 0) ++slot;
  pinned_[name] = slot;
  return slot;
}

void FakeSlots::unpin(const std::string& name) {
  if (pinned_.erase(name) == 0) violations_.push_back("unpin of '" + name + "', not pinned");
}

// ---------------------------------------------------------------------------------- model

FakeModel::FakeModel(int64_t num_blocks, int64_t block_size, int32_t vocab)
    : block_size_(block_size),
      vocab_(vocab),
      kv_(static_cast<size_t>(num_blocks * block_size), 0) {}

uint64_t FakeModel::step_state(uint64_t prev, int32_t token) const {
  uint64_t z = prev * 0x100000001b3ull + static_cast<uint64_t>(token) + 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return z == 0 ? 1 : z;
}

int32_t FakeModel::token_of(uint64_t state) const {
  return static_cast<int32_t>(state % static_cast<uint64_t>(vocab_));
}

std::vector<int32_t> FakeModel::run(const engine::StepPlan& plan,
                                    const engine::BlockManager& blocks) {
  std::vector<int32_t> out;
  std::map<uint64_t, int32_t> sampled;
  for (const engine::ScheduledSeq& q : plan.seqs) {
    const engine::Sequence& s = *q.seq;
    uint64_t state = 0;
    for (int64_t p = q.start; p < q.start + q.num_tokens; ++p) {
      uint64_t prev = step_state(0x5eed, static_cast<int32_t>(s.adapter_key));
      if (p > 0) {
        const int64_t b = (p - 1) / block_size_;
        if (b >= static_cast<int64_t>(s.blocks.size())) {
          ADD_FAILURE() << "sequence " << s.id << " reads position " << p - 1 << " past its "
                        << s.blocks.size() << " blocks";
          return out;
        }
        prev = kv_[static_cast<size_t>(s.blocks[static_cast<size_t>(b)] * block_size_ +
                                       (p - 1) % block_size_)];
        if (prev == 0) {
          ADD_FAILURE() << "sequence " << s.id << " reads position " << p - 1 << ", never written";
          return out;
        }
      }
      const int64_t b = p / block_size_;
      if (b >= static_cast<int64_t>(s.blocks.size())) {
        ADD_FAILURE() << "sequence " << s.id << " writes position " << p << " past its "
                      << s.blocks.size() << " blocks";
        return out;
      }
      const int32_t block = s.blocks[static_cast<size_t>(b)];
      if (blocks.ref_count(block) != 1) {
        ADD_FAILURE() << "sequence " << s.id << " writes position " << p << " into block " << block
                      << ", which " << blocks.ref_count(block) << " sequences hold";
      }
      int32_t token = s.tokens[static_cast<size_t>(p)];
      if (token == engine::kPendingToken) {
        const auto fed = last_sampled_.find(s.id);
        if (fed == last_sampled_.end() || p + 1 != s.num_tokens()) {
          ADD_FAILURE() << "sequence " << s.id << " runs a pending token at position " << p
                        << " that the run before did not sample";
          return out;
        }
        token = fed->second;
      }
      state = step_state(prev, token);
      kv_[static_cast<size_t>(block * block_size_ + p % block_size_)] = state;
    }
    if (q.sample) {
      out.push_back(token_of(state));
      sampled[s.id] = out.back();
    }
  }
  last_sampled_ = std::move(sampled);
  return out;
}

std::vector<int32_t> FakeModel::reference(std::span<const int32_t> prompt, uint64_t adapter_key,
                                          int64_t count) const {
  std::vector<int32_t> tokens(prompt.begin(), prompt.end());
  std::vector<int32_t> out;
  uint64_t state = step_state(0x5eed, static_cast<int32_t>(adapter_key));
  size_t fed = 0;
  while (static_cast<int64_t>(out.size()) < count) {
    for (; fed < tokens.size(); ++fed) state = step_state(state, tokens[fed]);
    out.push_back(token_of(state));
    tokens.push_back(out.back());
  }
  return out;
}

}  // namespace loraplex::test
