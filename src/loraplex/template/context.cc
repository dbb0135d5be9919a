#include "loraplex/template/context.h"

#include "loraplex/template/errors.h"

namespace loraplex::jinja {

Context::Context(const Dict& globals, std::string origin) : origin_(std::move(origin)) {
  scopes_.emplace_back();
  for (const auto& [name, value] : globals) scopes_.front()[name] = value;
}

Value Context::lookup(const std::string& name) const {
  for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it) {
    const auto found = it->find(name);
    if (found != it->end()) return found->second;
  }
  return Value::undefined("'" + name + "' is undefined");
}

void Context::set(const std::string& name, Value value) { scopes_.back()[name] = std::move(value); }

void Context::push_scope() { scopes_.emplace_back(); }

void Context::pop_scope() { scopes_.pop_back(); }

void Context::enter_call() {
  // Deep enough for any real template, shallow enough for the thread's stack.
  constexpr int kMaxCallDepth = 64;
  if (++call_depth_ > kMaxCallDepth) {
    --call_depth_;
    throw TemplateRenderError(origin_ + ": macro calls nested deeper than " +
                              std::to_string(kMaxCallDepth));
  }
}

}  // namespace loraplex::jinja
