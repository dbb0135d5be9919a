// The HTTP server end to end against the fake backend: a real server on 127.0.0.1 and a free
// port, driven with an HTTP client and raw sockets. Expected tokens come from the fake's own
// rule (FakeBackend::expected_tokens), never from the server's output.

#include <gtest/gtest.h>
#include <httplib.h>

#include <thread>

#include <nlohmann/json.hpp>

#include "server_test_support.h"

namespace loraplex::server {
namespace {

using json = nlohmann::ordered_json;
using testing::Events;
using testing::FakeBackend;
using testing::parse_sse;
using testing::RawConnection;
using testing::ServerTest;

TEST_F(ServerTest, HealthVersionAndModels) {
  start();
  backend_.load_adapter("sql", (lora_dir_ / "sql").string());
  auto c = client();
  auto health = c.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  auto version = c.Get("/version");
  ASSERT_TRUE(version);
  EXPECT_EQ(json::parse(version->body).at("version"), "9.9.9");
  auto models = c.Get("/v1/models");
  ASSERT_TRUE(models);
  ASSERT_EQ(models->status, 200);
  const json m = json::parse(models->body);
  EXPECT_EQ(m.at("object"), "list");
  ASSERT_EQ(m.at("data").size(), 2u);
  EXPECT_EQ(m["data"][0]["id"], "base-model");
  EXPECT_EQ(m["data"][0]["root"], "/models/base");
  EXPECT_TRUE(m["data"][0]["parent"].is_null());
  EXPECT_EQ(m["data"][0]["max_model_len"], 400);
  EXPECT_EQ(m["data"][1]["id"], "sql");
  EXPECT_EQ(m["data"][1]["parent"], "base-model");
  EXPECT_EQ(m["data"][1]["root"], (lora_dir_ / "sql").string());
  EXPECT_EQ(m["data"][1]["object"], "model");
}

TEST_F(ServerTest, ApiKeyGuardsTheV1RoutesOnly) {
  start("s3cret");
  auto c = client();
  auto none = c.Get("/v1/models");
  ASSERT_TRUE(none);
  EXPECT_EQ(none->status, 401);
  EXPECT_EQ(error_of(none).at("code"), 401);
  auto wrong = c.Get("/v1/models", {{"Authorization", "Bearer s3creX"}});
  ASSERT_TRUE(wrong);
  EXPECT_EQ(wrong->status, 401);
  auto longer = c.Get("/v1/models", {{"Authorization", "Bearer s3cret!"}});
  ASSERT_TRUE(longer);
  EXPECT_EQ(longer->status, 401);
  auto right = c.Get("/v1/models", {{"Authorization", "Bearer s3cret"}});
  ASSERT_TRUE(right);
  EXPECT_EQ(right->status, 200);
  auto completion = post("/v1/completions", {{"prompt", "x"}});
  ASSERT_TRUE(completion);
  EXPECT_EQ(completion->status, 401);
  EXPECT_EQ(backend_.submitted, 0);
  EXPECT_EQ(c.Get("/health")->status, 200);
  EXPECT_EQ(c.Get("/metrics")->status, 200);
}

TEST_F(ServerTest, MalformedRequestsGetOpenAIErrors) {
  start();
  auto c = client();
  auto bad_json = c.Post("/v1/completions", "{\"prompt\": ", "application/json");
  ASSERT_TRUE(bad_json);
  EXPECT_EQ(bad_json->status, 400);
  const json e = error_of(bad_json);
  EXPECT_EQ(e.at("type"), "BadRequestError");
  EXPECT_EQ(e.at("code"), 400);
  EXPECT_TRUE(e.contains("param"));
  auto wrong_type = post("/v1/completions", {{"prompt", "x"}, {"max_tokens", "ten"}});
  ASSERT_TRUE(wrong_type);
  EXPECT_EQ(wrong_type->status, 400);
  EXPECT_EQ(error_of(wrong_type).at("param"), "max_tokens");
  auto n0 = post("/v1/chat/completions",
                 {{"messages", json::array({{{"role", "user"}, {"content", "x"}}})}, {"n", 0}});
  ASSERT_TRUE(n0);
  EXPECT_EQ(n0->status, 400);
  EXPECT_EQ(error_of(n0).at("param"), "n");
  auto route = c.Get("/v1/nothing");
  ASSERT_TRUE(route);
  EXPECT_EQ(route->status, 404);
  EXPECT_EQ(error_of(route).at("type"), "NotFoundError");
  EXPECT_EQ(backend_.submitted, 0);
}

TEST_F(ServerTest, OversizeBodyIs413) {
  start("", 4096);
  auto r = post("/v1/completions", {{"prompt", std::string(10000, 'a')}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 413);
  EXPECT_EQ(error_of(r).at("code"), 413);
  EXPECT_EQ(backend_.submitted, 0);
}

TEST_F(ServerTest, UnknownModelIs404AndLoraDirResolves) {
  start();
  auto unknown = post("/v1/completions", {{"model", "nobody"}, {"prompt", "x"}});
  ASSERT_TRUE(unknown);
  EXPECT_EQ(unknown->status, 404);
  EXPECT_EQ(error_of(unknown).at("param"), "model");
  auto escape = post("/v1/completions", {{"model", "../sql"}, {"prompt", "x"}});
  ASSERT_TRUE(escape);
  EXPECT_EQ(escape->status, 404);
  // Found in --lora-dir and loaded on first use; the second request finds it loaded.
  for (int i = 0; i < 2; ++i) {
    auto r = post("/v1/completions", {{"model", "pirate"}, {"prompt", "ahoy"}, {"max_tokens", 5}});
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
    EXPECT_EQ(json::parse(r->body)["choices"][0]["text"], expected_completion("ahoy", "pirate", 5));
  }
  EXPECT_EQ(backend_.loads, 1);
  auto broken = post("/v1/completions", {{"model", "broken"}, {"prompt", "x"}});
  ASSERT_TRUE(broken);
  EXPECT_EQ(broken->status, 400);
  EXPECT_NE(error_of(broken).at("message").get<std::string>().find("broken"), std::string::npos);
}

TEST_F(ServerTest, CompletionWholeResponse) {
  start();
  backend_.load_adapter("sql", (lora_dir_ / "sql").string());
  for (const std::string& model : std::vector<std::string>{"base-model", "sql"}) {
    auto r = post("/v1/completions",
                  {{"model", model}, {"prompt", "SELECT"}, {"max_tokens", 7}, {"logprobs", 0}});
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
    const json j = json::parse(r->body);
    EXPECT_EQ(j.at("object"), "text_completion");
    EXPECT_EQ(j.at("model"), model);
    EXPECT_EQ(j.at("id").get<std::string>().rfind("cmpl-", 0), 0u);
    const std::string adapter = model == "sql" ? "sql" : "";
    EXPECT_EQ(j["choices"][0]["text"], expected_completion("SELECT", adapter, 7));
    EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
    EXPECT_EQ(j["usage"]["prompt_tokens"], 7);  // BOS + 6 bytes
    EXPECT_EQ(j["usage"]["completion_tokens"], 7);
    EXPECT_EQ(j["usage"]["total_tokens"], 14);
    EXPECT_EQ(j["choices"][0]["logprobs"]["token_logprobs"].size(), 7u);
    EXPECT_EQ(
        j["choices"][0]["logprobs"]["text_offset"][1],
        static_cast<int64_t>(j["choices"][0]["logprobs"]["tokens"][0].get<std::string>().size()));
  }
}

TEST_F(ServerTest, ReturnTokenIdsWholeAndStreamed) {
  start();
  const std::vector<int32_t> prompt = backend_.encode("SELECT", true);
  const std::vector<int32_t> want = FakeBackend::expected_tokens(prompt, "", 6);
  auto r = post("/v1/completions",
                {{"prompt", "SELECT"}, {"max_tokens", 6}, {"return_token_ids", true}});
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json whole = json::parse(r->body);
  EXPECT_EQ(whole["choices"][0]["token_ids"].get<std::vector<int32_t>>(), want);
  EXPECT_EQ(whole["choices"][0]["prompt_token_ids"].get<std::vector<int32_t>>(), prompt);
  auto plain = post("/v1/completions", {{"prompt", "SELECT"}, {"max_tokens", 6}});
  ASSERT_TRUE(plain);
  EXPECT_FALSE(json::parse(plain->body)["choices"][0].contains("token_ids")) << plain->body;

  // Chat: the prompt's ids at the top level (the first chunk when streaming), the generated
  // ids per choice, as vLLM writes them.
  const json messages = json::array({{{"role", "user"}, {"content", "hi"}}});
  const std::vector<int32_t> chat_prompt =
      backend_.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", false);
  const std::vector<int32_t> chat_want = FakeBackend::expected_tokens(chat_prompt, "", 5);
  auto c = post("/v1/chat/completions",
                {{"messages", messages}, {"max_tokens", 5}, {"return_token_ids", true}});
  ASSERT_TRUE(c);
  ASSERT_EQ(c->status, 200) << c->body;
  const json chat = json::parse(c->body);
  EXPECT_EQ(chat["prompt_token_ids"].get<std::vector<int32_t>>(), chat_prompt);
  EXPECT_EQ(chat["choices"][0]["token_ids"].get<std::vector<int32_t>>(), chat_want);
  for (const bool is_chat : {false, true}) {
    json body = {{"max_tokens", 5}, {"return_token_ids", true}, {"stream", true}};
    if (is_chat) {
      body["messages"] = messages;
    } else {
      body["prompt"] = "SELECT";
    }
    auto s = post(is_chat ? "/v1/chat/completions" : "/v1/completions", body);
    ASSERT_TRUE(s);
    const Events e = parse_sse(s->body);
    ASSERT_TRUE(e.done);
    std::vector<int32_t> ids;
    for (size_t i = 0; i < e.chunks.size(); ++i) {
      const json& choice = e.chunks[i]["choices"][0];
      const json prompt_ids = is_chat ? e.chunks[i].value("prompt_token_ids", json())
                                      : choice.value("prompt_token_ids", json());
      EXPECT_EQ(prompt_ids.is_array(), i == 0) << "chunk " << i << ": " << e.chunks[i].dump();
      if (prompt_ids.is_array()) {
        EXPECT_EQ(prompt_ids.get<std::vector<int32_t>>(), is_chat ? chat_prompt : prompt);
      }
      if (choice.contains("token_ids")) {
        for (const json& id : choice["token_ids"]) ids.push_back(id.get<int32_t>());
      }
    }
    EXPECT_EQ(ids, is_chat ? chat_want : FakeBackend::expected_tokens(prompt, "", 5));
  }
  auto wrong = post("/v1/completions", {{"prompt", "x"}, {"return_token_ids", "yes"}});
  ASSERT_TRUE(wrong);
  EXPECT_EQ(wrong->status, 400);
  EXPECT_EQ(error_of(wrong).at("param"), "return_token_ids");
}

// vLLM's truncate_prompt_tokens keeps a prompt's last tokens (a text prompt keeps its BOS, as a
// tokenizer truncating on the left does); add_special_tokens false leaves BOS out.
TEST_F(ServerTest, TruncatePromptTokensAndAddSpecialTokens) {
  start();
  const auto prompt_of = [&](const json& body) {
    json b = body;
    b["max_tokens"] = 2;
    b["return_token_ids"] = true;
    auto r = post("/v1/completions", b);
    EXPECT_TRUE(r);
    EXPECT_EQ(r->status, 200) << r->body;
    const json j = json::parse(r->body);
    EXPECT_EQ(j["choices"][0]["token_ids"].get<std::vector<int32_t>>(),
              FakeBackend::expected_tokens(
                  j["choices"][0]["prompt_token_ids"].get<std::vector<int32_t>>(), "", 2));
    return j["choices"][0]["prompt_token_ids"].get<std::vector<int32_t>>();
  };
  // The fake encodes bytes, BOS = 1.
  EXPECT_EQ(prompt_of({{"prompt", "abcdef"}, {"truncate_prompt_tokens", 3}}),
            (std::vector<int32_t>{1, 'e', 'f'}));
  EXPECT_EQ(prompt_of({{"prompt", "abcdef"}}),
            (std::vector<int32_t>{1, 'a', 'b', 'c', 'd', 'e', 'f'}));
  EXPECT_EQ(prompt_of({{"prompt", "abcdef"}, {"add_special_tokens", false}}),
            (std::vector<int32_t>{'a', 'b', 'c', 'd', 'e', 'f'}));
  EXPECT_EQ(
      prompt_of(
          {{"prompt", "abcdef"}, {"add_special_tokens", false}, {"truncate_prompt_tokens", 2}}),
      (std::vector<int32_t>{'e', 'f'}));
  EXPECT_EQ(prompt_of({{"prompt", json::array({5, 6, 7, 8})}, {"truncate_prompt_tokens", 2}}),
            (std::vector<int32_t>{7, 8}));
  EXPECT_EQ(prompt_of({{"prompt", "abc"}, {"truncate_prompt_tokens", 10}}),
            (std::vector<int32_t>{1, 'a', 'b', 'c'}));
  // -1: max_model_len (400 here), so a long prompt keeps room for no output: too long.
  auto too_long =
      post("/v1/completions",
           {{"prompt", std::string(500, 'x')}, {"truncate_prompt_tokens", -1}, {"max_tokens", 1}});
  ASSERT_TRUE(too_long);
  EXPECT_EQ(too_long->status, 400);
  auto fits = post("/v1/completions", {{"prompt", std::string(500, 'x')},
                                       {"truncate_prompt_tokens", 300},
                                       {"max_tokens", 1},
                                       {"return_token_ids", true}});
  ASSERT_TRUE(fits);
  ASSERT_EQ(fits->status, 200) << fits->body;
  EXPECT_EQ(json::parse(fits->body)["usage"]["prompt_tokens"], 300);
  // Chat: the rendered prompt's last tokens.
  auto chat = post("/v1/chat/completions",
                   {{"messages", json::array({{{"role", "user"}, {"content", "hello"}}})},
                    {"truncate_prompt_tokens", 4},
                    {"max_tokens", 1}});
  ASSERT_TRUE(chat);
  ASSERT_EQ(chat->status, 200) << chat->body;
  EXPECT_EQ(json::parse(chat->body)["usage"]["prompt_tokens"], 4);
}

// n > 1: one engine request per choice (seed + i each), whole or streamed, the prompt counted
// once in the usage and every choice's tokens.
// Top logprobs in OpenAI's shapes: completions a dict per token (the top ones and the sampled
// one), chat a list per token; the fake ranks the sampled id first.
TEST_F(ServerTest, TopLogprobsInBothShapes) {
  start();
  auto r = post("/v1/completions", {{"prompt", "abc"}, {"max_tokens", 3}, {"logprobs", 2}});
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json lp = json::parse(r->body)["choices"][0]["logprobs"];
  ASSERT_EQ(lp["top_logprobs"].size(), 3u);
  for (size_t t = 0; t < 3; ++t) {
    const json& top = lp["top_logprobs"][t];
    EXPECT_EQ(top.size(), 2u) << top.dump();
    EXPECT_TRUE(top.contains(lp["tokens"][t].get<std::string>())) << top.dump();
  }
  auto c = post("/v1/chat/completions",
                {{"messages", json::array({{{"role", "user"}, {"content", "q"}}})},
                 {"max_tokens", 2},
                 {"logprobs", true},
                 {"top_logprobs", 3}});
  ASSERT_TRUE(c);
  ASSERT_EQ(c->status, 200) << c->body;
  const json content = json::parse(c->body)["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 2u);
  for (const json& item : content) {
    ASSERT_EQ(item["top_logprobs"].size(), 3u) << item.dump();
    EXPECT_EQ(item["top_logprobs"][0]["token"], item["token"]);
    EXPECT_EQ(item["top_logprobs"][0]["logprob"], item["logprob"]);
    EXPECT_TRUE(item["top_logprobs"][1]["bytes"].is_array());
  }
}

TEST_F(ServerTest, SeveralChoices) {
  start();
  const std::string want = expected_completion("abc", "", 5);
  auto whole =
      post("/v1/completions", {{"prompt", "abc"}, {"max_tokens", 5}, {"n", 3}, {"seed", 40}});
  ASSERT_TRUE(whole);
  ASSERT_EQ(whole->status, 200) << whole->body;
  const json j = json::parse(whole->body);
  ASSERT_EQ(j["choices"].size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(j["choices"][i]["index"], i);
    EXPECT_EQ(j["choices"][i]["text"], want);
  }
  EXPECT_EQ(j["usage"]["prompt_tokens"], 4);
  EXPECT_EQ(j["usage"]["completion_tokens"], 15);
  EXPECT_EQ(backend_.seeds(), (std::vector<uint64_t>{40, 41, 42}));
  for (const bool chat : {false, true}) {
    json body = {{"max_tokens", 4}, {"n", 2}, {"stream", true}};
    body["stream_options"] = {{"include_usage", true}};
    if (chat) {
      body["messages"] = json::array({{{"role", "user"}, {"content", "q"}}});
    } else {
      body["prompt"] = "abc";
    }
    auto r = post(chat ? "/v1/chat/completions" : "/v1/completions", body);
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200);
    const testing::Events e = parse_sse(r->body);
    ASSERT_TRUE(e.done);
    std::vector<std::string> texts(2);
    std::vector<int> roles(2, 0);
    std::vector<int> finishes(2, 0);
    for (size_t k = 0; k + 1 < e.chunks.size(); ++k) {
      const json& c = e.chunks[k]["choices"][0];
      const int i = c["index"].get<int>();
      ASSERT_TRUE(i == 0 || i == 1) << c.dump();
      texts[i] += chat ? c["delta"].value("content", "") : c["text"].get<std::string>();
      roles[i] += chat && c["delta"].contains("role");
      finishes[i] += !c["finish_reason"].is_null();
    }
    const std::string expected =
        chat ? FakeBackend::expected_text(FakeBackend::expected_tokens(
                   backend_.encode("<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n", false),
                   "", 4))
             : expected_completion("abc", "", 4);
    for (int i = 0; i < 2; ++i) {
      EXPECT_EQ(texts[i], expected) << "choice " << i << (chat ? " (chat)" : "");
      EXPECT_EQ(finishes[i], 1) << i;
      EXPECT_EQ(roles[i], chat ? 1 : 0) << i;
    }
    EXPECT_EQ(e.chunks.back()["usage"]["completion_tokens"], 8);
  }
  auto best_of = post("/v1/completions", {{"prompt", "x"}, {"n", 2}, {"best_of", 3}});
  ASSERT_TRUE(best_of);
  EXPECT_EQ(best_of->status, 400);
  EXPECT_EQ(error_of(best_of).at("param"), "best_of");
}

TEST_F(ServerTest, LoadingANameStillBeingUnloadedIs409) {
  allow_runtime_loading();
  start();
  backend_.still_unloading = true;
  auto load = post("/v1/load_lora_adapter",
                   {{"lora_name", "sql"}, {"lora_path", (lora_dir_ / "sql").string()}});
  ASSERT_TRUE(load);
  EXPECT_EQ(load->status, 409) << load->body;
  EXPECT_EQ(error_of(load).at("type"), "ConflictError");
  EXPECT_NE(error_of(load).at("message").get<std::string>().find("'sql' is being unloaded"),
            std::string::npos);
  // The --lora-dir resolver waits the same way.
  auto r = post("/v1/completions", {{"model", "pirate"}, {"prompt", "x"}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 409) << r->body;
  EXPECT_EQ(backend_.loads, 0);
  backend_.still_unloading = false;
  load = post("/v1/load_lora_adapter",
              {{"lora_name", "sql"}, {"lora_path", (lora_dir_ / "sql").string()}});
  ASSERT_TRUE(load);
  EXPECT_EQ(load->status, 200) << load->body;
}

TEST_F(ServerTest, PromptIdsAndTooLongPrompts) {
  start();
  const std::vector<int32_t> ids = {5, 6, 7};
  auto r = post("/v1/completions", {{"prompt", ids}, {"max_tokens", 3}});
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(json::parse(r->body)["choices"][0]["text"],
            FakeBackend::expected_text(FakeBackend::expected_tokens(ids, "", 3)));
  auto too_long = post("/v1/completions", {{"prompt", std::string(390, 'x')}, {"max_tokens", 20}});
  ASSERT_TRUE(too_long);
  EXPECT_EQ(too_long->status, 400);
  EXPECT_EQ(error_of(too_long).at("param"), "prompt");
  EXPECT_NE(error_of(too_long).at("message").get<std::string>().find("400"), std::string::npos);
}

TEST_F(ServerTest, ChatRendersTheTemplateAndDefaultsMaxTokensToTheContext) {
  start();
  const json messages = json::array(
      {{{"role", "system"}, {"content", "be brief"}}, {{"role", "user"}, {"content", "hi"}}});
  auto r = post("/v1/chat/completions", {{"messages", messages}});
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = json::parse(r->body);
  const std::string prompt =
      "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
      "<|im_start|>assistant\n";
  const std::vector<int32_t> ids = backend_.encode(prompt, false);
  const int64_t room = 400 - static_cast<int64_t>(ids.size());
  EXPECT_EQ(j.at("object"), "chat.completion");
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(j["choices"][0]["message"]["content"],
            FakeBackend::expected_text(FakeBackend::expected_tokens(ids, "", room)));
  EXPECT_EQ(j["usage"]["prompt_tokens"], static_cast<int64_t>(ids.size()));
  EXPECT_EQ(j["usage"]["completion_tokens"], room);
  // Text parts are joined with newlines (vLLM's string content format).
  auto parts = post(
      "/v1/chat/completions",
      {{"messages", json::array({{{"role", "user"},
                                  {"content", json::array({{{"type", "text"}, {"text", "a"}},
                                                           {{"type", "text"}, {"text", "b"}}})}}})},
       {"max_tokens", 2}});
  ASSERT_TRUE(parts);
  ASSERT_EQ(parts->status, 200) << parts->body;
  const std::vector<int32_t> part_ids =
      backend_.encode("<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n", false);
  EXPECT_EQ(json::parse(parts->body)["choices"][0]["message"]["content"],
            FakeBackend::expected_text(FakeBackend::expected_tokens(part_ids, "", 2)));
  auto image = post(
      "/v1/chat/completions",
      {{"messages",
        json::array({{{"role", "user"}, {"content", json::array({{{"type", "image_url"}}})}}})}});
  ASSERT_TRUE(image);
  EXPECT_EQ(image->status, 400);
}

TEST_F(ServerTest, StreamedCompletionAndChat) {
  start();
  auto r = post("/v1/completions", {{"prompt", "abc"},
                                    {"max_tokens", 9},
                                    {"stream", true},
                                    {"stream_options", {{"include_usage", true}}}});
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200);
  EXPECT_EQ(r->get_header_value("Content-Type"), "text/event-stream");
  Events e = parse_sse(r->body);
  ASSERT_TRUE(e.done);
  ASSERT_GE(e.chunks.size(), 2u);
  std::string text;
  for (size_t i = 0; i + 1 < e.chunks.size(); ++i) {
    text += e.chunks[i]["choices"][0]["text"].get<std::string>();
    const json& fr = e.chunks[i]["choices"][0]["finish_reason"];
    EXPECT_EQ(fr.is_null(), i + 2 < e.chunks.size()) << i;
  }
  EXPECT_EQ(text, expected_completion("abc", "", 9));
  const json& usage = e.chunks.back();
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["completion_tokens"], 9);
  EXPECT_EQ(usage["usage"]["prompt_tokens"], 4);

  auto no_usage = post("/v1/completions", {{"prompt", "abc"}, {"max_tokens", 3}, {"stream", true}});
  ASSERT_TRUE(no_usage);
  const Events e2 = parse_sse(no_usage->body);
  ASSERT_TRUE(e2.done);
  for (const json& c : e2.chunks) EXPECT_FALSE(c.contains("usage") && !c["usage"].is_null());

  auto chat = post("/v1/chat/completions",
                   {{"messages", json::array({{{"role", "user"}, {"content", "q"}}})},
                    {"max_tokens", 4},
                    {"stream", true}});
  ASSERT_TRUE(chat);
  const Events ec = parse_sse(chat->body);
  ASSERT_TRUE(ec.done);
  ASSERT_GE(ec.chunks.size(), 2u);
  EXPECT_EQ(ec.chunks[0]["object"], "chat.completion.chunk");
  EXPECT_EQ(ec.chunks[0]["choices"][0]["delta"]["role"], "assistant");
  std::string content;
  for (const json& c : ec.chunks) content += c["choices"][0]["delta"].value("content", "");
  const std::vector<int32_t> ids =
      backend_.encode("<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n", false);
  EXPECT_EQ(content, FakeBackend::expected_text(FakeBackend::expected_tokens(ids, "", 4)));
  EXPECT_EQ(ec.chunks.back()["choices"][0]["finish_reason"], "length");
}

TEST_F(ServerTest, ClientThatHangsUpMidStreamAbortsItsRequest) {
  backend_.token_delay = std::chrono::milliseconds(3);
  start();
  {
    RawConnection conn(port_);
    ASSERT_TRUE(conn.connected());
    conn.send_post("/v1/completions",
                   json{{"prompt", "long"}, {"max_tokens", 300}, {"stream", true}}.dump());
    const std::string got = conn.read_until("data: ", 3);
    ASSERT_NE(got.find("200 OK"), std::string::npos) << got;
  }  // hang up
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (backend_.active > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(backend_.active, 0);
  EXPECT_EQ(backend_.aborted, 1);
  // Nothing is left running: /metrics says so too.
  auto metrics = client().Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_NE(
      metrics->body.find("vllm:num_requests_running{model_name=\"base-model\",engine=\"0\"} 0.0"),
      std::string::npos)
      << metrics->body;
}

TEST_F(ServerTest, OverloadedIs503) {
  backend_.token_delay = std::chrono::milliseconds(5);
  backend_.max_active = 1;
  start();
  RawConnection conn(port_);
  ASSERT_TRUE(conn.connected());
  conn.send_post("/v1/completions",
                 json{{"prompt", "hold"}, {"max_tokens", 300}, {"stream", true}}.dump());
  conn.read_until("data: ", 1);
  auto r = post("/v1/completions", {{"prompt", "x"}, {"max_tokens", 1}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 503);
  EXPECT_EQ(error_of(r).at("type"), "ServiceUnavailableError");
}

TEST_F(ServerTest, LoadAndUnloadAdapterEndpoints) {
  allow_runtime_loading();
  start();
  const std::string sql = (lora_dir_ / "sql").string();
  auto load = post("/v1/load_lora_adapter", {{"lora_name", "mine"}, {"lora_path", sql}});
  ASSERT_TRUE(load);
  EXPECT_EQ(load->status, 200);
  EXPECT_EQ(load->body, "Success: LoRA adapter 'mine' added successfully.");
  auto again = post("/v1/load_lora_adapter", {{"lora_name", "mine"}, {"lora_path", sql}});
  ASSERT_TRUE(again);
  EXPECT_EQ(again->status, 400);
  EXPECT_EQ(error_of(again).at("type"), "InvalidUserInput");
  auto missing = post("/v1/load_lora_adapter", {{"lora_name", "x"}});
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->status, 400);
  auto nowhere = post("/v1/load_lora_adapter",
                      {{"lora_name", "x"}, {"lora_path", (lora_dir_ / "nowhere").string()}});
  ASSERT_TRUE(nowhere);
  EXPECT_EQ(nowhere->status, 404);
  auto broken = post("/v1/load_lora_adapter",
                     {{"lora_name", "b"}, {"lora_path", (lora_dir_ / "broken").string()}});
  ASSERT_TRUE(broken);
  EXPECT_EQ(broken->status, 400);
  EXPECT_NE(error_of(broken).at("message").get<std::string>().find("adapter_config.json"),
            std::string::npos);
  // The loaded adapter still serves.
  auto use = post("/v1/completions", {{"model", "mine"}, {"prompt", "q"}, {"max_tokens", 2}});
  ASSERT_TRUE(use);
  EXPECT_EQ(use->status, 200);
  auto unload = post("/v1/unload_lora_adapter", {{"lora_name", "mine"}});
  ASSERT_TRUE(unload);
  EXPECT_EQ(unload->status, 200);
  EXPECT_EQ(unload->body, "Success: LoRA adapter 'mine' removed successfully.");
  auto gone = post("/v1/unload_lora_adapter", {{"lora_name", "mine"}});
  ASSERT_TRUE(gone);
  EXPECT_EQ(gone->status, 404);
  auto after = post("/v1/completions", {{"model", "mine"}, {"prompt", "q"}});
  ASSERT_TRUE(after);
  EXPECT_EQ(after->status, 404);
}

TEST_F(ServerTest, AnUnloadBetweenResolvingAndSubmittingLoadsTheAdapterAgain) {
  start();
  backend_.load_adapter("sql", (lora_dir_ / "sql").string());
  backend_.unload_before_submit = "sql";
  const int64_t loads = backend_.loads;
  auto r = post("/v1/completions", {{"model", "sql"}, {"prompt", "q"}, {"max_tokens", 3}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(json::parse(r->body)["choices"][0]["text"], expected_completion("q", "sql", 3));
  EXPECT_TRUE(backend_.has_adapter("sql"));
  EXPECT_EQ(backend_.loads, loads + 1);
}

TEST_F(ServerTest, ConcurrentStreamsWithAReloadInTheMiddle) {
  allow_runtime_loading();
  start();
  backend_.load_adapter("sql", (lora_dir_ / "sql").string());
  const std::vector<std::string> models = {"base-model", "sql", "pirate"};
  constexpr int kClients = 32;
  std::vector<std::string> texts(kClients);
  std::vector<int> statuses(kClients, 0);
  std::vector<char> done(kClients, 0);  // not vector<bool>: its bits share bytes across threads
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      const json body = {{"model", models[i % 3]},
                         {"prompt", "client " + std::to_string(i)},
                         {"max_tokens", 20 + i},
                         {"stream", true}};
      auto r = client().Post("/v1/completions", body.dump(), "application/json");
      if (!r) {
        texts[i] = "client error: " + httplib::to_string(r.error());
        return;
      }
      statuses[i] = r->status;
      const Events e = parse_sse(r->body);
      done[i] = e.done;
      for (const json& c : e.chunks) texts[i] += c["choices"][0]["text"].get<std::string>();
    });
    if (i == kClients / 2) {
      // Reload one adapter while half the clients are streaming. Requests for it that arrive
      // in between find it in --lora-dir, so the explicit load may find it loaded again (400).
      EXPECT_EQ(post("/v1/unload_lora_adapter", {{"lora_name", "sql"}})->status, 200);
      const int reload = post("/v1/load_lora_adapter",
                              {{"lora_name", "sql"}, {"lora_path", (lora_dir_ / "sql").string()}})
                             ->status;
      EXPECT_TRUE(reload == 200 || reload == 400) << reload;
      EXPECT_TRUE(backend_.has_adapter("sql"));
    }
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kClients; ++i) {
    const std::string adapter = i % 3 == 0 ? "" : models[i % 3];
    EXPECT_EQ(statuses[i], 200) << i;
    EXPECT_TRUE(done[i]) << i;
    EXPECT_EQ(texts[i], expected_completion("client " + std::to_string(i), adapter, 20 + i)) << i;
  }
  EXPECT_EQ(backend_.active, 0);
  EXPECT_EQ(backend_.aborted, 0);
}

}  // namespace
}  // namespace loraplex::server
