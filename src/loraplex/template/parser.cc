#include "loraplex/template/parser.h"

#include <set>
#include <string>

#include "loraplex/template/builtins.h"
#include "loraplex/template/errors.h"

namespace loraplex::jinja {
namespace {

using T = Token::Type;

std::string describe(const Token& t) {
  switch (t.type) {
    case T::kText:
      return "template text";
    case T::kVarBegin:
      return "'{{'";
    case T::kVarEnd:
      return "'}}'";
    case T::kBlockBegin:
      return "'{%'";
    case T::kBlockEnd:
      return "'%}'";
    case T::kName:
      return "'" + t.value + "'";
    case T::kString:
      return "a string";
    case T::kInt:
    case T::kFloat:
      return "a number";
    case T::kOperator:
      return "'" + t.value + "'";
    case T::kEof:
      return "the end of the template";
  }
  return "?";
}

class Parser {
 public:
  Parser(const std::vector<Token>& tokens, std::string_view origin)
      : tokens_(tokens), origin_(origin) {}

  Body parse_template() {
    Body body = parse_body({});
    return body;
  }

 private:
  const Token& peek(size_t ahead = 0) const {
    const size_t i = pos_ + ahead;
    return i < tokens_.size() ? tokens_[i] : tokens_.back();
  }
  const Token& next() {
    const Token& t = peek();
    if (pos_ < tokens_.size() - 1) ++pos_;
    return t;
  }
  static Location at(const Token& t) { return {t.line, t.column}; }

  [[noreturn]] void fail(const Token& t, const std::string& what) const {
    throw TemplateSyntaxError(std::string(origin_) + ":" + std::to_string(t.line) + ":" +
                              std::to_string(t.column) + ": " + what);
  }

  bool is_op(const Token& t, std::string_view op) const {
    return t.type == T::kOperator && t.value == op;
  }
  bool is_name(const Token& t, std::string_view name) const {
    return t.type == T::kName && t.value == name;
  }
  void expect_op(std::string_view op) {
    const Token& t = next();
    if (!is_op(t, op)) fail(t, "expected '" + std::string(op) + "', got " + describe(t));
  }
  std::string expect_name() {
    const Token& t = next();
    if (t.type != T::kName) fail(t, "expected a name, got " + describe(t));
    return t.value;
  }
  void expect_block_end() {
    const Token& t = next();
    if (t.type != T::kBlockEnd)
      fail(t, "expected the end of the statement ('%}'), got " + describe(t));
  }

  // Parses statements until a block tag named in `stop` (left unconsumed: the caller reads it)
  // or the end of the template (an error when `stop` is not empty).
  Body parse_body(const std::set<std::string>& stop) {
    Body body;
    while (true) {
      const Token& t = peek();
      if (t.type == T::kEof) {
        if (!stop.empty()) {
          fail(t, "missing {% " + *stop.rbegin() + " %} (the template ends inside a block)");
        }
        return body;
      }
      if (t.type == T::kText) {
        body.push_back(std::make_unique<TextStmt>(at(t), t.value));
        next();
        continue;
      }
      if (t.type == T::kVarBegin) {
        next();
        ExprPtr e = parse_tuple(true);
        const Token& end = next();
        if (end.type != T::kVarEnd) fail(end, "expected '}}', got " + describe(end));
        body.push_back(std::make_unique<PrintStmt>(at(t), std::move(e)));
        continue;
      }
      if (t.type != T::kBlockBegin) fail(t, "unexpected " + describe(t));
      const Token& keyword = peek(1);
      if (keyword.type != T::kName) fail(keyword, "expected a statement name after '{%'");
      if (stop.count(keyword.value)) return body;
      next();
      next();
      body.push_back(parse_statement(t, keyword));
    }
  }

  StmtPtr parse_statement(const Token& begin, const Token& keyword) {
    const std::string& k = keyword.value;
    if (k == "if") return parse_if(begin);
    if (k == "for") return parse_for(begin);
    if (k == "set") return parse_set(begin);
    if (k == "macro") return parse_macro(begin);
    if (k == "break" || k == "continue") {
      expect_block_end();
      return std::make_unique<LoopControlStmt>(at(begin),
                                               k == "break" ? Flow::kBreak : Flow::kContinue);
    }
    if (k == "generation") {
      expect_block_end();
      auto g = std::make_unique<GenerationStmt>(at(begin));
      g->body = parse_body({"endgeneration"});
      next();
      next();
      expect_block_end();
      return g;
    }
    static const std::set<std::string> kKnownUnsupported = {
        "include", "import", "from",       "extends", "block", "call",     "filter",
        "with",    "raw",    "autoescape", "do",      "trans", "pluralize"};
    if (kKnownUnsupported.count(k)) {
      fail(keyword, "'{% " + k + " %}' is not supported by loraplex's chat-template engine");
    }
    if (k == "else" || k == "elif" || k.rfind("end", 0) == 0) {
      fail(keyword, "'{% " + k + " %}' without a matching opening tag");
    }
    fail(keyword, "unknown statement '{% " + k + " %}'");
  }

  StmtPtr parse_if(const Token& begin) {
    auto s = std::make_unique<IfStmt>(at(begin));
    ExprPtr cond = parse_expression();
    expect_block_end();
    Body body = parse_body({"elif", "else", "endif"});
    s->branches.emplace_back(std::move(cond), std::move(body));
    while (true) {
      next();  // {%
      const Token& k = next();
      if (k.value == "elif") {
        ExprPtr c = parse_expression();
        expect_block_end();
        Body b = parse_body({"elif", "else", "endif"});
        s->branches.emplace_back(std::move(c), std::move(b));
      } else if (k.value == "else") {
        expect_block_end();
        s->else_body = parse_body({"endif"});
      } else {
        expect_block_end();
        return s;
      }
    }
  }

  StmtPtr parse_for(const Token& begin) {
    auto s = std::make_unique<ForStmt>(at(begin));
    s->targets.push_back(expect_name());
    while (is_op(peek(), ",")) {
      next();
      s->targets.push_back(expect_name());
    }
    const Token& in = next();
    if (!is_name(in, "in")) fail(in, "expected 'in' in the for statement, got " + describe(in));
    s->iterable = parse_tuple(false);
    if (is_name(peek(), "if")) {
      next();
      s->filter = parse_expression();
    }
    if (is_name(peek(), "recursive")) fail(peek(), "recursive for loops are not supported");
    expect_block_end();
    s->body = parse_body({"else", "endfor"});
    next();
    const Token& k = next();
    if (k.value == "else") {
      expect_block_end();
      s->else_body = parse_body({"endfor"});
      next();
      next();
    }
    expect_block_end();
    return s;
  }

  StmtPtr parse_set(const Token& begin) {
    auto s = std::make_unique<SetStmt>(at(begin));
    s->targets.push_back(expect_name());
    if (is_op(peek(), ".")) {
      next();
      s->attribute = expect_name();
    } else {
      while (is_op(peek(), ",")) {
        next();
        s->targets.push_back(expect_name());
      }
    }
    if (is_op(peek(), "=")) {
      next();
      s->value = parse_tuple(true);
      expect_block_end();
      return s;
    }
    if (is_op(peek(), "|")) fail(peek(), "filtered block assignments are not supported");
    if (s->targets.size() != 1 || !s->attribute.empty()) {
      fail(peek(), "a block assignment ({% set x %}...{% endset %}) takes one plain name");
    }
    expect_block_end();
    s->body = parse_body({"endset"});
    next();
    next();
    expect_block_end();
    return s;
  }

  StmtPtr parse_macro(const Token& begin) {
    auto s = std::make_unique<MacroStmt>(at(begin));
    s->name = expect_name();
    expect_op("(");
    while (!is_op(peek(), ")")) {
      if (!s->params.empty()) expect_op(",");
      if (is_op(peek(), ")")) break;
      s->params.push_back(expect_name());
      if (is_op(peek(), "=")) {
        next();
        s->defaults.push_back(parse_expression());
      } else {
        s->defaults.push_back(nullptr);
      }
    }
    next();
    expect_block_end();
    s->body = parse_body({"endmacro"});
    next();
    next();
    expect_block_end();
    return s;
  }

  // An expression, or several separated by commas (a tuple, kept as a list).
  ExprPtr parse_tuple(bool with_condexpr) {
    const Token& first_token = peek();
    ExprPtr first = with_condexpr ? parse_expression() : parse_or();
    if (!is_op(peek(), ",")) return first;
    auto list = std::make_unique<ListExpr>(at(first_token));
    list->tuple = true;
    list->items.push_back(std::move(first));
    while (is_op(peek(), ",")) {
      next();
      const Token& t = peek();
      if (t.type == T::kBlockEnd || t.type == T::kVarEnd || is_op(t, ")") || is_name(t, "if")) {
        break;
      }
      list->items.push_back(with_condexpr ? parse_expression() : parse_or());
    }
    return list;
  }

  ExprPtr parse_expression() {
    const Token& start = peek();
    ExprPtr expr = parse_or();
    while (is_name(peek(), "if")) {
      next();
      auto c = std::make_unique<CondExpr>(at(start));
      c->then_value = std::move(expr);
      c->condition = parse_or();
      if (is_name(peek(), "else")) {
        next();
        c->else_value = parse_expression();
      }
      expr = std::move(c);
    }
    return expr;
  }

  ExprPtr parse_or() {
    ExprPtr left = parse_and();
    while (is_name(peek(), "or")) {
      const Token& op = next();
      left = std::make_unique<Binary>(at(op), "or", std::move(left), parse_and());
    }
    return left;
  }

  ExprPtr parse_and() {
    ExprPtr left = parse_not();
    while (is_name(peek(), "and")) {
      const Token& op = next();
      left = std::make_unique<Binary>(at(op), "and", std::move(left), parse_not());
    }
    return left;
  }

  ExprPtr parse_not() {
    if (is_name(peek(), "not")) {
      const Token& op = next();
      return std::make_unique<Unary>(at(op), "not", parse_not());
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    ExprPtr left = parse_math1();
    bool compared = false;
    while (true) {
      const Token& t = peek();
      std::string op;
      if (t.type == T::kOperator && (t.value == "==" || t.value == "!=" || t.value == "<" ||
                                     t.value == ">" || t.value == "<=" || t.value == ">=")) {
        op = t.value;
        next();
      } else if (is_name(t, "in")) {
        op = "in";
        next();
      } else if (is_name(t, "not") && is_name(peek(1), "in")) {
        op = "notin";
        next();
        next();
      } else {
        return left;
      }
      // Python chains comparisons (a < b < c); templates do not, and a left-nested reading
      // would differ, so a chain is refused.
      if (compared) fail(t, "chained comparisons are not supported; use 'and'");
      compared = true;
      left = std::make_unique<Binary>(at(t), op, std::move(left), parse_math1());
    }
  }

  ExprPtr parse_math1() {
    ExprPtr left = parse_concat();
    while (is_op(peek(), "+") || is_op(peek(), "-")) {
      const Token& op = next();
      left = std::make_unique<Binary>(at(op), op.value, std::move(left), parse_concat());
    }
    return left;
  }

  ExprPtr parse_concat() {
    ExprPtr left = parse_math2();
    while (is_op(peek(), "~")) {
      const Token& op = next();
      left = std::make_unique<Binary>(at(op), "~", std::move(left), parse_math2());
    }
    return left;
  }

  ExprPtr parse_math2() {
    ExprPtr left = parse_pow();
    while (is_op(peek(), "*") || is_op(peek(), "/") || is_op(peek(), "//") || is_op(peek(), "%")) {
      const Token& op = next();
      left = std::make_unique<Binary>(at(op), op.value, std::move(left), parse_pow());
    }
    return left;
  }

  ExprPtr parse_pow() {
    ExprPtr left = parse_unary(true);
    while (is_op(peek(), "**")) {
      const Token& op = next();
      left = std::make_unique<Binary>(at(op), "**", std::move(left), parse_unary(true));
    }
    return left;
  }

  ExprPtr parse_unary(bool with_filter) {
    const Token& t = peek();
    ExprPtr node;
    if (is_op(t, "-") || is_op(t, "+")) {
      next();
      node = std::make_unique<Unary>(at(t), t.value, parse_unary(false));
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    if (with_filter) node = parse_filter_expr(std::move(node));
    return node;
  }

  ExprPtr parse_primary() {
    const Token& t = next();
    switch (t.type) {
      case T::kName: {
        if (t.value == "true" || t.value == "True") return std::make_unique<Literal>(at(t), true);
        if (t.value == "false" || t.value == "False") {
          return std::make_unique<Literal>(at(t), false);
        }
        if (t.value == "none" || t.value == "None") {
          return std::make_unique<Literal>(at(t), Value::none());
        }
        return std::make_unique<Name>(at(t), t.value);
      }
      case T::kString: {
        std::string s = t.value;
        while (peek().type == T::kString) s += next().value;  // "a" "b" concatenates
        return std::make_unique<Literal>(at(t), Value(std::move(s)));
      }
      case T::kInt:
        return std::make_unique<Literal>(at(t), Value(t.int_value));
      case T::kFloat:
        return std::make_unique<Literal>(at(t), Value(t.float_value));
      case T::kOperator:
        if (t.value == "(") {
          if (is_op(peek(), ")")) {
            next();
            auto empty = std::make_unique<ListExpr>(at(t));
            empty->tuple = true;
            return empty;
          }
          ExprPtr inner = parse_tuple(true);
          expect_op(")");
          return inner;
        }
        if (t.value == "[") {
          auto list = std::make_unique<ListExpr>(at(t));
          while (!is_op(peek(), "]")) {
            if (!list->items.empty()) expect_op(",");
            if (is_op(peek(), "]")) break;
            list->items.push_back(parse_expression());
          }
          next();
          return list;
        }
        if (t.value == "{") {
          auto dict = std::make_unique<DictExpr>(at(t));
          while (!is_op(peek(), "}")) {
            if (!dict->items.empty()) expect_op(",");
            if (is_op(peek(), "}")) break;
            ExprPtr key = parse_expression();
            expect_op(":");
            dict->items.emplace_back(std::move(key), parse_expression());
          }
          next();
          return dict;
        }
        break;
      default:
        break;
    }
    fail(t, "unexpected " + describe(t) + " in an expression");
  }

  ExprPtr parse_postfix(ExprPtr node) {
    while (true) {
      const Token& t = peek();
      if (is_op(t, ".")) {
        next();
        const Token& name = next();
        if (name.type == T::kName) {
          node = std::make_unique<GetAttr>(at(t), std::move(node), name.value);
        } else if (name.type == T::kInt) {
          node = std::make_unique<GetItem>(at(t), std::move(node),
                                           std::make_unique<Literal>(at(name), name.int_value));
        } else {
          fail(name, "expected an attribute name after '.', got " + describe(name));
        }
      } else if (is_op(t, "[")) {
        next();
        node = parse_subscript(t, std::move(node));
      } else if (is_op(t, "(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_subscript(const Token& open, ExprPtr object) {
    ExprPtr start, stop, step;
    bool slice = false;
    if (!is_op(peek(), ":")) start = parse_expression();
    if (is_op(peek(), ":")) {
      slice = true;
      next();
      if (!is_op(peek(), "]") && !is_op(peek(), ":")) stop = parse_expression();
      if (is_op(peek(), ":")) {
        next();
        if (!is_op(peek(), "]")) step = parse_expression();
      }
    }
    if (is_op(peek(), ",")) fail(peek(), "tuple subscripts are not supported");
    expect_op("]");
    if (!slice) return std::make_unique<GetItem>(at(open), std::move(object), std::move(start));
    auto s = std::make_unique<SliceExpr>(at(open));
    s->object = std::move(object);
    s->start = std::move(start);
    s->stop = std::move(stop);
    s->step = std::move(step);
    return s;
  }

  std::vector<Argument> parse_args() {
    expect_op("(");
    std::vector<Argument> args;
    while (!is_op(peek(), ")")) {
      if (!args.empty()) expect_op(",");
      if (is_op(peek(), ")")) break;
      if (is_op(peek(), "*") || is_op(peek(), "**")) {
        fail(peek(), "*args and **kwargs in calls are not supported");
      }
      Argument a;
      if (peek().type == T::kName && is_op(peek(1), "=")) {
        a.name = next().value;
        next();
      } else if (!args.empty() && !args.back().name.empty()) {
        fail(peek(), "a positional argument follows a keyword argument");
      }
      a.value = parse_expression();
      args.push_back(std::move(a));
    }
    next();
    return args;
  }

  ExprPtr parse_call(ExprPtr callee) {
    const Token& open = peek();
    // Methods are checked here so that one outside the subset (a list's append, which the
    // sandbox forbids anyway) fails at load rather than mid-render.
    if (const auto* attr = dynamic_cast<const GetAttr*>(callee.get())) {
      if (!is_known_method(attr->name)) {
        fail(open, "unsupported method '." + attr->name + "()'");
      }
    }
    auto call = std::make_unique<Call>(at(open));
    call->callee = std::move(callee);
    call->args = parse_args();
    return call;
  }

  ExprPtr parse_filter_expr(ExprPtr node) {
    while (true) {
      const Token& t = peek();
      if (is_op(t, "|")) {
        next();
        const Token& name = next();
        if (name.type != T::kName) fail(name, "expected a filter name after '|'");
        auto f = std::make_unique<FilterExpr>(at(name));
        f->name = name.value;
        f->fn = find_filter(name.value);
        if (f->fn == nullptr) fail(name, "unsupported filter '" + name.value + "'");
        f->input = std::move(node);
        if (is_op(peek(), "(")) f->args = parse_args();
        node = std::move(f);
      } else if (is_name(t, "is")) {
        next();
        auto test = std::make_unique<TestExpr>(at(t));
        if (is_name(peek(), "not")) {
          next();
          test->negated = true;
        }
        const Token& name = next();
        if (name.type != T::kName && name.type != T::kOperator) {
          fail(name, "expected a test name after 'is'");
        }
        test->name = name.value;
        test->fn = find_test(name.value);
        if (test->fn == nullptr) fail(name, "unsupported test '" + name.value + "'");
        test->input = std::move(node);
        const Token& a = peek();
        if (is_op(a, "(")) {
          for (Argument& arg : parse_args()) {
            if (!arg.name.empty()) fail(a, "keyword arguments to tests are not supported");
            test->args.push_back(std::move(arg.value));
          }
        } else if ((a.type == T::kName || a.type == T::kString || a.type == T::kInt ||
                    a.type == T::kFloat || is_op(a, "[") || is_op(a, "{")) &&
                   !is_name(a, "else") && !is_name(a, "or") && !is_name(a, "and") &&
                   !is_name(a, "if") && !is_name(a, "in") && !is_name(a, "not")) {
          if (is_name(a, "is")) fail(a, "tests cannot be chained with 'is'");
          test->args.push_back(parse_postfix(parse_primary()));
        }
        node = std::move(test);
      } else if (is_op(t, "(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  const std::vector<Token>& tokens_;
  std::string_view origin_;
  size_t pos_ = 0;
};

}  // namespace

Body parse(const std::vector<Token>& tokens, std::string_view origin) {
  return Parser(tokens, origin).parse_template();
}

}  // namespace loraplex::jinja
