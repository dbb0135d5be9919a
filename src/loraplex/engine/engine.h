#pragma once
// The online engine: requests arrive one by one from any thread, for any loaded adapter (or the
// base model); a step loop on its own thread batches them continuously (decodes first, then
// chunked prefills, under a token budget, at most max_num_seqs sequences and max_loras
// adapters a step) and streams each request's tokens and text back through its handle.
//
// This header is the contract between the engine (engine/), the HTTP server (server/) and the
// commands (`generate`, `bench serve`, `serve`).

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "loraplex/adapters/adapter_manager.h"
#include "loraplex/core/error.h"
#include "loraplex/model/decoder.h"
#include "loraplex/model/executor.h"
#include "loraplex/tokenizer/tokenizer.h"

namespace loraplex::engine {

/// A request refused at submit: the message names the value and the limit. `kind` lets the
/// server pick the HTTP status.
class RequestError : public Error {
 public:
  enum class Kind { kInvalid, kTooLong, kUnknownAdapter, kOverloaded };
  RequestError(Kind kind, const std::string& message)
      : Error(message), kind_(kind), reason_(message) {}
  /// From submit_all: what() is "request <index>: <reason>".
  RequestError(Kind kind, const std::string& reason, int64_t index)
      : Error("request " + std::to_string(index) + ": " + reason),
        kind_(kind),
        reason_(reason),
        index_(index) {}
  Kind kind() const { return kind_; }
  /// The message without the request index.
  const std::string& reason() const { return reason_; }
  /// The refused request's index in submit_all, -1 for submit.
  int64_t index() const { return index_; }

 private:
  Kind kind_;
  std::string reason_;
  int64_t index_ = -1;
};

struct EngineOptions {
  int64_t max_num_seqs = 256;             // sequences in one step
  int64_t max_num_batched_tokens = 8192;  // tokens in one step (the token budget)
  int max_loras = 4;                      // distinct adapters in one step (GPU slots)
  int max_lora_rank = 16;
  int max_cpu_loras = 0;                 // packed adapters kept in host memory; 0 = max_loras
  double gpu_memory_utilization = 0.90;  // KV cache: this fraction of the GPU, less the rest
  int64_t num_kv_blocks = 0;             // > 0: exactly this many KV blocks (CPU: required)
  int64_t kv_block_size = 16;
  int64_t max_model_len = 0;  // 0 = the model's max_position_embeddings
  bool enable_prefix_caching = true;
  int64_t max_waiting = 0;  // > 0: submit refuses (kOverloaded) beyond this
  uint64_t seed = 0;        // requests without a seed draw from (seed, id)
  /// Fairness: an adapter in host memory that has waited this long for a GPU slot gets one, by
  /// evicting a resident adapter when eviction is on (lora_evict_after_s), else by draining one
  /// (its new requests wait until its running ones finish). Negative = never.
  double lora_drain_after_s = 1.0;
  /// Time to first token: a new request that has waited this long for a GPU slot gets one by
  /// evicting a resident adapter whose requests have all had their first token (their
  /// sequences are preempted and recomputed later). Negative = never.
  double lora_evict_after_s = 0.02;
  /// Adapters reloaded from disk in the background at once; 0 = max(1, max_cpu_loras -
  /// max_loras), so that adapters loaded for waiting requests do not evict each other.
  int max_loading_adapters = 0;
  /// GPUs the model is sharded over (rank r on cuda:(device + r); CPU threads on the CPU), as
  /// vLLM's --tensor-parallel-size. The model is loaded with model::load_model.
  int tensor_parallel_size = 1;
  /// vLLM's --fully-sharded-loras: adapters are sharded like the layers they modify.
  bool fully_sharded_loras = false;
  /// How decode steps run the LoRA (model::DecoderOptions::lora_decode).
  model::LoraDecode lora_decode = model::LoraDecode::kAuto;
  /// Asynchronous scheduling: step n + 1 is planned and launched while step n runs on the
  /// device (its decode tokens that step n samples are put in place on the device), and step
  /// n's ids are collected only then; stop conditions are checked as ids are collected, and a
  /// sequence found finished has its one extra step's token discarded. The same tokens as
  /// with it off, where every step is collected before the next is planned. A step whose
  /// sequences need their generated tokens on the host to be planned (penalties, bad words)
  /// waits for them either way.
  bool async_scheduling = true;
  /// The projections' LoRA storage (model::DecoderOptions::lora_dtype): the model dtype, or
  /// float8_e4m3 (--lora-dtype fp8).
  std::optional<DType> lora_dtype;
};

/// --lora-dtype: "auto" (the model dtype: nullopt), or "fp8" / "float8_e4m3" / "e4m3". Throws
/// naming the value and the accepted ones. Inline: the server's option parsing uses it without
/// linking the engine.
inline std::optional<DType> parse_lora_dtype(const std::string& text) {
  if (text == "auto") return std::nullopt;
  if (text == "fp8" || text == "float8_e4m3" || text == "e4m3") return DType::kF8E4M3;
  LORAPLEX_FAIL("--lora-dtype '", text,
                "' is not supported (expected auto: the model dtype, or fp8: float8_e4m3 with "
                "per-row scales)");
}

/// Decoder options that fit `options` (slots, rank, tokens and sequences per step, block size,
/// tensor parallelism), for loading the model an Engine will run (model::load_model). The KV
/// cache is sized later, by the Engine.
model::DecoderOptions engine_decoder_options(const EngineOptions& options, DType dtype,
                                             Device device);

/// Structured output (vLLM's StructuredOutputsParams / guided decoding): the generated text is
/// held to a grammar, applied as a token mask before every sample (structured_output.h).
struct StructuredOutput {
  enum class Kind {
    kNone,
    kJson,     // `spec`: a JSON schema (response_format json_schema, guided_json)
    kAnyJson,  // any JSON object (response_format json_object)
    kRegex,    // `spec`: a regular expression (guided_regex)
    kChoice,   // exactly one of `choices` (guided_choice)
    kGrammar,  // `spec`: an EBNF grammar whose start rule is `root` (guided_grammar)
  };
  Kind kind = Kind::kNone;
  std::string spec;
  std::vector<std::string> choices;
  /// JSON may put any whitespace between its tokens (vLLM's default); false: none beyond one
  /// space after ':' and ',' (vLLM's disable_any_whitespace).
  bool any_whitespace = true;
};

/// What a request asks for: vLLM's SamplingParams, the fields loraplex implements.
struct RequestOptions {
  int64_t max_tokens = 16;
  int64_t min_tokens = 0;  // stop tokens and EOS are banned until this many are generated
  float temperature = 1.0f;
  float top_p = 1.0f;
  int top_k = 0;       // 0 = off (-1 is accepted as vLLM's "off" too)
  float min_p = 0.0f;  // 0 = off; else ids below min_p x the most probable one's probability
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;        // stop strings (not included in the output text)
  std::vector<int32_t> stop_token_ids;  // in addition to the model's EOS ids
  bool ignore_eos = false;
  bool logprobs = false;  // the log-probability of each sampled token
  /// Also the ids of each step's this many most probable tokens, with their log-probabilities
  /// (0 .. 20; OpenAI's top logprobs), from the model's logits.
  int top_logprobs = 0;
  /// The matched stop string, or the stop token's text, stays in the output (vLLM's
  /// include_stop_str_in_output).
  bool include_stop_str_in_output = false;
  bool skip_special_tokens = true;  // special tokens have no text
  // vLLM's logits processing (logit_adjustments.h), applied before temperature, top-k, top-p.
  float presence_penalty = 0.0f;        // subtracted once from each id generated so far
  float frequency_penalty = 0.0f;       // subtracted per time each id was generated
  float repetition_penalty = 1.0f;      // divides (> 0) or multiplies (< 0) prompt and output ids
  std::map<int32_t, float> logit_bias;  // added to the id's logit (-100 .. 100)
  std::vector<int32_t> allowed_token_ids;  // only these may be sampled; empty: every id
  std::vector<std::string> bad_words;      // never completed in the output
  StructuredOutput structured;
};

struct Request {
  std::vector<int32_t> prompt_ids;  // the prompt as ids, or ...
  std::string prompt;               // ... as text (encoded with special tokens) when ids are empty
  std::string adapter;              // a loaded adapter's name; "" = the base model
  RequestOptions options;
};

enum class FinishReason { kNone, kStop, kLength, kAbort, kError };
const char* finish_reason_name(FinishReason reason);  // "stop", "length", "abort", "error"

/// What a request produced since the last read of its handle.
struct RequestOutput {
  std::vector<int32_t> token_ids;  // new tokens
  std::string text;                // new text; never ends inside a UTF-8 character
  std::vector<float> logprobs;     // one per new token when asked
  /// One list per new token when top_logprobs was asked: (id, log-probability), most probable
  /// first.
  std::vector<std::vector<std::pair<int32_t, float>>> top_logprobs;
  bool finished = false;
  FinishReason finish_reason = FinishReason::kNone;
  std::string stop_reason;  // the stop string or stop token id (as text) that ended it
  std::string error;        // finish_reason == kError: what went wrong
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;  // generated so far, in total
  int64_t cached_tokens = 0;      // prompt tokens served from the prefix cache
  double queue_time_s = 0.0;      // submit -> first scheduled (set from the first token on)
};

class Engine;

/// A submitted request's stream. Thread-safe; copies share the request.
class RequestHandle {
 public:
  RequestHandle() = default;
  uint64_t id() const;
  const std::vector<int32_t>& prompt_ids() const;
  /// Waits up to `timeout` for new output or the end; returns what arrived since the last
  /// call (empty token_ids and finished == false after a timeout). After the last output
  /// (finished == true) every call returns finished at once.
  RequestOutput next(std::chrono::milliseconds timeout = std::chrono::milliseconds::max());
  /// Waits for the end and returns everything not yet read, accumulated.
  RequestOutput wait();
  /// Ends the request (finish reason abort) and frees its KV blocks and adapter lease at the
  /// next step boundary. Safe to call at any time, more than once.
  void abort();

 private:
  friend class Engine;
  struct State;
  explicit RequestHandle(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

/// Counters and histograms for /metrics (vLLM's names are the server's business).
struct EngineMetrics {
  int64_t num_running = 0;
  int64_t num_waiting = 0;
  double kv_cache_usage = 0.0;                // fraction of KV blocks in use, 0..1
  std::vector<std::string> running_adapters;  // adapters of running requests
  std::vector<std::string> waiting_adapters;  // adapters of waiting requests
  int max_loras = 0;
  int64_t prompt_tokens_total = 0;
  int64_t generation_tokens_total = 0;
  int64_t preemptions_total = 0;                  // sequences preempted (KV shortage or eviction)
  int64_t lora_evictions_total = 0;               // adapters evicted from a slot for a new request
  int64_t prefix_cache_queries_total = 0;         // prompt tokens looked up
  int64_t prefix_cache_hits_total = 0;            // prompt tokens found
  std::map<std::string, int64_t> finished_total;  // by finish reason name
  int64_t num_kv_blocks = 0;                      // the cache's size (vLLM's cache_config_info)
  int64_t kv_block_size = 0;
  // Steps: how many, and what they held (for benchmarks and `generate --stats`).
  int64_t steps_total = 0;
  int64_t step_seqs_total = 0;      // sequences summed over steps
  int64_t step_adapters_total = 0;  // distinct adapters summed over steps
  int64_t max_step_seqs = 0;
  int64_t max_step_tokens = 0;
  int64_t max_step_adapters = 0;
  /// Cumulative histograms: counts[i] = observations <= bounds[i]; sum and count of all.
  struct Histogram {
    std::vector<double> bounds;
    std::vector<int64_t> counts;
    double sum = 0.0;
    int64_t count = 0;
  };
  // vLLM's bucket bounds for each.
  Histogram time_to_first_token_s;
  Histogram inter_token_latency_s;
  Histogram e2e_request_latency_s;
  Histogram queue_time_s;
  Histogram time_per_output_token_s;   // per request: decode time / (tokens - 1)
  Histogram request_inference_time_s;  // first scheduled -> finished
  Histogram request_prefill_time_s;    // first scheduled -> first token
  Histogram request_decode_time_s;     // first token -> finished
  Histogram request_prompt_tokens;     // 1-2-5 buckets up to max_model_len
  Histogram request_generation_tokens;
  Histogram request_params_max_tokens;
  Histogram iteration_tokens_total;  // tokens per step
  Histogram adapters_per_step;       // distinct adapters per step; bounds 0, 1, .. max_loras
};

class Engine {
 public:
  /// Takes the model (its KV cache is sized here from options), its tokenizer (may be null: then
  /// prompts are ids, no text comes back and stop strings are refused) and the EOS ids. Throws
  /// when options do not fit the model (see engine_decoder_options). Starts the step loop
  /// thread.
  Engine(std::unique_ptr<model::ModelExecutor> model, std::shared_ptr<const Tokenizer> tokenizer,
         std::vector<int32_t> eos_token_ids, EngineOptions options);
  /// Aborts everything in flight and stops the loop.
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  /// Thread-safe. Throws RequestError naming the value and the limit: empty prompt, prompt +
  /// max_tokens over max_model_len, an adapter that is not loaded, sampling values out of range.
  RequestHandle submit(Request request);
  /// Submits every request atomically: all are checked first (an error names the index and
  /// nothing is submitted) and the step loop sees them together, as `generate` needs.
  std::vector<RequestHandle> submit_all(std::vector<Request> requests);

  /// Loads (and validates) a PEFT adapter while serving; throws loraplex::Error naming the
  /// adapter and the problem, and then nothing changes.
  AdapterInfo load_adapter(const std::string& name, const std::string& dir);
  /// Forgets an adapter: new requests for it are refused; requests in flight finish first.
  /// Returns false when it was not loaded.
  bool unload_adapter(const std::string& name);
  /// Waits until an adapter being unloaded is gone (its last request has ended), so that the
  /// name can be loaded again. True at once when `name` is not being unloaded; false when it
  /// still is after `timeout`.
  bool wait_until_unloaded(const std::string& name, std::chrono::milliseconds timeout) const;
  bool has_adapter(const std::string& name) const;
  std::vector<AdapterInfo> list_adapters() const;

  EngineMetrics metrics() const;
  const EngineOptions& options() const;
  const model::ModelConfig& model_config() const;
  /// Throws when the engine has no tokenizer.
  const Tokenizer& tokenizer() const;
  bool has_tokenizer() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace loraplex::engine
