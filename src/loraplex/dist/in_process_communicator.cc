#include "loraplex/dist/in_process_communicator.h"

#include <cstring>
#include <exception>
#include <thread>

#include "loraplex/core/error.h"

namespace loraplex {

InProcessGroup::InProcessGroup(int size) : size_(size) {
  LORAPLEX_CHECK(size >= 1, "InProcessGroup: size ", size, ", expected >= 1");
  published_.assign(static_cast<size_t>(size), nullptr);
}

void InProcessGroup::abort() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    aborted_ = true;
  }
  cv_.notify_all();
}

bool InProcessGroup::aborted() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return aborted_;
}

void InProcessGroup::barrier() {
  std::unique_lock<std::mutex> lock(mutex_);
  LORAPLEX_CHECK(!aborted_, "in-process group aborted: another rank failed");
  const uint64_t gen = generation_;
  if (++waiting_ == size_) {
    waiting_ = 0;
    ++generation_;
    cv_.notify_all();
    return;
  }
  cv_.wait(lock, [&] { return generation_ != gen || aborted_; });
  LORAPLEX_CHECK(generation_ != gen, "in-process group aborted: another rank failed");
}

InProcessCommunicator::InProcessCommunicator(std::shared_ptr<InProcessGroup> group, int rank)
    : group_(std::move(group)), rank_(rank) {
  LORAPLEX_CHECK(group_ != nullptr, "InProcessCommunicator: null group");
  LORAPLEX_CHECK(rank >= 0 && rank < group_->size(), "InProcessCommunicator: rank ", rank,
                 " outside [0, ", group_->size(), ")");
}

std::vector<std::unique_ptr<InProcessCommunicator>> InProcessCommunicator::create_group(int size) {
  auto group = std::make_shared<InProcessGroup>(size);
  std::vector<std::unique_ptr<InProcessCommunicator>> comms;
  for (int r = 0; r < size; ++r) comms.push_back(std::make_unique<InProcessCommunicator>(group, r));
  return comms;
}

std::string InProcessCommunicator::describe() const {
  return detail::concat("in-process rank ", rank_, " of ", size());
}

namespace {

template <typename T>
void sum_range(InProcessGroup& g, int64_t lo, int64_t hi) {
  const int n = g.size();
  std::vector<T*> src(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) src[static_cast<size_t>(r)] = g.published(r).data<T>();
  for (int64_t i = lo; i < hi; ++i) {
    float acc = 0.0f;
    for (int r = 0; r < n; ++r) acc += load_float(src[static_cast<size_t>(r)][i]);
    const T v = store_float<T>(acc);
    for (int r = 0; r < n; ++r) src[static_cast<size_t>(r)][i] = v;
  }
}

}  // namespace

void InProcessCommunicator::all_reduce_sum(Tensor& tensor, const Stream&) {
  const std::string who = describe();
  dist_detail::check_all_reduce(tensor, who.c_str());
  LORAPLEX_CHECK(tensor.device().is_cpu(), who, ": needs a CPU tensor, got ", tensor.describe());
  LORAPLEX_CHECK(is_floating(tensor.dtype()) && !is_fp8(tensor.dtype()), who,
                 ": all_reduce_sum of dtype ", tensor.dtype(),
                 ", expected float32, float16 or bfloat16");
  InProcessGroup& g = *group_;
  g.publish(rank_, &tensor);
  g.barrier();
  for (int r = 0; r < g.size(); ++r) {
    const Tensor& other = g.published(r);
    LORAPLEX_CHECK(other.shape() == tensor.shape() && other.dtype() == tensor.dtype(), who,
                   ": all_reduce_sum of ", tensor.describe(), " but rank ", r, " passed ",
                   other.describe());
  }
  // Rank r reduces elements [r * chunk, (r + 1) * chunk) of every rank's buffer; nobody else
  // reads or writes those elements in this phase.
  const int64_t numel = tensor.numel();
  const int64_t chunk = (numel + g.size() - 1) / g.size();
  const int64_t lo = std::min(numel, rank_ * chunk);
  const int64_t hi = std::min(numel, lo + chunk);
  dispatch_activation_dtype(tensor.dtype(),
                            [&](auto tag) { sum_range<typename decltype(tag)::type>(g, lo, hi); });
  g.barrier();
}

void InProcessCommunicator::all_gather(const Tensor& in, Tensor& out, int dim, const Stream&) {
  const std::string who = describe();
  InProcessGroup& g = *group_;
  const int d = dist_detail::check_all_gather(in, out, dim, g.size(), who.c_str());
  LORAPLEX_CHECK(in.device().is_cpu(), who, ": needs CPU tensors, got ", in.describe());
  g.publish(rank_, &in);
  g.barrier();
  for (int r = 0; r < g.size(); ++r) {
    const Tensor& other = g.published(r);
    LORAPLEX_CHECK(other.shape() == in.shape() && other.dtype() == in.dtype(), who,
                   ": all_gather of ", in.describe(), " but rank ", r, " passed ",
                   other.describe());
  }
  // out viewed as [outer, size, inner]; rank r's input fills [:, r, :].
  int64_t outer = 1;
  for (int i = 0; i < d; ++i) outer *= in.size(i);
  const int64_t inner_bytes =
      outer == 0 ? 0 : static_cast<int64_t>(in.nbytes()) / std::max<int64_t>(outer, 1);
  char* dst = static_cast<char*>(out.data_ptr());
  for (int r = 0; r < g.size(); ++r) {
    const char* src = static_cast<const char*>(g.published(r).data_ptr());
    for (int64_t o = 0; o < outer; ++o) {
      std::memcpy(dst + (o * g.size() + r) * inner_bytes, src + o * inner_bytes,
                  static_cast<size_t>(inner_bytes));
    }
  }
  g.barrier();
}

void run_in_process_group(int size, const std::function<void(int, Communicator&)>& fn) {
  auto comms = InProcessCommunicator::create_group(size);
  std::mutex mutex;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r, *comms[static_cast<size_t>(r)]);
      } catch (...) {
        {
          std::lock_guard<std::mutex> lock(mutex);
          if (!first) first = std::current_exception();
        }
        comms[static_cast<size_t>(r)]->group().abort();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

}  // namespace loraplex
