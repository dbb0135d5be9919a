#pragma once
// tokenizer.json "normalizer": Prepend, Replace, NFC, NFKC and Sequence of them.

#include <memory>
#include <string>

#include "loraplex/tokenizer/json_node.h"

namespace loraplex::tok {

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  /// Rewrites `text` (valid UTF-8) in place.
  virtual void normalize(std::string& text) const = 0;
};

/// Builds the normalizer described by `node`; nullptr for a JSON null.
std::unique_ptr<Normalizer> make_normalizer(const JsonNode& node);

}  // namespace loraplex::tok
