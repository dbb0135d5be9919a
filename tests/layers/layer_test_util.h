#pragma once
// Shared helpers of the layer tests: running one body per tensor-parallel rank (in-process
// threads on the CPU, or one thread per GPU with NCCL) and double-precision building blocks
// written directly from the definitions (never through the library's ops).

#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "loraplex/core/tensor.h"
#include "loraplex/dist/communicator.h"

namespace loraplex::test {

enum class Backend {
  kCpu,   // CPU, tensor parallelism over in-process threads
  kCuda,  // one GPU (cuda:0), tp must be 1
  kNccl,  // tp GPUs (cuda:0..tp-1), one thread each, NCCL
};

const char* backend_name(Backend b);
/// True (and the reason in `why`) when the machine cannot run `backend` at size `tp`.
/// GPUs a backend needs at tensor-parallel size tp (0 on the CPU), for LORAPLEX_REQUIRE_GPUS.
int backend_gpus(Backend b, int tp);
/// The device of `rank` under `backend`.
Device backend_device(Backend b, int rank);

/// Runs fn(rank, comm) once per rank and waits; comm is nullptr when tp == 1. Exceptions of
/// any rank are rethrown.
void run_ranks(Backend b, int tp, const std::function<void(int, Communicator*)>& fn);

/// One slot per token: uniform over [0, max_loras) with about a quarter set to -1, and at
/// least one -1 and one of every slot when there are enough tokens.
std::vector<int32_t> mixed_slots(int num_tokens, int max_loras, std::mt19937_64& rng);

/// x W^T in double: x [m, k], w [n, k] (any float dtype, CPU). Result [m, n] row-major.
std::vector<double> xwt_double(const Tensor& x, const Tensor& w);
/// y[t, col0 + j] += sum_r (x[t] . a[r]) * b[j, r] for the tokens whose slot is `slot`.
/// y: [tokens, y_width]; x [tokens, in]; a [r, in]; b [n, r] (any float dtype, CPU).
void add_lora_double(std::vector<double>& y, int64_t y_width, int64_t col0, const Tensor& x,
                     const Tensor& a, const Tensor& b, const std::vector<int32_t>& slots, int slot);
/// The values of a tensor on any device, as double.
std::vector<double> values_of(const Tensor& t);
/// max |v|, for scaling absolute tolerances.
double max_abs(const std::vector<double>& v);

}  // namespace loraplex::test
