// ChatTemplate: reading tokenizer_config.json, special tokens, options and the prefill cut.

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "loraplex/template/chat_template.h"
#include "loraplex/template/errors.h"

namespace loraplex::jinja {
namespace {

using json = nlohmann::ordered_json;

std::string write_temp(const std::string& name, const std::string& text) {
  const auto path = std::filesystem::temp_directory_path() /
                    ("loraplex_chat_" + std::to_string(::getpid()) + "_" + name);
  std::ofstream(path) << text;
  return path.string();
}

TEST(ChatTemplate, ReadsTemplateAndSpecialTokensFromTokenizerConfig) {
  const json config = {
      {"bos_token", {{"content", "<B>"}, {"lstrip", false}}},
      {"eos_token", "<E>"},
      {"chat_template",
       "{{ bos_token }}{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}"
       "{% if add_generation_prompt %}[assistant:{% endif %}{{ eos_token }}"}};
  const std::string path = write_temp("tokenizer_config.json", config.dump());
  const ChatTemplate chat = ChatTemplate::from_tokenizer_config(path);
  const json messages = json::parse(R"([{"role": "user", "content": "hi"}])");
  EXPECT_EQ(chat.render(messages, {}), "<B>[user:hi][assistant:<E>");
  ChatRenderOptions no_prompt;
  no_prompt.add_generation_prompt = false;
  EXPECT_EQ(chat.render(messages, no_prompt), "<B>[user:hi]<E>");
  std::filesystem::remove(path);
}

TEST(ChatTemplate, NamedTemplateListUsesDefault) {
  const json config = {{"chat_template",
                        {{{"name", "tool_use"}, {"template", "T"}},
                         {{"name", "default"}, {"template", "D{{ messages | length }}"}}}}};
  const std::string path = write_temp("named.json", config.dump());
  EXPECT_EQ(ChatTemplate::from_tokenizer_config(path).render(json::array({json::object()}), {}),
            "D1");
  std::filesystem::remove(path);
}

TEST(ChatTemplate, MissingOrBrokenTemplateIsALoadError) {
  const std::string none = write_temp("none.json", R"({"eos_token": "x"})");
  EXPECT_THROW(ChatTemplate::from_tokenizer_config(none), Error);
  const std::string broken =
      write_temp("broken.json", R"({"chat_template": "{% for m in messages %}{% include 'x' %}"})");
  try {
    ChatTemplate::from_tokenizer_config(broken);
    FAIL() << "no exception";
  } catch (const TemplateSyntaxError& e) {
    EXPECT_NE(std::string(e.what()).find("include"), std::string::npos) << e.what();
  }
  std::filesystem::remove(none);
  std::filesystem::remove(broken);
}

TEST(ChatTemplate, ContinueFinalMessageCutsAfterTheLastContent) {
  const ChatTemplate chat(
      "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>\n{% endfor %}",
      json::object(), "t");
  ChatRenderOptions o;
  o.add_generation_prompt = false;
  o.continue_final_message = true;
  const json messages = json::parse(
      R"([{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is "}])");
  // The template trims the content, so the cut keeps the stripped text (as transformers).
  EXPECT_EQ(chat.render(messages, o), "<user>q</user>\n<assistant>The answer is");
  o.add_generation_prompt = true;
  EXPECT_THROW(chat.render(messages, o), Error);
}

TEST(ChatTemplate, KwargsReachTheTemplate) {
  const ChatTemplate chat("{{ greeting | default('none') }}", json::object(), "t");
  ChatRenderOptions o;
  o.kwargs = {{"greeting", "hello"}};
  EXPECT_EQ(chat.render(json::array(), o), "hello");
  EXPECT_EQ(chat.render(json::array(), {}), "none");
}

}  // namespace
}  // namespace loraplex::jinja
