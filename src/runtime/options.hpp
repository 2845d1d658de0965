#pragma once
// The bindings' runtime, options: one table of parameters (name, type, default, range, one line of help) from which
// kvevict-select's flags and --help, the C API's option names (include/kvevict/c/kvevict.h) and the Python module's
// keyword arguments are all derived, with one validation and one set of messages. Compiled once (options.cpp).
//
//   runtime::OptionSet set(runtime::Spelling::api);   // "first_stage_ratio"; Spelling::command_line:
//   "--first-stage-ratio" set.set("policy", "criticalkv"); set.set("kernel", "7");                           // throws
//   usage_error("kernel must be an odd number >= 1, ...") runtime::Options options =
//   set.finish(/*needs_budget=*/false);

#include <algorithm>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvevict/kvevict.hpp"

namespace kvevict::runtime {

/// A bad option (name, value or combination), as opposed to bad tensors (kvevict::invalid_argument).
struct usage_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// What one run asks for: the policy (by catalogue name or composed), the budget, the knobs given, the precision,
/// and what the policy reads (filled by OptionSet::finish).
struct Options {
  std::string input, output;  // kvevict-select's paths
  std::string policy;         // the catalogue name, or "<base>+<selector>" when composed
  bool composed = false;
  std::string base, selector;  // the policy's composition (a named policy's real allocation and scoring)
  std::optional<kvevict::Budget> budget;
  std::string budget_text;
  kvevict::Knobs knobs;  // the options given; knobs.window defaults to the rows of q_window / window_attention
  std::string precision = "f32";
  bool reads_observation = true;  // what the policy reads (LayerInputs::queries or attention; values and w_o)
  bool reads_values = false;
  bool reads_queries = false;    // the observation must be LayerInputs::queries (attention rows will not do)
  bool reads_scores = false;     // the engine's per-entry scores (LayerInputs::scores: EngineScoreSelector)
  kvevict::LayoutParams layout;  // the policy's layout: the options given over the preset's (TOVA: per_layer, mean)
  Index protect_prefix =
      0;  // entries at original positions < P are never evicted (docs/algorithms.md#protected-prefix)
  bool prefix_extra = false;  // the protected prefix is kept on top of the budget (else counted in it)
  /// A threshold budget's count bounds (docs/algorithms.md#threshold-budgets): none given, none applied.
  std::optional<Index> count_lower, count_upper;
  std::optional<kvevict::Budget::Scope> count_scope;
  /// The layers the engine keeps whole (docs/algorithms.md#hybrid-models), ascending.
  std::vector<Index> keep_whole;
  bool keeps_whole(Index layer) const { return std::binary_search(keep_whole.begin(), keep_whole.end(), layer); }
  /// The retrieval heads (docs/algorithms.md#retrieval-heads) as (layer, KV head), ascending.
  std::vector<std::pair<Index, Index>> retrieval_heads;
  /// Layer `layer`'s retrieval heads, ascending (LayerInputs::retrieval_heads).
  std::vector<Index> retrieval_heads_of(Index layer) const {
    std::vector<Index> out;
    for (const auto& [l, h] : retrieval_heads)
      if (l == layer) out.push_back(h);
    return out;
  }
  /// This rank's part of a sharded model (docs/algorithms.md#sharded; kvevict_select_layers_sharded): the layers are
  /// its layers (keep_whole names global layer ids then); null: the whole model.
  const kvevict::shard::ModelShard* shard = nullptr;

  /// `b` (the budget given, apart as the C API and Python give it, or by its option) with the protected prefix and
  /// the count bounds of these options; count bounds on a count budget are refused by name.
  kvevict::Budget full_budget(const kvevict::Budget& b) const;
  /// The first count bound given ("count-lower", "count-upper", "count-scope"), or nullptr.
  const char* count_bound_given() const {
    return count_lower ? "count-lower" : count_upper ? "count-upper" : count_scope ? "count-scope" : nullptr;
  }

  /// B of --block (1 unless given): > 1 selects whole blocks, and the output lists their ids (kept_blocks).
  Index block() const { return layout.block; }
  /// kvevict-select's output metadata: the run's policy, composition, budget and layout.
  std::map<std::string, std::string> metadata() const;
};

/// How a front end spells option names in its messages: "--first-stage-ratio" on the command line,
/// "first_stage_ratio" in the C API and Python. Both spellings are accepted as names everywhere.
enum class Spelling { command_line, api };

enum class ParameterType { integer, real, choice, flag, name, layer_list, head_list };

/// A value as its row's type parsed it (the text as given, and the number or boolean it reads as).
struct ParsedValue {
  std::string text;
  Index integer = 0;
  double real = 0.0;
  bool flag = false;
  std::vector<Index> list;                     // a layer list: distinct indices >= 0, ascending
  std::vector<std::pair<Index, Index>> heads;  // a head list: distinct (layer, KV head) >= 0, ascending
};

/// What OptionSet::set has gathered: the options, and which policy, base, selector and budgets were named.
struct OptionDraft {
  Options options;
  std::optional<std::string> policy, base, selector;
  int budgets = 0;
};

/// One row of the parameter table.
struct Parameter {
  std::string_view name;  // canonical: words joined by '-'
  ParameterType type;
  std::string_view metavar;   // the value's placeholder in --help ("N", "R"); choices: "a|b"; flags: empty
  std::string_view fallback;  // the default, in words ("5", "0.2; DefensiveKV 0"); empty: none to state
  std::string_view help;      // one line
  // Numbers: the accepted range (bounds as text, empty when open-ended) and parity; choices: the words.
  std::string_view low, high;
  bool low_open = false, high_open = false;
  enum class Parity { any, odd, even } parity = Parity::any;
  std::vector<std::string_view> choices;
  void (*apply)(OptionDraft&, const ParsedValue&) = nullptr;  // records a value that passed the checks above

  /// The name as `spelling` writes it ("--first-stage-ratio" or "first_stage_ratio").
  std::string spelled(Spelling spelling) const;
  /// What a valid value is, as the messages say it after "must be " ("in [0, 1]", "an odd number >= 1", "l1 or l2").
  std::string expected() const;
  /// The help line with the range and the default ("pooling kernel (K an odd number >= 1; default 5)").
  std::string description() const;
};

/// Every option of every front end, in --help order (policy, base and selector first, then the budgets).
const std::vector<Parameter>& parameters();
/// The row of `name` ('-' or '_' between words), or nullptr.
const Parameter* find_parameter(std::string_view name);

/// kvevict-select --help.
std::string usage_text();

/// Options by name, checked against the table one at a time (`set`) and as a whole (`finish`: one budget, a known
/// policy). Messages spell names as the front end does.
class OptionSet {
 public:
  explicit OptionSet(Spelling spelling = Spelling::command_line) : spelling_(spelling) {}

  /// Sets one option: "policy", "base", "selector", a budget ("budget", "keep", "compression-ratio") or a knob.
  /// A flag takes "1"/"true" or "0"/"false". Throws usage_error naming the option and what it expects.
  void set(const std::string& name, const std::string& value);
  /// The options, checked as a whole: exactly one budget (unless given apart: the C API), a policy or a
  /// base/selector that the catalogue knows; then what the policy reads and its layout.
  Options finish(bool needs_budget = true) const;

  Spelling spelling() const { return spelling_; }

 private:
  Spelling spelling_;
  OptionDraft draft_;
};

/// Parses kvevict-select's argv; nullopt after printing --help. Throws usage_error on any bad argument.
std::optional<Options> parse_command_line(int argc, char** argv);

}  // namespace kvevict::runtime
