// `loraplex bench kernels`: times the multi-LoRA ops through the entry points the layers use
// (PunicaWrapper::add_lora_linear, add_shrink, add_expand; LoraBatchMeta for the per-step
// metadata) on the shape grid of the vLLM anchor, three ways:
//   cold     a 512 MB read before each call, CUDA events around the call, median of --iters;
//   graph    20 calls captured in one CUDA graph and replayed, median time per call;
//   rotating the same, but the captured calls cycle through distinct adapter weight sets
//            (together >= 128 MB, more than the L2 holds), so the weights come from HBM.
// Bytes are counted honestly: x read once, A and B of every active adapter at its own rank
// once, y read and written, the fp32 intermediate written and read unless the layer ran as
// the per-token pair (its partial sums are not counted). Bandwidth is reported against the
// device-to-device copy bandwidth measured at start-up (bytes read + written).

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "cli_parse.h"
#include "command.h"
#include "loraplex/core/error.h"
#include "loraplex/kernels/cuda/device_timing.h"
#include "loraplex/kernels/cuda/kernel_trace.h"
#include "loraplex/kernels/cuda/lora_ops_cuda.h"
#include "loraplex/kernels/planner/lora_tuning.h"
#include "loraplex/punica/punica_wrapper.h"

namespace loraplex::cli {
namespace {

namespace kc = kernels::cuda;
namespace kp = kernels::planner;
using nlohmann::json;

const char* kHelp =
    "usage: loraplex bench kernels [--json FILE] [--iters N] [--quick] [--device cuda:N]\n"
    "                              [--commit HASH] [--no-path-comparison] [--no-metadata]\n"
    "                              [--only OP:RANK:ADAPTERS:TOKENS:SLICES] [--tune K=V,...]\n"
    "                              [--trace FILE]\n"
    "Times the LoRA ops (add_lora_linear, add_shrink, add_expand and the metadata build) on\n"
    "the grid hidden 4096 x rank {16, 64} x adapters {1, 8, 32} x tokens {1, 16, 64, 256,\n"
    "1024, 4096} x slices {1: 4096, 3: 4096/1024/1024}, bf16, tokens spread round-robin\n"
    "over the adapters. Three figures per op: cold (512 MB read before each call, median of\n"
    "--iters, default 100), graph (20 calls in one CUDA graph, replayed) and graph with\n"
    "rotating weights (calls cycling through >= 128 MB of distinct adapter weights).\n"
    "Reports microseconds, GB/s and percent of the device-to-device copy bandwidth measured\n"
    "at start-up. --quick runs a small subset. --commit records the source commit (default:\n"
    "$LORAPLEX_COMMIT). --only restricts the grid (each field a value or *, SLICES 1 or 3;\n"
    "OP linear, shrink or expand), e.g. for a profiler. --tune sets launch-shape knobs for a\n"
    "sweep (the fields of src/loraplex/kernels/planner/lora_tuning.h; an unknown key is an\n"
    "error that lists them; the rest keep their defaults). --trace writes, per shrink and\n"
    "expand case that ran the prefill shrink or a tensor-core expand, one cold call's per-CTA\n"
    "timeline (SM, global-timer ns at the points of kernel_trace.h) as JSON lines, and per\n"
    "linear case on the decode pair or the cluster layer four consecutive calls of a graph\n"
    "replay with rotating weights.\n"
    "Needs a CUDA device; --help does not.\n";

struct Options {
  std::string json_path;
  int iters = 100;
  bool quick = false;
  bool path_comparison = true;
  bool metadata = true;
  std::vector<std::string> only;  // op, rank, adapters, tokens, slices; "*" matches anything
  Device device = Device::cuda(0);
  std::string commit;
  kp::LoraTuning tuning;
  std::string trace_path;
};

// Returns false when --help was printed.
bool parse(const std::vector<std::string>& args, Options& o) {
  o.commit = env_commit();
  CLI::App app{kHelp, "loraplex bench kernels"};
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--json", o.json_path, "write the results as JSON")->type_name("FILE");
  add_int(app, "--iters", o.iters, 1, "cold calls per case (median)");
  app.add_flag("--quick", o.quick, "a small subset of the grid");
  app.add_option_function<std::string>(
         "--device",
         [&](const std::string& v) {
           o.device = Device::parse(v);
           LORAPLEX_CHECK(o.device.is_cuda(), "--device must be a CUDA device, got ", o.device);
         },
         "cuda:N")
      ->type_name("DEVICE");
  app.add_option("--commit", o.commit, "source commit to record")->type_name("HASH");
  app.add_flag("!--no-path-comparison", o.path_comparison, "skip the decode paths side by side");
  app.add_flag("!--no-metadata", o.metadata, "skip the metadata build");
  app.add_option_function<std::string>(
         "--only",
         [&](const std::string& v) {
           o.only.clear();
           size_t start = 0;
           while (true) {
             const size_t colon = v.find(':', start);
             o.only.push_back(v.substr(start, colon == std::string::npos ? colon : colon - start));
             if (colon == std::string::npos) break;
             start = colon + 1;
           }
           LORAPLEX_CHECK(o.only.size() == 5,
                          "--only expects OP:RANK:ADAPTERS:TOKENS:SLICES, got '", v, "'");
         },
         "restrict the grid")
      ->type_name("OP:RANK:ADAPTERS:TOKENS:SLICES");
  app.add_option_function<std::string>(
         "--tune",
         [&](const std::string& v) { throw_if_error(kp::parse_lora_tuning(v, o.tuning)); },
         "tuning values over the defaults")
      ->type_name("K=V,...");
  app.add_option("--trace", o.trace_path, "per-CTA timelines as JSON lines")->type_name("FILE");
  return parse_cli(app, args);
}

constexpr int64_t kHidden = 4096;
constexpr size_t kFlushBytes = size_t{512} << 20;
constexpr int64_t kRotateBytes = int64_t{128} << 20;
constexpr int kGraphCalls = 20;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Timings {
  double cold_us = 0;
  double graph_us = 0;
  double rotating_us = 0;
};

class Bench {
 public:
  Bench(const Options& o, const Stream& stream) : o_(o), stream_(stream) {
    flush_ = Tensor::empty({static_cast<int64_t>(kFlushBytes)}, DType::kU8, o.device);
    kc::fill_random(flush_.data_ptr(), DType::kF32, static_cast<int64_t>(kFlushBytes / 4), 99, 1.0f,
                    stream.handle());
    sink_ = Tensor::empty({1}, DType::kF32, o.device);
  }

  void flush() {
    kc::read_buffer(flush_.data_ptr(), kFlushBytes, sink_.data<float>(), stream_.handle());
  }

  // One cold call of fn with the per-CTA timelines on (kernel_trace.h): the rows
  // of the CTAs that wrote anything.
  json trace(const std::function<void(int)>& fn) {
    constexpr int64_t kMaxCtas = 16384;
    Tensor buf = Tensor::zeros({kMaxCtas * kc::kTraceSlots}, DType::kI64, o_.device, stream_);
    kc::set_kernel_trace(reinterpret_cast<uint64_t*>(buf.data_ptr()));
    flush();
    fn(0);
    kc::set_kernel_trace(nullptr);
    const Tensor host = buf.to(Device::cpu(), stream_);
    stream_.synchronize();
    return written_rows(static_cast<const int64_t*>(host.data_ptr()), kMaxCtas);
  }

  // The per-CTA timelines (kernel_trace.h) of four consecutive calls from the middle of a graph
  // replay with rotating weights, as in the graph-rotating figure: each captured call writes
  // its own part of the buffer. For the decode pair, whose shrink waits for the kernel before it
  // (PDL): where one call's time goes and how calls overlap. [call][CTA row].
  json trace_graph(const std::function<void(int)>& fn, int sets) {
    constexpr int64_t kRowsPerCall = 4096;
    const int calls = std::max(kGraphCalls, sets);
    const int64_t per_call = kRowsPerCall * kc::kTraceSlots;
    Tensor buf = Tensor::zeros({calls * per_call}, DType::kI64, o_.device, stream_);
    auto* base = reinterpret_cast<uint64_t*>(buf.data_ptr());
    kc::set_kernel_trace(base);  // a first traced launch outside the capture
    fn(0);
    stream_.synchronize();
    kc::Graph graph;
    graph.begin_capture(stream_.handle());
    for (int i = 0; i < calls; ++i) {
      kc::set_kernel_trace(base + i * per_call);
      fn(i % sets);
    }
    kc::set_kernel_trace(nullptr);
    graph.end_capture();
    for (int r = 0; r < 3; ++r) graph.replay(stream_.handle());
    const Tensor host = buf.to(Device::cpu(), stream_);
    stream_.synchronize();
    const auto* v = static_cast<const int64_t*>(host.data_ptr());
    json out = json::array();
    for (int i = calls / 2; i < calls / 2 + 4; ++i) {
      out.push_back(written_rows(v + i * per_call, kRowsPerCall));
    }
    return out;
  }

  // fn(set) issues one call using weight set `set`.
  Timings time(const std::function<void(int)>& fn, int sets, bool cold, bool rotate) {
    Timings t;
    for (int i = 0; i < 3; ++i) fn(0);
    stream_.synchronize();
    kc::Timer timer;
    if (cold) {
      std::vector<double> us;
      for (int i = 0; i < o_.iters; ++i) {
        flush();
        timer.start(stream_.handle());
        fn(0);
        timer.stop(stream_.handle());
        us.push_back(timer.elapsed_ms() * 1e3);
      }
      t.cold_us = median(us);
    }
    t.graph_us = graph_time(fn, kGraphCalls, 1, timer);
    if (rotate) t.rotating_us = graph_time(fn, std::max(kGraphCalls, sets), sets, timer);
    return t;
  }

 private:
  double graph_time(const std::function<void(int)>& fn, int calls, int sets, kc::Timer& timer) {
    kc::Graph graph;
    graph.begin_capture(stream_.handle());
    for (int i = 0; i < calls; ++i) fn(i % sets);
    graph.end_capture();
    graph.replay(stream_.handle());
    stream_.synchronize();
    std::vector<double> us;
    const int reps = calls > 100 ? 5 : 10;
    for (int r = 0; r < reps; ++r) {
      timer.start(stream_.handle());
      graph.replay(stream_.handle());
      timer.stop(stream_.handle());
      us.push_back(timer.elapsed_ms() * 1e3 / calls);
    }
    return median(us);
  }

  // The rows of a trace buffer that a CTA wrote (any timestamp set; slot 0, the SM, may be 0).
  static json written_rows(const int64_t* v, int64_t rows) {
    json out = json::array();
    for (int64_t b = 0; b < rows; ++b) {
      const int64_t* r = v + b * kc::kTraceSlots;
      if (std::all_of(r + 1, r + kc::kTraceSlots, [](int64_t x) { return x == 0; })) continue;
      out.push_back(json(std::vector<int64_t>(r, r + kc::kTraceSlots)));
    }
    return out;
  }

  const Options& o_;
  const Stream& stream_;
  Tensor flush_;
  Tensor sink_;
};

struct Case {
  int rank;
  int adapters;
  int tokens;
  int slices;  // 1 (4096) or 3 (4096/1024/1024)
};

std::vector<int64_t> widths_of(int slices) {
  return slices == 1 ? std::vector<int64_t>{4096} : std::vector<int64_t>{4096, 1024, 1024};
}

// All tensors of one case: activations, a pool of weight sets, the wrapper with its metadata.
struct CaseData {
  CaseData(const Case& c, Device device, const Stream& stream, const kp::LoraTuning& tuning)
      : wrapper(c.adapters, c.tokens, 1, device), ranks(c.slices, c.adapters, c.rank, device) {
    wrapper.set_lora_tuning(tuning);
    widths = widths_of(c.slices);
    for (int64_t n : widths) width += n;
    std::vector<int32_t> slots(static_cast<size_t>(c.tokens));
    for (int t = 0; t < c.tokens; ++t) slots[static_cast<size_t>(t)] = t % c.adapters;
    wrapper.update_metadata(slots, {}, stream);
    for (int k = 0; k < c.adapters; ++k) ranks.set_slot(k, c.rank, stream);
    x = Tensor::empty({c.tokens, kHidden}, DType::kBF16, device);
    y = Tensor::empty({c.tokens, width}, DType::kBF16, device);
    kc::fill_random(x.data_ptr(), DType::kBF16, x.numel(), 1, 1.0f, stream.handle());
    kc::fill_random(y.data_ptr(), DType::kBF16, y.numel(), 2, 1.0f, stream.handle());
    mid = Tensor::empty({c.slices, c.tokens, c.rank}, DType::kF32, device);
    kc::fill_random(mid.data_ptr(), DType::kF32, mid.numel(), 3, 0.25f, stream.handle());
    ws = Tensor::empty({PunicaWrapper::workspace_elements(c.slices, c.tokens, c.rank)}, DType::kF32,
                       device);
    const int64_t a_elems = int64_t{c.adapters} * c.rank * kHidden;
    int64_t set_elems = a_elems * c.slices;
    for (int64_t n : widths) set_elems += int64_t{c.adapters} * n * c.rank;
    const int64_t set_bytes = set_elems * 2;
    sets = static_cast<int>(std::max<int64_t>(2, (kRotateBytes + set_bytes - 1) / set_bytes));
    pool = Tensor::empty({set_elems * sets}, DType::kBF16, device);
    // Small values keep y bounded over thousands of accumulating calls; never zero.
    kc::fill_random(pool.data_ptr(), DType::kBF16, pool.numel(), 4, 1.0f / 64, stream.handle());
    a.resize(static_cast<size_t>(sets));
    b.resize(static_cast<size_t>(sets));
    for (int s = 0; s < sets; ++s) {
      int64_t off = s * set_elems;
      for (int i = 0; i < c.slices; ++i) {
        a[s].push_back(pool.narrow(0, off, a_elems).view({c.adapters, c.rank, kHidden}));
        off += a_elems;
      }
      for (int64_t n : widths) {
        const int64_t b_elems = int64_t{c.adapters} * n * c.rank;
        b[s].push_back(pool.narrow(0, off, b_elems).view({c.adapters, n, c.rank}));
        off += b_elems;
      }
    }
    wrapper.reserve_lora_linear(y, x, a[0], b[0], ranks, ws);
    stream.synchronize();
  }

  PunicaWrapper wrapper;
  SlotRanks ranks;
  std::vector<int64_t> widths;
  int64_t width = 0;
  Tensor x, y, mid, ws, pool;
  int sets = 0;
  std::vector<std::vector<Tensor>> a, b;
};

struct Bytes {
  double x = 0, a = 0, b = 0, y = 0, mid = 0;
};

Bytes count_bytes(const Case& c) {
  Bytes by;
  const double active = std::min(c.tokens, c.adapters);
  double total_n = 0;
  for (int64_t n : widths_of(c.slices)) total_n += static_cast<double>(n);
  by.x = double(c.tokens) * kHidden * 2;
  by.a = active * c.slices * c.rank * kHidden * 2;
  by.b = active * total_n * c.rank * 2;
  by.y = double(c.tokens) * total_n * 2 * 2;
  by.mid = double(c.slices) * c.tokens * c.rank * 4;
  return by;
}

json entry(const char* op, const Case& c, const std::string& path, double bytes, const Timings& t,
           double copy_gbs) {
  auto gbs = [&](double us) { return us > 0 ? bytes / (us * 1e-6) / 1e9 : 0.0; };
  json j;
  j["op"] = op;
  j["hidden"] = kHidden;
  j["rank"] = c.rank;
  j["adapters"] = c.adapters;
  j["tokens"] = c.tokens;
  j["slices"] = c.slices == 1 ? "4096" : "4096/1024/1024";
  j["path"] = path;
  j["bytes"] = bytes;
  j["roofline_us"] = bytes / (copy_gbs * 1e9) * 1e6;
  j["cold_us"] = t.cold_us;
  j["graph_us"] = t.graph_us;
  j["graph_rotating_us"] = t.rotating_us;
  j["cold_gbs"] = gbs(t.cold_us);
  j["graph_gbs"] = gbs(t.graph_us);
  j["graph_rotating_gbs"] = gbs(t.rotating_us);
  j["cold_pct_copy_bw"] = 100.0 * gbs(t.cold_us) / copy_gbs;
  j["graph_pct_copy_bw"] = 100.0 * gbs(t.graph_us) / copy_gbs;
  j["graph_rotating_pct_copy_bw"] = 100.0 * gbs(t.rotating_us) / copy_gbs;
  return j;
}

std::string path_of(CaseData& d) {
  return d.wrapper.lora_linear_path(d.y, d.x, d.a[0], d.b[0], d.ranks, d.ws);
}

int run_kernels(const Options& o) {
  LORAPLEX_CHECK(cuda_device_count() > o.device.index, "bench kernels needs a CUDA device (",
                 o.device, "); this machine has ", cuda_device_count());
  cuda_rt::set_device(o.device.index);
  const Stream stream = Stream::create(o.device);
  const kc::DeviceInfo info = kc::device_info(o.device.index);
  const double copy_gbs = kc::copy_bandwidth_gbs(size_t{1} << 30, 10, stream.handle());
  const double clock_start = kc::measured_sm_clock_mhz(stream.handle());
  std::printf(
      "device %s, %d SMs, L2 %.0f MB; copy bandwidth %.0f GB/s (read + write); SM clock %.0f "
      "MHz\n",
      info.name.c_str(), info.sm_count, info.l2_bytes / 1e6, copy_gbs, clock_start);
  Bench bench(o, stream);
  json results = json::array();

  std::vector<Case> cases;
  const std::vector<int> ranks = {16, 64};
  const std::vector<int> adapters = o.quick ? std::vector<int>{8} : std::vector<int>{1, 8, 32};
  const std::vector<int> tokens =
      o.quick ? std::vector<int>{16, 4096} : std::vector<int>{1, 16, 64, 256, 1024, 4096};
  auto match = [&](size_t field, const std::string& value) {
    return o.only.empty() || o.only[field] == "*" || o.only[field] == value;
  };
  for (int r : ranks)
    for (int a : adapters)
      for (int t : tokens)
        for (int s : {1, 3}) {
          if (match(1, std::to_string(r)) && match(2, std::to_string(a)) &&
              match(3, std::to_string(t)) && match(4, std::to_string(s))) {
            cases.push_back({r, a, t, s});
          }
        }

  std::printf("%-7s %4s %4s %5s %-15s %-7s %9s %9s %9s %9s %6s\n", "op", "rank", "lora", "tok",
              "slices", "path", "cold_us", "graph_us", "rot_us", "roof_us", "%bw");
  std::ofstream trace_out;
  if (!o.trace_path.empty()) {
    trace_out.open(o.trace_path);
    LORAPLEX_CHECK(trace_out.good(), "cannot write ", o.trace_path);
  }
  for (const Case& c : cases) {
    CaseData d(c, o.device, stream, o.tuning);
    const Bytes by = count_bytes(c);
    const std::string path = path_of(d);
    struct Op {
      const char* name;
      double bytes;
      std::function<void(int)> fn;
    };
    const double linear_bytes = by.x + by.a + by.b + by.y + (path == "gather" ? 0.0 : 2 * by.mid);
    std::vector<Op> ops = {
        {"linear", linear_bytes,
         [&](int s) {
           d.wrapper.add_lora_linear(d.y, d.x, d.a[s], d.b[s], d.ranks, 1.0f, d.ws, stream);
         }},
        {"shrink", by.x + by.a + by.mid,
         [&](int s) { d.wrapper.add_shrink(d.mid, d.x, d.a[s], d.ranks, 1.0f, stream); }},
        {"expand", by.mid + by.b + by.y,
         [&](int s) { d.wrapper.add_expand(d.y, d.mid, d.b[s], d.ranks, 0, true, stream); }},
    };
    for (const Op& op : ops) {
      if (!match(0, op.name)) continue;
      const Timings t = bench.time(op.fn, d.sets, true, true);
      const std::string op_path = std::string(op.name) == "linear" ? path : "-";
      json j = entry(op.name, c, op_path, op.bytes, t, copy_gbs);
      j["weight_sets"] = d.sets;
      results.push_back(j);
      if (trace_out.is_open() && std::string(op.name) == "linear" &&
          (path == "gather" || path == "cluster")) {
        trace_out << json{{"op", op.name},
                          {"rank", c.rank},
                          {"adapters", c.adapters},
                          {"tokens", c.tokens},
                          {"slices", c.slices},
                          {"path", path},
                          {"rotating_us", t.rotating_us},
                          {"calls", bench.trace_graph(op.fn, d.sets)}}
                         .dump()
                  << "\n";
      }
      if (trace_out.is_open() && std::string(op.name) != "linear") {
        trace_out << json{{"op", op.name},      {"rank", c.rank},     {"adapters", c.adapters},
                          {"tokens", c.tokens}, {"slices", c.slices}, {"ctas", bench.trace(op.fn)}}
                         .dump()
                  << "\n";
      }
      std::printf("%-7s %4d %4d %5d %-15s %-7s %9.2f %9.2f %9.2f %9.2f %6.1f\n", op.name, c.rank,
                  c.adapters, c.tokens, c.slices == 1 ? "4096" : "4096/1024/1024", op_path.c_str(),
                  t.cold_us, t.graph_us, t.rotating_us, j["roofline_us"].get<double>(),
                  j["graph_rotating_pct_copy_bw"].get<double>());
      std::fflush(stdout);
    }
  }

  // The layer paths side by side at decode sizes.
  json comparison = json::array();
  if (o.path_comparison) {
    for (const Case& c : cases) {
      if (c.tokens > 256) continue;
      CaseData d(c, o.device, stream, o.tuning);
      const Bytes by = count_bytes(c);
      json row;
      row["rank"] = c.rank;
      row["adapters"] = c.adapters;
      row["tokens"] = c.tokens;
      row["slices"] = c.slices;
      // split (shrink + expand kernels), the per-token pair, the one-kernel cluster layer, each
      // as far as it goes: {decode tokens, pair's token x rank limit, cluster}.
      const int configs[][3] = {{0, 1 << 30, 0}, {1 << 20, 1 << 30, 0}, {1 << 20, 1 << 30, 2}};
      for (const auto& [limit, pair_limit, cluster] : configs) {
        kp::LoraTuning tuning = o.tuning;
        tuning.decode_max_tokens = limit;
        tuning.gather_max_token_ranks = pair_limit;
        tuning.decode_cluster = cluster;
        d.wrapper.set_lora_tuning(tuning);
        d.wrapper.reserve_lora_linear(d.y, d.x, d.a[0], d.b[0], d.ranks, d.ws);
        const std::string path = path_of(d);
        const Timings t = bench.time(
            [&](int s) {
              d.wrapper.add_lora_linear(d.y, d.x, d.a[s], d.b[s], d.ranks, 1.0f, d.ws, stream);
            },
            d.sets, false, true);
        row[path + "_graph_us"] = t.graph_us;
        row[path + "_graph_rotating_us"] = t.rotating_us;
      }
      row["roofline_us"] = (by.x + by.a + by.b + by.y) / (copy_gbs * 1e9) * 1e6;
      comparison.push_back(row);
    }
  }

  // The per-step metadata build: 4096 tokens over 32 adapters, in a graph.
  json meta_json;
  if (o.metadata) {
    LoraBatchMeta meta(32, 4096, o.device);
    std::vector<int32_t> slots(4096);
    for (int t = 0; t < 4096; ++t) slots[static_cast<size_t>(t)] = t % 32;
    meta.prepare(slots, stream);
    const Timings t =
        bench.time([&](int) { meta.prepare_from_buffer(4096, false, stream); }, 1, true, false);
    meta_json["tokens"] = 4096;
    meta_json["adapters"] = 32;
    meta_json["cold_us"] = t.cold_us;
    meta_json["graph_us"] = t.graph_us;
    std::printf("metadata build, 4096 tokens, 32 adapters: cold %.2f us, graph %.2f us\n",
                t.cold_us, t.graph_us);
  }

  if (!o.json_path.empty()) {
    json doc;
    doc["device"] = info.name;
    doc["sm_count"] = info.sm_count;
    doc["l2_bytes"] = info.l2_bytes;
    doc["compute_capability"] = std::to_string(info.cc_major) + "." + std::to_string(info.cc_minor);
    doc["commit"] = o.commit;
    doc["date"] = iso_date();
    doc["copy_bandwidth_gbs"] = copy_gbs;
    doc["sm_clock_mhz_start"] = clock_start;
    doc["sm_clock_mhz_end"] = kc::measured_sm_clock_mhz(stream.handle());
    for (const auto& [name, value] : kp::lora_tuning_values(o.tuning)) {
      doc["tuning"][name] = value;
    }
    doc["dtype"] = "bfloat16";
    doc["method"] = {
        {"cold", "512 MB read before each call, CUDA events, median of " + std::to_string(o.iters)},
        {"graph", "20 calls in one CUDA graph, replayed; median per call"},
        {"graph_rotating",
         "calls cycling through >= 128 MB of distinct weight sets in one graph; median per call"}};
    doc["results"] = results;
    doc["path_comparison"] = comparison;
    doc["metadata_build"] = meta_json;
    std::ofstream out(o.json_path);
    LORAPLEX_CHECK(out.good(), "cannot write ", o.json_path);
    out << doc.dump(1) << "\n";
    std::printf("wrote %s\n", o.json_path.c_str());
  }
  return 0;
}

int run(const std::vector<std::string>& args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    std::fputs(kHelp, args.empty() ? stderr : stdout);
    return args.empty() ? 2 : 0;
  }
  LORAPLEX_CHECK(args[0] == "kernels", "unknown benchmark '", args[0],
                 "'; available: kernels, adapter-load (see `loraplex bench kernels --help`, "
                 "`loraplex bench adapter-load --help`)");
  Options o;
  if (!parse(std::vector<std::string>(args.begin() + 1, args.end()), o)) return 0;
  return run_kernels(o);
}

}  // namespace

extern const Command kBenchCommand = {"bench", "time the LoRA kernels (bench kernels --help)", run};

}  // namespace loraplex::cli
