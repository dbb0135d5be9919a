#include "loraplex/server/api_error.h"

#include <nlohmann/json.hpp>

namespace loraplex::server {

std::string error_type_for(int status) {
  switch (status) {
    case 400:
      return "BadRequestError";
    case 401:
      return "AuthenticationError";
    case 404:
      return "NotFoundError";
    case 405:
      return "MethodNotAllowedError";
    case 409:
      return "ConflictError";
    case 413:
      return "RequestTooLargeError";
    case 415:
      return "UnsupportedMediaTypeError";
    case 503:
      return "ServiceUnavailableError";
    default:
      return status >= 500 ? "InternalServerError" : "BadRequestError";
  }
}

std::string error_body(const ApiError& error) {
  nlohmann::ordered_json e;
  e["message"] = error.message;
  e["type"] = error.type.empty() ? error_type_for(error.status) : error.type;
  e["param"] = error.param.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json(error.param);
  e["code"] = error.status;
  return nlohmann::ordered_json{{"error", e}}.dump(-1, ' ', false,
                                                   nlohmann::json::error_handler_t::replace);
}

void throw_api(int status, const std::string& message, const std::string& param) {
  throw ApiException(ApiError{status, message, "", param});
}

}  // namespace loraplex::server
