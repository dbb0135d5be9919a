#pragma once
// The template library's two failures: a template that cannot be loaded (a syntax error or a
// construct outside the supported subset, named with its line and column) and a render that
// fails (raise_exception, a type error, an undefined value used in arithmetic).

#include <string>

#include "loraplex/core/error.h"

namespace loraplex::jinja {

/// A template refused at load time; the message names the origin, line, column and construct.
class TemplateSyntaxError : public Error {
 public:
  explicit TemplateSyntaxError(const std::string& message) : Error(message) {}
};

/// A render that failed; the message says why (for raise_exception: the template's message).
class TemplateRenderError : public Error {
 public:
  explicit TemplateRenderError(const std::string& message) : Error(message) {}
};

}  // namespace loraplex::jinja
