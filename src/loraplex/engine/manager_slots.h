#pragma once
// The scheduler's AdapterSlots over the AdapterManager: a pin is a Lease held until the
// adapter's last running sequence leaves (the step that used the slot has finished by then);
// adapters not in host memory are prefetched on the manager's loader thread, never acquired
// from the step loop (acquire would read the disk there).

#include <future>
#include <map>
#include <string>

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

 private:
  AdapterManager& manager_;
  size_t max_loading_;
  std::map<std::string, AdapterManager::Lease> leases_;
  std::map<std::string, std::future<void>> loads_;
  std::map<std::string, std::string> pin_errors_;  // a slot write that failed, reported by load
};

}  // namespace loraplex::engine
