#include "collective_timing.h"

#include <algorithm>
#include <barrier>
#include <exception>
#include <mutex>
#include <thread>

#include "loraplex/core/cuda_runtime.h"
#include "loraplex/core/error.h"
#include "loraplex/core/stream.h"
#include "loraplex/core/tensor.h"
#include "loraplex/kernels/cuda/device_timing.h"
#if LORAPLEX_WITH_CUDA
#include "loraplex/dist/nccl_communicator.h"
#endif

namespace loraplex::cli {

double decode_collectives_ms(const std::vector<int>& devices, DType dtype, int64_t rows,
                             int64_t hidden, int64_t vocab_shard, int all_reduces, int repeats) {
#if LORAPLEX_WITH_CUDA
  LORAPLEX_CHECK(!devices.empty() && rows >= 1 && repeats >= 1,
                 "decode_collectives_ms: ", devices.size(), " devices, ", rows, " rows, ", repeats,
                 " repeats");
  auto comms = NcclCommunicator::create_group(devices);
  const size_t n = devices.size();
  std::vector<double> times;
  std::exception_ptr error;
  std::mutex mutex;
  // Every repeat starts on all ranks together: the time is the collectives', not a late rank's.
  std::barrier sync(static_cast<std::ptrdiff_t>(n));
  std::vector<std::thread> threads;
  for (size_t r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        const Device dev = Device::cuda(devices[r]);
        cuda_rt::set_device(dev.index);
        const Stream stream = Stream::create(dev);
        Tensor x = Tensor::zeros({rows, hidden}, dtype, dev, stream);
        Tensor local = Tensor::zeros({rows, vocab_shard}, dtype, dev, stream);
        Tensor gathered = Tensor::empty({static_cast<int64_t>(n) * rows, vocab_shard}, dtype, dev);
        Communicator& comm = *comms[r];
        auto step = [&] {
          for (int i = 0; i < all_reduces; ++i) comm.all_reduce_sum(x, stream);
          comm.all_gather(local, gathered, 0, stream);
        };
        step();
        stream.synchronize();
        kernels::cuda::Timer timer;
        for (int i = 0; i < repeats; ++i) {
          sync.arrive_and_wait();
          timer.start(stream.handle());
          step();
          timer.stop(stream.handle());
          const double ms = timer.elapsed_ms();
          if (r == 0) times.push_back(ms);
        }
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex);
        if (!error) error = std::current_exception();
        for (auto& c : comms) c->abort();
        sync.arrive_and_drop();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  if (error) std::rethrow_exception(error);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
#else
  (void)devices;
  (void)dtype;
  (void)rows;
  (void)hidden;
  (void)vocab_shard;
  (void)all_reduces;
  (void)repeats;
  LORAPLEX_FAIL("timing collectives needs the CUDA backend");
#endif
}

}  // namespace loraplex::cli
