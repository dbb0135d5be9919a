#include "loraplex/engine/structured_output.h"

#include <dlpack/dlpack.h>

#include <xgrammar/xgrammar.h>
#include <algorithm>
#include <bit>
#include <limits>
#include <nlohmann/json.hpp>

namespace loraplex::engine {
namespace {

constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

const char* field_of(StructuredOutput::Kind kind) {
  switch (kind) {
    case StructuredOutput::Kind::kJson:
      return "json schema";
    case StructuredOutput::Kind::kAnyJson:
      return "json object";
    case StructuredOutput::Kind::kRegex:
      return "regex";
    case StructuredOutput::Kind::kChoice:
      return "choice";
    case StructuredOutput::Kind::kGrammar:
      return "grammar";
    case StructuredOutput::Kind::kNone:
    default:
      return "none";
  }
}

}  // namespace

struct GrammarState::Impl {
  xgrammar::GrammarMatcher matcher;
  int64_t vocab_size = 0;
  mutable std::vector<int32_t> bitmask;  // one bit per id: may come next
};

GrammarState::GrammarState(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GrammarState::~GrammarState() = default;

bool GrammarState::accept(int32_t token) { return impl_->matcher.AcceptToken(token); }

bool GrammarState::terminated() const { return impl_->matcher.IsTerminated(); }

void GrammarState::constrain(std::vector<model::LogitAdjustment>& adjust, bool& only_listed) const {
  const int64_t v = impl_->vocab_size;
  std::vector<int32_t>& words = impl_->bitmask;
  int64_t shape = static_cast<int64_t>(words.size());
  DLTensor t{};
  t.data = words.data();
  t.device = DLDevice{kDLCPU, 0};
  t.ndim = 1;
  t.dtype = DLDataType{kDLInt, 32, 1};
  t.shape = &shape;
  impl_->matcher.FillNextTokenBitmask(&t, 0);
  auto allowed = [&](int32_t id) {
    return ((static_cast<uint32_t>(words[static_cast<size_t>(id) / 32]) >> (id % 32)) & 1u) != 0;
  };
  if (only_listed) {
    for (model::LogitAdjustment& a : adjust) {
      if (!allowed(a.id)) a.bias = kMinusInf;
    }
    return;
  }
  // Bits past the vocabulary are cleared, so that whole words can be counted and walked.
  const int64_t tail = v % 32;
  if (tail != 0) words.back() &= static_cast<int32_t>((uint32_t{1} << tail) - 1u);
  int64_t count = 0;
  for (int32_t w : words) count += std::popcount(static_cast<uint32_t>(w));
  // The shorter list: the allowed ids (the rest -inf), or the refused ids at -inf.
  const bool list_allowed = count * 2 <= v;
  std::vector<model::LogitAdjustment> merged;
  merged.reserve(static_cast<size_t>(list_allowed ? count : v - count) + adjust.size());
  size_t next = 0;  // into adjust, sorted by id
  // Takes the request's own entries below `id` (kept when allowed, -inf when refused).
  auto take_below = [&](int64_t id) {
    for (; next < adjust.size() && adjust[next].id < id; ++next) {
      model::LogitAdjustment a = adjust[next];
      const bool ok = allowed(a.id);
      if (!ok) a.bias = kMinusInf;
      if (ok || !list_allowed) merged.push_back(a);
    }
  };
  for (size_t w = 0; w < words.size(); ++w) {
    // The ids to list in this word: the allowed ones, or the refused ones.
    uint32_t bits = static_cast<uint32_t>(words[w]);
    if (!list_allowed) bits = ~bits;
    if (!list_allowed && w + 1 == words.size() && tail != 0) bits &= (uint32_t{1} << tail) - 1u;
    while (bits != 0) {
      const int32_t id = static_cast<int32_t>(w * 32) + std::countr_zero(bits);
      bits &= bits - 1u;
      take_below(id);
      if (next < adjust.size() && adjust[next].id == id) continue;  // taken below, in order
      model::LogitAdjustment a;
      a.id = id;
      a.bias = list_allowed ? 0.0f : kMinusInf;
      merged.push_back(a);
    }
  }
  take_below(v);
  adjust = std::move(merged);
  only_listed = list_allowed;
}

struct GrammarCompiler::Impl {
  std::unique_ptr<xgrammar::GrammarCompiler> compiler;
  int64_t vocab_size = 0;
};

GrammarCompiler::GrammarCompiler(const Tokenizer& tokenizer, int64_t vocab_size,
                                 const std::vector<int32_t>& eos_token_ids)
    : impl_(std::make_unique<Impl>()) {
  // xgrammar reads the vocabulary's strings the way the tokenizer's decoder does (byte-level,
  // byte fallback or raw), from the same tokenizer.json fields as its Hugging Face path.
  const nlohmann::json metadata = nlohmann::json::parse(
      xgrammar::TokenizerInfo::DetectMetadataFromHF(tokenizer.vocabulary_encoding_json()));
  std::vector<std::string> vocab = tokenizer.vocabulary();
  if (static_cast<int64_t>(vocab.size()) > vocab_size)
    vocab.resize(static_cast<size_t>(vocab_size));
  // Special tokens other than EOS are no text: the grammar never allows them.
  for (size_t id = 0; id < vocab.size(); ++id) {
    const bool eos = std::find(eos_token_ids.begin(), eos_token_ids.end(),
                               static_cast<int32_t>(id)) != eos_token_ids.end();
    if (!eos && tokenizer.is_special(static_cast<int32_t>(id))) vocab[id].clear();
  }
  const xgrammar::TokenizerInfo info(
      vocab, static_cast<xgrammar::VocabType>(metadata.at("vocab_type").get<int>()),
      static_cast<int>(vocab_size), eos_token_ids, metadata.at("add_prefix_space").get<bool>());
  // One thread: compiles run on the submitting request's thread. The cache of compiled
  // grammars is bounded (vLLM's default, VLLM_XGRAMMAR_CACHE_MB = 512), so that clients sending
  // ever new schemas cannot grow it without end.
  constexpr int64_t kCacheBytes = int64_t{512} << 20;
  impl_->compiler = std::make_unique<xgrammar::GrammarCompiler>(info, 1, true, kCacheBytes);
  impl_->vocab_size = vocab_size;
}

GrammarCompiler::~GrammarCompiler() = default;

std::unique_ptr<GrammarState> GrammarCompiler::start(const StructuredOutput& output) const {
  using Kind = StructuredOutput::Kind;
  std::optional<xgrammar::CompiledGrammar> compiled;
  try {
    switch (output.kind) {
      case Kind::kJson:
        compiled = impl_->compiler->CompileJSONSchema(output.spec, output.any_whitespace);
        break;
      case Kind::kAnyJson:
        compiled = output.any_whitespace
                       ? impl_->compiler->CompileBuiltinJSONGrammar()
                       : impl_->compiler->CompileJSONSchema(R"({"type": "object"})", false);
        break;
      case Kind::kRegex:
        compiled = impl_->compiler->CompileRegex(output.spec);
        break;
      case Kind::kChoice:
        compiled = impl_->compiler->CompileGrammar(choice_grammar(output.choices));
        break;
      case Kind::kGrammar:
        compiled = impl_->compiler->CompileGrammar(output.spec);
        break;
      case Kind::kNone:
      default:
        throw RequestError(RequestError::Kind::kInvalid, "structured output: no grammar given");
    }
  } catch (const RequestError&) {
    throw;
  } catch (const std::exception& e) {
    throw RequestError(RequestError::Kind::kInvalid, std::string("structured output (") +
                                                         field_of(output.kind) +
                                                         ") does not compile: " + e.what());
  }
  auto impl = std::make_unique<GrammarState::Impl>(GrammarState::Impl{
      xgrammar::GrammarMatcher(*compiled, std::nullopt, false, 0), impl_->vocab_size, {}});
  impl->bitmask.assign(static_cast<size_t>((impl_->vocab_size + 31) / 32), 0);
  return std::make_unique<GrammarState>(std::move(impl));
}

std::string choice_grammar(const std::vector<std::string>& choices) {
  if (choices.empty()) {
    throw RequestError(RequestError::Kind::kInvalid, "guided_choice: the list of choices is empty");
  }
  std::string g = "root ::= ";
  for (size_t i = 0; i < choices.size(); ++i) {
    if (i > 0) g += " | ";
    g += '"';
    for (char c : choices[i]) {
      if (c == '\\' || c == '"') g += '\\';
      g += c;
    }
    g += '"';
  }
  return g;
}

}  // namespace loraplex::engine
