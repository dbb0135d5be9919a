#include "loraplex/server/adapter_policy.h"

#include <system_error>

#include "loraplex/core/error.h"

namespace loraplex::server {

namespace fs = std::filesystem;

std::string adapter_name_problem(std::string_view name) {
  const std::string shown = "adapter name '" + std::string(name.substr(0, 200)) + "'";
  if (name.empty()) return "the adapter name is empty";
  if (name.size() > kMaxAdapterNameLength) {
    return shown + " has " + std::to_string(name.size()) + " characters, at most " +
           std::to_string(kMaxAdapterNameLength);
  }
  if (name == "." || name == "..") return shown + " is not allowed";
  for (const char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-' || c == ':' || c == '/';
    if (!ok) {
      return shown + " has a character outside ASCII letters, digits and . _ - : / (byte " +
             std::to_string(static_cast<unsigned char>(c)) + ")";
    }
  }
  return "";
}

std::vector<fs::path> canonical_roots(const std::vector<std::string>& dirs) {
  std::vector<fs::path> roots;
  for (const std::string& d : dirs) {
    std::error_code ec;
    const fs::path p = fs::canonical(d, ec);
    LORAPLEX_CHECK(!ec && fs::is_directory(p, ec), d, ": not a directory");
    roots.push_back(p);
  }
  return roots;
}

bool inside_roots(const std::string& path, const std::vector<fs::path>& roots) {
  if (path.empty() || path.find('\0') != std::string::npos) return false;
  std::error_code ec;
  const fs::path absolute = fs::absolute(path, ec);
  if (ec) return false;
  fs::path resolved = fs::weakly_canonical(absolute, ec).lexically_normal();
  if (ec) return false;
  if (!resolved.has_filename()) resolved = resolved.parent_path();  // a trailing separator
  for (const fs::path& root : roots) {
    const fs::path rel = resolved.lexically_relative(root);
    if (rel.empty()) continue;  // another root (or drive) altogether
    if (rel == ".") return true;
    if (*rel.begin() != "..") return true;
  }
  return false;
}

}  // namespace loraplex::server
