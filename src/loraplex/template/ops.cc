#include "loraplex/template/ops.h"

#include <cmath>
#include <limits>

#include "loraplex/template/errors.h"
#include "loraplex/template/text_util.h"

namespace loraplex::jinja {
namespace {

[[noreturn]] void type_error(Context& context, const Location& where, const std::string& op,
                             const Value& a, const Value& b) {
  render_fail(context, where,
              std::string("unsupported operand types for ") + op + ": '" + a.type_name() +
                  "' and '" + b.type_name() + "'");
}

void check_defined(const Value& v, Context& context, const Location& where) {
  if (v.is_undefined()) render_fail(context, where, v.undefined_hint());
}

Value checked_int(__int128 v, Context& context, const Location& where) {
  if (v > std::numeric_limits<int64_t>::max() || v < std::numeric_limits<int64_t>::min()) {
    render_fail(context, where, "integer overflow");
  }
  return Value(static_cast<int64_t>(v));
}

bool is_integral(const Value& v) {
  return v.kind() == Value::Kind::kInt || v.kind() == Value::Kind::kBool;
}

Value arithmetic(const std::string& op, const Value& a, const Value& b, Context& context,
                 const Location& where) {
  if (!a.is_number() || !b.is_number()) type_error(context, where, op, a, b);
  const bool ints = is_integral(a) && is_integral(b);
  if (op == "/") {
    if (b.as_double() == 0.0) render_fail(context, where, "division by zero");
    return Value(a.as_double() / b.as_double());
  }
  if (ints) {
    const __int128 x = a.as_int(), y = b.as_int();
    if (op == "+") return checked_int(x + y, context, where);
    if (op == "-") return checked_int(x - y, context, where);
    if (op == "*") return checked_int(x * y, context, where);
    if (op == "//" || op == "%") {
      if (y == 0) render_fail(context, where, "integer division or modulo by zero");
      __int128 q = x / y;
      if ((x % y != 0) && ((x < 0) != (y < 0))) --q;  // Python floors
      if (op == "//") return checked_int(q, context, where);
      return checked_int(x - q * y, context, where);
    }
    if (op == "**") {
      if (y < 0) return Value(std::pow(a.as_double(), b.as_double()));
      __int128 r = 1;
      for (__int128 i = 0; i < y; ++i) {
        r *= x;
        if (r > std::numeric_limits<int64_t>::max() || r < std::numeric_limits<int64_t>::min()) {
          render_fail(context, where, "integer overflow");
        }
      }
      return Value(static_cast<int64_t>(r));
    }
  }
  const double x = a.as_double(), y = b.as_double();
  if (op == "+") return Value(x + y);
  if (op == "-") return Value(x - y);
  if (op == "*") return Value(x * y);
  if (op == "**") return Value(std::pow(x, y));
  if (y == 0.0) render_fail(context, where, "float division or modulo by zero");
  const double q = std::floor(x / y);
  if (op == "//") return Value(q);
  return Value(x - q * y);
}

}  // namespace

Value get_attribute(const Value& object, const std::string& name, Context& context,
                    const Location& where) {
  check_defined(object, context, where);
  if (object.is_dict()) {
    if (const Value* v = object.find(name)) return *v;
  }
  return Value::undefined(
      detail::concat("'", object.type_name(), "' object has no attribute '", name, "'"));
}

Value get_item(const Value& object, const Value& key, Context& context, const Location& where) {
  check_defined(object, context, where);
  if (object.is_dict() && key.is_string()) {
    if (const Value* v = object.find(key.str())) return *v;
    return Value::undefined(
        detail::concat("'", object.type_name(), "' object has no key ", key.repr()));
  }
  if ((object.is_list() || object.is_string()) && is_integral(key)) {
    int64_t i = key.as_int();
    if (object.is_list()) {
      const auto n = static_cast<int64_t>(object.list().size());
      if (i < 0) i += n;
      if (i >= 0 && i < n) return object.list()[static_cast<size_t>(i)];
    } else {
      const std::vector<size_t> off = code_point_offsets(object.str());
      const auto n = static_cast<int64_t>(off.size()) - 1;
      if (i < 0) i += n;
      if (i >= 0 && i < n) {
        const auto k = static_cast<size_t>(i);
        return Value(object.str().substr(off[k], off[k + 1] - off[k]));
      }
    }
    return Value::undefined(
        detail::concat(object.type_name(), " index ", key.repr(), " out of range"));
  }
  return Value::undefined(
      detail::concat("'", object.type_name(), "' object has no item ", key.repr()));
}

List iterate(const Value& value, Context& context, const Location& where) {
  switch (value.kind()) {
    case Value::Kind::kUndefined:
      return {};
    case Value::Kind::kList:
      return value.list();
    case Value::Kind::kDict:
    case Value::Kind::kNamespace: {
      List keys;
      for (const auto& [k, v] : value.dict()) keys.emplace_back(k);
      return keys;
    }
    case Value::Kind::kString: {
      List chars;
      const std::vector<size_t> off = code_point_offsets(value.str());
      for (size_t k = 0; k + 1 < off.size(); ++k)
        chars.emplace_back(value.str().substr(off[k], off[k + 1] - off[k]));
      return chars;
    }
    default:
      render_fail(context, where,
                  std::string("'") + value.type_name() + "' object is not iterable");
  }
}

bool less_than(const Value& a, const Value& b, Context& context, const Location& where) {
  if (a.is_number() && b.is_number()) {
    if (is_integral(a) && is_integral(b)) return a.as_int() < b.as_int();
    return a.as_double() < b.as_double();
  }
  if (a.is_string() && b.is_string()) return a.str() < b.str();  // UTF-8 orders by code point
  if (a.is_list() && b.is_list()) {
    const List& x = a.list();
    const List& y = b.list();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (!x[i].equals(y[i])) return less_than(x[i], y[i], context, where);
    }
    return x.size() < y.size();
  }
  type_error(context, where, "<", a, b);
}

int64_t length_of(const Value& value, Context& context, const Location& where) {
  switch (value.kind()) {
    case Value::Kind::kUndefined:
      return 0;
    case Value::Kind::kString:
      return static_cast<int64_t>(code_point_count(value.str()));
    case Value::Kind::kList:
      return static_cast<int64_t>(value.list().size());
    case Value::Kind::kDict:
    case Value::Kind::kNamespace:
      return static_cast<int64_t>(value.dict().size());
    default:
      render_fail(context, where,
                  std::string("object of type '") + value.type_name() + "' has no len()");
  }
}

Value binary_op(const std::string& op, const Value& a, const Value& b, Context& context,
                const Location& where) {
  if (op == "~") return Value(a.to_string() + b.to_string());
  if (op == "==") return Value(a.equals(b));
  if (op == "!=") return Value(!a.equals(b));
  if (op == "in" || op == "notin") {
    bool found = false;
    if (b.is_string()) {
      if (!a.is_string()) {
        render_fail(
            context, where,
            std::string("'in <string>' requires string as left operand, not ") + a.type_name());
      }
      found = b.str().find(a.str()) != std::string::npos;
    } else if (b.is_dict()) {
      found = a.is_string() && b.find(a.str()) != nullptr;
    } else if (b.is_list()) {
      for (const Value& item : b.list()) {
        if (item.equals(a)) {
          found = true;
          break;
        }
      }
    } else if (!b.is_undefined()) {
      render_fail(context, where,
                  std::string("argument of type '") + b.type_name() + "' is not iterable");
    }
    return Value(op == "in" ? found : !found);
  }
  if (op == "<") return Value(less_than(a, b, context, where));
  if (op == ">") return Value(less_than(b, a, context, where));
  if (op == "<=") return Value(!less_than(b, a, context, where));
  if (op == ">=") return Value(!less_than(a, b, context, where));
  check_defined(a, context, where);
  check_defined(b, context, where);
  if (op == "+") {
    if (a.is_string() && b.is_string()) return Value(a.str() + b.str());
    if (a.is_list() && b.is_list()) {
      List out = a.list();
      out.insert(out.end(), b.list().begin(), b.list().end());
      return Value(std::move(out));
    }
  }
  if (op == "*" && (a.is_string() || a.is_list() || b.is_string() || b.is_list())) {
    const Value& seq = a.is_string() || a.is_list() ? a : b;
    const Value& count = a.is_string() || a.is_list() ? b : a;
    if (!is_integral(count)) type_error(context, where, op, a, b);
    const int64_t n = std::max<int64_t>(0, count.as_int());
    constexpr int64_t kMaxRepeat = 1 << 20;
    if (n > kMaxRepeat) render_fail(context, where, "sequence repeated too many times");
    if (seq.is_string()) {
      std::string out;
      for (int64_t i = 0; i < n; ++i) out += seq.str();
      return Value(std::move(out));
    }
    List out;
    for (int64_t i = 0; i < n; ++i) out.insert(out.end(), seq.list().begin(), seq.list().end());
    return Value(std::move(out));
  }
  return arithmetic(op, a, b, context, where);
}

}  // namespace loraplex::jinja
