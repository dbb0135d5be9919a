// Load and use errors: each message must name the file, the JSON path or the offending value.

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "loraplex/core/error.h"
#include "loraplex/tokenizer/tokenizer.h"

namespace loraplex {
namespace {

std::string data_path(const std::string& name) {
  return std::string(LORAPLEX_TEST_DATA_DIR) + "/tokenizer/" + name;
}

nlohmann::json load_json(const std::string& name) {
  std::ifstream in(data_path(name));
  return nlohmann::json::parse(in);
}

// Checks that `message` contains `part` and prints the whole message when it does not.
#define EXPECT_CONTAINS(message, part)                                                \
  do {                                                                                \
    const std::string m_ = (message);                                                 \
    EXPECT_NE(m_.find(part), std::string::npos) << "message: " << m_ << "\n"          \
                                                << "expected to contain: " << (part); \
  } while (0)

// The message of the loraplex::Error `fn` throws; fails the test when it throws nothing.
template <typename F>
std::string error_of(F&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected loraplex::Error";
  return "";
}

std::string load_error(const nlohmann::json& j, const std::string& origin = "edited.json") {
  return error_of([&] { Tokenizer::from_json(j.dump(), origin); });
}

TEST(TokenizerErrors, MissingFileNamesThePath) {
  const std::string path = data_path("does_not_exist/tokenizer.json");
  const std::string msg = error_of([&] { Tokenizer::from_file(path); });
  EXPECT_CONTAINS(msg, path);
  EXPECT_CONTAINS(msg, "cannot open");
}

TEST(TokenizerErrors, MalformedJsonNamesTheFile) {
  const std::string path = ::testing::TempDir() + "loraplex_malformed_tokenizer.json";
  {
    std::ofstream out(path);
    out << R"({"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0,)";
  }
  const std::string msg = error_of([&] { Tokenizer::from_file(path); });
  std::remove(path.c_str());
  EXPECT_CONTAINS(msg, path);
  EXPECT_CONTAINS(msg, "malformed JSON");
}

TEST(TokenizerErrors, NotAnObject) {
  EXPECT_CONTAINS(error_of([] { Tokenizer::from_json("[1, 2]", "list.json"); }),
                  "list.json: <root> must be a JSON object");
}

TEST(TokenizerErrors, UnsupportedPreTokenizerNamesPathAndType) {
  nlohmann::json j = load_json("llama3_style.json");
  j["pre_tokenizer"] = {{"type", "Whitespace"}};
  const std::string msg = load_error(j);
  EXPECT_CONTAINS(msg, "edited.json: pre_tokenizer.type \"Whitespace\" is not supported");
  EXPECT_CONTAINS(msg, "supported: ByteLevel, Split");
}

TEST(TokenizerErrors, UnsupportedNestedPreTokenizerNamesIndex) {
  nlohmann::json j = load_json("llama3_style.json");
  j["pre_tokenizer"]["pretokenizers"][1] = {{"type", "Punctuation"}, {"behavior", "Isolated"}};
  EXPECT_CONTAINS(load_error(j),
                  "pre_tokenizer.pretokenizers[1].type \"Punctuation\" is not supported");
}

TEST(TokenizerErrors, UnsupportedNormalizerDecoderProcessorModel) {
  nlohmann::json j = load_json("sentencepiece_style.json");
  j["normalizer"]["normalizers"][0] = {{"type", "Lowercase"}};
  EXPECT_CONTAINS(load_error(j), "normalizer.normalizers[0].type \"Lowercase\" is not supported");

  j = load_json("sentencepiece_style.json");
  j["normalizer"] = {{"type", "NFD"}};
  EXPECT_CONTAINS(load_error(j), "normalizer.type \"NFD\" is not supported");

  j = load_json("sentencepiece_style.json");
  j["decoder"] = {{"type", "WordPiece"}, {"prefix", "##"}, {"cleanup", true}};
  EXPECT_CONTAINS(load_error(j), "decoder.type \"WordPiece\" is not supported");

  j = load_json("sentencepiece_style.json");
  j["post_processor"] = {{"type", "BertProcessing"}};
  EXPECT_CONTAINS(load_error(j), "post_processor.type \"BertProcessing\" is not supported");

  j = load_json("sentencepiece_style.json");
  j["model"]["type"] = "Unigram";
  EXPECT_CONTAINS(load_error(j), "model.type \"Unigram\" is not supported; supported: BPE");
}

TEST(TokenizerErrors, BadModelContents) {
  nlohmann::json j = load_json("llama3_style.json");
  j["model"]["merges"][5] = {"Ġ", "no-such-token"};
  EXPECT_CONTAINS(load_error(j),
                  "model.merges[5] refers to a token missing from the "
                  "vocabulary: \"no-such-token\"");

  j = load_json("llama3_style.json");
  j["model"]["merges"][2] = "a b c";
  EXPECT_CONTAINS(load_error(j), "model.merges[2] must be \"left right\"");

  j = load_json("sentencepiece_style.json");
  j["model"]["unk_token"] = "<missing>";
  EXPECT_CONTAINS(load_error(j), "model.unk_token \"<missing>\" is not in the vocabulary");

  j = load_json("sentencepiece_style.json");
  j["model"]["dropout"] = 0.1;
  EXPECT_CONTAINS(load_error(j), "model.dropout must be null or 0");

  j = load_json("sentencepiece_style.json");
  j["model"]["continuing_subword_prefix"] = "##";
  EXPECT_CONTAINS(load_error(j), "model.continuing_subword_prefix is not supported");

  j = load_json("sentencepiece_style.json");
  j.erase("model");
  EXPECT_CONTAINS(load_error(j), "<root> has no member \"model\"");
}

TEST(TokenizerErrors, BadComponentFields) {
  nlohmann::json j = load_json("llama3_style.json");
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed";
  EXPECT_CONTAINS(load_error(j),
                  "pre_tokenizer.pretokenizers[0].pattern.Regex regex "
                  "/(unclosed/ does not compile");

  j = load_json("llama3_style.json");
  j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Sideways";
  EXPECT_CONTAINS(load_error(j),
                  "pre_tokenizer.pretokenizers[0].behavior \"Sideways\" is "
                  "not a split behavior");

  j = load_json("llama3_style.json");
  j["truncation"] = {{"max_length", 16}};
  EXPECT_CONTAINS(load_error(j), "truncation must be null");

  j = load_json("sentencepiece_style.json");
  j["post_processor"]["single"][0]["SpecialToken"]["id"] = "<bos>";
  EXPECT_CONTAINS(load_error(j),
                  "post_processor.single[0].SpecialToken.id \"<bos>\" is "
                  "not listed in special_tokens");

  j = load_json("sentencepiece_style.json");
  j["version"] = "2.0";
  EXPECT_CONTAINS(load_error(j), "version \"2.0\" is not a known tokenizer.json version");
}

TEST(TokenizerErrors, OutOfRangeDecodeIdNamesIdAndVocabSize) {
  if (!LORAPLEX_HAVE_ICU) GTEST_SKIP() << "qwen2_style.json has an NFC normalizer, which needs ICU";
  const Tokenizer tok = Tokenizer::from_file(data_path("qwen2_style.json"));
  const int32_t n = tok.vocab_size();
  ASSERT_EQ(n, 705);
  EXPECT_CONTAINS(error_of([&] {
                    tok.decode({5, n, 7});
                  }),
                  "id 705 is out of range; expected 0 <= id < vocab_size 705");
  EXPECT_CONTAINS(error_of([&] { tok.decode({-3}, false); }), "id -3 is out of range");
  EXPECT_EQ(tok.decode({n - 1}, false), "adapter");
}

TEST(TokenizerErrors, InvalidUtf8InputIsRefused) {
  const Tokenizer tok = Tokenizer::from_file(data_path("llama3_style.json"));
  EXPECT_CONTAINS(error_of([&] { tok.encode("ok \xC3\x28 bad"); }),
                  "not valid UTF-8 (invalid sequence at byte 3 of 9)");
  EXPECT_CONTAINS(error_of([&] { tok.encode("\xED\xA0\x80"); }), "at byte 0");
}

}  // namespace
}  // namespace loraplex
