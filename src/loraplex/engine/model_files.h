#pragma once
// What an engine needs from a model directory besides the weights: the tokenizer and the ids
// that end a sequence.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "loraplex/model/config.h"
#include "loraplex/tokenizer/tokenizer.h"

namespace loraplex::engine {

/// EOS ids from config.json, plus generation_config.json's when present (Llama 3 lists several).
std::vector<int32_t> read_eos_token_ids(const std::string& model_dir,
                                        const model::ModelConfig& config);
/// The directory's tokenizer.json; throws naming the file when it is missing or broken.
std::shared_ptr<const Tokenizer> read_tokenizer(const std::string& model_dir);

}  // namespace loraplex::engine
