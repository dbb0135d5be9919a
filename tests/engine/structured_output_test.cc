// Structured output through the Engine on the tiny Llama fixture (CPU, float32): a JSON schema,
// a choice, a regex and an EBNF grammar hold the generated text whatever the model (greedy and
// sampled), with asynchronous scheduling on and off; requests without a grammar in the same
// batch keep PEFT's tokens; what cannot compile is refused naming it. The mask itself: only
// tokens whose text the grammar allows next are left.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <regex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine_test_support.h"
#include "loraplex/engine/engine.h"
#include "loraplex/engine/structured_output.h"

namespace loraplex::test {
namespace {

using engine::Engine;
using engine::FinishReason;
using engine::Request;
using engine::RequestError;
using engine::RequestOutput;
using engine::StructuredOutput;
using Kind = StructuredOutput::Kind;

// Bounded on purpose: a random tiny model must be able to finish inside max_tokens. The name
// has a pattern because xgrammar's JSON strings admit raw control characters other than CR and
// LF, which a strict parser refuses (vLLM with xgrammar gives the same).
const char* const kSchema = R"({
  "type": "object",
  "properties": {
    "name": {"type": "string", "pattern": "^[a-z ]{1,5}$"},
    "size": {"enum": [1, 2, 3]},
    "ok": {"type": "boolean"}
  },
  "required": ["name", "size", "ok"],
  "additionalProperties": false
})";

Request structured_request(Kind kind, const std::string& spec, float temperature = 0.0f,
                           uint64_t seed = 0) {
  Request r;
  r.prompt = "The answer is";
  r.options.max_tokens = 120;
  r.options.temperature = temperature;
  if (temperature > 0.0f) r.options.seed = seed;
  r.options.structured.kind = kind;
  r.options.structured.spec = spec;
  // A random tiny model would fill any allowed whitespace until max_tokens.
  r.options.structured.any_whitespace = false;
  return r;
}

void expect_schema_text(const RequestOutput& out, const std::string& what) {
  ASSERT_EQ(out.finish_reason, FinishReason::kStop) << what << ": " << out.text << out.error;
  nlohmann::json j;
  ASSERT_NO_THROW(j = nlohmann::json::parse(out.text)) << what << ": " << out.text;
  ASSERT_TRUE(j.is_object()) << out.text;
  EXPECT_EQ(j.size(), 3u) << out.text;
  ASSERT_TRUE(j["name"].is_string()) << out.text;
  EXPECT_TRUE(std::regex_match(j["name"].get<std::string>(), std::regex("[a-z ]{1,5}")))
      << out.text;
  ASSERT_TRUE(j["size"].is_number_integer()) << out.text;
  const int size = j["size"].get<int>();
  EXPECT_TRUE(size >= 1 && size <= 3) << out.text;
  EXPECT_TRUE(j["ok"].is_boolean()) << out.text;
}

TEST(StructuredOutput, JsonSchemaHoldsGreedyAndSampledWithAndWithoutAsyncScheduling) {
  for (bool async : {true, false}) {
    engine::EngineOptions o = small_engine_options();
    o.async_scheduling = async;
    auto e = make_fixture_engine("tiny-llama", o, false);
    const RequestOutput greedy = e->submit(structured_request(Kind::kJson, kSchema)).wait();
    expect_schema_text(greedy, async ? "greedy, async" : "greedy");
    for (uint64_t seed = 1; seed <= 4; ++seed) {
      expect_schema_text(e->submit(structured_request(Kind::kJson, kSchema, 1.0f, seed)).wait(),
                         "seed " + std::to_string(seed));
    }
    if (async) continue;
    // The same greedy text either way.
    auto a = make_fixture_engine("tiny-llama", small_engine_options(), false);
    EXPECT_EQ(a->submit(structured_request(Kind::kJson, kSchema)).wait().text, greedy.text);
  }
}

TEST(StructuredOutput, ChoiceRegexAndGrammarHoldTheText) {
  auto e = make_fixture_engine("tiny-llama", small_engine_options(), false);
  for (uint64_t seed = 0; seed < 4; ++seed) {
    const float temperature = seed == 0 ? 0.0f : 1.0f;
    Request choice = structured_request(Kind::kChoice, "", temperature, seed);
    choice.options.structured.choices = {"yes", "no", "a \"quoted\" \\ one"};
    const RequestOutput c = e->submit(choice).wait();
    EXPECT_EQ(c.finish_reason, FinishReason::kStop) << c.text;
    EXPECT_TRUE(c.text == "yes" || c.text == "no" || c.text == "a \"quoted\" \\ one") << c.text;

    const RequestOutput r =
        e->submit(structured_request(Kind::kRegex, "[0-9]{3}-[a-z]{2}", temperature, seed)).wait();
    EXPECT_EQ(r.finish_reason, FinishReason::kStop) << r.text;
    EXPECT_TRUE(std::regex_match(r.text, std::regex("[0-9]{3}-[a-z]{2}"))) << r.text;

    const RequestOutput g =
        e->submit(structured_request(Kind::kGrammar, "root ::= \"x\" (\"ab\" | \"cd\") \"y\"",
                                     temperature, seed))
            .wait();
    EXPECT_EQ(g.finish_reason, FinishReason::kStop) << g.text;
    EXPECT_TRUE(g.text == "xaby" || g.text == "xcdy") << g.text;
  }
}

// A request with a grammar beside the fixture's own: theirs keep PEFT's tokens.
TEST(StructuredOutput, OtherRequestsOfTheBatchKeepTheirTokens) {
  const std::vector<ExpectedLine> expected = read_expected("tiny-llama");
  auto e = make_fixture_engine("tiny-llama", small_engine_options());
  std::vector<Request> requests;
  for (const ExpectedLine& line : expected) {
    requests.push_back(fixture_request(line));
    requests.push_back(structured_request(Kind::kJson, kSchema));
  }
  std::vector<engine::RequestHandle> handles = e->submit_all(std::move(requests));
  for (size_t i = 0; i < handles.size(); ++i) {
    const RequestOutput out = handles[i].wait();
    if (i % 2 == 1) {
      expect_schema_text(out, "beside request " + std::to_string(i / 2));
    } else {
      EXPECT_EQ(out.token_ids, expected[i / 2].output_token_ids) << "request " << i / 2;
    }
  }
}

TEST(StructuredOutput, WhatCannotCompileIsRefusedNamingIt) {
  auto e = make_fixture_engine("tiny-llama", small_engine_options(), false);
  auto refused = [&](Request r) -> std::string {
    try {
      e->submit(std::move(r));
    } catch (const RequestError& err) {
      EXPECT_EQ(err.kind(), RequestError::Kind::kInvalid);
      return err.what();
    }
    ADD_FAILURE() << "accepted";
    return "";
  };
  EXPECT_NE(refused(structured_request(Kind::kJson, "{\"type\": ")).find("json schema"),
            std::string::npos);
  EXPECT_NE(refused(structured_request(Kind::kRegex, "([a-z")).find("regex"), std::string::npos);
  EXPECT_NE(refused(structured_request(Kind::kGrammar, "root ::= (")).find("grammar"),
            std::string::npos);
  EXPECT_NE(refused(structured_request(Kind::kChoice, "")).find("choices is empty"),
            std::string::npos);
  Request with_logprobs = structured_request(Kind::kAnyJson, "");
  with_logprobs.options.logprobs = true;
  EXPECT_NE(refused(with_logprobs).find("structured output"), std::string::npos);
  // The engine still serves.
  expect_schema_text(e->submit(structured_request(Kind::kJson, kSchema)).wait(), "after");
}

TEST(StructuredOutput, ChoiceGrammarEscapesQuotesAndBackslashes) {
  EXPECT_EQ(engine::choice_grammar({"a", "b\"c", "d\\e"}),
            "root ::= \"a\" | \"b\\\"c\" | \"d\\\\e\"");
}

// The mask on its own: after "x" only tokens whose text continues "xaby" / "xcdy" remain, each
// kept id's text a prefix of what may follow, and an allowed_token_ids list is cut down.
TEST(StructuredOutput, TheMaskLeavesOnlyTokensTheGrammarAllows) {
  const auto tok = std::make_shared<Tokenizer>(
      Tokenizer::from_file(fixture_dir("tiny-llama") + "/model/tokenizer.json"));
  const int64_t vocab = tok->vocab_size();
  const engine::GrammarCompiler compiler(*tok, vocab, {1});
  StructuredOutput s;
  s.kind = Kind::kGrammar;
  s.spec = "root ::= \"x\" (\"ab\" | \"cd\") \"y\"";
  auto state = compiler.start(s);
  std::vector<model::LogitAdjustment> adjust;
  bool only_listed = false;
  state->constrain(adjust, only_listed);
  ASSERT_TRUE(only_listed);  // a handful of ids: the allowed ones are listed
  ASSERT_FALSE(adjust.empty());
  int32_t x = -1;
  for (const model::LogitAdjustment& a : adjust) {
    EXPECT_EQ(a.bias, 0.0f);
    const std::string text = tok->decode({a.id});
    EXPECT_TRUE(std::string("xaby").rfind(text, 0) == 0 || std::string("xcdy").rfind(text, 0) == 0)
        << "id " << a.id << " '" << text << "'";
    if (text == "x") x = a.id;
  }
  ASSERT_GE(x, 0) << "the vocabulary has no token \"x\"";
  ASSERT_TRUE(state->accept(x));
  EXPECT_FALSE(state->accept(x)) << "a second x is not in the grammar";
  // With allowed_token_ids: the listed ids the grammar refuses become -inf, the rest stay.
  const int32_t a = *tok->token_to_id("a");
  const int32_t ab = *tok->token_to_id("ab");
  const int32_t c = *tok->token_to_id("c");
  adjust = {
      {a, 0.5f, 1.0f, 0.0f}, {c, 0.5f, 1.0f, 0.0f}, {x, 0.5f, 1.0f, 0.0f}, {ab, 0.5f, 1.0f, 0.0f}};
  std::sort(
      adjust.begin(), adjust.end(),
      [](const model::LogitAdjustment& l, const model::LogitAdjustment& r) { return l.id < r.id; });
  only_listed = true;
  state->constrain(adjust, only_listed);
  EXPECT_TRUE(only_listed);
  ASSERT_EQ(adjust.size(), 4u);
  for (const model::LogitAdjustment& e : adjust) {
    if (e.id == x) {
      EXPECT_TRUE(std::isinf(e.bias) && e.bias < 0) << "x after x";
    } else {
      EXPECT_EQ(e.bias, 0.5f) << tok->decode({e.id});
    }
  }
  // Without a list, most of the vocabulary is refused after "xab": the allowed ids are listed.
  ASSERT_TRUE(state->accept(ab));
  adjust.clear();
  only_listed = false;
  state->constrain(adjust, only_listed);
  EXPECT_TRUE(only_listed);
  ASSERT_EQ(adjust.size(), 1u);
  EXPECT_EQ(tok->decode({adjust[0].id}), "y");
  ASSERT_TRUE(state->accept(adjust[0].id));
  // Complete: only EOS (id 1 here) may follow, and accepting it ends the grammar.
  adjust.clear();
  only_listed = false;
  state->constrain(adjust, only_listed);
  ASSERT_EQ(adjust.size(), 1u);
  EXPECT_EQ(adjust[0].id, 1);
  EXPECT_FALSE(state->terminated());
  ASSERT_TRUE(state->accept(1));
  EXPECT_TRUE(state->terminated());
}

// A grammar that allows most of the vocabulary: the refused ids are listed at -inf instead,
// merged with the request's own adjustments (logit_bias) in id order.
TEST(StructuredOutput, AWideMaskListsTheRefusedIdsMergedWithTheRequestsOwn) {
  const auto tok = std::make_shared<Tokenizer>(
      Tokenizer::from_file(fixture_dir("tiny-llama") + "/model/tokenizer.json"));
  const int64_t vocab = tok->vocab_size();
  const engine::GrammarCompiler compiler(*tok, vocab, {1});
  StructuredOutput s;
  s.kind = Kind::kRegex;
  s.spec = "[^x]*";  // everything but an x
  auto state = compiler.start(s);
  const int32_t a = *tok->token_to_id("a");
  const int32_t x = *tok->token_to_id("x");
  std::vector<model::LogitAdjustment> adjust = {{a, 2.0f, 1.0f, 0.0f}, {x, 3.0f, 1.0f, 0.0f}};
  bool only_listed = false;
  state->constrain(adjust, only_listed);
  EXPECT_FALSE(only_listed);
  ASSERT_FALSE(adjust.empty());
  EXPECT_LT(static_cast<int64_t>(adjust.size()), vocab / 2);
  for (size_t i = 1; i < adjust.size(); ++i) EXPECT_LT(adjust[i - 1].id, adjust[i].id);
  bool saw_a = false;
  bool saw_x = false;
  for (const model::LogitAdjustment& e : adjust) {
    if (e.id == a) {
      saw_a = true;
      EXPECT_EQ(e.bias, 2.0f);
    } else {
      EXPECT_TRUE(std::isinf(e.bias) && e.bias < 0) << e.id << " '" << tok->decode({e.id}) << "'";
      if (e.id == x) saw_x = true;
      // Every refused token's text holds an x, is a special token other than EOS, or is a
      // byte that cannot start a UTF-8 character (it decodes to U+FFFD alone).
      const std::string text = tok->decode({e.id}, false);
      EXPECT_TRUE(text.find('x') != std::string::npos || tok->is_special(e.id) ||
                  text == "\xEF\xBF\xBD")
          << e.id << " '" << text << "'";
    }
  }
  EXPECT_TRUE(saw_a);
  EXPECT_TRUE(saw_x);
}

}  // namespace
}  // namespace loraplex::test
