// `loraplex bench e2e`: the end-to-end benchmark of the forward step. An offline workload
// (R requests of P prompt tokens, G generated tokens each, greedy, EOS ignored, at most
// --max-num-seqs at once) on a real shape with random weights made on the GPU, or on a
// checkpoint, with N random PEFT adapters spread over the requests; the same workload without
// LoRA and with one adapter for all in the same run. Reports tok/s, prefill and decode time,
// the mean decode step, the floor (weight bytes per decode step over the measured copy
// bandwidth, prefill FLOPs over the measured bf16 matmul rate) and the percent of it reached,
// and where a step's time goes (CUPTI kernel records by component, and the host's gaps).
// With --tensor-parallel-size N the model is sharded over N GPUs: the floor is one GPU's share
// of the weights and FLOPs, plus the decode step's collectives timed alone (the breakdown then
// sums the kernels of every GPU).

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "cli_args.h"
#include "cli_parse.h"
#include "collective_timing.h"
#include "command.h"
#include "kernel_profile.h"
#include "loraplex/adapters/adapter_manager.h"
#include "loraplex/core/cuda_runtime.h"
#include "loraplex/core/error.h"
#include "loraplex/engine/engine.h"
#include "loraplex/kernels/cuda/device_timing.h"
#include "loraplex/layers/linear_base.h"
#include "loraplex/model/executor.h"
#include "loraplex/model/load_model.h"
#include "loraplex/model/model_shapes.h"
#include "loraplex/model/random_adapter.h"

namespace loraplex::cli {
namespace {

namespace kc = kernels::cuda;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

struct Options {
  std::string shape = "llama3-8b";
  std::string model_dir;
  int64_t layers = 0;
  std::string dtype = "bfloat16";
  int adapters = 8;
  int rank = 16;
  std::vector<std::string> targets;  // empty: every linear projection of the model
  std::string distribution = "uniform";
  int64_t requests = 32;
  int64_t prompt_len = 128;
  int64_t gen_len = 64;
  int64_t max_num_seqs = 0;        // 0 = requests
  int64_t max_batched_tokens = 0;  // 0 = a whole wave's prompts
  std::vector<std::string> configs = {"base", "mixed", "single"};
  int repeats = 2;
  bool profile = true;
  bool cuda_graphs = true;
  bool async_scheduling = true;  // decode step n + 1 launched before step n is collected
  std::string json_path;
  std::string adapter_dir;
  std::string commit;
  uint64_t seed = 0;
  std::string device = "cuda:0";
  int tensor_parallel_size = 1;
  bool fully_sharded_loras = false;
  std::string lora_tuning;
  std::string lora_decode = "auto";
  std::string lora_dtype = "auto";
  int64_t fused_lora_max_tokens = 512;
  bool moe_host_routing = false;
  int top_kernels = 15;
  bool timeline = false;
};

double seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

void progress(const char* fmt, const std::string& what) {
  std::fprintf(stderr, fmt, what.c_str());
  std::fflush(stderr);
}

// bf16 matrix rate: an 8192^3 product through the base GEMM path (cuBLASLt), median of 10.
double matmul_tflops(Device dev, const Stream& stream) {
  const int64_t n = 8192;
  Tensor a = Tensor::empty({n, n}, DType::kBF16, dev);
  Tensor b = Tensor::empty({n, n}, DType::kBF16, dev);
  Tensor c = Tensor::empty({n, n}, DType::kBF16, dev);
  kc::fill_random(a.data_ptr(), DType::kBF16, a.numel(), 1, 1.0f, stream.handle());
  kc::fill_random(b.data_ptr(), DType::kBF16, b.numel(), 2, 1.0f, stream.handle());
  linear_base(a, b, Tensor(), c, stream);
  std::vector<double> ms;
  for (int i = 0; i < 10; ++i) {
    kc::Timer t;
    t.start(stream.handle());
    linear_base(a, b, Tensor(), c, stream);
    t.stop(stream.handle());
    ms.push_back(t.elapsed_ms());
  }
  std::sort(ms.begin(), ms.end());
  return 2.0 * std::pow(static_cast<double>(n), 3) / (ms[ms.size() / 2] * 1e-3) / 1e12;
}

struct Request {
  std::vector<int32_t> prompt;
  int32_t slot = -1;
};

struct RunResult {
  double prefill_s = 0.0;
  double decode_s = 0.0;
  int64_t decode_steps = 0;
  int64_t prefill_steps = 0;
  int64_t graph_steps = 0;
  int64_t prefill_tokens = 0;
  int64_t attention_pairs = 0;  // causal (query, key) pairs of the prefills
  std::vector<std::vector<int32_t>> outputs;
  json prefill_breakdown;
  json decode_breakdown;  // per decode step
  json prefill_top;       // the kernels that took the most time
  json decode_top;        // per decode step
  json decode_timeline;   // the last decode step's kernels
};

// Every kernel of the last decode step (a step opens with the token embedding): start and
// duration in microseconds from the step's first kernel, and the CUDA stream, which tells the
// LoRA stream's kernels from the main stream's.
json last_step_timeline(const std::vector<KernelRecord>& records) {
  const std::vector<KernelRecord> step = last_step(records, "embedding_kernel");
  json out = json::array();
  for (const KernelRecord& k : step) {
    out.push_back({{"name", k.name.substr(0, std::min<size_t>(k.name.size(), 120))},
                   {"start_us", static_cast<double>(k.start_ns - step.front().start_ns) * 1e-3},
                   {"us", static_cast<double>(k.end_ns - k.start_ns) * 1e-3},
                   {"stream", k.stream}});
  }
  return out;
}

json top_kernels_json(const std::vector<KernelRecord>& records, size_t n, double per) {
  json out = json::array();
  for (const KernelTotal& t : top_kernels(records, n)) {
    out.push_back({{"name", t.name},
                   {"ms", t.ms / per},
                   {"launches", static_cast<double>(t.launches) / per}});
  }
  return out;
}

// Runs the requests in waves of max_num_seqs: the wave's prompts in steps of at most
// max_batched_tokens tokens (a prompt may be split), then gen_len - 1 decode steps.
RunResult run_workload(model::ModelExecutor& d, const std::vector<Request>& reqs, const Options& o,
                       int64_t max_seqs, int64_t max_tokens, bool profile) {
  RunResult r;
  r.outputs.resize(reqs.size());
  const int64_t bs = d.options().kv_block_size;
  const int64_t per_seq = (o.prompt_len + o.gen_len + bs - 1) / bs;
  for (size_t wave = 0; wave < reqs.size(); wave += static_cast<size_t>(max_seqs)) {
    const size_t end = std::min(reqs.size(), wave + static_cast<size_t>(max_seqs));
    std::vector<std::vector<int32_t>> blocks(end - wave);
    for (size_t i = 0; i < blocks.size(); ++i) {
      for (int64_t b = 0; b < per_seq; ++b) {
        blocks[i].push_back(static_cast<int32_t>(static_cast<int64_t>(i) * per_seq + b));
      }
    }
    // Prefill.
    std::vector<int64_t> done(end - wave, 0);
    KernelProfile prof;
    if (profile) prof.start();
    const auto p0 = Clock::now();
    size_t next = 0;
    while (next < done.size()) {
      model::StepBatch batch;
      int64_t budget = max_tokens;
      std::vector<size_t> sampled;
      for (size_t i = next; i < done.size() && budget > 0; ++i) {
        const Request& q = reqs[wave + i];
        const int64_t take = std::min<int64_t>(budget, o.prompt_len - done[i]);
        model::SequenceStep s;
        s.tokens.assign(q.prompt.begin() + done[i], q.prompt.begin() + done[i] + take);
        s.start_position = static_cast<int32_t>(done[i]);
        s.blocks = blocks[i];
        s.lora_slot = q.slot;
        s.sample = done[i] + take == o.prompt_len;
        r.attention_pairs += take * done[i] + take * (take + 1) / 2;
        done[i] += take;
        budget -= take;
        r.prefill_tokens += take;
        if (s.sample) sampled.push_back(i);
        batch.seqs.push_back(std::move(s));
      }
      const model::StepResult out = d.execute(batch);
      for (size_t k = 0; k < sampled.size(); ++k)
        r.outputs[wave + sampled[k]].push_back(out.token_ids[k]);
      while (next < done.size() && done[next] == o.prompt_len) ++next;
      ++r.prefill_steps;
    }
    const auto p1 = Clock::now();
    r.prefill_s += seconds(p0, p1);
    if (profile) {
      const std::vector<KernelRecord> records = prof.stop();
      r.prefill_breakdown = component_ms(records, seconds(p0, p1) * 1e3);
      r.prefill_top = top_kernels_json(records, static_cast<size_t>(o.top_kernels), 1.0);
    }
    // Decode. Asynchronously each step is launched before the one before it is collected,
    // with its tokens taken from that step on the device, as the engine runs them.
    if (profile) prof.start();
    const auto d0 = Clock::now();
    const auto take = [&](const model::StepResult& out) {
      for (size_t i = 0; i < done.size(); ++i) r.outputs[wave + i].push_back(out.token_ids[i]);
    };
    bool in_flight = false;
    for (int64_t step = 1; step < o.gen_len; ++step) {
      const bool fed = o.async_scheduling && in_flight;
      model::StepBatch batch;
      for (size_t i = 0; i < done.size(); ++i) {
        model::SequenceStep s;
        s.tokens = {fed ? 0 : r.outputs[wave + i].back()};
        s.feed_row = fed ? static_cast<int32_t>(i) : -1;
        s.start_position = static_cast<int32_t>(o.prompt_len + step - 1);
        s.blocks = blocks[i];
        s.lora_slot = reqs[wave + i].slot;
        s.sample = true;
        batch.seqs.push_back(std::move(s));
      }
      d.launch(batch);
      if (in_flight) take(d.collect());
      in_flight = o.async_scheduling;
      if (!in_flight) take(d.collect());
      ++r.decode_steps;
      if (d.last_step().graph) ++r.graph_steps;
    }
    if (in_flight) take(d.collect());
    const auto d1 = Clock::now();
    r.decode_s += seconds(d0, d1);
    if (profile && r.decode_steps > 0) {
      const std::vector<KernelRecord> records = prof.stop();
      const auto ms = component_ms(records, seconds(d0, d1) * 1e3);
      const auto steps = static_cast<double>(o.gen_len - 1);
      json per_step;
      for (const auto& [k, v] : ms) per_step[k] = v / steps;
      r.decode_breakdown = per_step;
      r.decode_top = top_kernels_json(records, static_cast<size_t>(o.top_kernels), steps);
      if (o.timeline) r.decode_timeline = last_step_timeline(records);
    }
  }
  return r;
}

int run(const std::vector<std::string>& args) {
  Options o;
  o.commit = env_commit();
  CLI::App app{
      "loraplex bench e2e: the offline end-to-end benchmark (random weights of a real shape, or "
      "a checkpoint), with and without LoRA, against the floor measured in the same run"};
  std::string shapes;
  for (const std::string& n : model::model_shape_names())
    shapes += (shapes.empty() ? "" : ", ") + n;
  app.add_option("--shape", o.shape,
                 "model shape: " + shapes + " (*-fp8: FP8 projections, per-channel scales)");
  app.add_option("--model", o.model_dir, "a checkpoint directory instead of --shape");
  app.add_option("--layers", o.layers, "keep only this many decoder layers (0 = all)");
  app.add_option("--dtype", o.dtype, "bfloat16 (default), float16 or float32");
  app.add_option("--adapters", o.adapters, "random PEFT adapters (default 8)");
  app.add_option("--rank", o.rank, "their rank (default 16)");
  app.add_option("--targets", o.targets,
                 "their target modules (default: the 7 linear projections; the MLP ones are the "
                 "experts' in MoE models, named w1, w2, w3 in Mixtral)")
      ->delimiter(',');
  app.add_option("--distribution", o.distribution, "requests over adapters: uniform or zipf");
  app.add_option("--requests", o.requests, "requests (default 32)");
  app.add_option("--prompt-len", o.prompt_len, "prompt tokens per request (default 128)");
  app.add_option("--gen-len", o.gen_len, "generated tokens per request (default 64)");
  app.add_option("--max-num-seqs", o.max_num_seqs, "sequences at once (default: all)");
  app.add_option("--max-num-batched-tokens", o.max_batched_tokens,
                 "tokens per prefill step (default: a whole wave's prompts)");
  app.add_option("--configs", o.configs, "base,mixed,single (default all three)")->delimiter(',');
  app.add_option("--repeats", o.repeats, "runs of each configuration; the last is reported");
  app.add_flag("!--no-profile", o.profile, "skip the CUPTI breakdown pass");
  app.add_option("--top-kernels", o.top_kernels,
                 "the breakdown lists this many kernels by time (default 15)");
  app.add_flag("--timeline", o.timeline,
               "add every kernel of the profile pass's last decode step to the JSON (start, "
               "duration, stream): what overlaps what");
  app.add_option("--lora-tune", o.lora_tuning,
                 "key=value,... over the LoRA kernels' tuning table (as bench kernels --tune)");
  app.add_option("--lora-decode", o.lora_decode,
                 "how decode steps run their LoRA: fused (the shrink in the base GEMM, the "
                 "expand in the op after it), overlap (LoRA kernels on a second stream), "
                 "kernels (LoRA kernels after each GEMM) or auto (overlap up to " +
                     std::to_string(model::kAutoOverlapTokens) + " tokens, else fused; default)")
      ->check(CLI::IsMember({"auto", "fused", "overlap", "kernels"}));
  app.add_option("--lora-dtype", o.lora_dtype,
                 "the adapters' storage: auto (the model dtype, default) or fp8 (float8_e4m3 "
                 "with a scale per row)");
  app.add_option("--fused-lora-max-tokens", o.fused_lora_max_tokens,
                 "steps of up to this many tokens take the fused LoRA path (default 512)");
  app.add_flag("--moe-host-routing", o.moe_host_routing,
               "MoE steps group their pairs on the host, one cuBLASLt GEMM per expert (eager), "
               "instead of the device-routed expert GEMMs: to measure the two");
  app.add_flag("!--enforce-eager", o.cuda_graphs, "no CUDA graphs");
  app.add_flag("!--no-async-scheduling", o.async_scheduling,
               "collect every decode step before launching the next (the host's work then sits "
               "between the steps' kernels)");
  app.add_option("--json", o.json_path, "write the results as JSON");
  app.add_option("--adapter-dir", o.adapter_dir, "where the random adapters are written");
  app.add_option("--commit", o.commit, "source commit to record (default $LORAPLEX_COMMIT)");
  app.add_option("--seed", o.seed, "random weights and prompts");
  app.add_option("--device", o.device, "cuda:N (the first GPU with --tensor-parallel-size)");
  app.add_option("--tensor-parallel-size", o.tensor_parallel_size,
                 "-tp: GPUs the model is sharded over, from --device on")
      ->check(CLI::PositiveNumber);
  app.add_flag("--fully-sharded-loras", o.fully_sharded_loras,
               "shard the adapters like the layers they modify (LoRA-A by rank too)");
  if (!parse_cli(app, args)) return 0;

  const Device dev = Device::parse(o.device);
  LORAPLEX_CHECK(dev.is_cuda() && cuda_device_count() > dev.index,
                 "bench e2e needs a CUDA device (", o.device, "; ", cuda_device_count(),
                 " present)");
  const int tp = o.tensor_parallel_size;
  LORAPLEX_CHECK(
      o.requests >= 1 && o.prompt_len >= 1 && o.gen_len >= 1 && o.repeats >= 1 && o.adapters >= 1 &&
          o.rank >= 1,
      "--requests, --prompt-len, --gen-len, --repeats, --adapters and --rank must be >= 1");
  LORAPLEX_CHECK(o.distribution == "uniform" || o.distribution == "zipf", "--distribution ",
                 o.distribution, ": expected uniform or zipf");
  const DType dtype = dtype_from_name(o.dtype);
  const int64_t max_seqs = o.max_num_seqs > 0 ? std::min(o.max_num_seqs, o.requests) : o.requests;
  const int64_t max_tokens =
      o.max_batched_tokens > 0 ? o.max_batched_tokens : max_seqs * o.prompt_len;
  const Stream stream = Stream::create(dev);
  const kc::DeviceInfo info = kc::device_info(dev.index);
  progress("bench e2e: measuring the device (%s)\n", info.name);
  const double copy_gbs = kc::copy_bandwidth_gbs(size_t{1} << 30, 10, stream.handle());
  const double tflops = matmul_tflops(dev, stream);

  model::ModelConfig config;
  if (o.model_dir.empty()) {
    config = model::model_shape(o.shape, o.layers);
  } else {
    config = model::ModelConfig::from_file(o.model_dir + "/config.json");
  }
  if (o.targets.empty()) o.targets = model::all_linear_targets(config);
  model::DecoderOptions dopts;
  dopts.dtype = dtype;
  dopts.device = dev;
  dopts.max_loras = o.adapters;
  dopts.max_lora_rank = o.rank;
  dopts.max_num_tokens = std::max(max_tokens, max_seqs);
  dopts.max_num_seqs = max_seqs;
  dopts.kv_block_size = 16;
  dopts.max_model_len = o.prompt_len + o.gen_len;
  dopts.kv_blocks = max_seqs * ((o.prompt_len + o.gen_len + 15) / 16);
  dopts.cuda_graphs = o.cuda_graphs;
  dopts.tensor_parallel_size = tp;
  dopts.fully_sharded_loras = o.fully_sharded_loras;
  dopts.lora_tuning = o.lora_tuning;
  dopts.fused_lora_max_tokens = o.fused_lora_max_tokens;
  dopts.moe_host_routing = o.moe_host_routing;
  dopts.lora_dtype = engine::parse_lora_dtype(o.lora_dtype);
  dopts.lora_decode = o.lora_decode == "overlap"   ? model::LoraDecode::kOverlap
                      : o.lora_decode == "kernels" ? model::LoraDecode::kKernels
                      : o.lora_decode == "fused"   ? model::LoraDecode::kFused
                                                   : model::LoraDecode::kAuto;
  // The decode step's collectives alone (tp > 1): 2 all-reduces per layer and the embedding's,
  // and the lm_head's all-gather, over the wave's rows.
  double collective_ms = 0.0;
  if (tp > 1) {
    std::vector<int> devices;
    for (int r = 0; r < tp; ++r) devices.push_back(dev.index + r);
    LORAPLEX_CHECK(dev.index + tp <= cuda_device_count(), "--tensor-parallel-size ", tp, " needs ",
                   tp, " GPUs from ", o.device, " on; ", cuda_device_count(), " present");
    collective_ms = decode_collectives_ms(devices, dtype, max_seqs, config.hidden_size,
                                          (config.vocab_size + tp - 1) / tp,
                                          static_cast<int>(2 * config.num_layers + 1), 20);
  }
  progress("bench e2e: loading %s\n", o.model_dir.empty() ? o.shape : o.model_dir);
  const auto l0 = Clock::now();
  std::unique_ptr<model::ModelExecutor> d =
      o.model_dir.empty() ? model::create_random_model(config, dopts, o.seed + 1)
                          : model::load_model(o.model_dir, dopts);
  const double load_s = seconds(l0, Clock::now());

  // Adapters: written as PEFT directories and loaded through the adapter manager.
  const bool need_adapters = std::find_if(o.configs.begin(), o.configs.end(), [](const auto& c) {
                               return c != "base";
                             }) != o.configs.end();
  AdapterManagerConfig mc;
  mc.max_loras = o.adapters;
  mc.max_lora_rank = o.rank;
  mc.lora_dtype = dtype;
  mc.device = dev;
  AdapterManager manager(d->targets(), mc);
  std::vector<AdapterManager::Lease> leases;
  double adapter_s = 0.0;
  if (need_adapters) {
    const std::string root =
        o.adapter_dir.empty()
            ? (std::filesystem::temp_directory_path() / "loraplex_bench_adapters").string()
            : o.adapter_dir;
    const auto a0 = Clock::now();
    for (int i = 0; i < o.adapters; ++i) {
      const std::string name = "a" + std::to_string(i);
      const std::string dir = root + "/" + o.shape + "_r" + std::to_string(o.rank) + "_" + name;
      const auto w0 = Clock::now();
      if (!std::filesystem::exists(dir + "/adapter_model.safetensors")) {
        model::write_random_peft_adapter(dir, config, o.rank, o.targets, o.seed + 100 + i);
      }
      const auto w1 = Clock::now();
      manager.load(name, dir);
      const auto w2 = Clock::now();
      leases.push_back(manager.acquire(name));
      for (const Stream& s : d->streams()) leases.back().wait_ready(s);
      std::fprintf(stderr,
                   "bench e2e: adapter %s written in %.1f s, read and packed in %.1f s, written "
                   "to its slot in %.1f s\n",
                   name.c_str(), seconds(w0, w1), seconds(w1, w2), seconds(w2, Clock::now()));
    }
    adapter_s = seconds(a0, Clock::now());
  }

  // The same prompts in every configuration.
  std::mt19937_64 rng(o.seed + 7);
  std::vector<Request> reqs(static_cast<size_t>(o.requests));
  for (Request& q : reqs) {
    q.prompt.resize(static_cast<size_t>(o.prompt_len));
    for (int32_t& t : q.prompt)
      t = static_cast<int32_t>(rng() % static_cast<uint64_t>(config.vocab_size));
  }
  std::vector<double> zipf_cdf;
  double z = 0.0;
  for (int i = 0; i < o.adapters; ++i) zipf_cdf.push_back(z += 1.0 / (i + 1));
  auto adapter_of = [&](size_t i) {
    if (o.distribution == "uniform")
      return static_cast<int32_t>(i % static_cast<size_t>(o.adapters));
    const double u = std::uniform_real_distribution<double>(0.0, z)(rng);
    return static_cast<int32_t>(std::lower_bound(zipf_cdf.begin(), zipf_cdf.end(), u) -
                                zipf_cdf.begin());
  };
  std::vector<int32_t> mixed_slots;
  for (size_t i = 0; i < reqs.size(); ++i)
    mixed_slots.push_back(leases.empty() ? -1 : leases[static_cast<size_t>(adapter_of(i))].slot());

  const int64_t weight_bytes = model::decode_weight_bytes(config, dtype);
  // Each GPU reads its shard (norms and routers, a few MB, are whole on every rank).
  const double decode_floor_s =
      static_cast<double>(weight_bytes) / tp / (copy_gbs * 1e9) + collective_ms * 1e-3;
  json doc;
  doc["command"] = "bench e2e";
  doc["device"] = info.name;
  doc["commit"] = o.commit;
  doc["date"] = iso_date();
  doc["shape"] = o.model_dir.empty() ? o.shape : o.model_dir;
  doc["layers"] = config.num_layers;
  doc["dtype"] = o.dtype;
  doc["workload"] = {{"requests", o.requests},
                     {"prompt_len", o.prompt_len},
                     {"gen_len", o.gen_len},
                     {"max_num_seqs", max_seqs},
                     {"max_batched_tokens", max_tokens},
                     {"adapters", o.adapters},
                     {"rank", o.rank},
                     {"targets", o.targets},
                     {"distribution", o.distribution},
                     {"cuda_graphs", o.cuda_graphs},
                     {"async_scheduling", o.async_scheduling},
                     {"tensor_parallel_size", tp}};
  doc["copy_bandwidth_gbs"] = copy_gbs;
  doc["matmul_tflops_bf16"] = tflops;
  doc["load_s"] = load_s;
  doc["adapter_load_s"] = adapter_s;
  doc["decode_weight_bytes"] = weight_bytes;
  doc["tensor_parallel_size"] = tp;
  doc["fully_sharded_loras"] = o.fully_sharded_loras;
  if (!o.lora_tuning.empty()) doc["lora_tuning"] = o.lora_tuning;
  doc["lora_decode"] = o.lora_decode;
  doc["lora_dtype"] = o.lora_dtype;
  doc["fused_lora_max_tokens"] = o.fused_lora_max_tokens;
  doc["moe_host_routing"] = o.moe_host_routing;
  const char* autotune = std::getenv("LORAPLEX_GEMM_AUTOTUNE");
  doc["gemm_autotune"] = autotune != nullptr && std::string(autotune) == "1";
  doc["decode_weight_bytes_per_gpu"] = weight_bytes / tp;
  doc["decode_collectives_ms"] = collective_ms;
  doc["decode_step_floor_ms"] = decode_floor_s * 1e3;
  std::fprintf(stderr,
               "bench e2e: %s, %s %s (%lld layers), copy %.0f GB/s, bf16 matmul %.0f TFLOP/s, "
               "load %.2f s\n",
               info.name.c_str(), doc["shape"].get<std::string>().c_str(), o.dtype.c_str(),
               static_cast<long long>(config.num_layers), copy_gbs, tflops, load_s);
  json results = json::object();
  double base_tok_s = 0.0;
  for (const std::string& cfg : o.configs) {
    LORAPLEX_CHECK(cfg == "base" || cfg == "mixed" || cfg == "single", "--configs: unknown '", cfg,
                   "' (base, mixed, single)");
    for (size_t i = 0; i < reqs.size(); ++i) {
      reqs[i].slot = cfg == "base" ? -1 : (cfg == "single" ? leases[0].slot() : mixed_slots[i]);
    }
    RunResult r;
    for (int rep = 0; rep < o.repeats; ++rep) {
      std::fprintf(stderr, "bench e2e: %s run %d/%d\r", cfg.c_str(), rep + 1, o.repeats);
      std::fflush(stderr);
      r = run_workload(*d, reqs, o, max_seqs, max_tokens, false);
    }
    const double total = r.prefill_s + r.decode_s;
    const int64_t generated = o.requests * o.gen_len;
    const double prefill_flops =
        model::step_flops(config, r.prefill_tokens, r.attention_pairs, o.requests);
    const double floor_s =
        prefill_flops / (tflops * 1e12 * tp) + static_cast<double>(r.decode_steps) * decode_floor_s;
    json j;
    j["tok_s"] = static_cast<double>(generated) / total;
    j["total_s"] = total;
    j["prefill_s"] = r.prefill_s;
    j["prefill_steps"] = r.prefill_steps;
    j["decode_s"] = r.decode_s;
    j["decode_steps"] = r.decode_steps;
    j["graph_steps"] = r.graph_steps;
    j["decode_step_ms"] =
        r.decode_steps > 0 ? r.decode_s / static_cast<double>(r.decode_steps) * 1e3 : 0.0;
    j["prefill_tflop"] = prefill_flops / 1e12;
    j["floor_s"] = floor_s;
    j["percent_of_floor"] = 100.0 * floor_s / total;
    if (cfg == "base") base_tok_s = j["tok_s"].get<double>();
    if (base_tok_s > 0.0) j["ratio_to_base"] = j["tok_s"].get<double>() / base_tok_s;
    if (o.profile && KernelProfile::available()) {
      const RunResult p = run_workload(*d, reqs, o, max_seqs, max_tokens, true);
      j["prefill_breakdown_ms"] = p.prefill_breakdown;
      j["decode_step_breakdown_ms"] = p.decode_breakdown;
      if (o.top_kernels > 0) {
        j["prefill_top_kernels"] = p.prefill_top;
        j["decode_step_top_kernels"] = p.decode_top;
      }
      if (o.timeline) j["decode_step_timeline"] = p.decode_timeline;
    }
    j["outputs_first_request"] = r.outputs[0];
    std::fprintf(
        stderr,
        "bench e2e: %-6s %8.1f tok/s  prefill %.3f s  decode step %.2f ms  (floor %.1f%%)\n",
        cfg.c_str(), j["tok_s"].get<double>(), r.prefill_s, j["decode_step_ms"].get<double>(),
        j["percent_of_floor"].get<double>());
    results[cfg] = j;
  }
  doc["results"] = results;
  const std::string text = doc.dump(2);
  if (!o.json_path.empty()) {
    std::ofstream out(o.json_path);
    out << text << "\n";
    LORAPLEX_CHECK(out.good(), o.json_path, ": write failed");
  }
  std::printf("%s\n", text.c_str());
  return 0;
}

}  // namespace

extern const Command kBenchE2eCommand = {
    "bench e2e", "end-to-end generation speed on a real shape, with and without LoRA", run};

}  // namespace loraplex::cli
