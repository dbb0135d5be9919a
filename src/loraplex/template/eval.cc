// Expression evaluation: one eval() per node type of ast.h.

#include <cmath>

#include "loraplex/template/ast.h"
#include "loraplex/template/builtins.h"
#include "loraplex/template/errors.h"
#include "loraplex/template/ops.h"
#include "loraplex/template/text_util.h"

namespace loraplex::jinja {
namespace {

void eval_args(const std::vector<Argument>& args, Context& context, List* positional,
               Dict* keyword) {
  for (const Argument& a : args) {
    if (a.name.empty()) {
      positional->push_back(a.value->eval(context));
    } else {
      keyword->emplace_back(a.name, a.value->eval(context));
    }
  }
}

// Python's slice.indices(): clamps start/stop for a sequence of `n` items.
void slice_bounds(int64_t n, const Value& start_v, const Value& stop_v, int64_t step,
                  int64_t* start, int64_t* stop) {
  auto clamp = [&](const Value& v, int64_t dflt) -> int64_t {
    if (v.is_undefined() || v.is_none()) return dflt;
    int64_t i = v.as_int();
    if (i < 0) i += n;
    if (step > 0) return std::min(std::max<int64_t>(i, 0), n);
    return std::min(std::max<int64_t>(i, -1), n - 1);
  };
  *start = clamp(start_v, step > 0 ? 0 : n - 1);
  *stop = clamp(stop_v, step > 0 ? n : -1);
}

}  // namespace

void render_fail(const Context& context, const Location& where, const std::string& what) {
  throw TemplateRenderError(context.origin() + ":" + std::to_string(where.line) + ":" +
                            std::to_string(where.column) + ": " + what);
}

Value Literal::eval(Context&) const { return value; }

Value Name::eval(Context& context) const { return context.lookup(name); }

Value ListExpr::eval(Context& context) const {
  List out;
  out.reserve(items.size());
  for (const ExprPtr& e : items) out.push_back(e->eval(context));
  return tuple ? Value::tuple(std::move(out)) : Value(std::move(out));
}

Value DictExpr::eval(Context& context) const {
  Dict out;
  for (const auto& [k, v] : items) {
    const Value key = k->eval(context);
    if (!key.is_string()) render_fail(context, where, "dict literal keys must be strings");
    Value value = v->eval(context);
    bool replaced = false;
    for (auto& entry : out) {
      if (entry.first == key.str()) {
        entry.second = value;
        replaced = true;
      }
    }
    if (!replaced) out.emplace_back(key.str(), std::move(value));
  }
  return Value(std::move(out));
}

Value GetAttr::eval(Context& context) const {
  return get_attribute(object->eval(context), name, context, where);
}

Value GetItem::eval(Context& context) const {
  return get_item(object->eval(context), key->eval(context), context, where);
}

Value SliceExpr::eval(Context& context) const {
  const Value obj = object->eval(context);
  const Value start_v = start ? start->eval(context) : Value::none();
  const Value stop_v = stop ? stop->eval(context) : Value::none();
  const Value step_v = step ? step->eval(context) : Value::none();
  for (const Value* v : {&start_v, &stop_v, &step_v}) {
    if (!v->is_none() && !(v->kind() == Value::Kind::kInt || v->kind() == Value::Kind::kBool)) {
      render_fail(context, where, "slice indices must be integers or none");
    }
  }
  const int64_t step_n = step_v.is_none() ? 1 : step_v.as_int();
  if (step_n == 0) render_fail(context, where, "slice step cannot be zero");
  if (obj.is_undefined()) render_fail(context, where, obj.undefined_hint());
  std::vector<size_t> off;
  int64_t n;
  if (obj.is_list()) {
    n = static_cast<int64_t>(obj.list().size());
  } else if (obj.is_string()) {
    off = code_point_offsets(obj.str());
    n = static_cast<int64_t>(off.size()) - 1;
  } else {
    render_fail(context, where,
                std::string("'") + obj.type_name() + "' object is not subscriptable");
  }
  int64_t begin, end;
  slice_bounds(n, start_v, stop_v, step_n, &begin, &end);
  if (obj.is_list()) {
    List out;
    for (int64_t i = begin; step_n > 0 ? i < end : i > end; i += step_n)
      out.push_back(obj.list()[static_cast<size_t>(i)]);
    return Value(std::move(out));
  }
  std::string out;
  if (step_n == 1) {
    if (end > begin)
      out = obj.str().substr(off[static_cast<size_t>(begin)],
                             off[static_cast<size_t>(end)] - off[static_cast<size_t>(begin)]);
    return Value(std::move(out));
  }
  for (int64_t i = begin; step_n > 0 ? i < end : i > end; i += step_n) {
    const auto k = static_cast<size_t>(i);
    out += obj.str().substr(off[k], off[k + 1] - off[k]);
  }
  return Value(std::move(out));
}

Value Call::eval(Context& context) const {
  List args_v;
  Dict kwargs_v;
  if (const auto* attr = dynamic_cast<const GetAttr*>(callee.get())) {
    const Value object = attr->object->eval(context);
    if (object.is_undefined()) render_fail(context, where, object.undefined_hint());
    eval_args(args, context, &args_v, &kwargs_v);
    Value result;
    if (call_method(object, attr->name, args_v, kwargs_v, context, where, &result)) return result;
    const Value member = get_attribute(object, attr->name, context, where);
    if (member.kind() != Value::Kind::kCallable) {
      render_fail(
          context, where,
          std::string("'") + object.type_name() + "' object has no method '" + attr->name + "'");
    }
    return member.fn().call(args_v, kwargs_v, context);
  }
  const Value fn = callee->eval(context);
  if (fn.kind() != Value::Kind::kCallable) {
    if (fn.is_undefined())
      render_fail(context, where, fn.undefined_hint() + " (called as a function)");
    render_fail(context, where, std::string("'") + fn.type_name() + "' object is not callable");
  }
  eval_args(args, context, &args_v, &kwargs_v);
  return fn.fn().call(args_v, kwargs_v, context);
}

Value FilterExpr::eval(Context& context) const {
  const Value in = input->eval(context);
  List args_v;
  Dict kwargs_v;
  eval_args(args, context, &args_v, &kwargs_v);
  return fn(in, args_v, kwargs_v, context, where);
}

Value TestExpr::eval(Context& context) const {
  const Value in = input->eval(context);
  List args_v;
  for (const ExprPtr& a : args) args_v.push_back(a->eval(context));
  const bool r = fn(in, args_v, context, where);
  return Value(negated ? !r : r);
}

Value Unary::eval(Context& context) const {
  const Value v = operand->eval(context);
  if (op == "not") return Value(!v.truthy());
  if (v.is_undefined()) render_fail(context, where, v.undefined_hint());
  if (!v.is_number()) {
    render_fail(context, where, "bad operand type for unary " + op + ": '" + v.type_name() + "'");
  }
  if (op == "+") return v.kind() == Value::Kind::kBool ? Value(v.as_int()) : v;
  if (v.kind() == Value::Kind::kFloat) return Value(-v.as_double());
  if (v.as_int() == INT64_MIN) render_fail(context, where, "integer overflow");
  return Value(-v.as_int());
}

Value Binary::eval(Context& context) const {
  const Value a = left->eval(context);
  // and/or return an operand, as in Python, and short-circuit.
  if (op == "and") return a.truthy() ? right->eval(context) : a;
  if (op == "or") return a.truthy() ? a : right->eval(context);
  return binary_op(op, a, right->eval(context), context, where);
}

Value CondExpr::eval(Context& context) const {
  if (condition->eval(context).truthy()) return then_value->eval(context);
  if (else_value) return else_value->eval(context);
  return Value::undefined("the condition of an inline if without else was false");
}

}  // namespace loraplex::jinja
