// Request parsing: valid bodies become the engine request they describe; every invalid one is
// a 400 naming the field.

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "loraplex/server/api_error.h"
#include "loraplex/server/openai_request.h"

namespace loraplex::server {
namespace {

using json = nlohmann::ordered_json;

TEST(OpenAIRequest, CompletionFieldsReachTheEngineRequest) {
  const GenerationRequest r = parse_completion_request(R"({
    "model": "sql", "prompt": "SELECT", "max_tokens": 33, "temperature": 0.7, "top_p": 0.9,
    "top_k": 40, "min_p": 0.05, "seed": 7, "stop": ["\n\n", "END"], "stop_token_ids": [2, 5],
    "ignore_eos": true, "min_tokens": 3, "logprobs": 0, "stream": true,
    "stream_options": {"include_usage": true}, "user": "u", "unknown_field": [1]})");
  EXPECT_EQ(r.kind, GenerationRequest::Kind::kCompletion);
  EXPECT_EQ(r.model, "sql");
  EXPECT_EQ(r.prompt, "SELECT");
  EXPECT_EQ(r.options.max_tokens, 33);
  EXPECT_TRUE(r.max_tokens_given);
  EXPECT_FLOAT_EQ(r.options.temperature, 0.7f);
  EXPECT_FLOAT_EQ(r.options.top_p, 0.9f);
  EXPECT_EQ(r.options.top_k, 40);
  EXPECT_FLOAT_EQ(r.options.min_p, 0.05f);
  ASSERT_TRUE(r.options.seed.has_value());
  EXPECT_EQ(*r.options.seed, 7u);
  EXPECT_EQ(r.options.stop, (std::vector<std::string>{"\n\n", "END"}));
  EXPECT_EQ(r.options.stop_token_ids, (std::vector<int32_t>{2, 5}));
  EXPECT_TRUE(r.options.ignore_eos);
  EXPECT_EQ(r.options.min_tokens, 3);
  EXPECT_TRUE(r.options.logprobs);
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
}

TEST(OpenAIRequest, PromptForms) {
  EXPECT_EQ(parse_completion_request(R"({"prompt": [1, 2, 3]})").prompt_ids,
            (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(parse_completion_request(R"({"prompt": ["one"]})").prompt, "one");
  EXPECT_EQ(parse_completion_request(R"({"prompt": [[9, 8]]})").prompt_ids,
            (std::vector<int32_t>{9, 8}));
  const GenerationRequest d = parse_completion_request(R"({"prompt": "x", "stop": "S"})");
  EXPECT_EQ(d.options.stop, std::vector<std::string>{"S"});
  EXPECT_FALSE(d.max_tokens_given);
  EXPECT_EQ(parse_completion_request(R"({"prompt": "x", "top_k": -1})").options.top_k, 0);
  EXPECT_EQ(parse_completion_request(R"({"prompt": "x", "max_tokens": 4.0})").options.max_tokens,
            4);
}

TEST(OpenAIRequest, ChatFields) {
  const GenerationRequest r = parse_chat_request(R"({
    "messages": [{"role": "system", "content": "s"},
                 {"role": "user", "content": [{"type": "text", "text": "a"},
                                              {"type": "text", "text": "b"}]},
                 {"role": "assistant", "content": null, "tool_calls": []}],
    "max_tokens": 5, "max_completion_tokens": 9, "add_generation_prompt": false,
    "chat_template_kwargs": {"enable_thinking": false}, "logprobs": true, "top_logprobs": 0})");
  EXPECT_EQ(r.kind, GenerationRequest::Kind::kChat);
  EXPECT_EQ(r.options.max_tokens, 9);  // max_completion_tokens wins
  EXPECT_EQ(r.messages[1]["content"], "a\nb");
  EXPECT_EQ(r.messages[2]["content"], "");
  EXPECT_TRUE(r.messages[2].contains("tool_calls"));
  EXPECT_FALSE(r.chat.add_generation_prompt);
  EXPECT_EQ(r.chat.kwargs["enable_thinking"], false);
  EXPECT_TRUE(r.logprobs);
  EXPECT_FALSE(r.add_special_tokens);
  const GenerationRequest prefill = parse_chat_request(R"({
    "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "A:"}],
    "add_generation_prompt": false, "continue_final_message": true})");
  EXPECT_TRUE(prefill.chat.continue_final_message);
}

// Structured output as vLLM reads it: response_format, the guided_* fields and
// structured_outputs, one kind per request.
TEST(OpenAIRequest, StructuredOutputFieldsBecomeTheEngineRequestsGrammar) {
  using Kind = engine::StructuredOutput::Kind;
  auto parse = [](const std::string& extra) {
    return parse_completion_request(R"({"prompt": "x", )" + extra + "}").options.structured;
  };
  EXPECT_EQ(parse(R"("max_tokens": 3)").kind, Kind::kNone);
  EXPECT_EQ(parse(R"("response_format": {"type": "text"})").kind, Kind::kNone);
  EXPECT_EQ(parse(R"("response_format": {"type": "json_object"})").kind, Kind::kAnyJson);
  const auto rf = parse(
      R"("response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}})");
  EXPECT_EQ(rf.kind, Kind::kJson);
  EXPECT_EQ(nlohmann::json::parse(rf.spec), nlohmann::json::parse(R"({"type": "integer"})"));
  EXPECT_TRUE(rf.any_whitespace);
  const auto gj = parse(R"("guided_json": "{\"type\": \"string\"}")");
  EXPECT_EQ(gj.kind, Kind::kJson);
  EXPECT_EQ(nlohmann::json::parse(gj.spec), nlohmann::json::parse(R"({"type": "string"})"));
  const auto gr = parse(R"("guided_regex": "a+b")");
  EXPECT_EQ(gr.kind, Kind::kRegex);
  EXPECT_EQ(gr.spec, "a+b");
  const auto gc = parse(R"("guided_choice": ["yes", "no"])");
  EXPECT_EQ(gc.kind, Kind::kChoice);
  EXPECT_EQ(gc.choices, (std::vector<std::string>{"yes", "no"}));
  const auto gg = parse(R"("guided_grammar": "root ::= \"a\"")");
  EXPECT_EQ(gg.kind, Kind::kGrammar);
  EXPECT_EQ(gg.spec, "root ::= \"a\"");
  const auto so =
      parse(R"("structured_outputs": {"regex": "[0-9]+", "disable_any_whitespace": true})");
  EXPECT_EQ(so.kind, Kind::kRegex);
  EXPECT_FALSE(so.any_whitespace);
  // Whitespace off for a response_format schema, given beside it.
  const auto both = parse(
      R"("response_format": {"type": "json_object"}, "structured_outputs": {"disable_any_whitespace": true})");
  EXPECT_EQ(both.kind, Kind::kAnyJson);
  EXPECT_FALSE(both.any_whitespace);
  EXPECT_EQ(parse(R"("structured_outputs": {"json_object": true})").kind, Kind::kAnyJson);

  const std::vector<std::pair<std::string, std::string>> refused = {
      {R"("guided_regex": "a", "guided_choice": ["b"])", "guided_choice"},
      {R"("response_format": {"type": "json_object"}, "guided_json": {})", "guided_json"},
      {R"("response_format": {"type": "structural_tag"})", "response_format"},
      {R"("response_format": {"type": "json_schema"})", "response_format"},
      {R"("response_format": {"type": "json_schema", "json_schema": {"name": "n"}})",
       "response_format"},
      {R"("response_format": "json")", "response_format"},
      {R"("guided_json": 3)", "guided_json"},
      {R"("guided_json": "{not json")", "guided_json"},
      {R"("guided_choice": [])", "guided_choice"},
      {R"("guided_choice": ["a", 1])", "guided_choice"},
      {R"("guided_regex": "")", "guided_regex"},
      {R"("structured_outputs": {"whitespace_pattern": "x"})",
       "structured_outputs.whitespace_pattern"},
      {R"("structured_outputs": {"json_object": "yes"})", "structured_outputs.json_object"},
      {R"("structured_outputs": [1])", "structured_outputs"},
  };
  for (const auto& [extra, param] : refused) {
    try {
      parse(extra);
      ADD_FAILURE() << "accepted: " << extra;
    } catch (const ApiException& e) {
      EXPECT_EQ(e.error().status, 400) << extra;
      EXPECT_EQ(e.error().param, param) << extra;
      EXPECT_NE(e.error().message.find(param.substr(param.find('.') + 1)), std::string::npos)
          << e.error().message;
    }
  }
}

// Every vLLM field loraplex does not implement: refused (400 naming it) unless absent, null or
// at the value that changes nothing.
TEST(OpenAIRequest, UnimplementedVllmFieldsAreRefusedUnlessNeutral) {
  const std::vector<std::pair<std::string, std::string>> refused = {
      {"use_beam_search", "true"},
      {"length_penalty", "0.5"},
      {"logits_processors", R"(["a.b"])"},
      {"structural_tag", R"("{}")"},
      {"guided_whitespace_pattern", R"("\\s*")"},
      {"prompt_logprobs", "0"},
      {"return_tokens_as_token_ids", "true"},
      {"priority", "1"},
      {"cache_salt", R"("s")"},
      {"kv_transfer_params", "{}"},
      {"vllm_xargs", R"({"a": 1})"},
      {"prompt_embeds", R"("AAAA")"},
      {"mm_processor_kwargs", R"({"a": 1})"},
      {"reasoning_effort", R"("low")"},
      {"include_reasoning", "false"},
      {"functions", "[]"},
      {"function_call", R"("auto")"},
      {"audio", "{}"},
      {"modalities", R"(["text", "audio"])"},
      {"prediction", "{}"},
  };
  for (const auto& [name, value] : refused) {
    for (const bool chat : {false, true}) {
      const std::string body =
          std::string(chat ? R"({"messages": [{"role": "user", "content": "x"}])"
                           : R"({"prompt": "x")") +
          ", \"" + name + "\": " + value + "}";
      try {
        chat ? parse_chat_request(body) : parse_completion_request(body);
        ADD_FAILURE() << "accepted: " << body;
      } catch (const ApiException& e) {
        EXPECT_EQ(e.error().status, 400) << body;
        EXPECT_EQ(e.error().param, name) << body;
        EXPECT_NE(e.error().message.find(name), std::string::npos) << e.error().message;
      }
    }
  }
  const std::vector<std::pair<std::string, std::string>> neutral = {
      {"use_beam_search", "false"},
      {"length_penalty", "1"},
      {"bad_words", "[]"},
      {"logits_processors", "[]"},
      {"guided_json", "null"},
      {"priority", "0"},
      {"vllm_xargs", "{}"},
      {"include_reasoning", "true"},
      {"modalities", R"(["text"])"},
      {"prompt_logprobs", "null"},
      {"spaces_between_special_tokens", "false"},
      {"guided_decoding_backend", R"("xgrammar")"},
      {"unknown_to_vllm", "[1]"},
  };
  for (const auto& [name, value] : neutral) {
    const std::string body = R"({"prompt": "x", ")" + name + "\": " + value + "}";
    EXPECT_NO_THROW(parse_completion_request(body)) << body;
  }
}

TEST(OpenAIRequest, LogitsProcessingFields) {
  const GenerationRequest r = parse_completion_request(
      R"({"prompt": "x", "presence_penalty": 0.5, "frequency_penalty": -0.25,
          "repetition_penalty": 1.2, "logit_bias": {"5": 10, "17": -150.5},
          "allowed_token_ids": [3, 4], "bad_words": ["foo", " bar"]})");
  EXPECT_FLOAT_EQ(r.options.presence_penalty, 0.5f);
  EXPECT_FLOAT_EQ(r.options.frequency_penalty, -0.25f);
  EXPECT_FLOAT_EQ(r.options.repetition_penalty, 1.2f);
  EXPECT_EQ(r.options.logit_bias, (std::map<int32_t, float>{{5, 10.0f}, {17, -100.0f}}));
  EXPECT_EQ(r.options.allowed_token_ids, (std::vector<int32_t>{3, 4}));
  EXPECT_EQ(r.options.bad_words, (std::vector<std::string>{"foo", " bar"}));
  for (const auto& [body, param] : std::vector<std::pair<std::string, std::string>>{
           {R"({"prompt": "x", "logit_bias": {"a": 1}})", "logit_bias"},
           {R"({"prompt": "x", "logit_bias": {"-1": 1}})", "logit_bias"},
           {R"({"prompt": "x", "logit_bias": {"5": "high"}})", "logit_bias"},
           {R"({"prompt": "x", "logit_bias": [5]})", "logit_bias"},
           {R"({"prompt": "x", "allowed_token_ids": []})", "allowed_token_ids"},
           {R"({"prompt": "x", "allowed_token_ids": [-3]})", "allowed_token_ids"},
           {R"({"prompt": "x", "bad_words": "foo"})", "bad_words"},
           {R"({"prompt": "x", "bad_words": [1]})", "bad_words"},
           {R"({"prompt": "x", "presence_penalty": "a lot"})", "presence_penalty"}}) {
    try {
      parse_completion_request(body);
      ADD_FAILURE() << "accepted: " << body;
    } catch (const ApiException& e) {
      EXPECT_EQ(e.error().param, param) << body;
    }
  }
}

TEST(OpenAIRequest, StopStringOutputSpecialTokensAndTruncation) {
  const GenerationRequest r = parse_completion_request(
      R"({"prompt": "x", "include_stop_str_in_output": true, "skip_special_tokens": false,
          "truncate_prompt_tokens": 5, "add_special_tokens": false})");
  EXPECT_TRUE(r.options.include_stop_str_in_output);
  EXPECT_FALSE(r.options.skip_special_tokens);
  ASSERT_TRUE(r.truncate_prompt_tokens.has_value());
  EXPECT_EQ(*r.truncate_prompt_tokens, 5);
  EXPECT_FALSE(r.add_special_tokens);
  const GenerationRequest d = parse_completion_request(R"({"prompt": "x"})");
  EXPECT_FALSE(d.options.include_stop_str_in_output);
  EXPECT_TRUE(d.options.skip_special_tokens);
  EXPECT_FALSE(d.truncate_prompt_tokens.has_value());
  EXPECT_TRUE(d.add_special_tokens);  // completions: BOS, as vLLM
  EXPECT_FALSE(
      parse_chat_request(R"({"messages": [{"role": "user", "content": "x"}]})").add_special_tokens);
  EXPECT_EQ(parse_completion_request(R"({"prompt": "x", "truncate_prompt_tokens": -1})")
                .truncate_prompt_tokens.value(),
            -1);
  for (const char* bad : {R"({"prompt": "x", "truncate_prompt_tokens": 0})",
                          R"({"prompt": "x", "truncate_prompt_tokens": -2})",
                          R"({"prompt": "x", "include_stop_str_in_output": "yes"})"}) {
    EXPECT_THROW(parse_completion_request(bad), ApiException) << bad;
  }
}

TEST(OpenAIRequest, DeeplyNestedBodiesAreRefusedNotRecursedInto) {
  const std::string deep = R"({"prompt": "x", "user_data": )" + std::string(100000, '[') +
                           std::string(100000, ']') + "}";
  try {
    parse_completion_request(deep);
    FAIL() << "accepted";
  } catch (const ApiException& e) {
    EXPECT_EQ(e.error().status, 400);
    EXPECT_NE(std::string(e.what()).find("nests deeper"), std::string::npos) << e.what();
  }
}

TEST(OpenAIRequest, InvalidBodiesAre400NamingTheField) {
  struct Case {
    bool chat;
    const char* body;
    const char* param;  // "" when the error names no field
  };
  const Case cases[] = {
      {false, R"({"prompt": "x",)", ""},
      {false, R"([1, 2])", ""},
      {false, R"({"max_tokens": 3})", "prompt"},
      {false, R"({"prompt": ""})", "prompt"},
      {false, R"({"prompt": []})", "prompt"},
      {false, R"({"prompt": ["a", "b"]})", "prompt"},
      {false, R"({"prompt": [1, -2]})", "prompt"},
      {false, R"({"prompt": {"a": 1}})", "prompt"},
      {false, R"({"prompt": "x", "model": 3})", "model"},
      {false, R"({"prompt": "x", "max_tokens": 0})", "max_tokens"},
      {false, R"({"prompt": "x", "max_tokens": "5"})", "max_tokens"},
      {false, R"({"prompt": "x", "max_tokens": 1.5})", "max_tokens"},
      {false, R"({"prompt": "x", "temperature": -0.1})", "temperature"},
      {false, R"({"prompt": "x", "temperature": "hot"})", "temperature"},
      {false, R"({"prompt": "x", "top_p": 0})", "top_p"},
      {false, R"({"prompt": "x", "top_p": 1.5})", "top_p"},
      {false, R"({"prompt": "x", "top_k": -2})", "top_k"},
      {false, R"({"prompt": "x", "n": 129})", "n"},
      {false, R"({"prompt": "x", "best_of": 3})", "best_of"},
      {false, R"({"prompt": "x", "stop": 5})", "stop"},
      {false, R"({"prompt": "x", "stop": [""]})", "stop"},
      {false, R"({"prompt": "x", "stop_token_ids": [1.5]})", "stop_token_ids"},
      {false, R"({"prompt": "x", "stream": "yes"})", "stream"},
      {false, R"({"prompt": "x", "stream_options": {"include_usage": true}})", "stream_options"},
      {false, R"({"prompt": "x", "logprobs": 21})", "logprobs"},
      {false, R"({"prompt": "x", "min_tokens": 9, "max_tokens": 3})", "min_tokens"},
      {false, R"({"prompt": "x", "echo": true})", "echo"},
      {false, R"({"prompt": "x", "suffix": "tail"})", "suffix"},
      {true, R"({"messages": []})", "messages"},
      {true, R"({"messages": "hi"})", "messages"},
      {true, R"({"messages": [{"content": "no role"}]})", "messages[0].role"},
      {true, R"({"messages": [{"role": "user", "content": 5}]})", "messages[0].content"},
      {true, R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})",
       "messages[0].content"},
      {true, R"({"messages": [{"role": "user", "content": "q"}], "top_logprobs": 3})",
       "top_logprobs"},
      {true, R"({"messages": [{"role": "user", "content": "q"}], "continue_final_message": true})",
       "continue_final_message"},
      {true,
       R"({"messages": [{"role": "user", "content": "q"}], "add_generation_prompt": false,
           "continue_final_message": true})",
       "continue_final_message"},
      {true, R"({"messages": [{"role": "user", "content": "q"}], "chat_template": "{{ x }}"})",
       "chat_template"},
      {true, R"({"messages": [{"role": "user", "content": "q"}], "tool_choice": "required"})",
       "tool_choice"},
  };
  for (const Case& c : cases) {
    try {
      if (c.chat) {
        parse_chat_request(c.body);
      } else {
        parse_completion_request(c.body);
      }
      ADD_FAILURE() << "accepted: " << c.body;
    } catch (const ApiException& e) {
      EXPECT_EQ(e.error().status, 400) << c.body;
      EXPECT_EQ(e.error().param, c.param) << c.body << " -> " << e.what();
      const json body = json::parse(error_body(e.error()));
      EXPECT_EQ(body["error"]["code"], 400);
      EXPECT_EQ(body["error"]["type"], "BadRequestError");
      EXPECT_FALSE(body["error"]["message"].get<std::string>().empty());
    }
  }
}

}  // namespace
}  // namespace loraplex::server
