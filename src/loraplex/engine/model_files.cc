#include "loraplex/engine/model_files.h"

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "loraplex/core/error.h"

namespace loraplex::engine {

std::vector<int32_t> read_eos_token_ids(const std::string& dir, const model::ModelConfig& config) {
  std::vector<int32_t> ids = config.eos_token_ids;
  const std::filesystem::path gen = std::filesystem::path(dir) / "generation_config.json";
  std::ifstream in(gen);
  if (!in.good()) return ids;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    LORAPLEX_FAIL(gen.string(), ": not valid JSON: ", e.what());
  }
  if (!j.is_object() || !j.contains("eos_token_id")) return ids;
  const nlohmann::json& e = j.at("eos_token_id");
  if (e.is_number_integer()) ids.push_back(e.get<int32_t>());
  if (e.is_array()) {
    for (const auto& v : e)
      if (v.is_number_integer()) ids.push_back(v.get<int32_t>());
  }
  return ids;
}

std::shared_ptr<const Tokenizer> read_tokenizer(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / "tokenizer.json").string();
  LORAPLEX_CHECK(std::filesystem::exists(path), path,
                 ": missing (the model directory needs its tokenizer.json)");
  return std::make_shared<const Tokenizer>(Tokenizer::from_file(path));
}

}  // namespace loraplex::engine
