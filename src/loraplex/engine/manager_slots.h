#pragma once
// The scheduler's AdapterSlots over the AdapterManager: a pin is a Lease held until the
// adapter's last running sequence leaves and every step launched before then has been
// collected (a slot may be rewritten once its lease ends, and with asynchronous scheduling a
// step can still be running when its sequences leave); adapters not in host memory are
// prefetched on the manager's loader thread, never acquired from the step loop (acquire would
// read the disk there).

#include <cstdint>
#include <future>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "loraplex/adapters/adapter_manager.h"
#include "loraplex/core/stream.h"
#include "loraplex/engine/scheduler.h"

namespace loraplex::engine {

class ManagerSlots : public AdapterSlots {
 public:
  /// At most `max_loading` prefetches in flight (>= 1).
  ManagerSlots(AdapterManager& manager, int max_loading);
  ~ManagerSlots() override;

  bool ready(const std::string& name) override;
  LoadState load(const std::string& name, std::string& error) override;
  int pin(const std::string& name) override;
  void unpin(const std::string& name) override;

  /// Makes `compute` wait for the pinned adapter's slot upload (CUDA; no-op on the CPU).
  void wait_ready(const std::string& name, const Stream& compute) const;
  /// Adapters pinned now.
  size_t num_pinned() const { return leases_.size(); }

  /// A step was launched: an adapter unpinned from now on keeps its slot until this step has
  /// been collected.
  void step_launched() { ++launched_; }
  /// The oldest step launched and not collected has been collected (or dropped).
  void step_collected();
  /// Leases of unpinned adapters kept for steps still in flight.
  size_t num_retired() const { return retired_.size(); }

 private:
  AdapterManager& manager_;
  size_t max_loading_;
  std::map<std::string, AdapterManager::Lease> leases_;
  // Unpinned while steps were in flight: (steps launched by then, lease), released once that
  // many steps have been collected.
  std::vector<std::pair<uint64_t, AdapterManager::Lease>> retired_;
  uint64_t launched_ = 0;
  uint64_t collected_ = 0;
  std::map<std::string, std::future<void>> loads_;
  std::map<std::string, std::string> pin_errors_;  // a slot write that failed, reported by load
};

}  // namespace loraplex::engine
