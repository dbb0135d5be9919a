#pragma once
// tokenizer.json "pre_tokenizer": ByteLevel, Split, Digits, Metaspace and Sequence of them.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "loraplex/tokenizer/json_node.h"

namespace loraplex::tok {

/// One split of the input on its way to the model: either an added token (already an id) or
/// text the model will tokenize.
struct Piece {
  std::string text;
  int32_t added_id = -1;  // >= 0 when the piece is an added token
  /// Whether the piece starts at offset 0 of the original input (Metaspace's "first" scheme).
  bool at_origin = false;
};

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  /// Splits and rewrites the pieces that are not added tokens; drops pieces that become empty.
  virtual void pre_tokenize(std::vector<Piece>& pieces) const = 0;
};

/// Builds the pre-tokenizer described by `node`; nullptr for a JSON null.
std::unique_ptr<PreTokenizer> make_pre_tokenizer(const JsonNode& node);

}  // namespace loraplex::tok
