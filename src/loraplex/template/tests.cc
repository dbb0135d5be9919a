// The tests (`x is name`) of the supported subset, jinja2's names and aliases.

#include <map>

#include "loraplex/template/builtins.h"
#include "loraplex/template/ops.h"

namespace loraplex::jinja {
namespace {

using L = const Location&;

const Value& first_arg(const List& args, Context& c, L w, const char* test) {
  if (args.empty()) render_fail(c, w, std::string("test '") + test + "' needs an argument");
  return args[0];
}

bool t_defined(const Value& v, const List&, Context&, L) { return !v.is_undefined(); }
bool t_undefined(const Value& v, const List&, Context&, L) { return v.is_undefined(); }
bool t_none(const Value& v, const List&, Context&, L) { return v.is_none(); }
bool t_string(const Value& v, const List&, Context&, L) { return v.is_string(); }
bool t_mapping(const Value& v, const List&, Context&, L) { return v.kind() == Value::Kind::kDict; }
bool t_number(const Value& v, const List&, Context&, L) { return v.is_number(); }
bool t_integer(const Value& v, const List&, Context&, L) { return v.kind() == Value::Kind::kInt; }
bool t_float(const Value& v, const List&, Context&, L) { return v.kind() == Value::Kind::kFloat; }
bool t_boolean(const Value& v, const List&, Context&, L) { return v.kind() == Value::Kind::kBool; }
bool t_true(const Value& v, const List&, Context&, L) {
  return v.kind() == Value::Kind::kBool && v.as_bool();
}
bool t_false(const Value& v, const List&, Context&, L) {
  return v.kind() == Value::Kind::kBool && !v.as_bool();
}
// Python: strings, lists, dicts (and Undefined, which iterates as empty) are iterable.
bool t_iterable(const Value& v, const List&, Context&, L) {
  return v.is_string() || v.is_list() || v.is_dict() || v.is_undefined();
}
bool t_sequence(const Value& v, const List&, Context&, L) {
  return v.is_string() || v.is_list() || v.kind() == Value::Kind::kDict;
}
bool t_callable(const Value& v, const List&, Context&, L) {
  return v.kind() == Value::Kind::kCallable;
}
bool t_eq(const Value& v, const List& a, Context& c, L w) {
  return v.equals(first_arg(a, c, w, "equalto"));
}
bool t_ne(const Value& v, const List& a, Context& c, L w) {
  return !v.equals(first_arg(a, c, w, "ne"));
}
bool t_lt(const Value& v, const List& a, Context& c, L w) {
  return less_than(v, first_arg(a, c, w, "lt"), c, w);
}
bool t_gt(const Value& v, const List& a, Context& c, L w) {
  return less_than(first_arg(a, c, w, "gt"), v, c, w);
}
bool t_le(const Value& v, const List& a, Context& c, L w) {
  return !less_than(first_arg(a, c, w, "le"), v, c, w);
}
bool t_ge(const Value& v, const List& a, Context& c, L w) {
  return !less_than(v, first_arg(a, c, w, "ge"), c, w);
}
bool t_in(const Value& v, const List& a, Context& c, L w) {
  return binary_op("in", v, first_arg(a, c, w, "in"), c, w).truthy();
}
bool t_odd(const Value& v, const List&, Context& c, L w) {
  if (!v.is_number()) render_fail(c, w, "test 'odd' needs a number");
  return v.as_int() % 2 != 0;
}
bool t_even(const Value& v, const List&, Context& c, L w) {
  if (!v.is_number()) render_fail(c, w, "test 'even' needs a number");
  return v.as_int() % 2 == 0;
}
bool t_divisibleby(const Value& v, const List& a, Context& c, L w) {
  const Value& d = first_arg(a, c, w, "divisibleby");
  if (!v.is_number() || !d.is_number() || d.as_int() == 0) {
    render_fail(c, w, "test 'divisibleby' needs numbers and a non-zero divisor");
  }
  return v.as_int() % d.as_int() == 0;
}
bool t_sameas(const Value& v, const List& a, Context& c, L w) {
  const Value& o = first_arg(a, c, w, "sameas");
  // Identity holds for the singletons templates compare with (none, true, false).
  return v.kind() == o.kind() && v.equals(o);
}

const std::map<std::string, TestFn, std::less<>>& tests() {
  static const std::map<std::string, TestFn, std::less<>> table = {
      {"defined", t_defined},
      {"undefined", t_undefined},
      {"none", t_none},
      {"string", t_string},
      {"mapping", t_mapping},
      {"number", t_number},
      {"integer", t_integer},
      {"float", t_float},
      {"boolean", t_boolean},
      {"true", t_true},
      {"false", t_false},
      {"iterable", t_iterable},
      {"sequence", t_sequence},
      {"callable", t_callable},
      {"equalto", t_eq},
      {"eq", t_eq},
      {"==", t_eq},
      {"ne", t_ne},
      {"!=", t_ne},
      {"lt", t_lt},
      {"lessthan", t_lt},
      {"<", t_lt},
      {"gt", t_gt},
      {"greaterthan", t_gt},
      {">", t_gt},
      {"le", t_le},
      {"<=", t_le},
      {"ge", t_ge},
      {">=", t_ge},
      {"in", t_in},
      {"odd", t_odd},
      {"even", t_even},
      {"divisibleby", t_divisibleby},
      {"sameas", t_sameas},
  };
  return table;
}

}  // namespace

TestFn find_test(std::string_view name) {
  const auto it = tests().find(name);
  return it == tests().end() ? nullptr : it->second;
}

}  // namespace loraplex::jinja
