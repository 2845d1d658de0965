// The parameter table and everything derived from it: parsing and checking a value, --help, the messages.

#include "options.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <type_traits>
#include <utility>

#include "run_policy.hpp"

namespace kvevict::runtime {
namespace {

using Type = ParameterType;
using Parity = Parameter::Parity;
using Apply = void (*)(OptionDraft&, const ParsedValue&);

Parameter integer(std::string_view name, std::string_view metavar, std::string_view fallback, std::string_view help,
                  std::string_view low, Apply apply, Parity parity = Parity::any) {
  Parameter p{name, Type::integer, metavar, fallback, help, low, "", false, false, parity, {}, apply};
  return p;
}
Parameter real(std::string_view name, std::string_view metavar, std::string_view fallback, std::string_view help,
               std::string_view low, bool low_open, std::string_view high, bool high_open, Apply apply) {
  return Parameter{name, Type::real, metavar, fallback, help, low, high, low_open, high_open, Parity::any, {}, apply};
}
Parameter choice(std::string_view name, std::vector<std::string_view> choices, std::string_view fallback,
                 std::string_view help, Apply apply) {
  return Parameter{name,  Type::choice, "",          fallback,           help, "", "",
                   false, false,        Parity::any, std::move(choices), apply};
}
Parameter flag(std::string_view name, std::string_view help, Apply apply) {
  return Parameter{name, Type::flag, "", "", help, "", "", false, false, Parity::any, {}, apply};
}
Parameter layer_list(std::string_view name, std::string_view metavar, std::string_view help, Apply apply) {
  return Parameter{name, Type::layer_list, metavar, "", help, "", "", false, false, Parity::any, {}, apply};
}
Parameter head_list(std::string_view name, std::string_view metavar, std::string_view help, Apply apply) {
  return Parameter{name, Type::head_list, metavar, "", help, "", "", false, false, Parity::any, {}, apply};
}
Parameter word(std::string_view name, std::string_view metavar, std::string_view help, Apply apply) {
  return Parameter{name, Type::name, metavar, "", help, "", "", false, false, Parity::any, {}, apply};
}

void budget(OptionDraft& d, kvevict::Budget b, const std::string& text) {
  d.options.budget = b;
  d.options.budget_text = text;
  ++d.budgets;
}

std::vector<Parameter> make_table() {
  using V = const ParsedValue&;
  using D = OptionDraft&;
  return {
      word("policy", "NAME", "a policy of the catalogue (below)", [](D d, V v) { d.policy = v.text; }),
      word("base", "B", "a base to compose with --selector (below; default snapkv)", [](D d, V v) { d.base = v.text; }),
      word("selector", "S", "a selector to compose with --base (below; default attention)",
           [](D d, V v) { d.selector = v.text; }),
      integer("budget", "N", "", "tokens kept per KV head on average, window included (1 <= N <= L)", "",
              [](D d, V v) { budget(d, kvevict::Budget::tokens(v.integer), "tokens=" + v.text); }),
      real("keep", "R", "", "keep ratio: n_kept = int(L * R)", "0", true, "1", false,
           [](D d, V v) { budget(d, kvevict::Budget::keep_ratio(v.real), "keep=" + v.text); }),
      real("compression-ratio", "CR", "",
           "fraction removed: n_kept = int(L * (1 - CR)); on ragged layers L is the heads' mean length", "0", false,
           "1", true,
           [](D d, V v) { budget(d, kvevict::Budget::compression_ratio(v.real), "compression_ratio=" + v.text); }),
      real("threshold", "T", "",
           "keep every entry whose score reaches T, the window always (its count: --count-lower/-upper/-scope)", "",
           false, "", false, [](D d, V v) { budget(d, kvevict::Budget::threshold(v.real), "threshold=" + v.text); }),
      integer("count-lower", "N", "0", "with --threshold: keep at least N entries in each --count-scope", "0",
              [](D d, V v) { d.options.count_lower = v.integer; }),
      integer("count-upper", "N", "none", "with --threshold: keep at most N entries in each --count-scope", "0",
              [](D d, V v) { d.options.count_upper = v.integer; }),
      choice("count-scope", {"head", "layer", "model"}, "head", "with --threshold: where the count bounds apply",
             [](D d, V v) {
               d.options.count_scope = v.text == "head"    ? kvevict::Budget::Scope::head
                                       : v.text == "layer" ? kvevict::Budget::Scope::layer
                                                           : kvevict::Budget::Scope::model;
             }),
      integer("window", "W", "the rows of q_window / window_attention", "observation window", "1",
              [](D d, V v) { d.options.knobs.window = v.integer; }),
      choice("pool", {"avg", "max"}, "avg", "pooling along tokens",
             [](D d, V v) { d.options.knobs.pooling = v.text == "avg" ? Pooling::avg : Pooling::max; }),
      integer(
          "kernel", "K", "5", "pooling kernel", "1", [](D d, V v) { d.options.knobs.kernel = v.integer; }, Parity::odd),
      real("alpha", "A", "0.2; DefensiveKV 0", "AdaKV safeguard fraction", "0", false, "1", false,
           [](D d, V v) { d.options.knobs.alpha = v.real; }),
      choice("adakv-variant", {"kvpress", "original"}, "kvpress", "AdaKV allocation",
             [](D d, V v) {
               d.options.knobs.adakv_variant = v.text == "kvpress" ? HeadAdaptiveAllocation::Variant::kvpress
                                                                   : HeadAdaptiveAllocation::Variant::original;
             }),
      real("beta", "B", "20", "PyramidKV steepness: the last layer's prefix share is 1/B of the mean", "1", false, "",
           false, [](D d, V v) { d.options.knobs.beta = v.real; }),
      integer("sinks", "N", "4", "StreamingLLM and Expected Attention sink tokens", "0",
              [](D d, V v) { d.options.knobs.sinks = v.integer; }),
      real("rope-theta", "T", "10000", "Expected Attention: the model's RoPE base", "0", true, "", false,
           [](D d, V v) { d.options.knobs.rope_theta = v.real; }),
      integer(
          "rotary-dim", "R", "0: all head_dim", "Expected Attention: rotated dimensions", "0",
          [](D d, V v) { d.options.knobs.rotary_dim = v.integer; }, Parity::even),
      choice("rope-layout", {"half", "interleaved"}, "half, rotate_half", "Expected Attention: RoPE pairing",
             [](D d, V v) {
               d.options.knobs.rope_layout = v.text == "half" ? RopeLayout::half : RopeLayout::interleaved;
             }),
      integer("future-positions", "F", "512", "Expected Attention: next positions RoPE is averaged over", "1",
              [](D d, V v) { d.options.knobs.future_positions = v.integer; }),
      flag("no-covariance", "Expected Attention: the query mean alone (ablation)",
           [](D d, V v) {
             if (v.flag) d.options.knobs.covariance = false;
           }),
      real("redundancy", "R", "0 (rkv: 0.93)",
           "weight of the key-redundancy term: scores become (1 - R) s - R redundancy (R-KV)", "0", false, "1", true,
           [](D d, V v) { d.options.knobs.redundancy = v.real; }),
      real("recent-share", "R", "0.5", "H2O: share of the budget kept for the most recent entries", "0", false, "1",
           false, [](D d, V v) { d.options.knobs.recent_share = v.real; }),
      choice("precision", {"f32", "f64"}, "f32", "arithmetic precision",
             [](D d, V v) { d.options.precision = v.text; }),
      flag("reference-quirks", "reproduce the reference code's quirks (DefensiveKV: needs --compression-ratio)",
           [](D d, V v) {
             if (v.flag) d.options.knobs.reference_quirks = true;
           }),
      choice("share", {"head", "layer", "model"}, "head",
             "KV heads keeping one common set: each head, a layer's heads, every head of every layer",
             [](D d, V v) {
               d.options.knobs.share = v.text == "head"    ? Sharing::per_head
                                       : v.text == "layer" ? Sharing::per_layer
                                                           : Sharing::per_model;
             }),
      choice("reduce", {"max", "mean"}, "max", "how shared heads' and a block's scores become one",
             [](D d, V v) { d.options.knobs.reduce = v.text == "max" ? Reduce::max : Reduce::mean; }),
      integer("block", "B", "1: tokens", "keep or evict whole blocks of B rows, at most n_kept", "1",
              [](D d, V v) { d.options.knobs.block = v.integer; }),
      integer("protect-prefix", "P", "0: none",
              "entries at original positions < P (a shared prompt prefix) are never evicted", "0",
              [](D d, V v) { d.options.protect_prefix = v.integer; }),
      choice("prefix-budget", {"counted", "extra"}, "counted",
             "whether the budget counts the protected prefix or keeps it on top",
             [](D d, V v) { d.options.prefix_extra = v.text == "extra"; }),
      layer_list("keep-whole", "L,L,...",
                 "layers the engine keeps whole (a hybrid model's sliding-window or full layers): every entry kept, "
                 "no part of the model's budget",
                 [](D d, V v) { d.options.keep_whole = v.list; }),
      head_list("retrieval-heads", "L:H,L:H,...",
                "KV heads kept whole where the budget allows (layer L, KV head H; retrieval heads): every entry "
                "forced",
                [](D d, V v) { d.options.retrieval_heads = v.heads; }),
      real("eps", "E", "1e-4", "CriticalKV eps", "0", false, "", false, [](D d, V v) { d.options.knobs.eps = v.real; }),
      real("first-stage-ratio", "R", "0.5", "CriticalKV share of each head's budget chosen by attention", "0", false,
           "1", false, [](D d, V v) { d.options.knobs.first_stage_ratio = v.real; }),
      choice("value-norm", {"l1", "l2"}, "l1; l2 uses the W_o Gram matrix, O(L d^2)", "value term norm",
             [](D d, V v) { d.options.knobs.value_norm = v.text == "l1" ? ValueNorm::l1 : ValueNorm::l2; }),
      real("mass-threshold", "T", "0.9", "DefensiveKV cumulative mass threshold", "0", false, "1", false,
           [](D d, V v) { d.options.knobs.mass_threshold = v.real; }),
      flag("no-floor", "DefensiveKV without the adaptive prior floor (ablation)",
           [](D d, V v) {
             if (v.flag) d.options.knobs.floor = false;
           }),
      flag("no-value-term",
           "DefensiveKV and Expected Attention: attention alone, without the value term (the papers' ablation)",
           [](D d, V v) {
             if (v.flag) d.options.knobs.value_term = false;
           }),
      flag("open-window", "DefensiveKV: score the window's tokens too, keep only the newest first",
           [](D d, V v) { d.options.knobs.open_window = v.flag; }),
  };
}

std::string canonical(std::string_view name) {
  std::string n(name);
  std::replace(n.begin(), n.end(), '_', '-');
  return n;
}

double parse_double(const std::string& flag, const std::string& text) {
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || errno == ERANGE || !std::isfinite(v))
    throw usage_error(flag + " expects a finite number, got '" + text + "'");
  return v;
}

Index parse_int(const std::string& flag, const std::string& text) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno == ERANGE)
    throw usage_error(flag + " expects an integer, got '" + text + "'");
  return static_cast<Index>(v);
}

/// The items of a comma-separated list, in order ("" is one empty item).
std::vector<std::string> comma_items(const std::string& text) {
  std::vector<std::string> items;
  for (std::size_t start = 0;;) {
    const std::size_t comma = text.find(',', start);
    items.push_back(text.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (comma == std::string::npos) return items;
    start = comma + 1;
  }
}

/// The whole of `item` read as an integer >= 0 by strtoll, or -1 when it is not one.
Index index_or_negative(const std::string& item) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(item.c_str(), &end, 10);
  return item.empty() || *end != '\0' || errno == ERANGE || v < 0 ? -1 : static_cast<Index>(v);
}

/// `list` ascending; a usage_error "FLAG names a WHAT twice" when an entry repeats.
template <class T>
std::vector<T> sorted_distinct(std::vector<T> list, const std::string& flag, const char* what,
                               const std::string& text) {
  std::sort(list.begin(), list.end());
  if (std::adjacent_find(list.begin(), list.end()) != list.end())
    throw usage_error(flag + " names a " + what + " twice, got '" + text + "'");
  return list;
}

/// "3" or "1,3,5": distinct layer indices >= 0, returned ascending.
std::vector<Index> parse_layer_list(const std::string& flag, const std::string& text) {
  std::vector<Index> out;
  for (const std::string& item : comma_items(text)) {
    const Index v = index_or_negative(item);
    if (v < 0) throw usage_error(flag + " expects layer indices >= 0 separated by commas, got '" + text + "'");
    out.push_back(v);
  }
  return sorted_distinct(std::move(out), flag, "layer", text);
}

/// "6:0" or "1:0,6:1": distinct (layer, KV head) pairs, both >= 0 and written as digits, returned ascending.
std::vector<std::pair<Index, Index>> parse_head_list(const std::string& flag, const std::string& text) {
  const auto bad = [&] {
    return usage_error(flag + " expects layer:head pairs of indices >= 0 separated by commas (6:0,7:1), got '" + text +
                       "'");
  };
  const auto index = [&](const std::string& part) {
    const Index v = index_or_negative(part);
    if (v < 0 || !std::isdigit(static_cast<unsigned char>(part[0]))) throw bad();
    return v;
  };
  std::vector<std::pair<Index, Index>> out;
  for (const std::string& item : comma_items(text)) {
    const std::size_t colon = item.find(':');
    if (colon == std::string::npos) throw bad();
    out.emplace_back(index(item.substr(0, colon)), index(item.substr(colon + 1)));
  }
  return sorted_distinct(std::move(out), flag, "head", text);
}

bool parse_bool(const std::string& flag, const std::string& v) {
  if (v == "1" || v == "true" || v == "True") return true;
  if (v == "0" || v == "false" || v == "False") return false;
  throw usage_error(flag + " expects a boolean (1, true, 0 or false), got '" + v + "'");
}

/// Whether the number x is in p's range and has its parity.
bool in_range(const Parameter& p, double x) {
  const auto bound = [](std::string_view text) { return std::strtod(std::string(text).c_str(), nullptr); };
  if (!p.low.empty() && (p.low_open ? !(x > bound(p.low)) : !(x >= bound(p.low)))) return false;
  if (!p.high.empty() && (p.high_open ? !(x < bound(p.high)) : !(x <= bound(p.high)))) return false;
  const long long i = static_cast<long long>(x);
  if (p.parity == Parity::odd && i % 2 == 0) return false;
  if (p.parity == Parity::even && i % 2 != 0) return false;
  return true;
}

std::string listed(const std::vector<std::string_view>& words) {
  std::string out;
  for (std::size_t i = 0; i < words.size(); ++i)
    out += (i == 0 ? "" : i + 1 == words.size() ? " or " : ", ") + std::string(words[i]);
  return out;
}

}  // namespace

std::string Parameter::spelled(Spelling spelling) const {
  std::string n(name);
  if (spelling == Spelling::command_line) return "--" + n;
  std::replace(n.begin(), n.end(), '-', '_');
  return n;
}

std::string Parameter::expected() const {
  if (type == Type::choice) return listed(choices);
  if (parity == Parity::odd) return "an odd number >= " + std::string(low);
  if (parity == Parity::even) return "even and >= " + std::string(low);
  if (!low.empty() && !high.empty())
    return "in " + std::string(low_open ? "(" : "[") + std::string(low) + ", " + std::string(high) +
           (high_open ? ")" : "]");
  if (!low.empty()) return (low_open ? "> " : ">= ") + std::string(low);
  return "";
}

std::string Parameter::description() const {
  std::string text(help);
  const std::string range = expected();
  if (type == Type::choice)
    text += " (" + range;
  else if (!range.empty())
    text += " (" + std::string(metavar) + " " + range;
  if (!fallback.empty()) text += std::string(range.empty() ? " (" : "; ") + "default " + std::string(fallback);
  if (!range.empty() || !fallback.empty()) text += ")";
  return text;
}

const std::vector<Parameter>& parameters() {
  static const std::vector<Parameter> table = make_table();
  return table;
}

const Parameter* find_parameter(std::string_view name) {
  const std::string n = canonical(name);
  for (const Parameter& p : parameters())
    if (p.name == n) return &p;
  return nullptr;
}

kvevict::Budget Options::full_budget(const kvevict::Budget& given) const {
  kvevict::Budget b = given;
  if (const char* bound = count_bound_given()) {
    if (!b.is_threshold())  // the message of OptionSet::finish, as the C API and Python spell the option
      throw invalid_argument(find_parameter(bound)->spelled(Spelling::api) +
                             " bounds a threshold budget, got a count budget");
    b = b.count_bounds(count_lower.value_or(0), count_upper.value_or(-1),
                       count_scope.value_or(kvevict::Budget::Scope::head));
  }
  return b.protect_prefix(protect_prefix,
                          prefix_extra ? kvevict::Budget::PrefixBudget::extra : kvevict::Budget::PrefixBudget::counted);
}

std::map<std::string, std::string> Options::metadata() const {
  std::map<std::string, std::string> out = {{"policy", policy},
                                            {"base", base},
                                            {"selector", selector},
                                            {"budget", budget_text},
                                            {"precision", precision},
                                            {"reference_quirks", knobs.reference_quirks.value_or(false) ? "1" : "0"},
                                            {"share", layout.share == Sharing::per_head    ? "head"
                                                      : layout.share == Sharing::per_layer ? "layer"
                                                                                           : "model"},
                                            {"reduce", layout.reduce == Reduce::max ? "max" : "mean"},
                                            {"block", std::to_string(block())}};
  if (count_lower || count_upper || count_scope) {
    out["count_lower"] = std::to_string(count_lower.value_or(0));
    out["count_upper"] = count_upper ? std::to_string(*count_upper) : "none";
    const auto scope = count_scope.value_or(kvevict::Budget::Scope::head);
    out["count_scope"] = scope == kvevict::Budget::Scope::head    ? "head"
                         : scope == kvevict::Budget::Scope::layer ? "layer"
                                                                  : "model";
  }
  if (!keep_whole.empty()) {
    std::string layers;
    for (Index l : keep_whole) layers += (layers.empty() ? "" : ",") + std::to_string(l);
    out["keep_whole"] = layers;
  }
  if (!retrieval_heads.empty()) {
    std::string heads;
    for (const auto& [l, h] : retrieval_heads)
      heads += (heads.empty() ? "" : ",") + std::to_string(l) + ":" + std::to_string(h);
    out["retrieval_heads"] = heads;
  }
  if (protect_prefix > 0) {
    out["protect_prefix"] = std::to_string(protect_prefix);
    out["prefix_budget"] = prefix_extra ? "extra" : "counted";
  }
  return out;
}

std::string usage_text() {
  const auto column = [](std::string head, const std::string& text) {
    head.resize(std::max<std::size_t>(head.size() + 1, 28), ' ');
    return head + text + "\n";
  };
  std::string policies, bases, options;
  catalogue::for_each(catalogue::entries(),
                      [&](const auto& e) { policies += column("  " + std::string(e.name), std::string(e.summary)); });
  catalogue::for_each(catalogue::bases(),
                      [&](const auto& e) { bases += column("  " + std::string(e.name), std::string(e.summary)); });
  for (const Parameter& p : parameters()) {
    if (p.type == Type::name) continue;  // in the usage line
    std::string head = "  " + p.spelled(Spelling::command_line);
    if (p.type == Type::choice) {
      head += " ";
      for (std::size_t i = 0; i < p.choices.size(); ++i) head += (i ? "|" : "") + std::string(p.choices[i]);
    } else if (!p.metavar.empty()) {
      head += " " + std::string(p.metavar);
    }
    options += column(head, p.description());
  }
  return "usage: kvevict-select (--policy NAME | --base B --selector S) (--budget N | --keep R | --compression-ratio "
         "CR)\n"
         "                      [options] INPUT.safetensors OUTPUT.safetensors\n"
         "policies:\n" +
         policies +
         "bases (--base B --selector S: Policy<B, S>, the base's allocation with the selector's scoring):\n" + bases +
         "selectors: " + catalogue::names(catalogue::selectors()) +
         "\n"
         "options (each applies to the policies whose parameters have it; the defaults are each policy's own;\n"
         "the C API and Python take the same names with '_' for '-', flags as booleans):\n" +
         options +
         "input per layer i: layers.{i}.q_window [H,w,d] or layers.{i}.window_attention [H,w,L] (not for the\n"
         "key-only knorm, keydiff, streamingllm and the engine-score policies), layers.{i}.keys [Hkv,L,d],\n"
         "layers.{i}.values [Hkv,L,d], layers.{i}.w_o [D,H*d] (value-aware selectors), layers.{i}.scores [Hkv,L]\n"
         "(the engine's score of each entry: engine-scores, layer-engine-scores, the engine selector);\n"
         "F64/F32/F16/BF16 (keys and values in one dtype, the same in every layer).\n"
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

void OptionSet::set(const std::string& name, const std::string& value) {
  const Parameter* p = find_parameter(name);
  if (!p) {
    std::string known;
    if (spelling_ == Spelling::api)
      for (const Parameter& q : parameters()) known += (known.empty() ? "" : ", ") + q.spelled(spelling_);
    throw usage_error("unknown option '" + name + "'" + (known.empty() ? "" : " (expected one of " + known + ")"));
  }
  const std::string flag = p->spelled(spelling_);
  ParsedValue v;
  v.text = value;
  switch (p->type) {
    case Type::integer:
      v.integer = parse_int(flag, value);
      v.real = static_cast<double>(v.integer);
      break;
    case Type::real:
      v.real = parse_double(flag, value);
      break;
    case Type::flag:
      v.flag = parse_bool(flag, value);
      break;
    case Type::choice:
      if (std::find(p->choices.begin(), p->choices.end(), value) == p->choices.end())
        throw usage_error(flag + " must be " + p->expected() + ", got '" + value + "'");
      break;
    case Type::name:
      break;
    case Type::layer_list:
      v.list = parse_layer_list(flag, value);
      break;
    case Type::head_list:
      v.heads = parse_head_list(flag, value);
      break;
  }
  if ((p->type == Type::integer || p->type == Type::real) && !in_range(*p, v.real))
    throw usage_error(flag + " must be " + p->expected() + ", got " + value);
  p->apply(draft_, v);
}

namespace {
/// The base and selector a named policy stands for (the output's metadata): its allocation and its scoring, as
/// catalogue::base_of finds them (the base whose allocation and defaults P has: pyramidkv, defensivekv, ...).
template <class Entry>
void name_parts(const Entry&, Options& o) {
  using P = typename Entry::policy_type;
  if constexpr (std::is_same_v<P, kvevict::StreamingLLM>) {
    o.base = "streamingllm";
    o.selector = "none";
  } else {
    o.base = std::string(catalogue::base_of<P>());
    catalogue::for_each(catalogue::selectors(), [&](const auto& s) {
      if (std::is_same_v<typename std::decay_t<decltype(s)>::selector_type, typename P::SelectorType>)
        o.selector = s.name;
    });
  }
}
}  // namespace

Options OptionSet::finish(bool needs_budget) const {
  Options o = draft_.options;
  const auto spell = [&](std::string_view n) { return find_parameter(n)->spelled(spelling_); };
  if (needs_budget && draft_.budgets != 1)
    throw usage_error(draft_.budgets == 0
                          ? "a budget is required: " + spell("budget") + " N, " + spell("keep") + " R, " +
                                spell("compression-ratio") + " CR or " + spell("threshold") + " T"
                          : "give exactly one of " + spell("budget") + ", " + spell("keep") + ", " +
                                spell("compression-ratio") + " and " + spell("threshold"));
  if (const char* bound = o.count_bound_given(); bound && o.budget && !o.budget->is_threshold())
    throw usage_error(spell(bound) + " bounds a threshold budget, got a count budget");
  const std::string p = spell("policy"), bs = spell("base") + "/" + spell("selector");
  if (draft_.policy && (draft_.base || draft_.selector))
    throw usage_error("give either " + p + " or " + bs + ", not both");
  if (!draft_.policy && !draft_.base && !draft_.selector)
    throw usage_error("a policy is required: " + p + " NAME or " + spell("base") + " B " + spell("selector") + " S");
  if (draft_.policy) {
    o.policy = *draft_.policy;
    if (!catalogue::visit(o.policy, [&](const auto& e) { name_parts(e, o); }))
      throw usage_error("unknown policy '" + o.policy + "' (expected one of " + catalogue::names(catalogue::entries()) +
                        ")");
  } else {
    o.composed = true;
    o.base = draft_.base.value_or("snapkv");
    o.selector = draft_.selector.value_or("attention");
    if (!catalogue::contains(catalogue::bases(), o.base))
      throw usage_error("unknown base '" + o.base + "' (expected one of " + catalogue::names(catalogue::bases()) + ")");
    if (!catalogue::contains(catalogue::selectors(), o.selector))
      throw usage_error("unknown selector '" + o.selector + "' (expected one of " +
                        catalogue::names(catalogue::selectors()) + ")");
    o.policy = o.base + "+" + o.selector;
  }
  visit_policy(o, [&](const auto& entry) {
    const auto made = entry.make(o.knobs);
    o.reads_observation = made.reads_observation();
    o.reads_values = made.reads_values();
    o.reads_queries = made.reads_queries();
    o.reads_scores = made.reads_scores();
    o.layout = static_cast<const LayoutParams&>(made.params());
  });
  return o;
}

std::optional<Options> parse_command_line(int argc, char** argv) {
  OptionSet set;
  std::vector<std::string> positional;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const Parameter* p = a.size() > 2 && a.compare(0, 2, "--") == 0 && a.find('_') == std::string::npos
                             ? find_parameter(a.substr(2))
                             : nullptr;
    if (a == "-h" || a == "--help") {
      std::cout << usage_text();
      return std::nullopt;
    } else if (p) {
      if (p->type == Type::flag) {
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

}  // namespace kvevict::runtime
