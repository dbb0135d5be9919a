#include "loraplex/model/load_model.h"

#include <filesystem>

#include "loraplex/core/error.h"
#include "loraplex/model/decoder.h"
#include "loraplex/model/tensor_parallel.h"

namespace loraplex::model {

std::unique_ptr<ModelExecutor> load_model(const std::string& dir, const DecoderOptions& options) {
  if (options.tensor_parallel_size == 1) {
    return Decoder::load(dir, options);
  }
  namespace fs = std::filesystem;
  LORAPLEX_CHECK(fs::is_directory(dir), dir, ": model directory does not exist");
  const ModelConfig config = ModelConfig::from_file((fs::path(dir) / "config.json").string());
  return TensorParallelDecoder::create(
      config, options, [dir](const DecoderOptions& rank) { return Decoder::load(dir, rank); });
}

std::unique_ptr<ModelExecutor> create_random_model(const ModelConfig& config,
                                                   const DecoderOptions& options, uint64_t seed) {
  if (options.tensor_parallel_size == 1) {
    return Decoder::create_random(config, options, seed);
  }
  return TensorParallelDecoder::create(config, options, [config, seed](const DecoderOptions& rank) {
    return Decoder::create_random(config, rank, seed);
  });
}

}  // namespace loraplex::model
