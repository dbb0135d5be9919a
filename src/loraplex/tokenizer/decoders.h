#pragma once
// tokenizer.json "decoder": ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace, Sequence.

#include <memory>
#include <string>
#include <vector>

#include "loraplex/tokenizer/json_node.h"

namespace loraplex::tok {

class Decoder {
 public:
  virtual ~Decoder() = default;
  /// Rewrites the token strings in place (HF's decode_chain); the result is their concatenation.
  virtual void decode_chain(std::vector<std::string>& tokens) const = 0;
};

/// Builds the decoder described by `node`; nullptr for a JSON null.
std::unique_ptr<Decoder> make_decoder(const JsonNode& node);

}  // namespace loraplex::tok
