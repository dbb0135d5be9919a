#pragma once
// PEFT's adapter_config.json for LoRA, and PEFT's rules for which modules an adapter targets
// and with which rank and alpha (peft/tuners/tuners_utils.py check_target_module_exists,
// peft/utils/other.py get_pattern_key, LoraModel._create_and_replace). Fields that would change
// the math and are not served are refused with an error naming the field, so that an adapter is
// either served exactly as PEFT runs it or not at all.
//
// PEFT's regular expressions are Python `re`; here they are std::regex ECMAScript, which agrees
// on the syntax adapters use (names, '.', '|', groups, classes, repeats). A Python-only construct
// such as (?P<name>...) is refused with an error naming the field.

#include <optional>
#include <regex>
#include <string>
#include <utility>
#include <vector>

namespace loraplex {

/// A regular expression taken from a config, kept with its source text for messages.
struct ConfigRegex {
  std::string text;
  std::regex re;
};

/// The parts of a PEFT LoRA config that decide the served math.
struct PeftLoraConfig {
  /// Default rank and alpha (config fields r, lora_alpha).
  int r = 0;
  double lora_alpha = 0.0;
  /// scale = alpha / sqrt(r) instead of alpha / r.
  bool use_rslora = false;

  /// target_modules: a list (exact name or "." + entry suffix) or one regular expression that
  /// must match the whole module name. "all-linear" selects every linear layer but lm_head.
  enum class TargetMode { kNone, kList, kRegex, kAllLinear };
  TargetMode target_mode = TargetMode::kNone;
  std::vector<std::string> target_modules;  // kList
  std::optional<ConfigRegex> target_regex;  // kRegex

  /// exclude_modules: a list (exact or suffix) or a full-match regular expression.
  std::vector<std::string> exclude_modules;
  std::optional<ConfigRegex> exclude_regex;

  /// layers_to_transform (empty = every layer) and layers_pattern (empty = any container);
  /// both apply to list target_modules only, as in PEFT.
  std::vector<int> layers_to_transform;
  std::vector<ConfigRegex> layers_pattern;  // compiled as ".*\.<pattern>\.(\d+)\."

  /// rank_pattern / alpha_pattern in file order (PEFT takes the first key that matches), each
  /// key compiled as "(.*\.)?(<key>)" for a whole-name match.
  std::vector<std::pair<ConfigRegex, int>> rank_pattern;
  std::vector<std::pair<ConfigRegex, double>> alpha_pattern;

  /// target_parameters: "<module>.<parameter>" names or suffixes of them, for 3-D MoE experts.
  std::vector<std::string> target_parameters;

  /// Reads `path` (an adapter_config.json); throws loraplex::Error naming the file and the
  /// field on anything malformed or not served.
  static PeftLoraConfig from_file(const std::string& path);
  /// Parses JSON text; `source` names it in error messages.
  static PeftLoraConfig from_json(const std::string& text, const std::string& source);

  /// PEFT's check_target_module_exists for a module (its name without "base_model.model.").
  /// `is_linear` says whether the module is a linear layer other than the output head, which is
  /// what "all-linear" selects.
  bool targets_module(const std::string& module, bool is_linear) const;
  /// PEFT's target_parameters test: "<module>.<parameter>" equals an entry or ends with "." +
  /// an entry.
  bool targets_parameter(const std::string& module, const std::string& parameter) const;

  /// Rank, alpha and scale for one target key (module name, or "<module>.<parameter>"), after
  /// rank_pattern / alpha_pattern.
  int rank_for(const std::string& key) const;
  double alpha_for(const std::string& key) const;
  double scale_for(const std::string& key) const;
  /// The scale of the config-level r and lora_alpha.
  double default_scale() const;
  /// The largest rank any module can have: max(r, rank_pattern values).
  int max_rank() const;
};

/// PEFT's layer index of a module name: the number after "<pattern>." for the first pattern
/// that occurs (any container name when `layers_pattern` is empty), the last occurrence when
/// there are several. nullopt when the name has none.
std::optional<int> layer_index_of(const std::string& module,
                                  const std::vector<ConfigRegex>& layers_pattern);

}  // namespace loraplex
