#include "loraplex/model/checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "loraplex/core/error.h"

namespace loraplex::model {

Checkpoint Checkpoint::open(const std::string& dir) {
  namespace fs = std::filesystem;
  LORAPLEX_CHECK(fs::is_directory(dir), dir, ": not a directory (expected a checkpoint directory)");
  Checkpoint c;
  c.dir_ = dir;
  const fs::path single = fs::path(dir) / "model.safetensors";
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  std::vector<std::string> shards;
  if (fs::exists(single)) {
    shards.push_back(single.string());
  } else {
    LORAPLEX_CHECK(fs::exists(index), dir,
                   ": no model.safetensors and no model.safetensors.index.json");
    std::ifstream in(index);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      LORAPLEX_FAIL(index.string(), ": not valid JSON: ", e.what());
    }
    LORAPLEX_CHECK(j.is_object() && j.contains("weight_map") && j.at("weight_map").is_object(),
                   index.string(), ": expected an object with a 'weight_map' object");
    for (const auto& item : j.at("weight_map").items()) {
      LORAPLEX_CHECK(item.value().is_string(), index.string(), ": weight_map entry '", item.key(),
                     "' is ", item.value().dump(), ", expected a file name");
      const std::string file = item.value().get<std::string>();
      LORAPLEX_CHECK(file.find('/') == std::string::npos && file.find("..") == std::string::npos,
                     index.string(), ": shard name '", file, "' must be a plain file name");
      if (std::find(shards.begin(), shards.end(), (fs::path(dir) / file).string()) ==
          shards.end()) {
        shards.push_back((fs::path(dir) / file).string());
      }
    }
    LORAPLEX_CHECK(!shards.empty(), index.string(), ": weight_map lists no shards");
  }
  for (const std::string& path : shards) {
    LORAPLEX_CHECK(fs::exists(path), path, ": shard listed in the index is missing");
    c.files_.push_back(std::make_shared<SafetensorsFile>(SafetensorsFile::open(path)));
    for (const std::string& name : c.files_.back()->names()) {
      LORAPLEX_CHECK(c.where_.emplace(name, c.files_.size() - 1).second, path, ": tensor '", name,
                     "' also appears in ", c.files_[c.where_.at(name)]->path());
    }
  }
  return c;
}

Tensor Checkpoint::tensor(const std::string& name) const {
  const auto it = where_.find(name);
  LORAPLEX_CHECK(it != where_.end(), dir_, ": the checkpoint has no tensor '", name, "'");
  return files_[it->second]->tensor(name);
}

Tensor Checkpoint::tensor(const std::string& name, const Shape& shape, DType dtype) const {
  Tensor t = tensor(name);
  LORAPLEX_CHECK(t.shape() == shape, dir_, ": tensor '", name, "' has shape ", shape_str(t.shape()),
                 ", expected ", shape_str(shape));
  LORAPLEX_CHECK(is_floating(t.dtype()) && !is_fp8(t.dtype()), dir_, ": tensor '", name,
                 "' has dtype ", t.dtype(), ", expected float32, float16 or bfloat16");
  return t.dtype() == dtype ? t.clone() : t.to(dtype);
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  for (const auto& [name, file] : where_) out.push_back(name);
  return out;
}

}  // namespace loraplex::model
