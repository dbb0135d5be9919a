#pragma once
// Reading the PEFT reference fixtures of testdata/ (expected.jsonl, adapters/) for the
// end-to-end generation tests on the CPU and on CUDA.

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "loraplex/engine/generate_run.h"

namespace loraplex::test {

/// One line of a fixture's expected.jsonl: what PEFT generated for one request, alone.
struct ExpectedLine {
  std::string prompt;
  std::optional<std::string> adapter;
  std::vector<int32_t> prompt_token_ids;
  std::vector<int32_t> output_token_ids;
  std::string output_text;
  double min_top1_margin = 0.0;
  double first_step_margin = 0.0;   // top1 - top2 log-probability of the first step
  double first_step_logprob = 0.0;  // the first token's log-probability
};

/// testdata/<name>.
std::string fixture_dir(const std::string& name);
/// The lines of testdata/<fixture>/<file>.
std::vector<ExpectedLine> read_expected(const std::string& fixture,
                                        const std::string& file = "expected.jsonl");

/// A GenerateConfig for `fixture` with every adapter under adapters/ (sorted by name), the
/// requests of expected.jsonl in `order` (indices into it), 12 tokens, EOS ignored, greedy.
engine::GenerateConfig fixture_config(const std::string& fixture,
                                      const std::vector<ExpectedLine>& expected,
                                      const std::vector<size_t>& order);

}  // namespace loraplex::test
