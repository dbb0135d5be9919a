// `loraplex bench serve`: the online benchmark, in process. A seeded trace of requests (Poisson
// arrivals at --rate, or all at once; prompt and output lengths fixed or drawn; adapters drawn
// uniform or zipf from the pool) is played against an Engine twice: with each request's
// adapter, and the same trace on the base model. The client side measures time to first token,
// inter-token latency and end-to-end latency per request; the engine's counters give queueing
// time, steps, adapters per step, preemptions, adapter evictions and prefix-cache hits.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_parse.h"
#include "command.h"
#include "loraplex/adapters/peft_config.h"
#include "loraplex/core/device.h"
#include "loraplex/core/error.h"
#include "loraplex/engine/engine.h"
#include "loraplex/engine/model_files.h"
#include "loraplex/kernels/cuda/device_timing.h"
#include "loraplex/model/decoder.h"
#include "loraplex/model/load_model.h"
#include "loraplex/model/model_shapes.h"
#include "loraplex/model/random_adapter.h"
#include "serve_workload.h"

#if LORAPLEX_WITH_HTTP_CLIENT
#include "serve_http_client.h"
#endif

namespace loraplex::cli {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::ordered_json;

struct ServeArgs {
  std::string model_dir;
  std::string shape;        // random weights of a named shape instead of --model
  int64_t layers = 0;       // --shape: keep this many layers (0 = all)
  int random_adapters = 0;  // --shape: this many random PEFT adapters in the pool
  int random_rank = 16;
  std::string adapter_cache;       // where the random adapters are written
  std::vector<std::string> loras;  // NAME=DIR
  std::string lora_dir;
  int64_t num_requests = 200;
  double rate = 0.0;  // 0 or inf: all at once
  std::string prompt_len = "256";
  std::string output_len = "128";
  std::string adapter_dist = "zipf";
  double zipf_s = 1.0;
  int64_t shared_prefix = 0;
  bool no_base = false;
  bool no_progress = false;
  std::string json_path;
  std::string device;
  std::string dtype;
  uint64_t seed = 0;
  int64_t max_num_seqs = 256;
  int64_t max_num_batched_tokens = 8192;
  int max_loras = 0;      // 0: the pool's size, at most 32
  int max_lora_rank = 0;  // 0: the largest adapter rank
  int max_cpu_loras = 0;  // 0: the whole pool
  int64_t num_kv_blocks = 0;
  double gpu_memory_utilization = 0.90;
  int64_t kv_block_size = 16;
  int64_t max_model_len = 0;
  bool no_prefix_caching = false;
  bool no_async_scheduling = false;
  double lora_drain_after = 1.0;
  double lora_evict_after = 0.02;
  int tensor_parallel_size = 1;
  bool fully_sharded_loras = false;
  // --server: the trace against a running server over HTTP instead of an engine in process.
  std::string server;
  std::string api_key;
  std::string served_model_name;
  int64_t vocab_size = 0;
  double request_timeout = 600.0;
};

/// The model and adapter pool a benchmark serves. Built by one function from the options, so
/// that other sources (random weights of a named shape, random adapters) slot in here.
struct ServePool {
  std::unique_ptr<model::ModelExecutor> decoder;
  std::shared_ptr<const Tokenizer> tokenizer;  // null when the model has none
  std::vector<int32_t> eos_token_ids;
  std::vector<std::string> adapter_names;
  std::string description;
  /// Loads adapter_names into the engine.
  std::function<void(engine::Engine&)> load_adapters;
};

std::vector<std::pair<std::string, std::string>> adapter_dirs(const ServeArgs& a) {
  namespace fs = std::filesystem;
  std::vector<std::pair<std::string, std::string>> out;
  for (const std::string& l : a.loras) {
    const size_t eq = l.find('=');
    if (!a.server.empty() && eq == std::string::npos) {
      // --server: the server has the adapter; only its name matters.
      LORAPLEX_CHECK(!l.empty(), "--lora expects NAME or NAME=DIR");
      out.emplace_back(l, "");
      continue;
    }
    LORAPLEX_CHECK(eq != std::string::npos && eq > 0 && eq + 1 < l.size(),
                   "--lora expects NAME=DIR, got '", l, "'");
    out.emplace_back(l.substr(0, eq), l.substr(eq + 1));
  }
  if (!a.lora_dir.empty()) {
    LORAPLEX_CHECK(fs::is_directory(a.lora_dir), "--lora-dir ", a.lora_dir, ": not a directory");
    std::vector<std::pair<std::string, std::string>> found;
    for (const auto& entry : fs::directory_iterator(a.lora_dir)) {
      if (entry.is_directory() && fs::exists(entry.path() / "adapter_config.json"))
        found.emplace_back(entry.path().filename().string(), entry.path().string());
    }
    LORAPLEX_CHECK(!found.empty(), "--lora-dir ", a.lora_dir,
                   ": no adapter directories (with adapter_config.json) in it");
    std::sort(found.begin(), found.end());
    out.insert(out.end(), found.begin(), found.end());
  }
  std::map<std::string, int> seen;
  for (const auto& [name, dir] : out)
    LORAPLEX_CHECK(seen[name]++ == 0, "adapter name '", name, "' is given twice");
  return out;
}

// Random weights of a named shape made on the device, and random PEFT adapters written once to
// disk and loaded through the real path; prompts are token ids (no tokenizer).
ServePool random_serve_pool(const ServeArgs& a, engine::EngineOptions& o, DType dtype,
                            Device device) {
  LORAPLEX_CHECK(a.model_dir.empty(), "--shape and --model exclude each other");
  LORAPLEX_CHECK(a.random_adapters >= 0 && a.random_rank >= 1, "--adapters ", a.random_adapters,
                 " and --rank ", a.random_rank, " must be >= 0 and >= 1");
  const model::ModelConfig config = model::model_shape(a.shape, a.layers);
  const int pool = a.random_adapters;
  if (o.max_loras == 0) o.max_loras = std::clamp(pool, 1, 32);
  if (o.max_lora_rank == 0) o.max_lora_rank = a.random_rank;
  if (o.max_cpu_loras == 0) o.max_cpu_loras = std::max(o.max_loras, pool);
  if (o.max_model_len == 0) o.max_model_len = config.max_position_embeddings;
  ServePool p;
  p.decoder =
      model::create_random_model(config, engine::engine_decoder_options(o, dtype, device), 1);
  p.eos_token_ids = config.eos_token_ids;
  const std::string root =
      a.adapter_cache.empty()
          ? (std::filesystem::temp_directory_path() / "loraplex_bench_adapters").string()
          : a.adapter_cache;
  std::vector<std::pair<std::string, std::string>> dirs;
  for (int i = 0; i < pool; ++i) {
    const std::string name = "a" + std::to_string(i);
    const std::string dir =
        root + "/" + a.shape + "_r" + std::to_string(a.random_rank) + "_" + name;
    if (!std::filesystem::exists(dir + "/adapter_model.safetensors")) {
      model::write_random_peft_adapter(dir, config, a.random_rank,
                                       model::all_linear_targets(config),
                                       100 + static_cast<uint64_t>(i));
    }
    dirs.emplace_back(name, dir);
    p.adapter_names.push_back(name);
  }
  p.description = a.shape + " (random weights)";
  p.load_adapters = [dirs](engine::Engine& e) {
    for (const auto& [name, dir] : dirs) e.load_adapter(name, dir);
  };
  return p;
}

ServePool make_serve_pool(const ServeArgs& a, engine::EngineOptions& o, DType dtype,
                          Device device) {
  namespace fs = std::filesystem;
  if (!a.shape.empty()) return random_serve_pool(a, o, dtype, device);
  LORAPLEX_CHECK(!a.model_dir.empty(), "--model DIR or --shape NAME is required (see --help)");
  LORAPLEX_CHECK(fs::is_directory(a.model_dir), a.model_dir, ": model directory does not exist");
  const auto dirs = adapter_dirs(a);
  int max_rank = 1;
  for (const auto& [name, dir] : dirs) {
    try {
      max_rank = std::max(max_rank, PeftLoraConfig::from_file(adapter_config_path(dir)).max_rank());
    } catch (const Error& e) {
      LORAPLEX_FAIL("adapter '", name, "': ", e.what());
    }
  }
  const int pool = static_cast<int>(dirs.size());
  if (o.max_loras == 0) o.max_loras = std::clamp(pool, 1, 32);
  if (o.max_lora_rank == 0) o.max_lora_rank = max_rank;
  if (o.max_cpu_loras == 0) o.max_cpu_loras = std::max(o.max_loras, pool);

  ServePool p;
  p.decoder = model::load_model(a.model_dir, engine::engine_decoder_options(o, dtype, device));
  if (fs::exists(fs::path(a.model_dir) / "tokenizer.json"))
    p.tokenizer = engine::read_tokenizer(a.model_dir);
  p.eos_token_ids = engine::read_eos_token_ids(a.model_dir, p.decoder->config());
  for (const auto& [name, dir] : dirs) p.adapter_names.push_back(name);
  p.description = a.model_dir;
  p.load_adapters = [dirs](engine::Engine& e) {
    for (const auto& [name, dir] : dirs) e.load_adapter(name, dir);
  };
  return p;
}

struct RunResult {
  std::string label;
  double duration_s = 0.0;
  int64_t completed = 0;
  int64_t failed = 0;
  int64_t input_tokens = 0;
  int64_t output_tokens = 0;
  std::vector<double> ttft, itl, e2e, queue;
  std::map<int, double> first_token_wait;  // adapter -> TTFT of its first request
  engine::EngineMetrics before, after;
  bool over_http = false;  // no engine counters: the fields that come from them are left out
};

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

// Plays `trace` (with or without its adapters) against the engine and measures it on the
// client side: tokens are read as they arrive by one polling loop.
RunResult run_trace(engine::Engine& engine, const std::vector<TraceRequest>& trace,
                    const std::vector<std::string>& adapters, bool with_lora,
                    const std::string& label, bool progress) {
  struct Active {
    engine::RequestHandle handle;
    size_t index = 0;
    Clock::time_point submitted;
    Clock::time_point last;
    bool got_first = false;
  };
  RunResult r;
  r.label = label;
  r.before = engine.metrics();
  const Clock::time_point t0 = Clock::now();
  std::vector<Active> active;
  size_t next = 0;
  size_t done = 0;
  Clock::time_point last_progress = t0;
  const auto seconds = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
  while (done < trace.size()) {
    Clock::time_point now = Clock::now();
    while (next < trace.size() && seconds(now - t0) >= trace[next].arrival_s) {
      const TraceRequest& t = trace[next];
      engine::Request q;
      q.prompt_ids = t.prompt;
      if (with_lora && t.adapter >= 0) q.adapter = adapters[static_cast<size_t>(t.adapter)];
      q.options.max_tokens = t.output_len;
      q.options.temperature = 0.0f;
      q.options.ignore_eos = true;
      Active a;
      a.index = next;
      a.submitted = Clock::now();
      a.handle = engine.submit(std::move(q));
      active.push_back(std::move(a));
      r.input_tokens += static_cast<int64_t>(t.prompt.size());
      ++next;
    }
    bool any = false;
    for (size_t i = 0; i < active.size();) {
      Active& a = active[i];
      const engine::RequestOutput o = a.handle.next(std::chrono::milliseconds(0));
      now = Clock::now();
      if (!o.token_ids.empty()) {
        any = true;
        if (!a.got_first) {
          a.got_first = true;
          const double ttft = seconds(now - a.submitted);
          r.ttft.push_back(ttft);
          const int adapter = with_lora ? trace[a.index].adapter : -1;
          if (r.first_token_wait.count(adapter) == 0) r.first_token_wait[adapter] = ttft;
        } else {
          r.itl.push_back(seconds(now - a.last));
        }
        a.last = now;
      }
      if (!o.finished) {
        ++i;
        continue;
      }
      any = true;
      ++done;
      if (o.finish_reason == engine::FinishReason::kError) {
        ++r.failed;
        std::fprintf(stderr, "\nrequest %zu failed: %s\n", a.index, o.error.c_str());
      } else {
        ++r.completed;
        r.output_tokens += o.completion_tokens;
        r.e2e.push_back(seconds(now - a.submitted));
        r.queue.push_back(o.queue_time_s);
      }
      active[i] = std::move(active.back());
      active.pop_back();
    }
    if (progress && seconds(now - last_progress) >= 0.5) {
      last_progress = now;
      const engine::EngineMetrics m = engine.metrics();
      std::fprintf(stderr, "\r  %-5s %6zu/%zu done  %4lld running  %5lld waiting  %7.1f s",
                   label.c_str(), done, trace.size(), static_cast<long long>(m.num_running),
                   static_cast<long long>(m.num_waiting), seconds(now - t0));
      std::fflush(stderr);
    }
    if (!any) {
      // Nothing new: wait a little, or until the next arrival.
      wait_for_arrival(t0, trace, next, std::chrono::microseconds(200));
    }
  }
  r.duration_s = seconds(Clock::now() - t0);
  if (progress)
    std::fprintf(stderr, "\r  %-5s %6zu/%zu done in %.1f s%40s\n", label.c_str(), done,
                 trace.size(), r.duration_s, "");
  r.after = engine.metrics();
  return r;
}

ordered_json summary(const std::vector<double>& v, double scale) {
  ordered_json j;
  j["mean"] =
      v.empty() ? 0.0
                : scale * std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
  j["p50"] = scale * percentile(v, 50);
  j["p90"] = scale * percentile(v, 90);
  j["p99"] = scale * percentile(v, 99);
  j["max"] = v.empty() ? 0.0 : scale * *std::max_element(v.begin(), v.end());
  return j;
}

// Queueing time and the engine's counters over the run (in process only).
void add_engine_counters(const RunResult& r, ordered_json& j) {
  const engine::EngineMetrics& a = r.after;
  const engine::EngineMetrics& b = r.before;
  const int64_t steps = a.steps_total - b.steps_total;
  const int64_t queries = a.prefix_cache_queries_total - b.prefix_cache_queries_total;
  const int64_t hits = a.prefix_cache_hits_total - b.prefix_cache_hits_total;
  j["queue_ms"] = summary(r.queue, 1e3);
  j["steps"] = steps;
  j["seqs_per_step"] =
      steps > 0 ? static_cast<double>(a.step_seqs_total - b.step_seqs_total) / steps : 0.0;
  j["adapters_per_step"] =
      steps > 0 ? static_cast<double>(a.step_adapters_total - b.step_adapters_total) / steps : 0.0;
  // The most adapters in one step of this run: the highest bucket that counted a step.
  int64_t max_adapters = 0;
  const auto& ha = a.adapters_per_step;
  const auto& hb = b.adapters_per_step;
  for (size_t i = 0; i < ha.counts.size(); ++i) {
    const int64_t below = i == 0 ? 0 : (ha.counts[i - 1] - hb.counts[i - 1]);
    if (ha.counts[i] - hb.counts[i] > below) max_adapters = static_cast<int64_t>(ha.bounds[i]);
  }
  j["max_adapters_per_step"] = max_adapters;
  j["preemptions"] = a.preemptions_total - b.preemptions_total;
  j["lora_evictions"] = a.lora_evictions_total - b.lora_evictions_total;
  j["prefix_cache_queries"] = queries;
  j["prefix_cache_hits"] = hits;
  j["prefix_cache_hit_rate"] = queries > 0 ? static_cast<double>(hits) / queries : 0.0;
}

ordered_json result_json(const RunResult& r) {
  ordered_json j;
  j["duration_s"] = r.duration_s;
  j["completed"] = r.completed;
  j["failed"] = r.failed;
  j["input_tokens"] = r.input_tokens;
  j["output_tokens"] = r.output_tokens;
  j["request_throughput"] = static_cast<double>(r.completed) / r.duration_s;
  j["output_throughput"] = static_cast<double>(r.output_tokens) / r.duration_s;
  j["total_token_throughput"] =
      static_cast<double>(r.input_tokens + r.output_tokens) / r.duration_s;
  j["ttft_ms"] = summary(r.ttft, 1e3);
  j["itl_ms"] = summary(r.itl, 1e3);
  j["e2e_s"] = summary(r.e2e, 1.0);
  if (!r.over_http) add_engine_counters(r, j);
  std::vector<double> waits;
  for (const auto& [adapter, w] : r.first_token_wait)
    if (adapter >= 0) waits.push_back(w);
  if (!waits.empty()) {
    ordered_json f;
    f["adapters"] = waits.size();
    f["median_s"] = percentile(waits, 50);
    f["max_s"] = *std::max_element(waits.begin(), waits.end());
    f["max_over_median"] = f["median_s"].get<double>() > 0
                               ? f["max_s"].get<double>() / f["median_s"].get<double>()
                               : 0.0;
    j["adapter_first_token_wait"] = f;
  }
  return j;
}

void print_table(const std::vector<std::pair<std::string, ordered_json>>& runs) {
  std::printf("%-28s", "");
  for (const auto& [label, j] : runs) std::printf("%14s", label.c_str());
  std::printf("\n");
  const auto row = [&](const char* name, const std::function<std::string(const ordered_json&)>& f) {
    std::printf("%-28s", name);
    for (const auto& [label, j] : runs) std::printf("%14s", f(j).c_str());
    std::printf("\n");
  };
  const auto num = [](const char* key, const char* f) {
    return [key, f](const ordered_json& j) { return fmt(f, j.at(key).get<double>()); };
  };
  const auto pct = [](const char* key, const char* p) {
    return [key, p](const ordered_json& j) { return fmt("%.2f", j.at(key).at(p).get<double>()); };
  };
  row("completed / failed", [](const ordered_json& j) {
    return std::to_string(j.at("completed").get<int64_t>()) + " / " +
           std::to_string(j.at("failed").get<int64_t>());
  });
  row("duration (s)", num("duration_s", "%.2f"));
  row("requests/s", num("request_throughput", "%.2f"));
  row("output tokens/s", num("output_throughput", "%.1f"));
  row("total tokens/s", num("total_token_throughput", "%.1f"));
  for (const char* p : {"p50", "p90", "p99"}) {
    row((std::string("TTFT ") + p + " (ms)").c_str(), pct("ttft_ms", p));
  }
  for (const char* p : {"p50", "p90", "p99"}) {
    row((std::string("ITL ") + p + " (ms)").c_str(), pct("itl_ms", p));
  }
  row("e2e p50 (s)",
      [](const ordered_json& j) { return fmt("%.3f", j.at("e2e_s").at("p50").get<double>()); });
  row("e2e p99 (s)",
      [](const ordered_json& j) { return fmt("%.3f", j.at("e2e_s").at("p99").get<double>()); });
  if (!runs.front().second.contains("steps")) return;  // over HTTP: no engine counters
  for (const char* p : {"p50", "p90", "p99"}) {
    row((std::string("queueing ") + p + " (ms)").c_str(), pct("queue_ms", p));
  }
  row("steps", [](const ordered_json& j) { return std::to_string(j.at("steps").get<int64_t>()); });
  row("sequences per step", num("seqs_per_step", "%.1f"));
  row("adapters per step (mean)", num("adapters_per_step", "%.2f"));
  row("adapters per step (max)", [](const ordered_json& j) {
    return std::to_string(j.at("max_adapters_per_step").get<int64_t>());
  });
  row("preemptions",
      [](const ordered_json& j) { return std::to_string(j.at("preemptions").get<int64_t>()); });
  row("adapter evictions",
      [](const ordered_json& j) { return std::to_string(j.at("lora_evictions").get<int64_t>()); });
  row("prefix-cache hit rate", num("prefix_cache_hit_rate", "%.3f"));
}

// The trace both modes play: the same options and seed give the same requests.
std::vector<TraceRequest> make_serve_trace(const ServeArgs& a, const LengthSpec& prompt_len,
                                           const LengthSpec& output_len, int num_adapters,
                                           int32_t vocab_size) {
  TraceOptions t;
  t.num_requests = a.num_requests;
  t.rate = a.rate;
  t.prompt_len = prompt_len;
  t.output_len = output_len;
  t.num_adapters = num_adapters;
  t.zipf = a.adapter_dist == "zipf";
  t.zipf_s = a.zipf_s;
  t.vocab_size = vocab_size;
  t.shared_prefix = a.shared_prefix;
  t.seed = a.seed;
  return make_trace(t);
}

// The trace's options in the report's config section.
void trace_config(const ServeArgs& a, const LengthSpec& prompt_len, const LengthSpec& output_len,
                  ordered_json& c) {
  c["num_requests"] = a.num_requests;
  c["rate"] = std::isinf(a.rate) || a.rate <= 0.0 ? ordered_json("inf") : ordered_json(a.rate);
  c["prompt_len"] = prompt_len.str();
  c["output_len"] = output_len.str();
  c["adapter_dist"] = a.adapter_dist;
  c["zipf_s"] = a.zipf_s;
  c["shared_prefix"] = a.shared_prefix;
  c["seed"] = a.seed;
}

std::string rate_text(const ServeArgs& a) {
  return std::isinf(a.rate) || a.rate <= 0.0 ? "all at once" : fmt("Poisson %.2f req/s", a.rate);
}

// Puts the runs beside the configuration, prints the table and writes --json.
void report(const ordered_json& config,
            const std::vector<std::pair<std::string, ordered_json>>& runs,
            const std::string& json_path) {
  ordered_json doc;
  doc["config"] = config;
  for (const auto& [label, j] : runs) doc[label] = j;
  if (runs.size() == 2) {
    const ordered_json& l = runs[0].second;
    const ordered_json& b = runs[1].second;
    ordered_json cmp;
    cmp["throughput_ratio"] = l["output_throughput"].get<double>() /
                              std::max(b["output_throughput"].get<double>(), 1e-12);
    cmp["ttft_p99_ratio"] =
        l["ttft_ms"]["p99"].get<double>() / std::max(b["ttft_ms"]["p99"].get<double>(), 1e-12);
    doc["lora_vs_base"] = cmp;
  }
  print_table(runs);
  if (doc.contains("lora_vs_base")) {
    std::printf("lora / base: output throughput x%.3f, p99 TTFT x%.3f\n",
                doc["lora_vs_base"]["throughput_ratio"].get<double>(),
                doc["lora_vs_base"]["ttft_p99_ratio"].get<double>());
  }
  if (doc.contains("lora") && doc["lora"].contains("adapter_first_token_wait")) {
    const ordered_json& f = doc["lora"]["adapter_first_token_wait"];
    std::printf("first token per adapter (%zu adapters): median %.3f s, max %.3f s (x%.2f)\n",
                f["adapters"].get<size_t>(), f["median_s"].get<double>(), f["max_s"].get<double>(),
                f["max_over_median"].get<double>());
  }
  if (!json_path.empty()) {
    std::ofstream out(json_path);
    LORAPLEX_CHECK(out.good(), json_path, ": cannot open for writing");
    out << doc.dump(2) << "\n";
    LORAPLEX_CHECK(out.good(), json_path, ": write failed");
  }
}

#if LORAPLEX_WITH_HTTP_CLIENT
// One HTTP run in the in-process run's terms. A request's TTFT and latencies count only when it
// completed; the first failures are printed.
RunResult http_run_result(const HttpTraceResult& h, const std::vector<TraceRequest>& trace,
                          bool with_lora, const std::string& label) {
  RunResult r;
  r.label = label;
  r.over_http = true;
  r.duration_s = h.duration_s;
  std::map<int, double> first_at;  // adapter -> when its first token came
  for (size_t i = 0; i < trace.size(); ++i) {
    const HttpRequestResult& q = h.requests[i];
    r.input_tokens += static_cast<int64_t>(trace[i].prompt.size());
    if (!q.ok) {
      if (r.failed++ < 5) std::fprintf(stderr, "request %zu failed: %s\n", i, q.error.c_str());
      continue;
    }
    ++r.completed;
    r.output_tokens += q.completion_tokens;
    r.ttft.push_back(q.ttft_s);
    r.itl.insert(r.itl.end(), q.itl_s.begin(), q.itl_s.end());
    r.e2e.push_back(q.e2e_s);
    const int adapter = with_lora ? trace[i].adapter : -1;
    const auto it = first_at.find(adapter);
    if (q.first_token_s >= 0 && (it == first_at.end() || q.first_token_s < it->second)) {
      first_at[adapter] = q.first_token_s;
      r.first_token_wait[adapter] = q.ttft_s;
    }
  }
  if (r.failed > 5)
    std::fprintf(stderr, "... %lld requests failed in all\n", static_cast<long long>(r.failed));
  return r;
}

// --server: the trace against a running server; no model is loaded.
int run_over_http(const ServeArgs& a, const LengthSpec& prompt_len, const LengthSpec& output_len) {
  namespace fs = std::filesystem;
  LORAPLEX_CHECK(a.shape.empty(), "--server and --shape exclude each other");
  LORAPLEX_CHECK(a.model_dir.empty() || a.vocab_size == 0,
                 "--server: give --model DIR or --vocab-size N, not both");
  const HttpTarget target{a.server, a.api_key, a.request_timeout};
  std::vector<std::string> adapters;
  for (const auto& [name, dir] : adapter_dirs(a)) adapters.push_back(name);
  // The prompts' token ids are drawn below the vocabulary size, as in process.
  int32_t vocab = static_cast<int32_t>(a.vocab_size);
  if (!a.model_dir.empty()) {
    const fs::path dir(a.model_dir);
    vocab = static_cast<int32_t>(
        model::ModelConfig::from_file((dir / "config.json").string()).vocab_size);
    if (fs::exists(dir / "tokenizer.json"))
      vocab = std::min(vocab, engine::read_tokenizer(a.model_dir)->vocab_size());
  }
  LORAPLEX_CHECK(vocab > 0,
                 "--server needs the vocabulary size for the prompts' token ids: --model DIR (its "
                 "config.json and tokenizer.json are read, no weights) or --vocab-size N");

  const ServerModels listed = list_server_models(target);
  const std::string base = a.served_model_name.empty() ? listed.base : a.served_model_name;
  LORAPLEX_CHECK(!base.empty(), "--server ", a.server,
                 ": GET /v1/models lists no base model (give --served-model-name)");
  for (const std::string& name : adapters) {
    if (std::find(listed.adapters.begin(), listed.adapters.end(), name) == listed.adapters.end())
      std::fprintf(stderr, "note: adapter '%s' is not listed at /v1/models yet\n", name.c_str());
  }
  const std::vector<TraceRequest> trace =
      make_serve_trace(a, prompt_len, output_len, static_cast<int>(adapters.size()), vocab);

  const auto play = [&](const std::vector<TraceRequest>& t, bool with_lora,
                        const std::string& label, bool progress) {
    std::vector<std::string> models;
    for (const TraceRequest& q : t)
      models.push_back(with_lora && q.adapter >= 0 ? adapters[static_cast<size_t>(q.adapter)]
                                                   : base);
    const std::function<void(size_t, size_t, double)> show = [&](size_t done, size_t sent,
                                                                 double s) {
      std::fprintf(stderr, "\r  %-5s %6zu/%zu done  %4zu in flight  %7.1f s", label.c_str(), done,
                   t.size(), sent - done, s);
      std::fflush(stderr);
    };
    const HttpTraceResult h = play_trace_http(target, t, models, progress ? show : nullptr);
    if (progress)
      std::fprintf(stderr, "\r  %-5s %6zu/%zu done in %.1f s%40s\n", label.c_str(), t.size(),
                   t.size(), h.duration_s, "");
    return h;
  };
  // Warm-up (not measured), as in process; a server that fails all of it stops the benchmark.
  {
    std::vector<TraceRequest> warm(trace.begin(),
                                   trace.begin() + std::min<int64_t>(4, a.num_requests));
    for (TraceRequest& w : warm) {
      w.arrival_s = 0.0;
      w.output_len = std::min<int64_t>(w.output_len, 4);
    }
    const HttpTraceResult h = play(warm, true, "warm", false);
    const auto ok = [](const HttpRequestResult& q) { return q.ok; };
    LORAPLEX_CHECK(std::any_of(h.requests.begin(), h.requests.end(), ok), "--server ", a.server,
                   ": every warm-up request failed: ", h.requests.front().error);
  }
  const bool progress = !a.no_progress;
  std::vector<std::pair<std::string, ordered_json>> runs;
  if (!adapters.empty()) {
    runs.emplace_back("lora", result_json(http_run_result(play(trace, true, "lora", progress),
                                                          trace, true, "lora")));
  }
  if (adapters.empty() || !a.no_base) {
    runs.emplace_back("base", result_json(http_run_result(play(trace, false, "base", progress),
                                                          trace, false, "base")));
  }

  ordered_json c;
  c["transport"] = "http";
  c["server"] = a.server;
  c["model"] = base;
  c["commit"] = env_commit();
  c["date"] = iso_date();
  c["adapters"] = adapters.size();
  c["adapter_names"] = adapters;
  trace_config(a, prompt_len, output_len, c);
  c["vocab_size"] = vocab;
  std::printf(
      "loraplex bench serve over HTTP (%s): %lld requests, %s, prompts %s, outputs %s tokens, "
      "%zu adapters (%s), model %s\n",
      a.server.c_str(), static_cast<long long>(a.num_requests), rate_text(a).c_str(),
      prompt_len.str().c_str(), output_len.str().c_str(), adapters.size(), a.adapter_dist.c_str(),
      base.c_str());
  report(c, runs, a.json_path);
  return 0;
}
#endif

const char* kHelpIntro =
    "Plays a seeded trace of requests against the engine, in process: Poisson arrivals at "
    "--rate (or all at once), prompt and output lengths fixed (N), uniform (A-B) or "
    "exponential (exp:MEAN), each request's adapter drawn uniform or zipf from the pool; then "
    "the same trace without LoRA. Reports throughput, TTFT, inter-token latency, queueing "
    "time (p50/p90/p99), steps, adapters per step, preemptions, adapter evictions and the "
    "prefix-cache hit rate; "
    "--json writes them all.\n\n"
    "With --server URL the same trace goes to a running server (loraplex serve, or vLLM) over "
    "HTTP instead, and no model is loaded: each request is a streamed POST /v1/completions "
    "(prompt as token ids, temperature 0, ignore_eos) sent at its arrival time on its own "
    "connection; --lora NAME (or NAME=DIR, the DIR unused) names the pool's adapters as the "
    "server knows them, the base model's name comes from GET /v1/models or "
    "--served-model-name, and the token ids are drawn below the vocabulary size of --model "
    "DIR (config.json and tokenizer.json only) or --vocab-size. TTFT is send to the first chunk "
    "that carries a token, ITL the gap between such chunks (one per chunk, as in process one "
    "per poll), output tokens the final usage; the engine's counters (queueing, steps, "
    "preemptions, prefix cache) are not reported.";

int run(const std::vector<std::string>& args) {
  ServeArgs a;
  CLI::App app{kHelpIntro, "loraplex bench serve"};
  app.option_defaults()->always_capture_default();
  app.add_option("--model", a.model_dir,
                 "checkpoint directory (config.json, weights, "
                 "tokenizer.json)");
  app.add_option("--shape", a.shape,
                 "random weights of a named shape instead of --model: llama3-8b, llama3-70b, "
                 "mistral-7b, qwen2-7b, mixtral-8x7b, qwen3-8b, qwen3-30b-a3b, tiny");
  app.add_option("--layers", a.layers, "--shape: keep this many decoder layers (0 = all)");
  app.add_option("--adapters", a.random_adapters, "--shape: random PEFT adapters in the pool");
  app.add_option("--rank", a.random_rank, "--shape: their rank (all linear layers)");
  app.add_option("--adapter-cache", a.adapter_cache, "--shape: where the random adapters go");
  app.add_option("--lora", a.loras,
                 "a PEFT adapter of the pool (repeatable); with --server NAME alone is enough")
      ->type_name("NAME=DIR")
      ->expected(1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app.add_option("--lora-dir", a.lora_dir,
                 "every subdirectory with an adapter_config.json joins the pool, by its name");
  app.add_option("--num-requests", a.num_requests, "requests in the trace")
      ->check(CLI::PositiveNumber);
  // CLI::NonNegativeNumber stops below the largest double, so "inf" needs its own check.
  app.add_option("--rate", a.rate, "Poisson arrival rate in requests/s; 0 or inf: all at once")
      ->check(CLI::Validator(
          [](std::string& text) {
            const double v = std::strtod(text.c_str(), nullptr);
            return v >= 0.0 ? std::string() : "must be >= 0 (or inf)";
          },
          "RATE"));
  app.add_option("--prompt-len", a.prompt_len, "prompt tokens: N, A-B or exp:MEAN");
  app.add_option("--output-len", a.output_len, "generated tokens: N, A-B or exp:MEAN");
  app.add_option("--adapter-dist", a.adapter_dist, "how requests pick adapters")
      ->check(CLI::IsMember({"uniform", "zipf"}));
  app.add_option("--zipf-s", a.zipf_s, "zipf exponent: the k-th adapter ~ 1/k^s")
      ->check(CLI::PositiveNumber);
  app.add_option("--shared-prefix", a.shared_prefix,
                 "tokens every prompt starts with (for the prefix cache)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--no-base-run", a.no_base, "skip the run of the same trace without LoRA");
  app.add_flag("--no-progress", a.no_progress, "no progress line on standard error");
  app.add_option("--json", a.json_path, "write the results as JSON");
  app.add_option("--device", a.device, "cpu or cuda[:N] (default: cuda when present)");
  app.add_option("--dtype", a.dtype,
                 "float32, bfloat16 or float16 (default: bfloat16 on "
                 "CUDA, float32 on the CPU)");
  app.add_option("--seed", a.seed, "trace seed");
  app.add_option("--max-num-seqs", a.max_num_seqs, "sequences in one step")
      ->check(CLI::PositiveNumber);
  app.add_option("--max-num-batched-tokens", a.max_num_batched_tokens, "tokens in one step")
      ->check(CLI::PositiveNumber);
  app.add_option("--max-loras", a.max_loras, "adapters in one step (default: pool size, <= 32)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--max-lora-rank", a.max_lora_rank, "default: the largest adapter rank")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--max-cpu-loras", a.max_cpu_loras, "adapters in host memory (default: all)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--num-kv-blocks", a.num_kv_blocks,
                 "KV-cache blocks (default: from --gpu-memory-utilization on CUDA; on the CPU, "
                 "enough for max-num-seqs of the longest requests)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--gpu-memory-utilization", a.gpu_memory_utilization,
                 "fraction of the GPU the engine may fill");
  app.add_option("--kv-block-size", a.kv_block_size, "tokens per KV block")
      ->check(CLI::PositiveNumber);
  app.add_option("--max-model-len", a.max_model_len, "default: the model's positions");
  app.add_flag("--no-prefix-caching", a.no_prefix_caching, "disable the prefix cache");
  app.add_flag("--no-async-scheduling", a.no_async_scheduling,
               "collect every step before planning the next (EngineOptions::async_scheduling off)");
  app.add_option("--lora-drain-after", a.lora_drain_after,
                 "seconds an adapter waits for a slot before a busy one is evicted for it (or, "
                 "with eviction off, drained); negative = never");
  app.add_option("--lora-evict-after", a.lora_evict_after,
                 "seconds a new request waits for a slot before a busy adapter is evicted for it "
                 "(its sequences preempted); negative = never");
  app.add_option("--tensor-parallel-size", a.tensor_parallel_size,
                 "-tp: GPUs the model is sharded over, from --device on (CPU: threads)")
      ->check(CLI::PositiveNumber);
  app.add_flag("--fully-sharded-loras", a.fully_sharded_loras,
               "shard the adapters like the layers they modify (LoRA-A by rank too)");

  app.add_option("--server", a.server,
                 "http://HOST:PORT of a running server: measure it over HTTP (no model loaded)");
  app.add_option("--api-key", a.api_key, "--server: sent as Authorization: Bearer KEY");
  app.add_option("--served-model-name", a.served_model_name,
                 "--server: the base model's name (default: from GET /v1/models)");
  app.add_option("--vocab-size", a.vocab_size,
                 "--server without --model: prompt token ids are drawn below this")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--request-timeout", a.request_timeout,
                 "--server: seconds a request may wait for its next bytes before it fails")
      ->check(CLI::PositiveNumber);

  if (!parse_cli(app, args)) return 0;

  const LengthSpec prompt_len = LengthSpec::parse("--prompt-len", a.prompt_len);
  const LengthSpec output_len = LengthSpec::parse("--output-len", a.output_len);
  LORAPLEX_CHECK(
      a.shared_prefix < prompt_len.lo || prompt_len.kind == LengthSpec::Kind::kExponential,
      "--shared-prefix ", a.shared_prefix, " must be shorter than the shortest prompt (",
      prompt_len.lo, ")");
  if (!a.server.empty()) {
#if LORAPLEX_WITH_HTTP_CLIENT
    return run_over_http(a, prompt_len, output_len);
#else
    LORAPLEX_FAIL(
        "--server: this build has no HTTP client (cpp-httplib was not found when it was "
        "configured; install libcpp-httplib-dev and build again)");
#endif
  }
  const Device device = a.device.empty()
                            ? (cuda_device_count() > 0 ? Device::cuda(0) : Device::cpu())
                            : Device::parse(a.device);
  LORAPLEX_CHECK(device.is_cpu() || cuda_device_count() > device.index, "--device ", device.str(),
                 ": no such CUDA device (", cuda_device_count(), " present)");
  const DType dtype =
      a.dtype.empty() ? (device.is_cuda() ? DType::kBF16 : DType::kF32) : dtype_from_name(a.dtype);

  engine::EngineOptions o;
  o.max_num_seqs = a.max_num_seqs;
  o.max_num_batched_tokens = a.max_num_batched_tokens;
  o.max_loras = a.max_loras;
  o.max_lora_rank = a.max_lora_rank;
  o.max_cpu_loras = a.max_cpu_loras;
  o.gpu_memory_utilization = a.gpu_memory_utilization;
  o.num_kv_blocks = a.num_kv_blocks;
  o.kv_block_size = a.kv_block_size;
  o.max_model_len = a.max_model_len;
  o.enable_prefix_caching = !a.no_prefix_caching;
  o.async_scheduling = !a.no_async_scheduling;
  o.lora_drain_after_s = a.lora_drain_after;
  o.lora_evict_after_s = a.lora_evict_after;
  o.seed = a.seed;
  o.tensor_parallel_size = a.tensor_parallel_size;
  o.fully_sharded_loras = a.fully_sharded_loras;
  const int64_t longest = prompt_len.max() + output_len.max();
  if (device.is_cpu() && o.num_kv_blocks == 0) {
    o.num_kv_blocks =
        std::max<int64_t>(1, a.max_num_seqs * ((longest + o.kv_block_size - 1) / o.kv_block_size));
  }

  const auto load_start = Clock::now();
  ServePool pool = make_serve_pool(a, o, dtype, device);
  const model::ModelConfig config = pool.decoder->config();
  const int64_t max_len = o.max_model_len > 0 ? o.max_model_len : config.max_position_embeddings;
  LORAPLEX_CHECK(longest <= max_len, "the longest request (", prompt_len.max(), " prompt + ",
                 output_len.max(), " output tokens) exceeds max_model_len ", max_len);
  engine::Engine engine(std::move(pool.decoder), pool.tokenizer, pool.eos_token_ids, o);
  pool.load_adapters(engine);
  const double load_s = std::chrono::duration<double>(Clock::now() - load_start).count();

  int32_t vocab_size = static_cast<int32_t>(config.vocab_size);
  if (pool.tokenizer != nullptr) vocab_size = std::min(vocab_size, pool.tokenizer->vocab_size());
  const std::vector<TraceRequest> trace = make_serve_trace(
      a, prompt_len, output_len, static_cast<int>(pool.adapter_names.size()), vocab_size);

  const bool progress = !a.no_progress;
  // Warm-up (not measured): a few requests through every path once.
  {
    std::vector<TraceRequest> warm(trace.begin(),
                                   trace.begin() + std::min<int64_t>(4, a.num_requests));
    for (TraceRequest& w : warm) {
      w.arrival_s = 0.0;
      w.output_len = std::min<int64_t>(w.output_len, 4);
    }
    run_trace(engine, warm, pool.adapter_names, true, "warm", false);
  }
  std::vector<std::pair<std::string, ordered_json>> runs;
  const bool has_lora = !pool.adapter_names.empty();
  if (has_lora) {
    runs.emplace_back(
        "lora", result_json(run_trace(engine, trace, pool.adapter_names, true, "lora", progress)));
  }
  if (!has_lora || !a.no_base) {
    runs.emplace_back(
        "base", result_json(run_trace(engine, trace, pool.adapter_names, false, "base", progress)));
  }

  // Built apart and then put in: ordered_json keeps its members in a vector, so references
  // into it do not survive insertions.
  ordered_json c;
  c["transport"] = "in-process";
  c["model"] = pool.description;
  c["device"] = device.str();
  c["device_name"] = device.is_cuda() ? kernels::cuda::device_info(device.index).name : "cpu";
  c["commit"] = env_commit();
  c["date"] = iso_date();
  c["dtype"] = std::string(dtype_name(dtype));
  c["adapters"] = pool.adapter_names.size();
  c["adapter_names"] = pool.adapter_names;
  trace_config(a, prompt_len, output_len, c);
  c["vocab_size"] = vocab_size;
  c["max_num_seqs"] = o.max_num_seqs;
  c["max_num_batched_tokens"] = o.max_num_batched_tokens;
  c["max_loras"] = o.max_loras;
  c["max_lora_rank"] = o.max_lora_rank;
  c["max_cpu_loras"] = o.max_cpu_loras;
  c["num_kv_blocks"] = engine.metrics().num_kv_blocks;
  c["kv_block_size"] = o.kv_block_size;
  c["prefix_caching"] = o.enable_prefix_caching;
  c["async_scheduling"] = o.async_scheduling;
  c["lora_drain_after_s"] = o.lora_drain_after_s;
  c["lora_evict_after_s"] = o.lora_evict_after_s;
  c["tensor_parallel_size"] = o.tensor_parallel_size;
  c["fully_sharded_loras"] = o.fully_sharded_loras;
  c["load_s"] = load_s;
  std::printf(
      "loraplex bench serve: %lld requests, %s, prompts %s, outputs %s tokens, %zu "
      "adapters (%s), max_loras %d, %s %s\n",
      static_cast<long long>(a.num_requests), rate_text(a).c_str(), prompt_len.str().c_str(),
      output_len.str().c_str(), pool.adapter_names.size(), a.adapter_dist.c_str(), o.max_loras,
      device.str().c_str(), std::string(dtype_name(dtype)).c_str());
  report(c, runs, a.json_path);
  return 0;
}

}  // namespace

extern const Command kBenchServeCommand = {
    "bench serve",
    "the online benchmark: a request trace against the engine, with and without LoRA", run};

}  // namespace loraplex::cli
