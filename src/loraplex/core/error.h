#pragma once
// One exception type for the library boundary (Tensor API, Punica wrapper, adapters, model
// loading). Messages name the offending value and the expected one, so a user can act on them.

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace loraplex {

/// The single exception type thrown at the library boundary.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

namespace detail {

template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

[[noreturn]] void throw_error(const char* file, int line, const std::string& message);

}  // namespace detail
}  // namespace loraplex

/// Throws loraplex::Error with the streamed arguments when `cond` is false.
/// Usage: LORAPLEX_CHECK(x.dim() == 2, "x must be 2-D [tokens, hidden], got ", x.dim(), " dims");
#define LORAPLEX_CHECK(cond, ...)                                               \
  do {                                                                          \
    if (!(cond)) {                                                              \
      ::loraplex::detail::throw_error(__FILE__, __LINE__,                       \
                                      ::loraplex::detail::concat(__VA_ARGS__)); \
    }                                                                           \
  } while (0)

/// Throws loraplex::Error unconditionally.
#define LORAPLEX_FAIL(...) \
  ::loraplex::detail::throw_error(__FILE__, __LINE__, ::loraplex::detail::concat(__VA_ARGS__))
