#pragma once
// Kernels and their launchers report failure through Status and never throw: they may run on
// worker threads or inside CUDA graph capture, where an exception has nowhere sensible to go.
// The library boundary turns a bad Status into loraplex::Error with throw_if_error().

#include <string>
#include <utility>

#include "loraplex/core/error.h"

namespace loraplex {

enum class StatusCode { kOk, kInvalidArgument, kUnsupported, kCudaError, kInternal };

/// Result of a kernel or launcher: ok, or a code and a message naming the bad value.
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok_status() { return Status(); }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

template <typename... Args>
Status invalid_argument(Args&&... args) {
  return Status(StatusCode::kInvalidArgument, detail::concat(std::forward<Args>(args)...));
}

template <typename... Args>
Status unsupported(Args&&... args) {
  return Status(StatusCode::kUnsupported, detail::concat(std::forward<Args>(args)...));
}

/// Throws loraplex::Error carrying the status message when `status` is not ok.
inline void throw_if_error(const Status& status) {
  if (!status.ok()) throw Error(status.message());
}

}  // namespace loraplex

/// Returns `status_expr` from the enclosing function when it is not ok.
#define LORAPLEX_RETURN_IF_ERROR(status_expr)      \
  do {                                             \
    ::loraplex::Status _lp_status = (status_expr); \
    if (!_lp_status.ok()) return _lp_status;       \
  } while (0)

/// Inside a kernel launcher: returns invalid_argument(...) when `cond` is false.
#define LORAPLEX_ENSURE(cond, ...)                                 \
  do {                                                             \
    if (!(cond)) return ::loraplex::invalid_argument(__VA_ARGS__); \
  } while (0)
