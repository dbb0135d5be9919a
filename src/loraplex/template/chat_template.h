#pragma once
// A model's chat template: the Jinja `chat_template` of tokenizer_config.json (or a file given
// on the command line) with the special tokens transformers passes to it, rendered for an
// OpenAI message list the way transformers' apply_chat_template renders it (messages, tools,
// documents, add_generation_prompt, the special tokens, extra keyword arguments; and
// continue_final_message's cut after the last message).

#include <string>

#include <nlohmann/json.hpp>

#include "loraplex/template/template.h"

namespace loraplex::jinja {

struct ChatRenderOptions {
  bool add_generation_prompt = true;
  /// Leave the last (assistant) message open so that generation continues it (prefill).
  bool continue_final_message = false;
  nlohmann::ordered_json tools;      // null: none
  nlohmann::ordered_json documents;  // null: none
  /// Extra template variables (vLLM's chat_template_kwargs); an object or null.
  nlohmann::ordered_json kwargs;
};

class ChatTemplate {
 public:
  /// `special_tokens`: bos_token, eos_token, ... as transformers' special_tokens_map.
  ChatTemplate(std::string source, nlohmann::ordered_json special_tokens, std::string origin);

  /// Reads tokenizer_config.json: its chat_template (a string, or a list of {name, template}
  /// of which "default" is used) and its special tokens. Throws loraplex::Error naming the file
  /// when it has no chat template, and TemplateSyntaxError when the template is outside the
  /// supported subset.
  static ChatTemplate from_tokenizer_config(const std::string& path);
  /// A template file (--chat-template) with the special tokens of `tokenizer_config_path` when
  /// that file exists.
  static ChatTemplate from_file(const std::string& path, const std::string& tokenizer_config_path);
  /// Template text given directly (the Python API's chat_template argument); `origin` names
  /// it in error messages.
  static ChatTemplate from_source(std::string source, const std::string& tokenizer_config_path,
                                  std::string origin);

  /// Renders `messages` (a JSON array of message objects). Throws TemplateRenderError for a
  /// raise_exception or a render failure, loraplex::Error for invalid options.
  std::string render(const nlohmann::ordered_json& messages,
                     const ChatRenderOptions& options) const;

  const std::string& origin() const { return template_.origin(); }
  const nlohmann::ordered_json& special_tokens() const { return special_tokens_; }

 private:
  Template template_;
  nlohmann::ordered_json special_tokens_;
};

}  // namespace loraplex::jinja
