#include "loraplex/engine/engine.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <unordered_map>

#include "loraplex/core/cuda_runtime.h"
#include "loraplex/core/error.h"
#include "loraplex/engine/block_manager.h"
#include "loraplex/engine/detokenizer.h"
#include "loraplex/engine/engine_metrics.h"
#include "loraplex/engine/launched_steps.h"
#include "loraplex/engine/logit_adjustments.h"
#include "loraplex/engine/manager_slots.h"
#include "loraplex/engine/request_checks.h"
#include "loraplex/engine/scheduler.h"
#include "loraplex/engine/structured_output.h"
#include "loraplex/model/sampler.h"
#include "loraplex/tokenizer/prompt_encoding.h"

namespace loraplex::engine {

const char* finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kAbort:
      return "abort";
    case FinishReason::kError:
      return "error";
    case FinishReason::kNone:
      break;
  }
  return "none";
}

model::DecoderOptions engine_decoder_options(const EngineOptions& options, DType dtype,
                                             Device device) {
  model::DecoderOptions d;
  d.dtype = dtype;
  d.device = device;
  d.max_loras = options.max_loras;
  d.max_lora_rank = options.max_lora_rank;
  d.max_num_tokens = options.max_num_batched_tokens;
  d.max_num_seqs = options.max_num_seqs;
  d.kv_blocks = 1;  // the Engine allocates the real cache
  d.kv_block_size = options.kv_block_size;
  d.max_model_len = options.max_model_len;
  d.tensor_parallel_size = options.tensor_parallel_size;
  d.fully_sharded_loras = options.fully_sharded_loras;
  d.lora_decode = options.lora_decode;
  d.lora_dtype = options.lora_dtype;
  return d;
}

// Internal types with names (not in an anonymous namespace): RequestHandle::State derives
// from one, and Engine::Impl holds the others.
namespace internal {

struct Inbox;

// A request's stream, shared by its handles and the step loop.
struct HandleState {
  uint64_t id = 0;
  std::vector<int32_t> prompt_ids;
  std::mutex mutex;
  std::condition_variable cv;
  // New tokens, text and logprobs since the last read; the counts and the end are current.
  RequestOutput pending;
  std::weak_ptr<Inbox> inbox;
};

struct AdapterEntry {
  enum class State { kLoading, kReady, kUnloading, kRemoving };
  State state = State::kLoading;
  uint64_t key = 0;       // names this load's weights in the prefix cache
  int64_t in_flight = 0;  // requests submitted and not finished
};

// One request on the step loop's side.
struct Record {
  std::shared_ptr<HandleState> handle;
  std::string adapter;
  RequestOptions options;
  model::SamplingParams sampling;
  std::mt19937_64 rng;
  std::vector<int32_t> banned;            // until min_tokens is reached
  LogitsProcessing processing;            // penalties, logit_bias, allowed ids, bad words
  std::unique_ptr<GrammarState> grammar;  // structured output
  std::unique_ptr<IncrementalDetokenizer> detok;
  int64_t prompt_len = 0;
  int64_t generated = 0;
  double arrival = 0.0;
  double first_scheduled = -1.0;
  double first_token = -1.0;
  double last_token = -1.0;
};

struct Pending {
  std::unique_ptr<Sequence> seq;
  Record record;
};

// What the submitting threads and the step loop share. Held only for short bookkeeping: the
// step loop never runs the model or reads the disk while holding it.
struct Inbox {
  std::mutex mutex;
  std::condition_variable cv;
  std::vector<Pending> incoming;
  std::vector<uint64_t> aborts;
  bool stop = false;
  std::map<std::string, AdapterEntry> adapters;
  std::condition_variable adapter_removed;  // an entry left `adapters`
  uint64_t next_id = 0;
  uint64_t next_adapter_key = 1;
};

}  // namespace internal

using internal::AdapterEntry;
using internal::Inbox;
using internal::Pending;
using internal::Record;

// ------------------------------------------------------------------------- RequestHandle

struct RequestHandle::State : internal::HandleState {};

uint64_t RequestHandle::id() const {
  LORAPLEX_CHECK(state_ != nullptr, "empty RequestHandle");
  return state_->id;
}

const std::vector<int32_t>& RequestHandle::prompt_ids() const {
  LORAPLEX_CHECK(state_ != nullptr, "empty RequestHandle");
  return state_->prompt_ids;
}

RequestOutput RequestHandle::next(std::chrono::milliseconds timeout) {
  LORAPLEX_CHECK(state_ != nullptr, "empty RequestHandle");
  State& s = *state_;
  std::unique_lock<std::mutex> lock(s.mutex);
  const auto has_news = [&] {
    return s.pending.finished || !s.pending.token_ids.empty() || !s.pending.text.empty();
  };
  // wait_for overflows the clock with milliseconds::max(); a day is "for ever" here.
  if (timeout >= std::chrono::hours(24)) {
    s.cv.wait(lock, has_news);
  } else {
    s.cv.wait_for(lock, timeout, has_news);
  }
  RequestOutput out = s.pending;
  s.pending.token_ids.clear();
  s.pending.text.clear();
  s.pending.logprobs.clear();
  s.pending.top_logprobs.clear();
  return out;
}

RequestOutput RequestHandle::wait() {
  RequestOutput all;
  for (;;) {
    RequestOutput o = next();
    all.token_ids.insert(all.token_ids.end(), o.token_ids.begin(), o.token_ids.end());
    all.text += o.text;
    all.logprobs.insert(all.logprobs.end(), o.logprobs.begin(), o.logprobs.end());
    all.top_logprobs.insert(all.top_logprobs.end(), o.top_logprobs.begin(), o.top_logprobs.end());
    all.finished = o.finished;
    all.finish_reason = o.finish_reason;
    all.stop_reason = o.stop_reason;
    all.error = o.error;
    all.prompt_tokens = o.prompt_tokens;
    all.completion_tokens = o.completion_tokens;
    all.cached_tokens = o.cached_tokens;
    all.queue_time_s = o.queue_time_s;
    if (o.finished) return all;
  }
}

void RequestHandle::abort() {
  if (state_ == nullptr) return;
  std::shared_ptr<Inbox> inbox;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (state_->pending.finished) return;
    state_->pending.finished = true;
    state_->pending.finish_reason = FinishReason::kAbort;
    inbox = state_->inbox.lock();
  }
  state_->cv.notify_all();
  if (inbox != nullptr) {
    {
      std::lock_guard<std::mutex> lock(inbox->mutex);
      inbox->aborts.push_back(state_->id);
    }
    inbox->cv.notify_all();
  }
}

// -------------------------------------------------------------------------------- Engine

struct Engine::Impl {
  EngineOptions options;
  std::unique_ptr<model::ModelExecutor> decoder;
  std::shared_ptr<const Tokenizer> tokenizer;
  std::vector<int32_t> eos;
  RequestLimits limits;
  // Destroyed bottom-up: the scheduler and slots (leases) before the manager, the manager
  // before the decoder whose layers it writes.
  std::unique_ptr<AdapterManager> adapters;
  std::unique_ptr<BlockManager> blocks;
  std::unique_ptr<ManagerSlots> slots;
  std::unique_ptr<Scheduler> scheduler;
  std::shared_ptr<Inbox> inbox = std::make_shared<Inbox>();
  std::atomic<int64_t> num_waiting{0};  // as of the last step, for max_waiting
  // Structured output's compiler over the tokenizer's vocabulary: made on the first request
  // that needs it (reading a large vocabulary takes a moment), shared by the submit threads.
  std::once_flag grammar_once;
  std::unique_ptr<GrammarCompiler> grammars;
  const GrammarCompiler& grammar_compiler();

  // Step loop only.
  std::unordered_map<uint64_t, Record> records;
  LaunchedSteps launched;  // steps whose ids have not been collected, oldest first
  EngineMetrics live;
  // Outputs of this step, delivered to the handles once the metrics that count them are
  // published: a reader that sees a request end also sees it in the metrics.
  struct Delivery {
    std::shared_ptr<internal::HandleState> handle;
    RequestOutput piece;
    FinishReason reason = FinishReason::kNone;
    std::string stop_reason;
    std::string error;
  };
  std::vector<Delivery> outbox;

  mutable std::mutex metrics_mutex;
  EngineMetrics snapshot;
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  std::thread thread;

  double now() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  Pending prepare(Request&& request);
  void enqueue_locked(Pending& p);
  void loop();
  void iterate(bool& idle);
  // Builds and launches the step; false when the model refused it (its requests have ended).
  bool launch_step(const StepPlan& plan);
  model::StepBatch build_batch(const StepPlan& plan, LaunchedStep& step);
  void count_step(const StepPlan& plan);
  // Collects the oldest step in flight: its tokens go to their sequences (stop checks, text).
  void collect_step();
  void collect_all();
  // Collects every step in flight and ignores what they sampled (errors, shutdown).
  void drop_launched();
  // `top` points at the row's `top_k` (id, log-probability) pairs of the step, or is null.
  void on_token(Sequence& seq, int32_t token, const float* logprob, const int32_t* top_ids,
                const float* top_lps, int top_k);
  void publish(Record& r, RequestOutput&& piece, FinishReason reason,
               const std::string& stop_reason, const std::string& error);
  void deliver();
  void finish(uint64_t id, FinishReason reason, const std::string& stop_reason,
              const std::string& error);
  void release_adapter(const std::string& adapter);
  void fail_everything(const std::string& error);
  void publish_metrics();
};

namespace {

template <typename... Args>
[[noreturn]] void refuse(RequestError::Kind kind, const Args&... args) {
  throw RequestError(kind, detail::concat(args...));
}

int64_t kv_blocks_for(const EngineOptions& o, const model::ModelExecutor& decoder) {
  if (o.num_kv_blocks > 0) return o.num_kv_blocks;
  const Device device = decoder.options().device;
  LORAPLEX_CHECK(device.is_cuda(), "EngineOptions::num_kv_blocks must be set on the CPU (got ",
                 o.num_kv_blocks, ")");
  LORAPLEX_CHECK(o.gpu_memory_utilization > 0.0 && o.gpu_memory_utilization <= 1.0,
                 "gpu_memory_utilization ", o.gpu_memory_utilization, ", expected (0, 1]");
  // Every rank holds the same number of blocks (of its own KV heads): the fullest GPU decides.
  cuda_rt::MemoryInfo mem = cuda_rt::memory_info(device.index);
  for (const Device& d : decoder.devices()) {
    const cuda_rt::MemoryInfo m = cuda_rt::memory_info(d.index);
    if (m.free < mem.free) mem = m;
  }
  const size_t free_bytes = mem.free;
  const size_t total_bytes = mem.total;
  // Whatever is in use now (weights, workspaces, other processes) stays; the cache takes what
  // is free beyond the (1 - utilization) share of the device left untouched.
  const double keep = (1.0 - o.gpu_memory_utilization) * static_cast<double>(total_bytes);
  const double budget = static_cast<double>(free_bytes) - keep;
  const int64_t n =
      budget > 0 ? static_cast<int64_t>(budget / static_cast<double>(decoder.kv_block_bytes())) : 0;
  LORAPLEX_CHECK(n >= 1, "no memory left for the KV cache: ", free_bytes >> 20, " MiB free of ",
                 total_bytes >> 20, " MiB, gpu_memory_utilization ", o.gpu_memory_utilization,
                 " keeps ", static_cast<int64_t>(keep) >> 20, " MiB free");
  return n;
}

}  // namespace

Engine::Engine(std::unique_ptr<model::ModelExecutor> model,
               std::shared_ptr<const Tokenizer> tokenizer, std::vector<int32_t> eos_token_ids,
               EngineOptions options)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  LORAPLEX_CHECK(model != nullptr, "Engine needs a model");
  const model::DecoderOptions& d = model->options();
  const model::ModelConfig& config = model->config();
  LORAPLEX_CHECK(options.max_num_seqs >= 1 && options.max_num_seqs <= d.max_num_seqs,
                 "max_num_seqs ", options.max_num_seqs, ", expected 1 .. the model's ",
                 d.max_num_seqs, " (load it with engine_decoder_options)");
  LORAPLEX_CHECK(
      options.max_num_batched_tokens >= 1 && options.max_num_batched_tokens <= d.max_num_tokens,
      "max_num_batched_tokens ", options.max_num_batched_tokens, ", expected 1 .. the model's ",
      d.max_num_tokens, " (load it with engine_decoder_options)");
  LORAPLEX_CHECK(options.max_loras >= 1 && options.max_loras <= d.max_loras, "max_loras ",
                 options.max_loras, ", expected 1 .. the model's ", d.max_loras);
  LORAPLEX_CHECK(options.max_lora_rank >= 1 && options.max_lora_rank <= d.max_lora_rank,
                 "max_lora_rank ", options.max_lora_rank, ", expected 1 .. the model's ",
                 d.max_lora_rank);
  LORAPLEX_CHECK(options.kv_block_size == d.kv_block_size, "kv_block_size ", options.kv_block_size,
                 " differs from the model's ", d.kv_block_size);
  LORAPLEX_CHECK(options.max_cpu_loras == 0 || options.max_cpu_loras >= options.max_loras,
                 "max_cpu_loras ", options.max_cpu_loras, ", expected 0 or >= max_loras (",
                 options.max_loras, ")");
  // The decoder's max_model_len defaults to max_position_embeddings and refuses more.
  LORAPLEX_CHECK(options.max_model_len >= 0 && options.max_model_len <= d.max_model_len,
                 "max_model_len ", options.max_model_len, " exceeds the model's ", d.max_model_len,
                 " (load it with engine_decoder_options)");
  if (options.max_model_len == 0) options.max_model_len = d.max_model_len;
  LORAPLEX_CHECK(!std::isnan(options.lora_drain_after_s), "lora_drain_after_s ",
                 options.lora_drain_after_s, ", expected seconds (negative = never)");
  LORAPLEX_CHECK(!std::isnan(options.lora_evict_after_s), "lora_evict_after_s ",
                 options.lora_evict_after_s, ", expected seconds (negative = never)");

  const int64_t num_blocks = kv_blocks_for(options, *model);
  model->allocate_kv_cache(num_blocks);

  m.options = options;
  m.decoder = std::move(model);
  m.tokenizer = std::move(tokenizer);
  m.eos = std::move(eos_token_ids);

  AdapterManagerConfig mc;
  mc.max_loras = options.max_loras;
  mc.max_cpu_loras = options.max_cpu_loras;
  mc.max_lora_rank = options.max_lora_rank;
  mc.lora_dtype = d.dtype;
  mc.device = d.device;
  m.adapters = std::make_unique<AdapterManager>(m.decoder->targets(), mc);
  m.blocks = std::make_unique<BlockManager>(num_blocks, options.kv_block_size,
                                            options.enable_prefix_caching);
  const int cpu_loras = m.adapters->config().max_cpu_loras;
  const int max_loading = options.max_loading_adapters > 0
                              ? options.max_loading_adapters
                              : std::max(1, cpu_loras - options.max_loras);
  m.slots = std::make_unique<ManagerSlots>(*m.adapters, max_loading);
  SchedulerConfig sc;
  sc.max_num_seqs = options.max_num_seqs;
  sc.max_num_batched_tokens = options.max_num_batched_tokens;
  sc.max_loras = options.max_loras;
  sc.lora_drain_after_s = options.lora_drain_after_s;
  sc.lora_evict_after_s = options.lora_evict_after_s;
  m.scheduler = std::make_unique<Scheduler>(sc, *m.blocks, *m.slots);

  m.limits.max_model_len = options.max_model_len;
  m.limits.kv_cache_tokens = num_blocks * options.kv_block_size;
  m.limits.vocab_size = static_cast<int32_t>(config.vocab_size);
  m.limits.has_tokenizer = m.tokenizer != nullptr;
  m.limits.eos_token_ids = m.eos;

  m.live = empty_metrics(options.max_loras, options.max_model_len);
  m.live.num_kv_blocks = num_blocks;
  m.live.kv_block_size = options.kv_block_size;
  m.snapshot = m.live;
  m.thread = std::thread([&m] { m.loop(); });
}

Engine::~Engine() {
  {
    std::lock_guard<std::mutex> lock(impl_->inbox->mutex);
    impl_->inbox->stop = true;
  }
  impl_->inbox->cv.notify_all();
  impl_->thread.join();
}

const EngineOptions& Engine::options() const { return impl_->options; }
const model::ModelConfig& Engine::model_config() const { return impl_->decoder->config(); }

const Tokenizer& Engine::tokenizer() const {
  LORAPLEX_CHECK(impl_->tokenizer != nullptr,
                 "the model has no tokenizer: prompts must be token ids");
  return *impl_->tokenizer;
}

bool Engine::has_tokenizer() const { return impl_->tokenizer != nullptr; }

EngineMetrics Engine::metrics() const {
  std::lock_guard<std::mutex> lock(impl_->metrics_mutex);
  return impl_->snapshot;
}

// ------------------------------------------------------------------------------- submit

Pending Engine::Impl::prepare(Request&& request) {
  RequestOptions& o = request.options;
  check_request_options(o, limits);
  std::vector<int32_t> ids = std::move(request.prompt_ids);
  if (ids.empty()) {
    if (request.prompt.empty()) refuse(RequestError::Kind::kInvalid, "the prompt is empty");
    if (tokenizer == nullptr) {
      refuse(RequestError::Kind::kInvalid,
             "a text prompt needs a tokenizer, and this engine has none: send token ids");
    }
    try {
      ids = ::loraplex::tokenizer::encode_prompt(
          [&](std::string_view text, bool special) { return tokenizer->encode(text, special); },
          request.prompt, {});
    } catch (const Error& e) {
      refuse(RequestError::Kind::kInvalid, e.what());
    }
  }
  check_prompt(ids, o, limits);

  Pending p;
  p.seq = std::make_unique<Sequence>();
  p.seq->adapter = request.adapter;
  p.seq->num_prompt_tokens = static_cast<int64_t>(ids.size());
  // on_token ends it by length there; asynchronous scheduling must not plan past it.
  p.seq->max_num_tokens =
      std::min(options.max_model_len,
               p.seq->num_prompt_tokens + std::min(o.max_tokens, options.max_model_len));
  p.seq->tokens = ids;
  Record& r = p.record;
  r.handle = std::make_shared<RequestHandle::State>();
  r.handle->prompt_ids = std::move(ids);
  r.handle->pending.prompt_tokens = p.seq->num_prompt_tokens;
  r.handle->inbox = inbox;
  r.adapter = request.adapter;
  r.sampling = sampling_params_of(o);
  if (o.min_tokens > 0) r.banned = min_tokens_banned_ids(o, eos);
  r.processing = LogitsProcessing(o, r.handle->prompt_ids, tokenizer.get());
  if (o.structured.kind != StructuredOutput::Kind::kNone) {
    r.grammar = grammar_compiler().start(o.structured);
  }
  r.prompt_len = p.seq->num_prompt_tokens;
  if (tokenizer != nullptr) {
    r.detok = std::make_unique<IncrementalDetokenizer>(
        *tokenizer, r.handle->prompt_ids, o.stop,
        DetokenizeOptions{o.include_stop_str_in_output, o.skip_special_tokens});
  }
  r.options = std::move(o);
  return p;
}

const GrammarCompiler& Engine::Impl::grammar_compiler() {
  std::call_once(grammar_once, [&] {
    grammars = std::make_unique<GrammarCompiler>(*tokenizer, limits.vocab_size, eos);
  });
  return *grammars;
}

// Under inbox->mutex: checks the adapter and gives the request its id and place.
void Engine::Impl::enqueue_locked(Pending& p) {
  Record& r = p.record;
  uint64_t key = 0;
  if (!r.adapter.empty()) {
    const auto it = inbox->adapters.find(r.adapter);
    if (it == inbox->adapters.end() || it->second.state != AdapterEntry::State::kReady) {
      const bool leaving =
          it != inbox->adapters.end() && (it->second.state == AdapterEntry::State::kUnloading ||
                                          it->second.state == AdapterEntry::State::kRemoving);
      refuse(RequestError::Kind::kUnknownAdapter, "adapter '", r.adapter, "' is not loaded",
             leaving ? " (it is being unloaded)" : "");
    }
    key = it->second.key;
  }
  const uint64_t id = inbox->next_id;
  p.seq->id = id;
  p.seq->order = id;
  p.seq->adapter_key = key;
  r.handle->id = id;
  r.rng = r.options.seed ? model::make_sequence_rng(*r.options.seed, 0)
                         : model::make_sequence_rng(options.seed, id);
}

RequestHandle Engine::submit(Request request) {
  std::vector<Request> one;
  one.push_back(std::move(request));
  try {
    return submit_all(std::move(one)).front();
  } catch (const RequestError& e) {
    if (e.index() < 0) throw;
    throw RequestError(e.kind(), e.reason());  // a single request needs no index
  }
}

std::vector<RequestHandle> Engine::submit_all(std::vector<Request> requests) {
  Impl& m = *impl_;
  std::vector<Pending> pending;
  pending.reserve(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    try {
      pending.push_back(m.prepare(std::move(requests[i])));
    } catch (const RequestError& e) {
      throw RequestError(e.kind(), e.reason(), static_cast<int64_t>(i));
    }
  }
  std::vector<RequestHandle> handles;
  {
    std::lock_guard<std::mutex> lock(m.inbox->mutex);
    const int64_t waiting = m.num_waiting.load() + static_cast<int64_t>(m.inbox->incoming.size());
    if (m.options.max_waiting > 0 &&
        waiting + static_cast<int64_t>(pending.size()) > m.options.max_waiting) {
      refuse(RequestError::Kind::kOverloaded, waiting, " requests are waiting; max_waiting is ",
             m.options.max_waiting);
    }
    const uint64_t first_id = m.inbox->next_id;
    for (size_t i = 0; i < pending.size(); ++i) {
      try {
        m.enqueue_locked(pending[i]);
      } catch (const RequestError& e) {
        m.inbox->next_id = first_id;  // ids stay dense: seeds derive from them
        throw RequestError(e.kind(), e.reason(), static_cast<int64_t>(i));
      }
      ++m.inbox->next_id;
    }
    // Nothing above threw: every request is accepted, in order.
    const double t = m.now();
    for (Pending& p : pending) {
      p.record.arrival = t;
      p.seq->arrival_time = t;
      if (!p.record.adapter.empty()) ++m.inbox->adapters[p.record.adapter].in_flight;
      handles.push_back(
          RequestHandle(std::static_pointer_cast<RequestHandle::State>(p.record.handle)));
      m.inbox->incoming.push_back(std::move(p));
    }
  }
  m.inbox->cv.notify_all();
  return handles;
}

// ------------------------------------------------------------------------------ adapters

AdapterInfo Engine::load_adapter(const std::string& name, const std::string& dir) {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> lock(m.inbox->mutex);
    const auto it = m.inbox->adapters.find(name);
    if (it != m.inbox->adapters.end()) {
      switch (it->second.state) {
        case AdapterEntry::State::kLoading:
          LORAPLEX_FAIL("adapter '", name, "' is being loaded already");
        case AdapterEntry::State::kReady:
          LORAPLEX_FAIL("adapter '", name, "' is already loaded; unload it first");
        default:
          LORAPLEX_FAIL("adapter '", name, "' is being unloaded (", it->second.in_flight,
                        " requests still use it); load it again once they finish");
      }
    }
    m.inbox->adapters[name] = AdapterEntry{};
  }
  AdapterInfo info;
  try {
    info = m.adapters->load(name, dir);
  } catch (...) {
    std::lock_guard<std::mutex> lock(m.inbox->mutex);
    m.inbox->adapters.erase(name);
    throw;
  }
  std::lock_guard<std::mutex> lock(m.inbox->mutex);
  AdapterEntry& e = m.inbox->adapters[name];
  e.state = AdapterEntry::State::kReady;
  e.key = m.inbox->next_adapter_key++;
  return info;
}

bool Engine::unload_adapter(const std::string& name) {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> lock(m.inbox->mutex);
    const auto it = m.inbox->adapters.find(name);
    if (it == m.inbox->adapters.end() || it->second.state != AdapterEntry::State::kReady) {
      return false;
    }
    if (it->second.in_flight > 0) {
      it->second.state = AdapterEntry::State::kUnloading;  // the last request's end unloads it
      return true;
    }
    it->second.state = AdapterEntry::State::kRemoving;
  }
  m.adapters->unload(name);
  {
    std::lock_guard<std::mutex> lock(m.inbox->mutex);
    m.inbox->adapters.erase(name);
  }
  m.inbox->adapter_removed.notify_all();
  return true;
}

bool Engine::wait_until_unloaded(const std::string& name, std::chrono::milliseconds timeout) const {
  Inbox& inbox = *impl_->inbox;
  const auto gone = [&] {
    const auto it = inbox.adapters.find(name);
    return it == inbox.adapters.end() || (it->second.state != AdapterEntry::State::kUnloading &&
                                          it->second.state != AdapterEntry::State::kRemoving);
  };
  std::unique_lock<std::mutex> lock(inbox.mutex);
  // wait_for overflows the clock with milliseconds::max(); a day is "for ever" here.
  if (timeout >= std::chrono::hours(24)) {
    inbox.adapter_removed.wait(lock, gone);
    return true;
  }
  return inbox.adapter_removed.wait_for(lock, timeout, gone);
}

bool Engine::has_adapter(const std::string& name) const {
  std::lock_guard<std::mutex> lock(impl_->inbox->mutex);
  const auto it = impl_->inbox->adapters.find(name);
  return it != impl_->inbox->adapters.end() && it->second.state == AdapterEntry::State::kReady;
}

std::vector<AdapterInfo> Engine::list_adapters() const {
  std::set<std::string> ready;
  {
    std::lock_guard<std::mutex> lock(impl_->inbox->mutex);
    for (const auto& [name, e] : impl_->inbox->adapters)
      if (e.state == AdapterEntry::State::kReady) ready.insert(name);
  }
  std::vector<AdapterInfo> out;
  for (AdapterInfo& info : impl_->adapters->list())
    if (ready.count(info.name) != 0) out.push_back(std::move(info));
  return out;
}

// ----------------------------------------------------------------------------- step loop

void Engine::Impl::loop() {
  bool idle = false;
  for (;;) {
    std::vector<Pending> incoming;
    std::vector<uint64_t> aborts;
    {
      std::unique_lock<std::mutex> lock(inbox->mutex);
      const auto news = [&] {
        return inbox->stop || !inbox->incoming.empty() || !inbox->aborts.empty();
      };
      if (!scheduler->has_work()) {
        inbox->cv.wait(lock, news);
      } else if (idle) {
        // Everything waits for adapters loading in the background: poll.
        inbox->cv.wait_for(lock, std::chrono::milliseconds(1), news);
      }
      if (inbox->stop) break;
      incoming.swap(inbox->incoming);
      aborts.swap(inbox->aborts);
      // submit's max_waiting check reads num_waiting plus the inbox: what is taken here counts
      // as waiting until this step's metrics replace the count.
      num_waiting.fetch_add(static_cast<int64_t>(incoming.size()));
    }
    try {
      for (Pending& p : incoming) {
        const uint64_t id = p.seq->id;
        records.emplace(id, std::move(p.record));
        scheduler->add(std::move(p.seq));
      }
      for (uint64_t id : aborts) {
        if (records.count(id) != 0) finish(id, FinishReason::kAbort, "", "");
      }
      iterate(idle);
    } catch (const std::exception& e) {
      drop_launched();
      fail_everything(detail::concat("engine error: ", e.what()));
      idle = false;
    }
    publish_metrics();
    deliver();
  }
  // Shutting down: everything in flight, and everything not yet seen, ends as aborted.
  drop_launched();
  std::vector<Pending> incoming;
  {
    std::lock_guard<std::mutex> lock(inbox->mutex);
    incoming.swap(inbox->incoming);
  }
  for (Pending& p : incoming) publish(p.record, RequestOutput{}, FinishReason::kAbort, "", "");
  std::vector<uint64_t> ids;
  for (const auto& [id, r] : records) ids.push_back(id);
  for (uint64_t id : ids) finish(id, FinishReason::kAbort, "", "");
  publish_metrics();
  deliver();
}

void Engine::Impl::iterate(bool& idle) {
  // A sequence planned from its generated tokens needs the last one on the host.
  if (!options.async_scheduling || launched.host_tokens_needed()) collect_all();
  StepPlan plan = scheduler->schedule(now());
  for (size_t i = 0; i < plan.failed.size(); ++i) {
    const uint64_t id = plan.failed[i]->id;
    plan.failed[i].reset();
    finish(id, FinishReason::kError, "", plan.failed_errors[i]);
  }
  const bool ran = !plan.empty() && launch_step(plan);
  // Asynchronously the step just launched runs while the next one is planned: only the one
  // before it is collected now. With nothing left to plan, everything is.
  const size_t keep = ran && options.async_scheduling ? 1 : 0;
  bool collected = false;
  while (launched.size() > keep) {
    collect_step();
    collected = true;
  }
  if (!scheduler->has_work()) collect_all();
  idle = !ran && !collected;
}

model::StepBatch Engine::Impl::build_batch(const StepPlan& plan, LaunchedStep& step) {
  model::StepBatch batch;
  batch.seqs.reserve(plan.seqs.size());
  const double t = now();
  for (const ScheduledSeq& q : plan.seqs) {
    const Sequence& s = *q.seq;
    Record& r = records.at(s.id);
    if (r.first_scheduled < 0) r.first_scheduled = t;
    step.seqs.push_back(s.id);
    model::SequenceStep st;
    st.tokens.assign(s.tokens.begin() + q.start, s.tokens.begin() + q.start + q.num_tokens);
    st.start_position = static_cast<int32_t>(q.start);
    st.blocks = s.blocks;
    st.lora_slot = s.slot;
    st.sample = q.sample;
    // A pending token (the chunk's last) comes from the step launched just before.
    if (q.start + q.num_tokens > s.num_known_tokens()) {
      st.feed_row = launched.feed_row(s.id);
      LORAPLEX_CHECK(st.feed_row >= 0, "engine: sequence ", s.id,
                     " runs a pending token that the last step did not sample (internal error)");
    }
    if (q.sample) {
      st.sampling = r.sampling;
      st.uniform = model::next_uniform(r.rng);
      if (s.num_tokens() - s.num_prompt_tokens < r.options.min_tokens) st.banned = r.banned;
      if (r.processing.active()) {
        const std::vector<int32_t> output(s.tokens.begin() + s.num_prompt_tokens,
                                          s.tokens.begin() + s.num_known_tokens());
        r.processing.step(output, st.adjust, st.only_listed);
      }
      if (r.grammar != nullptr) r.grammar->constrain(st.adjust, st.only_listed);
      if (r.options.logprobs) batch.want_logprobs = true;
      batch.top_logprobs = std::max(batch.top_logprobs, r.options.top_logprobs);
      step.sampled.push_back(s.id);
      step.host_tokens_needed =
          step.host_tokens_needed || r.processing.reads_output() || r.grammar != nullptr;
    }
    batch.seqs.push_back(std::move(st));
  }
  step.logprobs = batch.want_logprobs;
  step.top_logprobs = batch.top_logprobs;
  return batch;
}

bool Engine::Impl::launch_step(const StepPlan& plan) {
  LaunchedStep step;
  const model::StepBatch batch = build_batch(plan, step);
  std::set<std::string> step_adapters;
  for (const ScheduledSeq& q : plan.seqs)
    if (!q.seq->adapter.empty()) step_adapters.insert(q.seq->adapter);
  try {
    for (const std::string& a : step_adapters) {
      for (const Stream& s : decoder->streams()) slots->wait_ready(a, s);
    }
    const auto layers_lock = adapters->lock_layers();
    decoder->launch(batch);
  } catch (const std::exception& e) {
    // The model refused the step: the requests in it end with its error, the rest go on.
    for (uint64_t id : step.seqs) finish(id, FinishReason::kError, "", e.what());
    return false;
  }
  slots->step_launched();
  scheduler->advance(plan);
  count_step(plan);
  launched.push(std::move(step));
  return true;
}

void Engine::Impl::count_step(const StepPlan& plan) {
  ++live.steps_total;
  live.step_seqs_total += static_cast<int64_t>(plan.seqs.size());
  live.step_adapters_total += plan.num_adapters;
  live.max_step_seqs = std::max(live.max_step_seqs, static_cast<int64_t>(plan.seqs.size()));
  live.max_step_tokens = std::max(live.max_step_tokens, plan.num_tokens);
  live.max_step_adapters = std::max<int64_t>(live.max_step_adapters, plan.num_adapters);
  observe(live.iteration_tokens_total, static_cast<double>(plan.num_tokens));
  observe(live.adapters_per_step, plan.num_adapters);
}

void Engine::Impl::collect_step() {
  const LaunchedStep step = launched.pop();
  model::StepResult result;
  try {
    result = decoder->collect();
  } catch (const std::exception& e) {
    slots->step_collected();
    for (uint64_t id : step.seqs) finish(id, FinishReason::kError, "", e.what());
    return;
  }
  slots->step_collected();
  // Sequences that ended since the launch (a stop in the step before, an abort) are gone:
  // their tokens are dropped here.
  scheduler->resolve(step.sampled, result.token_ids);
  const int k = step.top_logprobs;
  for (size_t i = 0; i < step.sampled.size(); ++i) {
    Sequence* seq = scheduler->find(step.sampled[i]);
    if (seq == nullptr) continue;
    const float* lp = step.logprobs ? &result.logprobs.at(i) : nullptr;
    const bool top = k > 0 && result.top_ids.size() >= (i + 1) * static_cast<size_t>(k);
    on_token(*seq, result.token_ids.at(i), lp, top ? &result.top_ids[i * k] : nullptr,
             top ? &result.top_logprobs[i * k] : nullptr, k);
  }
}

void Engine::Impl::collect_all() {
  while (!launched.empty()) collect_step();
}

void Engine::Impl::drop_launched() {
  while (!launched.empty()) {
    launched.pop();
    try {
      decoder->collect();
    } catch (const std::exception&) {  // nothing it sampled is used
    }
    slots->step_collected();
  }
}

void Engine::Impl::on_token(Sequence& s, int32_t token, const float* logprob,
                            const int32_t* top_ids, const float* top_lps, int top_k) {
  Record& r = records.at(s.id);
  const double t = now();
  // Tokens of later steps may be pending behind this one.
  const int64_t generated = s.num_known_tokens() - s.num_prompt_tokens;
  if (r.first_token < 0) {
    r.first_token = t;
    observe(live.time_to_first_token_s, t - r.arrival);
    live.prompt_tokens_total += r.prompt_len;
  } else {
    observe(live.inter_token_latency_s, t - r.last_token);
  }
  r.last_token = t;
  r.generated = generated;
  ++live.generation_tokens_total;

  const RequestOptions& o = r.options;
  FinishReason reason = FinishReason::kNone;
  std::string stop_reason;
  bool stop_token = false;
  if (generated >= o.min_tokens) {
    if (!o.ignore_eos && std::find(eos.begin(), eos.end(), token) != eos.end()) {
      reason = FinishReason::kStop;
      stop_token = true;
    } else if (std::find(o.stop_token_ids.begin(), o.stop_token_ids.end(), token) !=
               o.stop_token_ids.end()) {
      reason = FinishReason::kStop;
      stop_reason = std::to_string(token);
      stop_token = true;
    }
  }
  if (r.grammar != nullptr) {
    // The mask allowed only what the grammar accepts; a grammar that has accepted EOS is done
    // (also with ignore_eos: nothing may follow).
    if (!r.grammar->accept(token)) {
      finish(s.id, FinishReason::kError, "",
             "structured output: the grammar refused token " + std::to_string(token));
      return;
    }
    if (reason == FinishReason::kNone && r.grammar->terminated()) reason = FinishReason::kStop;
  }
  if (reason == FinishReason::kNone &&
      (generated >= o.max_tokens || s.num_known_tokens() >= options.max_model_len)) {
    reason = FinishReason::kLength;
  }
  RequestOutput piece;
  piece.token_ids.push_back(token);
  if (o.logprobs && logprob != nullptr) piece.logprobs.push_back(*logprob);
  if (o.top_logprobs > 0 && top_ids != nullptr) {
    std::vector<std::pair<int32_t, float>>& top = piece.top_logprobs.emplace_back();
    for (int t = 0; t < std::min(o.top_logprobs, top_k); ++t)
      top.emplace_back(top_ids[t], top_lps[t]);
  }
  if (r.detok != nullptr) {
    // A stop token's own text is not part of the output, unless asked for (the request ends
    // here: no stop string is looked for in it).
    if (!stop_token || o.include_stop_str_in_output) {
      const std::optional<std::string> matched =
          r.detok->add(token, generated >= o.min_tokens && !stop_token);
      if (matched) {
        reason = FinishReason::kStop;
        stop_reason = *matched;
      }
    }
    piece.text = r.detok->take(reason != FinishReason::kNone);
  }
  piece.completion_tokens = generated;
  piece.cached_tokens = std::max<int64_t>(0, s.prompt_cached_tokens);
  piece.queue_time_s = r.first_scheduled - r.arrival;
  const uint64_t id = s.id;
  publish(r, std::move(piece), reason, stop_reason, "");
  if (reason != FinishReason::kNone) finish(id, reason, stop_reason, "");
}

void Engine::Impl::publish(Record& r, RequestOutput&& piece, FinishReason reason,
                           const std::string& stop_reason, const std::string& error) {
  outbox.push_back({r.handle, std::move(piece), reason, stop_reason, error});
}

void Engine::Impl::deliver() {
  for (Delivery& d : outbox) {
    {
      std::lock_guard<std::mutex> lock(d.handle->mutex);
      RequestOutput& p = d.handle->pending;
      if (p.finished) continue;  // aborted by the client: nothing more is delivered
      p.token_ids.insert(p.token_ids.end(), d.piece.token_ids.begin(), d.piece.token_ids.end());
      p.text += d.piece.text;
      p.logprobs.insert(p.logprobs.end(), d.piece.logprobs.begin(), d.piece.logprobs.end());
      p.top_logprobs.insert(p.top_logprobs.end(), d.piece.top_logprobs.begin(),
                            d.piece.top_logprobs.end());
      if (!d.piece.token_ids.empty()) {
        p.completion_tokens = d.piece.completion_tokens;
        p.cached_tokens = d.piece.cached_tokens;
        p.queue_time_s = d.piece.queue_time_s;
      }
      if (d.reason != FinishReason::kNone) {
        p.finished = true;
        p.finish_reason = d.reason;
        p.stop_reason = d.stop_reason;
        p.error = d.error;
      }
    }
    d.handle->cv.notify_all();
  }
  outbox.clear();
}

void Engine::Impl::finish(uint64_t id, FinishReason reason, const std::string& stop_reason,
                          const std::string& error) {
  scheduler->remove(id);  // frees its blocks and, with its last sequence, its adapter's slot
  const auto it = records.find(id);
  if (it == records.end()) return;
  Record r = std::move(it->second);
  records.erase(it);
  publish(r, RequestOutput{}, reason, stop_reason, error);

  ++live.finished_total[finish_reason_name(reason)];
  const double t = now();
  if (reason == FinishReason::kStop || reason == FinishReason::kLength) {
    const int64_t generated = r.generated;
    observe(live.e2e_request_latency_s, t - r.arrival);
    if (r.first_scheduled >= 0) {
      observe(live.queue_time_s, r.first_scheduled - r.arrival);
      observe(live.request_inference_time_s, t - r.first_scheduled);
    }
    if (r.first_token >= 0) {
      observe(live.request_prefill_time_s, r.first_token - std::max(r.first_scheduled, 0.0));
      observe(live.request_decode_time_s, t - r.first_token);
      if (generated > 1) {
        observe(live.time_per_output_token_s,
                (t - r.first_token) / static_cast<double>(generated - 1));
      }
    }
    observe(live.request_prompt_tokens, static_cast<double>(r.prompt_len));
    observe(live.request_generation_tokens, static_cast<double>(generated));
    observe(live.request_params_max_tokens, static_cast<double>(r.options.max_tokens));
  }
  if (!r.adapter.empty()) release_adapter(r.adapter);
}

// A request of `adapter` ended: an unload waiting for it may proceed.
void Engine::Impl::release_adapter(const std::string& adapter) {
  {
    std::lock_guard<std::mutex> lock(inbox->mutex);
    const auto it = inbox->adapters.find(adapter);
    if (it == inbox->adapters.end()) return;
    if (--it->second.in_flight > 0 || it->second.state != AdapterEntry::State::kUnloading) return;
    it->second.state = AdapterEntry::State::kRemoving;
  }
  adapters->unload(adapter);
  {
    std::lock_guard<std::mutex> lock(inbox->mutex);
    inbox->adapters.erase(adapter);
  }
  inbox->adapter_removed.notify_all();
}

void Engine::Impl::fail_everything(const std::string& error) {
  std::vector<uint64_t> ids;
  for (const auto& [id, r] : records) ids.push_back(id);
  for (uint64_t id : ids) {
    try {
      finish(id, FinishReason::kError, "", error);
    } catch (const std::exception&) {
      // The scheduler's state is what failed; the request still ends.
      const auto it = records.find(id);
      if (it == records.end()) continue;
      publish(it->second, RequestOutput{}, FinishReason::kError, "", error);
      records.erase(it);
    }
  }
}

void Engine::Impl::publish_metrics() {
  live.num_running = scheduler->num_running();
  live.num_waiting = scheduler->num_waiting();
  live.kv_cache_usage =
      static_cast<double>(blocks->num_used_blocks()) / static_cast<double>(blocks->num_blocks());
  live.running_adapters = scheduler->running_adapters();
  live.waiting_adapters = scheduler->waiting_adapters();
  live.preemptions_total = scheduler->preemptions_total();
  live.lora_evictions_total = scheduler->evictions_total();
  live.prefix_cache_queries_total = scheduler->prefix_queries_total();
  live.prefix_cache_hits_total = scheduler->prefix_hits_total();
  num_waiting.store(live.num_waiting);
  std::lock_guard<std::mutex> lock(metrics_mutex);
  snapshot = live;
}

}  // namespace loraplex::engine
