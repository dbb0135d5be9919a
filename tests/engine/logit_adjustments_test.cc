// The adjustments a request's logits processing asks for at each step, against values worked
// out by hand from vLLM's definitions: logit_bias added, allowed ids listed (and the rest
// dropped), repetition over prompt and output ids, frequency per count and presence once per
// generated id, a bad word's last token banned only where the output ends with the rest of it.

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "loraplex/engine/logit_adjustments.h"
#include "loraplex/tokenizer/tokenizer.h"

namespace loraplex::test {
namespace {

using engine::LogitsProcessing;
using engine::RequestOptions;
using model::LogitAdjustment;

const LogitAdjustment* find(const std::vector<LogitAdjustment>& v, int32_t id) {
  for (const LogitAdjustment& e : v)
    if (e.id == id) return &e;
  return nullptr;
}

TEST(LogitsProcessing, NothingAskedNothingAdjusted) {
  const LogitsProcessing p(RequestOptions{}, {1, 2, 3}, nullptr);
  EXPECT_FALSE(p.active());
  std::vector<LogitAdjustment> adjust = {{5, 1.0f, 1.0f, 0.0f}};
  bool only = true;
  p.step({4, 4}, adjust, only);
  EXPECT_TRUE(adjust.empty());
  EXPECT_FALSE(only);
}

TEST(LogitsProcessing, PenaltiesBiasAndAllowedIds) {
  RequestOptions o;
  o.presence_penalty = 0.5f;
  o.frequency_penalty = 0.25f;
  o.repetition_penalty = 1.5f;
  o.logit_bias = {{7, 3.0f}, {9, -100.0f}};
  o.allowed_token_ids = {9, 7, 11, 7};
  const LogitsProcessing p(o, {1, 2, 2}, nullptr);
  ASSERT_TRUE(p.active());
  std::vector<LogitAdjustment> adjust;
  bool only = false;
  p.step({2, 5, 5, 5}, adjust, only);
  EXPECT_TRUE(only);
  for (size_t i = 1; i < adjust.size(); ++i) EXPECT_LT(adjust[i - 1].id, adjust[i].id);
  // Listed for allowed_token_ids alone: neutral values.
  ASSERT_NE(find(adjust, 11), nullptr);
  EXPECT_EQ(find(adjust, 11)->bias, 0.0f);
  EXPECT_EQ(find(adjust, 11)->repetition, 1.0f);
  EXPECT_EQ(find(adjust, 11)->subtract, 0.0f);
  EXPECT_EQ(find(adjust, 7)->bias, 3.0f);
  EXPECT_EQ(find(adjust, 9)->bias, -100.0f);
  // Prompt ids: repetition only; output ids: repetition, and frequency x count + presence.
  EXPECT_EQ(find(adjust, 1)->repetition, 1.5f);
  EXPECT_EQ(find(adjust, 1)->subtract, 0.0f);
  EXPECT_EQ(find(adjust, 2)->subtract, 0.25f * 1 + 0.5f);
  EXPECT_EQ(find(adjust, 5)->subtract, 0.25f * 3 + 0.5f);
  EXPECT_EQ(find(adjust, 5)->repetition, 1.5f);
  EXPECT_EQ(adjust.size(), 6u);  // 1, 2, 5, 7, 9, 11
}

TEST(LogitsProcessing, BadWordsBanTheirLastTokenAfterTheirPrefix) {
  const Tokenizer tok = Tokenizer::from_file(std::string(LORAPLEX_TEST_DATA_DIR) +
                                             "/tiny-llama/model/tokenizer.json");
  RequestOptions o;
  o.bad_words = {"hello world", "x"};
  const std::vector<std::vector<int32_t>> words = LogitsProcessing::bad_word_ids(o.bad_words, tok);
  ASSERT_GE(words.size(), 2u);
  const std::vector<int32_t> hello_world = tok.encode("hello world", false);
  ASSERT_GE(hello_world.size(), 2u) << "the test needs a bad word of several tokens";
  EXPECT_EQ(words.front(), hello_world);
  const LogitsProcessing p(o, {1}, &tok);
  std::vector<LogitAdjustment> adjust;
  bool only = true;
  const float ban = -std::numeric_limits<float>::infinity();
  // A one-token bad word is always banned; the last token of "hello world" only after the rest.
  const std::vector<int32_t> x = tok.encode("x", false);
  ASSERT_EQ(x.size(), 1u);
  p.step({}, adjust, only);
  EXPECT_FALSE(only);
  ASSERT_NE(find(adjust, x[0]), nullptr);
  EXPECT_EQ(find(adjust, x[0])->bias, ban);
  EXPECT_EQ(find(adjust, hello_world.back()), nullptr);
  std::vector<int32_t> out = {5};
  out.insert(out.end(), hello_world.begin(), hello_world.end() - 1);
  p.step(out, adjust, only);
  ASSERT_NE(find(adjust, hello_world.back()), nullptr);
  EXPECT_EQ(find(adjust, hello_world.back())->bias, ban);
  out.push_back(5);
  p.step(out, adjust, only);
  EXPECT_EQ(find(adjust, hello_world.back()), nullptr);
}

}  // namespace
}  // namespace loraplex::test
