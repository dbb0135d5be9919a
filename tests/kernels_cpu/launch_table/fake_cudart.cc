// A stand-in for the CUDA runtime that records kernel launches instead of running them, so that
// the host side of the CUDA kernels (which kernel, grid, block, shared memory, cluster and PDL
// attributes, parameter bytes) can be compared between two builds on a machine without a GPU.
// Linked instead of libcudart into record_launches; see README.md.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "fake_cudart.h"

namespace fake_cudart {
namespace {

struct State {
  std::map<const void*, std::string> names;   // host stub -> mangled device name
  std::map<std::string, size_t> param_bytes;  // mangled name -> parameter bytes
  std::map<std::string, int> registers;       // mangled name -> registers per thread
  std::vector<Launch> launches;
  dim3 pushed_grid, pushed_block;
  size_t pushed_smem = 0;
  DeviceModel device;
};

State& state() {
  static State s;
  return s;
}

std::string name_of(const void* fn) {
  auto it = state().names.find(fn);
  if (it == state().names.end()) {
    std::fprintf(stderr, "fake_cudart: launch of an unregistered function %p\n", fn);
    std::abort();
  }
  return it->second;
}

void record(const void* fn, dim3 grid, dim3 block, size_t smem, void** args, int cluster_x,
            bool pdl) {
  Launch l;
  l.name = name_of(fn);
  l.grid[0] = grid.x;
  l.grid[1] = grid.y;
  l.grid[2] = grid.z;
  l.block = block.x * block.y * block.z;
  l.smem = smem;
  l.cluster_x = cluster_x;
  l.pdl = pdl;
  auto size = state().param_bytes.find(l.name);
  if (size == state().param_bytes.end()) {
    std::fprintf(stderr, "fake_cudart: no parameter size for %s\n", l.name.c_str());
    std::abort();
  }
  // Every kernel here takes one parameter (a struct by value).
  const auto* bytes = static_cast<const unsigned char*>(args[0]);
  l.params.assign(bytes, bytes + size->second);
  state().launches.push_back(std::move(l));
}

}  // namespace

void load_kernel_info(const std::string& path) {
  std::ifstream in(path);
  if (!in.good()) {
    std::fprintf(stderr, "fake_cudart: cannot read %s\n", path.c_str());
    std::abort();
  }
  std::string name;
  size_t bytes = 0;
  int regs = 0;
  while (in >> name >> bytes >> regs) {
    state().param_bytes[name] = bytes;
    state().registers[name] = regs;
  }
}

void set_device(const DeviceModel& d) { state().device = d; }
std::vector<Launch> take_launches() {
  std::vector<Launch> out;
  out.swap(state().launches);
  return out;
}

}  // namespace fake_cudart

using fake_cudart::state;

extern "C" {

void** __cudaRegisterFatBinary(void*) {
  static void* handle = nullptr;
  return &handle;
}
void __cudaRegisterFatBinaryEnd(void**) {}
void __cudaUnregisterFatBinary(void**) {}
void __cudaRegisterFunction(void**, const char* host_fun, char*, const char* device_name, int,
                            uint3*, uint3*, dim3*, dim3*, int*) {
  state().names[host_fun] = device_name;
}
void __cudaRegisterVar(void**, char*, char*, const char*, int, size_t, int, int) {}

unsigned __cudaPushCallConfiguration(dim3 grid, dim3 block, size_t smem, struct CUstream_st*) {
  state().pushed_grid = grid;
  state().pushed_block = block;
  state().pushed_smem = smem;
  return 0;
}
cudaError_t __cudaPopCallConfiguration(dim3* grid, dim3* block, size_t* smem, void* stream) {
  *grid = state().pushed_grid;
  *block = state().pushed_block;
  *smem = state().pushed_smem;
  *static_cast<cudaStream_t*>(stream) = nullptr;
  return cudaSuccess;
}
cudaError_t __cudaGetKernel(cudaKernel_t* kernel, const void* fn) {
  *kernel = reinterpret_cast<cudaKernel_t>(const_cast<void*>(fn));
  return cudaSuccess;
}
cudaError_t __cudaLaunchKernel(cudaKernel_t kernel, dim3 grid, dim3 block, void** args, size_t smem,
                               cudaStream_t) {
  fake_cudart::record(reinterpret_cast<const void*>(kernel), grid, block, smem, args, 0, false);
  return cudaSuccess;
}
cudaError_t __cudaLaunchKernel_ptsz(cudaKernel_t kernel, dim3 grid, dim3 block, void** args,
                                    size_t smem, cudaStream_t stream) {
  return __cudaLaunchKernel(kernel, grid, block, args, smem, stream);
}

}  // extern "C"

cudaError_t cudaLaunchKernelExC(const cudaLaunchConfig_t* config, const void* fn, void** args) {
  int cluster_x = 0;
  bool pdl = false;
  for (unsigned i = 0; i < config->numAttrs; ++i) {
    const cudaLaunchAttribute& a = config->attrs[i];
    if (a.id == cudaLaunchAttributeClusterDimension)
      cluster_x = static_cast<int>(a.val.clusterDim.x);
    if (a.id == cudaLaunchAttributeProgrammaticStreamSerialization) {
      pdl = a.val.programmaticStreamSerializationAllowed != 0;
    }
  }
  fake_cudart::record(fn, config->gridDim, config->blockDim, config->dynamicSmemBytes, args,
                      cluster_x, pdl);
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int) { return cudaSuccess; }
cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int) {
  const fake_cudart::DeviceModel& d = state().device;
  switch (attr) {
    case cudaDevAttrMultiProcessorCount:
      *value = d.sm_count;
      return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *value = d.smem_per_block_optin;
      return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor:
      *value = d.smem_per_sm;
      return cudaSuccess;
    case cudaDevAttrComputeCapabilityMajor:
      *value = 9;
      return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor:
      *value = 0;
      return cudaSuccess;
    default:
      std::fprintf(stderr, "fake_cudart: device attribute %d not modelled\n",
                   static_cast<int>(attr));
      std::abort();
  }
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int) {
  const fake_cudart::DeviceModel& d = state().device;
  std::memset(prop, 0, sizeof(*prop));
  std::snprintf(prop->name, sizeof(prop->name), "%s", "fake H100 (launch recorder)");
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = d.sm_count;
  prop->sharedMemPerBlockOptin = static_cast<size_t>(d.smem_per_block_optin);
  prop->sharedMemPerMultiprocessor = static_cast<size_t>(d.smem_per_sm);
  prop->reservedSharedMemPerBlock = static_cast<size_t>(d.reserved_smem_per_block);
  prop->sharedMemPerBlock = 48 * 1024;
  prop->regsPerMultiprocessor = 65536;
  prop->maxThreadsPerMultiProcessor = 2048;
  prop->maxBlocksPerMultiProcessor = 32;
  prop->l2CacheSize = 50 * 1024 * 1024;
  return cudaSuccess;
}

cudaError_t cudaFuncSetAttribute(const void*, cudaFuncAttribute, int) { return cudaSuccess; }

// Blocks per SM as the hardware would allow them: threads, registers (rounded up to 8 per thread
// and allocated per warp) and shared memory (plus the system's reserve per block).
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, const void* fn, int threads,
                                                          size_t smem) {
  const fake_cudart::DeviceModel& d = state().device;
  const std::string name = fake_cudart::name_of(fn);
  auto it = state().registers.find(name);
  const int regs = it == state().registers.end() ? 64 : it->second;
  const int warps = (threads + 31) / 32;
  const int by_threads = 2048 / (warps * 32);
  const int per_warp = ((regs + 7) / 8 * 8) * 32;
  const int by_regs = 65536 / (per_warp * warps);
  const int by_smem =
      static_cast<int>(d.smem_per_sm / (smem + static_cast<size_t>(d.reserved_smem_per_block)));
  int n = by_threads;
  if (by_regs < n) n = by_regs;
  if (by_smem < n) n = by_smem;
  if (n > 32) n = 32;
  *blocks = n;
  return cudaSuccess;
}
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int* blocks, const void* fn,
                                                                   int threads, size_t smem,
                                                                   unsigned) {
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, fn, threads, smem);
}

cudaError_t cudaGetLastError() { return cudaSuccess; }
cudaError_t cudaPeekAtLastError() { return cudaSuccess; }
const char* cudaGetErrorString(cudaError_t) { return "fake_cudart error"; }
const char* cudaGetErrorName(cudaError_t) { return "fake_cudart"; }

// Anything that would touch memory or synchronise is an error here: the recorder only plans.
namespace {
cudaError_t unsupported(const char* what) {
  std::fprintf(stderr, "fake_cudart: %s is not supported by the launch recorder\n", what);
  std::abort();
}
}  // namespace

cudaError_t cudaMalloc(void**, size_t) { return unsupported("cudaMalloc"); }
cudaError_t cudaFree(void*) { return unsupported("cudaFree"); }
cudaError_t cudaMemsetAsync(void*, int, size_t, cudaStream_t) {
  return unsupported("cudaMemsetAsync");
}
cudaError_t cudaMemcpyAsync(void*, const void*, size_t, cudaMemcpyKind, cudaStream_t) {
  return unsupported("cudaMemcpyAsync");
}
cudaError_t cudaEventCreate(cudaEvent_t*) { return unsupported("cudaEventCreate"); }
cudaError_t cudaEventDestroy(cudaEvent_t) { return unsupported("cudaEventDestroy"); }
cudaError_t cudaEventElapsedTime(float*, cudaEvent_t, cudaEvent_t) {
  return unsupported("cudaEventElapsedTime");
}
cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t) { return unsupported("cudaEventRecord"); }
cudaError_t cudaEventSynchronize(cudaEvent_t) { return unsupported("cudaEventSynchronize"); }
cudaError_t cudaGraphDestroy(cudaGraph_t) { return unsupported("cudaGraphDestroy"); }
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t) { return unsupported("cudaGraphExecDestroy"); }
cudaError_t cudaGraphInstantiate(cudaGraphExec_t*, cudaGraph_t, unsigned long long) {
  return unsupported("cudaGraphInstantiate");
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t, cudaStream_t) {
  return unsupported("cudaGraphLaunch");
}
cudaError_t cudaStreamBeginCapture(cudaStream_t, cudaStreamCaptureMode) {
  return unsupported("cudaStreamBeginCapture");
}
cudaError_t cudaStreamEndCapture(cudaStream_t, cudaGraph_t*) {
  return unsupported("cudaStreamEndCapture");
}
