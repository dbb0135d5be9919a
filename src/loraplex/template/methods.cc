// The str, dict and list methods chat templates call (`content.strip()`, `tool.items()`),
// with Python's argument conventions. Mutating methods are absent on purpose: transformers
// renders in jinja2's immutable sandbox, which refuses them too.

#include <set>

#include "loraplex/template/builtins.h"
#include "loraplex/template/ops.h"
#include "loraplex/template/text_util.h"

namespace loraplex::jinja {
namespace {

std::optional<std::string> opt_string(const List& args, size_t i, Context& c, const Location& w) {
  if (i >= args.size() || args[i].is_none()) return std::nullopt;
  if (!args[i].is_string()) render_fail(c, w, "expected a string argument");
  return args[i].str();
}

bool string_method(const std::string& s, const std::string& name, const List& args, Context& c,
                   const Location& w, Value* out) {
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    *out = Value(python_strip(s, opt_string(args, 0, c, w), name != "rstrip", name != "lstrip"));
  } else if (name == "split" || name == "rsplit") {
    const std::optional<std::string> sep = opt_string(args, 0, c, w);
    if (sep && sep->empty()) render_fail(c, w, "empty separator");
    const int64_t maxsplit = args.size() > 1 ? args[1].as_int() : -1;
    if (name == "rsplit" && maxsplit >= 0) {
      // rsplit with a limit splits from the right: split all, then rejoin the left part.
      std::vector<std::string> all = python_split(s, sep, -1);
      if (static_cast<int64_t>(all.size()) > maxsplit + 1 && sep) {
        const size_t keep = all.size() - static_cast<size_t>(maxsplit);
        std::string head = all[0];
        for (size_t i = 1; i < keep; ++i) head += *sep + all[i];
        std::vector<std::string> r = {head};
        r.insert(r.end(), all.begin() + static_cast<std::ptrdiff_t>(keep), all.end());
        all = r;
      } else if (!sep) {
        render_fail(c, w, "rsplit with a limit and no separator is not supported");
      }
      List l;
      for (auto& p : all) l.emplace_back(std::move(p));
      *out = Value(std::move(l));
      return true;
    }
    List parts;
    for (auto& p : python_split(s, sep, maxsplit)) parts.emplace_back(std::move(p));
    *out = Value(std::move(parts));
  } else if (name == "startswith" || name == "endswith") {
    if (args.empty()) render_fail(c, w, name + "() needs an argument");
    std::vector<std::string> options;
    if (args[0].is_list()) {
      for (const Value& v : args[0].list()) options.push_back(v.to_string());
    } else {
      options.push_back(args[0].to_string());
    }
    bool r = false;
    for (const std::string& p : options) {
      r = r || (name == "startswith"
                    ? s.compare(0, p.size(), p) == 0
                    : s.size() >= p.size() && s.compare(s.size() - p.size(), p.size(), p) == 0);
    }
    *out = Value(r);
  } else if (name == "replace") {
    if (args.size() < 2) render_fail(c, w, "replace() needs two arguments");
    const std::string old = args[0].to_string(), repl = args[1].to_string();
    int64_t count = args.size() > 2 ? args[2].as_int() : -1;
    std::string r;
    size_t pos = 0;
    while (!old.empty() && count != 0) {
      const size_t at = s.find(old, pos);
      if (at == std::string::npos) break;
      r += s.substr(pos, at - pos) + repl;
      pos = at + old.size();
      if (count > 0) --count;
    }
    *out = Value(r + s.substr(pos));
  } else if (name == "upper") {
    *out = Value(ascii_upper(s));
  } else if (name == "lower") {
    *out = Value(ascii_lower(s));
  } else if (name == "title") {
    *out = Value(ascii_title(s));
  } else if (name == "capitalize") {
    std::string r = ascii_lower(s);
    if (!r.empty()) r[0] = ascii_upper(r.substr(0, 1))[0];
    *out = Value(std::move(r));
  } else if (name == "find" || name == "rfind" || name == "count") {
    if (args.empty()) render_fail(c, w, name + "() needs an argument");
    const std::string sub = args[0].to_string();
    if (name == "count") {
      int64_t n = 0;
      if (sub.empty()) {
        n = static_cast<int64_t>(code_point_count(s)) + 1;
      } else {
        for (size_t at = s.find(sub); at != std::string::npos; at = s.find(sub, at + sub.size()))
          ++n;
      }
      *out = Value(n);
    } else {
      const size_t at = name == "find" ? s.find(sub) : s.rfind(sub);
      // Python returns a code-point index.
      *out = Value(at == std::string::npos
                       ? int64_t{-1}
                       : static_cast<int64_t>(code_point_count(std::string_view(s).substr(0, at))));
    }
  } else if (name == "join") {
    if (args.empty()) render_fail(c, w, "join() needs an argument");
    std::string r;
    bool first = true;
    for (const Value& v : iterate(args[0], c, w)) {
      if (!v.is_string()) render_fail(c, w, "join() items must be strings");
      if (!first) r += s;
      first = false;
      r += v.str();
    }
    *out = Value(std::move(r));
  } else if (name == "isdigit" || name == "isalpha" || name == "isspace" || name == "isalnum") {
    bool r = !s.empty();
    for (unsigned char ch : s) {
      r = r && (name == "isdigit"   ? std::isdigit(ch) != 0
                : name == "isalpha" ? std::isalpha(ch) != 0
                : name == "isalnum" ? std::isalnum(ch) != 0
                                    : is_python_space(ch));
    }
    *out = Value(r);
  } else if (name == "splitlines") {
    List lines;
    size_t pos = 0;
    while (pos < s.size()) {
      const size_t nl = s.find('\n', pos);
      std::string line = s.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos);
      if (!line.empty() && line.back() == '\r') line.pop_back();
      lines.emplace_back(std::move(line));
      if (nl == std::string::npos) break;
      pos = nl + 1;
    }
    *out = Value(std::move(lines));
  } else {
    return false;
  }
  return true;
}

bool dict_method(const Value& d, const std::string& name, const List& args, Value* out) {
  if (name == "items") {
    List items;
    for (const auto& [k, v] : d.dict()) items.push_back(Value::tuple({Value(k), v}));
    *out = Value(std::move(items));
  } else if (name == "keys") {
    List keys;
    for (const auto& [k, v] : d.dict()) keys.emplace_back(k);
    *out = Value(std::move(keys));
  } else if (name == "values") {
    List values;
    for (const auto& [k, v] : d.dict()) values.push_back(v);
    *out = Value(std::move(values));
  } else if (name == "get") {
    const Value* v = !args.empty() && args[0].is_string() ? d.find(args[0].str()) : nullptr;
    *out = v ? *v : (args.size() > 1 ? args[1] : Value::none());
  } else {
    return false;
  }
  return true;
}

bool list_method(const Value& l, const std::string& name, const List& args, Context& c,
                 const Location& w, Value* out) {
  if (name == "index") {
    if (args.empty()) render_fail(c, w, "index() needs an argument");
    for (size_t i = 0; i < l.list().size(); ++i) {
      if (l.list()[i].equals(args[0])) {
        *out = Value(static_cast<int64_t>(i));
        return true;
      }
    }
    render_fail(c, w, args[0].repr() + " is not in list");
  }
  if (name == "count") {
    int64_t n = 0;
    for (const Value& v : l.list()) n += !args.empty() && v.equals(args[0]) ? 1 : 0;
    *out = Value(n);
    return true;
  }
  return false;
}

}  // namespace

bool is_known_method(std::string_view name) {
  static const std::set<std::string, std::less<>> kNames = {
      "strip",   "lstrip", "rstrip",  "split",   "rsplit",     "startswith", "endswith",
      "replace", "upper",  "lower",   "title",   "capitalize", "find",       "rfind",
      "count",   "join",   "isdigit", "isalpha", "isspace",    "isalnum",    "splitlines",
      "items",   "keys",   "values",  "get",     "index"};
  return kNames.count(name) > 0;
}

bool call_method(const Value& object, const std::string& name, const List& args, const Dict& kwargs,
                 Context& context, const Location& where, Value* result) {
  if (!kwargs.empty())
    render_fail(context, where, "keyword arguments to ." + name + "() are not supported");
  if (object.is_string()) return string_method(object.str(), name, args, context, where, result);
  if (object.kind() == Value::Kind::kDict) return dict_method(object, name, args, result);
  if (object.is_list()) return list_method(object, name, args, context, where, result);
  return false;
}

}  // namespace loraplex::jinja
