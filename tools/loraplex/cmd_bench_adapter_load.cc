// `loraplex bench adapter-load`: what loading adapters costs the forward passes of the adapters
// already being served. A synthetic model-shaped stack of LoRA layers (per decoder layer a
// merged QKV layer, o_proj, a merged gate_up layer and down_proj) runs forward steps of a mixed
// batch over 4 leased adapters on one compute stream:
//   phase A  nothing else happens;
//   phase B  a background thread keeps loading other adapters from disk (load, acquire into a
//            free slot, wait for its upload, release, unload, repeat) through the same
//            AdapterManager, as an engine does while it serves.
// Each step is timed with CUDA events around the enqueued work (GPU time) and with the host
// clock from taking the layer lock to the step's completion (what the serving loop sees,
// including waits for the lock that slot writes hold). The adapters are generated PEFT
// directories (adapter_config.json + adapter_model.safetensors, random weights) in a temporary
// directory; they are read back from the page cache, so "load" is parsing and packing, not disk.

#include <stdlib.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "cli_parse.h"
#include "command.h"
#include "loraplex/adapters/adapter_manager.h"
#include "loraplex/adapters/safetensors.h"
#include "loraplex/core/error.h"
#include "loraplex/core/parallel.h"
#include "loraplex/kernels/cuda/device_timing.h"
#include "loraplex/layers/lora_linear.h"
#include "loraplex/layers/workspace.h"

namespace loraplex::cli {
namespace {

namespace kc = kernels::cuda;
namespace fs = std::filesystem;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

const char* kHelp =
    "usage: loraplex bench adapter-load [--device cuda:N|cpu] [--json FILE] [--steps S]\n"
    "           [--warmup W] [--layers L] [--hidden H] [--kv-hidden K] [--intermediate I]\n"
    "           [--tokens T] [--adapters N] [--rank R] [--max-loras M] [--max-lora-rank R]\n"
    "           [--dtype bfloat16|float16|float32] [--upload async|sync] [--min-loads N]\n"
    "           [--seed S] [--commit HASH]\n"
    "Builds a synthetic stack of L decoder layers of LoRA layers (QKV H/K/K, o_proj H x H,\n"
    "gate_up 2 x I, down_proj I -> H) on the device, writes N generated PEFT adapters of rank R\n"
    "(every projection targeted, random weights) to a temporary directory and serves them\n"
    "through an AdapterManager (max_loras M, max_lora_rank R). Phase A: S forward steps of T\n"
    "tokens mixed over 4 leased adapters. Phase B: the same steps while a background thread\n"
    "loads the other N - 4 adapters in turn (load, acquire into a free slot, wait for the\n"
    "upload, release, unload); it runs on past S steps until N >= --min-loads (default 1)\n"
    "adapters were loaded. Reports the median and p90 step time (CUDA events; host clock on\n"
    "the CPU) of both phases and the adapters loaded during phase B. --upload sync writes\n"
    "slots through the layers' synchronous set_lora instead (the host waits for each upload\n"
    "while holding the layer lock), for comparison.\n"
    "Defaults: cuda:0, L 8, H 4096, K 1024, I 11008, T 64, N 12, R 16, M 8, bfloat16, S 500,\n"
    "W 20; with --device cpu: L 2, H 256, K 64, I 512, T 16, N 6, S 20, W 2.\n"
    "--commit records the source commit (default: $LORAPLEX_COMMIT).\n";

struct Options {
  Device device = Device::cuda(0);
  std::string json_path;
  int steps = -1;  // -1: the device's default
  int warmup = -1;
  int layers = -1;
  int64_t hidden = -1;
  int64_t kv_hidden = -1;
  int64_t intermediate = -1;
  int tokens = -1;
  int adapters = -1;
  int rank = 16;
  int max_loras = 8;
  int max_lora_rank = 16;
  DType dtype = DType::kBF16;
  bool async_upload = true;
  int min_loads = 1;
  uint64_t seed = 1;
  std::string commit;
};

constexpr int kServed = 4;  // adapters leased in both phases

// Returns false when --help was printed.
bool parse(const std::vector<std::string>& args, Options& o) {
  o.commit = env_commit();
  CLI::App app{kHelp, "loraplex bench adapter-load"};
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option_function<std::string>(
         "--device", [&](const std::string& v) { o.device = Device::parse(v); }, "cuda:N or cpu")
      ->type_name("DEVICE");
  app.add_option("--json", o.json_path, "write the results as JSON")->type_name("FILE");
  add_int(app, "--steps", o.steps, 1, "forward steps per phase");
  add_int(app, "--warmup", o.warmup, 0, "steps before timing");
  add_int(app, "--layers", o.layers, 1, "decoder layers");
  add_int(app, "--hidden", o.hidden, 1, "hidden size");
  add_int(app, "--kv-hidden", o.kv_hidden, 1, "k and v width");
  add_int(app, "--intermediate", o.intermediate, 1, "MLP width");
  add_int(app, "--tokens", o.tokens, 1, "tokens per step");
  add_int(app, "--adapters", o.adapters, kServed + 1, "generated adapters");
  add_int(app, "--rank", o.rank, 1, "their rank");
  add_int(app, "--max-loras", o.max_loras, kServed + 1, "GPU slots");
  add_int(app, "--max-lora-rank", o.max_lora_rank, 1, "the slots' rank");
  app.add_option_function<std::string>(
         "--dtype", [&](const std::string& v) { o.dtype = dtype_from_name(v); },
         "bfloat16, float16 or float32")
      ->type_name("DTYPE");
  app.add_option_function<std::string>(
         "--upload",
         [&](const std::string& value) {
           LORAPLEX_CHECK(value == "async" || value == "sync",
                          "--upload expects async or sync, got '", value, "'");
           o.async_upload = value == "async";
         },
         "async (the copy stream) or sync (set_lora)")
      ->type_name("MODE");
  add_int(app, "--min-loads", o.min_loads, 0, "adapters phase B loads at least");
  add_int(app, "--seed", o.seed, 0, "random weights");
  app.add_option("--commit", o.commit, "source commit to record")->type_name("HASH");
  if (!parse_cli(app, args)) return false;
  const bool cpu = o.device.is_cpu();
  auto fill = [&](auto& field, auto gpu_default, auto cpu_default) {
    if (field < 0) field = cpu ? cpu_default : gpu_default;
  };
  fill(o.steps, 500, 20);
  fill(o.warmup, 20, 2);
  fill(o.layers, 8, 2);
  fill(o.hidden, int64_t{4096}, int64_t{256});
  fill(o.kv_hidden, int64_t{1024}, int64_t{64});
  fill(o.intermediate, int64_t{11008}, int64_t{512});
  fill(o.tokens, 64, 16);
  fill(o.adapters, 12, 6);
  LORAPLEX_CHECK(o.dtype == DType::kBF16 || o.dtype == DType::kF16 || o.dtype == DType::kF32,
                 "--dtype must be bfloat16, float16 or float32, got ", o.dtype);
  LORAPLEX_CHECK(o.rank <= o.max_lora_rank, "--rank ", o.rank, " exceeds --max-lora-rank ",
                 o.max_lora_rank);
  LORAPLEX_CHECK(o.tokens >= kServed, "--tokens must be >= ", kServed,
                 " (every served adapter gets tokens), got ", o.tokens);
  return true;
}

// Counter-based uniform values in +-[scale/8, scale] (never zero), as the tests' random data.
float hashed_value(uint64_t seed, uint64_t i, float scale) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + i + 1;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  const float u = static_cast<float>(z >> 40) / static_cast<float>(1ull << 24);  // [0, 1)
  const float mag = scale * (0.125f + 0.875f * u);
  return (z & 1) != 0 ? mag : -mag;
}

Tensor random_host(const Shape& shape, DType dtype, uint64_t seed, float scale) {
  Tensor t = Tensor::empty(shape, dtype);
  dispatch_activation_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* p = t.data<T>();
    parallel_for(0, t.numel(), 1 << 16, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i)
        p[i] = store_float<T>(hashed_value(seed, static_cast<uint64_t>(i), scale));
    });
  });
  return t;
}

struct Stats {
  double median = 0, p90 = 0, mean = 0, min = 0, max = 0;
  size_t count = 0;
};

Stats stats_of(std::vector<double> v) {
  Stats s;
  s.count = v.size();
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  s.median = v.size() % 2 == 1 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
  s.p90 = v[static_cast<size_t>(std::ceil(0.9 * static_cast<double>(v.size()))) - 1];
  double sum = 0;
  for (double x : v) sum += x;
  s.mean = sum / static_cast<double>(v.size());
  s.min = v.front();
  s.max = v.back();
  return s;
}

json to_json(const Stats& s) {
  return {{"median", s.median}, {"p90", s.p90}, {"mean", s.mean},
          {"min", s.min},       {"max", s.max}, {"count", s.count}};
}

// The projections of one decoder layer an adapter targets: PEFT module suffix, the LoRA layer
// kind (0 qkv, 1 o, 2 gate_up, 3 down), the slice within it, in and out features.
struct Projection {
  const char* module;
  int layer;
  int slice;
  int64_t in;
  int64_t out;
};

std::vector<Projection> projections(const Options& o) {
  const int64_t h = o.hidden, k = o.kv_hidden, i = o.intermediate;
  return {{"self_attn.q_proj", 0, 0, h, h}, {"self_attn.k_proj", 0, 1, h, k},
          {"self_attn.v_proj", 0, 2, h, k}, {"self_attn.o_proj", 1, 0, h, h},
          {"mlp.gate_proj", 2, 0, h, i},    {"mlp.up_proj", 2, 1, h, i},
          {"mlp.down_proj", 3, 0, i, h}};
}

// The synthetic model: L decoder layers of four LoRA layers sharing one workspace, with fixed
// inputs (the steps time the layers, not a model's data flow).
class Stack {
 public:
  Stack(const Options& o, const Stream& stream) {
    const LoraConfig cfg{o.max_loras, o.max_lora_rank, o.dtype, false};
    workspace_ = std::make_shared<LayerWorkspace>(o.device);
    const int64_t h = o.hidden, k = o.kv_hidden, i = o.intermediate;
    const int64_t head = h % 128 == 0 && k % 128 == 0 ? 128 : 16;
    LORAPLEX_CHECK(h % head == 0 && k % head == 0, "--hidden ", h, " and --kv-hidden ", k,
                   " must be multiples of 16 (attention heads)");
    const LinearSpec specs[4] = {
        LinearSpec::qkv(h, head, h / head, k / head, o.dtype), LinearSpec::row(h, h, o.dtype),
        LinearSpec::merged_column(h, {i, i}, o.dtype), LinearSpec::row(i, h, o.dtype)};
    // One pool of random values backs every base weight (identical layers time the same).
    const int64_t pool_elems = std::max({2 * i * h, h * h + 2 * k * h, i * h});
    const Tensor pool = random_host({pool_elems}, o.dtype, o.seed, 0.02f);
    auto weight = [&](int64_t offset, int64_t rows, int64_t cols) {
      return pool.narrow(0, offset, rows * cols).view({rows, cols});
    };
    for (int l = 0; l < o.layers; ++l) {
      std::vector<std::unique_ptr<LoraLinear>> row;
      for (const LinearSpec& spec : specs) {
        row.push_back(
            std::make_unique<LoraLinear>(spec, cfg, nullptr, o.device, o.tokens, workspace_));
        std::vector<Tensor> base;
        int64_t off = 0;
        for (const OutputSlice& s : spec.outputs) {
          base.push_back(weight(off, s.size, spec.in_features));
          off += s.size * spec.in_features;
        }
        row.back()->load_base(base);
      }
      layers_.push_back(std::move(row));
    }
    workspace_->allocate();
    x_ = random_host({o.tokens, h}, o.dtype, o.seed + 1, 1.0f).to(o.device, stream);
    act_ = random_host({o.tokens, i}, o.dtype, o.seed + 2, 1.0f).to(o.device, stream);
    stream.synchronize();
  }

  LoraLinear& layer(int l, int kind) {
    return *layers_[static_cast<size_t>(l)][static_cast<size_t>(kind)];
  }
  int num_layers() const { return static_cast<int>(layers_.size()); }

  // One step: every layer's forward, base GEMM plus the Punica LoRA, on `stream`.
  void step(const PunicaWrapper& punica, const Stream& stream) {
    for (auto& row : layers_) {
      row[0]->forward(x_, punica, stream);
      row[1]->forward(x_, punica, stream);
      row[2]->forward(x_, punica, stream);
      row[3]->forward(act_, punica, stream);
    }
  }

  int64_t base_bytes() const {
    int64_t n = 0;
    for (const auto& row : layers_)
      for (const auto& layer : row) n += static_cast<int64_t>(layer->weight().nbytes());
    return n;
  }

 private:
  std::shared_ptr<LayerWorkspace> workspace_;
  std::vector<std::vector<std::unique_ptr<LoraLinear>>> layers_;
  Tensor x_;    // [tokens, hidden]: input of qkv, o_proj and gate_up
  Tensor act_;  // [tokens, intermediate]: input of down_proj
};

// Writes adapter `index` (every projection of every layer, rank o.rank, lora_alpha 2 r) as a
// PEFT directory; returns its size on disk.
int64_t write_adapter(const Options& o, const std::string& dir, int index) {
  fs::create_directories(dir);
  std::vector<std::pair<std::string, Tensor>> tensors;
  const std::vector<Projection> projs = projections(o);
  uint64_t seed = o.seed * 1000003 + static_cast<uint64_t>(index) * 7919;
  for (int l = 0; l < o.layers; ++l) {
    for (const Projection& p : projs) {
      const std::string prefix =
          "base_model.model.model.layers." + std::to_string(l) + "." + p.module;
      tensors.push_back(
          {prefix + ".lora_A.weight", random_host({o.rank, p.in}, o.dtype, ++seed, 0.05f)});
      tensors.push_back(
          {prefix + ".lora_B.weight", random_host({p.out, o.rank}, o.dtype, ++seed, 0.05f)});
    }
  }
  json config = {{"peft_type", "LORA"},
                 {"r", o.rank},
                 {"lora_alpha", 2 * o.rank},
                 {"lora_dropout", 0.0},
                 {"bias", "none"},
                 {"target_modules",
                  {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}},
                 {"base_model_name_or_path", "loraplex-bench/synthetic"}};
  std::ofstream(dir + "/adapter_config.json") << config.dump(2) << "\n";
  write_safetensors(dir + "/adapter_model.safetensors", tensors, {{"format", "pt"}});
  return static_cast<int64_t>(fs::file_size(dir + "/adapter_model.safetensors"));
}

// A temporary directory, removed with its contents.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "loraplex_bench_adapters_XXXXXX").string();
    LORAPLEX_CHECK(mkdtemp(tmpl.data()) != nullptr, "cannot create a temporary directory ", tmpl);
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string sub(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

struct PhaseResult {
  std::vector<double> gpu_ms;   // CUDA events around the step's work (empty on the CPU)
  std::vector<double> wall_ms;  // host clock: lock, enqueue (or compute), completion
};

// Background loading: what one cycle cost, and how many completed.
struct Loader {
  std::vector<double> load_ms;     // disk -> validated, packed (pinned on CUDA)
  std::vector<double> acquire_ms;  // into a free slot (enqueued uploads)
  std::vector<double> upload_ms;   // acquire -> the slot's upload has finished
  std::atomic<int> completed{0};
  std::atomic<bool> stop{false};
  std::exception_ptr error;
};

int run_bench(const Options& o) {
  const bool gpu = o.device.is_cuda();
  std::string device_name = "cpu";
  if (gpu) {
    LORAPLEX_CHECK(cuda_device_count() > o.device.index, "bench adapter-load on ", o.device,
                   " needs a CUDA device; this machine has ", cuda_device_count(),
                   " (use --device cpu for the CPU)");
    cuda_rt::set_device(o.device.index);
    device_name = kc::device_info(o.device.index).name;
  }
  const Stream compute = gpu ? Stream::create(o.device) : Stream();
  std::printf("device %s; %d layers, hidden %lld, kv %lld, intermediate %lld, %s, %d tokens\n",
              device_name.c_str(), o.layers, static_cast<long long>(o.hidden),
              static_cast<long long>(o.kv_hidden), static_cast<long long>(o.intermediate),
              std::string(dtype_name(o.dtype)).c_str(), o.tokens);
  std::fflush(stdout);

  Stack stack(o, compute);
  LoraTargetRegistry registry;
  const int slices_of[4] = {3, 1, 2, 1};
  const char* kinds[4] = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"};
  for (int l = 0; l < o.layers; ++l) {
    const std::string prefix = "model.layers." + std::to_string(l) + ".";
    LoraLayerHandle handles[4];
    for (int kind = 0; kind < 4; ++kind) {
      LoraLinear* layer = &stack.layer(l, kind);
      const std::string name = prefix + kinds[kind];
      if (o.async_upload) {
        handles[kind] = LoraLayerHandle::of(*layer, name, slices_of[kind]);
      } else {
        handles[kind] = LoraLayerHandle(
            name, slices_of[kind],
            [layer](int slot, const std::vector<LoraSliceWeights>& s, const Stream&) {
              layer->set_lora(slot, s);
            },
            [layer](int slot, const Stream&) { layer->reset_lora(slot); });
      }
    }
    for (const Projection& p : projections(o)) {
      LoraTarget t;
      t.module = prefix + p.module;
      t.layer = handles[p.layer];
      t.slice = p.slice;
      t.in_features = p.in;
      t.out_features = p.out;
      registry.add(t);
    }
  }

  TempDir tmp;
  std::vector<std::string> names;
  int64_t file_bytes = 0;
  const auto write_start = Clock::now();
  for (int a = 0; a < o.adapters; ++a) {
    names.push_back("adapter" + std::to_string(a));
    file_bytes = write_adapter(o, tmp.sub(names.back()), a);
  }
  std::printf("base weights %.1f MB; wrote %d adapters of %.1f MB each in %.1f s\n",
              static_cast<double>(stack.base_bytes()) / 1e6, o.adapters,
              static_cast<double>(file_bytes) / 1e6, ms_between(write_start, Clock::now()) / 1e3);

  AdapterManagerConfig mc;
  mc.max_loras = o.max_loras;
  mc.max_cpu_loras = o.max_loras;
  mc.max_lora_rank = o.max_lora_rank;
  mc.lora_dtype = o.dtype;
  mc.device = o.device;
  AdapterManager manager(registry, mc);

  std::vector<AdapterManager::Lease> leases;
  size_t packed_bytes = 0;
  for (int a = 0; a < kServed; ++a) {
    packed_bytes =
        manager.load(names[static_cast<size_t>(a)], tmp.sub(names[static_cast<size_t>(a)])).bytes;
    leases.push_back(manager.acquire(names[static_cast<size_t>(a)]));
    leases.back().wait_ready(compute);
  }
  std::vector<int32_t> token_slots(static_cast<size_t>(o.tokens));
  for (int t = 0; t < o.tokens; ++t) {
    token_slots[static_cast<size_t>(t)] = leases[static_cast<size_t>(t % kServed)].slot();
  }
  PunicaWrapper punica(o.max_loras, o.tokens, 1, o.device);
  punica.update_metadata(token_slots, {}, compute);

  std::unique_ptr<kc::Timer> timer = gpu ? std::make_unique<kc::Timer>() : nullptr;
  auto run_step = [&](PhaseResult* out) {
    const auto t0 = Clock::now();
    {
      auto lock = manager.lock_layers();
      if (gpu) timer->start(compute.handle());
      stack.step(punica, compute);
      if (gpu) timer->stop(compute.handle());
    }
    const float gpu_ms = gpu ? timer->elapsed_ms() : 0.0f;  // waits for the step
    const auto t1 = Clock::now();
    if (out != nullptr) {
      if (gpu) out->gpu_ms.push_back(gpu_ms);
      out->wall_ms.push_back(ms_between(t0, t1));
    }
    // Between steps the serving loop yields the layer lock to slot writes.
    std::this_thread::yield();
  };

  for (int i = 0; i < o.warmup; ++i) run_step(nullptr);
  PhaseResult a;
  for (int i = 0; i < o.steps; ++i) run_step(&a);

  Loader loader;
  std::mutex loader_mutex;
  std::thread background([&] {
    try {
      const Stream wait_stream = gpu ? Stream::create(o.device) : Stream();
      if (gpu) cuda_rt::set_device(o.device.index);
      for (size_t i = 0; !loader.stop.load(); ++i) {
        const size_t pick = kServed + i % static_cast<size_t>(o.adapters - kServed);
        const std::string& name = names[pick];
        const auto t0 = Clock::now();
        manager.load(name, tmp.sub(name));
        const auto t1 = Clock::now();
        AdapterManager::Lease lease = manager.acquire(name);
        const auto t2 = Clock::now();
        lease.wait_ready(wait_stream);
        wait_stream.synchronize();
        const auto t3 = Clock::now();
        lease.release();
        manager.unload(name);
        {
          std::lock_guard<std::mutex> lock(loader_mutex);
          loader.load_ms.push_back(ms_between(t0, t1));
          loader.acquire_ms.push_back(ms_between(t1, t2));
          loader.upload_ms.push_back(ms_between(t2, t3));
        }
        loader.completed.fetch_add(1);
      }
    } catch (...) {
      loader.error = std::current_exception();
      loader.stop.store(true);
    }
  });
  PhaseResult b;
  int extra = 0;
  const auto b_start = Clock::now();
  for (int i = 0; (i < o.steps || loader.completed.load() < o.min_loads) && !loader.stop.load();
       ++i) {
    run_step(&b);
    if (i >= o.steps) ++extra;
  }
  const double b_seconds = ms_between(b_start, Clock::now()) / 1e3;
  const int loaded_during_b = loader.completed.load();
  loader.stop.store(true);
  background.join();
  if (loader.error) std::rethrow_exception(loader.error);

  const Stats a_gpu = stats_of(a.gpu_ms), a_wall = stats_of(a.wall_ms);
  const Stats b_gpu = stats_of(b.gpu_ms), b_wall = stats_of(b.wall_ms);
  auto line = [&](const char* phase, const Stats& g, const Stats& w) {
    if (gpu) {
      std::printf("%s  gpu median %8.3f ms  p90 %8.3f ms | wall median %8.3f ms  p90 %8.3f ms\n",
                  phase, g.median, g.p90, w.median, w.p90);
    } else {
      std::printf("%s  wall median %8.3f ms  p90 %8.3f ms\n", phase, w.median, w.p90);
    }
  };
  std::printf("%d steps per phase (+%d in B until %d loads), upload %s, packed adapter %.1f MB\n",
              o.steps, extra, o.min_loads, o.async_upload ? "async" : "sync",
              static_cast<double>(packed_bytes) / 1e6);
  line("phase A (serving only)      ", a_gpu, a_wall);
  line("phase B (serving + loading) ", b_gpu, b_wall);
  const Stats load = stats_of(loader.load_ms), acq = stats_of(loader.acquire_ms),
              up = stats_of(loader.upload_ms);
  std::printf(
      "adapters loaded during phase B: %d in %.2f s (per adapter: load median %.2f ms, acquire "
      "%.2f ms, upload wait %.2f ms)\n",
      loaded_during_b, b_seconds, load.median, acq.median, up.median);

  if (!o.json_path.empty()) {
    json doc;
    doc["benchmark"] = "adapter-load";
    doc["device"] = device_name;
    doc["commit"] = o.commit;
    doc["date"] = iso_date();
    doc["config"] = {{"layers", o.layers},
                     {"hidden", o.hidden},
                     {"kv_hidden", o.kv_hidden},
                     {"intermediate", o.intermediate},
                     {"tokens", o.tokens},
                     {"dtype", std::string(dtype_name(o.dtype))},
                     {"max_loras", o.max_loras},
                     {"max_lora_rank", o.max_lora_rank},
                     {"adapter_rank", o.rank},
                     {"adapters", o.adapters},
                     {"served_adapters", kServed},
                     {"adapter_file_bytes", file_bytes},
                     {"adapter_packed_bytes", packed_bytes},
                     {"base_weight_bytes", stack.base_bytes()},
                     {"steps", o.steps},
                     {"warmup", o.warmup},
                     {"min_loads", o.min_loads},
                     {"upload", o.async_upload ? "async" : "sync"}};
    auto phase = [&](const Stats& g, const Stats& w) {
      json j = {{"steps", w.count}, {"wall_ms", to_json(w)}};
      j["gpu_ms"] = gpu ? to_json(g) : json(nullptr);
      return j;
    };
    doc["phase_a"] = phase(a_gpu, a_wall);
    doc["phase_b"] = phase(b_gpu, b_wall);
    doc["phase_b"]["adapters_loaded"] = loaded_during_b;
    doc["phase_b"]["seconds"] = b_seconds;
    doc["phase_b"]["load_ms"] = to_json(load);
    doc["phase_b"]["acquire_ms"] = to_json(acq);
    doc["phase_b"]["upload_wait_ms"] = to_json(up);
    doc["method"] = {
        {"step", "every layer's forward (base GEMM + Punica LoRA) on one compute stream, " +
                     std::to_string(o.tokens) + " tokens round-robin over " +
                     std::to_string(kServed) + " leased adapters"},
        {"gpu_ms", "CUDA events around the step's enqueued work"},
        {"wall_ms", "host clock from taking the layer lock to the step's completion"},
        {"phase_b",
         "a background thread loads, acquires (free slot), waits for the upload, "
         "releases and unloads the other adapters in turn; files are in the page "
         "cache"}};
    std::ofstream out(o.json_path);
    LORAPLEX_CHECK(out.good(), "cannot write ", o.json_path);
    out << doc.dump(1) << "\n";
    std::printf("wrote %s\n", o.json_path.c_str());
  }
  return 0;
}

int run(const std::vector<std::string>& args) {
  Options o;
  if (!parse(args, o)) return 0;
  return run_bench(o);
}

}  // namespace

extern const Command kBenchAdapterLoadCommand = {
    "bench adapter-load", "time forward steps while adapters load (--help)", run};

}  // namespace loraplex::cli
