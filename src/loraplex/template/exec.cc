// Statement execution: one exec() per statement type of ast.h.

#include "loraplex/template/ast.h"
#include "loraplex/template/errors.h"
#include "loraplex/template/ops.h"

namespace loraplex::jinja {
namespace {

void bind_targets(const std::vector<std::string>& targets, const Value& value, Context& context,
                  const Location& where) {
  if (targets.size() == 1) {
    context.set(targets[0], value);
    return;
  }
  const List items = iterate(value, context, where);
  if (items.size() != targets.size()) {
    render_fail(context, where,
                "cannot unpack " + std::to_string(items.size()) + " values into " +
                    std::to_string(targets.size()) + " names");
  }
  for (size_t i = 0; i < targets.size(); ++i) context.set(targets[i], items[i]);
}

// A macro bound to its definition: called with positional and keyword arguments, it renders
// its body in a scope of its own and returns the text.
struct Macro : Callable {
  const MacroStmt* def;
  Value call(const List& args, const Dict& kwargs, Context& context) const override {
    if (args.size() > def->params.size()) {
      render_fail(context, def->where,
                  "macro '" + def->name + "' takes " + std::to_string(def->params.size()) +
                      " arguments, got " + std::to_string(args.size()));
    }
    std::string out;
    context.enter_call();
    struct Leave {
      Context& c;
      ~Leave() { c.leave_call(); }
    } leave{context};
    // Defaults are evaluated in the caller's scope before the macro's own opens.
    std::vector<Value> values(def->params.size());
    for (size_t i = 0; i < def->params.size(); ++i) {
      if (i < args.size()) {
        values[i] = args[i];
        continue;
      }
      bool given = false;
      for (const auto& [k, v] : kwargs) {
        if (k == def->params[i]) {
          values[i] = v;
          given = true;
        }
      }
      if (!given) {
        values[i] = def->defaults[i]
                        ? def->defaults[i]->eval(context)
                        : Value::undefined("parameter '" + def->params[i] + "' of macro '" +
                                           def->name + "' is missing");
      }
    }
    for (const auto& [k, v] : kwargs) {
      bool known = false;
      for (const std::string& p : def->params) known = known || p == k;
      if (!known) {
        render_fail(context, def->where,
                    "macro '" + def->name + "' has no parameter named '" + k + "'");
      }
    }
    context.with_isolated_scope([&] {
      for (size_t i = 0; i < def->params.size(); ++i) context.set(def->params[i], values[i]);
      exec_body(def->body, context, out);
    });
    return Value(std::move(out));
  }
};

}  // namespace

Flow exec_body(const Body& body, Context& context, std::string& out) {
  for (const StmtPtr& s : body) {
    const Flow f = s->exec(context, out);
    if (f != Flow::kNormal) return f;
  }
  return Flow::kNormal;
}

Flow TextStmt::exec(Context&, std::string& out) const {
  out += text;
  return Flow::kNormal;
}

Flow PrintStmt::exec(Context& context, std::string& out) const {
  out += expr->eval(context).to_string();
  return Flow::kNormal;
}

Flow IfStmt::exec(Context& context, std::string& out) const {
  for (const auto& [cond, body] : branches) {
    if (cond->eval(context).truthy()) return exec_body(body, context, out);
  }
  return exec_body(else_body, context, out);
}

Flow ForStmt::exec(Context& context, std::string& out) const {
  const Value seq = iterable->eval(context);
  if (seq.is_none()) render_fail(context, where, "'NoneType' object is not iterable");
  List items = iterate(seq, context, where);
  context.push_scope();
  struct Pop {
    Context& c;
    ~Pop() { c.pop_scope(); }
  } pop{context};
  if (filter) {
    // The loop's `if` filters before loop.index and loop.length are counted.
    List kept;
    for (const Value& item : items) {
      bind_targets(targets, item, context, where);
      if (filter->eval(context).truthy()) kept.push_back(item);
    }
    items.swap(kept);
  }
  const auto n = static_cast<int64_t>(items.size());
  for (int64_t i = 0; i < n; ++i) {
    const Value& item = items[static_cast<size_t>(i)];
    Dict loop = {{"index", Value(i + 1)},
                 {"index0", Value(i)},
                 {"revindex", Value(n - i)},
                 {"revindex0", Value(n - i - 1)},
                 {"first", Value(i == 0)},
                 {"last", Value(i == n - 1)},
                 {"length", Value(n)},
                 {"depth", Value(int64_t{1})},
                 {"depth0", Value(int64_t{0})},
                 {"previtem", i > 0 ? items[static_cast<size_t>(i - 1)]
                                    : Value::undefined("there is no previous item")},
                 {"nextitem", i + 1 < n ? items[static_cast<size_t>(i + 1)]
                                        : Value::undefined("there is no next item")}};
    context.set("loop", Value(std::move(loop)));
    bind_targets(targets, item, context, where);
    if (exec_body(body, context, out) == Flow::kBreak) break;
  }
  if (n == 0) exec_body(else_body, context, out);
  return Flow::kNormal;
}

Flow SetStmt::exec(Context& context, std::string& out) const {
  (void)out;
  Value v;
  if (value) {
    v = value->eval(context);
  } else {
    std::string captured;
    exec_body(body, context, captured);
    v = Value(std::move(captured));
  }
  if (!attribute.empty()) {
    const Value ns = context.lookup(targets[0]);
    if (ns.kind() != Value::Kind::kNamespace) {
      render_fail(context, where,
                  "cannot assign attribute '" + attribute + "' on '" + targets[0] +
                      "' (only a namespace() takes attribute assignments)");
    }
    Dict& attrs = ns.namespace_dict();
    for (auto& [k, old] : attrs) {
      if (k == attribute) {
        old = std::move(v);
        return Flow::kNormal;
      }
    }
    attrs.emplace_back(attribute, std::move(v));
    return Flow::kNormal;
  }
  bind_targets(targets, v, context, where);
  return Flow::kNormal;
}

Flow MacroStmt::exec(Context& context, std::string&) const {
  auto m = std::make_shared<Macro>();
  m->def = this;
  context.set(name, Value::callable(std::move(m)));
  return Flow::kNormal;
}

Flow LoopControlStmt::exec(Context&, std::string&) const { return flow; }

Flow GenerationStmt::exec(Context& context, std::string& out) const {
  return exec_body(body, context, out);
}

}  // namespace loraplex::jinja
