#include "loraplex/server/serve_run.h"

#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "loraplex/adapters/peft_adapter.h"
#include "loraplex/adapters/peft_config.h"
#include "loraplex/core/device.h"
#include "loraplex/core/dtype.h"
#include "loraplex/core/error.h"
#include "loraplex/engine/engine.h"
#include "loraplex/engine/model_files.h"
#include "loraplex/model/load_model.h"
#include "loraplex/model/model_shapes.h"
#include "loraplex/server/engine_backend.h"
#include "loraplex/server/http_server.h"
#include "loraplex/server/openai_service.h"
#include "loraplex/template/chat_template.h"

#ifndef LORAPLEX_VERSION
#define LORAPLEX_VERSION "unknown"
#endif

namespace loraplex::server {
namespace {

namespace fs = std::filesystem;

// On the CPU the KV cache has no device memory to measure: without --num-kv-blocks it gets
// what max_num_seqs sequences of max_model_len need, within this many bytes.
constexpr int64_t kCpuKvCacheBytes = int64_t{1} << 30;

Device resolve_device(const std::string& name) {
  if (name == "auto") return cuda_device_count() > 0 ? Device::cuda(0) : Device::cpu();
  Device d;
  try {
    d = Device::parse(name);
  } catch (const Error& e) {
    LORAPLEX_FAIL("--device ", name, ": ", e.what());
  }
  LORAPLEX_CHECK(d.is_cpu() || cuda_device_count() > d.index, "--device ", name,
                 ": no such CUDA device (", cuda_device_count(), " present",
                 built_with_cuda() ? "" : "; this build has no CUDA backend", ")");
  return d;
}

DType resolve_dtype(const std::string& name, Device device) {
  if (name == "auto") return device.is_cuda() ? DType::kBF16 : DType::kF32;
  try {
    return dtype_from_name(name);
  } catch (const Error& e) {
    LORAPLEX_FAIL("--dtype ", name, ": ", e.what());
  }
}

// --chat-template FILE; else the model directory's chat_template.jinja (where newer
// transformers save it); else tokenizer_config.json's chat_template; else none (chat requests
// are refused with a message saying so). A template outside the supported subset fails here,
// at start-up, with its line and column.
std::shared_ptr<const jinja::ChatTemplate> load_chat_template(const ServeOptions& o,
                                                              std::FILE* log) {
  const fs::path model(o.model_dir);
  const std::string tokenizer_config = (model / "tokenizer_config.json").string();
  if (!o.chat_template.empty()) {
    return std::make_shared<const jinja::ChatTemplate>(
        jinja::ChatTemplate::from_file(o.chat_template, tokenizer_config));
  }
  const fs::path jinja_file = model / "chat_template.jinja";
  if (fs::exists(jinja_file)) {
    return std::make_shared<const jinja::ChatTemplate>(
        jinja::ChatTemplate::from_file(jinja_file.string(), tokenizer_config));
  }
  bool has_template = false;
  if (fs::exists(tokenizer_config)) {
    std::ifstream in(tokenizer_config, std::ios::binary);
    try {
      const nlohmann::json j = nlohmann::json::parse(in);
      has_template =
          j.is_object() && j.contains("chat_template") && !j.at("chat_template").is_null();
    } catch (const nlohmann::json::exception& e) {
      LORAPLEX_FAIL(tokenizer_config, ": not valid JSON: ", e.what());
    }
  }
  if (has_template) {
    return std::make_shared<const jinja::ChatTemplate>(
        jinja::ChatTemplate::from_tokenizer_config(tokenizer_config));
  }
  std::fprintf(log,
               "loraplex serve: %s has no chat template: /v1/chat/completions answers 400 (give "
               "one with --chat-template FILE)\n",
               o.model_dir.c_str());
  return nullptr;
}

// What the server needs to know of its model before the weights load: a checkpoint
// directory's config, tokenizer, EOS ids and chat template, or a named shape's config alone
// (--shape: random weights, no tokenizer, no chat template).
struct ModelSource {
  model::ModelConfig config;
  std::shared_ptr<const Tokenizer> tokenizer;
  std::vector<int32_t> eos;
  std::shared_ptr<const jinja::ChatTemplate> chat_template;
};

ModelSource read_model_source(const ServeOptions& o, std::FILE* log) {
  ModelSource s;
  if (!o.shape.empty()) {
    LORAPLEX_CHECK(o.chat_template.empty(), "--chat-template: a --shape model has no tokenizer");
    s.config = model::model_shape(o.shape, o.shape_layers);
    s.eos = s.config.eos_token_ids;
    std::fprintf(log,
                 "loraplex serve: --shape %s: random weights, no tokenizer (prompts are token "
                 "ids, no text comes back) and no chat template\n",
                 o.shape.c_str());
    return s;
  }
  const fs::path config_path = fs::path(o.model_dir) / "config.json";
  LORAPLEX_CHECK(fs::exists(config_path), o.model_dir, ": not a model directory (no config.json)");
  s.config = model::ModelConfig::from_file(config_path.string());
  s.tokenizer = engine::read_tokenizer(o.model_dir);
  s.eos = engine::read_eos_token_ids(o.model_dir, s.config);
  s.chat_template = load_chat_template(o, log);
  return s;
}

// Each --lora adapter's rank, from its config, read before the model loads so that a broken
// one fails fast.
std::vector<int> adapter_ranks(const ServeOptions& o) {
  std::vector<int> ranks;
  for (const auto& [name, dir] : o.loras) {
    LORAPLEX_CHECK(fs::is_directory(dir), "--lora ", name, "=", dir, ": not a directory");
    try {
      ranks.push_back(PeftLoraConfig::from_file(adapter_config_path(dir)).max_rank());
    } catch (const Error& e) {
      LORAPLEX_FAIL("--lora ", name, "=", dir, ": adapter '", name, "': ", e.what());
    }
  }
  return ranks;
}

// Each connection is a file descriptor. The soft limit (often 1,024) is raised to the hard one,
// and max_connections kept within it, with room for the model's files, the listening socket
// and the tokenizer's and loader's own.
void fit_connections_to_fd_limit(HttpOptions& http, std::FILE* log) {
  constexpr rlim_t kReserved = 256;
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return;
  const rlim_t wanted = static_cast<rlim_t>(http.max_connections) + kReserved;
  if (limit.rlim_cur < wanted && limit.rlim_cur < limit.rlim_max) {
    rlimit raised = limit;
    raised.rlim_cur = limit.rlim_max == RLIM_INFINITY ? wanted : std::min(wanted, limit.rlim_max);
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) limit = raised;
  }
  if (limit.rlim_cur != RLIM_INFINITY && limit.rlim_cur < wanted) {
    const size_t fits = limit.rlim_cur > 2 * kReserved ? limit.rlim_cur - kReserved : 1;
    std::fprintf(log,
                 "loraplex serve: max_connections %zu: the open-file limit is %llu (raise it, "
                 "e.g. LimitNOFILE= in systemd, for --max-connections %zu)\n",
                 fits, static_cast<unsigned long long>(limit.rlim_cur), http.max_connections);
    http.max_connections = fits;
  }
}

int64_t cpu_kv_blocks(const engine::EngineOptions& e, const model::ModelExecutor& decoder) {
  int64_t max_len = e.max_model_len > 0 ? e.max_model_len : decoder.options().max_model_len;
  if (max_len <= 0) max_len = decoder.config().max_position_embeddings;
  const int64_t per_seq = (max_len + e.kv_block_size - 1) / e.kv_block_size;
  const int64_t wanted = per_seq * e.max_num_seqs;
  const int64_t affordable = kCpuKvCacheBytes / std::max<int64_t>(1, decoder.kv_block_bytes());
  return std::max<int64_t>(1, std::min(wanted, affordable));
}

// SIGINT and SIGTERM, blocked in every thread and received by one that waits for them.
class StopSignals {
 public:
  StopSignals() {
    sigemptyset(&set_);
    sigaddset(&set_, SIGINT);
    sigaddset(&set_, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set_, &old_);
  }
  ~StopSignals() {
    // Signals that came after the first were consumed by nobody: drop them before the mask
    // is restored, or they would kill the process on its way out.
    const timespec zero{0, 0};
    while (sigtimedwait(&set_, nullptr, &zero) > 0) {
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  /// Waits up to `timeout` for one; returns it, or 0.
  int wait(std::chrono::milliseconds timeout) const {
    const auto s = std::chrono::duration_cast<std::chrono::seconds>(timeout);
    const timespec t{static_cast<time_t>(s.count()),
                     static_cast<long>((timeout - s).count()) * 1000000L};
    const int sig = sigtimedwait(&set_, nullptr, &t);
    return sig > 0 ? sig : 0;
  }

 private:
  sigset_t set_;
  sigset_t old_;
};

// The thread that acts on SIGINT/SIGTERM. During start-up (no server yet) there is nothing to
// finish: the process exits 0 at once rather than after a model load that may take a minute.
// Once serving, it stops the HTTP server, repeatedly until serve() has returned: httplib
// ignores a stop that comes before its accept loop runs.
class StopWatcher {
 public:
  StopWatcher(const StopSignals& signals, std::FILE* log)
      : thread_([this, &signals, log] { watch(signals, log); }) {}
  ~StopWatcher() { finish(); }
  StopWatcher(const StopWatcher&) = delete;
  StopWatcher& operator=(const StopWatcher&) = delete;

  /// From now on a signal stops `http` (which must outlive finish()).
  void serving(HttpServer* http) { http_ = http; }
  /// Ends the watch; call once serve() has returned.
  void finish() {
    finished_ = true;
    if (thread_.joinable()) thread_.join();
  }
  bool stopping() const { return stopping_; }

 private:
  void watch(const StopSignals& signals, std::FILE* log) {
    int sig = 0;
    while (!finished_ && sig == 0) sig = signals.wait(std::chrono::milliseconds(100));
    if (sig == 0) return;
    stopping_ = true;
    const char* name = sig == SIGINT ? "SIGINT" : "SIGTERM";
    if (http_ == nullptr) {
      std::fprintf(log, "loraplex serve: %s during start-up: exiting\n", name);
      std::fflush(log);
      std::_Exit(0);
    }
    std::fprintf(log, "loraplex serve: %s: stopping (requests in flight are aborted)\n", name);
    std::fflush(log);
    while (!finished_) {
      http_.load()->stop();
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }

  std::atomic<HttpServer*> http_{nullptr};
  std::atomic<bool> finished_{false};
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

// The start-up line that says what is served, where and how.
void log_ready(std::FILE* log, const ServeOptions& o, const engine::Engine& engine,
               const model::ModelConfig& config, DType dtype, const Device& device,
               const jinja::ChatTemplate* chat_template, double seconds) {
  const engine::EngineMetrics m = engine.metrics();
  std::string where = device.str();
  if (engine.options().tensor_parallel_size > 1) {
    where +=
        " (tensor-parallel size " + std::to_string(engine.options().tensor_parallel_size) + ")";
  }
  std::fprintf(log,
               "loraplex serve: %s (%s) on %s, %s: %lld KV blocks of %lld tokens, max_model_len "
               "%lld, %zu adapter(s) loaded, max_loras %d, max_lora_rank %d, runtime adapter "
               "loading %s, chat template: %s; ready in %.2f s\n",
               o.served_model_name.c_str(), model::architecture_name(config.arch), where.c_str(),
               std::string(dtype_name(dtype)).c_str(), static_cast<long long>(m.num_kv_blocks),
               static_cast<long long>(m.kv_block_size),
               static_cast<long long>(engine.options().max_model_len), o.loras.size(),
               engine.options().max_loras, engine.options().max_lora_rank,
               o.enable_lora_loading ? "on" : "off",
               chat_template ? chat_template->origin().c_str() : "none", seconds);
}

// The OpenAI service's configuration from the options.
ServiceConfig service_config(const ServeOptions& o,
                             const std::shared_ptr<const jinja::ChatTemplate>& chat_template,
                             std::FILE* log) {
  ServiceConfig sc;
  sc.served_model_name = o.served_model_name;
  sc.model_root = o.model_dir;
  sc.lora_dir = o.lora_dir;
  sc.runtime_lora_updating = o.enable_lora_loading;
  if (o.enable_lora_loading) {
    if (!o.lora_dir.empty()) sc.lora_roots.push_back(o.lora_dir);
    sc.lora_roots.insert(sc.lora_roots.end(), o.allowed_lora_paths.begin(),
                         o.allowed_lora_paths.end());
  }
  sc.log = [log](const std::string& line) {
    std::fprintf(log, "loraplex serve: %s\n", line.c_str());
    std::fflush(log);
  };
  sc.chat_template = chat_template;
  sc.version = LORAPLEX_VERSION;
  return sc;
}

}  // namespace

int run_serve(const ServeOptions& options_in, std::FILE* log) {
  ServeOptions o = options_in;  // settle_serve_options fills in the defaults the adapters decide
  const StopSignals signals;
  StopWatcher watcher(signals, log);
  const Device device = resolve_device(o.device);
  const DType dtype = resolve_dtype(o.dtype, device);

  // The quick checks first: a bad template, adapter config or address fails in milliseconds,
  // not after the weights have loaded.
  const ModelSource source = read_model_source(o, log);
  const model::ModelConfig& config = source.config;
  const std::shared_ptr<const Tokenizer>& tokenizer = source.tokenizer;
  const std::vector<int32_t>& eos = source.eos;
  const std::shared_ptr<const jinja::ChatTemplate>& chat_template = source.chat_template;
  for (const std::string& line : settle_serve_options(o, config, adapter_ranks(o))) {
    std::fprintf(log, "loraplex serve: %s\n", line.c_str());
  }
  check_can_listen(o.http.host, o.http.port);
  fit_connections_to_fd_limit(o.http, log);

  const auto t0 = std::chrono::steady_clock::now();
  engine::EngineOptions options = o.engine;
  const model::DecoderOptions decoder_options =
      engine::engine_decoder_options(options, dtype, device);
  std::unique_ptr<model::ModelExecutor> decoder =
      o.shape.empty() ? model::load_model(o.model_dir, decoder_options)
                      : model::create_random_model(config, decoder_options, /*seed=*/1);
  if (options.num_kv_blocks == 0 && device.is_cpu()) {
    options.num_kv_blocks = cpu_kv_blocks(options, *decoder);
  }
  engine::Engine engine(std::move(decoder), tokenizer, eos, options);
  for (const auto& [name, dir] : o.loras) {
    try {
      engine.load_adapter(name, dir);
    } catch (const Error& e) {
      LORAPLEX_FAIL("--lora ", name, "=", dir, ": ", e.what());
    }
  }
  const double load_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  log_ready(log, o, engine, config, dtype, device, chat_template.get(), load_seconds);

  EngineBackend backend(engine);
  const ServiceConfig sc = service_config(o, chat_template, log);
  OpenAIService service(backend, sc);
  HttpServer http(service, o.http);
  const int port = http.bind();
  watcher.serving(&http);
  std::fprintf(log, "loraplex serve: listening on http://%s:%d\n", o.http.host.c_str(), port);
  std::fflush(log);

  bool listened = false;
  try {
    listened = http.serve();
  } catch (...) {
    watcher.finish();
    throw;
  }
  watcher.finish();
  LORAPLEX_CHECK(listened || watcher.stopping(), "the HTTP server on ", o.http.host, ":", port,
                 " stopped accepting connections");
  std::fprintf(log, "loraplex serve: stopped\n");
  std::fflush(log);
  return 0;
}

}  // namespace loraplex::server
