#pragma once
// The adapter manager: named PEFT adapters from disk to the layers' slots.
//
//   load(name, dir)  disk -> validated, packed -> CPU cache (max_cpu_loras, LRU)
//   acquire(name)    CPU cache (reloading from disk when evicted; refused when the files
//                    changed since load, adapter_stamp.h) -> a GPU slot (max_loras, LRU among
//                    unpinned slots) -> a Lease that pins the slot while it lives
//   unload(name)     forgets the adapter; a slot still leased is freed when its last lease ends
//
// Loading from disk happens outside every lock (and can run on the manager's loader thread:
// load_async, prefetch), so requests for adapters already in slots never wait for disk.
// Writing a slot calls the layers' set_lora under the layer lock; whoever runs the layers'
// forward holds the same lock (lock_layers()), since a layer may not be written while it
// computes (or enqueues). On CUDA the packed weights live in page-locked memory and the layers
// take the manager's copy stream (set_lora(slot, slices, stream)): each layer enqueues the
// slot's weight copies and then its ranks on that stream without waiting, the manager records
// the slot's event after the last layer, and Lease::wait_ready makes the compute stream wait
// for that event, so no forward sees the new ranks before the weights. acquire() therefore
// returns as soon as the upload is enqueued. A slot may be rewritten as soon as its last lease
// ends: end leases only after the device work that reads the slot has finished (the engine's
// ManagerSlots keeps a lease until every step launched before the unpin has been collected).
//
// Every method is thread-safe.

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "loraplex/adapters/lora_targets.h"
#include "loraplex/adapters/peft_adapter.h"
#include "loraplex/core/device.h"
#include "loraplex/core/error.h"
#include "loraplex/core/stream.h"

namespace loraplex {

/// acquire() of a name that is not loaded (never loaded, or unloaded).
class AdapterNotLoadedError : public Error {
 public:
  using Error::Error;
};

/// acquire() when every slot is pinned by leases of other adapters. The caller may retry once
/// a lease ends (the scheduler keeps the request waiting).
class AdapterCapacityError : public Error {
 public:
  using Error::Error;
};

struct AdapterManagerConfig {
  /// GPU slots: the layers' LoraConfig::max_loras.
  int max_loras = 1;
  /// Adapters kept packed in host memory; 0 means max_loras. Must be >= max_loras.
  int max_cpu_loras = 0;
  /// The layers' LoraConfig::max_lora_rank: adapters with a larger module rank are refused.
  int max_lora_rank = 16;
  /// dtype adapters are packed in (the layers' lora_dtype).
  DType lora_dtype = DType::kBF16;
  /// The layers' device. CUDA: pinned host cache, copy stream and upload events.
  Device device = Device::cpu();
};

/// A snapshot of one loaded adapter.
struct AdapterInfo {
  std::string name;
  std::string dir;
  int rank = 0;        // the largest module rank (after rank_pattern)
  double scale = 0.0;  // the config-level scale (alpha / r or alpha / sqrt(r))
  std::vector<AdapterModule> modules;
  size_t bytes = 0;           // packed size
  bool in_cpu_cache = false;  // false: evicted, acquire reloads it from dir
  int slot = -1;              // GPU slot, -1 when in none
  int leases = 0;             // live leases
};

class AdapterManager {
 public:
  /// Pins one adapter in one slot while it lives. Movable, not copyable. Must not outlive the
  /// manager's layers (it only unpins on destruction).
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept;
    Lease& operator=(Lease&& other) noexcept;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease();

    bool valid() const { return state_ != nullptr; }
    /// The slot the adapter occupies: the value for the token -> slot mapping.
    int slot() const { return slot_; }
    const std::string& name() const { return name_; }
    /// CUDA: makes `compute` wait until the slot's upload has finished (without blocking the
    /// host); call it before enqueuing a forward that uses the slot. No-op on the CPU.
    void wait_ready(const Stream& compute) const;
    /// Unpins now (as the destructor does).
    void release();

   private:
    friend class AdapterManager;
    struct State;
    Lease(std::shared_ptr<State> state, int slot, std::string name);
    std::shared_ptr<State> state_;
    int slot_ = -1;
    std::string name_;
  };

  /// `registry` (the model's LoRA targets and layers) must outlive the manager.
  AdapterManager(const LoraTargetRegistry& registry, AdapterManagerConfig config);
  ~AdapterManager();
  AdapterManager(const AdapterManager&) = delete;
  AdapterManager& operator=(const AdapterManager&) = delete;

  /// Reads, validates and packs the PEFT adapter in `dir` under `name` and puts it in the CPU
  /// cache (evicting the least recently used packed adapter beyond max_cpu_loras). Throws
  /// loraplex::Error naming the adapter, the file and the problem; a failed load changes
  /// nothing. Loading a name that is already loaded is an error (unload it first).
  AdapterInfo load(const std::string& name, const std::string& dir);
  /// load() on the manager's loader thread; the future rethrows load()'s error.
  std::future<AdapterInfo> load_async(const std::string& name, const std::string& dir);
  /// Brings an evicted adapter back into the CPU cache on the loader thread (a no-op when it
  /// is cached), so that a later acquire() does not wait for the disk.
  std::future<void> prefetch(const std::string& name);
  /// Forgets `name`: new acquire() calls fail; leases already held keep their slot until they
  /// end. Returns false when the name is not loaded.
  bool unload(const std::string& name);

  /// Puts `name` in a GPU slot (reusing its slot, else a free one, else the least recently used
  /// unpinned one) and pins it. Waits only while another thread reloads or writes the same
  /// adapter. Throws AdapterNotLoadedError for an unknown name,
  /// AdapterCapacityError at once when every slot is pinned, and loraplex::Error when an
  /// evicted adapter cannot be reloaded or a layer refuses the weights. Do not hold a
  /// Lease of a second adapter expecting it to free capacity while you wait: nothing waits.
  Lease acquire(const std::string& name);
  /// acquire() that never reads the disk: returns an empty Lease (valid() == false) when the
  /// adapter is in neither a slot nor the CPU cache, or is being reloaded (prefetch() it and try
  /// again). Throws as acquire() does otherwise. What a serving loop calls.
  Lease try_acquire(const std::string& name);
  /// Whether acquire(name) would not read the disk now: the adapter is in a slot or packed in the
  /// CPU cache. False for names that are not loaded.
  bool is_resident(const std::string& name) const;

  /// Serialises slot writes with the layers' forward: hold it while running (or, on CUDA,
  /// enqueuing) a forward pass. Recursive, so the thread holding it may call acquire(); but
  /// acquire() can wait for another thread that is writing the same adapter into a slot, and
  /// that thread needs this lock, so when several threads acquire, call acquire() before
  /// taking the lock (as an engine does: acquire the step's adapters, then run the step).
  std::unique_lock<std::recursive_mutex> lock_layers();

  bool contains(const std::string& name) const;
  std::optional<AdapterInfo> info(const std::string& name) const;
  /// Every loaded adapter, sorted by name.
  std::vector<AdapterInfo> list() const;
  /// The adapter in each slot ("" when free), for tests and debugging.
  std::vector<std::string> slot_contents() const;

  const AdapterManagerConfig& config() const { return config_; }

 private:
  struct Entry;
  using Lock = std::unique_lock<std::mutex>;

  AdapterLoadOptions load_options() const;
  AdapterInfo info_locked(const Entry& entry) const;
  // Reads an evicted adapter again; throws loraplex::Error when its files are not the ones it
  // was loaded from.
  PackedAdapter read_unchanged(const Entry& entry) const;
  // Makes entry->packed available, reloading from disk outside the lock; `lock` is held on
  // entry and exit.
  void ensure_packed(Lock& lock, const std::shared_ptr<Entry>& entry,
                     std::vector<std::shared_ptr<const PackedAdapter>>& dropped);
  // Evicts beyond max_cpu_loras; the evicted packed adapters go to `dropped`, for the caller
  // to release after unlocking (freeing page-locked memory may wait for the device).
  void cache_insert_locked(const std::shared_ptr<Entry>& entry,
                           std::vector<std::shared_ptr<const PackedAdapter>>& dropped);
  Lease acquire_impl(const std::string& name, bool allow_reload);
  void write_slot(int slot, const PackedAdapter& packed);
  void submit(std::function<void()> task);
  void worker_loop();

  const LoraTargetRegistry& registry_;
  AdapterManagerConfig config_;
  std::shared_ptr<Lease::State> state_;  // mutex, slots and condition variable (leases share it)
  std::map<std::string, std::shared_ptr<Entry>> adapters_;
  std::recursive_mutex layers_mutex_;
  Stream copy_stream_;

  std::mutex queue_mutex_;
  std::condition_variable queue_cv_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  std::thread worker_;
};

}  // namespace loraplex
