// loraplex._C: the online engine (engine/engine.h), the model loader with its progress
// callback (model/load_model.h) and chat templates (template/chat_template.h), for the
// vLLM-style offline API of python/loraplex/llm.py. Every call that waits for the engine, the
// disk or the model releases the GIL.

#include <chrono>
#include <cmath>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "loraplex/core/error.h"
#include "loraplex/engine/engine.h"
#include "loraplex/engine/model_files.h"
#include "loraplex/model/load_model.h"
#include "loraplex/template/chat_template.h"
#include "loraplex/tokenizer/prompt_encoding.h"

namespace loraplex::python {
namespace {

namespace nb = nanobind;

/// A loaded model waiting to be handed to an Engine (which takes it).
struct Model {
  std::string dir;
  std::unique_ptr<model::ModelExecutor> executor;

  model::ModelExecutor& get() const {
    LORAPLEX_CHECK(executor != nullptr, dir, ": this model has been given to an Engine already");
    return *executor;
  }
};

// The progress callback runs on the loading threads: it takes the GIL for each call, and a
// Python exception in it stops the load.
Model load(const std::string& dir, const engine::EngineOptions& options, const std::string& dtype,
           const std::string& device, bool enforce_eager, nb::object progress) {
  const Device dev = Device::parse(device);
  LORAPLEX_CHECK(dev.is_cpu() || cuda_device_count() > dev.index, "device ", device,
                 ": no such CUDA device (", cuda_device_count(), " present",
                 built_with_cuda() ? "" : "; this build has no CUDA backend", ")");
  model::DecoderOptions d = engine::engine_decoder_options(options, dtype_from_name(dtype), dev);
  d.cuda_graphs = !enforce_eager;
  model::LoadProgress report;
  if (!progress.is_none()) {
    // A borrowed handle: copies of the callback (made without the GIL) must not touch its
    // reference count; the caller's reference outlives the load.
    const nb::handle callback = progress;
    report = [callback](int64_t done, int64_t total) {
      nb::gil_scoped_acquire gil;
      try {
        callback(done, total);
      } catch (nb::python_error& e) {
        // Ends the load (Ctrl-C included) with the callback's exception as the message.
        throw Error(std::string("model load stopped by the progress callback: ") + e.what());
      }
    };
  }
  Model m;
  m.dir = dir;
  nb::gil_scoped_release release;
  m.executor = model::load_model(dir, d, report);
  return m;
}

nb::dict adapter_info(const AdapterInfo& a) {
  nb::dict d;
  d["name"] = a.name;
  d["path"] = a.dir;
  d["rank"] = a.rank;
  d["scale"] = a.scale;
  return d;
}

/// The Engine with the model directory's tokenizer and EOS ids.
class PyEngine {
 public:
  PyEngine(Model& model, const engine::EngineOptions& options) {
    const model::ModelConfig config = model.get().config();
    tokenizer_ = engine::read_tokenizer(model.dir);
    eos_ = engine::read_eos_token_ids(model.dir, config);
    engine_ =
        std::make_unique<engine::Engine>(std::move(model.executor), tokenizer_, eos_, options);
  }

  std::vector<engine::RequestHandle> submit_all(std::vector<engine::Request> requests) {
    nb::gil_scoped_release release;
    return get().submit_all(std::move(requests));
  }
  nb::dict load_adapter(const std::string& name, const std::string& dir) {
    AdapterInfo info;
    {
      nb::gil_scoped_release release;
      info = get().load_adapter(name, dir);
    }
    return adapter_info(info);
  }
  bool unload_adapter(const std::string& name) { return get().unload_adapter(name); }
  bool wait_until_unloaded(const std::string& name, double timeout_s) {
    nb::gil_scoped_release release;
    return get().wait_until_unloaded(
        name, std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000.0)));
  }
  bool has_adapter(const std::string& name) { return get().has_adapter(name); }
  std::vector<std::string> adapters() {
    std::vector<std::string> names;
    for (const AdapterInfo& a : get().list_adapters()) names.push_back(a.name);
    return names;
  }
  std::vector<int32_t> encode(const std::string& text, bool add_special_tokens) const {
    return tokenizer_->encode(text, add_special_tokens);
  }
  /// vLLM's truncate_prompt_tokens on a text prompt: the last `truncate_to` tokens (-1:
  /// max_model_len), the special tokens in front kept (tokenizer/prompt_encoding.h).
  std::vector<int32_t> encode_truncated(const std::string& text, bool add_special_tokens,
                                        int64_t truncate_to) {
    tokenizer::PromptEncoding how;
    how.add_special_tokens = add_special_tokens;
    how.truncate_to = truncate_to;
    how.max_model_len = get().options().max_model_len;
    return tokenizer::encode_prompt(
        [&](std::string_view t, bool special) { return tokenizer_->encode(t, special); }, text,
        how);
  }
  /// The same on token ids: the last `truncate_to` of them.
  std::vector<int32_t> truncate_ids(std::vector<int32_t> ids, int64_t truncate_to) {
    tokenizer::truncate_prompt_left(ids, 0, truncate_to, get().options().max_model_len);
    return ids;
  }
  std::string decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const {
    return tokenizer_->decode(ids, skip_special_tokens);
  }
  const engine::EngineOptions& options() { return get().options(); }
  const std::vector<int32_t>& eos_token_ids() const { return eos_; }
  int64_t vocab_size() { return get().model_config().vocab_size; }
  int64_t num_kv_blocks() { return get().metrics().num_kv_blocks; }
  /// Stops the step loop and frees the model (requests in flight end with finish reason abort).
  void shutdown() {
    nb::gil_scoped_release release;
    engine_.reset();
  }
  engine::Engine& get() {
    LORAPLEX_CHECK(engine_ != nullptr, "the engine has been shut down");
    return *engine_;
  }

 private:
  std::shared_ptr<const Tokenizer> tokenizer_;
  std::vector<int32_t> eos_;
  std::unique_ptr<engine::Engine> engine_;
};

engine::StructuredOutput::Kind structured_kind(const std::string& kind) {
  using Kind = engine::StructuredOutput::Kind;
  if (kind == "json") return Kind::kJson;
  if (kind == "json_object") return Kind::kAnyJson;
  if (kind == "regex") return Kind::kRegex;
  if (kind == "choice") return Kind::kChoice;
  if (kind == "grammar") return Kind::kGrammar;
  LORAPLEX_FAIL("structured output kind '", kind,
                "' is not one of json, json_object, regex, choice, grammar");
}

engine::RequestOutput next_output(engine::RequestHandle& h, std::optional<double> timeout_s) {
  nb::gil_scoped_release release;
  if (!timeout_s) return h.next();
  const double ms = std::max(0.0, *timeout_s * 1000.0);
  return h.next(std::chrono::milliseconds(static_cast<int64_t>(std::ceil(ms))));
}

std::string render_chat(const jinja::ChatTemplate& t, const std::string& messages_json,
                        bool add_generation_prompt, bool continue_final_message,
                        const std::string& tools_json, const std::string& kwargs_json) {
  jinja::ChatRenderOptions o;
  o.add_generation_prompt = add_generation_prompt;
  o.continue_final_message = continue_final_message;
  if (!tools_json.empty()) o.tools = nlohmann::ordered_json::parse(tools_json);
  if (!kwargs_json.empty()) o.kwargs = nlohmann::ordered_json::parse(kwargs_json);
  return t.render(nlohmann::ordered_json::parse(messages_json), o);
}

}  // namespace

void bind_engine(nb::module_& m) {
  nb::class_<engine::EngineOptions>(m, "EngineOptions")
      .def(nb::init<>())
      .def_rw("max_num_seqs", &engine::EngineOptions::max_num_seqs)
      .def_rw("max_num_batched_tokens", &engine::EngineOptions::max_num_batched_tokens)
      .def_rw("max_loras", &engine::EngineOptions::max_loras)
      .def_rw("max_lora_rank", &engine::EngineOptions::max_lora_rank)
      .def_rw("max_cpu_loras", &engine::EngineOptions::max_cpu_loras)
      .def_rw("gpu_memory_utilization", &engine::EngineOptions::gpu_memory_utilization)
      .def_rw("num_kv_blocks", &engine::EngineOptions::num_kv_blocks)
      .def_rw("kv_block_size", &engine::EngineOptions::kv_block_size)
      .def_rw("max_model_len", &engine::EngineOptions::max_model_len)
      .def_rw("enable_prefix_caching", &engine::EngineOptions::enable_prefix_caching)
      .def_rw("async_scheduling", &engine::EngineOptions::async_scheduling)
      .def_rw("seed", &engine::EngineOptions::seed)
      .def_rw("lora_evict_after_s", &engine::EngineOptions::lora_evict_after_s)
      .def_rw("tensor_parallel_size", &engine::EngineOptions::tensor_parallel_size)
      .def_rw("fully_sharded_loras", &engine::EngineOptions::fully_sharded_loras);

  nb::class_<Model>(m, "Model")
      .def_prop_ro("kv_block_bytes", [](const Model& mo) { return mo.get().kv_block_bytes(); })
      .def_prop_ro("max_model_len",
                   [](const Model& mo) { return mo.get().options().max_model_len; })
      .def_prop_ro("architecture",
                   [](const Model& mo) {
                     return std::string(model::architecture_name(mo.get().config().arch));
                   })
      .def_prop_ro("is_cuda", [](const Model& mo) { return mo.get().options().device.is_cuda(); });
  m.def("load_model", &load, nb::arg("model_dir"), nb::arg("options"), nb::arg("dtype"),
        nb::arg("device"), nb::arg("enforce_eager"), nb::arg("progress").none());
  m.def("cuda_device_count", &cuda_device_count);
  m.def("built_with_cuda", &built_with_cuda);

  nb::class_<engine::RequestOptions>(m, "RequestOptions")
      .def(nb::init<>())
      .def_rw("max_tokens", &engine::RequestOptions::max_tokens)
      .def_rw("min_tokens", &engine::RequestOptions::min_tokens)
      .def_rw("temperature", &engine::RequestOptions::temperature)
      .def_rw("top_p", &engine::RequestOptions::top_p)
      .def_rw("top_k", &engine::RequestOptions::top_k)
      .def_rw("min_p", &engine::RequestOptions::min_p)
      .def_rw("seed", &engine::RequestOptions::seed)
      .def_rw("stop", &engine::RequestOptions::stop)
      .def_rw("stop_token_ids", &engine::RequestOptions::stop_token_ids)
      .def_rw("ignore_eos", &engine::RequestOptions::ignore_eos)
      .def_rw("logprobs", &engine::RequestOptions::logprobs)
      .def_rw("top_logprobs", &engine::RequestOptions::top_logprobs)
      .def_rw("include_stop_str_in_output", &engine::RequestOptions::include_stop_str_in_output)
      .def_rw("skip_special_tokens", &engine::RequestOptions::skip_special_tokens)
      .def_rw("presence_penalty", &engine::RequestOptions::presence_penalty)
      .def_rw("frequency_penalty", &engine::RequestOptions::frequency_penalty)
      .def_rw("repetition_penalty", &engine::RequestOptions::repetition_penalty)
      .def_rw("logit_bias", &engine::RequestOptions::logit_bias)
      .def_rw("allowed_token_ids", &engine::RequestOptions::allowed_token_ids)
      .def_rw("bad_words", &engine::RequestOptions::bad_words)
      .def(
          "set_structured_output",
          [](engine::RequestOptions& o, const std::string& kind, const std::string& spec,
             const std::vector<std::string>& choices, bool any_whitespace) {
            o.structured.kind = structured_kind(kind);
            o.structured.spec = spec;
            o.structured.choices = choices;
            o.structured.any_whitespace = any_whitespace;
          },
          nb::arg("kind"), nb::arg("spec"), nb::arg("choices"), nb::arg("any_whitespace"),
          "kind: json, json_object, regex, choice or grammar (the engine's StructuredOutput)");

  nb::class_<engine::Request>(m, "Request")
      .def(nb::init<>())
      .def_rw("prompt_ids", &engine::Request::prompt_ids)
      .def_rw("prompt", &engine::Request::prompt)
      .def_rw("adapter", &engine::Request::adapter)
      .def_rw("options", &engine::Request::options);

  nb::class_<engine::RequestOutput>(m, "RequestOutput")
      .def_ro("token_ids", &engine::RequestOutput::token_ids)
      .def_ro("text", &engine::RequestOutput::text)
      .def_ro("logprobs", &engine::RequestOutput::logprobs)
      .def_ro("top_logprobs", &engine::RequestOutput::top_logprobs)
      .def_ro("finished", &engine::RequestOutput::finished)
      .def_prop_ro("finish_reason",
                   [](const engine::RequestOutput& o) -> std::optional<std::string> {
                     if (o.finish_reason == engine::FinishReason::kNone) return std::nullopt;
                     return std::string(engine::finish_reason_name(o.finish_reason));
                   })
      .def_ro("stop_reason", &engine::RequestOutput::stop_reason)
      .def_ro("error", &engine::RequestOutput::error)
      .def_ro("prompt_tokens", &engine::RequestOutput::prompt_tokens)
      .def_ro("completion_tokens", &engine::RequestOutput::completion_tokens)
      .def_ro("cached_tokens", &engine::RequestOutput::cached_tokens);

  nb::class_<engine::RequestHandle>(m, "RequestHandle")
      .def_prop_ro("id", &engine::RequestHandle::id)
      .def_prop_ro("prompt_ids", &engine::RequestHandle::prompt_ids)
      .def("next", &next_output, nb::arg("timeout_s").none() = nb::none(),
           "new output since the last read; waits up to timeout_s (None: until some comes)")
      .def(
          "wait",
          [](engine::RequestHandle& h) {
            nb::gil_scoped_release release;
            return h.wait();
          },
          "waits for the end; everything not yet read")
      .def("abort", &engine::RequestHandle::abort);

  nb::class_<PyEngine>(m, "Engine")
      .def(nb::init<Model&, const engine::EngineOptions&>(), nb::arg("model"), nb::arg("options"))
      .def("submit_all", &PyEngine::submit_all, nb::arg("requests"))
      .def("load_adapter", &PyEngine::load_adapter, nb::arg("name"), nb::arg("path"))
      .def("unload_adapter", &PyEngine::unload_adapter, nb::arg("name"))
      .def("wait_until_unloaded", &PyEngine::wait_until_unloaded, nb::arg("name"),
           nb::arg("timeout_s"))
      .def("has_adapter", &PyEngine::has_adapter, nb::arg("name"))
      .def("adapters", &PyEngine::adapters)
      .def("encode", &PyEngine::encode, nb::arg("text"), nb::arg("add_special_tokens"))
      .def("decode", &PyEngine::decode, nb::arg("ids"), nb::arg("skip_special_tokens"))
      .def("encode_truncated", &PyEngine::encode_truncated, nb::arg("text"),
           nb::arg("add_special_tokens"), nb::arg("truncate_to"))
      .def("truncate_ids", &PyEngine::truncate_ids, nb::arg("ids"), nb::arg("truncate_to"))
      .def_prop_ro("options", &PyEngine::options)
      .def_prop_ro("eos_token_ids", &PyEngine::eos_token_ids)
      .def_prop_ro("vocab_size", &PyEngine::vocab_size)
      .def_prop_ro("num_kv_blocks", &PyEngine::num_kv_blocks)
      .def("shutdown", &PyEngine::shutdown);

  nb::class_<jinja::ChatTemplate>(m, "ChatTemplate")
      .def_static("from_file", &jinja::ChatTemplate::from_file, nb::arg("path"),
                  nb::arg("tokenizer_config_path"))
      .def_static("from_tokenizer_config", &jinja::ChatTemplate::from_tokenizer_config,
                  nb::arg("path"))
      .def_static("from_source", &jinja::ChatTemplate::from_source, nb::arg("source"),
                  nb::arg("tokenizer_config_path"), nb::arg("origin"))
      .def("render", &render_chat, nb::arg("messages_json"), nb::arg("add_generation_prompt"),
           nb::arg("continue_final_message"), nb::arg("tools_json"), nb::arg("kwargs_json"))
      .def_prop_ro("origin", &jinja::ChatTemplate::origin);
}

}  // namespace loraplex::python
