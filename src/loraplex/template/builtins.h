#pragma once
// The filters, tests, methods and global functions the supported subset offers (those real
// chat templates call), looked up by name: the parser refuses names not listed here.

#include <string>
#include <string_view>

#include "loraplex/template/ast.h"
#include "loraplex/template/value.h"

namespace loraplex::jinja {

/// The filter `name`, or nullptr.
FilterFn find_filter(std::string_view name);
/// The test `name` (`x is name`), or nullptr.
TestFn find_test(std::string_view name);

/// Whether `name` is a method of str, dict or list that templates may call.
bool is_known_method(std::string_view name);
/// Calls `object.name(args...)`; returns false when `object` has no such method.
bool call_method(const Value& object, const std::string& name, const List& args, const Dict& kwargs,
                 Context& context, const Location& where, Value* result);

/// range, namespace, dict, raise_exception, strftime_now: bound into every render.
Dict builtin_globals();

/// Python's json.dumps(value, ensure_ascii=False, indent=indent, sort_keys=sort_keys) with its
/// default separators: what transformers' tojson filter writes. indent < 0: none.
std::string python_json_dumps(const Value& value, int indent, bool sort_keys, Context& context,
                              const Location& where);

}  // namespace loraplex::jinja
