#include "loraplex/template/template.h"

#include "loraplex/template/ast.h"
#include "loraplex/template/builtins.h"
#include "loraplex/template/lexer.h"
#include "loraplex/template/parser.h"

namespace loraplex::jinja {

struct Template::Parsed {
  Body body;
};

Template Template::parse(std::string_view source, std::string origin) {
  Template t;
  auto parsed = std::make_shared<Parsed>();
  parsed->body = jinja::parse(tokenize(source, origin), origin);
  t.parsed_ = std::move(parsed);
  t.origin_ = std::move(origin);
  return t;
}

std::string Template::render(const Dict& variables) const {
  Dict globals = builtin_globals();
  for (const auto& [name, value] : variables) {
    bool replaced = false;
    for (auto& g : globals) {
      if (g.first == name) {
        g.second = value;
        replaced = true;
      }
    }
    if (!replaced) globals.emplace_back(name, value);
  }
  Context context(globals, origin_);
  std::string out;
  exec_body(parsed_->body, context, out);
  return out;
}

}  // namespace loraplex::jinja
