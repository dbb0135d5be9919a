#include "loraplex/engine/manager_slots.h"

#include <algorithm>
#include <chrono>

namespace loraplex::engine {
namespace {

bool is_done(const std::future<void>& f) {
  return f.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
}

}  // namespace

ManagerSlots::ManagerSlots(AdapterManager& manager, int max_loading)
    : manager_(manager), max_loading_(static_cast<size_t>(std::max(1, max_loading))) {}

ManagerSlots::~ManagerSlots() = default;

bool ManagerSlots::ready(const std::string& name) {
  if (pin_errors_.count(name) != 0) return false;
  return leases_.count(name) != 0 || manager_.is_resident(name);
}

AdapterSlots::LoadState ManagerSlots::load(const std::string& name, std::string& error) {
  const auto failed = pin_errors_.find(name);
  if (failed != pin_errors_.end()) {
    error = failed->second;
    pin_errors_.erase(failed);
    return LoadState::kFailed;
  }
  const auto it = loads_.find(name);
  if (it != loads_.end()) {
    if (!is_done(it->second)) return LoadState::kLoading;
    std::future<void> done = std::move(it->second);
    loads_.erase(it);
    try {
      done.get();
    } catch (const AdapterNotLoadedError& e) {
      // Unloaded while loading; a new load of the same name is loaded again below.
      if (!manager_.contains(name)) {
        error = e.what();
        return LoadState::kFailed;
      }
    } catch (const std::exception& e) {
      error = e.what();
      return LoadState::kFailed;
    }
  }
  if (manager_.is_resident(name)) return LoadState::kReady;
  if (loads_.size() >= max_loading_) {
    // Finished prefetches stay in loads_ until polled; those do not count as in flight.
    size_t in_flight = 0;
    for (const auto& [n, f] : loads_) in_flight += is_done(f) ? 0 : 1;
    if (in_flight >= max_loading_) return LoadState::kLoading;
  }
  try {
    loads_.emplace(name, manager_.prefetch(name));
  } catch (const std::exception& e) {
    error = e.what();
    return LoadState::kFailed;
  }
  return LoadState::kLoading;
}

int ManagerSlots::pin(const std::string& name) {
  const auto it = leases_.find(name);
  if (it != leases_.end()) return it->second.slot();
  AdapterManager::Lease lease;
  try {
    lease = manager_.try_acquire(name);
  } catch (const std::exception& e) {
    // A slot the scheduler counts as free may still be held for a step in flight: it frees
    // when that step is collected, and the adapter waits until then.
    const bool held = dynamic_cast<const AdapterCapacityError*>(&e) != nullptr && !retired_.empty();
    if (!held) pin_errors_[name] = e.what();
    return -1;
  }
  if (!lease.valid()) return -1;
  const int slot = lease.slot();
  leases_.emplace(name, std::move(lease));
  return slot;
}

void ManagerSlots::unpin(const std::string& name) {
  const auto it = leases_.find(name);
  if (it == leases_.end()) return;
  if (launched_ > collected_) retired_.emplace_back(launched_, std::move(it->second));
  leases_.erase(it);
}

void ManagerSlots::step_collected() {
  ++collected_;
  std::erase_if(retired_, [&](const auto& r) { return r.first <= collected_; });
}

void ManagerSlots::wait_ready(const std::string& name, const Stream& compute) const {
  const auto it = leases_.find(name);
  if (it != leases_.end()) it->second.wait_ready(compute);
}

}  // namespace loraplex::engine
