#include "loraplex/core/error.h"

#include <cstring>

namespace loraplex::detail {

void throw_error(const char* file, int line, const std::string& message) {
  // Keep only the file name: full build paths make messages noisy and machine-specific.
  const char* base = std::strrchr(file, '/');
  throw Error(concat(message, " [", base ? base + 1 : file, ":", line, "]"));
}

}  // namespace loraplex::detail
