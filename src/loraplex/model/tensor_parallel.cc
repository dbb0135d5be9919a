#include "loraplex/model/tensor_parallel.h"

#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "loraplex/core/cuda_runtime.h"
#include "loraplex/core/error.h"
#include "loraplex/dist/in_process_communicator.h"
#include "loraplex/model/shard_layout.h"
#if LORAPLEX_WITH_CUDA
#include "loraplex/dist/nccl_communicator.h"
#endif

namespace loraplex::model {
namespace {

using Clock = std::chrono::steady_clock;

// After an abort, how long ranks get to return before the group gives up on them.
constexpr double kAbortGraceSeconds = 30.0;

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Makes `device` current on this thread for the guard's lifetime (CUDA devices only).
class CurrentDevice {
 public:
  explicit CurrentDevice(Device device) {
    if (device.is_cuda()) {
      previous_ = cuda_rt::current_device();
      cuda_rt::set_device(device.index);
    }
  }
  ~CurrentDevice() {
    if (previous_ >= 0) {
      try {
        cuda_rt::set_device(previous_);
      } catch (...) {  // a destructor must not throw; the next CUDA call reports the error
      }
    }
  }
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;

 private:
  int previous_ = -1;
};

std::string what_of(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

}  // namespace

// The ranks, their threads and the job they run together. Shared with the rank threads, so that
// a thread that never returns (a device that hangs even after the abort) can be left behind.
struct TensorParallelDecoder::Group {
  struct Rank {
    int index = 0;
    Device device;
    Communicator* comm = nullptr;
    std::unique_ptr<Decoder> decoder;
    std::thread thread;
    std::exception_ptr error;
    bool busy = false;
  };

  // Destroyed after the ranks, whose layers use them.
  std::vector<std::unique_ptr<Communicator>> owned_comms;
  std::vector<std::unique_ptr<Rank>> ranks;

  mutable std::mutex mutex;
  std::condition_variable work_cv;
  std::condition_variable done_cv;
  std::function<void(Rank&)> job;
  uint64_t job_id = 0;
  size_t pending = 0;
  bool stopping = false;
  int first_failed = -1;  // the rank whose error stopped the current job
  std::string failure;    // set once: the group is stopped
  bool stuck = false;     // a rank did not return after the abort

  void abort_all() {
    for (const auto& r : ranks) {
      if (r->comm == nullptr) continue;
      try {
        r->comm->abort();
      } catch (...) {  // best effort: the other communicators still need their abort
      }
    }
  }

  void check_running() const {
    std::lock_guard<std::mutex> lock(mutex);
    LORAPLEX_CHECK(failure.empty(), "the tensor-parallel group stopped earlier: ", failure);
  }

  static void rank_main(const std::shared_ptr<Group>& g, Rank& r) {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(g->mutex);
        g->work_cv.wait(lock, [&] { return g->stopping || g->job_id != seen; });
        if (g->stopping) break;
        seen = g->job_id;
        r.busy = true;
      }
      std::exception_ptr error;
      try {
        if (r.device.is_cuda()) cuda_rt::set_device(r.device.index);
        g->job(r);
      } catch (...) {
        error = std::current_exception();
      }
      if (error) {
        {
          std::lock_guard<std::mutex> lock(g->mutex);
          if (g->first_failed < 0) g->first_failed = r.index;
        }
        // Peers waiting in a collective for this rank return (and throw) instead of hanging.
        g->abort_all();
      }
      std::lock_guard<std::mutex> lock(g->mutex);
      r.error = error;
      r.busy = false;
      if (--g->pending == 0) g->done_cv.notify_all();
    }
    // The replica goes on its own thread, with its device current.
    try {
      if (r.device.is_cuda()) cuda_rt::set_device(r.device.index);
      r.decoder.reset();
    } catch (...) {  // nothing to report to at shutdown
    }
  }

  // Runs `fn` on every rank at once and waits for all of them. A rank's error, an asynchronous
  // communicator error or (timeout_s > 0) a job still running after timeout_s stops the group
  // and throws naming the rank, its device and `what`.
  void run(std::function<void(Rank&)> fn, double timeout_s, const std::string& what) {
    std::unique_lock<std::mutex> lock(mutex);
    LORAPLEX_CHECK(failure.empty(), "the tensor-parallel group stopped earlier: ", failure);
    job = std::move(fn);
    pending = ranks.size();
    first_failed = -1;
    for (auto& r : ranks) r->error = nullptr;
    ++job_id;
    work_cv.notify_all();
    const Clock::time_point start = Clock::now();
    std::optional<Clock::time_point> aborted_at;
    std::string reason;
    while (pending > 0) {
      done_cv.wait_for(lock, std::chrono::milliseconds(20));
      if (pending == 0) break;
      const Clock::time_point now = Clock::now();
      // A failed rank has aborted the group already; the others are returning.
      if (!aborted_at && first_failed >= 0) aborted_at = now;
      if (aborted_at) {
        if (seconds_between(*aborted_at, now) > kAbortGraceSeconds) {
          stuck = true;
          break;
        }
        continue;
      }
      lock.unlock();
      std::string why;
      for (const auto& r : ranks) {
        const std::string e = r->comm != nullptr ? r->comm->async_error() : std::string();
        if (!e.empty()) {
          why = detail::concat("rank ", r->index, " (", r->device, ") reported ", e);
          break;
        }
      }
      lock.lock();
      if (why.empty() && timeout_s > 0 && seconds_between(start, now) > timeout_s) {
        std::string running;
        for (const auto& r : ranks) {
          if (r->busy) {
            running += detail::concat(running.empty() ? "" : ", ", "rank ", r->index, " (",
                                      r->device, ")");
          }
        }
        why = detail::concat(what, " did not finish within step_timeout_s ", timeout_s,
                             " s; still running: ", running);
      }
      if (!why.empty()) {
        reason = why;
        aborted_at = now;
        lock.unlock();
        abort_all();
        lock.lock();
      }
    }
    if (reason.empty() && first_failed >= 0) {
      const Rank& r = *ranks[static_cast<size_t>(first_failed)];
      reason = detail::concat("rank ", r.index, " (", r.device, ") failed during ", what, ": ",
                              what_of(r.error));
    }
    if (reason.empty() && stuck) reason = detail::concat(what, ": a rank did not return");
    if (reason.empty()) {
      for (const auto& r : ranks) {
        if (r->error) {
          reason = detail::concat("rank ", r->index, " (", r->device, ") failed during ", what,
                                  ": ", what_of(r->error));
          break;
        }
      }
    }
    if (reason.empty()) return;
    failure = detail::concat("tensor-parallel size ", ranks.size(), ": ", reason);
    if (stuck) failure += " (a rank did not return within 30 s of the abort and was left behind)";
    LORAPLEX_FAIL(failure, "; the tensor-parallel group is stopped");
  }

  // Adapter uploads to ranks on other devices than the adapter manager's copy stream: each rank
  // copies on a stream of its own device, which the manager's stream then waits for, so the
  // manager's per-slot event covers every rank (and Lease::wait_ready orders each rank's
  // compute stream after it).
  std::vector<Stream> copy_streams;
  std::vector<std::unique_ptr<Event>> copied;
};

std::unique_ptr<TensorParallelDecoder> TensorParallelDecoder::create(const ModelConfig& config,
                                                                     const DecoderOptions& options,
                                                                     const RankFactory& make_rank) {
  const int tp = options.tensor_parallel_size;
  // The GPUs first: with too few, how the shapes would split is beside the point.
  if (options.device.is_cuda()) {
    const int present = cuda_device_count();
    LORAPLEX_CHECK(options.device.index + tp <= present, "tensor-parallel size ", tp, " needs ", tp,
                   " GPUs from ", options.device, " on, but ", present, " CUDA device",
                   present == 1 ? " is" : "s are", " present");
  }
  check_shard_layout(config, tp, options.fully_sharded_loras);
  std::vector<std::unique_ptr<Communicator>> owned;
  if (options.device.is_cuda()) {
#if LORAPLEX_WITH_CUDA
    std::vector<int> devices;
    for (int r = 0; r < tp; ++r) devices.push_back(options.device.index + r);
    for (auto& c : NcclCommunicator::create_group(devices)) owned.push_back(std::move(c));
#else
    LORAPLEX_FAIL("tensor parallelism on ", options.device, " needs the CUDA backend");
#endif
  } else {
    for (auto& c : InProcessCommunicator::create_group(tp)) owned.push_back(std::move(c));
  }
  std::vector<Communicator*> comms;
  for (const auto& c : owned) comms.push_back(c.get());
  return build(config, options, make_rank, comms, std::move(owned));
}

std::unique_ptr<TensorParallelDecoder> TensorParallelDecoder::create(
    const ModelConfig& config, const DecoderOptions& options, const RankFactory& make_rank,
    const std::vector<Communicator*>& comms) {
  const int tp = options.tensor_parallel_size;
  check_shard_layout(config, tp, options.fully_sharded_loras);
  LORAPLEX_CHECK(static_cast<int>(comms.size()) == tp, "tensor-parallel size ", tp, " but ",
                 comms.size(), " communicators");
  for (int r = 0; r < tp; ++r) {
    const Communicator* c = comms[static_cast<size_t>(r)];
    LORAPLEX_CHECK(c != nullptr && c->rank() == r && c->size() == tp,
                   "tensor-parallel communicator ", r, " is ",
                   c != nullptr ? c->describe() : "null", ", expected rank ", r, " of ", tp);
  }
  return build(config, options, make_rank, comms, {});
}

std::unique_ptr<TensorParallelDecoder> TensorParallelDecoder::build(
    const ModelConfig& config, const DecoderOptions& options, const RankFactory& make_rank,
    const std::vector<Communicator*>& comms, std::vector<std::unique_ptr<Communicator>> owned) {
  std::unique_ptr<TensorParallelDecoder> d(new TensorParallelDecoder());
  d->config_ = config;
  d->options_ = options;
  d->group_ = std::make_shared<Group>();
  d->group_->owned_comms = std::move(owned);
  for (size_t r = 0; r < comms.size(); ++r) {
    auto rank = std::make_unique<Group::Rank>();
    rank->index = static_cast<int>(r);
    rank->device = options.device.is_cuda()
                       ? Device::cuda(options.device.index + static_cast<int>(r))
                       : options.device;
    rank->comm = comms[r];
    d->group_->ranks.push_back(std::move(rank));
  }
  d->start(make_rank);
  return d;
}

void TensorParallelDecoder::start(const RankFactory& make_rank) {
  Group& g = *group_;
  for (auto& r : g.ranks) {
    Group::Rank* rank = r.get();
    rank->thread = std::thread([group = group_, rank] { Group::rank_main(group, *rank); });
  }
  const DecoderOptions base = options_;
  g.run(
      [&make_rank, base](Group::Rank& r) {
        DecoderOptions o = base;
        o.device = r.device;
        o.comm = r.comm;
        r.decoder = make_rank(o);
        LORAPLEX_CHECK(r.decoder != nullptr, "the rank factory returned no decoder");
      },
      0.0, "loading the model");
  // What the ranks settled (max_model_len's default), as the group's.
  options_ = g.ranks[0]->decoder->options();
  options_.comm = nullptr;
  build_targets();
}

void TensorParallelDecoder::build_targets() {
  Group& g = *group_;
  const size_t tp = g.ranks.size();
  for (const auto& r : g.ranks) {
    if (r->device.is_cuda()) {
      CurrentDevice current(r->device);
      g.copy_streams.push_back(Stream::create(r->device));
      g.copied.push_back(std::make_unique<Event>());
    } else {
      g.copy_streams.emplace_back();
      g.copied.push_back(nullptr);
    }
  }
  const LoraTargetRegistry& first = g.ranks[0]->decoder->targets();
  std::vector<LoraLayerHandle> merged;
  for (size_t l = 0; l < first.layers().size(); ++l) {
    std::vector<LoraLayerHandle> per_rank;
    std::vector<Device> devices;
    for (const auto& r : g.ranks) {
      const LoraLayerHandle& h = r->decoder->targets().layers().at(l);
      LORAPLEX_CHECK(h.name() == first.layers()[l].name(), "tensor-parallel rank ", r->index,
                     " registered LoRA layer '", h.name(), "' where rank 0 has '",
                     first.layers()[l].name(), "'");
      per_rank.push_back(h);
      devices.push_back(r->device);
    }
    std::shared_ptr<Group> group = group_;
    auto set = [per_rank, devices, group, tp](int slot, const std::vector<LoraSliceWeights>& slices,
                                              const Stream& stream) {
      for (size_t r = 0; r < tp; ++r) {
        const Device dev = devices[r];
        if (!dev.is_cuda() || stream.device() == dev) {
          CurrentDevice current(dev);
          per_rank[r].set_lora(slot, slices, stream);
          continue;
        }
        CurrentDevice current(dev);
        per_rank[r].set_lora(slot, slices, group->copy_streams[r]);
        group->copied[r]->record(group->copy_streams[r]);
        group->copied[r]->wait_on(stream);
      }
    };
    auto reset = [per_rank, devices, group, tp](int slot, const Stream& stream) {
      for (size_t r = 0; r < tp; ++r) {
        const Device dev = devices[r];
        CurrentDevice current(dev);
        if (!dev.is_cuda() || stream.device() == dev) {
          per_rank[r].reset_lora(slot, stream);
          continue;
        }
        per_rank[r].reset_lora(slot, group->copy_streams[r]);
        group->copied[r]->record(group->copy_streams[r]);
        group->copied[r]->wait_on(stream);
      }
    };
    merged.emplace_back(first.layers()[l].name(), first.layers()[l].num_slices(), std::move(set),
                        std::move(reset));
  }
  for (const LoraTarget& t : first.targets()) {
    LoraTarget m = t;
    m.layer = merged[first.layer_index(t)];
    targets_.add(std::move(m));
  }
}

TensorParallelDecoder::~TensorParallelDecoder() {
  if (group_ == nullptr) return;
  Group& g = *group_;
  {
    std::lock_guard<std::mutex> lock(g.mutex);
    g.stopping = true;
  }
  g.work_cv.notify_all();
  for (auto& r : g.ranks) {
    if (!r->thread.joinable()) continue;
    bool busy = false;
    {
      std::lock_guard<std::mutex> lock(g.mutex);
      busy = r->busy;
    }
    if (busy) {
      // Never returned from a job even after the abort: its replica (and the group's
      // communicators) stay with it.
      r->thread.detach();
    } else {
      r->thread.join();
    }
  }
}

void TensorParallelDecoder::allocate_kv_cache(int64_t num_blocks) {
  group_->run([num_blocks](Group::Rank& r) { r.decoder->allocate_kv_cache(num_blocks); }, 0.0,
              "allocating the KV cache");
  options_.kv_blocks = num_blocks;
}

int64_t TensorParallelDecoder::kv_block_bytes() const {
  return group_->ranks[0]->decoder->kv_block_bytes();
}

void TensorParallelDecoder::launch(const StepBatch& batch) {
  group_->check_running();
  // A batch the model refuses is refused here, before any rank starts: no rank throws alone.
  group_->ranks[0]->decoder->check(batch);
  group_->run([&batch](Group::Rank& r) { r.decoder->launch(batch); }, options_.step_timeout_s,
              "launching a step");
  last_step_ = group_->ranks[0]->decoder->last_step();
}

StepResult TensorParallelDecoder::collect() {
  group_->check_running();
  std::vector<StepResult> results(group_->ranks.size());
  group_->run(
      [&results](Group::Rank& r) { results[static_cast<size_t>(r.index)] = r.decoder->collect(); },
      options_.step_timeout_s, "a step");
  for (size_t r = 1; r < results.size(); ++r) {
    LORAPLEX_CHECK(results[r].token_ids == results[0].token_ids, "tensor-parallel rank ", r,
                   " sampled other tokens than rank 0 from the same "
                   "logits (the ranks' all-gathered logits must be identical)");
  }
  return std::move(results[0]);
}

std::vector<Device> TensorParallelDecoder::devices() const {
  std::vector<Device> out;
  for (const auto& r : group_->ranks) out.push_back(r->device);
  return out;
}

std::vector<Stream> TensorParallelDecoder::streams() const {
  std::vector<Stream> out;
  for (const auto& r : group_->ranks) out.push_back(r->decoder->stream());
  return out;
}

Decoder& TensorParallelDecoder::rank(int r) {
  LORAPLEX_CHECK(r >= 0 && r < static_cast<int>(group_->ranks.size()), "tensor-parallel rank ", r,
                 " outside [0, ", group_->ranks.size(), ")");
  return *group_->ranks[static_cast<size_t>(r)]->decoder;
}

std::string TensorParallelDecoder::failure() const {
  std::lock_guard<std::mutex> lock(group_->mutex);
  return group_->failure;
}

}  // namespace loraplex::model
