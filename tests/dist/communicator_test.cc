// Communicators: the in-process one (threads, CPU) against serial sums and concatenations,
// its failure handling, and NCCL on two GPUs (skipped with fewer).

#include <gtest/gtest.h>

#include <atomic>
#include <random>
#include <thread>

#include "loraplex/core/device.h"
#include "loraplex/dist/in_process_communicator.h"
#include "support/gpu_check.h"
#include "support/random_data.h"
#if LORAPLEX_WITH_CUDA
#include "loraplex/dist/nccl_communicator.h"
#endif

namespace loraplex {
namespace {

std::vector<Tensor> per_rank_inputs(int size, const Shape& shape, DType dtype, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<Tensor> out;
  for (int r = 0; r < size; ++r) out.push_back(test::random_tensor(shape, dtype, rng));
  return out;
}

void check_all_reduce(int size, DType dtype) {
  const std::vector<Tensor> inputs = per_rank_inputs(size, {7, 13}, dtype, 1);
  std::vector<double> ref(7 * 13, 0.0);
  for (const Tensor& t : inputs) {
    const std::vector<double> v = t.to_double_vector();
    for (size_t i = 0; i < v.size(); ++i) ref[i] += v[i];
  }
  std::vector<Tensor> results(static_cast<size_t>(size));
  run_in_process_group(size, [&](int rank, Communicator& comm) {
    EXPECT_EQ(comm.rank(), rank);
    EXPECT_EQ(comm.size(), size);
    Tensor t = inputs[static_cast<size_t>(rank)].clone();
    comm.all_reduce_sum(t, Stream());
    results[static_cast<size_t>(rank)] = t;
  });
  for (int r = 0; r < size; ++r) {
    test::expect_close(results[static_cast<size_t>(r)], ref, test::default_rtol(dtype), 1e-6,
                       "all_reduce rank " + std::to_string(r));
    // Every rank holds bit-identical sums.
    EXPECT_EQ(results[static_cast<size_t>(r)].to_double_vector(), results[0].to_double_vector());
  }
}

TEST(InProcessCommunicator, AllReduceSumMatchesSerialSum_tp2) {
  check_all_reduce(2, DType::kF32);
  check_all_reduce(2, DType::kBF16);
}

TEST(InProcessCommunicator, AllReduceSumMatchesSerialSum_tp4) {
  check_all_reduce(4, DType::kF32);
  check_all_reduce(4, DType::kF16);
}

// Concatenation along `dim` written out index by index.
std::vector<double> concat_reference(const std::vector<Tensor>& parts, int dim) {
  const Shape shape = parts[0].shape();
  int64_t outer = 1;
  for (int i = 0; i < dim; ++i) outer *= shape[static_cast<size_t>(i)];
  const int64_t inner = parts[0].numel() / outer;
  std::vector<double> out;
  for (int64_t o = 0; o < outer; ++o) {
    for (const Tensor& p : parts) {
      const std::vector<double> v = p.to_double_vector();
      out.insert(out.end(), v.begin() + o * inner, v.begin() + (o + 1) * inner);
    }
  }
  return out;
}

void check_all_gather(int size, int dim) {
  const Shape shape{3, 5, 2};
  const std::vector<Tensor> inputs = per_rank_inputs(size, shape, DType::kF32, 2 + dim);
  const std::vector<double> ref = concat_reference(inputs, dim);
  run_in_process_group(size, [&](int rank, Communicator& comm) {
    Shape out_shape = shape;
    out_shape[static_cast<size_t>(dim)] *= size;
    Tensor out = Tensor::empty(out_shape, DType::kF32);
    comm.all_gather(inputs[static_cast<size_t>(rank)], out, dim, Stream());
    EXPECT_EQ(out.to_double_vector(), ref) << "dim " << dim << " rank " << rank;
  });
}

TEST(InProcessCommunicator, AllGatherConcatenatesInRankOrder_tp2) {
  for (int dim = 0; dim < 3; ++dim) check_all_gather(2, dim);
}

TEST(InProcessCommunicator, AllGatherConcatenatesInRankOrder_tp4) {
  for (int dim = 0; dim < 3; ++dim) check_all_gather(4, dim);
}

TEST(InProcessCommunicator, ManyCollectivesInARow_tp4) {
  // Back-to-back collectives reuse the barrier generations; a fast rank must never see a
  // slow rank's previous tensor.
  std::vector<double> sums(4, 0.0);
  run_in_process_group(4, [&](int rank, Communicator& comm) {
    for (int i = 0; i < 200; ++i) {
      Tensor t = Tensor::from_vector<float>({static_cast<float>(rank + i)}, {1});
      comm.all_reduce_sum(t, Stream());
      ASSERT_EQ(t.item({0}), 4.0 * i + 6.0) << "iteration " << i << " rank " << rank;
    }
    sums[static_cast<size_t>(rank)] = 1.0;
  });
  EXPECT_EQ(sums, std::vector<double>(4, 1.0));
}

TEST(InProcessCommunicator, FailingRankAbortsTheOthers_tp4) {
  // Rank 2 fails before the collective; the others must get an error instead of waiting
  // forever, and the original error is the one reported.
  std::atomic<int> aborted{0};
  try {
    run_in_process_group(4, [&](int rank, Communicator& comm) {
      if (rank == 2) LORAPLEX_FAIL("rank 2 failed on purpose");
      Tensor t = Tensor::from_vector<float>({1.0f}, {1});
      try {
        comm.all_reduce_sum(t, Stream());
      } catch (const Error&) {
        ++aborted;
        throw;
      }
    });
    ADD_FAILURE() << "expected the failure to propagate";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 2 failed on purpose"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(aborted.load(), 3);
}

TEST(InProcessCommunicator, RejectsMismatchedShapes_tp2) {
  int errors = 0;
  try {
    run_in_process_group(2, [&](int rank, Communicator& comm) {
      Tensor t = Tensor::zeros({rank + 1}, DType::kF32);
      comm.all_reduce_sum(t, Stream());
    });
  } catch (const Error& e) {
    ++errors;
    EXPECT_NE(std::string(e.what()).find("passed"), std::string::npos) << e.what();
  }
  EXPECT_EQ(errors, 1);
  Tensor in = Tensor::zeros({2, 3}, DType::kF32);
  Tensor out = Tensor::zeros({2, 3}, DType::kF32);
  SingleDeviceCommunicator single;
  try {
    InProcessCommunicator::create_group(2)[0]->all_gather(in, out, 0, Stream());
    ADD_FAILURE() << "expected a shape error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("needs out [4, 3]"), std::string::npos) << e.what();
  }
}

TEST(SingleDeviceCommunicator, ReduceIsIdentityAndGatherCopies) {
  std::mt19937_64 rng(3);
  SingleDeviceCommunicator comm;
  Tensor t = test::random_tensor({4, 3}, DType::kF32, rng);
  const std::vector<double> before = t.to_double_vector();
  comm.all_reduce_sum(t, Stream());
  EXPECT_EQ(t.to_double_vector(), before);
  Tensor out = Tensor::empty({4, 3}, DType::kF32);
  comm.all_gather(t, out, 1, Stream());
  EXPECT_EQ(out.to_double_vector(), before);
}

TEST(NcclCommunicator, AllReduceAndAllGatherMatchInProcess_tp2) {
  LORAPLEX_REQUIRE_GPUS(2);
#if LORAPLEX_WITH_CUDA
  const std::vector<Tensor> inputs = per_rank_inputs(2, {6, 10}, DType::kF32, 9);
  std::vector<double> ref_sum(60, 0.0);
  for (const Tensor& t : inputs) {
    const std::vector<double> v = t.to_double_vector();
    for (size_t i = 0; i < v.size(); ++i) ref_sum[i] += v[i];
  }
  const NcclUniqueId id = NcclCommunicator::make_unique_id();
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      NcclCommunicator comm(id, r, 2, r);
      const Stream stream = Stream::create(Device::cuda(r));
      Tensor t = inputs[static_cast<size_t>(r)].to(Device::cuda(r), stream);
      comm.all_reduce_sum(t, stream);
      for (int dim = 0; dim < 2; ++dim) {
        Tensor in = inputs[static_cast<size_t>(r)].to(Device::cuda(r), stream);
        Shape shape = in.shape();
        shape[static_cast<size_t>(dim)] *= 2;
        Tensor out = Tensor::empty(shape, DType::kF32, Device::cuda(r));
        comm.all_gather(in, out, dim, stream);
        stream.synchronize();
        EXPECT_EQ(out.to(Device::cpu(), stream).to_double_vector(), concat_reference(inputs, dim))
            << "dim " << dim << " rank " << r;
      }
      stream.synchronize();
      test::expect_close(t.to(Device::cpu(), stream), ref_sum, 1e-6, 1e-6,
                         "NCCL all_reduce rank " + std::to_string(r));
    });
  }
  for (std::thread& t : threads) t.join();
#endif
}

}  // namespace
}  // namespace loraplex
