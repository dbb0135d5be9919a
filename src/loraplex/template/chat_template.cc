#include "loraplex/template/chat_template.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "loraplex/template/errors.h"
#include "loraplex/template/text_util.h"

namespace loraplex::jinja {
namespace {

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in.good()) throw Error(path + ": cannot open");
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

nlohmann::ordered_json read_json(const std::string& path) {
  try {
    return nlohmann::ordered_json::parse(read_text(path));
  } catch (const nlohmann::ordered_json::exception& e) {
    throw Error(path + ": not valid JSON: " + e.what());
  }
}

// transformers' special_tokens_map: each token as its text (AddedToken objects give their
// "content").
nlohmann::ordered_json special_tokens_of(const nlohmann::ordered_json& config) {
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  for (const char* key : {"bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                          "cls_token", "mask_token"}) {
    if (!config.contains(key)) continue;
    const nlohmann::ordered_json& t = config.at(key);
    if (t.is_string()) out[key] = t;
    if (t.is_object() && t.contains("content") && t.at("content").is_string()) {
      out[key] = t.at("content");
    }
  }
  if (config.contains("additional_special_tokens") &&
      config.at("additional_special_tokens").is_array()) {
    nlohmann::ordered_json list = nlohmann::ordered_json::array();
    for (const auto& t : config.at("additional_special_tokens")) {
      if (t.is_string()) list.push_back(t);
      if (t.is_object() && t.contains("content")) list.push_back(t.at("content"));
    }
    out["additional_special_tokens"] = list;
  }
  return out;
}

}  // namespace

ChatTemplate::ChatTemplate(std::string source, nlohmann::ordered_json special_tokens,
                           std::string origin)
    : template_(Template::parse(source, std::move(origin))),
      special_tokens_(std::move(special_tokens)) {}

ChatTemplate ChatTemplate::from_tokenizer_config(const std::string& path) {
  const nlohmann::ordered_json config = read_json(path);
  if (!config.is_object() || !config.contains("chat_template")) {
    throw Error(path + ": no \"chat_template\" (give one with --chat-template FILE)");
  }
  const nlohmann::ordered_json& t = config.at("chat_template");
  std::string source;
  if (t.is_string()) {
    source = t.get<std::string>();
  } else if (t.is_array()) {
    for (const auto& entry : t) {
      if (entry.is_object() && entry.value("name", "") == "default" && entry.contains("template") &&
          entry.at("template").is_string()) {
        source = entry.at("template").get<std::string>();
      }
    }
    if (source.empty())
      throw Error(path + ": \"chat_template\" lists no template named \"default\"");
  } else {
    throw Error(path + ": \"chat_template\" must be a string or a list of named templates");
  }
  return ChatTemplate(std::move(source), special_tokens_of(config), path + " (chat_template)");
}

ChatTemplate ChatTemplate::from_file(const std::string& path,
                                     const std::string& tokenizer_config_path) {
  return from_source(read_text(path), tokenizer_config_path, path);
}

ChatTemplate ChatTemplate::from_source(std::string source, const std::string& tokenizer_config_path,
                                       std::string origin) {
  nlohmann::ordered_json tokens = nlohmann::ordered_json::object();
  if (!tokenizer_config_path.empty() && std::filesystem::exists(tokenizer_config_path)) {
    tokens = special_tokens_of(read_json(tokenizer_config_path));
  }
  return ChatTemplate(std::move(source), std::move(tokens), std::move(origin));
}

std::string ChatTemplate::render(const nlohmann::ordered_json& messages,
                                 const ChatRenderOptions& options) const {
  if (!messages.is_array()) throw Error("messages must be a list");
  if (options.continue_final_message && options.add_generation_prompt) {
    throw Error("continue_final_message and add_generation_prompt cannot both be true");
  }
  Dict vars;
  vars.emplace_back("messages", Value::from_json(messages));
  vars.emplace_back("tools", Value::from_json(options.tools));
  vars.emplace_back("documents", Value::from_json(options.documents));
  vars.emplace_back("add_generation_prompt", Value(options.add_generation_prompt));
  for (auto it = special_tokens_.begin(); it != special_tokens_.end(); ++it) {
    vars.emplace_back(it.key(), Value::from_json(*it));
  }
  if (options.kwargs.is_object()) {
    for (auto it = options.kwargs.begin(); it != options.kwargs.end(); ++it) {
      bool replaced = false;
      for (auto& v : vars) {
        if (v.first == it.key()) {
          v.second = Value::from_json(*it);
          replaced = true;
        }
      }
      if (!replaced) vars.emplace_back(it.key(), Value::from_json(*it));
    }
  }
  std::string rendered = template_.render(vars);
  if (!options.continue_final_message) return rendered;

  // transformers: cut the render right after the final message's content, so that the model
  // continues it instead of starting a new turn.
  if (messages.empty() || !messages.back().is_object()) {
    throw Error("continue_final_message needs a final message");
  }
  const nlohmann::ordered_json& last = messages.back();
  std::string final_text;
  const nlohmann::ordered_json content =
      last.contains("content") ? last.at("content") : nlohmann::ordered_json();
  if (content.is_string()) {
    final_text = content.get<std::string>();
  } else if (content.is_array()) {
    bool found = false;
    for (auto it = content.rbegin(); it != content.rend() && !found; ++it) {
      if (it->is_object() && it->contains("text") && it->at("text").is_string()) {
        final_text = it->at("text").get<std::string>();
        found = true;
      }
    }
    if (!found) throw Error("continue_final_message: the final message has no text part");
  } else {
    throw Error("continue_final_message: the final message has no content");
  }
  const std::string stripped = python_strip(final_text, std::nullopt, true, true);
  const size_t at = rendered.rfind(stripped);
  if (at == std::string::npos) {
    throw Error(
        "continue_final_message: the final message does not appear in the rendered chat (the "
        "template changes it)");
  }
  const std::string lstripped = python_strip(final_text, std::nullopt, true, false);
  if (rendered.compare(at, lstripped.size(), final_text) == 0) {
    rendered.resize(at + lstripped.size());
  } else {
    rendered.resize(at + stripped.size());
  }
  return rendered;
}

}  // namespace loraplex::jinja
