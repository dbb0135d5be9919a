#pragma once
// Errors as the OpenAI API (and vLLM) returns them: an HTTP status and the JSON body
// {"error": {"message", "type", "param", "code"}}, with vLLM's type names (BadRequestError,
// NotFoundError, ...) and the status as the code.

#include <stdexcept>
#include <string>

namespace loraplex::server {

struct ApiError {
  int status = 400;
  std::string message;
  std::string type;   // empty: derived from the status
  std::string param;  // the request field at fault; empty: null
};

/// Thrown by request parsing and handlers; the HTTP layer turns it into a response.
class ApiException : public std::runtime_error {
 public:
  explicit ApiException(ApiError error)
      : std::runtime_error(error.message), error_(std::move(error)) {}
  const ApiError& error() const { return error_; }

 private:
  ApiError error_;
};

/// vLLM's error type for a status: 400 BadRequestError, 401 AuthenticationError, 404
/// NotFoundError, 409 ConflictError, 413 RequestTooLargeError, 415 UnsupportedMediaTypeError, 503
/// ServiceUnavailableError, 500 InternalServerError.
std::string error_type_for(int status);

/// The response body for `error`.
std::string error_body(const ApiError& error);

[[noreturn]] void throw_api(int status, const std::string& message, const std::string& param = {});

}  // namespace loraplex::server
