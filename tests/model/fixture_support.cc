#include "fixture_support.h"

#include <algorithm>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "loraplex/core/error.h"

namespace loraplex::test {

std::string fixture_dir(const std::string& name) {
  return std::string(LORAPLEX_TEST_DATA_DIR) + "/" + name;
}

std::vector<ExpectedLine> read_expected(const std::string& fixture, const std::string& file) {
  const std::string path = fixture_dir(fixture) + "/" + file;
  std::ifstream in(path);
  LORAPLEX_CHECK(in.good(), path, ": cannot open");
  std::vector<ExpectedLine> out;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const nlohmann::json j = nlohmann::json::parse(line);
    ExpectedLine e;
    e.prompt = j.at("prompt").get<std::string>();
    if (!j.at("adapter").is_null()) e.adapter = j.at("adapter").get<std::string>();
    e.prompt_token_ids = j.at("prompt_token_ids").get<std::vector<int32_t>>();
    e.output_token_ids = j.at("output_token_ids").get<std::vector<int32_t>>();
    e.output_text = j.at("output_text").get<std::string>();
    e.min_top1_margin = j.at("min_top1_margin").get<double>();
    const auto& top5 = j.at("first_token_top5_logprobs");
    e.first_step_margin = top5.at(0).at(1).get<double>() - top5.at(1).at(1).get<double>();
    e.first_step_logprob = top5.at(0).at(1).get<double>();
    out.push_back(std::move(e));
  }
  return out;
}

engine::GenerateConfig fixture_config(const std::string& fixture,
                                      const std::vector<ExpectedLine>& expected,
                                      const std::vector<size_t>& order) {
  namespace fs = std::filesystem;
  engine::GenerateConfig cfg;
  const std::string dir = fixture_dir(fixture);
  cfg.model_dir = dir + "/model";
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir + "/adapters")) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  for (const std::string& n : names) cfg.loras.emplace_back(n, dir + "/adapters/" + n);
  cfg.requests_path = dir + "/expected.jsonl";
  for (size_t i : order) {
    engine::RequestSpec r;
    r.prompt = expected[i].prompt;
    r.adapter = expected[i].adapter;
    r.line = static_cast<int>(i) + 1;
    cfg.requests.push_back(r);
  }
  cfg.max_tokens = 12;
  cfg.ignore_eos = true;
  return cfg;
}

}  // namespace loraplex::test
