#pragma once
// tokenizer.json "post_processor": TemplateProcessing (single template), ByteLevel (no effect on
// ids) and Sequence of them.

#include <cstdint>
#include <memory>
#include <vector>

#include "loraplex/tokenizer/json_node.h"

namespace loraplex::tok {

class PostProcessor {
 public:
  virtual ~PostProcessor() = default;
  /// Rewrites the ids of one encoded sequence; special tokens only when `add_special_tokens`.
  virtual void process(std::vector<int32_t>& ids, bool add_special_tokens) const = 0;
};

/// Builds the post-processor described by `node`; nullptr for a JSON null.
std::unique_ptr<PostProcessor> make_post_processor(const JsonNode& node);

}  // namespace loraplex::tok
