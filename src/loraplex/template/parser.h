#pragma once
// Builds the statement tree of a template from its tokens. Supported: text, {{ expr }},
// if/elif/else, for (with `if` filter, else, loop.*), set (name, tuple, namespace attribute,
// block form), macro, break/continue, generation; expressions with jinja2's precedence,
// filters, tests, calls with keyword arguments, subscripts and slices, list/dict literals.
// Anything else (include, extends, call blocks, recursive loops, unknown filters or tests,
// methods that mutate) is a TemplateSyntaxError naming the origin, line, column and construct.

#include <string_view>
#include <vector>

#include "loraplex/template/ast.h"
#include "loraplex/template/lexer.h"

namespace loraplex::jinja {

Body parse(const std::vector<Token>& tokens, std::string_view origin);

}  // namespace loraplex::jinja
