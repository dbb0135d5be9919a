// The prompt encoding rules every caller shares (tokenizer/prompt_encoding.h), on the tiny
// Llama's tokenizer (a BOS in front with special tokens): what truncation keeps, what -1 means,
// and the errors' wording.

#include "loraplex/tokenizer/prompt_encoding.h"

#include <gtest/gtest.h>

#include <string>
#include <string_view>
#include <vector>

#include "loraplex/tokenizer/tokenizer.h"

namespace loraplex::tokenizer {
namespace {

const Tokenizer& tiny() {
  static const Tokenizer t = Tokenizer::from_file(std::string(LORAPLEX_TEST_DATA_DIR) +
                                                  "/tiny-llama/model/tokenizer.json");
  return t;
}

std::vector<int32_t> encode_with(std::string_view text, const PromptEncoding& how) {
  return encode_prompt([](std::string_view t, bool s) { return tiny().encode(t, s); }, text, how);
}

constexpr std::string_view kText = "the quick brown fox jumps over the lazy dog";

TEST(PromptEncoding, WithoutTruncationItIsTheTokenizersEncoding) {
  EXPECT_EQ(encode_with(kText, {}), tiny().encode(kText, true));
  PromptEncoding plain;
  plain.add_special_tokens = false;
  EXPECT_EQ(encode_with(kText, plain), tiny().encode(kText, false));
}

TEST(PromptEncoding, TruncationKeepsTheSpecialPrefixAndTheLastTokens) {
  const std::vector<int32_t> all = tiny().encode(kText, true);
  const std::vector<int32_t> plain = tiny().encode(kText, false);
  ASSERT_EQ(all.size(), plain.size() + 1) << "the test expects one BOS in front";
  PromptEncoding how;
  how.truncate_to = 3;
  const std::vector<int32_t> want = {all[0], plain[plain.size() - 2], plain.back()};
  EXPECT_EQ(encode_with(kText, how), want);
  how.add_special_tokens = false;  // nothing in front to keep: the last 3
  EXPECT_EQ(encode_with(kText, how), std::vector<int32_t>(plain.end() - 3, plain.end()));
}

TEST(PromptEncoding, MinusOneTruncatesToTheModelLength) {
  const std::vector<int32_t> all = tiny().encode(kText, true);
  PromptEncoding how;
  how.truncate_to = -1;
  how.max_model_len = 4;
  const std::vector<int32_t> got = encode_with(kText, how);
  ASSERT_EQ(got.size(), 4u);
  EXPECT_EQ(got.front(), all.front());
  EXPECT_EQ(got.back(), all.back());
  how.max_model_len = 1000;  // longer than the prompt: unchanged
  EXPECT_EQ(encode_with(kText, how), all);
}

TEST(PromptEncoding, ErrorsSayWhatWentWrong) {
  PromptEncoding plain;
  plain.add_special_tokens = false;
  try {
    encode_with("", plain);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "the prompt encodes to no tokens");
  }
  try {
    encode_with("bad \xff utf-8", {});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("cannot tokenize the prompt: ", 0), 0u) << e.what();
  }
}

TEST(PromptEncoding, TruncatePromptLeftKeepsAtMostKWithTheFixedPrefix) {
  std::vector<int32_t> ids = {1, 2, 3, 4, 5, 6};
  truncate_prompt_left(ids, 1, 3, 0);
  EXPECT_EQ(ids, (std::vector<int32_t>{1, 5, 6}));
  ids = {1, 2, 3};
  truncate_prompt_left(ids, 5, 2, 0);  // a prefix longer than k keeps only k
  EXPECT_EQ(ids, (std::vector<int32_t>{1, 2}));
  ids = {1, 2};
  truncate_prompt_left(ids, 0, 5, 0);
  EXPECT_EQ(ids, (std::vector<int32_t>{1, 2}));
}

}  // namespace
}  // namespace loraplex::tokenizer
