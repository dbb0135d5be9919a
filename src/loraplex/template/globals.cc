// The global functions every render sees (jinja2's range, namespace and dict, and the two
// transformers adds: raise_exception and strftime_now), and the tojson writer.

#include <cmath>
#include <ctime>

#include "loraplex/template/builtins.h"
#include "loraplex/template/errors.h"

namespace loraplex::jinja {
namespace {

struct Range : Callable {
  Value call(const List& args, const Dict&, Context& c) const override {
    for (const Value& a : args) {
      if (a.kind() != Value::Kind::kInt && a.kind() != Value::Kind::kBool) {
        throw TemplateRenderError(c.origin() + ": range() takes integers");
      }
    }
    int64_t start = 0, stop = 0, step = 1;
    if (args.size() == 1) {
      stop = args[0].as_int();
    } else if (args.size() == 2 || args.size() == 3) {
      start = args[0].as_int();
      stop = args[1].as_int();
      if (args.size() == 3) step = args[2].as_int();
    } else {
      throw TemplateRenderError(c.origin() + ": range() takes 1 to 3 arguments");
    }
    if (step == 0) throw TemplateRenderError(c.origin() + ": range() step must not be zero");
    constexpr int64_t kMaxItems = 1 << 20;
    List out;
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
      if (static_cast<int64_t>(out.size()) >= kMaxItems) {
        throw TemplateRenderError(c.origin() + ": range() too long");
      }
      out.emplace_back(i);
    }
    return Value(std::move(out));
  }
};

struct MakeNamespace : Callable {
  Value call(const List& args, const Dict& kwargs, Context& c) const override {
    Dict attrs;
    for (const Value& a : args) {
      if (a.kind() != Value::Kind::kDict) {
        throw TemplateRenderError(c.origin() + ": namespace() takes a dict or keyword arguments");
      }
      attrs.insert(attrs.end(), a.dict().begin(), a.dict().end());
    }
    attrs.insert(attrs.end(), kwargs.begin(), kwargs.end());
    return Value::make_namespace(std::move(attrs));
  }
};

struct MakeDict : Callable {
  Value call(const List&, const Dict& kwargs, Context&) const override { return Value(kwargs); }
};

struct RaiseException : Callable {
  Value call(const List& args, const Dict&, Context&) const override {
    // The template's own message is what the client sees (transformers raises it as-is).
    throw TemplateRenderError(args.empty() ? std::string("raise_exception() called")
                                           : args[0].to_string());
  }
};

struct StrftimeNow : Callable {
  Value call(const List& args, const Dict&, Context& c) const override {
    if (args.empty() || !args[0].is_string()) {
      throw TemplateRenderError(c.origin() + ": strftime_now() takes a format string");
    }
    const std::time_t now = std::time(nullptr);
    std::tm local{};
    localtime_r(&now, &local);
    char buf[256];
    const size_t n = std::strftime(buf, sizeof(buf), args[0].str().c_str(), &local);
    return Value(std::string(buf, n));
  }
};

void escape_json_string(const std::string& s, std::string& out) {
  out += '"';
  for (unsigned char ch : s) {
    switch (ch) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (ch < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", ch);
          out += buf;
        } else {
          out += static_cast<char>(ch);  // ensure_ascii=False keeps UTF-8 as it is
        }
    }
  }
  out += '"';
}

void dump(const Value& v, int indent, bool sort_keys, int depth, std::string& out, Context& c,
          const Location& w) {
  const std::string item_sep = indent >= 0 ? "," : ", ";
  auto newline = [&](int d) {
    if (indent < 0) return;
    out += '\n';
    out.append(static_cast<size_t>(indent * d), ' ');
  };
  if (depth > 256) render_fail(c, w, "tojson: nesting too deep");
  switch (v.kind()) {
    case Value::Kind::kNone:
      out += "null";
      return;
    case Value::Kind::kBool:
      out += v.as_bool() ? "true" : "false";
      return;
    case Value::Kind::kInt:
      out += std::to_string(v.as_int());
      return;
    case Value::Kind::kFloat: {
      const double d = v.as_double();
      out += std::isnan(d)   ? "NaN"
             : std::isinf(d) ? (d > 0 ? "Infinity" : "-Infinity")
                             : python_float_repr(d);
      return;
    }
    case Value::Kind::kString:
      escape_json_string(v.str(), out);
      return;
    case Value::Kind::kList: {
      if (v.list().empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t i = 0; i < v.list().size(); ++i) {
        if (i) out += item_sep;
        newline(depth + 1);
        dump(v.list()[i], indent, sort_keys, depth + 1, out, c, w);
      }
      newline(depth);
      out += ']';
      return;
    }
    case Value::Kind::kDict: {
      if (v.dict().empty()) {
        out += "{}";
        return;
      }
      std::vector<const std::pair<std::string, Value>*> entries;
      for (const auto& e : v.dict()) entries.push_back(&e);
      if (sort_keys) {
        std::stable_sort(entries.begin(), entries.end(),
                         [](const auto* a, const auto* b) { return a->first < b->first; });
      }
      out += '{';
      for (size_t i = 0; i < entries.size(); ++i) {
        if (i) out += item_sep;
        newline(depth + 1);
        escape_json_string(entries[i]->first, out);
        out += ": ";
        dump(entries[i]->second, indent, sort_keys, depth + 1, out, c, w);
      }
      newline(depth);
      out += '}';
      return;
    }
    default:
      render_fail(c, w,
                  std::string("Object of type ") + v.type_name() + " is not JSON serializable");
  }
}

}  // namespace

std::string python_json_dumps(const Value& value, int indent, bool sort_keys, Context& context,
                              const Location& where) {
  std::string out;
  dump(value, indent, sort_keys, 0, out, context, where);
  return out;
}

Dict builtin_globals() {
  return {{"range", Value::callable(std::make_shared<Range>())},
          {"namespace", Value::callable(std::make_shared<MakeNamespace>())},
          {"dict", Value::callable(std::make_shared<MakeDict>())},
          {"raise_exception", Value::callable(std::make_shared<RaiseException>())},
          {"strftime_now", Value::callable(std::make_shared<StrftimeNow>())}};
}

}  // namespace loraplex::jinja
