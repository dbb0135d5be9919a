#include "loraplex/tokenizer/tokenizer.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "loraplex/core/error.h"
#include "loraplex/tokenizer/added_vocabulary.h"
#include "loraplex/tokenizer/bpe_model.h"
#include "loraplex/tokenizer/decoders.h"
#include "loraplex/tokenizer/json_node.h"
#include "loraplex/tokenizer/normalizers.h"
#include "loraplex/tokenizer/post_processors.h"
#include "loraplex/tokenizer/pre_tokenizers.h"
#include "loraplex/tokenizer/utf8.h"

namespace loraplex {

struct Tokenizer::Impl {
  std::unique_ptr<tok::Normalizer> normalizer;
  std::unique_ptr<tok::PreTokenizer> pre_tokenizer;
  std::unique_ptr<tok::BpeModel> model;
  std::unique_ptr<tok::AddedVocabulary> added;
  std::unique_ptr<tok::PostProcessor> post_processor;
  std::unique_ptr<tok::Decoder> decoder;
  int32_t vocab_size = 0;
  std::string vocabulary_encoding;  // {"decoder", "normalizer", "pre_tokenizer"} of the JSON
};

namespace {

void check_root(const tok::JsonNode& root) {
  if (!root.value().is_object()) root.fail("must be a JSON object (a tokenizer.json)");
  if (root.has("version") && root.at("version").as_string() != "1.0") {
    root.at("version").fail("\"", root.at("version").as_string(),
                            "\" is not a known tokenizer.json version; expected \"1.0\"");
  }
  if (root.has("truncation")) {
    root.at("truncation").fail("must be null: truncation is left to the caller");
  }
  if (root.has("padding")) {
    const tok::JsonNode padding = root.at("padding");
    // Padding to the longest sequence of a batch does nothing to a single encoding.
    const tok::JsonNode strategy = padding.get("strategy");
    if (!(strategy.value().is_string() && strategy.as_string() == "BatchLongest")) {
      padding.fail("must be null or use strategy \"BatchLongest\": padding is left to the caller");
    }
  }
}

}  // namespace

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::from_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  LORAPLEX_CHECK(in.good(), path, ": cannot open tokenizer file (expected a tokenizer.json)");
  std::ostringstream text;
  text << in.rdbuf();
  LORAPLEX_CHECK(!in.bad(), path, ": error while reading the tokenizer file");
  return from_json(text.str(), path);
}

Tokenizer Tokenizer::from_json(const std::string& json_text, const std::string& origin) {
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(json_text);
  } catch (const nlohmann::json::parse_error& e) {
    LORAPLEX_FAIL(origin, ": malformed JSON: ", e.what());
  }
  const tok::JsonNode root(json, "", origin);
  check_root(root);
  auto impl = std::make_unique<Impl>();
  impl->normalizer = tok::make_normalizer(root.get("normalizer"));
  impl->pre_tokenizer = tok::make_pre_tokenizer(root.get("pre_tokenizer"));
  impl->model = std::make_unique<tok::BpeModel>(root.at("model"));
  impl->added = std::make_unique<tok::AddedVocabulary>(root.get("added_tokens"), *impl->model,
                                                       impl->normalizer.get());
  impl->post_processor = tok::make_post_processor(root.get("post_processor"));
  impl->decoder = tok::make_decoder(root.get("decoder"));
  impl->vocab_size = std::max(impl->model->max_id(), impl->added->max_id()) + 1;
  nlohmann::json encoding = nlohmann::json::object();
  for (const char* key : {"decoder", "normalizer", "pre_tokenizer"}) {
    if (json.contains(key)) encoding[key] = json[key];
  }
  impl->vocabulary_encoding = encoding.dump();
  return Tokenizer(std::move(impl));
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  if (const auto bad = tok::find_invalid_utf8(text)) {
    LORAPLEX_FAIL("Tokenizer::encode: input is not valid UTF-8 (invalid sequence at byte ", *bad,
                  " of ", text.size(), ")");
  }
  // The order of Hugging Face's TokenizerImpl::encode_single_sequence: split on raw added
  // tokens, normalize each remaining piece, split on normalized added tokens, pre-tokenize,
  // run the model on each piece, post-process.
  std::vector<tok::Piece> pieces;
  pieces.push_back(tok::Piece{std::string(text), -1, true});
  impl_->added->split_raw(pieces);
  if (impl_->normalizer) {
    for (tok::Piece& p : pieces) {
      if (p.added_id < 0) impl_->normalizer->normalize(p.text);
    }
  }
  impl_->added->split_normalized(pieces);
  if (impl_->pre_tokenizer) impl_->pre_tokenizer->pre_tokenize(pieces);
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  for (const tok::Piece& p : pieces) {
    if (p.added_id >= 0) {
      ids.push_back(p.added_id);
    } else {
      impl_->model->tokenize(p.text, ids);
    }
  }
  if (impl_->post_processor) impl_->post_processor->process(ids, add_special_tokens);
  return ids;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (const int32_t id : ids) {
    LORAPLEX_CHECK(id >= 0 && id < impl_->vocab_size, "Tokenizer::decode: id ", id,
                   " is out of range; expected 0 <= id < vocab_size ", impl_->vocab_size);
    const std::string* token = impl_->added->id_to_token(id);
    if (token == nullptr) token = impl_->model->id_to_token(id);
    // Ids inside the range that name no token (gaps in the vocabulary) are dropped, as in HF.
    if (token == nullptr) continue;
    if (skip_special_tokens && impl_->added->is_special(*token)) continue;
    tokens.push_back(*token);
  }
  if (!impl_->decoder) {
    std::string joined;
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (i > 0) joined += ' ';
      joined += tokens[i];
    }
    return joined;
  }
  impl_->decoder->decode_chain(tokens);
  std::string out;
  for (const std::string& t : tokens) out += t;
  return out;
}

int32_t Tokenizer::vocab_size() const { return impl_->vocab_size; }

std::vector<std::string> Tokenizer::vocabulary() const {
  std::vector<std::string> vocab(static_cast<size_t>(impl_->vocab_size));
  for (int32_t id = 0; id < impl_->vocab_size; ++id) {
    const std::string* token = impl_->added->id_to_token(id);
    if (token == nullptr) token = impl_->model->id_to_token(id);
    if (token != nullptr) vocab[static_cast<size_t>(id)] = *token;
  }
  return vocab;
}

const std::string& Tokenizer::vocabulary_encoding_json() const {
  return impl_->vocabulary_encoding;
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  return impl_->added->token_to_id(token);
}

bool Tokenizer::is_special(int32_t id) const {
  const std::string* token = impl_->added->id_to_token(id);
  if (token == nullptr) token = impl_->model->id_to_token(id);
  return token != nullptr && impl_->added->is_special(*token);
}

}  // namespace loraplex
