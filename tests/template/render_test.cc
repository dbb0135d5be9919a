// Renders of small templates whose expected text is what Python's jinja2 (as transformers
// configures it) prints for the same source and variables.

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "loraplex/template/errors.h"
#include "loraplex/template/template.h"

namespace loraplex::jinja {
namespace {

std::string render(const std::string& source, const std::string& vars_json = "{}") {
  const Template t = Template::parse(source, "test");
  Dict vars;
  const auto j = nlohmann::ordered_json::parse(vars_json);
  for (auto it = j.begin(); it != j.end(); ++it) vars.emplace_back(it.key(), Value::from_json(*it));
  return t.render(vars);
}

struct Case {
  const char* source;
  const char* vars;
  const char* expected;
};

TEST(JinjaRender, MatchesJinja2) {
  const Case cases[] = {
      // Whitespace control: trim_blocks, lstrip_blocks, {%- -%}, {{- -}}, +%}.
      {"{% if true %}\n  a\n{% endif %}\nb", "{}", "  a\nb"},
      {"x  {%- if true -%}  y  {%- endif -%}  z", "{}", "xyz"},
      {"  {% if true %}a{% endif %}", "{}", "a"},
      {"x {% if true %}a{% endif %}", "{}", "x a"},
      {"{% if true +%}\na{% endif %}", "{}", "\na"},
      {"{{- ' a ' -}}\n", "{}", " a "},
      {"line\n", "{}", "line"},
      {"{# comment #}\nx", "{}", "x"},
      // Loops: loop variables, else, if-filter, unpacking, break/continue.
      {"{% for x in xs %}{{ loop.index }}{{ loop.index0 }}{{ loop.first }}{{ loop.last }}"
       "{{ loop.length }};{% endfor %}",
       R"({"xs": ["a", "b"]})", "10TrueFalse2;21FalseTrue2;"},
      {"{% for x in xs %}{{ x }}{% else %}empty{% endfor %}", R"({"xs": []})", "empty"},
      {"{% for x in xs if x > 1 %}{{ x }}{{ loop.length }},{% endfor %}", R"({"xs": [1, 2, 3]})",
       "22,32,"},
      {"{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}", R"({"d": {"b": 1, "a": 2}})",
       "b=1;a=2;"},
      {"{% for x in xs %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 4 %}{% break %}"
       "{% endif %}{{ x }}{% endfor %}",
       R"({"xs": [1, 2, 3, 4, 5]})", "13"},
      // Scoping: set in a loop stays in it; namespace() crosses it.
      {"{% set n = 0 %}{% for x in xs %}{% set n = n + x %}{% endfor %}{{ n }}",
       R"({"xs": [1, 2]})", "0"},
      {"{% set ns = namespace(n=0) %}{% for x in xs %}{% set ns.n = ns.n + x %}{% endfor %}"
       "{{ ns.n }}",
       R"({"xs": [1, 2, 39]})", "42"},
      {"{% if true %}{% set y = 'in if' %}{% endif %}{{ y }}", "{}", "in if"},
      {"{% set a, b = 1, 2 %}{{ b }}{{ a }}", "{}", "21"},
      {"{% set s %}block {{ 1 + 1 }}{% endset %}[{{ s }}]", "{}", "[block 2]"},
      // Expressions: precedence, Python arithmetic, comparisons, membership, ternary.
      {"{{ 1 + 2 * 3 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }}", "{}",
       "7 3 -4 2 3.5 1024"},
      {"{{ 'a' ~ 1 ~ none }} {{ 'ab' * 3 }} {{ [1] + [2] }}", "{}", "a1None ababab [1, 2]"},
      {"{{ 'b' in 'abc' }} {{ 'x' not in ['x'] }} {{ 'k' in {'k': 1} }}", "{}", "True False True"},
      {"{{ 'yes' if x else 'no' }}{{ 'a' if false }}", R"({"x": 0})", "no"},
      {"{{ not x is defined }} {{ x is not defined }}", "{}", "True True"},
      {"{{ 1 == 1.0 }} {{ true == 1 }} {{ [1, 2] == [1, 2] }} {{ {'a': 1} == {'a': 1} }}", "{}",
       "True True True True"},
      {"{{ x or 'dflt' }} {{ 0 and 'no' }}", R"({"x": ""})", "dflt 0"},
      // Subscripts and slices count code points.
      {"{{ s[0] }}{{ s[-1] }}{{ s[1:3] }}{{ s[::-1] }}{{ s[:-1] }}", R"({"s": "héllo"})",
       "hoélolléhhéll"},
      {"{{ xs[1:] }} {{ xs[-2] }} {{ xs[5] is defined }}", R"({"xs": [1, 2, 3]})",
       "[2, 3] 2 False"},
      // str() and repr() of values as Python prints them.
      {"{{ none }} {{ true }} {{ 1.0 }} {{ 0.1 }} {{ 1e-05 }} {{ 12345678901234567.0 }}", "{}",
       "None True 1.0 0.1 1e-05 1.2345678901234568e+16"},
      {"{{ xs }}", R"({"xs": ["it's", "a\"b", {"k": null, "t": true}, 1.5]})",
       R"(["it's", 'a"b', {'k': None, 't': True}, 1.5])"},
      // Filters.
      {"{{ '  x \n' | trim }}|{{ 'abc' | upper }}|{{ 'ABC' | lower }}|{{ 'hello world' | title }}",
       "{}", "x|ABC|abc|Hello World"},
      {"{{ xs | length }} {{ 'héllo' | length }} {{ d | length }}",
       R"({"xs": [1, 2], "d": {"a": 1}})", "2 5 1"},
      {"{{ xs | join(', ') }} {{ xs | first }} {{ xs | last }} {{ xs | reverse | list }}",
       R"({"xs": ["a", "b", "c"]})", "a, b, c a c ['c', 'b', 'a']"},
      {"{{ missing | default('d') }} {{ '' | default('e', true) }}", "{}", "d e"},
      {"{{ ms | selectattr('role', 'equalto', 'user') | map(attribute='c') | join }}"
       "{{ ms | rejectattr('role', 'equalto', 'user') | list | length }}",
       R"({"ms": [{"role": "user", "c": "1"}, {"role": "x", "c": "2"}, {"role": "user", "c": "3"}]})",
       "131"},
      {"{{ d | tojson }} {{ d | tojson(indent=2) }}", R"({"d": {"b": [1, 2.5, "é\n"], "a": {}}})",
       "{\"b\": [1, 2.5, \"é\\n\"], \"a\": {}} {\n  \"b\": [\n    1,\n    2.5,\n    \"é\\n\"\n  ],"
       "\n  \"a\": {}\n}"},
      {"{{ d | items | list }} {{ d | dictsort }}", R"({"d": {"b": 1, "a": 2}})",
       "[('b', 1), ('a', 2)] [('a', 2), ('b', 1)]"},
      {"{{ '3' | int + 1 }} {{ 'x' | int }} {{ 2 | float }} {{ -3 | abs }}", "{}", "4 0 2.0 3"},
      {"{{ 'a-b-c' | replace('-', '+') }} {{ [3, 1, 2] | sort }} {{ [1, 1, 2] | unique | list }}",
       "{}", "a+b+c [1, 2, 3] [1, 2]"},
      // Methods.
      {"{{ ' a b '.strip() }}|{{ 'a,b,,c'.split(',') }}|{{ ' a  b '.split() }}|"
       "{{ 'xxhixx'.strip('x') }}|{{ 'ab'.startswith('a') }}{{ 'ab'.endswith(('x', 'b')) }}",
       "{}", "a b|['a', 'b', '', 'c']|['a', 'b']|hi|TrueTrue"},
      {"{{ d.get('a') }} {{ d.get('z', 9) }} {{ d.keys() | list }} {{ '-'.join(['x', 'y']) }}",
       R"({"d": {"a": 1}})", "1 9 ['a'] x-y"},
      // Tests.
      {"{{ x is string }}{{ x is mapping }}{{ d is mapping }}{{ l is iterable }}{{ n is none }}"
       "{{ 3 is odd }}{{ 4 is divisibleby 2 }}{{ 1 is number }}",
       R"({"x": "s", "d": {}, "l": [], "n": null})", "TrueFalseTrueTrueTrueTrueTrueTrue"},
      // Macros with defaults and keyword arguments.
      {"{% macro m(a, b='B') %}<{{ a }}{{ b }}>{% endmacro %}{{ m(1) }}{{ m(2, b=3) }}", "{}",
       "<1B><23>"},
      // String escapes in literals.
      {"{{ 'a\\nb\\t\\u00e9\\'' }}", "{}", "a\nb\té'"},
      // Undefined prints as nothing and iterates as empty.
      {"[{{ nothing }}]{% for x in nothing %}x{% endfor %}", "{}", "[]"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(render(c.source, c.vars), c.expected) << "template: " << c.source;
  }
}

TEST(JinjaRender, RaiseExceptionCarriesTheTemplatesMessage) {
  try {
    render("{% if true %}{{ raise_exception('roles must alternate') }}{% endif %}");
    FAIL() << "no exception";
  } catch (const TemplateRenderError& e) {
    EXPECT_STREQ(e.what(), "roles must alternate");
  }
}

TEST(JinjaRender, TypeErrorsAndUndefinedArithmeticFailWithTheLocation) {
  const char* bad[] = {"{{ 'a' + 1 }}",
                       "{{ missing + 'x' }}",
                       "{{ missing.attr }}",
                       "{{ 1 // 0 }}",
                       "{{ none | tojson(ensure_ascii=true) }}",
                       "{% for x in none %}{% endfor %}",
                       "{{ undefined_fn() }}",
                       "{% set x = 1 %}{% set x.a = 2 %}"};
  for (const char* source : bad) {
    try {
      render(source);
      ADD_FAILURE() << "no exception for " << source;
    } catch (const TemplateRenderError& e) {
      EXPECT_NE(std::string(e.what()).find("test:1:"), std::string::npos) << e.what();
    }
  }
}

TEST(JinjaRender, DeepMacroRecursionIsAnErrorNotACrash) {
  EXPECT_THROW(render("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"),
               TemplateRenderError);
}

TEST(JinjaRender, NamespacesAreFreshForEveryRender) {
  const Template t = Template::parse(
      "{% set ns = namespace(n=0) %}{% for x in xs %}{% set ns.n = ns.n + 1 %}{% endfor %}"
      "{{ ns.n }}",
      "test");
  Dict vars = {{"xs", Value(List{Value(1), Value(2), Value(3)})}};
  EXPECT_EQ(t.render(vars), "3");
  EXPECT_EQ(t.render(vars), "3");
}

}  // namespace
}  // namespace loraplex::jinja
