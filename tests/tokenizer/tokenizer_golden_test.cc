// Compares the C++ tokenizer with ids and strings produced by the Hugging Face `tokenizers`
// package (scripts/gen_tokenizer_expectations.py wrote testdata/tokenizer/*.expected.json).

#include <gtest/gtest.h>

#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "loraplex/tokenizer/tokenizer.h"

namespace loraplex {
namespace {

std::string data_path(const std::string& name) {
  return std::string(LORAPLEX_TEST_DATA_DIR) + "/tokenizer/" + name;
}

// Tokenizers with NFC/NFKC normalizers need ICU; builds without it refuse them at load.
bool needs_missing_icu(const std::string& name) {
  if (LORAPLEX_HAVE_ICU) return false;
  std::ifstream in(data_path(name + ".json"));
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return text.find("\"type\": \"NFC\"") != std::string::npos ||
         text.find("\"type\": \"NFKC\"") != std::string::npos ||
         text.find("\"type\":\"NFC\"") != std::string::npos ||
         text.find("\"type\":\"NFKC\"") != std::string::npos;
}

nlohmann::json load_expectations(const std::string& name) {
  std::ifstream in(data_path(name + ".expected.json"));
  EXPECT_TRUE(in.good()) << "missing " << data_path(name + ".expected.json");
  return nlohmann::json::parse(in);
}

std::vector<int32_t> ids_of(const nlohmann::json& j) { return j.get<std::vector<int32_t>>(); }

// Printable form of a text in failure messages (escapes control characters).
std::string show(const std::string& s) {
  std::string out = "\"";
  for (const char c : s.substr(0, 120)) {
    if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\r') {
      out += "\\r";
    } else {
      out += c;
    }
  }
  return out + (s.size() > 120 ? "...\"" : "\"");
}

void expect_encode_matches(const std::string& name) {
  if (needs_missing_icu(name)) GTEST_SKIP() << name << " needs ICU (NFC/NFKC)";
  const nlohmann::json exp = load_expectations(name);
  const Tokenizer tok = Tokenizer::from_file(data_path(name + ".json"));
  ASSERT_GE(exp["encode"].size(), 60u);
  for (const auto& c : exp["encode"]) {
    const std::string text = c["text"];
    EXPECT_EQ(tok.encode(text, true), ids_of(c["ids"])) << name << " text " << show(text);
    EXPECT_EQ(tok.encode(text, false), ids_of(c["ids_no_special"]))
        << name << " text " << show(text) << " without special tokens";
  }
}

// Expects decode to give `expected`; a null expectation marks ids HF's decoder panics on, where
// only the absence of a crash is checked.
void expect_decoded(const Tokenizer& tok, const std::vector<int32_t>& ids, bool skip,
                    const nlohmann::json& expected, const std::string& context) {
  const std::string got = tok.decode(ids, skip);
  if (!expected.is_null()) {
    EXPECT_EQ(got, expected.get<std::string>()) << context;
  }
}

void expect_decode_matches(const std::string& name) {
  if (needs_missing_icu(name)) GTEST_SKIP() << name << " needs ICU (NFC/NFKC)";
  const nlohmann::json exp = load_expectations(name);
  const Tokenizer tok = Tokenizer::from_file(data_path(name + ".json"));
  for (const auto& c : exp["encode"]) {
    const std::string context = name + " text " + show(c["text"]);
    expect_decoded(tok, ids_of(c["ids"]), true, c["decode_skip_special"], context);
    expect_decoded(tok, ids_of(c["ids"]), false, c["decode_keep_special"], context);
  }
  ASSERT_FALSE(exp["decode"].empty());
  for (const auto& c : exp["decode"]) {
    const std::string context = name + " ids " + c["ids"].dump();
    expect_decoded(tok, ids_of(c["ids"]), true, c["skip_special"], context);
    expect_decoded(tok, ids_of(c["ids"]), false, c["keep_special"], context);
  }
  const auto& single = exp["decode_single_keep_special"];
  ASSERT_EQ(single.size(), static_cast<size_t>(tok.vocab_size()));
  for (int32_t id = 0; id < tok.vocab_size(); ++id) {
    expect_decoded(tok, {id}, false, single[id], name + " id " + std::to_string(id));
  }
}

void expect_vocabulary_matches(const std::string& name) {
  if (needs_missing_icu(name)) GTEST_SKIP() << name << " needs ICU (NFC/NFKC)";
  const nlohmann::json exp = load_expectations(name);
  const Tokenizer tok = Tokenizer::from_file(data_path(name + ".json"));
  EXPECT_EQ(tok.vocab_size(), exp["max_id"].get<int32_t>() + 1);
  for (const auto& [token, id] : exp["token_to_id"].items()) {
    EXPECT_EQ(tok.token_to_id(token), std::optional<int32_t>(id.get<int32_t>())) << token;
  }
  EXPECT_EQ(tok.token_to_id("no such token \xE2\x9C\x93"), std::nullopt);
  const auto special = exp["special_ids"].get<std::vector<int32_t>>();
  for (int32_t id = 0; id < tok.vocab_size(); ++id) {
    const bool expected = std::find(special.begin(), special.end(), id) != special.end();
    EXPECT_EQ(tok.is_special(id), expected) << name << " id " << id;
  }
}

TEST(TokenizerByteLevel, TinyLlamaFixtureEncode) { expect_encode_matches("tiny_llama_byte_level"); }
TEST(TokenizerByteLevel, TinyLlamaFixtureDecode) { expect_decode_matches("tiny_llama_byte_level"); }
TEST(TokenizerByteLevel, TinyLlamaFixtureVocabulary) {
  expect_vocabulary_matches("tiny_llama_byte_level");
}

TEST(TokenizerByteLevel, Llama3StyleEncode) { expect_encode_matches("llama3_style"); }
TEST(TokenizerByteLevel, Llama3StyleDecode) { expect_decode_matches("llama3_style"); }
TEST(TokenizerByteLevel, Llama3StyleVocabulary) { expect_vocabulary_matches("llama3_style"); }

TEST(TokenizerByteLevel, Qwen2StyleEncode) { expect_encode_matches("qwen2_style"); }
TEST(TokenizerByteLevel, Qwen2StyleDecode) { expect_decode_matches("qwen2_style"); }
TEST(TokenizerByteLevel, Qwen2StyleVocabulary) { expect_vocabulary_matches("qwen2_style"); }

TEST(TokenizerByteLevel, Gpt2DigitsNfkcEncode) { expect_encode_matches("gpt2_digits_style"); }
TEST(TokenizerByteLevel, Gpt2DigitsNfkcDecode) { expect_decode_matches("gpt2_digits_style"); }
TEST(TokenizerByteLevel, Gpt2DigitsNfkcVocabulary) {
  expect_vocabulary_matches("gpt2_digits_style");
}

TEST(TokenizerSentencePiece, LegacyNormalizerEncode) {
  expect_encode_matches("sentencepiece_style");
}
TEST(TokenizerSentencePiece, LegacyNormalizerDecode) {
  expect_decode_matches("sentencepiece_style");
}
TEST(TokenizerSentencePiece, LegacyNormalizerVocabulary) {
  expect_vocabulary_matches("sentencepiece_style");
}

TEST(TokenizerSentencePiece, MetaspaceEncode) { expect_encode_matches("metaspace_style"); }
TEST(TokenizerSentencePiece, MetaspaceDecode) { expect_decode_matches("metaspace_style"); }
TEST(TokenizerSentencePiece, MetaspaceVocabulary) { expect_vocabulary_matches("metaspace_style"); }

TEST(TokenizerComponents, SplitBehaviorsDigitsMetaspaceUnkEncode) {
  expect_encode_matches("components_style");
}
TEST(TokenizerComponents, ReplaceStripFuseDecode) { expect_decode_matches("components_style"); }
TEST(TokenizerComponents, Vocabulary) { expect_vocabulary_matches("components_style"); }
TEST(TokenizerComponents, NoDecoderJoinsWithSpaces) {
  expect_decode_matches("components_no_decoder");
}
TEST(TokenizerComponents, StripDecoderWithStop) {
  expect_encode_matches("strip_style");
  expect_decode_matches("strip_style");
}

TEST(TokenizerAddedTokens, IdsRederivedAsHfDoes) {
  expect_vocabulary_matches("rederived_ids_style");
  expect_encode_matches("rederived_ids_style");
  expect_decode_matches("rederived_ids_style");
}

// Encoding shares the BPE cache and the compiled regexes across threads: concurrent calls must
// still agree with HF.
TEST(TokenizerConcurrency, ParallelEncodesMatchHf) {
  for (const std::string name : {"qwen2_style", "sentencepiece_style"}) {
    if (needs_missing_icu(name)) continue;
    const nlohmann::json exp = load_expectations(name);
    const Tokenizer tok = Tokenizer::from_file(data_path(name + ".json"));
    std::vector<int> mismatches(4, 0);
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        for (size_t i = t; i < exp["encode"].size(); i += 2) {
          const auto& c = exp["encode"][i];
          if (tok.encode(c["text"].get<std::string>(), true) != ids_of(c["ids"])) ++mismatches[t];
        }
      });
    }
    for (auto& th : threads) th.join();
    EXPECT_EQ(mismatches, std::vector<int>(4, 0)) << name;
  }
}

// Loading from several threads at once compiles regexes concurrently.
TEST(TokenizerConcurrency, ParallelLoads) {
  const nlohmann::json exp = load_expectations("llama3_style");
  const auto& c = exp["encode"][12];
  const std::string text = c["text"];
  std::vector<std::vector<int32_t>> ids(4);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back(
        [&, t] { ids[t] = Tokenizer::from_file(data_path("llama3_style.json")).encode(text); });
  }
  for (auto& th : threads) th.join();
  for (const auto& got : ids) EXPECT_EQ(got, ids_of(c["ids"])) << show(text);
}

}  // namespace
}  // namespace loraplex
