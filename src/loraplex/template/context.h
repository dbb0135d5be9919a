#pragma once
// The variables a render sees: a stack of scopes (the template's globals at the bottom, one
// scope per for loop or macro call above), looked up innermost first, as jinja2 scopes them:
// `set` inside a loop stays in the loop, `set` inside an if does not open a scope.

#include <string>
#include <unordered_map>
#include <vector>

#include "loraplex/template/value.h"

namespace loraplex::jinja {

class Context {
 public:
  /// `origin` names the template in error messages.
  Context(const Dict& globals, std::string origin);

  /// The innermost binding of `name`, or Undefined naming it.
  Value lookup(const std::string& name) const;
  /// Binds `name` in the innermost scope.
  void set(const std::string& name, Value value);
  void push_scope();
  void pop_scope();

  /// Runs `body` with only the bottom (global) scope and a fresh one above it visible, as a
  /// macro call sees the world; restores the stack afterwards (also on exceptions).
  template <typename F>
  void with_isolated_scope(F&& body) {
    std::vector<std::unordered_map<std::string, Value>> saved;
    saved.swap(scopes_);
    scopes_.push_back(saved.front());
    scopes_.emplace_back();
    struct Restore {
      Context* self;
      std::vector<std::unordered_map<std::string, Value>>* saved;
      ~Restore() { self->scopes_.swap(*saved); }
    } restore{this, &saved};
    body();
  }

  const std::string& origin() const { return origin_; }
  /// Guards against unbounded macro recursion; throws TemplateRenderError past the limit.
  void enter_call();
  void leave_call() { --call_depth_; }

 private:
  std::vector<std::unordered_map<std::string, Value>> scopes_;
  std::string origin_;
  int call_depth_ = 0;
};

}  // namespace loraplex::jinja
