#include "loraplex/adapters/adapter_manager.h"

#include <algorithm>
#include <exception>
#include <utility>

#include "loraplex/adapters/adapter_stamp.h"
#include "loraplex/core/cuda_runtime.h"

namespace loraplex {

// One loaded adapter. A new load() of the same name after unload() is a new Entry, so leases
// of the old one can never observe the new weights.
struct AdapterManager::Entry {
  std::string name;
  std::string dir;
  int rank = 0;
  double scale = 0.0;
  std::vector<AdapterModule> modules;
  size_t bytes = 0;
  AdapterStamp stamp;                           // the files the weights were read from
  std::shared_ptr<const PackedAdapter> packed;  // null when evicted from the CPU cache
  bool loading = false;                         // a reload from disk is in flight
  bool retired = false;                         // unloaded
  uint64_t cpu_tick = 0;                        // CPU-cache recency
  int slot = -1;
};

struct AdapterManager::Lease::State {
  struct Slot {
    std::shared_ptr<Entry> entry;  // null when free
    int pins = 0;
    uint64_t tick = 0;   // GPU-slot recency
    bool ready = false;  // every layer holds entry's weights
    // The packed weights last uploaded, kept until the slot is rewritten: on CUDA the copies
    // may still be reading them after the CPU cache dropped its reference.
    std::shared_ptr<const PackedAdapter> uploaded_from;
    std::unique_ptr<Event> uploaded;  // CUDA only
  };
  std::mutex mutex;
  std::condition_variable cv;
  std::vector<Slot> slots;
  uint64_t tick = 0;
};

// ---------------------------------------------------------------------------------- Lease

AdapterManager::Lease::Lease(std::shared_ptr<State> state, int slot, std::string name)
    : state_(std::move(state)), slot_(slot), name_(std::move(name)) {}

AdapterManager::Lease::Lease(Lease&& other) noexcept
    : state_(std::move(other.state_)), slot_(other.slot_), name_(std::move(other.name_)) {
  other.slot_ = -1;
}

AdapterManager::Lease& AdapterManager::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    release();
    state_ = std::move(other.state_);
    slot_ = other.slot_;
    name_ = std::move(other.name_);
    other.slot_ = -1;
  }
  return *this;
}

AdapterManager::Lease::~Lease() { release(); }

void AdapterManager::Lease::release() {
  if (state_ == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    State::Slot& s = state_->slots[static_cast<size_t>(slot_)];
    --s.pins;
    s.tick = ++state_->tick;
    if (s.pins == 0 && s.entry != nullptr && s.entry->retired) {
      s.entry->slot = -1;
      s.entry.reset();
      s.ready = false;
    }
  }
  state_.reset();
  slot_ = -1;
}

void AdapterManager::Lease::wait_ready(const Stream& compute) const {
  LORAPLEX_CHECK(valid(), "wait_ready on an empty lease");
  const State::Slot& s = state_->slots[static_cast<size_t>(slot_)];
  if (s.uploaded != nullptr && compute.device().is_cuda()) s.uploaded->wait_on(compute);
}

// ------------------------------------------------------------------------- AdapterManager

AdapterManager::AdapterManager(const LoraTargetRegistry& registry, AdapterManagerConfig config)
    : registry_(registry), config_(config), state_(std::make_shared<Lease::State>()) {
  if (config_.max_cpu_loras == 0) config_.max_cpu_loras = config_.max_loras;
  LORAPLEX_CHECK(config_.max_loras >= 1, "max_loras must be >= 1, got ", config_.max_loras);
  LORAPLEX_CHECK(config_.max_cpu_loras >= config_.max_loras, "max_cpu_loras (",
                 config_.max_cpu_loras, ") must be >= max_loras (", config_.max_loras, ")");
  LORAPLEX_CHECK(config_.max_lora_rank >= 1, "max_lora_rank must be >= 1, got ",
                 config_.max_lora_rank);
  LORAPLEX_CHECK(is_floating(config_.lora_dtype) && !is_fp8(config_.lora_dtype),
                 "lora_dtype must be float32, float16 or bfloat16, got ", config_.lora_dtype);
  state_->slots.resize(static_cast<size_t>(config_.max_loras));
  if (config_.device.is_cuda()) {
    // Events belong to the device current when they are made; the copy stream is this one.
    cuda_rt::set_device(config_.device.index);
    copy_stream_ = Stream::create(config_.device);
    for (auto& s : state_->slots) s.uploaded = std::make_unique<Event>();
  }
  worker_ = std::thread([this] { worker_loop(); });
}

AdapterManager::~AdapterManager() {
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    stopping_ = true;
  }
  queue_cv_.notify_all();
  worker_.join();
  if (config_.device.is_cuda()) copy_stream_.synchronize();
}

AdapterLoadOptions AdapterManager::load_options() const {
  AdapterLoadOptions options;
  options.max_lora_rank = config_.max_lora_rank;
  options.dtype = config_.lora_dtype;
  options.pinned = config_.device.is_cuda();
  return options;
}

AdapterInfo AdapterManager::info_locked(const Entry& entry) const {
  AdapterInfo info;
  info.name = entry.name;
  info.dir = entry.dir;
  info.rank = entry.rank;
  info.scale = entry.scale;
  info.modules = entry.modules;
  info.bytes = entry.bytes;
  info.in_cpu_cache = entry.packed != nullptr;
  info.slot = entry.slot;
  info.leases = entry.slot >= 0 ? state_->slots[static_cast<size_t>(entry.slot)].pins : 0;
  return info;
}

void AdapterManager::cache_insert_locked(
    const std::shared_ptr<Entry>& entry,
    std::vector<std::shared_ptr<const PackedAdapter>>& dropped) {
  entry->cpu_tick = ++state_->tick;
  for (;;) {
    int cached = 0;
    Entry* oldest = nullptr;
    for (const auto& [name, e] : adapters_) {
      if (e->packed == nullptr) continue;
      ++cached;
      if (e != entry && (oldest == nullptr || e->cpu_tick < oldest->cpu_tick)) oldest = e.get();
    }
    if (cached <= config_.max_cpu_loras || oldest == nullptr) return;
    // A slot keeps its own reference while it may still be uploading.
    dropped.push_back(std::move(oldest->packed));
  }
}

PackedAdapter AdapterManager::read_unchanged(const Entry& entry) const {
  const auto refuse_if_changed = [&] {
    const std::string change = describe_change(entry.stamp, AdapterStamp::of(entry.dir));
    if (!change.empty()) {
      LORAPLEX_FAIL("adapter '", entry.name, "': its files changed on disk since it was loaded (",
                    change, "); unload it and load it again to serve the new files");
    }
  };
  refuse_if_changed();
  PackedAdapter packed = load_peft_adapter(entry.name, entry.dir, registry_, load_options());
  refuse_if_changed();  // replaced while being read
  return packed;
}

void AdapterManager::ensure_packed(Lock& lock, const std::shared_ptr<Entry>& entry,
                                   std::vector<std::shared_ptr<const PackedAdapter>>& dropped) {
  while (entry->packed == nullptr) {
    if (entry->retired)
      throw AdapterNotLoadedError(
          detail::concat("adapter '", entry->name, "' was unloaded while it was being reloaded"));
    if (entry->loading) {
      state_->cv.wait(lock);
      continue;
    }
    entry->loading = true;
    lock.unlock();
    std::shared_ptr<const PackedAdapter> packed;
    std::exception_ptr error;
    try {
      packed = std::make_shared<const PackedAdapter>(read_unchanged(*entry));
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    entry->loading = false;
    state_->cv.notify_all();
    if (error) std::rethrow_exception(error);
    if (entry->retired) continue;  // reported at the top of the loop
    entry->packed = std::move(packed);
    cache_insert_locked(entry, dropped);
  }
  entry->cpu_tick = ++state_->tick;
}

AdapterInfo AdapterManager::load(const std::string& name, const std::string& dir) {
  LORAPLEX_CHECK(!name.empty(), "adapter name must not be empty (directory '", dir, "')");
  auto already = [&](const Entry& e) {
    return detail::concat("adapter '", name, "' is already loaded (from '", e.dir,
                          "'); unload it first");
  };
  {
    Lock lock(state_->mutex);
    auto it = adapters_.find(name);
    if (it != adapters_.end()) throw Error(already(*it->second));
  }
  const AdapterStamp stamp = AdapterStamp::of(dir);
  auto packed = std::make_shared<const PackedAdapter>(
      load_peft_adapter(name, dir, registry_, load_options()));
  if (const std::string change = describe_change(stamp, AdapterStamp::of(dir)); !change.empty()) {
    LORAPLEX_FAIL("adapter '", name, "': its files changed while they were read (", change,
                  "); load it again");
  }

  std::vector<std::shared_ptr<const PackedAdapter>> dropped;  // released after the lock
  Lock lock(state_->mutex);
  auto it = adapters_.find(name);
  if (it != adapters_.end()) throw Error(already(*it->second));
  auto entry = std::make_shared<Entry>();
  entry->name = name;
  entry->dir = dir;
  entry->rank = packed->max_rank;
  entry->scale = packed->scale;
  entry->modules = packed->modules;
  entry->bytes = packed->bytes;
  entry->stamp = stamp;
  entry->packed = std::move(packed);
  adapters_.emplace(name, entry);
  cache_insert_locked(entry, dropped);
  return info_locked(*entry);
}

std::future<AdapterInfo> AdapterManager::load_async(const std::string& name,
                                                    const std::string& dir) {
  auto task = std::make_shared<std::packaged_task<AdapterInfo()>>(
      [this, name, dir] { return load(name, dir); });
  std::future<AdapterInfo> result = task->get_future();
  submit([task] { (*task)(); });
  return result;
}

std::future<void> AdapterManager::prefetch(const std::string& name) {
  auto task = std::make_shared<std::packaged_task<void()>>([this, name] {
    std::vector<std::shared_ptr<const PackedAdapter>> dropped;  // released after the lock
    Lock lock(state_->mutex);
    auto it = adapters_.find(name);
    if (it == adapters_.end())
      throw AdapterNotLoadedError(detail::concat("adapter '", name, "' is not loaded"));
    ensure_packed(lock, it->second, dropped);
  });
  std::future<void> result = task->get_future();
  submit([task] { (*task)(); });
  return result;
}

bool AdapterManager::unload(const std::string& name) {
  std::shared_ptr<const PackedAdapter> dropped;  // released after the lock
  Lock lock(state_->mutex);
  auto it = adapters_.find(name);
  if (it == adapters_.end()) return false;
  std::shared_ptr<Entry> entry = it->second;
  adapters_.erase(it);
  entry->retired = true;
  dropped = std::move(entry->packed);
  if (entry->slot >= 0) {
    Lease::State::Slot& s = state_->slots[static_cast<size_t>(entry->slot)];
    if (s.pins == 0) {
      s.entry.reset();
      s.ready = false;
      entry->slot = -1;
    }
  }
  state_->cv.notify_all();
  return true;
}

AdapterManager::Lease AdapterManager::acquire(const std::string& name) {
  return acquire_impl(name, true);
}

AdapterManager::Lease AdapterManager::try_acquire(const std::string& name) {
  return acquire_impl(name, false);
}

bool AdapterManager::is_resident(const std::string& name) const {
  Lock lock(state_->mutex);
  const auto it = adapters_.find(name);
  return it != adapters_.end() && (it->second->slot >= 0 || it->second->packed != nullptr);
}

AdapterManager::Lease AdapterManager::acquire_impl(const std::string& name, bool allow_reload) {
  auto& slots = state_->slots;
  // Packed adapters whose last reference goes here are released after the lock.
  std::vector<std::shared_ptr<const PackedAdapter>> dropped;
  std::shared_ptr<const PackedAdapter> previous_upload;
  Lock lock(state_->mutex);
  for (;;) {
    auto it = adapters_.find(name);
    if (it == adapters_.end())
      throw AdapterNotLoadedError(detail::concat("adapter '", name, "' is not loaded"));
    const std::shared_ptr<Entry> entry = it->second;

    if (entry->slot >= 0) {
      Lease::State::Slot& s = slots[static_cast<size_t>(entry->slot)];
      if (!s.ready) {  // another thread is writing it
        state_->cv.wait(lock);
        continue;
      }
      ++s.pins;
      s.tick = ++state_->tick;
      return Lease(state_, entry->slot, name);
    }

    if (!allow_reload && entry->packed == nullptr) return Lease();
    ensure_packed(lock, entry, dropped);
    // The lock was released while reloading: start over if anything moved.
    it = adapters_.find(name);
    if (it == adapters_.end() || it->second != entry || entry->slot >= 0) continue;

    int chosen = -1;
    for (size_t i = 0; i < slots.size() && chosen < 0; ++i)
      if (slots[i].entry == nullptr) chosen = static_cast<int>(i);
    if (chosen < 0) {
      for (size_t i = 0; i < slots.size(); ++i) {
        if (slots[i].pins > 0) continue;
        if (chosen < 0 || slots[i].tick < slots[static_cast<size_t>(chosen)].tick)
          chosen = static_cast<int>(i);
      }
    }
    if (chosen < 0)
      throw AdapterCapacityError(detail::concat(
          "adapter '", name, "': all ", slots.size(),
          " GPU adapter slots (max_loras) are pinned by running requests for other adapters"));

    Lease::State::Slot& s = slots[static_cast<size_t>(chosen)];
    if (s.entry != nullptr) s.entry->slot = -1;  // evict the least recently used
    s.entry = entry;
    s.pins = 1;
    s.tick = ++state_->tick;
    s.ready = false;
    entry->slot = chosen;
    const std::shared_ptr<const PackedAdapter> packed = entry->packed;
    lock.unlock();
    try {
      write_slot(chosen, *packed);
    } catch (...) {
      lock.lock();
      s.entry.reset();
      s.pins = 0;
      entry->slot = -1;
      state_->cv.notify_all();
      throw;
    }
    lock.lock();
    s.ready = true;
    previous_upload = std::exchange(s.uploaded_from, packed);
    state_->cv.notify_all();
    return Lease(state_, chosen, name);
  }
}

void AdapterManager::write_slot(int slot, const PackedAdapter& packed) {
  auto layers_lock = lock_layers();
  Lease::State::Slot& s = state_->slots[static_cast<size_t>(slot)];
  // The previous upload into this slot must be complete before its source can be released.
  if (s.uploaded != nullptr) s.uploaded->synchronize();
  const std::vector<LoraLayerHandle>& layers = registry_.layers();
  for (size_t l = 0; l < layers.size(); ++l) {
    if (packed.layers[l].empty()) {
      layers[l].reset_lora(slot, copy_stream_);
    } else {
      layers[l].set_lora(slot, packed.layers[l], copy_stream_);
    }
  }
  if (s.uploaded != nullptr) s.uploaded->record(copy_stream_);
}

std::unique_lock<std::recursive_mutex> AdapterManager::lock_layers() {
  return std::unique_lock<std::recursive_mutex>(layers_mutex_);
}

bool AdapterManager::contains(const std::string& name) const {
  Lock lock(state_->mutex);
  return adapters_.count(name) != 0;
}

std::optional<AdapterInfo> AdapterManager::info(const std::string& name) const {
  Lock lock(state_->mutex);
  auto it = adapters_.find(name);
  if (it == adapters_.end()) return std::nullopt;
  return info_locked(*it->second);
}

std::vector<AdapterInfo> AdapterManager::list() const {
  Lock lock(state_->mutex);
  std::vector<AdapterInfo> out;
  out.reserve(adapters_.size());
  for (const auto& [name, entry] : adapters_) out.push_back(info_locked(*entry));
  return out;
}

std::vector<std::string> AdapterManager::slot_contents() const {
  Lock lock(state_->mutex);
  std::vector<std::string> out;
  for (const auto& s : state_->slots) out.push_back(s.entry != nullptr ? s.entry->name : "");
  return out;
}

void AdapterManager::submit(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    LORAPLEX_CHECK(!stopping_, "adapter manager is shutting down");
    queue_.push_back(std::move(task));
  }
  queue_cv_.notify_one();
}

void AdapterManager::worker_loop() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(queue_mutex_);
      queue_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and every queued load has run
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();  // packaged tasks keep their exceptions for the future
  }
}

}  // namespace loraplex
