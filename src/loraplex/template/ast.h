#pragma once
// The parsed template: expression nodes evaluate to a Value, statement nodes append to the
// output. Filters and tests are resolved to functions when parsed, so an unknown one is a
// load-time error.

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "loraplex/template/context.h"
#include "loraplex/template/value.h"

namespace loraplex::jinja {

struct Location {
  int line = 0;
  int column = 0;
};

/// A render failure at `where`: throws TemplateRenderError naming the origin and location.
[[noreturn]] void render_fail(const Context& context, const Location& where,
                              const std::string& what);

struct Expr {
  explicit Expr(Location where) : where(where) {}
  virtual ~Expr() = default;
  virtual Value eval(Context& context) const = 0;
  Location where;
};
using ExprPtr = std::unique_ptr<Expr>;

using FilterFn = Value (*)(const Value& input, const List& args, const Dict& kwargs,
                           Context& context, const Location& where);
using TestFn = bool (*)(const Value& input, const List& args, Context& context,
                        const Location& where);

struct Literal : Expr {
  Literal(Location w, Value v) : Expr(w), value(std::move(v)) {}
  Value eval(Context& context) const override;
  Value value;
};

struct Name : Expr {
  Name(Location w, std::string n) : Expr(w), name(std::move(n)) {}
  Value eval(Context& context) const override;
  std::string name;
};

struct ListExpr : Expr {
  using Expr::Expr;
  Value eval(Context& context) const override;
  std::vector<ExprPtr> items;
  bool tuple = false;  // (a, b) rather than [a, b]
};

struct DictExpr : Expr {
  using Expr::Expr;
  Value eval(Context& context) const override;
  std::vector<std::pair<ExprPtr, ExprPtr>> items;
};

struct GetAttr : Expr {
  GetAttr(Location w, ExprPtr o, std::string n)
      : Expr(w), object(std::move(o)), name(std::move(n)) {}
  Value eval(Context& context) const override;
  ExprPtr object;
  std::string name;
};

struct GetItem : Expr {
  GetItem(Location w, ExprPtr o, ExprPtr k) : Expr(w), object(std::move(o)), key(std::move(k)) {}
  Value eval(Context& context) const override;
  ExprPtr object;
  ExprPtr key;
};

struct SliceExpr : Expr {
  using Expr::Expr;
  Value eval(Context& context) const override;
  ExprPtr object;
  ExprPtr start, stop, step;  // each may be null
};

struct Argument {
  std::string name;  // empty for positional
  ExprPtr value;
};

struct Call : Expr {
  using Expr::Expr;
  Value eval(Context& context) const override;
  ExprPtr callee;
  std::vector<Argument> args;
};

struct FilterExpr : Expr {
  using Expr::Expr;
  Value eval(Context& context) const override;
  ExprPtr input;
  std::string name;
  FilterFn fn = nullptr;
  std::vector<Argument> args;
};

struct TestExpr : Expr {
  using Expr::Expr;
  Value eval(Context& context) const override;
  ExprPtr input;
  std::string name;
  TestFn fn = nullptr;
  std::vector<ExprPtr> args;
  bool negated = false;
};

struct Unary : Expr {
  Unary(Location w, std::string o, ExprPtr e) : Expr(w), op(std::move(o)), operand(std::move(e)) {}
  Value eval(Context& context) const override;
  std::string op;  // not, -, +
  ExprPtr operand;
};

struct Binary : Expr {
  Binary(Location w, std::string o, ExprPtr l, ExprPtr r)
      : Expr(w), op(std::move(o)), left(std::move(l)), right(std::move(r)) {}
  Value eval(Context& context) const override;
  std::string op;  // + - * / // % ** ~ == != < > <= >= in notin and or
  ExprPtr left, right;
};

struct CondExpr : Expr {
  using Expr::Expr;
  Value eval(Context& context) const override;
  ExprPtr condition, then_value, else_value;  // else_value may be null
};

/// How a statement list ended: normally or by {% break %} / {% continue %}.
enum class Flow { kNormal, kBreak, kContinue };

struct Stmt {
  explicit Stmt(Location where) : where(where) {}
  virtual ~Stmt() = default;
  virtual Flow exec(Context& context, std::string& out) const = 0;
  Location where;
};
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

/// Runs a statement list; stops early on break/continue and returns that flow.
Flow exec_body(const Body& body, Context& context, std::string& out);

struct TextStmt : Stmt {
  TextStmt(Location w, std::string t) : Stmt(w), text(std::move(t)) {}
  Flow exec(Context& context, std::string& out) const override;
  std::string text;
};

struct PrintStmt : Stmt {
  PrintStmt(Location w, ExprPtr e) : Stmt(w), expr(std::move(e)) {}
  Flow exec(Context& context, std::string& out) const override;
  ExprPtr expr;
};

struct IfStmt : Stmt {
  using Stmt::Stmt;
  Flow exec(Context& context, std::string& out) const override;
  std::vector<std::pair<ExprPtr, Body>> branches;  // if, elif...
  Body else_body;
};

struct ForStmt : Stmt {
  using Stmt::Stmt;
  Flow exec(Context& context, std::string& out) const override;
  std::vector<std::string> targets;
  ExprPtr iterable;
  ExprPtr filter;  // `for x in xs if cond`; may be null
  Body body;
  Body else_body;
};

struct SetStmt : Stmt {
  using Stmt::Stmt;
  Flow exec(Context& context, std::string& out) const override;
  std::vector<std::string> targets;  // one name, or several to unpack
  std::string attribute;             // `set ns.attribute = ...` when not empty
  ExprPtr value;                     // null for the block form
  Body body;                         // `{% set x %}...{% endset %}`
};

struct MacroStmt : Stmt {
  using Stmt::Stmt;
  Flow exec(Context& context, std::string& out) const override;
  std::string name;
  std::vector<std::string> params;
  std::vector<ExprPtr> defaults;  // one per parameter, null when it has none
  Body body;
};

struct LoopControlStmt : Stmt {
  LoopControlStmt(Location w, Flow f) : Stmt(w), flow(f) {}
  Flow exec(Context& context, std::string& out) const override;
  Flow flow;
};

/// transformers' {% generation %} block (marks assistant tokens); renders its body.
struct GenerationStmt : Stmt {
  using Stmt::Stmt;
  Flow exec(Context& context, std::string& out) const override;
  Body body;
};

}  // namespace loraplex::jinja
