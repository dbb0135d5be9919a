#pragma once
// A Jinja template in the subset real chat templates use, parsed once and rendered any number
// of times from any thread. Rendering follows jinja2 as transformers configures it
// (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, transformers' tojson,
// raise_exception and strftime_now).

#include <memory>
#include <string>
#include <string_view>

#include "loraplex/template/value.h"

namespace loraplex::jinja {

struct Stmt;

class Template {
 public:
  /// Parses `source`; throws TemplateSyntaxError naming `origin`, the line, the column and the
  /// construct for anything outside the supported subset.
  static Template parse(std::string_view source, std::string origin = "<template>");

  /// Renders with `variables` (and the built-in globals) bound; throws TemplateRenderError
  /// (raise_exception's message, or what went wrong and where). Thread-safe.
  std::string render(const Dict& variables) const;

  const std::string& origin() const { return origin_; }

 private:
  struct Parsed;
  std::shared_ptr<const Parsed> parsed_;
  std::string origin_;
};

}  // namespace loraplex::jinja
