// `loraplex bench sampling`: the GPU sampler (model/sampling_ops.h) on random logits, per batch
// size and parameter set, timed as 10 calls captured in a CUDA graph and replayed (what a
// captured decode step pays), beside the time to read the logits once at the measured copy
// bandwidth.

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli_parse.h"
#include "command.h"
#include "loraplex/core/cuda_runtime.h"
#include "loraplex/core/device.h"
#include "loraplex/core/error.h"
#include "loraplex/core/stream.h"
#include "loraplex/kernels/cuda/device_timing.h"
#include "loraplex/model/sampling_ops.h"

namespace loraplex::cli {
namespace {

namespace kc = kernels::cuda;
using nlohmann::json;

const char* kHelp =
    "usage: loraplex bench sampling [--rows N[,N...]] [--vocab V]\n"
    "           [--dtype bfloat16|float16|float32] [--logprobs] [--replays R] [--json FILE]\n"
    "Times the GPU sampler on random logits (uniform in +-[1.25, 10]) for each batch size\n"
    "(default 1,32,256) and parameter set: greedy; temperature 0.8; + top_k 50; + top_p 0.9;\n"
    "+ both; mixed (the five cycled over the rows). Each figure is the mean per call of R\n"
    "replays (default 20) of a CUDA graph of 10 calls; 'read_us' is the logits' bytes over the\n"
    "measured device copy bandwidth. Vocabulary 128256 and bfloat16 by default.\n";

struct Options {
  std::vector<int64_t> rows = {1, 32, 256};
  int64_t vocab = 128256;
  DType dtype = DType::kBF16;
  bool logprobs = false;
  int replays = 20;
  std::string json_path;
};

// Returns false when --help was printed.
bool parse(const std::vector<std::string>& args, Options& o) {
  CLI::App app{kHelp, "loraplex bench sampling"};
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option_function<std::string>(
         "--rows",
         [&](const std::string& v) {
           o.rows.clear();
           for (size_t at = 0; at <= v.size();) {
             const size_t comma = std::min(v.find(',', at), v.size());
             o.rows.push_back(parse_int("--rows", v.substr(at, comma - at), 1));
             at = comma + 1;
           }
         },
         "batch sizes (default 1,32,256)")
      ->type_name("N[,N...]");
  add_int(app, "--vocab", o.vocab, 1, "vocabulary (default 128256)");
  app.add_option_function<std::string>(
         "--dtype", [&](const std::string& v) { o.dtype = dtype_from_name(v); },
         "bfloat16 (default), float16 or float32")
      ->type_name("DTYPE");
  app.add_flag("--logprobs", o.logprobs, "also the picked ids' log-probabilities");
  add_int(app, "--replays", o.replays, 1, "graph replays per figure (default 20)");
  app.add_option("--json", o.json_path, "write the results as JSON")->type_name("FILE");
  return parse_cli(app, args);
}

struct ParamSet {
  const char* name;
  float temperature;
  int top_k;
  float top_p;
};
constexpr ParamSet kSets[] = {{"greedy", 0.0f, 0, 1.0f},
                              {"temperature", 0.8f, 0, 1.0f},
                              {"top_k_50", 0.8f, 50, 1.0f},
                              {"top_p_0.9", 0.8f, 0, 0.9f},
                              {"top_k_50_top_p_0.9", 0.8f, 50, 0.9f}};
constexpr int kCallsPerGraph = 10;

// A device copy of a host vector, freed with the object.
struct DeviceCopy {
  DeviceCopy(const void* data, size_t bytes, const Stream& s)
      : ptr(cuda_rt::device_malloc(bytes, 0)) {
    cuda_rt::memcpy_async(ptr, data, bytes, cuda_rt::CopyKind::kHostToDevice, s.handle());
  }
  ~DeviceCopy() { cuda_rt::device_free(ptr, 0); }
  DeviceCopy(const DeviceCopy&) = delete;
  DeviceCopy& operator=(const DeviceCopy&) = delete;
  void* ptr;
};

int run(const std::vector<std::string>& args) {
  Options o;
  if (!parse(args, o)) return 0;
  LORAPLEX_CHECK(cuda_device_count() > 0, "bench sampling needs a CUDA device");
  const Stream stream = Stream::create(Device::cuda(0));
  const int64_t max_rows = *std::max_element(o.rows.begin(), o.rows.end());
  const size_t logit_bytes = static_cast<size_t>(max_rows * o.vocab) * dtype_size(o.dtype);
  void* logits = cuda_rt::device_malloc(logit_bytes, 0);
  kc::fill_random(logits, o.dtype, max_rows * o.vocab, 7, 10.0f, stream.handle());
  const double copy_gbs = kc::copy_bandwidth_gbs(logit_bytes, 10, stream.handle());
  void* out = cuda_rt::device_malloc(static_cast<size_t>(max_rows) * 8, 0);
  const kc::DeviceInfo info = kc::device_info(0);
  std::printf("%s, vocab %lld, %s, copy bandwidth %.0f GB/s%s\n", info.name.c_str(),
              static_cast<long long>(o.vocab), std::string(dtype_name(o.dtype)).c_str(), copy_gbs,
              o.logprobs ? ", with logprobs" : "");
  std::printf("%6s  %-20s %10s %10s\n", "rows", "params", "us", "read_us");
  json results = json::array();
  for (int64_t rows : o.rows) {
    const double read_us =
        static_cast<double>(rows * o.vocab) * dtype_size(o.dtype) / (copy_gbs * 1e9) * 1e6;
    for (int set = 0; set <= static_cast<int>(std::size(kSets)); ++set) {
      const bool mixed = set == static_cast<int>(std::size(kSets));
      std::vector<float> temperature, top_p;
      std::vector<int32_t> top_k;
      std::vector<double> uniform;
      std::vector<int32_t> banned(static_cast<size_t>(rows * model::kMaxBannedTokens), -1);
      for (int64_t r = 0; r < rows; ++r) {
        const ParamSet& p = kSets[mixed ? r % std::size(kSets) : set];
        temperature.push_back(p.temperature);
        top_k.push_back(p.top_k);
        top_p.push_back(p.top_p);
        uniform.push_back(static_cast<double>((r * 7919) % 1000) / 1000.0);
      }
      const DeviceCopy t(temperature.data(), temperature.size() * sizeof(float), stream);
      const DeviceCopy k(top_k.data(), top_k.size() * sizeof(int32_t), stream);
      const DeviceCopy p(top_p.data(), top_p.size() * sizeof(float), stream);
      const DeviceCopy u(uniform.data(), uniform.size() * sizeof(double), stream);
      const DeviceCopy b(banned.data(), banned.size() * sizeof(int32_t), stream);
      model::ops::SampleArgs a;
      a.dtype = o.dtype;
      a.num_rows = rows;
      a.vocab = o.vocab;
      a.logits = logits;
      a.row_stride = o.vocab;
      a.temperature = static_cast<const float*>(t.ptr);
      a.top_k = static_cast<const int32_t*>(k.ptr);
      a.top_p = static_cast<const float*>(p.ptr);
      a.uniform = static_cast<const double*>(u.ptr);
      a.banned = static_cast<const int32_t*>(b.ptr);
      a.ids = static_cast<int32_t*>(out);
      a.logprobs =
          o.logprobs ? reinterpret_cast<float*>(static_cast<char*>(out) + rows * 4) : nullptr;
      // Warm-up (and, the first time, time for the clocks to rise).
      const int warmup = results.empty() ? 300 : 3;
      for (int w = 0; w < warmup; ++w) throw_if_error(model::ops::cuda::sample(a, stream));
      kc::Graph graph;
      graph.begin_capture(stream.handle());
      for (int c = 0; c < kCallsPerGraph; ++c) throw_if_error(model::ops::cuda::sample(a, stream));
      graph.end_capture();
      graph.replay(stream.handle());
      kc::Timer timer;
      timer.start(stream.handle());
      for (int rep = 0; rep < o.replays; ++rep) graph.replay(stream.handle());
      timer.stop(stream.handle());
      const double us = timer.elapsed_ms() * 1e3 / (o.replays * kCallsPerGraph);
      const char* name = mixed ? "mixed" : kSets[set].name;
      std::printf("%6lld  %-20s %10.2f %10.2f\n", static_cast<long long>(rows), name, us, read_us);
      results.push_back({{"rows", rows}, {"params", name}, {"us", us}, {"read_us", read_us}});
    }
  }
  cuda_rt::device_free(out, 0);
  cuda_rt::device_free(logits, 0);
  if (!o.json_path.empty()) {
    json doc = {{"device", info.name},
                {"vocab", o.vocab},
                {"dtype", std::string(dtype_name(o.dtype))},
                {"logprobs", o.logprobs},
                {"copy_gbs", copy_gbs},
                {"results", results}};
    std::ofstream f(o.json_path);
    LORAPLEX_CHECK(f.good(), "cannot write ", o.json_path);
    f << doc.dump(1) << "\n";
  }
  return 0;
}

}  // namespace

extern const Command kBenchSamplingCommand = {"bench sampling",
                                              "time the GPU sampler (bench sampling --help)", run};

}  // namespace loraplex::cli
