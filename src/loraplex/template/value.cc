#include "loraplex/template/value.h"

#include <charconv>
#include <cmath>
#include <cstdio>

#include <nlohmann/json.hpp>

namespace loraplex::jinja {

Value Value::undefined(std::string hint) {
  Value v;
  v.s_ = std::make_shared<std::string>(std::move(hint));
  return v;
}

Value Value::none() {
  Value v;
  v.kind_ = Kind::kNone;
  return v;
}

Value::Value(bool b) : kind_(Kind::kBool), b_(b), i_(b ? 1 : 0) {}
Value::Value(int64_t i) : kind_(Kind::kInt), i_(i) {}
Value::Value(double d) : kind_(Kind::kFloat), d_(d) {}
Value::Value(std::string s)
    : kind_(Kind::kString), s_(std::make_shared<std::string>(std::move(s))) {}
Value::Value(List list) : kind_(Kind::kList), list_(std::make_shared<List>(std::move(list))) {}
Value::Value(Dict dict) : kind_(Kind::kDict), dict_(std::make_shared<Dict>(std::move(dict))) {}

Value Value::tuple(List items) {
  Value v(std::move(items));
  v.tuple_ = true;
  return v;
}

Value Value::make_namespace(Dict attributes) {
  Value v(std::move(attributes));
  v.kind_ = Kind::kNamespace;
  return v;
}

Value Value::callable(std::shared_ptr<const Callable> fn) {
  Value v;
  v.kind_ = Kind::kCallable;
  v.fn_ = std::move(fn);
  return v;
}

Value Value::from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
      return none();
    case nlohmann::ordered_json::value_t::boolean:
      return Value(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return Value(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      const uint64_t u = j.get<uint64_t>();
      if (u <= static_cast<uint64_t>(INT64_MAX)) return Value(static_cast<int64_t>(u));
      return Value(static_cast<double>(u));
    }
    case nlohmann::ordered_json::value_t::number_float:
      return Value(j.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return Value(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      List list;
      list.reserve(j.size());
      for (const auto& e : j) list.push_back(from_json(e));
      return Value(std::move(list));
    }
    case nlohmann::ordered_json::value_t::object: {
      Dict dict;
      dict.reserve(j.size());
      for (auto it = j.begin(); it != j.end(); ++it) dict.emplace_back(it.key(), from_json(*it));
      return Value(std::move(dict));
    }
    default:
      return Value::undefined("binary JSON value");
  }
}

int64_t Value::as_int() const {
  if (kind_ == Kind::kFloat) return static_cast<int64_t>(d_);
  return i_;
}

double Value::as_double() const {
  if (kind_ == Kind::kFloat) return d_;
  return static_cast<double>(i_);
}

bool Value::truthy() const {
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone:
      return false;
    case Kind::kBool:
      return b_;
    case Kind::kInt:
      return i_ != 0;
    case Kind::kFloat:
      return d_ != 0.0;
    case Kind::kString:
      return !s_->empty();
    case Kind::kList:
      return !list_->empty();
    case Kind::kDict:
      return !dict_->empty();
    case Kind::kNamespace:
    case Kind::kCallable:
      return true;
  }
  return false;
}

std::string python_float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  // Python's repr: the shortest round-tripping digits, positional for 1e-4 <= |d| < 1e16,
  // else scientific with at least two exponent digits.
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  (void)ec;
  std::string sci(buf, end);
  const size_t e = sci.find('e');
  std::string mantissa = sci.substr(0, e);
  const int exponent = std::stoi(sci.substr(e + 1));
  const bool negative = mantissa[0] == '-';
  if (negative) mantissa.erase(0, 1);
  std::string digits;
  for (char c : mantissa)
    if (c != '.') digits += c;
  std::string out;
  if (exponent >= -4 && exponent < 16) {
    const int point = exponent + 1;  // digits before the decimal point
    if (point <= 0) {
      out = "0.";
      out.append(static_cast<size_t>(-point), '0');
      out += digits;
    } else if (static_cast<size_t>(point) >= digits.size()) {
      out = digits + std::string(static_cast<size_t>(point) - digits.size(), '0') + ".0";
    } else {
      out = digits.substr(0, static_cast<size_t>(point));
      out += '.';
      out.append(digits, static_cast<size_t>(point), std::string::npos);
    }
  }
  if (out.empty()) {
    out = digits.substr(0, 1);
    if (digits.size() > 1) {
      out += '.';
      out.append(digits, 1, std::string::npos);
    }
    char exp[16];
    std::snprintf(exp, sizeof(exp), "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
    out += exp;
  }
  return negative ? "-" + out : out;
}

std::string python_string_repr(std::string_view s) {
  const bool has_single = s.find('\'') != std::string_view::npos;
  const bool has_double = s.find('"') != std::string_view::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (unsigned char c : s) {
    if (c == static_cast<unsigned char>(quote) || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  out += quote;
  return out;
}

std::string Value::to_string() const {
  switch (kind_) {
    case Kind::kUndefined:
      return "";
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return b_ ? "True" : "False";
    case Kind::kInt:
      return std::to_string(i_);
    case Kind::kFloat:
      return python_float_repr(d_);
    case Kind::kString:
      return *s_;
    case Kind::kList:
    case Kind::kDict:
      return repr();
    case Kind::kNamespace:
      return "<Namespace " + Value(*dict_).repr() + ">";
    case Kind::kCallable:
      return "<function>";
  }
  return "";
}

std::string Value::repr() const {
  switch (kind_) {
    case Kind::kString:
      return python_string_repr(*s_);
    case Kind::kList: {
      std::string out = tuple_ ? "(" : "[";
      for (size_t i = 0; i < list_->size(); ++i) {
        if (i) out += ", ";
        out += (*list_)[i].repr();
      }
      if (tuple_ && list_->size() == 1) out += ",";
      return out + (tuple_ ? ")" : "]");
    }
    case Kind::kDict: {
      std::string out = "{";
      for (size_t i = 0; i < dict_->size(); ++i) {
        if (i) out += ", ";
        out += python_string_repr((*dict_)[i].first) + ": " + (*dict_)[i].second.repr();
      }
      return out + "}";
    }
    case Kind::kUndefined:
      return "Undefined";
    default:
      return to_string();
  }
}

bool Value::equals(const Value& other) const {
  if (is_number() && other.is_number()) {
    if (kind_ == Kind::kFloat || other.kind_ == Kind::kFloat) {
      return as_double() == other.as_double();
    }
    return i_ == other.i_;
  }
  if (kind_ != other.kind_) return false;
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone:
      return true;
    case Kind::kString:
      return *s_ == *other.s_;
    case Kind::kList: {
      if (list_->size() != other.list_->size()) return false;
      for (size_t i = 0; i < list_->size(); ++i)
        if (!(*list_)[i].equals((*other.list_)[i])) return false;
      return true;
    }
    case Kind::kDict: {
      // Python dicts compare equal regardless of insertion order.
      if (dict_->size() != other.dict_->size()) return false;
      for (const auto& [k, v] : *dict_) {
        const Value* o = other.find(k);
        if (o == nullptr || !v.equals(*o)) return false;
      }
      return true;
    }
    case Kind::kNamespace:
      return dict_ == other.dict_;
    case Kind::kCallable:
      return fn_ == other.fn_;
    default:
      return false;
  }
}

const Value* Value::find(std::string_view key) const {
  if (!is_dict()) return nullptr;
  for (const auto& [k, v] : *dict_)
    if (k == key) return &v;
  return nullptr;
}

const char* Value::type_name() const {
  switch (kind_) {
    case Kind::kUndefined:
      return "Undefined";
    case Kind::kNone:
      return "NoneType";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
      return "int";
    case Kind::kFloat:
      return "float";
    case Kind::kString:
      return "str";
    case Kind::kList:
      return "list";
    case Kind::kDict:
      return "dict";
    case Kind::kNamespace:
      return "Namespace";
    case Kind::kCallable:
      return "function";
  }
  return "?";
}

}  // namespace loraplex::jinja
