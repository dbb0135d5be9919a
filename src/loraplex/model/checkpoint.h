#pragma once
// The weights of a Hugging Face checkpoint directory: model.safetensors, or the shards listed
// by model.safetensors.index.json. Tensors are zero-copy views of the memory-mapped files.

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "loraplex/adapters/safetensors.h"
#include "loraplex/core/tensor.h"

namespace loraplex::model {

class Checkpoint {
 public:
  /// Opens the weights of `dir`; throws naming the directory or file when neither layout is
  /// there or a shard is missing or broken.
  static Checkpoint open(const std::string& dir);

  bool has(const std::string& name) const { return where_.count(name) != 0; }
  /// The tensor `name` as stored (CPU view); throws naming the checkpoint and the tensor.
  Tensor tensor(const std::string& name) const;
  /// `tensor(name)` checked to have `shape`, converted to `dtype`.
  Tensor tensor(const std::string& name, const Shape& shape, DType dtype) const;
  std::vector<std::string> names() const;
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::map<std::string, size_t> where_;  // tensor name -> index into files_
};

}  // namespace loraplex::model
