// Load-time behaviour: what the supported subset refuses, and that the refusal names the
// line, the column and the construct.

#include <gtest/gtest.h>

#include "loraplex/template/errors.h"
#include "loraplex/template/lexer.h"
#include "loraplex/template/template.h"

namespace loraplex::jinja {
namespace {

std::string load_error(const std::string& source) {
  try {
    Template::parse(source, "tmpl");
  } catch (const TemplateSyntaxError& e) {
    return e.what();
  }
  return "";
}

TEST(JinjaLoad, UnsupportedConstructsAreNamedWithLineAndColumn) {
  struct Case {
    const char* source;
    const char* location;
    const char* names;
  };
  const Case cases[] = {
      {"ok\n{% include 'x.j2' %}", "tmpl:2:4", "include"},
      {"{{ x | nosuchfilter }}", "tmpl:1:8", "nosuchfilter"},
      {"{% if x is nosuchtest %}{% endif %}", "tmpl:1:12", "nosuchtest"},
      {"{% for x in y recursive %}{% endfor %}", "tmpl:1:15", "recursive"},
      {"{{ xs.append(1) }}", "tmpl:1:13", "append"},
      {"\n\n  {% if x %}no end", "tmpl:3:19", "endif"},
      {"{% endfor %}", "tmpl:1:4", "endfor"},
      {"{{ 'unterminated }}", "tmpl:1:4", "unterminated string"},
      {"{{ x ", "tmpl:1:1", "unterminated"},
      {"{# open comment", "tmpl:1:1", "comment"},
      {"{{ a < b < c }}", "tmpl:1:10", "chained"},
      {"{% macro m(*args) %}{% endmacro %}", "tmpl:1:12", ""},
      {"{{ f(*xs) }}", "tmpl:1:6", "*args"},
      {"{% filter upper %}x{% endfilter %}", "tmpl:1:4", "filter"},
      {"{{ x $ y }}", "tmpl:1:6", "$"},
  };
  for (const Case& c : cases) {
    const std::string error = load_error(c.source);
    EXPECT_NE(error.find(c.location), std::string::npos) << c.source << " -> " << error;
    EXPECT_NE(error.find(c.names), std::string::npos) << c.source << " -> " << error;
  }
}

TEST(JinjaLoad, TokensCarryPositionsAndDecodedLiterals) {
  const std::vector<Token> t = tokenize("a\n  {{ x.y['k\\u00e9'] + 1.5e3 }}", "t");
  ASSERT_GE(t.size(), 3u);
  EXPECT_EQ(t[0].type, Token::Type::kText);
  EXPECT_EQ(t[0].value, "a\n  ");
  EXPECT_EQ(t[1].type, Token::Type::kVarBegin);
  EXPECT_EQ(t[1].line, 2);
  EXPECT_EQ(t[1].column, 3);
  bool found_string = false, found_float = false;
  for (const Token& k : t) {
    found_string = found_string || (k.type == Token::Type::kString && k.value == "k\xc3\xa9");
    found_float = found_float || (k.type == Token::Type::kFloat && k.float_value == 1500.0);
  }
  EXPECT_TRUE(found_string);
  EXPECT_TRUE(found_float);
  EXPECT_EQ(t.back().type, Token::Type::kEof);
}

TEST(JinjaLoad, CarriageReturnsAreNormalized) {
  const Template t = Template::parse("{% if true %}\r\na\r\nb{% endif %}\r\n", "t");
  EXPECT_EQ(t.render({}), "a\nb");
}

}  // namespace
}  // namespace loraplex::jinja
