// A test helper for check_chat_templates.py: renders a list of cases with loraplex's chat
// template engine and prints the results as JSON, so that the script can compare each with
// Python's jinja2 rendering the same case.
//
// usage: loraplex_render_chat CASES.json
//   CASES.json: [{"template": FILE, "messages": [...], "special_tokens": {...},
//                 "add_generation_prompt": bool, "continue_final_message": bool,
//                 "tools": ..., "kwargs": {...}}, ...]
//   prints: [{"ok": true, "text": "..."} | {"ok": false, "stage": "load"|"render",
//             "error": "..."}, ...]

#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "loraplex/template/chat_template.h"
#include "loraplex/template/errors.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: loraplex_render_chat CASES.json\n");
    return 2;
  }
  std::ifstream in(argv[1]);
  const nlohmann::ordered_json cases = nlohmann::ordered_json::parse(in);
  nlohmann::ordered_json results = nlohmann::ordered_json::array();
  for (const nlohmann::ordered_json& c : cases) {
    nlohmann::ordered_json r;
    try {
      std::ifstream t(c.at("template").get<std::string>(), std::ios::binary);
      std::ostringstream source;
      source << t.rdbuf();
      const loraplex::jinja::ChatTemplate chat(
          source.str(), c.value("special_tokens", nlohmann::ordered_json::object()),
          c.at("template").get<std::string>());
      loraplex::jinja::ChatRenderOptions options;
      options.add_generation_prompt = c.value("add_generation_prompt", false);
      options.continue_final_message = c.value("continue_final_message", false);
      options.tools = c.value("tools", nlohmann::ordered_json());
      options.kwargs = c.value("kwargs", nlohmann::ordered_json::object());
      try {
        r = {{"ok", true}, {"text", chat.render(c.at("messages"), options)}};
      } catch (const loraplex::Error& e) {
        r = {{"ok", false}, {"stage", "render"}, {"error", e.what()}};
      }
    } catch (const loraplex::jinja::TemplateSyntaxError& e) {
      r = {{"ok", false}, {"stage", "load"}, {"error", e.what()}};
    }
    results.push_back(r);
  }
  std::cout << results.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace)
            << "\n";
  return 0;
}
