#pragma once
// Python's operators on template values, shared by the evaluator and the filters: attribute
// and item access as jinja2's environment does them, iteration, ordering and arithmetic.

#include <string>

#include "loraplex/template/ast.h"
#include "loraplex/template/value.h"

namespace loraplex::jinja {

/// `object.name`: a dict entry (or namespace attribute); Undefined when missing. Fails on an
/// Undefined object, as jinja2's Undefined does.
Value get_attribute(const Value& object, const std::string& name, Context& context,
                    const Location& where);
/// `object[key]`: dict entry, list or string index (negative from the end); Undefined when
/// missing or out of range.
Value get_item(const Value& object, const Value& key, Context& context, const Location& where);
/// What `for x in value` walks: list items, dict keys, string code points; Undefined is empty.
List iterate(const Value& value, Context& context, const Location& where);
/// Python's `a < b` for numbers, strings and lists; fails on other types.
bool less_than(const Value& a, const Value& b, Context& context, const Location& where);
/// Applies a binary operator (+ - * / // % ** ~ == != < > <= >= in notin).
Value binary_op(const std::string& op, const Value& a, const Value& b, Context& context,
                const Location& where);
/// len(): code points of a string, items of a list or dict; 0 for Undefined.
int64_t length_of(const Value& value, Context& context, const Location& where);

}  // namespace loraplex::jinja
