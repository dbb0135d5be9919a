#pragma once
// Structured output (vLLM's guided decoding: response_format, guided_json / regex / choice /
// grammar) through xgrammar's C++ core, as vLLM's xgrammar backend does: a request's grammar
// is compiled against the tokenizer's vocabulary once, a matcher follows the tokens it
// generates, and before each sample the tokens the grammar allows next become the step's logit
// adjustments (model::LogitAdjustment: the others at -inf), which the decoder applies on the
// device like logit_bias. A request with a grammar plans each step only once its last token is
// known on the host (like the penalties); the grammar's end allows only the model's EOS ids.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "loraplex/engine/engine.h"
#include "loraplex/model/step_batch.h"
#include "loraplex/tokenizer/tokenizer.h"

namespace loraplex::engine {

/// One request's position in its grammar.
class GrammarState {
 public:
  struct Impl;
  explicit GrammarState(std::unique_ptr<Impl> impl);
  ~GrammarState();

  /// Restricts a step's adjustments (each id at most once, sorted by id; `only_listed`: ids
  /// without an entry are -inf) to the tokens the grammar allows next: a listed id the grammar
  /// does not allow gets bias -inf; without `only_listed`, either the allowed ids become the
  /// list (when they are at most half the vocabulary) or the others are added at -inf.
  void constrain(std::vector<model::LogitAdjustment>& adjust, bool& only_listed) const;
  /// Advances over a sampled token; false when the grammar does not allow it.
  bool accept(int32_t token);
  /// The grammar is complete and has accepted one of the EOS ids.
  bool terminated() const;

 private:
  std::unique_ptr<Impl> impl_;
};

/// Compiles grammars against one tokenizer's vocabulary (xgrammar's GrammarCompiler and its
/// cache); thread-safe.
class GrammarCompiler {
 public:
  /// `vocab_size`: the model's (the width of its logits, at least the tokenizer's);
  /// `eos_token_ids`: the ids that end a complete grammar.
  GrammarCompiler(const Tokenizer& tokenizer, int64_t vocab_size,
                  const std::vector<int32_t>& eos_token_ids);
  ~GrammarCompiler();

  /// The start of `output`'s grammar (its kind must not be kNone). Throws RequestError
  /// (kInvalid) naming the field and the library's reason for a schema, regex or grammar it
  /// cannot compile.
  std::unique_ptr<GrammarState> start(const StructuredOutput& output) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// vLLM's grammar for guided_choice: root ::= "choice 1" | "choice 2" | ..., each choice a
/// literal with `\` and `"` escaped.
std::string choice_grammar(const std::vector<std::string>& choices);

}  // namespace loraplex::engine
