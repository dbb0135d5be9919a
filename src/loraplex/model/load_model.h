#pragma once
// Building the model the options ask for: one Decoder, or a TensorParallelDecoder of
// options.tensor_parallel_size ranks (GPUs from options.device on; CPU threads on the CPU).

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "loraplex/model/config.h"
#include "loraplex/model/executor.h"

namespace loraplex::model {

/// config.json and the weights of `dir` (each rank reads only its shard of the memory-mapped
/// checkpoint). Throws naming the directory, file, tensor, field or value at fault.
std::unique_ptr<ModelExecutor> load_model(const std::string& dir, const DecoderOptions& options);

/// How far a load has come: bytes of checkpoint tensors handed to the layers so far, of
/// `total` (the checkpoint's tensor bytes times the ranks, each rank reading every tensor
/// it holds a shard of). Called from the loading threads (one per rank), never two at once;
/// the last call has done == total.
using LoadProgress = std::function<void(int64_t done, int64_t total)>;
/// load_model, reporting progress as it reads the checkpoint (for progress bars on long
/// loads).
std::unique_ptr<ModelExecutor> load_model(const std::string& dir, const DecoderOptions& options,
                                          const LoadProgress& progress);
/// Random weights of `config`'s shapes (Decoder::create_random): the same model for every
/// tensor-parallel size.
std::unique_ptr<ModelExecutor> create_random_model(const ModelConfig& config,
                                                   const DecoderOptions& options, uint64_t seed);

}  // namespace loraplex::model
