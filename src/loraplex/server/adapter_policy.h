#pragma once
// Which adapter names and directories the server accepts from clients. Names appear in
// /v1/models, in requests' "model" and comma-joined in vllm:lora_requests_info's labels, so
// they are limited to a character set that is safe in all three. Runtime loads
// (/v1/load_lora_adapter) may only read directories under the roots the operator allowed
// (--lora-dir, --allowed-lora-paths), and a refusal says the same whether or not the path
// exists, so the endpoint cannot be used to probe the file system.

#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace loraplex::server {

inline constexpr size_t kMaxAdapterNameLength = 128;

/// Empty when `name` is a valid adapter name (1 to kMaxAdapterNameLength characters, each an
/// ASCII letter, digit, '.', '_', '-', ':' or '/', and not "." or ".."); else what is wrong with
/// it, naming it.
std::string adapter_name_problem(std::string_view name);

/// Each directory made absolute and canonical (symlinks resolved). Throws loraplex::Error naming
/// one that is not an existing directory.
std::vector<std::filesystem::path> canonical_roots(const std::vector<std::string>& dirs);

/// Whether `path`, resolved through symlinks as far as it exists, is one of `roots` or lies
/// under one. False for anything that cannot be resolved.
bool inside_roots(const std::string& path, const std::vector<std::filesystem::path>& roots);

}  // namespace loraplex::server
