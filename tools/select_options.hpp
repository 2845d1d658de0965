#pragma once
// Command line of kvevict-select: parsing, and the policy it names composed from a base and a selector.

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "kvevict/kvevict.hpp"

namespace kvevict::tools {

struct usage_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Named policies and the (base, selector) pair each one stands for, with the preset's own settings.
struct PolicyName {
  const char* name;
  const char* base;
  const char* selector;
  bool flat = false;          ///< head-adaptive without the safeguard (alpha 0): DefensiveKV's flat top-k
  bool aggregation_only = false;  ///< defensive aggregation alone (no value term, no mass forcing)
};
inline const std::vector<PolicyName>& policy_names() {
  static const std::vector<PolicyName> names = {
      {"snapkv", "snapkv", "attention"},
      {"adakv", "adakv", "attention"},
      {"streamingllm", "streamingllm", "none"},
      {"criticalkv", "adakv", "critical"},
      {"criticalkv-snapkv", "snapkv", "critical"},
      {"defensivekv", "adakv", "defensive", true},
      {"layer-defensivekv", "layer", "defensive"},
      {"adakv-defensive", "adakv", "defensive", false, true},
  };
  return names;
}

inline std::string policy_list() {
  std::string out;
  for (const PolicyName& p : policy_names()) out += (out.empty() ? "" : ", ") + std::string(p.name);
  return out;
}

struct Options {
  std::string input, output;
  std::string policy;  // the named policy, or "<base>+<selector>" when composed
  std::string base = "snapkv", selector = "attention";
  std::optional<kvevict::Budget> budget;
  std::string budget_text;
  std::optional<Index> window;
  kvevict::Pooling pooling = kvevict::Pooling::avg;
  Index kernel = 5;
  double alpha = 0.2;
  kvevict::HeadAdaptiveAllocation::Variant adakv_variant = kvevict::HeadAdaptiveAllocation::Variant::kvpress;
  Index sinks = 4;
  std::string precision = "f32";
  bool reference_quirks = false;
  // selectors
  double eps = 1e-4;
  double first_stage_ratio = 0.5;
  kvevict::ValueNorm value_norm = kvevict::ValueNorm::l1;
  double mass_threshold = 0.9;
  bool floor = true;
  bool flat = false;
  bool aggregation_only = false;

  std::map<std::string, std::string> metadata() const {
    return {{"policy", policy}, {"base", base},     {"selector", selector},
            {"budget", budget_text}, {"precision", precision}, {"reference_quirks", reference_quirks ? "1" : "0"}};
  }
};

inline const char* usage_text() {
  return "usage: kvevict-select (--policy NAME | --base B --selector S) (--budget N | --keep R | --compression-ratio CR)\n"
         "                      [options] INPUT.safetensors OUTPUT.safetensors\n"
         "policies:  snapkv, adakv, streamingllm, criticalkv, criticalkv-snapkv, defensivekv, layer-defensivekv,\n"
         "           adakv-defensive\n"
         "bases:     snapkv (uniform), adakv (head-adaptive), layer (layer-global)\n"
         "selectors: attention, critical (CriticalKV), defensive (DefensiveKV)\n"
         "options:\n"
         "  --budget N                tokens kept per KV head on average, window included (1 <= N <= L)\n"
         "  --keep R                  keep ratio in (0, 1]: n_kept = int(L * R)\n"
         "  --compression-ratio CR    fraction removed in [0, 1): n_kept = int(L * (1 - CR))\n"
         "  --window W                observation window (default: the rows of q_window / window_attention)\n"
         "  --pool avg|max            pooling along tokens (default avg)\n"
         "  --kernel K                odd pooling kernel (default 5)\n"
         "  --alpha A                 AdaKV safeguard fraction in [0, 1] (default 0.2)\n"
         "  --adakv-variant kvpress|original   AdaKV allocation (default kvpress)\n"
         "  --sinks N                 StreamingLLM sink tokens (default 4)\n"
         "  --precision f32|f64       arithmetic precision (default f32)\n"
         "  --reference-quirks        reproduce the reference code's quirks (needs --compression-ratio for defensive)\n"
         "  --eps E                   CriticalKV eps (default 1e-4)\n"
         "  --first-stage-ratio R     CriticalKV share of each head's budget chosen by attention (default 0.5)\n"
         "  --value-norm l1|l2        value term norm (default l1; l2 uses the W_o Gram matrix, O(L d^2))\n"
         "  --mass-threshold T        DefensiveKV cumulative mass threshold (default 0.9)\n"
         "  --no-floor                DefensiveKV without the adaptive prior floor (ablation)\n"
         "input per layer i: layers.{i}.q_window [H,w,d] or layers.{i}.window_attention [H,w,L], layers.{i}.keys\n"
         "[Hkv,L,d], layers.{i}.values [Hkv,L,d], layers.{i}.w_o [D,H*d] (value-aware selectors); F64/F32/F16/BF16. output: layers.{i}.kept_indices I64,\n"
         "layers.{i}.kept_offsets I64 [Hkv+1].\n";
}

inline double parse_double(const std::string& flag, const std::string& text) {
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || errno == ERANGE || !std::isfinite(v))
    throw usage_error(flag + " expects a finite number, got '" + text + "'");
  return v;
}

inline Index parse_int(const std::string& flag, const std::string& text) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno == ERANGE) throw usage_error(flag + " expects an integer, got '" + text + "'");
  return static_cast<Index>(v);
}

/// Parses argv; returns nullopt after printing --help. Throws usage_error on any bad argument.
inline std::optional<Options> parse_options(int argc, char** argv) {
  Options o;
  std::vector<std::string> positional;
  std::optional<std::string> policy, base, selector;
  int budgets = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw usage_error(a + " expects a value");
      return argv[++i];
    };
    if (a == "-h" || a == "--help") {
      std::cout << usage_text();
      return std::nullopt;
    } else if (a == "--policy") {
      policy = value();
    } else if (a == "--base") {
      base = value();
    } else if (a == "--selector") {
      selector = value();
    } else if (a == "--budget") {
      o.budget = kvevict::Budget::tokens(parse_int(a, value()));
      o.budget_text = "tokens=" + std::string(argv[i]);
      ++budgets;
    } else if (a == "--keep") {
      const double r = parse_double(a, value());
      if (!(r > 0.0 && r <= 1.0)) throw usage_error("--keep must be in (0, 1], got " + std::string(argv[i]));
      o.budget = kvevict::Budget::keep_ratio(r);
      o.budget_text = "keep=" + std::string(argv[i]);
      ++budgets;
    } else if (a == "--compression-ratio") {
      const double c = parse_double(a, value());
      if (!(c >= 0.0 && c < 1.0)) throw usage_error("--compression-ratio must be in [0, 1), got " + std::string(argv[i]));
      o.budget = kvevict::Budget::compression_ratio(c);
      o.budget_text = "compression_ratio=" + std::string(argv[i]);
      ++budgets;
    } else if (a == "--window") {
      o.window = parse_int(a, value());
      if (*o.window < 1) throw usage_error("--window must be >= 1, got " + std::string(argv[i]));
    } else if (a == "--pool") {
      const std::string p = value();
      if (p != "avg" && p != "max") throw usage_error("--pool must be avg or max, got '" + p + "'");
      o.pooling = p == "avg" ? kvevict::Pooling::avg : kvevict::Pooling::max;
    } else if (a == "--kernel") {
      o.kernel = parse_int(a, value());
      if (o.kernel < 1 || o.kernel % 2 == 0) throw usage_error("--kernel must be an odd number >= 1, got " + std::string(argv[i]));
    } else if (a == "--alpha") {
      o.alpha = parse_double(a, value());
      if (o.alpha < 0.0 || o.alpha > 1.0) throw usage_error("--alpha must be in [0, 1], got " + std::string(argv[i]));
    } else if (a == "--adakv-variant") {
      const std::string v = value();
      if (v != "kvpress" && v != "original") throw usage_error("--adakv-variant must be kvpress or original, got '" + v + "'");
      o.adakv_variant = v == "kvpress" ? kvevict::HeadAdaptiveAllocation::Variant::kvpress
                                       : kvevict::HeadAdaptiveAllocation::Variant::original;
    } else if (a == "--sinks") {
      o.sinks = parse_int(a, value());
      if (o.sinks < 0) throw usage_error("--sinks must be >= 0, got " + std::string(argv[i]));
    } else if (a == "--precision") {
      o.precision = value();
      if (o.precision != "f32" && o.precision != "f64")
        throw usage_error("--precision must be f32 or f64, got '" + o.precision + "'");
    } else if (a == "--reference-quirks") {
      o.reference_quirks = true;
    } else if (a == "--eps") {
      o.eps = parse_double(a, value());
      if (o.eps < 0.0) throw usage_error("--eps must be >= 0, got " + std::string(argv[i]));
    } else if (a == "--first-stage-ratio") {
      o.first_stage_ratio = parse_double(a, value());
      if (o.first_stage_ratio < 0.0 || o.first_stage_ratio > 1.0)
        throw usage_error("--first-stage-ratio must be in [0, 1], got " + std::string(argv[i]));
    } else if (a == "--value-norm") {
      const std::string v = value();
      if (v != "l1" && v != "l2") throw usage_error("--value-norm must be l1 or l2, got '" + v + "'");
      o.value_norm = v == "l1" ? kvevict::ValueNorm::l1 : kvevict::ValueNorm::l2;
    } else if (a == "--mass-threshold") {
      o.mass_threshold = parse_double(a, value());
      if (o.mass_threshold < 0.0 || o.mass_threshold > 1.0)
        throw usage_error("--mass-threshold must be in [0, 1], got " + std::string(argv[i]));
    } else if (a == "--no-floor") {
      o.floor = false;
    } else if (a.size() > 1 && a[0] == '-') {
      throw usage_error("unknown option '" + a + "'");
    } else {
      positional.push_back(a);
    }
  }
  if (positional.size() != 2)
    throw usage_error("expected INPUT and OUTPUT safetensors paths, got " + std::to_string(positional.size()) + " paths");
  o.input = positional[0];
  o.output = positional[1];
  if (budgets != 1)
    throw usage_error(budgets == 0 ? "a budget is required: --budget N, --keep R or --compression-ratio CR"
                                   : "give exactly one of --budget, --keep and --compression-ratio");
  if (policy && (base || selector)) throw usage_error("give either --policy or --base/--selector, not both");
  if (!policy && !base && !selector) throw usage_error("a policy is required: --policy NAME or --base B --selector S");
  if (policy) {
    bool found = false;
    for (const PolicyName& p : policy_names())
      if (*policy == p.name) {
        o.base = p.base;
        o.selector = p.selector;
        o.flat = p.flat;
        o.aggregation_only = p.aggregation_only;
        found = true;
      }
    if (!found) throw usage_error("unknown policy '" + *policy + "' (expected one of " + policy_list() + ")");
    o.policy = *policy;
  } else {
    o.base = base.value_or("snapkv");
    o.selector = selector.value_or("attention");
    if (o.base != "snapkv" && o.base != "adakv" && o.base != "layer")
      throw usage_error("unknown base '" + o.base + "' (expected snapkv, adakv or layer)");
    if (o.selector != "attention" && o.selector != "critical" && o.selector != "defensive")
      throw usage_error("unknown selector '" + o.selector + "' (expected attention, critical or defensive)");
    o.policy = o.base + "+" + o.selector;
  }
  return o;
}

/// Copies the command line's numbers into a policy's flat Params (fields the policy lacks are skipped).
template <class Params>
void fill_params(const Options& o, Index window, Params& p) {
  p.window = window;
  p.pooling = o.pooling;
  p.kernel = o.kernel;
  p.reference_quirks = o.reference_quirks;
  if constexpr (std::is_base_of_v<kvevict::HeadAdaptiveAllocation::Params, Params>) {
    p.alpha = o.flat ? 0.0 : o.alpha;
    p.variant = o.adakv_variant;
  }
  if constexpr (std::is_base_of_v<kvevict::CriticalSelector::Params, Params>) {
    p.eps = o.eps;
    p.first_stage_ratio = o.first_stage_ratio;
    p.value_norm = o.value_norm;
  }
  if constexpr (std::is_base_of_v<kvevict::DefensiveSelector::Params, Params>) {
    p.mass_threshold = o.mass_threshold;
    p.value_norm = o.value_norm;
    p.floor = o.floor;
    p.value_term = !o.aggregation_only;
    p.mass_forcing = !o.aggregation_only;
  }
}

template <class T>
struct type_tag {
  using type = T;
};

/// Runs the selector on the base the options name, over every layer (layer-global bases see them all at once).
template <class S, class Selector>
std::vector<kvevict::Selection> run_selector(const Options& o, const std::vector<kvevict::LayerInputs<S>>& layers,
                                             Index window) {
  std::vector<kvevict::Selection> out;
  if (o.base == "layer") {
    typename kvevict::LayerGlobalPolicy<Selector>::Params p;
    fill_params(o, window, p);
    const kvevict::LayerGlobalPolicy<Selector> policy(p);
    auto plan = policy.template plan<S, S>(*o.budget);
    for (std::size_t i = 0; i < layers.size(); ++i) {
      try {
        plan.add(layers[i]);
      } catch (const kvevict::invalid_argument& e) {
        throw kvevict::invalid_argument("layer " + std::to_string(i) + ": " + e.what());
      }
    }
    return plan.apply();
  }
  auto run = [&](auto policy_tag) {
    using P = typename decltype(policy_tag)::type;
    typename P::Params p;
    fill_params(o, window, p);
    const P policy(p);
    for (std::size_t i = 0; i < layers.size(); ++i) {
      try {
        out.push_back(policy.template select<S>(layers[i], *o.budget));
      } catch (const kvevict::invalid_argument& e) {
        throw kvevict::invalid_argument("layer " + std::to_string(i) + ": " + e.what());
      }
    }
  };
  if (o.base == "adakv")
    run(type_tag<kvevict::Policy<kvevict::HeadAdaptiveAllocation, Selector>>{});
  else
    run(type_tag<kvevict::Policy<kvevict::UniformAllocation, Selector>>{});
  return out;
}

/// The selections of every layer for the policy the options name.
template <class S>
std::vector<kvevict::Selection> run_policy(const Options& o, const std::vector<kvevict::LayerInputs<S>>& layers,
                                           Index window) {
  if (o.base == "streamingllm") {
    kvevict::StreamingLLM::Params p;
    p.sinks = o.sinks;
    const kvevict::StreamingLLM policy(p);
    std::vector<kvevict::Selection> out;
    for (const auto& in : layers) out.push_back(policy.select(in, *o.budget));
    return out;
  }
  if (o.selector == "critical") return run_selector<S, kvevict::CriticalSelector>(o, layers, window);
  if (o.selector == "defensive") return run_selector<S, kvevict::DefensiveSelector>(o, layers, window);
  return run_selector<S, kvevict::AttentionSelector>(o, layers, window);
}

}  // namespace kvevict::tools
