#pragma once
// Splits a template into text and the tokens of its {{ }} and {% %} tags, applying jinja2's
// whitespace control as transformers configures it: {%- -%} {{- -}} strip, trim_blocks drops
// the first newline after a block or comment tag, lstrip_blocks drops the spaces and tabs
// before a block or comment tag that starts a line, and one trailing newline of the source is
// dropped (keep_trailing_newline=False). Comments are dropped here.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace loraplex::jinja {

struct Token {
  enum class Type {
    kText,        // template text, whitespace control already applied
    kVarBegin,    // {{
    kVarEnd,      // }}
    kBlockBegin,  // {%
    kBlockEnd,    // %}
    kName,
    kString,  // value: the unescaped string
    kInt,
    kFloat,
    kOperator,  // value: the operator text (+, //, ==, (, ...)
    kEof,
  };
  Type type = Type::kEof;
  std::string value;
  int64_t int_value = 0;
  double float_value = 0.0;
  int line = 1;    // 1-based, of the token's first character
  int column = 1;  // 1-based
};

struct LexOptions {
  bool trim_blocks = true;
  bool lstrip_blocks = true;
  bool keep_trailing_newline = false;
};

/// The token stream, ending with kEof. Throws TemplateSyntaxError naming `origin`, the line
/// and the column of an unterminated tag, string or comment, or an unexpected character.
std::vector<Token> tokenize(std::string_view source, std::string_view origin,
                            const LexOptions& options = {});

}  // namespace loraplex::jinja
