#include "layers/layer_test_util.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <mutex>
#include <string>
#include <thread>

#include "loraplex/core/device.h"
#include "loraplex/dist/in_process_communicator.h"
#if LORAPLEX_WITH_CUDA
#include "loraplex/dist/nccl_communicator.h"
#endif

namespace loraplex::test {

const char* backend_name(Backend b) {
  switch (b) {
    case Backend::kCpu:
      return "cpu";
    case Backend::kCuda:
      return "cuda";
    case Backend::kNccl:
      return "nccl";
  }
  return "?";
}

int backend_gpus(Backend b, int tp) {
  switch (b) {
    case Backend::kCpu:
      return 0;
    case Backend::kCuda:
      return 1;
    case Backend::kNccl:
      return tp;
  }
  return 0;
}

Device backend_device(Backend b, int rank) {
  switch (b) {
    case Backend::kCpu:
      return Device::cpu();
    case Backend::kCuda:
      return Device::cuda(0);
    case Backend::kNccl:
      return Device::cuda(rank);
  }
  return Device::cpu();
}

void run_ranks(Backend b, int tp, const std::function<void(int, Communicator*)>& fn) {
  if (tp == 1) {
    fn(0, nullptr);
    return;
  }
  if (b == Backend::kCpu) {
    run_in_process_group(tp, [&](int rank, Communicator& comm) { fn(rank, &comm); });
    return;
  }
  LORAPLEX_CHECK(b == Backend::kNccl, "tensor parallelism on ", backend_name(b),
                 " is not a test backend");
#if LORAPLEX_WITH_CUDA
  const NcclUniqueId id = NcclCommunicator::make_unique_id();
  std::mutex mutex;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  for (int r = 0; r < tp; ++r) {
    threads.emplace_back([&, r] {
      try {
        NcclCommunicator comm(id, r, tp, r);
        fn(r, &comm);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex);
        if (!first) first = std::current_exception();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  if (first) std::rethrow_exception(first);
#else
  LORAPLEX_FAIL("NCCL tests need the CUDA backend");
#endif
}

std::vector<int32_t> mixed_slots(int num_tokens, int max_loras, std::mt19937_64& rng) {
  std::uniform_int_distribution<int32_t> slot(-1, max_loras - 1);
  std::vector<int32_t> slots(static_cast<size_t>(num_tokens));
  for (int32_t& s : slots) s = slot(rng);
  // Guarantee the interesting cases: every slot and -1 appear when the batch is long enough.
  for (int k = -1; k < max_loras && k + 1 < num_tokens; ++k) {
    slots[static_cast<size_t>((k + 1) * 3 % num_tokens)] = k;
  }
  return slots;
}

std::vector<double> xwt_double(const Tensor& x, const Tensor& w) {
  const std::vector<double> xv = x.contiguous().to_double_vector();
  const std::vector<double> wv = w.contiguous().to_double_vector();
  const int64_t m = x.size(0);
  const int64_t k = x.size(1);
  const int64_t n = w.size(0);
  std::vector<double> y(static_cast<size_t>(m * n), 0.0);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0.0;
      for (int64_t p = 0; p < k; ++p) acc += xv[i * k + p] * wv[j * k + p];
      y[i * n + j] = acc;
    }
  }
  return y;
}

void add_lora_double(std::vector<double>& y, int64_t y_width, int64_t col0, const Tensor& x,
                     const Tensor& a, const Tensor& b, const std::vector<int32_t>& slots,
                     int slot) {
  const std::vector<double> xv = x.contiguous().to_double_vector();
  const std::vector<double> av = a.contiguous().to_double_vector();
  const std::vector<double> bv = b.contiguous().to_double_vector();
  const int64_t in = x.size(1);
  const int64_t r = a.size(0);
  const int64_t n = b.size(0);
  for (size_t t = 0; t < slots.size(); ++t) {
    if (slots[t] != slot) continue;
    std::vector<double> mid(static_cast<size_t>(r), 0.0);
    for (int64_t j = 0; j < r; ++j) {
      for (int64_t i = 0; i < in; ++i) mid[j] += xv[t * in + i] * av[j * in + i];
    }
    for (int64_t o = 0; o < n; ++o) {
      double acc = 0.0;
      for (int64_t j = 0; j < r; ++j) acc += mid[j] * bv[o * r + j];
      y[t * y_width + col0 + o] += acc;
    }
  }
}

std::vector<double> values_of(const Tensor& t) {
  if (t.device().is_cpu()) return t.contiguous().to_double_vector();
  return t.contiguous(Stream::default_for(t.device()))
      .to(Device::cpu(), Stream::default_for(t.device()))
      .to_double_vector();
}

double max_abs(const std::vector<double>& v) {
  double m = 0.0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

}  // namespace loraplex::test
