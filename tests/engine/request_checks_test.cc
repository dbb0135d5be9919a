// What Engine::submit refuses: every refusal names the offending value and the limit.

#include <gtest/gtest.h>

#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "loraplex/core/error.h"
#include "loraplex/engine/request_checks.h"
#include "loraplex/engine/requests.h"

namespace loraplex::test {
namespace {

using engine::RequestError;
using engine::RequestLimits;
using engine::RequestOptions;

RequestLimits limits() {
  RequestLimits l;
  l.max_model_len = 100;
  l.kv_cache_tokens = 80;
  l.vocab_size = 1000;
  l.eos_token_ids = {2, 3};
  return l;
}

// Expects `fn` to throw a RequestError of `kind` whose message holds every one of `parts`.
void expect_refused(const std::function<void()>& fn, RequestError::Kind kind,
                    const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "not refused (expected a message with '" << parts.front() << "')";
  } catch (const RequestError& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    for (const std::string& p : parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what() << " lacks " << p;
  }
}

void expect_options_refused(const RequestOptions& o, const std::vector<std::string>& parts,
                            RequestLimits l = limits()) {
  expect_refused([&] { engine::check_request_options(o, l); }, RequestError::Kind::kInvalid, parts);
}

TEST(RequestChecks, SamplingValuesOutOfRangeAreNamed) {
  RequestOptions o;
  EXPECT_NO_THROW(engine::check_request_options(o, limits()));
  o.max_tokens = 0;
  expect_options_refused(o, {"max_tokens 0", ">= 1"});
  o = {};
  o.min_tokens = 20;
  o.max_tokens = 10;
  expect_options_refused(o, {"min_tokens 20", "max_tokens (10)"});
  o = {};
  o.temperature = -0.5f;
  expect_options_refused(o, {"temperature -0.5", ">= 0"});
  o = {};
  o.top_p = 0.0f;
  expect_options_refused(o, {"top_p 0", "(0, 1]"});
  o.top_p = 1.5f;
  expect_options_refused(o, {"top_p 1.5", "(0, 1]"});
  o = {};
  o.top_k = -2;
  expect_options_refused(o, {"top_k -2"});
  o.top_k = -1;  // vLLM's "off"
  EXPECT_NO_THROW(engine::check_request_options(o, limits()));
  o = {};
  o.min_p = -0.1f;
  expect_options_refused(o, {"min_p -0.1", "[0, 1]"});
  o.min_p = 1.5f;
  expect_options_refused(o, {"min_p 1.5", "[0, 1]"});
  o.min_p = 1.0f;
  EXPECT_NO_THROW(engine::check_request_options(o, limits()));
  o = {};
  o.stop_token_ids = {5, 1000};
  expect_options_refused(o, {"stop token id 1000", "[0, 1000)"});
  o = {};
  o.stop = {"ok", ""};
  expect_options_refused(o, {"stop string 1", "empty"});
  RequestLimits no_tok = limits();
  no_tok.has_tokenizer = false;
  o.stop = {"ok"};
  expect_options_refused(o, {"tokenizer"}, no_tok);
}

TEST(RequestChecks, MinTokensBansAtMostEightIds) {
  RequestOptions o;
  o.min_tokens = 4;
  o.stop_token_ids = {10, 11, 12, 13, 14, 15, 2};  // 2 is EOS too: 8 distinct ids
  EXPECT_NO_THROW(engine::check_request_options(o, limits()));
  EXPECT_EQ(engine::min_tokens_banned_ids(o, {2, 3}),
            (std::vector<int32_t>{2, 3, 10, 11, 12, 13, 14, 15}));
  o.stop_token_ids.push_back(16);
  expect_options_refused(o, {"min_tokens 4", "9 token ids", "at most 8"});
  o.ignore_eos = true;  // EOS is not banned then
  EXPECT_NO_THROW(engine::check_request_options(o, limits()));
  o.min_tokens = 0;  // nothing is banned
  o.ignore_eos = false;
  EXPECT_NO_THROW(engine::check_request_options(o, limits()));
}

TEST(RequestChecks, PromptLengthAgainstModelLenAndCache) {
  RequestOptions o;
  o.max_tokens = 30;
  std::vector<int32_t> prompt(50, 7);
  EXPECT_NO_THROW(engine::check_prompt(prompt, o, limits()));
  prompt.assign(75, 7);
  expect_refused([&] { engine::check_prompt(prompt, o, limits()); }, RequestError::Kind::kTooLong,
                 {"prompt (75 tokens)", "max_tokens (30)", "105", "max_model_len 100"});
  prompt.assign(55, 7);
  expect_refused([&] { engine::check_prompt(prompt, o, limits()); }, RequestError::Kind::kTooLong,
                 {"85", "KV cache (80 tokens)"});
  expect_refused([&] { engine::check_prompt({}, o, limits()); }, RequestError::Kind::kInvalid,
                 {"empty"});
  expect_refused(
      [&] {
        engine::check_prompt({1, -3}, o, limits());
      },
      RequestError::Kind::kInvalid, {"prompt token 1", "-3", "[0, 1000)"});
}

TEST(RequestChecks, MaxTokensNearTheIntegerLimitIsRefusedNotWrapped) {
  RequestOptions o;
  const std::vector<int32_t> prompt(10, 7);
  for (const int64_t max_tokens : {std::numeric_limits<int64_t>::max(),
                                   std::numeric_limits<int64_t>::max() - 5, int64_t{1} << 62}) {
    o.max_tokens = max_tokens;
    expect_refused([&] { engine::check_prompt(prompt, o, limits()); }, RequestError::Kind::kTooLong,
                   {"max_tokens (" + std::to_string(max_tokens) + ")", "max_model_len 100"});
  }
  RequestLimits big = limits();
  big.max_model_len = std::numeric_limits<int64_t>::max();
  o.max_tokens = std::numeric_limits<int64_t>::max() - 20;
  expect_refused([&] { engine::check_prompt(prompt, o, big); }, RequestError::Kind::kTooLong,
                 {"KV cache (80 tokens)"});
}

TEST(RequestChecks, TemperaturesBelowVllmsEpsilonAreGreedy) {
  RequestOptions o;
  o.top_k = 40;
  o.top_p = 0.9f;
  o.min_p = 0.2f;
  for (const float t : {0.0f, 1e-40f, 1e-20f, 9.9e-6f}) {
    o.temperature = t;
    const model::SamplingParams p = engine::sampling_params_of(o);
    EXPECT_EQ(p.temperature, 0.0f) << t;
    EXPECT_EQ(p.top_k, 0) << t;
    EXPECT_EQ(p.top_p, 1.0f) << t;
    EXPECT_EQ(p.min_p, 0.0f) << t;
  }
  for (const float t : {1e-5f, 0.7f}) {
    o.temperature = t;
    const model::SamplingParams p = engine::sampling_params_of(o);
    EXPECT_EQ(p.temperature, t);
    EXPECT_EQ(p.top_k, 40);
    EXPECT_EQ(p.top_p, 0.9f);
    EXPECT_EQ(p.min_p, 0.2f);
  }
  o.temperature = 1.0f;
  o.top_k = -1;
  EXPECT_EQ(engine::sampling_params_of(o).top_k, 0);
}

TEST(RequestsFile, MaxTokensIsBoundedBeforeTheEngineSizesForIt) {
  EXPECT_EQ(
      engine::parse_requests(R"({"prompt": "a", "max_tokens": 2147483647})", "f").at(0).max_tokens,
      2147483647);
  for (const char* line :
       {R"({"prompt": "a", "max_tokens": 9223372036854775807})",
        R"({"prompt": "a", "max_tokens": 2147483648})", R"({"prompt": "a", "max_tokens": 0})"}) {
    try {
      engine::parse_requests(line, "f.jsonl");
      ADD_FAILURE() << "accepted: " << line;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("f.jsonl:1: 'max_tokens'"), std::string::npos)
          << e.what();
    }
  }
}

}  // namespace
}  // namespace loraplex::test
