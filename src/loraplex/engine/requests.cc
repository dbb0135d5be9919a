#include "loraplex/engine/requests.h"

#include <fstream>
#include <limits>
#include <sstream>

#include <nlohmann/json.hpp>

#include "loraplex/core/error.h"

namespace loraplex::engine {

std::vector<RequestSpec> parse_requests(const std::string& text, const std::string& source) {
  std::vector<RequestSpec> out;
  std::istringstream in(text);
  std::string line;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      LORAPLEX_FAIL(source, ":", number, ": not valid JSON: ", e.what());
    }
    LORAPLEX_CHECK(j.is_object(), source, ":", number, ": expected a JSON object, got ",
                   j.type_name());
    RequestSpec r;
    r.line = number;
    LORAPLEX_CHECK(j.contains("prompt") && j.at("prompt").is_string(), source, ":", number,
                   ": 'prompt' must be a string, got ",
                   j.contains("prompt") ? j.at("prompt").dump() : std::string("nothing"));
    r.prompt = j.at("prompt").get<std::string>();
    if (j.contains("adapter") && !j.at("adapter").is_null()) {
      LORAPLEX_CHECK(j.at("adapter").is_string(), source, ":", number,
                     ": 'adapter' must be an adapter name or null, got ", j.at("adapter").dump());
      r.adapter = j.at("adapter").get<std::string>();
    }
    if (j.contains("max_tokens") && !j.at("max_tokens").is_null()) {
      const nlohmann::json& m = j.at("max_tokens");
      // Bounded before any arithmetic: positions are 32-bit.
      LORAPLEX_CHECK(m.is_number_integer() && m.get<int64_t>() >= 1 &&
                         m.get<int64_t>() <= std::numeric_limits<int32_t>::max(),
                     source, ":", number, ": 'max_tokens' must be an integer in 1 .. ",
                     std::numeric_limits<int32_t>::max(), ", got ", m.dump());
      r.max_tokens = m.get<int64_t>();
    }
    for (const auto& item : j.items()) {
      LORAPLEX_CHECK(
          item.key() == "prompt" || item.key() == "adapter" || item.key() == "max_tokens", source,
          ":", number, ": unknown field '", item.key(), "' (expected prompt, adapter, max_tokens)");
    }
    out.push_back(std::move(r));
  }
  return out;
}

std::vector<RequestSpec> read_requests(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  LORAPLEX_CHECK(in.good(), path, ": cannot open the request file");
  std::ostringstream buf;
  buf << in.rdbuf();
  return parse_requests(buf.str(), path);
}

}  // namespace loraplex::engine
