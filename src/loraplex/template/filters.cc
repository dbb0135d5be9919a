// The filters of the supported subset, with jinja2's argument conventions (transformers'
// tojson in place of jinja2's HTML-safe one).

#include <algorithm>
#include <cmath>
#include <map>

#include "loraplex/template/builtins.h"
#include "loraplex/template/ops.h"
#include "loraplex/template/text_util.h"

namespace loraplex::jinja {
namespace {

using L = const Location&;

// Argument `i` (positional) or `name` (keyword), else `dflt`.
Value arg(const List& args, const Dict& kwargs, size_t i, const char* name, Value dflt = {}) {
  if (i < args.size()) return args[i];
  for (const auto& [k, v] : kwargs)
    if (k == name) return v;
  return dflt;
}

std::string as_text(const Value& v) { return v.to_string(); }

Value f_trim(const Value& in, const List& args, const Dict& kwargs, Context&, L) {
  const Value chars = arg(args, kwargs, 0, "chars");
  return Value(python_strip(
      as_text(in), chars.is_string() ? std::optional<std::string>(chars.str()) : std::nullopt, true,
      true));
}

Value f_upper(const Value& in, const List&, const Dict&, Context&, L) {
  return Value(ascii_upper(as_text(in)));
}
Value f_lower(const Value& in, const List&, const Dict&, Context&, L) {
  return Value(ascii_lower(as_text(in)));
}
Value f_title(const Value& in, const List&, const Dict&, Context&, L) {
  return Value(ascii_title(as_text(in)));
}
Value f_capitalize(const Value& in, const List&, const Dict&, Context&, L) {
  std::string s = ascii_lower(as_text(in));
  if (!s.empty()) s[0] = ascii_upper(s.substr(0, 1))[0];
  return Value(std::move(s));
}

Value f_string(const Value& in, const List&, const Dict&, Context&, L) {
  return Value(as_text(in));
}

Value f_length(const Value& in, const List&, const Dict&, Context& c, L w) {
  return Value(length_of(in, c, w));
}

Value f_default(const Value& in, const List& args, const Dict& kwargs, Context&, L) {
  const Value dflt = arg(args, kwargs, 0, "default_value", Value(std::string()));
  const bool boolean = arg(args, kwargs, 1, "boolean", Value(false)).truthy();
  if (in.is_undefined() || (boolean && !in.truthy())) return dflt;
  return in;
}

Value f_list(const Value& in, const List&, const Dict&, Context& c, L w) {
  return Value(iterate(in, c, w));
}

Value f_first(const Value& in, const List&, const Dict&, Context& c, L w) {
  const List items = iterate(in, c, w);
  if (items.empty()) return Value::undefined("first() of an empty sequence");
  return items.front();
}

Value f_last(const Value& in, const List&, const Dict&, Context& c, L w) {
  const List items = iterate(in, c, w);
  if (items.empty()) return Value::undefined("last() of an empty sequence");
  return items.back();
}

Value f_join(const Value& in, const List& args, const Dict& kwargs, Context& c, L w) {
  const std::string sep = as_text(arg(args, kwargs, 0, "d", Value(std::string())));
  const Value attribute = arg(args, kwargs, 1, "attribute");
  std::string out;
  bool first = true;
  for (const Value& item : iterate(in, c, w)) {
    if (!first) out += sep;
    first = false;
    out += as_text(attribute.is_undefined() ? item : get_attribute(item, as_text(attribute), c, w));
  }
  return Value(std::move(out));
}

Value f_items(const Value& in, const List&, const Dict&, Context& c, L w) {
  if (in.is_undefined()) return Value(List{});
  if (!in.is_dict())
    render_fail(c, w, std::string("items filter needs a mapping, got ") + in.type_name());
  List out;
  for (const auto& [k, v] : in.dict()) out.push_back(Value::tuple({Value(k), v}));
  return Value(std::move(out));
}

Value f_tojson(const Value& in, const List& args, const Dict& kwargs, Context& c, L w) {
  const Value indent = arg(args, kwargs, 0, "indent", Value::none());
  const bool sort_keys = arg(args, kwargs, 99, "sort_keys", Value(false)).truthy();
  for (const auto& [k, v] : kwargs) {
    if (k != "indent" && k != "sort_keys" && k != "ensure_ascii") {
      render_fail(c, w, "tojson: unsupported argument '" + k + "'");
    }
    if (k == "ensure_ascii" && v.truthy())
      render_fail(c, w, "tojson: ensure_ascii=true is not supported");
  }
  const int n = indent.is_none() || indent.is_undefined() ? -1 : static_cast<int>(indent.as_int());
  return Value(python_json_dumps(in, n, sort_keys, c, w));
}

Value f_int(const Value& in, const List& args, const Dict& kwargs, Context&, L) {
  const Value dflt = arg(args, kwargs, 0, "default", Value(int64_t{0}));
  if (in.is_number()) return Value(in.as_int());
  if (in.is_string()) {
    try {
      size_t used = 0;
      const std::string s = python_strip(in.str(), std::nullopt, true, true);
      const long long v = std::stoll(s, &used);
      if (used == s.size()) return Value(static_cast<int64_t>(v));
      const double d = std::stod(s, &used);
      if (used == s.size()) return Value(static_cast<int64_t>(d));
    } catch (const std::exception&) {
    }
  }
  return dflt;
}

Value f_float(const Value& in, const List& args, const Dict& kwargs, Context&, L) {
  const Value dflt = arg(args, kwargs, 0, "default", Value(0.0));
  if (in.is_number()) return Value(in.as_double());
  if (in.is_string()) {
    try {
      size_t used = 0;
      const std::string s = python_strip(in.str(), std::nullopt, true, true);
      const double d = std::stod(s, &used);
      if (used == s.size()) return Value(d);
    } catch (const std::exception&) {
    }
  }
  return dflt;
}

Value f_abs(const Value& in, const List&, const Dict&, Context& c, L w) {
  if (!in.is_number())
    render_fail(c, w, std::string("bad operand type for abs(): ") + in.type_name());
  if (in.kind() == Value::Kind::kFloat) return Value(std::fabs(in.as_double()));
  return Value(in.as_int() < 0 ? -in.as_int() : in.as_int());
}

Value f_replace(const Value& in, const List& args, const Dict& kwargs, Context&, L) {
  const std::string s = as_text(in);
  const std::string old = as_text(arg(args, kwargs, 0, "old"));
  const std::string repl = as_text(arg(args, kwargs, 1, "new"));
  const Value count_v = arg(args, kwargs, 2, "count", Value::none());
  int64_t count = count_v.is_number() ? count_v.as_int() : -1;
  std::string out;
  if (old.empty()) {
    // Python inserts the replacement around every code point.
    return Value(s);
  }
  size_t pos = 0;
  while (count != 0) {
    const size_t at = s.find(old, pos);
    if (at == std::string::npos) break;
    out += s.substr(pos, at - pos) + repl;
    pos = at + old.size();
    if (count > 0) --count;
  }
  out += s.substr(pos);
  return Value(std::move(out));
}

Value f_indent(const Value& in, const List& args, const Dict& kwargs, Context&, L) {
  const Value width = arg(args, kwargs, 0, "width", Value(int64_t{4}));
  const bool first = arg(args, kwargs, 1, "first", Value(false)).truthy();
  const bool blank = arg(args, kwargs, 2, "blank", Value(false)).truthy();
  const std::string pad =
      width.is_string()
          ? width.str()
          : std::string(static_cast<size_t>(std::max<int64_t>(0, width.as_int())), ' ');
  const std::string s = as_text(in);
  std::vector<std::string> lines;
  size_t pos = 0;
  while (true) {
    const size_t nl = s.find('\n', pos);
    lines.push_back(s.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos));
    if (nl == std::string::npos) break;
    pos = nl + 1;
  }
  std::string out;
  for (size_t i = 0; i < lines.size(); ++i) {
    if (i) out += '\n';
    const bool pad_line = (i > 0 || first) && (blank || !lines[i].empty());
    out += (pad_line ? pad : "") + lines[i];
  }
  return Value(std::move(out));
}

// select/reject/selectattr/rejectattr: the test named by the first argument after the optional
// attribute (truthiness when none is named).
Value filter_by_test(const Value& in, const List& args, bool by_attribute, bool keep, Context& c,
                     L w) {
  size_t next = 0;
  std::string attribute;
  if (by_attribute) {
    if (args.empty()) render_fail(c, w, "selectattr/rejectattr need an attribute name");
    attribute = as_text(args[next++]);
  }
  TestFn test = nullptr;
  std::string test_name;
  if (next < args.size()) {
    test_name = as_text(args[next++]);
    test = find_test(test_name);
    if (test == nullptr) render_fail(c, w, "no test named '" + test_name + "'");
  }
  const List test_args(args.begin() + static_cast<std::ptrdiff_t>(next), args.end());
  List out;
  for (const Value& item : iterate(in, c, w)) {
    const Value subject = by_attribute ? get_attribute(item, attribute, c, w) : item;
    const bool pass = test ? test(subject, test_args, c, w) : subject.truthy();
    if (pass == keep) out.push_back(item);
  }
  return Value(std::move(out));
}

Value f_select(const Value& in, const List& a, const Dict&, Context& c, L w) {
  return filter_by_test(in, a, false, true, c, w);
}
Value f_reject(const Value& in, const List& a, const Dict&, Context& c, L w) {
  return filter_by_test(in, a, false, false, c, w);
}
Value f_selectattr(const Value& in, const List& a, const Dict&, Context& c, L w) {
  return filter_by_test(in, a, true, true, c, w);
}
Value f_rejectattr(const Value& in, const List& a, const Dict&, Context& c, L w) {
  return filter_by_test(in, a, true, false, c, w);
}

Value f_map(const Value& in, const List& args, const Dict& kwargs, Context& c, L w) {
  const Value attribute = arg({}, kwargs, 0, "attribute");
  List out;
  if (!attribute.is_undefined()) {
    const Value dflt = arg({}, kwargs, 0, "default");
    for (const Value& item : iterate(in, c, w)) {
      Value v = get_attribute(item, as_text(attribute), c, w);
      out.push_back(v.is_undefined() && !dflt.is_undefined() ? dflt : v);
    }
    return Value(std::move(out));
  }
  if (args.empty()) render_fail(c, w, "map needs a filter name or attribute=");
  const std::string name = as_text(args[0]);
  const FilterFn f = find_filter(name);
  if (f == nullptr) render_fail(c, w, "no filter named '" + name + "'");
  const List rest(args.begin() + 1, args.end());
  for (const Value& item : iterate(in, c, w)) out.push_back(f(item, rest, kwargs, c, w));
  return Value(std::move(out));
}

Value f_reverse(const Value& in, const List&, const Dict&, Context& c, L w) {
  if (in.is_string()) {
    List chars = iterate(in, c, w);
    std::string out;
    for (auto it = chars.rbegin(); it != chars.rend(); ++it) out += it->str();
    return Value(std::move(out));
  }
  List items = iterate(in, c, w);
  std::reverse(items.begin(), items.end());
  return Value(std::move(items));
}

Value f_sort(const Value& in, const List& args, const Dict& kwargs, Context& c, L w) {
  const bool reverse = arg(args, kwargs, 0, "reverse", Value(false)).truthy();
  const Value attribute = arg(args, kwargs, 2, "attribute");
  List items = iterate(in, c, w);
  auto key = [&](const Value& v) {
    return attribute.is_undefined() ? v : get_attribute(v, as_text(attribute), c, w);
  };
  std::stable_sort(items.begin(), items.end(), [&](const Value& a, const Value& b) {
    return reverse ? less_than(key(b), key(a), c, w) : less_than(key(a), key(b), c, w);
  });
  return Value(std::move(items));
}

Value f_unique(const Value& in, const List&, const Dict&, Context& c, L w) {
  List out;
  for (const Value& item : iterate(in, c, w)) {
    bool seen = false;
    for (const Value& o : out) seen = seen || o.equals(item);
    if (!seen) out.push_back(item);
  }
  return Value(std::move(out));
}

Value f_sum(const Value& in, const List& args, const Dict& kwargs, Context& c, L w) {
  const Value attribute = arg(args, kwargs, 0, "attribute");
  Value total = arg(args, kwargs, 1, "start", Value(int64_t{0}));
  for (const Value& item : iterate(in, c, w)) {
    total = binary_op(
        "+", total, attribute.is_undefined() ? item : get_attribute(item, as_text(attribute), c, w),
        c, w);
  }
  return total;
}

Value extreme(const Value& in, bool want_max, Context& c, L w) {
  const List items = iterate(in, c, w);
  if (items.empty()) return Value::undefined("min/max of an empty sequence");
  Value best = items[0];
  for (const Value& item : items) {
    if (want_max ? less_than(best, item, c, w) : less_than(item, best, c, w)) best = item;
  }
  return best;
}
Value f_max(const Value& in, const List&, const Dict&, Context& c, L w) {
  return extreme(in, true, c, w);
}
Value f_min(const Value& in, const List&, const Dict&, Context& c, L w) {
  return extreme(in, false, c, w);
}

Value f_round(const Value& in, const List& args, const Dict& kwargs, Context& c, L w) {
  if (!in.is_number()) render_fail(c, w, "round needs a number");
  const int64_t precision = arg(args, kwargs, 0, "precision", Value(int64_t{0})).as_int();
  const std::string method = as_text(arg(args, kwargs, 1, "method", Value("common")));
  const double scale = std::pow(10.0, static_cast<double>(precision));
  const double x = in.as_double() * scale;
  const double r = method == "floor"  ? std::floor(x)
                   : method == "ceil" ? std::ceil(x)
                                      : std::round(x);
  return Value(r / scale);
}

Value f_safe(const Value& in, const List&, const Dict&, Context&, L) { return in; }

Value f_wordcount(const Value& in, const List&, const Dict&, Context&, L) {
  return Value(static_cast<int64_t>(python_split(as_text(in), std::nullopt, -1).size()));
}

Value f_dictsort(const Value& in, const List& args, const Dict& kwargs, Context& c, L w) {
  if (!in.is_dict()) render_fail(c, w, "dictsort needs a mapping");
  const bool by_value = as_text(arg(args, kwargs, 1, "by", Value("key"))) == "value";
  const bool reverse = arg(args, kwargs, 2, "reverse", Value(false)).truthy();
  List items;
  for (const auto& [k, v] : in.dict()) items.push_back(Value::tuple({Value(k), v}));
  std::stable_sort(items.begin(), items.end(), [&](const Value& a, const Value& b) {
    const Value& x = a.list()[by_value ? 1 : 0];
    const Value& y = b.list()[by_value ? 1 : 0];
    return reverse ? less_than(y, x, c, w) : less_than(x, y, c, w);
  });
  return Value(std::move(items));
}

const std::map<std::string, FilterFn, std::less<>>& filters() {
  static const std::map<std::string, FilterFn, std::less<>> table = {
      {"abs", f_abs},
      {"capitalize", f_capitalize},
      {"count", f_length},
      {"d", f_default},
      {"default", f_default},
      {"dictsort", f_dictsort},
      {"first", f_first},
      {"float", f_float},
      {"indent", f_indent},
      {"int", f_int},
      {"items", f_items},
      {"join", f_join},
      {"last", f_last},
      {"length", f_length},
      {"list", f_list},
      {"lower", f_lower},
      {"map", f_map},
      {"max", f_max},
      {"min", f_min},
      {"reject", f_reject},
      {"rejectattr", f_rejectattr},
      {"replace", f_replace},
      {"reverse", f_reverse},
      {"round", f_round},
      {"safe", f_safe},
      {"select", f_select},
      {"selectattr", f_selectattr},
      {"sort", f_sort},
      {"string", f_string},
      {"sum", f_sum},
      {"title", f_title},
      {"tojson", f_tojson},
      {"trim", f_trim},
      {"unique", f_unique},
      {"upper", f_upper},
      {"wordcount", f_wordcount},
  };
  return table;
}

}  // namespace

FilterFn find_filter(std::string_view name) {
  const auto it = filters().find(name);
  return it == filters().end() ? nullptr : it->second;
}

}  // namespace loraplex::jinja
