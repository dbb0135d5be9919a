#pragma once
// The values a Jinja template computes with, with Python's semantics where chat templates
// depend on them: truthiness, equality (1 == 1.0 == True), str() and repr() of lists and
// dicts, insertion-ordered dicts, and jinja2's default Undefined (prints as "", is falsy,
// iterates as empty, and fails on arithmetic or attribute access).

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace loraplex::jinja {

class Value;
class Context;

using List = std::vector<Value>;
/// An insertion-ordered dict with string keys (what chat messages and tool schemas are).
using Dict = std::vector<std::pair<std::string, Value>>;

/// A function a template can call: a macro, a global (range, namespace, raise_exception) or
/// a bound method.
struct Callable {
  virtual ~Callable() = default;
  virtual Value call(const List& args, const Dict& kwargs, Context& context) const = 0;
};

class Value {
 public:
  enum class Kind {
    kUndefined,
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kList,
    kDict,
    kNamespace,
    kCallable
  };

  /// Undefined; `hint` names what was missing, for error messages.
  Value() = default;
  static Value undefined(std::string hint);
  static Value none();
  Value(bool b);                                    // NOLINT(google-explicit-constructor)
  Value(int64_t i);                                 // NOLINT(google-explicit-constructor)
  Value(int i) : Value(static_cast<int64_t>(i)) {}  // NOLINT(google-explicit-constructor)
  Value(double d);                                  // NOLINT(google-explicit-constructor)
  Value(std::string s);                             // NOLINT(google-explicit-constructor)
  Value(const char* s) : Value(std::string(s)) {}   // NOLINT(google-explicit-constructor)
  Value(List list);                                 // NOLINT(google-explicit-constructor)
  Value(Dict dict);                                 // NOLINT(google-explicit-constructor)
  /// A namespace(): a dict whose attributes `set ns.x = ...` changes in place.
  /// A tuple: a list that prints with parentheses (dict items, tuple literals).
  static Value tuple(List items);
  static Value make_namespace(Dict attributes);
  static Value callable(std::shared_ptr<const Callable> fn);
  /// Keeps the key order of objects (as Python's json module does).
  static Value from_json(const nlohmann::ordered_json& j);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_number() const {
    return kind_ == Kind::kInt || kind_ == Kind::kFloat || kind_ == Kind::kBool;
  }
  bool is_list() const { return kind_ == Kind::kList; }
  bool is_dict() const { return kind_ == Kind::kDict || kind_ == Kind::kNamespace; }

  bool as_bool() const { return b_; }
  int64_t as_int() const;  // bools and ints; floats truncate
  double as_double() const;
  const std::string& str() const { return *s_; }
  const List& list() const { return *list_; }
  const Dict& dict() const { return *dict_; }
  /// The namespace's attributes, changed in place by `set ns.attr = value`.
  Dict& namespace_dict() const { return *dict_; }
  const Callable& fn() const { return *fn_; }
  const std::string& undefined_hint() const { return *s_; }

  /// Python's bool(): empty strings, lists and dicts, 0, None and Undefined are false.
  bool truthy() const;
  /// Python's str(); Undefined is "".
  std::string to_string() const;
  /// Python's repr() (strings quoted, as inside printed lists).
  std::string repr() const;
  /// Python's ==, deep for lists and dicts.
  bool equals(const Value& other) const;
  /// The dict entry `key`, or nullptr.
  const Value* find(std::string_view key) const;
  /// Python's type name, for error messages.
  const char* type_name() const;

 private:
  Kind kind_ = Kind::kUndefined;
  bool b_ = false;
  bool tuple_ = false;
  int64_t i_ = 0;
  double d_ = 0.0;
  std::shared_ptr<std::string> s_;  // kString, or kUndefined's hint
  std::shared_ptr<List> list_;
  std::shared_ptr<Dict> dict_;
  std::shared_ptr<const Callable> fn_;
};

/// Python's repr() of a float ("1.0", "0.1", "1e-05", "inf").
std::string python_float_repr(double d);
/// Python's repr() of a string: single quotes unless the text has ' and no ".
std::string python_string_repr(std::string_view s);

}  // namespace loraplex::jinja
