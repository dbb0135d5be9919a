#pragma once
// Building the model the options ask for: one Decoder, or a TensorParallelDecoder of
// options.tensor_parallel_size ranks (GPUs from options.device on; CPU threads on the CPU).

#include <cstdint>
#include <memory>
#include <string>

#include "loraplex/model/config.h"
#include "loraplex/model/executor.h"

namespace loraplex::model {

/// config.json and the weights of `dir` (each rank reads only its shard of the memory-mapped
/// checkpoint). Throws naming the directory, file, tensor, field or value at fault.
std::unique_ptr<ModelExecutor> load_model(const std::string& dir, const DecoderOptions& options);
/// Random weights of `config`'s shapes (Decoder::create_random): the same model for every
/// tensor-parallel size.
std::unique_ptr<ModelExecutor> create_random_model(const ModelConfig& config,
                                                   const DecoderOptions& options, uint64_t seed);

}  // namespace loraplex::model
