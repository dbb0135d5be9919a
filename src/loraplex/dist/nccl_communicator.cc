#include "loraplex/dist/nccl_communicator.h"

#include <nccl.h>

#include <chrono>
#include <cstdlib>
#include <cstring>

#include "loraplex/core/cuda_runtime.h"
#include "loraplex/core/error.h"

namespace loraplex {
namespace {

static_assert(sizeof(ncclUniqueId) == sizeof(NcclUniqueId::bytes),
              "NcclUniqueId must hold exactly an ncclUniqueId");

void check_nccl(ncclResult_t result, const char* what, int rank) {
  LORAPLEX_CHECK(result == ncclSuccess, "NCCL ", what, " failed on rank ", rank, ": ",
                 ncclGetErrorString(result));
}

ncclDataType_t nccl_type(DType dtype, const char* who) {
  switch (dtype) {
    case DType::kF32:
      return ncclFloat32;
    case DType::kF16:
      return ncclFloat16;
    case DType::kBF16:
      return ncclBfloat16;
    case DType::kI32:
      return ncclInt32;
    case DType::kI64:
      return ncclInt64;
    case DType::kU8:
      return ncclUint8;
    default:
      LORAPLEX_FAIL(who, ": dtype ", dtype, " is not supported by the NCCL communicator");
  }
}

ncclComm_t as_comm(void* comm) { return static_cast<ncclComm_t>(comm); }

}  // namespace

NcclUniqueId NcclCommunicator::make_unique_id() {
  ncclUniqueId id;
  check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId", -1);
  NcclUniqueId out;
  std::memcpy(out.bytes.data(), &id, sizeof(id));
  return out;
}

NcclCommunicator::NcclCommunicator(const NcclUniqueId& id, int rank, int size, int device)
    : rank_(rank), size_(size), device_(device) {
  LORAPLEX_CHECK(size >= 1 && rank >= 0 && rank < size, "NcclCommunicator: rank ", rank,
                 " of size ", size, " is not a valid rank");
  LORAPLEX_CHECK(device >= 0 && device < cuda_rt::device_count(), "NcclCommunicator: CUDA device ",
                 device, " does not exist (", cuda_rt::device_count(), " devices)");
  // NVLink SHARP multicast is off unless the user asked for it: it needs fabric-manager
  // support that the lent machines do not promise, and NCCL would fail at init without it.
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  cuda_rt::set_device(device);
  ncclUniqueId nid;
  std::memcpy(&nid, id.bytes.data(), sizeof(nid));
  ncclComm_t comm = nullptr;
  check_nccl(ncclCommInitRank(&comm, size, nid, rank), "ncclCommInitRank", rank);
  comm_.store(comm);
}

NcclCommunicator::NcclCommunicator(Adopt, void* comm, int rank, int size, int device)
    : comm_(comm), rank_(rank), size_(size), device_(device) {}

std::vector<std::unique_ptr<NcclCommunicator>> NcclCommunicator::create_group(
    const std::vector<int>& devices) {
  const int n = static_cast<int>(devices.size());
  LORAPLEX_CHECK(n >= 1, "NcclCommunicator::create_group: no devices");
  for (int d : devices) {
    LORAPLEX_CHECK(d >= 0 && d < cuda_rt::device_count(), "NcclCommunicator: CUDA device ", d,
                   " does not exist (", cuda_rt::device_count(), " devices)");
  }
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  std::vector<ncclComm_t> comms(devices.size(), nullptr);
  const int previous = cuda_rt::current_device();
  const ncclResult_t result = ncclCommInitAll(comms.data(), n, devices.data());
  cuda_rt::set_device(previous);
  check_nccl(result, "ncclCommInitAll", -1);
  std::vector<std::unique_ptr<NcclCommunicator>> out;
  for (int r = 0; r < n; ++r) {
    out.emplace_back(new NcclCommunicator(Adopt{}, comms[static_cast<size_t>(r)], r, n,
                                          devices[static_cast<size_t>(r)]));
  }
  return out;
}

NcclCommunicator::~NcclCommunicator() {
  void* comm = comm_.exchange(nullptr);
  if (comm != nullptr) ncclCommDestroy(as_comm(comm));
}

void* NcclCommunicator::live(const std::string& who) const {
  void* comm = comm_.load();
  LORAPLEX_CHECK(comm != nullptr, who, ": the communicator was aborted (a rank failed or a step ",
                 "timed out)");
  return comm;
}

void NcclCommunicator::abort() {
  // A collective being enqueued finishes first, unless it is blocked on a peer (the first
  // collectives connect to the peers): then the abort is what unblocks it.
  std::unique_lock<std::shared_timed_mutex> lock(use_mutex_, std::defer_lock);
  (void)lock.try_lock_for(std::chrono::seconds(2));
  void* comm = comm_.exchange(nullptr);
  if (comm != nullptr) ncclCommAbort(as_comm(comm));
}

std::string NcclCommunicator::async_error() {
  std::unique_lock<std::shared_timed_mutex> lock(use_mutex_, std::try_to_lock);
  if (!lock.owns_lock()) return {};  // a collective is being enqueued: ask again later
  void* comm = comm_.load();
  if (comm == nullptr) return {};
  ncclResult_t state = ncclSuccess;
  const ncclResult_t result = ncclCommGetAsyncError(as_comm(comm), &state);
  if (result != ncclSuccess)
    return std::string("ncclCommGetAsyncError: ") + ncclGetErrorString(result);
  if (state == ncclSuccess || state == ncclInProgress) return {};
  return detail::concat(describe(), ": ", ncclGetErrorString(state));
}

std::string NcclCommunicator::describe() const {
  return detail::concat("NCCL rank ", rank_, " of ", size_, " on cuda:", device_);
}

void NcclCommunicator::all_reduce_sum(Tensor& tensor, const Stream& stream) {
  const std::string who = describe();
  dist_detail::check_all_reduce(tensor, who.c_str());
  LORAPLEX_CHECK(tensor.device() == Device::cuda(device_), who, ": tensor on ", tensor.device(),
                 ", expected cuda:", device_);
  const ncclDataType_t type = nccl_type(tensor.dtype(), who.c_str());
  std::shared_lock<std::shared_timed_mutex> in_use(use_mutex_);
  void* comm = live(who);
  if (tensor.numel() == 0) return;
  cuda_rt::set_device(device_);
  check_nccl(
      ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), static_cast<size_t>(tensor.numel()), type,
                    ncclSum, as_comm(comm), static_cast<cudaStream_t>(stream.handle())),
      "ncclAllReduce", rank_);
}

void NcclCommunicator::all_gather(const Tensor& in, Tensor& out, int dim, const Stream& stream) {
  const std::string who = describe();
  const int d = dist_detail::check_all_gather(in, out, dim, size_, who.c_str());
  LORAPLEX_CHECK(in.device() == Device::cuda(device_), who, ": tensors on ", in.device(),
                 ", expected cuda:", device_);
  const ncclDataType_t type = nccl_type(in.dtype(), who.c_str());
  std::shared_lock<std::shared_timed_mutex> in_use(use_mutex_);
  ncclComm_t comm = as_comm(live(who));
  if (in.numel() == 0) return;
  cuda_rt::set_device(device_);
  const auto count = static_cast<size_t>(in.numel());
  const auto cu_stream = static_cast<cudaStream_t>(stream.handle());
  int64_t outer = 1;
  for (int i = 0; i < d; ++i) outer *= in.size(i);
  if (outer == 1) {
    check_nccl(ncclAllGather(in.data_ptr(), out.data_ptr(), count, type, comm, cu_stream),
               "ncclAllGather", rank_);
    return;
  }
  const int64_t need = static_cast<int64_t>(in.nbytes()) * size_;
  if (!staging_.defined() || staging_.numel() < need) {
    if (staging_.defined()) retired_.push_back(staging_);
    staging_ = Tensor::empty({need}, DType::kU8, Device::cuda(device_));
  }
  check_nccl(ncclAllGather(in.data_ptr(), staging_.data_ptr(), count, type, comm, cu_stream),
             "ncclAllGather", rank_);
  // staging is [size, outer, inner]; out is [outer, size, inner].
  const int64_t inner = in.numel() / outer;
  Tensor gathered = Tensor::from_blob(staging_.data_ptr(), {size_, outer, inner}, in.dtype(),
                                      out.device(), staging_.storage());
  Tensor out_rows = out.view({outer, size_ * inner});
  for (int r = 0; r < size_; ++r) {
    Tensor dst = out_rows.narrow(1, r * inner, inner);
    dst.copy_from(gathered.select(0, r), stream);
  }
}

}  // namespace loraplex
