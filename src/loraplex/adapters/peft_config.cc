// GCC 12 reports a false -Wmaybe-uninitialized inside libstdc++'s <regex> compiler when
// building with sanitizers at -O3 (GCC bug 105562); this file is where regexes are compiled.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "loraplex/adapters/peft_config.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "loraplex/core/error.h"

namespace loraplex {
namespace {

using json = nlohmann::ordered_json;

// adapter_config.json is a few kB; anything this large is not a config.
constexpr std::streamoff kMaxConfigBytes = 16 << 20;

// PEFT's "not set" values: absent, null, false, empty string, list or object.
bool is_unset(const json& config, const char* field) {
  if (!config.contains(field)) return true;
  const json& v = config[field];
  if (v.is_null()) return true;
  if (v.is_boolean()) return !v.get<bool>();
  if (v.is_string() || v.is_array() || v.is_object()) return v.empty();
  return false;
}

std::string short_dump(const json& v) {
  std::string s = v.dump();
  if (s.size() > 120) s = s.substr(0, 117) + "...";
  return s;
}

ConfigRegex compile(const std::string& pattern, const std::string& regex_text,
                    const std::string& source, const char* field) {
  try {
    return ConfigRegex{pattern, std::regex(regex_text, std::regex::ECMAScript)};
  } catch (const std::regex_error& e) {
    LORAPLEX_FAIL(source, ": field '", field, "' holds the regular expression '", pattern,
                  "', which is not valid (ECMAScript syntax; Python-only constructs such as "
                  "(?P<name>...) are not supported): ",
                  e.what());
  }
}

std::vector<std::string> string_list(const json& v, const std::string& source, const char* field) {
  LORAPLEX_CHECK(v.is_array(), source, ": field '", field,
                 "' must be a list of strings or a string, got ", short_dump(v));
  std::vector<std::string> out;
  for (const json& e : v) {
    LORAPLEX_CHECK(e.is_string(), source, ": field '", field, "' must hold strings, got ",
                   short_dump(e));
    out.push_back(e.get<std::string>());
  }
  return out;
}

bool ends_with_component(const std::string& name, const std::string& suffix) {
  return name.size() > suffix.size() &&
         name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0 &&
         name[name.size() - suffix.size() - 1] == '.';
}

// "exactly `entry`, or ends with '.' + `entry`": PEFT's list rule for modules and parameters.
bool matches_list(const std::string& name, const std::vector<std::string>& entries) {
  for (const std::string& e : entries)
    if (name == e || ends_with_component(name, e)) return true;
  return false;
}

void refuse_if_set(const json& config, const std::string& source, const char* field,
                   const char* why) {
  if (!is_unset(config, field)) {
    LORAPLEX_FAIL(source, ": field '", field, "' is ", short_dump(config[field]), ": ", why);
  }
}

// The steps of PeftLoraConfig::from_json, in order.

json parse_config_object(const std::string& text, const std::string& source) {
  json config;
  try {
    config = json::parse(text);
  } catch (const json::exception& e) {
    LORAPLEX_FAIL(source, ": not valid JSON: ", e.what());
  }
  LORAPLEX_CHECK(config.is_object(), source, ": must be a JSON object, got ", config.type_name());

  return config;
}

// Fields that change the math and are not served, each refused naming it.
void refuse_unserved_fields(const json& config, const std::string& source) {
  if (config.contains("peft_type") && !config["peft_type"].is_null()) {
    LORAPLEX_CHECK(config["peft_type"] == "LORA", source, ": field 'peft_type' is ",
                   short_dump(config["peft_type"]), ": only LORA adapters are served");
  }

  // Fields that change the math and are not served.
  if (config.contains("bias") && !config["bias"].is_null()) {
    LORAPLEX_CHECK(config["bias"] == "none", source, ": field 'bias' is ",
                   short_dump(config["bias"]),
                   ": trained bias terms are not served (only \"none\" is)");
  }
  refuse_if_set(config, source, "lora_bias", "a bias on LoRA B is not served");
  refuse_if_set(config, source, "modules_to_save",
                "fully trained extra modules (modules_to_save) are not served");
  refuse_if_set(config, source, "use_dora", "DoRA adapters are not served yet");
  refuse_if_set(config, source, "fan_in_fan_out",
                "transposed (Conv1D, GPT-2 style) base weights are not served");
  refuse_if_set(config, source, "trainable_token_indices", "trainable tokens are not served");
  refuse_if_set(config, source, "layer_replication", "layer replication is not served");
  refuse_if_set(config, source, "alora_invocation_tokens",
                "activated LoRA (aLoRA) adapters are not served");
  refuse_if_set(config, source, "use_qalora", "QA-LoRA adapters are not served");
  refuse_if_set(config, source, "use_bdlora", "BD-LoRA adapters are not served");
  refuse_if_set(config, source, "arrow_config", "Arrow routing is not served");
  if (config.contains("init_lora_weights") && config["init_lora_weights"].is_string()) {
    // These initialisations also rewrite the base weights, so the adapter is only correct on a
    // base model that was modified along with it.
    std::string init = config["init_lora_weights"].get<std::string>();
    std::string lower = init;
    std::transform(lower.begin(), lower.end(), lower.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    for (const char* p : {"pissa", "olora", "corda", "loftq"}) {
      LORAPLEX_CHECK(lower.rfind(p, 0) != 0, source, ": field 'init_lora_weights' is \"", init,
                     "\": this initialisation modifies the base weights, which is not served");
    }
  }
}

// r, lora_alpha and use_rslora: the adapter's scale.
void read_rank_and_alpha(const json& config, const std::string& source, PeftLoraConfig& c) {
  LORAPLEX_CHECK(config.contains("r") && config["r"].is_number_integer(), source,
                 ": field 'r' must be a positive integer, got ",
                 config.contains("r") ? short_dump(config["r"]) : "nothing");
  const int64_t r = config["r"].get<int64_t>();
  LORAPLEX_CHECK(r > 0 && r <= (1 << 20), source, ": field 'r' must be a positive integer, got ",
                 r);
  c.r = static_cast<int>(r);
  LORAPLEX_CHECK(config.contains("lora_alpha") && config["lora_alpha"].is_number(), source,
                 ": field 'lora_alpha' must be a number, got ",
                 config.contains("lora_alpha") ? short_dump(config["lora_alpha"]) : "nothing");
  c.lora_alpha = config["lora_alpha"].get<double>();
  LORAPLEX_CHECK(std::isfinite(c.lora_alpha), source, ": field 'lora_alpha' must be finite");
  if (config.contains("use_rslora") && !config["use_rslora"].is_null()) {
    LORAPLEX_CHECK(config["use_rslora"].is_boolean(), source,
                   ": field 'use_rslora' must be true or false, got ",
                   short_dump(config["use_rslora"]));
    c.use_rslora = config["use_rslora"].get<bool>();
  }
}

// target_modules, target_parameters and exclude_modules: which modules the adapter touches.
void read_targets(const json& config, const std::string& source, PeftLoraConfig& c) {
  using TargetMode = PeftLoraConfig::TargetMode;
  if (config.contains("target_modules") && !config["target_modules"].is_null()) {
    const json& t = config["target_modules"];
    if (t.is_string()) {
      std::string s = t.get<std::string>();
      std::string lower = s;
      std::transform(lower.begin(), lower.end(), lower.begin(),
                     [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
      if (lower == "all-linear") {
        c.target_mode = TargetMode::kAllLinear;
      } else {
        c.target_mode = TargetMode::kRegex;
        c.target_regex = compile(s, s, source, "target_modules");
      }
    } else {
      c.target_mode = TargetMode::kList;
      c.target_modules = string_list(t, source, "target_modules");
    }
  }

  if (config.contains("target_parameters") && !config["target_parameters"].is_null()) {
    c.target_parameters = string_list(config["target_parameters"], source, "target_parameters");
  }
  LORAPLEX_CHECK(c.target_mode != TargetMode::kNone || !c.target_parameters.empty(), source,
                 ": neither field 'target_modules' nor 'target_parameters' names a target");

  if (config.contains("exclude_modules") && !config["exclude_modules"].is_null()) {
    const json& e = config["exclude_modules"];
    if (e.is_string()) {
      const std::string s = e.get<std::string>();
      if (!s.empty()) c.exclude_regex = compile(s, s, source, "exclude_modules");
    } else {
      c.exclude_modules = string_list(e, source, "exclude_modules");
    }
  }
}

// layers_to_transform and layers_pattern: which layers.
void read_layer_selection(const json& config, const std::string& source, PeftLoraConfig& c) {
  if (config.contains("layers_to_transform") && !config["layers_to_transform"].is_null()) {
    const json& l = config["layers_to_transform"];
    auto add = [&](const json& v) {
      LORAPLEX_CHECK(v.is_number_integer() && v.get<int64_t>() >= 0 &&
                         v.get<int64_t>() <= std::numeric_limits<int>::max(),
                     source, ": field 'layers_to_transform' must hold layer indices >= 0, got ",
                     short_dump(v));
      c.layers_to_transform.push_back(static_cast<int>(v.get<int64_t>()));
    };
    if (l.is_array()) {
      for (const json& v : l) add(v);
    } else {
      add(l);
    }
  }
  if (config.contains("layers_pattern") && !config["layers_pattern"].is_null()) {
    const json& p = config["layers_pattern"];
    std::vector<std::string> patterns;
    if (p.is_string()) {
      if (!p.get<std::string>().empty()) patterns.push_back(p.get<std::string>());
    } else {
      patterns = string_list(p, source, "layers_pattern");
    }
    for (const std::string& s : patterns) {
      // PEFT substitutes the pattern into this expression as it is.
      c.layers_pattern.push_back(
          compile(s, ".*\\." + s + "\\.(\\d+)\\.", source, "layers_pattern"));
    }
  }
}

// peft_version, rank_pattern and alpha_pattern: per-module ranks and alphas.
void read_patterns(const json& config, const std::string& source, PeftLoraConfig& c) {
  if (config.contains("peft_version") && config["peft_version"].is_string()) {
    int major = 0;
    int minor = 0;
    if (std::sscanf(config["peft_version"].get<std::string>().c_str(), "%d.%d", &major, &minor) ==
        2)
      c.peft_version = {major, minor};
  }

  for (const char* field : {"rank_pattern", "alpha_pattern"}) {
    if (!config.contains(field) || config[field].is_null()) continue;
    const json& m = config[field];
    LORAPLEX_CHECK(m.is_object(), source, ": field '", field, "' must be an object, got ",
                   short_dump(m));
    for (auto it = m.begin(); it != m.end(); ++it) {
      ConfigRegex key = compile(it.key(), "(.*\\.)?(" + it.key() + ")", source, field);
      const json& v = it.value();
      if (std::string(field) == "rank_pattern") {
        LORAPLEX_CHECK(
            v.is_number_integer() && v.get<int64_t>() > 0 && v.get<int64_t>() <= (1 << 20), source,
            ": field 'rank_pattern' key '", it.key(), "' must map to a positive integer rank, got ",
            short_dump(v));
        c.rank_pattern.emplace_back(std::move(key), static_cast<int>(v.get<int64_t>()));
      } else {
        LORAPLEX_CHECK(v.is_number() && std::isfinite(v.get<double>()), source,
                       ": field 'alpha_pattern' key '", it.key(), "' must map to a number, got ",
                       short_dump(v));
        c.alpha_pattern.emplace_back(std::move(key), v.get<double>());
      }
    }
  }
}

}  // namespace

PeftLoraConfig PeftLoraConfig::from_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  LORAPLEX_CHECK(in.good(), "cannot open adapter config '", path, "'");
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  LORAPLEX_CHECK(size >= 0 && size <= kMaxConfigBytes, "adapter config '", path, "' has ", size,
                 " bytes, more than the ", kMaxConfigBytes, " bytes a config can have");
  in.seekg(0);
  std::string text(static_cast<size_t>(size), '\0');
  in.read(text.data(), size);
  LORAPLEX_CHECK(in.good() || in.eof(), "cannot read adapter config '", path, "'");
  return from_json(text, path);
}

PeftLoraConfig PeftLoraConfig::from_json(const std::string& text, const std::string& source) {
  const json config = parse_config_object(text, source);
  refuse_unserved_fields(config, source);
  PeftLoraConfig c;
  read_rank_and_alpha(config, source, c);
  read_targets(config, source, c);
  read_layer_selection(config, source, c);
  read_patterns(config, source, c);
  return c;
}

bool PeftLoraConfig::targets_module(const std::string& module, bool is_linear) const {
  if (exclude_regex && std::regex_match(module, exclude_regex->re)) return false;
  if (matches_list(module, exclude_modules)) return false;

  switch (target_mode) {
    case TargetMode::kNone:
      return false;
    case TargetMode::kRegex:
      return std::regex_match(module, target_regex->re);
    case TargetMode::kList:
      // An exact name is taken as it is; layers_to_transform only filters suffix matches.
      if (std::find(target_modules.begin(), target_modules.end(), module) != target_modules.end())
        return true;
      if (!matches_list(module, target_modules)) return false;
      break;
    case TargetMode::kAllLinear:
      // PEFT expands "all-linear" to module names and, for any real model, condenses them into
      // suffixes, which are then filtered by layers_to_transform like a list.
      if (!is_linear) return false;
      break;
  }
  if (layers_to_transform.empty()) return true;
  const std::optional<int> index = layer_index_of(module, layers_pattern);
  return index && std::find(layers_to_transform.begin(), layers_to_transform.end(), *index) !=
                      layers_to_transform.end();
}

bool PeftLoraConfig::targets_parameter(const std::string& module,
                                       const std::string& parameter) const {
  return matches_list(module + "." + parameter, target_parameters);
}

int PeftLoraConfig::rank_for(const std::string& key) const {
  for (const auto& [pattern, rank] : rank_pattern)
    if (std::regex_match(key, pattern.re)) return rank;
  return r;
}

double PeftLoraConfig::alpha_for(const std::string& key) const {
  for (const auto& [pattern, alpha] : alpha_pattern)
    if (std::regex_match(key, pattern.re)) return alpha;
  return lora_alpha;
}

double PeftLoraConfig::scale_for(const std::string& key) const {
  const double rank = rank_for(key);
  const double alpha = alpha_for(key);
  return use_rslora ? alpha / std::sqrt(rank) : alpha / rank;
}

double PeftLoraConfig::default_scale() const {
  return use_rslora ? lora_alpha / std::sqrt(static_cast<double>(r))
                    : lora_alpha / static_cast<double>(r);
}

int PeftLoraConfig::max_rank() const {
  int m = r;
  for (const auto& [pattern, rank] : rank_pattern) m = std::max(m, rank);
  return m;
}

std::optional<int> layer_index_of(const std::string& module,
                                  const std::vector<ConfigRegex>& layers_pattern) {
  static const std::regex kAnyContainer(R"(.*\.[^.]*\.(\d+)\.)", std::regex::ECMAScript);
  auto parse = [&](const std::regex& re) -> std::optional<int> {
    std::smatch m;
    // re.match: anchored at the start, not at the end.
    if (!std::regex_search(module, m, re, std::regex_constants::match_continuous))
      return std::nullopt;
    if (m.size() < 2 || !m[1].matched) return std::nullopt;
    const std::string digits = m[1].str();
    if (digits.empty() || digits.size() > 9 ||
        !std::all_of(digits.begin(), digits.end(), [](char ch) { return ch >= '0' && ch <= '9'; }))
      return std::nullopt;
    return std::stoi(digits);
  };
  if (layers_pattern.empty()) return parse(kAnyContainer);
  for (const ConfigRegex& p : layers_pattern) {
    std::smatch m;
    if (std::regex_search(module, m, p.re, std::regex_constants::match_continuous))
      return parse(p.re);
  }
  return std::nullopt;
}

}  // namespace loraplex
