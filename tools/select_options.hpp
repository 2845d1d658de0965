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

struct Options {
  std::string input, output;
  std::string policy;  // the catalogue name, or "<base>+<selector>" when composed
  bool composed = false;
  std::string base, selector;
  std::optional<kvevict::Budget> budget;
  std::string budget_text;
  kvevict::Knobs knobs;  // the options given; knobs.window defaults to the rows of q_window / window_attention
  std::string precision = "f32";
  bool reads_observation = true;  // what the policy reads (LayerInputs::queries or attention; values and w_o)
  bool reads_values = false;
  bool reads_queries = false;    // the observation must be LayerInputs::queries (attention rows will not do)
  kvevict::LayoutParams layout;  // the policy's layout: the options given over the preset's (TOVA: per_layer, mean)

  /// B of --block (1 unless given): > 1 selects whole blocks, and the output lists their ids (kept_blocks).
  Index block() const { return layout.block; }

  std::map<std::string, std::string> metadata() const {
    const kvevict::Sharing share = layout.share;
    return {{"policy", policy},
            {"base", base},
            {"selector", selector},
            {"budget", budget_text},
            {"precision", precision},
            {"reference_quirks", knobs.reference_quirks.value_or(false) ? "1" : "0"},
            {"share", share == kvevict::Sharing::per_head    ? "head"
                      : share == kvevict::Sharing::per_layer ? "layer"
                                                             : "model"},
            {"reduce", layout.reduce == kvevict::Reduce::max ? "max" : "mean"},
            {"block", std::to_string(block())}};
  }
};

/// Calls f(entry) with the catalogue entry (kvevict/policy/catalogue.hpp) the options name.
template <class F>
void visit_policy(const Options& o, F&& f) {
  const bool found =
      o.composed ? kvevict::catalogue::compose(o.base, o.selector, f) : kvevict::catalogue::visit(o.policy, f);
  KVEVICT_ASSERT(found);  // parse_options checked the names
  (void)found;
}

inline std::string usage_text() {
  std::string policies, bases;
  kvevict::catalogue::for_each(kvevict::catalogue::entries(), [&](const auto& e) {
    policies += "  " + std::string(e.name) + std::string(20 - std::min<std::size_t>(19, e.name.size()), ' ') +
                std::string(e.summary) + "\n";
  });
  kvevict::catalogue::for_each(kvevict::catalogue::bases(), [&](const auto& e) {
    bases += "  " + std::string(e.name) + std::string(20 - std::min<std::size_t>(19, e.name.size()), ' ') +
             std::string(e.summary) + "\n";
  });
  return "usage: kvevict-select (--policy NAME | --base B --selector S) (--budget N | --keep R | --compression-ratio "
         "CR)\n"
         "                      [options] INPUT.safetensors OUTPUT.safetensors\n"
         "policies:\n" +
         policies +
         "bases (--base B --selector S: Policy<B, S>, the base's allocation with the selector's scoring):\n" + bases +
         "selectors: " + kvevict::catalogue::names(kvevict::catalogue::selectors()) +
         "\n"
         "options (each applies to the policies whose parameters have it; the defaults are each policy's own):\n"
         "  --budget N                tokens kept per KV head on average, window included (1 <= N <= L)\n"
         "  --keep R                  keep ratio in (0, 1]: n_kept = int(L * R)\n"
         "  --compression-ratio CR    fraction removed in [0, 1): n_kept = int(L * (1 - CR))\n"
         "                            (on ragged layers L is the mean of the heads' lengths)\n"
         "  --window W                observation window (default: the rows of q_window / window_attention)\n"
         "  --pool avg|max            pooling along tokens (default avg)\n"
         "  --kernel K                odd pooling kernel (default 5)\n"
         "  --alpha A                 AdaKV safeguard fraction in [0, 1] (default 0.2; DefensiveKV 0)\n"
         "  --adakv-variant kvpress|original   AdaKV allocation (default kvpress)\n"
         "  --beta B                  PyramidKV steepness >= 1: the last layer's prefix share is 1/B of the mean\n"
         "                            (default 20)\n"
         "  --sinks N                 StreamingLLM and Expected Attention sink tokens (default 4)\n"
         "  --rope-theta T            Expected Attention: the model's RoPE base (default 10000)\n"
         "  --rotary-dim R            Expected Attention: rotated dimensions, even (default 0: all head_dim)\n"
         "  --rope-layout half|interleaved   Expected Attention: RoPE pairing (default half, rotate_half)\n"
         "  --future-positions F      Expected Attention: next positions RoPE is averaged over (default 512)\n"
         "  --no-covariance           Expected Attention: the query mean alone (ablation)\n"
         "  --recent-share R          H2O: share of the budget kept for the most recent entries, [0, 1]\n"
         "                            (default 0.5)\n"
         "  --precision f32|f64       arithmetic precision (default f32)\n"
         "  --reference-quirks        reproduce the reference code's quirks (needs --compression-ratio for defensive)\n"
         "  --share head|layer|model  KV heads keeping one common set: each head, a layer's heads, every head of\n"
         "                            every layer (default head; shared heads must hold the same entries)\n"
         "  --reduce max|mean         how shared heads' and a block's scores become one (default max)\n"
         "  --block B                 keep or evict whole blocks of B rows, B >= 1 (default 1: tokens; B <= n_kept)\n"
         "  --eps E                   CriticalKV eps (default 1e-4)\n"
         "  --first-stage-ratio R     CriticalKV share of each head's budget chosen by attention (default 0.5)\n"
         "  --value-norm l1|l2        value term norm (default l1; l2 uses the W_o Gram matrix, O(L d^2))\n"
         "  --mass-threshold T        DefensiveKV cumulative mass threshold (default 0.9)\n"
         "  --no-floor                DefensiveKV without the adaptive prior floor (ablation)\n"
         "  --open-window             DefensiveKV: score the window's tokens too, keep only the newest first\n"
         "input per layer i: layers.{i}.q_window [H,w,d] or layers.{i}.window_attention [H,w,L] (not for the\n"
         "key-only knorm, keydiff and streamingllm), layers.{i}.keys [Hkv,L,d], layers.{i}.values [Hkv,L,d],\n"
         "layers.{i}.w_o [D,H*d] (value-aware selectors); F64/F32/F16/BF16.\n"
         "quantized caches: keys and values in I8/F8_E4M3/F8_E5M2, optional F32 layers.{i}.keys_scale and\n"
         "layers.{i}.values_scale of shape [] (one factor), [L] (per token) or [Hkv,L] (per KV head and token).\n"
         "ragged layers (optional, I64/I32): layers.{i}.lengths [Hkv] (head h holds rows 0..lengths[h]-1 of keys and\n"
         "values, the rest is padding; default L), layers.{i}.positions [Hkv,L] (original positions, strictly\n"
         "increasing per head; default 0..L-1).\n"
         "output: layers.{i}.kept_indices I64 (kept rows, heads concatenated), layers.{i}.kept_offsets I64 [Hkv+1],\n"
         "layers.{i}.kept_positions I64 (their original positions, parallel to kept_indices); with --block B > 1\n"
         "also layers.{i}.kept_blocks I64 (kept block ids, block b = rows bB..bB+B-1, heads concatenated) and\n"
         "layers.{i}.kept_block_offsets I64 [Hkv+1].\n";
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
  if (text.empty() || *end != '\0' || errno == ERANGE)
    throw usage_error(flag + " expects an integer, got '" + text + "'");
  return static_cast<Index>(v);
}

/// The base and selector a named policy stands for (the output's metadata): its allocation and its scoring, as
/// catalogue::base_of finds them (the base whose allocation and defaults P has: pyramidkv, defensivekv, ...).
template <class Entry>
void name_parts(const Entry&, Options& o) {
  using P = typename Entry::policy_type;
  if constexpr (std::is_same_v<P, kvevict::StreamingLLM>) {
    o.base = "streamingllm";
    o.selector = "none";
  } else {
    o.base = std::string(kvevict::catalogue::base_of<P>());
    kvevict::catalogue::for_each(kvevict::catalogue::selectors(), [&](const auto& s) {
      if (std::is_same_v<typename std::decay_t<decltype(s)>::selector_type, typename P::SelectorType>)
        o.selector = s.name;
    });
  }
}

/// Options by name, as kvevict-select's command line, the C API (include/kvevict/c/kvevict.h) and the Python module
/// give them: `set(name, value)` checks each value, `finish()` the whole (one budget, a known policy). Names take '-'
/// or '_' alike; messages spell them as the front end does ("--keep" on the command line, "keep" in the APIs).
class OptionSet {
 public:
  enum class Spelling { command_line, api };
  explicit OptionSet(Spelling spelling = Spelling::command_line) : spelling_(spelling) {}

  /// Whether the option takes no value on the command line (the APIs give it a boolean: "1"/"true", "0"/"false").
  static bool is_flag(const std::string& name) {
    const std::string n = canonical(name);
    return n == "reference-quirks" || n == "no-floor" || n == "no-covariance" || n == "open-window";
  }

  /// Whether `name` is an option (in either spelling).
  static bool known(const std::string& name) {
    const std::string n = canonical(name);
    for (const std::string& k : names())
      if (k == n) return true;
    return false;
  }

  /// Sets one option ("keep", "compression-ratio", "window", ..., "policy", "base", "selector"). Throws usage_error.
  void set(const std::string& raw_name, const std::string& v) {
    const std::string a = canonical(raw_name), flag = spell(a);
    Options& o = o_;
    if (a == "policy") {
      policy_ = v;
    } else if (a == "base") {
      base_ = v;
    } else if (a == "selector") {
      selector_ = v;
    } else if (a == "budget") {
      o.budget = kvevict::Budget::tokens(parse_int(flag, v));
      o.budget_text = "tokens=" + v;
      ++budgets_;
    } else if (a == "keep") {
      const double r = parse_double(flag, v);
      if (!(r > 0.0 && r <= 1.0)) throw usage_error(flag + " must be in (0, 1], got " + v);
      o.budget = kvevict::Budget::keep_ratio(r);
      o.budget_text = "keep=" + v;
      ++budgets_;
    } else if (a == "compression-ratio") {
      const double c = parse_double(flag, v);
      if (!(c >= 0.0 && c < 1.0)) throw usage_error(flag + " must be in [0, 1), got " + v);
      o.budget = kvevict::Budget::compression_ratio(c);
      o.budget_text = "compression_ratio=" + v;
      ++budgets_;
    } else if (a == "window") {
      o.knobs.window = parse_int(flag, v);
      if (*o.knobs.window < 1) throw usage_error(flag + " must be >= 1, got " + v);
    } else if (a == "pool") {
      if (v != "avg" && v != "max") throw usage_error(flag + " must be avg or max, got '" + v + "'");
      o.knobs.pooling = v == "avg" ? kvevict::Pooling::avg : kvevict::Pooling::max;
    } else if (a == "kernel") {
      const Index kernel = parse_int(flag, v);
      o.knobs.kernel = kernel;
      if (kernel < 1 || kernel % 2 == 0) throw usage_error(flag + " must be an odd number >= 1, got " + v);
    } else if (a == "alpha") {
      const double alpha = parse_double(flag, v);
      o.knobs.alpha = alpha;
      if (alpha < 0.0 || alpha > 1.0) throw usage_error(flag + " must be in [0, 1], got " + v);
    } else if (a == "adakv-variant") {
      if (v != "kvpress" && v != "original") throw usage_error(flag + " must be kvpress or original, got '" + v + "'");
      o.knobs.adakv_variant = v == "kvpress" ? kvevict::HeadAdaptiveAllocation::Variant::kvpress
                                             : kvevict::HeadAdaptiveAllocation::Variant::original;
    } else if (a == "beta") {
      const double beta = parse_double(flag, v);
      o.knobs.beta = beta;
      if (!(beta >= 1.0)) throw usage_error(flag + " must be >= 1, got " + v);
    } else if (a == "sinks") {
      const Index sinks = parse_int(flag, v);
      o.knobs.sinks = sinks;
      if (sinks < 0) throw usage_error(flag + " must be >= 0, got " + v);
    } else if (a == "rope-theta") {
      const double theta = parse_double(flag, v);
      o.knobs.rope_theta = theta;
      if (!(theta > 0.0)) throw usage_error(flag + " must be > 0, got " + v);
    } else if (a == "rotary-dim") {
      const Index rotary_dim = parse_int(flag, v);
      o.knobs.rotary_dim = rotary_dim;
      if (rotary_dim < 0 || rotary_dim % 2 != 0) throw usage_error(flag + " must be even and >= 0, got " + v);
    } else if (a == "rope-layout") {
      if (v != "half" && v != "interleaved") throw usage_error(flag + " must be half or interleaved, got '" + v + "'");
      o.knobs.rope_layout = v == "half" ? kvevict::RopeLayout::half : kvevict::RopeLayout::interleaved;
    } else if (a == "future-positions") {
      const Index future = parse_int(flag, v);
      o.knobs.future_positions = future;
      if (future < 1) throw usage_error(flag + " must be >= 1, got " + v);
    } else if (a == "no-covariance") {
      if (parse_bool(flag, v)) o.knobs.covariance = false;
    } else if (a == "recent-share") {
      const double share = parse_double(flag, v);
      o.knobs.recent_share = share;
      if (!(share >= 0.0 && share <= 1.0)) throw usage_error(flag + " must be in [0, 1], got " + v);
    } else if (a == "precision") {
      if (v != "f32" && v != "f64") throw usage_error(flag + " must be f32 or f64, got '" + v + "'");
      o.precision = v;
    } else if (a == "reference-quirks") {
      if (parse_bool(flag, v)) o.knobs.reference_quirks = true;
    } else if (a == "eps") {
      const double eps = parse_double(flag, v);
      o.knobs.eps = eps;
      if (eps < 0.0) throw usage_error(flag + " must be >= 0, got " + v);
    } else if (a == "first-stage-ratio") {
      const double ratio = parse_double(flag, v);
      o.knobs.first_stage_ratio = ratio;
      if (ratio < 0.0 || ratio > 1.0) throw usage_error(flag + " must be in [0, 1], got " + v);
    } else if (a == "value-norm") {
      if (v != "l1" && v != "l2") throw usage_error(flag + " must be l1 or l2, got '" + v + "'");
      o.knobs.value_norm = v == "l1" ? kvevict::ValueNorm::l1 : kvevict::ValueNorm::l2;
    } else if (a == "mass-threshold") {
      const double threshold = parse_double(flag, v);
      o.knobs.mass_threshold = threshold;
      if (threshold < 0.0 || threshold > 1.0) throw usage_error(flag + " must be in [0, 1], got " + v);
    } else if (a == "share") {
      if (v != "head" && v != "layer" && v != "model")
        throw usage_error(flag + " must be head, layer or model, got '" + v + "'");
      o.knobs.share = v == "head"    ? kvevict::Sharing::per_head
                      : v == "layer" ? kvevict::Sharing::per_layer
                                     : kvevict::Sharing::per_model;
    } else if (a == "reduce") {
      if (v != "max" && v != "mean") throw usage_error(flag + " must be max or mean, got '" + v + "'");
      o.knobs.reduce = v == "max" ? kvevict::Reduce::max : kvevict::Reduce::mean;
    } else if (a == "block") {
      const Index block = parse_int(flag, v);
      o.knobs.block = block;
      if (block < 1) throw usage_error(flag + " must be >= 1, got " + v);
    } else if (a == "no-floor") {
      if (parse_bool(flag, v)) o.knobs.floor = false;
    } else if (a == "open-window") {
      o.knobs.open_window = parse_bool(flag, v);
    } else {
      throw usage_error("unknown option '" + raw_name + "'" +
                        (spelling_ == Spelling::command_line ? "" : " (expected one of " + option_names() + ")"));
    }
  }

  /// The options, checked as a whole: exactly one budget (unless given apart: the C API), a policy or a
  /// base/selector that the catalogue knows.
  Options finish(bool needs_budget = true) {
    Options o = o_;
    const std::string b = spell("budget"), k = spell("keep"), c = spell("compression-ratio");
    if (needs_budget && budgets_ != 1)
      throw usage_error(budgets_ == 0 ? "a budget is required: " + b + " N, " + k + " R or " + c + " CR"
                                      : "give exactly one of " + b + ", " + k + " and " + c);
    const std::string p = spell("policy"), bs = spell("base") + "/" + spell("selector");
    if (policy_ && (base_ || selector_)) throw usage_error("give either " + p + " or " + bs + ", not both");
    if (!policy_ && !base_ && !selector_)
      throw usage_error("a policy is required: " + p + " NAME or " + spell("base") + " B " + spell("selector") + " S");
    if (policy_) {
      o.policy = *policy_;
      if (!kvevict::catalogue::visit(o.policy, [&](const auto& e) { name_parts(e, o); }))
        throw usage_error("unknown policy '" + *policy_ + "' (expected one of " +
                          kvevict::catalogue::names(kvevict::catalogue::entries()) + ")");
    } else {
      o.composed = true;
      o.base = base_.value_or("snapkv");
      o.selector = selector_.value_or("attention");
      if (!kvevict::catalogue::contains(kvevict::catalogue::bases(), o.base))
        throw usage_error("unknown base '" + o.base + "' (expected one of " +
                          kvevict::catalogue::names(kvevict::catalogue::bases()) + ")");
      if (!kvevict::catalogue::contains(kvevict::catalogue::selectors(), o.selector))
        throw usage_error("unknown selector '" + o.selector + "' (expected one of " +
                          kvevict::catalogue::names(kvevict::catalogue::selectors()) + ")");
      o.policy = o.base + "+" + o.selector;
    }
    visit_policy(o, [&](const auto& entry) {
      const auto made = entry.make(o.knobs);
      o.reads_observation = made.reads_observation();
      o.reads_values = made.reads_values();
      o.reads_queries = made.reads_queries();
      o.layout = static_cast<const kvevict::LayoutParams&>(made.params());
    });
    return o;
  }

 private:
  static std::string canonical(std::string name) {
    for (char& ch : name)
      if (ch == '_') ch = '-';
    return name;
  }
  std::string spell(const std::string& canonical_name) const {
    if (spelling_ == Spelling::command_line) return "--" + canonical_name;
    std::string n = canonical_name;
    for (char& ch : n)
      if (ch == '-') ch = '_';
    return n;
  }
  static const std::vector<std::string>& names() {
    static const std::vector<std::string> all = {"policy",
                                                 "base",
                                                 "selector",
                                                 "budget",
                                                 "keep",
                                                 "compression-ratio",
                                                 "window",
                                                 "pool",
                                                 "kernel",
                                                 "alpha",
                                                 "adakv-variant",
                                                 "beta",
                                                 "sinks",
                                                 "rope-theta",
                                                 "rotary-dim",
                                                 "rope-layout",
                                                 "future-positions",
                                                 "no-covariance",
                                                 "recent-share",
                                                 "precision",
                                                 "reference-quirks",
                                                 "share",
                                                 "reduce",
                                                 "block",
                                                 "eps",
                                                 "first-stage-ratio",
                                                 "value-norm",
                                                 "mass-threshold",
                                                 "no-floor",
                                                 "open-window"};
    return all;
  }
  std::string option_names() const {
    std::string out;
    for (const std::string& n : names()) out += (out.empty() ? "" : ", ") + spell(n);
    return out;
  }
  static bool parse_bool(const std::string& flag, const std::string& v) {
    if (v == "1" || v == "true" || v == "True") return true;
    if (v == "0" || v == "false" || v == "False") return false;
    throw usage_error(flag + " expects a boolean (1, true, 0 or false), got '" + v + "'");
  }

  Spelling spelling_;
  Options o_;
  std::optional<std::string> policy_, base_, selector_;
  int budgets_ = 0;
};

/// Parses argv; returns nullopt after printing --help. Throws usage_error on any bad argument.
inline std::optional<Options> parse_options(int argc, char** argv) {
  OptionSet set;
  std::vector<std::string> positional;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::cout << usage_text();
      return std::nullopt;
    } else if (a.size() > 2 && a.compare(0, 2, "--") == 0 && a.find('_') == std::string::npos &&
               OptionSet::known(a.substr(2))) {
      if (OptionSet::is_flag(a.substr(2))) {
        set.set(a.substr(2), "1");
      } else {
        if (i + 1 >= argc) throw usage_error(a + " expects a value");
        set.set(a.substr(2), argv[++i]);
      }
    } else if (a.size() > 1 && a[0] == '-') {
      throw usage_error("unknown option '" + a + "'");
    } else {
      positional.push_back(a);
    }
  }
  if (positional.size() != 2)
    throw usage_error("expected INPUT and OUTPUT safetensors paths, got " + std::to_string(positional.size()) +
                      " paths");
  Options o = set.finish();
  o.input = positional[0];
  o.output = positional[1];
  return o;
}

/// The runs of the policy the options name over every layer (layer-global policies see them all at once), with
/// the window the data gives unless --window was given (a policy that reads no observation: its own default).
template <class S, class KV, class Q, class W>
std::vector<kvevict::Selection> run_policy(const Options& o, const std::vector<kvevict::LayerInputs<KV, Q, W>>& layers,
                                           std::optional<Index> window) {
  kvevict::Knobs knobs = o.knobs;
  if (window) knobs.window = window;  // none: the policy reads no observation and no --window was given
  std::vector<kvevict::Selection> out;
  visit_policy(o, [&](const auto& entry) { out = kvevict::select_layers<S>(entry.make(knobs), layers, *o.budget); });
  return out;
}

#ifdef KVEVICT_POLICY_RUNS_EXTERN  // float and double caches: compiled once, in tools/policy_runs.cpp
extern template std::vector<kvevict::Selection> run_policy<float>(const Options&,
                                                                  const std::vector<kvevict::LayerInputs<float>>&,
                                                                  std::optional<Index>);
extern template std::vector<kvevict::Selection> run_policy<double>(const Options&,
                                                                   const std::vector<kvevict::LayerInputs<double>>&,
                                                                   std::optional<Index>);
#endif

}  // namespace kvevict::tools
