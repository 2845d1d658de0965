// kvevict-demo: KV-cache eviction policies on a real (tiny) language model, end to end.
//
// For every policy and budget it prefills each evaluation context once with the full cache, compresses every
// layer's cache with the policy (kvevict, window = the last 32 context positions), then continues on the
// compressed cache, following the protocol of models/tinycode/MODEL.md:
//   continuation loss  mean NLL of bytes 1536..2047 of each doc after compressing its first 1536 bytes
//   passkey retrieval  a key planted in ~1.8 KB of code must be reproduced after compressing the code
// `--docs 64 --passkeys 192` is the full protocol; the default is a subset that runs in a minute or two.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include <kvevict/kvevict.hpp>

#include "demo/engine_modes.hpp"
#include "demo/report.hpp"
#include "tinycode/engine.hpp"
#include "tinycode/eval.hpp"

namespace {

using tinycode::Engine;
using tinycode::Index;
using tinycode::Matrix;
using clock_type = std::chrono::steady_clock;

double ms_since(clock_type::time_point t0) {
  return std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
}

// ---- policies -------------------------------------------------------------------------------------------------

/// Chooses what every layer of a prefilled engine keeps; returns one Selection per layer. It sees the whole
/// engine, so per-layer policies and whole-model ones (which plan over all layers before evicting) fit the same
/// slot, and value-aware ones read W_o through engine.eviction_inputs().
using Compressor =
    std::function<std::vector<kvevict::Selection>(const Engine&, const kvevict::Budget&, const kvevict::Knobs& layout)>;
/// Ends a step of a stream (--mode chunked|capped): evicts every layer over n rows per KV head (Engine's
/// evict_over_budget, docs/algorithms.md#streaming), adding the policy's time to *select_ms.
using StreamEvictor = std::function<void(Engine&, Index n, double* select_ms, const kvevict::Knobs& layout)>;

/// RazorAttention's calibration (arXiv 2407.15891; docs/algorithms.md#retrieval-heads), once per model: a block of
/// 256 random bytes (seeded) repeated once is prefilled, every layer's KV heads get kvevict::induction_scores, and the
/// one KV head of the model that scores highest is the retrieval head (LayerInputs::retrieval_heads, per layer).
struct RetrievalHeads {
  std::vector<std::vector<Index>> heads;    // [n_layer]: each layer's retrieval heads
  std::vector<std::vector<double>> scores;  // [n_layer][n_kv_head]: the induction scores
};
const RetrievalHeads& retrieval_heads(const tinycode::Model& model) {
  static const RetrievalHeads calibrated = [&] {
    constexpr Index period = 256;
    std::mt19937 rng(20261207u);
    tinycode::eval::Tokens tokens(static_cast<std::size_t>(period));
    for (auto& t : tokens) t = static_cast<tinycode::Token>(rng() % 256u);
    tokens.insert(tokens.end(), tokens.begin(), tokens.end());
    Engine engine(model);
    engine.extend(tokens);
    RetrievalHeads out;
    for (Index l = 0; l < model.config.n_layer; ++l)
      out.scores.push_back(kvevict::induction_scores(engine.eviction_inputs(l), period));
    out.heads = kvevict::top_heads(out.scores, 1);
    return out;
  }();
  return calibrated;
}

/// `inputs` [n_layer] with the calibrated retrieval heads named (per_layer: the engine's inputs of every layer).
void name_retrieval_heads(std::vector<kvevict::LayerInputs<float>>& inputs, const tinycode::Model& model) {
  const auto& heads = retrieval_heads(model).heads;
  for (std::size_t l = 0; l < inputs.size(); ++l) inputs[l].retrieval_heads = heads[l];
}

struct PolicyEntry {
  std::string name;
  Compressor compress;                                      // empty: the full cache, no eviction
  kvevict::BudgetScope scope = kvevict::BudgetScope::head;  // checked after every compression
  bool ablation = false;                                    // run only when named in --policies or with --ablations
  StreamEvictor stream = {};                                // the same policy while the cache grows
  bool engine_scores = false;  // reads the prefilled engine's KVzip scores (Engine::score_by_reconstruction)
  bool retrieval = false;      // names the calibrated retrieval heads (retrieval_heads(model))
};

/// `k` with a run's layout (--share, --block, --reduce, or an engine mode's; docs/algorithms.md#layouts).
kvevict::Knobs with_layout(kvevict::Knobs k, const kvevict::Knobs& layout) {
  k.share = layout.share;
  k.block = layout.block;
  k.reduce = layout.reduce;
  return k;
}

/// The catalogue's policy `base` with `knobs` (and the layout) applied, under `name`; with a `selector`, the
/// composition Policy<base, selector> (kvevict::catalogue::compose: bases() and selectors()). A policy that ranks the
/// engine's scores (docs/algorithms.md#engine-scores) reads those of the engine's KVzip replay
/// (Engine::score_by_reconstruction), which runs once per record on the prefilled engine (score_once) and whose time
/// is added to the selection time of every configuration that reads it; one-shot only (the replay scores what the
/// prefill cached), so it has no stream evictor.
PolicyEntry entry(const std::string& name, const std::string& base, const kvevict::Knobs& knobs = {},
                  bool ablation = false, const std::string& selector = "", bool retrieval = false) {
  PolicyEntry out{name, {}, kvevict::BudgetScope::head, ablation};
  out.retrieval = retrieval;
  const auto make = [&](const auto& e) {
    using P = typename std::decay_t<decltype(e)>::policy_type;
    out.scope = e.scope;
    out.engine_scores = P::reads_scores();
    out.compress = [e, knobs, retrieval](const Engine& engine, const kvevict::Budget& budget,
                                         const kvevict::Knobs& layout) {
      const auto policy = e.make(with_layout(knobs, layout));
      auto inputs = engine.eviction_inputs_for(policy);
      if (retrieval) name_retrieval_heads(inputs, engine.model());
      return kvevict::select_layers(policy, inputs, budget);
    };
    if (!P::reads_scores())
      out.stream = [e, knobs, retrieval](Engine& engine, Index n, double* select_ms, const kvevict::Knobs& layout) {
        tinycode::EvictionStats stats;
        const auto* heads = retrieval ? &retrieval_heads(engine.model()).heads : nullptr;
        engine.evict_over_budget(e.make(with_layout(knobs, layout)), n, &stats, heads);
        *select_ms += stats.select_ms;
      };
  };
  const bool found =
      selector.empty() ? kvevict::catalogue::visit(base, make) : kvevict::catalogue::compose(base, selector, make);
  if (!found) throw std::logic_error("kvevict-demo: no catalogue policy '" + base + "' (selector '" + selector + "')");
  return out;
}

/// The policies the demo compares: the full cache, every catalogue policy, then the ablations (one part of a
/// policy changed: which part helps or hurts on this model, and what the L2 Gram value term costs).
const std::vector<PolicyEntry>& all_policies() {
  static const std::vector<PolicyEntry> policies = [] {
    std::vector<PolicyEntry> list = {{"full", {}}};
    kvevict::catalogue::for_each(kvevict::catalogue::entries(), [&](const auto& e) {
      if (!std::decay_t<decltype(e)>::policy_type::reads_scores())
        list.push_back(entry(std::string(e.name), std::string(e.name)));
    });
    // KVzip (arXiv 2505.23416): the engine scores each entry by context reconstruction, ranked by the engine-score
    // presets (window 0, as KVzip), per layer and across layers.
    list.push_back(entry("kvzip", "engine-scores"));
    list.push_back(entry("layer-kvzip", "layer-engine-scores"));
    kvevict::Knobs l2, no_value, no_mass, safeguard;
    l2.value_norm = kvevict::ValueNorm::l2;
    no_value.value_term = false;
    no_mass.mass_forcing = false;
    safeguard.alpha = 0.2;
    list.push_back(entry("criticalkv+l2", "criticalkv", l2, true));
    list.push_back(entry("defensivekv+l2", "defensivekv", l2, true));
    list.push_back(entry("defensivekv-no-value", "defensivekv", no_value, true));
    list.push_back(entry("defensivekv-no-mass", "defensivekv", no_mass, true));
    list.push_back(entry("defensivekv+safeguard", "defensivekv", safeguard, true));
    list.push_back(entry("layer-defensivekv+l2", "layer-defensivekv", l2, true));
    list.push_back(entry("layer-defensivekv-no-value", "layer-defensivekv", no_value, true));
    // Question-agnostic KeyDiff scores under budgets that move across layers (the last token as the window).
    kvevict::Knobs last_token;
    last_token.window = 1;
    list.push_back(entry("layer+keydiff", "layer", last_token, true, "keydiff"));
    list.push_back(entry("pyramidkv+keydiff", "pyramidkv", last_token, true, "keydiff"));
    // Expected Attention's scores (the next positions' expected attention) under one budget across layers.
    list.push_back(entry("layer+expected", "layer", {}, true, "expected"));
    // H2O's received attention (the whole prompt's, then every later query's) under one budget across layers.
    list.push_back(entry("layer+h2o", "layer", last_token, true, "h2o"));
    // OpenDefensiveKV's ablation: each of its parts removed in turn (pooled again, the whole window kept again, no
    // value term, no mass forcing, no floor); layer-defensivekv is both of its changes removed.
    kvevict::Knobs pooled, closed, open_no_floor;
    pooled.kernel = 5;
    closed.open_window = false;
    open_no_floor.floor = false;
    list.push_back(entry("open-defensivekv+pooled", "open-defensivekv", pooled, true));
    list.push_back(entry("open-defensivekv+window", "open-defensivekv", closed, true));
    list.push_back(entry("open-defensivekv-no-value", "open-defensivekv", no_value, true));
    list.push_back(entry("open-defensivekv-no-mass", "open-defensivekv", no_mass, true));
    list.push_back(entry("open-defensivekv-no-floor", "open-defensivekv", open_no_floor, true));
    // R-KV's redundancy term (docs/algorithms.md#redundancy): removed from R-KV, added to the layer-global policies
    // at R-KV's weight.
    kvevict::Knobs no_redundancy, redundancy;
    no_redundancy.redundancy = 0.0;
    redundancy.redundancy = kvevict::RKV::Params{}.redundancy;
    list.push_back(entry("rkv-no-redundancy", "rkv", no_redundancy, true));
    list.push_back(entry("layer-defensivekv+redundancy", "layer-defensivekv", redundancy, true));
    list.push_back(entry("open-defensivekv+redundancy", "open-defensivekv", redundancy, true));
    // Capped decoding without the value term, then with R-KV's term in its place (docs/results/tinycode-quality.md).
    kvevict::Knobs no_value_redundancy = redundancy;
    no_value_redundancy.value_term = false;
    list.push_back(entry("layer-defensivekv-no-value+redundancy", "layer-defensivekv", no_value_redundancy, true));
    list.push_back(entry("open-defensivekv-no-value+redundancy", "open-defensivekv", no_value_redundancy, true));
    // The calibrated retrieval head kept whole where the budget allows (docs/algorithms.md#retrieval-heads): the
    // layer-global policies as they are, and without the value term (capped decoding's configuration).
    list.push_back(entry("layer-defensivekv+retrieval", "layer-defensivekv", {}, true, "", true));
    list.push_back(entry("open-defensivekv+retrieval", "open-defensivekv", {}, true, "", true));
    list.push_back(entry("layer-defensivekv-no-value+retrieval", "layer-defensivekv", no_value, true, "", true));
    list.push_back(entry("open-defensivekv-no-value+retrieval", "open-defensivekv", no_value, true, "", true));
    return list;
  }();
  return policies;
}

// ---- options --------------------------------------------------------------------------------------------------

struct Options {
  std::filesystem::path model = KVEVICT_SOURCE_DIR "/models/tinycode";
  int docs = 16;  // default subset: about a minute on 2 cores (Release)
  int passkeys = 48;
  std::vector<double> keeps = {0.2, 0.1, 0.05};
  std::vector<std::string> policies;  // empty: all
  std::string json, svg, replot;
  bool check = false, ablations = false;
  bool stepwise = false;
  bool attention_rows = false;  // --attention-rows: the engine hands kvevict the window's softmax rows
  demo::Mode mode = demo::Mode::oneshot;
  Index chunk = 0;  // --chunk C; 0: the mode's default (256 chunked, 64 capped)
  kvevict::Sharing share = kvevict::Sharing::per_head;
  Index block = 1;
  kvevict::Reduce reduce = kvevict::Reduce::max;
  bool renumber = false;
  Index pages = 0;                               // --pages B: the engine's cache in a page pool (vLLM), 0: slabs
  std::vector<const demo::EngineMode*> engines;  // --engines: every configuration under each engine's mode
  unsigned threads = std::max(1u, std::thread::hardware_concurrency());
};

void usage(std::FILE* out) {
  std::fprintf(
      out,
      "usage: kvevict-demo [--docs N] [--passkeys M] [--keep R[,R...]] [--policies NAME[,NAME...]]\n"
      "                    [--json FILE] [--svg FILE] [--replot FILE] [--check] [--ablations]\n"
      "                    [--model DIR] [--threads N] [--stepwise] [--attention-rows] [--mode M] [--chunk C]\n"
      "                    [--share S] [--block B] [--reduce R] [--renumber] [--pages B]\n"
      "                    [--engines NAME[,NAME...]|all]\n"
      "  --docs N        continuation loss on the first N of the 64 eval docs (default %d)\n"
      "  --passkeys M    passkey retrieval on the first M of the 192 records (default %d)\n"
      "  --keep LIST     keep ratios (default 0.2,0.1,0.05): n_kept = floor(keep * context length)\n"
      "  --policies LIST subset of:",
      Options{}.docs, Options{}.passkeys);
  for (const auto& p : all_policies()) std::fprintf(out, " %s", p.name.c_str());
  std::fprintf(
      out,
      "\n  --json FILE     one record per (policy, keep)\n"
      "  --ablations     also run the ablations (names with + or -no-: one part of a policy changed)\n"
      "  --svg FILE      chart: loss increase and passkey accuracy against keep, one line per policy\n"
      "  --replot FILE   no run: print the table (and --svg) of a --json FILE written earlier\n"
      "  --check         exit 1 unless every number is finite and the full cache reproduces the reference\n"
      "                  per-doc losses of eval/full_cache_nll.json within 1e-3 (the CI smoke test)\n"
      "  --model DIR     model directory (default: the vendored models/tinycode)\n"
      "  --threads N     docs and passkey records run in parallel on N threads (default: all cores)\n"
      "  --stepwise      run the continuation one decoding step at a time (slower, same numbers)\n"
      "  --attention-rows  the engine hands each policy the softmax rows its forward pass computed for the window\n"
      "                  (LayerInputs::attention, eager attention) instead of the queries (policies that read\n"
      "                  queries themselves, expected-attention, refuse it)\n"
      "  --mode M        oneshot (default): prefill the context, evict once, continue;\n"
      "                  chunked: prefill the context in chunks of C, evicting to n_kept after each, then\n"
      "                  continue without eviction; capped: stream the whole document (context and\n"
      "                  continuation; passkeys: context, question, answer) in steps of C under n_kept,\n"
      "                  evicting after every step. A last step shorter than the window joins the one before\n"
      "  --chunk C       the step of chunked / capped (default 256 / 64; at least the window, 32)\n"
      "  --share S       head (default), layer or model: which KV heads keep one common set of tokens\n"
      "  --block B       keep or evict whole blocks of B rows (default 1: tokens), as paged caches do\n"
      "  --reduce R      max (default) or mean: how shared heads' and a block's scores become one\n"
      "  --renumber      after each eviction, re-rotate the kept keys to contiguous RoPE positions and\n"
      "                  continue from each head's length (default: keep the original positions)\n"
      "  --pages B       the engine keeps its cache in a page pool of B-token pages with one block table,\n"
      "                  read in place by kvevict, each eviction applying adapters::vllm_plan (as vLLM;\n"
      "                  needs --share model; positions kept)\n"
      "  --engines LIST  run every configuration under each engine's mode instead of the layout flags:\n"
      "                  tensorrt-llm, llama.cpp, sglang, vllm, vllm-pages, openvino, or all (docs/engines.md);\n"
      "                  each selection goes through the engine's adapter, which may refuse it (oneshot)\n"
      "  --docs 64 --passkeys 192 is the full protocol of MODEL.md.\n");
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    const auto number = [&](const std::string& text, auto parse_fn) {
      std::size_t used = 0;
      try {
        const auto v = parse_fn(text, &used);
        if (used == text.size()) return v;
      } catch (const std::exception&) {
      }
      throw std::invalid_argument(a + ": '" + text + "' is not a number");
    };
    const auto integer = [&] {
      return number(value(), [](const std::string& t, std::size_t* u) { return std::stoi(t, u); });
    };
    if (a == "-h" || a == "--help") {
      usage(stdout);
      std::exit(0);
    } else if (a == "--docs") {
      o.docs = integer();
    } else if (a == "--passkeys") {
      o.passkeys = integer();
    } else if (a == "--keep") {
      o.keeps.clear();
      for (const auto& k : split(value()))
        o.keeps.push_back(number(k, [](const std::string& t, std::size_t* u) { return std::stod(t, u); }));
    } else if (a == "--policies") {
      o.policies = split(value());
    } else if (a == "--json") {
      o.json = value();
    } else if (a == "--svg") {
      o.svg = value();
    } else if (a == "--replot") {
      o.replot = value();
    } else if (a == "--check") {
      o.check = true;
    } else if (a == "--ablations") {
      o.ablations = true;
    } else if (a == "--model") {
      o.model = value();
    } else if (a == "--threads") {
      const int t = integer();
      if (t < 1) throw std::invalid_argument("--threads must be >= 1");
      o.threads = static_cast<unsigned>(t);
    } else if (a == "--share") {
      const std::string v = value();
      if (v != "head" && v != "layer" && v != "model")
        throw std::invalid_argument("--share must be head, layer or model, got '" + v + "'");
      o.share = v == "head"    ? kvevict::Sharing::per_head
                : v == "layer" ? kvevict::Sharing::per_layer
                               : kvevict::Sharing::per_model;
    } else if (a == "--block") {
      o.block = integer();
      if (o.block < 1) throw std::invalid_argument("--block must be >= 1");
    } else if (a == "--reduce") {
      const std::string v = value();
      if (v != "max" && v != "mean") throw std::invalid_argument("--reduce must be max or mean, got '" + v + "'");
      o.reduce = v == "max" ? kvevict::Reduce::max : kvevict::Reduce::mean;
    } else if (a == "--renumber") {
      o.renumber = true;
    } else if (a == "--engines") {
      const std::string v = value();
      if (v == "all") {
        for (const demo::EngineMode& m : demo::engine_modes())
          if (std::find(o.engines.begin(), o.engines.end(), &m) == o.engines.end()) o.engines.push_back(&m);
      } else {
        for (const std::string& name : split(v)) {
          const demo::EngineMode* m = demo::find_engine_mode(name);
          if (!m) throw std::invalid_argument("unknown engine '" + name + "' (see --help)");
          if (std::find(o.engines.begin(), o.engines.end(), m) == o.engines.end()) o.engines.push_back(m);
        }
      }
    } else if (a == "--pages") {
      o.pages = integer();
      if (o.pages < 1) throw std::invalid_argument("--pages must be >= 1");
    } else if (a == "--mode") {
      o.mode = demo::parse_mode(value());
    } else if (a == "--chunk") {
      o.chunk = integer();
      if (o.chunk < 32) throw std::invalid_argument("--chunk must be >= 32 (the window)");
    } else if (a == "--stepwise") {
      o.stepwise = true;
    } else if (a == "--attention-rows") {
      o.attention_rows = true;
    } else {
      throw std::invalid_argument("unknown argument '" + a + "' (see --help)");
    }
  }
  if (o.docs < 0 || o.passkeys < 0) throw std::invalid_argument("--docs and --passkeys must be >= 0");
  if (o.chunk == 0) o.chunk = o.mode == demo::Mode::capped ? 64 : o.mode == demo::Mode::chunked ? 256 : 0;
  if (o.mode == demo::Mode::oneshot && o.chunk != 0) throw std::invalid_argument("--chunk needs --mode chunked|capped");
  for (const auto& name : o.policies) {
    const auto& all = all_policies();
    if (std::none_of(all.begin(), all.end(), [&](const PolicyEntry& p) { return name == p.name; }))
      throw std::invalid_argument("unknown policy '" + name + "' (see --help)");
  }
  for (double k : o.keeps) kvevict::Budget::keep_ratio(k);  // validates
  if (o.pages > 0 && (o.share != kvevict::Sharing::per_model || o.renumber))
    throw std::invalid_argument(
        "--pages needs --share model (one block table for the model) and keeps positions "
        "(no --renumber)");
  if (!o.engines.empty() && (o.mode != demo::Mode::oneshot || o.pages > 0 || o.renumber || o.block > 1 ||
                             o.share != kvevict::Sharing::per_head))
    throw std::invalid_argument(
        "--engines sets each engine's layout itself: oneshot mode, without --share, --block, "
        "--renumber or --pages");
  return o;
}

// ---- runs -----------------------------------------------------------------------------------------------------

/// One (policy, keep) configuration, with the layout and the engine it runs on.
struct RunConfig {
  const PolicyEntry* policy;
  double keep;                               // 1 for the full cache
  kvevict::Knobs layout;                     // share, block, reduce
  bool renumber = false;                     // the engine renumbers positions after each eviction (K-shift)
  Index pages = 0;                           // the engine's page pool (vLLM's plans); 0: slabs
  const demo::EngineMode* engine = nullptr;  // --engines: the engine whose adapter takes every selection
  bool full() const { return !policy->compress; }
};

/// What one configuration does after a prefilled context.
struct Outcome {
  Matrix logits;            // of the tokens run after the compression
  double select_ms = 0;     // the policy's time, all layers
  double forward_ms = 0;    // streaming modes: the engine's forward passes over the stream (eviction excluded)
  std::vector<Index> kept;  // cache rows per (layer, KV head) after eviction
  std::string refused;      // the engine's adapter refused the selections: its message (nothing else is set)
};

/// The budget contract of `policy` (see BudgetScope) on the selections it made for every layer; throws if the
/// library handed back something the engine did not ask for. In block mode kept counts round down to whole blocks
/// (at most the budget); shared heads (and layers) keep identical rows. (Shapes are checked again by compact().)
void check_budget(const PolicyEntry& policy, const Engine& engine, const std::vector<kvevict::Selection>& selections,
                  Index n_kept, const kvevict::Knobs& layout) {
  const auto& c = engine.model().config;
  const auto fail = [&](const std::string& what) {
    throw std::logic_error(policy.name + ": " + what + " (n_kept " + std::to_string(n_kept) + ")");
  };
  const bool blocks = layout.block.value_or(1) > 1;
  const kvevict::Sharing share = layout.share.value_or(kvevict::Sharing::per_head);
  const auto within = [&](Index got, Index budget) { return blocks ? got <= budget : got == budget; };
  if (static_cast<Index>(selections.size()) != c.n_layer) fail("not one selection per layer");
  Index model_total = 0;
  for (Index l = 0; l < c.n_layer; ++l) {
    const kvevict::Selection& s = selections[static_cast<std::size_t>(l)];
    if (s.heads() != c.n_kv_head) fail("layer " + std::to_string(l) + ": selection over the wrong number of heads");
    Index layer_total = 0;
    for (Index h = 0; h < s.heads(); ++h) {
      if (policy.scope == kvevict::BudgetScope::head && !within(s.length(h), n_kept))
        fail("layer " + std::to_string(l) + " head " + std::to_string(h) + " keeps " + std::to_string(s.length(h)));
      const kvevict::Selection& shared =
          selections[share == kvevict::Sharing::per_model ? 0 : static_cast<std::size_t>(l)];
      if (share != kvevict::Sharing::per_head &&
          !std::equal(s.head(h).begin(), s.head(h).end(), shared.head(0).begin(), shared.head(0).end()))
        fail("layer " + std::to_string(l) + " head " + std::to_string(h) + " differs from its shared set");
      layer_total += s.length(h);
    }
    if (policy.scope == kvevict::BudgetScope::layer && !within(layer_total, c.n_kv_head * n_kept))
      fail("layer " + std::to_string(l) + " keeps " + std::to_string(layer_total) + " rows");
    model_total += layer_total;
  }
  if (policy.scope == kvevict::BudgetScope::model && !within(model_total, c.n_layer * c.n_kv_head * n_kept))
    fail("the model keeps " + std::to_string(model_total) + " rows");
}

/// Compresses a copy of `prefilled` (a prefilled context) with `run`'s policy, then runs `after` on it.
Outcome continue_with(const RunConfig& run, const Engine& prefilled, const tinycode::eval::Tokens& after,
                      bool stepwise) {
  Outcome out;
  Engine engine = prefilled;  // every configuration starts from the same prefill and compresses its own copy
  engine.renumber_positions(run.renumber);
  if (!run.full()) {
    const kvevict::Budget budget = kvevict::Budget::keep_ratio(run.keep);
    const auto t0 = clock_type::now();
    const std::vector<kvevict::Selection> selections = run.policy->compress(engine, budget, run.layout);
    out.select_ms = ms_since(t0);
    check_budget(*run.policy, engine, selections, static_cast<Index>(budget.n_kept(engine.cache().length(0, 0))),
                 run.layout);
    if (run.engine) {
      try {
        demo::check_adapter(*run.engine, selections);
      } catch (const kvevict::invalid_argument& e) {
        out.refused = e.what();
        return out;
      }
    }
    engine.evict(selections);
  }
  out.kept = engine.kept_lengths();
  if (!stepwise) {
    out.logits = engine.extend(after);  // teacher forcing: one chunk == after.size() decoding steps
  } else {
    out.logits.resize(static_cast<Index>(after.size()), engine.model().config.vocab);
    for (std::size_t i = 0; i < after.size(); ++i) out.logits.row(static_cast<Index>(i)) = engine.decode(after[i]);
  }
  return out;
}

/// `tokens` in steps of `chunk` (a last step shorter than the window joins the one before).
std::vector<std::pair<std::size_t, std::size_t>> steps_of(std::size_t size, Index chunk, Index window) {
  std::vector<std::pair<std::size_t, std::size_t>> steps;  // [first, last)
  const auto c = static_cast<std::size_t>(chunk);
  for (std::size_t at = 0; at < size; at += c) steps.emplace_back(at, std::min(size, at + c));
  if (steps.size() > 1 && steps.back().second - steps.back().first < static_cast<std::size_t>(window)) {
    steps[steps.size() - 2].second = steps.back().second;
    steps.pop_back();
  }
  return steps;
}

/// Runs `tokens` on `engine` in steps, ending each with the policy's streaming eviction to n (none for the full
/// cache); returns the logits of every token [tokens, vocab]. Adds the forward passes' time to *forward_ms.
Matrix stream(Engine& engine, const RunConfig& run, const tinycode::eval::Tokens& tokens, Index n, Index chunk,
              double* select_ms, double* forward_ms) {
  Matrix logits(static_cast<Index>(tokens.size()), engine.model().config.vocab);
  for (const auto& [first, last] : steps_of(tokens.size(), chunk, engine.window())) {
    const auto t0 = clock_type::now();
    logits.middleRows(static_cast<Index>(first), static_cast<Index>(last - first)) =
        engine.extend(tokens.data() + first, static_cast<Index>(last - first));
    *forward_ms += ms_since(t0);
    if (run.full()) continue;
    run.policy->stream(engine, n, select_ms, run.layout);
    // The streaming contract: every layer (a layer-global policy: the model) back within n per KV head.
    const auto& book = engine.cache().book();
    const Index heads = book.layer(0).kv_heads();
    for (Index l = 0; l < book.layers(); ++l)
      if (run.policy->scope != kvevict::BudgetScope::model &&
          run.layout.share.value_or(kvevict::Sharing::per_head) != kvevict::Sharing::per_model &&
          book.layer(l).entries() > heads * n)
        throw std::logic_error(run.policy->name + ": layer " + std::to_string(l) + " holds " +
                               std::to_string(book.layer(l).entries()) + " rows after a streaming eviction to " +
                               std::to_string(n) + " per head");
    if (book.entries() > book.layers() * heads * n)
      throw std::logic_error(run.policy->name + ": the model holds " + std::to_string(book.entries()) +
                             " rows after a streaming eviction to " + std::to_string(n) + " per head");
  }
  return logits;
}

/// The budget of the streaming modes: n = int(context * keep) tokens per KV head, the record's own context length
/// (1536 bytes for a document, about 1,780 for a passkey record), as oneshot mode gives it.
Index stream_budget(const RunConfig& run, std::size_t context) {
  return static_cast<Index>(kvevict::Budget::keep_ratio(run.keep).n_kept(static_cast<Index>(context)));
}

/// A fresh engine for one configuration of the streaming modes: `context` prefilled in chunks (chunked: evicting
/// after each, then `after` without eviction) or `context` and `after` streamed together (capped). Returns the
/// logits of `context` followed by `after`.
Matrix run_streaming(const tinycode::Model& model, const Options& opt, const RunConfig& run,
                     const tinycode::eval::Tokens& context, const tinycode::eval::Tokens& after, Outcome& out) {
  Engine engine(model, 32, 0, run.pages);
  engine.hand_attention_rows(opt.attention_rows);
  engine.renumber_positions(run.renumber);
  const Index n = stream_budget(run, context.size());
  Matrix logits(static_cast<Index>(context.size() + after.size()), model.config.vocab);
  if (opt.mode == demo::Mode::capped) {
    tinycode::eval::Tokens all = context;
    all.insert(all.end(), after.begin(), after.end());
    logits = stream(engine, run, all, n, opt.chunk, &out.select_ms, &out.forward_ms);
  } else {
    logits.topRows(static_cast<Index>(context.size())) =
        stream(engine, run, context, n, opt.chunk, &out.select_ms, &out.forward_ms);
    out.kept = engine.kept_lengths();  // after the context's last eviction, as oneshot reports
    const auto t0 = clock_type::now();
    logits.bottomRows(static_cast<Index>(after.size())) = engine.extend(after);
    out.forward_ms += ms_since(t0);
    return logits;
  }
  out.kept = engine.kept_lengths();
  return logits;
}

/// The KVzip replay on `prefilled` when a configuration reads it; its time in ms (0 when none does).
double score_once(Engine& prefilled, const std::vector<RunConfig>& runs) {
  if (std::none_of(runs.begin(), runs.end(), [](const RunConfig& r) { return r.policy->engine_scores; })) return 0;
  const auto t0 = clock_type::now();
  prefilled.score_by_reconstruction();
  return ms_since(t0);
}

/// The prefilled engines of one record: slabs, and a page pool when a configuration runs on one (the same prefill,
/// bit for bit; Engine's file comment).
struct Prefilled {
  Engine slab;
  std::vector<std::pair<Index, Engine>> paged;  // (page_rows, engine)

  Prefilled(const tinycode::Model& model, const std::vector<RunConfig>& runs, bool attention_rows) : slab(model) {
    for (const RunConfig& run : runs)
      if (run.pages > 0 &&
          std::none_of(paged.begin(), paged.end(), [&](const auto& p) { return p.first == run.pages; }))
        paged.emplace_back(run.pages, Engine(model, 32, 0, run.pages));
    slab.hand_attention_rows(attention_rows);
    for (auto& p : paged) p.second.hand_attention_rows(attention_rows);
  }
  /// Runs the context on every engine; returns the slab engine's logits, and its time in *slab_ms.
  Matrix extend(const tinycode::eval::Tokens& context, double* slab_ms = nullptr) {
    for (auto& p : paged) p.second.extend(context);
    const auto t0 = clock_type::now();
    Matrix logits = slab.extend(context);
    if (slab_ms) *slab_ms = ms_since(t0);
    return logits;
  }
  /// The KVzip replay where a configuration reads it (score_once); its time on the slab engine.
  double score(const std::vector<RunConfig>& runs) {
    for (auto& p : paged) {  // only where a configuration on that pool reads the scores
      std::vector<RunConfig> on_pool;
      for (const RunConfig& run : runs)
        if (run.pages == p.first) on_pool.push_back(run);
      score_once(p.second, on_pool);
    }
    return score_once(slab, runs);
  }
  const Engine& of(const RunConfig& run) const {
    for (const auto& p : paged)
      if (p.first == run.pages) return p.second;
    return slab;
  }
};

/// Continuation loss of one doc under every configuration.
struct DocResult {
  double prefill_ms = 0;
  std::vector<double> loss, select_ms;   // [configurations]
  std::vector<double> forward_ms;        // [configurations], streaming modes: the stream's forward passes
  std::vector<std::vector<Index>> kept;  // [configurations][layer * kv_head]
  std::vector<std::string> refused;      // [configurations]: the adapter's message, or empty
};

DocResult run_doc(const tinycode::Model& model, const tinycode::eval::Tokens& doc, const std::vector<RunConfig>& runs,
                  const Options& opt) {
  const tinycode::eval::ContinuationTask task(doc);
  DocResult r;
  const auto after = task.continuation_inputs();
  if (opt.mode != demo::Mode::oneshot) {
    const auto context_len = static_cast<Index>(task.context.size());
    for (const RunConfig& run : runs) {
      Outcome o;
      const Matrix logits = run_streaming(model, opt, run, task.context, after, o);
      r.loss.push_back(task.loss(logits.topRows(context_len), logits.bottomRows(logits.rows() - context_len)));
      r.select_ms.push_back(o.select_ms);
      r.forward_ms.push_back(o.forward_ms);
      r.kept.push_back(std::move(o.kept));
      r.refused.emplace_back();
    }
    return r;
  }
  Prefilled prefilled(model, runs, opt.attention_rows);
  const Matrix context_logits = prefilled.extend(task.context, &r.prefill_ms);  // full causal attention, 1536 bytes
  const double replay_ms = prefilled.score(runs);
  for (const RunConfig& run : runs) {
    Outcome o = continue_with(run, prefilled.of(run), after, opt.stepwise);
    r.loss.push_back(o.refused.empty() ? task.loss(context_logits, o.logits) : 0.0);
    r.select_ms.push_back(o.select_ms + (run.policy->engine_scores ? replay_ms : 0.0));
    r.kept.push_back(std::move(o.kept));
    r.refused.push_back(std::move(o.refused));
  }
  return r;
}

/// Passkey retrieval of one record under every configuration.
struct KeyResult {
  std::vector<char> solved;          // [configurations]
  std::vector<std::string> refused;  // [configurations]: the adapter's message, or empty
};

KeyResult run_passkey(const tinycode::Model& model, const tinycode::eval::PasskeyRecord& record,
                      const std::vector<RunConfig>& runs, const Options& opt) {
  const tinycode::eval::PasskeyTask task(record);
  KeyResult r;
  const auto after = task.after_inputs();
  if (opt.mode != demo::Mode::oneshot) {
    for (const RunConfig& run : runs) {
      Outcome o;
      const Matrix logits = run_streaming(model, opt, run, task.context, after, o);
      r.solved.push_back(task.solved(logits.bottomRows(static_cast<Index>(after.size()))));
      r.refused.emplace_back();
    }
    return r;
  }
  Prefilled prefilled(model, runs, opt.attention_rows);
  prefilled.extend(task.context);
  prefilled.score(runs);
  for (const RunConfig& run : runs) {
    Outcome o = continue_with(run, prefilled.of(run), after, opt.stepwise);
    r.solved.push_back(o.refused.empty() && task.solved(o.logits));
    r.refused.push_back(std::move(o.refused));
  }
  return r;
}

/// Runs f(0) .. f(n - 1) on `threads` threads; rethrows the first exception.
template <class F>
void parallel_for(std::size_t n, unsigned threads, F&& f) {
  std::atomic<std::size_t> next{0};
  std::exception_ptr error;
  std::mutex error_mutex;
  const auto worker = [&] {
    for (std::size_t i; (i = next++) < n;) {
      try {
        f(i);
      } catch (...) {
        const std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
        next = n;
      }
    }
  };
  std::vector<std::thread> pool;
  for (unsigned t = 1; t < std::max(1u, threads); ++t) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

/// What every run ends with (and all that --replot does): the JSON, the chart and the smoke checks.
int finish(const Options& opt, const std::vector<demo::Record>& records) {
  if (!opt.json.empty()) demo::write_json(opt.json, records);
  if (!opt.svg.empty()) demo::write_chart(opt.svg, records);
  if (opt.check) {
    nlohmann::json reference;
    std::ifstream(opt.model / "eval" / "full_cache_nll.json") >> reference;
    const std::vector<std::string> failures = demo::check_records(records, reference);
    for (const std::string& f : failures) std::fprintf(stderr, "kvevict-demo --check: %s\n", f.c_str());
    if (!failures.empty()) return 1;
    std::printf("--check: every number finite, full-cache losses of %ld docs within 1e-3 of the reference\n",
                records.empty() ? 0L : records.front().docs);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options opt = parse(argc, argv);
    if (!opt.replot.empty()) {
      const std::vector<demo::Record> records = demo::read_json(opt.replot);
      demo::print_table(stdout, records);
      return finish(opt, records);
    }
    const auto t_start = clock_type::now();
    const tinycode::Model model = tinycode::Model::load(opt.model);
    const auto docs = tinycode::eval::load_docs(opt.model / "eval" / "docs.bin");
    const auto passkeys = tinycode::eval::load_passkeys(opt.model / "eval" / "passkeys.bin");
    const std::size_t n_docs = std::min(static_cast<std::size_t>(opt.docs), docs.size());
    const std::size_t n_keys = std::min(static_cast<std::size_t>(opt.passkeys), passkeys.size());

    std::vector<RunConfig> runs;
    for (const auto& p : all_policies()) {
      const bool named = std::find(opt.policies.begin(), opt.policies.end(), p.name) != opt.policies.end();
      if (opt.policies.empty() ? p.ablation && !opt.ablations : !named) continue;
      if (opt.mode != demo::Mode::oneshot && p.compress && !p.stream) {  // one-shot scores (kvzip)
        if (named) std::printf("kvevict-demo: %s runs in oneshot mode only; skipped\n", p.name.c_str());
        continue;
      }
      kvevict::Knobs layout;
      layout.share = opt.share;
      layout.block = opt.block;
      layout.reduce = opt.reduce;
      if (!p.compress) {
        runs.push_back({&p, 1.0, layout, opt.renumber, opt.pages, nullptr});  // the flags' engine (no --engines)
        continue;
      }
      if (opt.engines.empty())
        for (double k : opt.keeps) runs.push_back({&p, k, layout, opt.renumber, opt.pages, nullptr});
      for (const demo::EngineMode* m : opt.engines) {
        layout.share = m->share;
        layout.block = m->block;
        for (double k : opt.keeps) runs.push_back({&p, k, layout, m->renumber, m->pages, m});
      }
    }

    std::printf("kvevict-demo: tinycode (%s), %zu (policy, keep) configurations, %u threads, mode %s, %s\n",
                opt.model.string().c_str(), runs.size(), opt.threads, demo::describe_mode(opt.mode, opt.chunk).c_str(),
                opt.engines.empty() ? demo::describe_layout(opt.share, opt.block, opt.reduce, opt.renumber,
                                                            static_cast<long>(opt.pages))
                                          .c_str()
                                    : "each engine's layout (policy@engine; docs/engines.md)");
    std::printf("continuation loss: docs 0..%zu (%zu of %zu; context 1536 bytes, loss over bytes 1536..2047)\n",
                n_docs ? n_docs - 1 : 0, n_docs, docs.size());
    std::printf("passkey retrieval: records 0..%zu (%zu of %zu; context = the ~1.8 KB before the question)%s\n",
                n_keys ? n_keys - 1 : 0, n_keys, passkeys.size(), opt.stepwise ? "; stepwise decoding" : "");
    if (opt.attention_rows)
      std::printf("window attention: the softmax rows the engine's forward pass computed (--attention-rows)\n");
    if (std::any_of(runs.begin(), runs.end(), [](const RunConfig& r) { return r.policy->retrieval; })) {
      const RetrievalHeads& calibrated = retrieval_heads(model);  // computed here, once, before the threads
      std::string best;
      for (std::size_t l = 0; l < calibrated.heads.size(); ++l)
        for (Index h : calibrated.heads[l])
          best += " layer " + std::to_string(l) + ", KV head " + std::to_string(h) + " (induction score " +
                  std::to_string(calibrated.scores[l][static_cast<std::size_t>(h)]) + ")";
      std::printf("retrieval head (+retrieval; 256 random bytes repeated, the top induction score):%s\n", best.c_str());
    }
    std::fflush(stdout);

    // Every doc and every passkey record is an independent task (its own engine); results land in fixed slots.
    std::vector<DocResult> doc_results(n_docs);
    std::vector<KeyResult> key_results(n_keys);
    std::atomic<std::size_t> done{0};
    std::mutex print_mutex;
    parallel_for(n_docs + n_keys, opt.threads, [&](std::size_t t) {
      if (t < n_docs)
        doc_results[t] = run_doc(model, docs[t], runs, opt);
      else
        key_results[t - n_docs] = run_passkey(model, passkeys[t - n_docs], runs, opt);
      const std::lock_guard<std::mutex> lock(print_mutex);
      std::fprintf(stderr, "\r  %zu/%zu docs + passkeys (%.0f s)", ++done, n_docs + n_keys, ms_since(t_start) / 1000.0);
    });
    std::fprintf(stderr, "\n");

    // Report.
    const double docs_d = std::max(1.0, static_cast<double>(n_docs));
    double prefill_ms = 0;
    for (const DocResult& d : doc_results) prefill_ms += d.prefill_ms / docs_d;
    const auto context_len = static_cast<Index>(tinycode::eval::ContinuationTask::context_len);
    std::vector<demo::Record> records;
    for (std::size_t c = 0; c < runs.size(); ++c) {
      demo::Record r;
      r.policy = runs[c].policy->name;
      r.mode = opt.mode;
      r.chunk = static_cast<long>(opt.chunk);
      r.share = runs[c].layout.share.value_or(kvevict::Sharing::per_head);
      r.block = static_cast<long>(runs[c].layout.block.value_or(1));
      r.reduce = runs[c].layout.reduce.value_or(kvevict::Reduce::max);
      r.renumber = runs[c].renumber;
      r.attention_rows = opt.attention_rows;
      r.pages = static_cast<long>(runs[c].pages);
      if (runs[c].engine) r.engine = runs[c].engine->name;
      r.keep = runs[c].keep;
      r.n_kept = static_cast<long>(kvevict::Budget::keep_ratio(r.keep).n_kept(context_len));
      r.docs = static_cast<long>(n_docs);
      r.prefill_ms = prefill_ms;
      Index kept_min = std::numeric_limits<Index>::max(), kept_max = 0, kept_sum = 0, kept_count = 0;
      for (const DocResult& d : doc_results)
        if (r.refused.empty()) r.refused = d.refused[c];
      for (const KeyResult& k : key_results)
        if (r.refused.empty()) r.refused = k.refused[c];
      if (!r.refused.empty()) {  // refused for one record is refused: no numbers
        records.push_back(std::move(r));
        continue;
      }
      for (const DocResult& d : doc_results) {
        r.doc_losses.push_back(d.loss[c]);
        r.loss += d.loss[c] / docs_d;
        r.select_ms += d.select_ms[c] / docs_d;
        if (!d.forward_ms.empty()) r.forward_ms += d.forward_ms[c] / docs_d;
        r.kept_by_head.resize(d.kept[c].size(), 0.0);
        for (std::size_t i = 0; i < d.kept[c].size(); ++i)
          r.kept_by_head[i] += static_cast<double>(d.kept[c][i]) / docs_d;
        for (Index k : d.kept[c]) {
          kept_min = std::min(kept_min, k);
          kept_max = std::max(kept_max, k);
          kept_sum += k;
          ++kept_count;
        }
      }
      r.kept_min = kept_count ? static_cast<long>(kept_min) : 0;
      r.kept_max = static_cast<long>(kept_max);
      r.kept_mean = kept_count ? static_cast<double>(kept_sum) / static_cast<double>(kept_count) : 0.0;
      for (std::size_t k = 0; k < n_keys; ++k) {
        const bool ident = passkeys[k].kind == "ident";
        (ident ? r.ident_total : r.assert_total) += 1;
        (ident ? r.ident_solved : r.assert_solved) += key_results[k].solved[c] ? 1 : 0;
      }
      records.push_back(std::move(r));
    }
    const auto full = std::find_if(records.begin(), records.end(), [](const demo::Record& r) { return r.full(); });
    if (full != records.end() && full->loss > 0)
      for (demo::Record& r : records)
        if (r.refused.empty()) r.loss_increase_pct = (r.loss - full->loss) / full->loss * 100.0;

    std::printf("\n");
    demo::print_table(stdout, records);
    if (opt.mode == demo::Mode::oneshot)
      std::printf(
          "\nselect ms: the policy's time for all 10 layers of one doc; prefill ms: the full prefill of one doc's\n"
          "1536-byte context (both means per doc, one thread each); kept/head: cache rows per (layer, KV head)\n"
          "after eviction, over all docs. Total %.1f s.\n",
          ms_since(t_start) / 1000.0);
    else
      std::printf(
          "\nselect ms: the policy's time over all evictions of one doc's stream (all layers, compaction included;\n"
          "mean per doc, one thread each); forward ms: the engine's forward passes over the same doc (every step and\n"
          "the continuation, eviction excluded); sel/fw: select ms as a share of forward ms; kept/head: cache rows\n"
          "per (layer, KV head) after the last eviction of the %s, over all docs. Total %.1f s.\n",
          opt.mode == demo::Mode::chunked ? "context" : "stream", ms_since(t_start) / 1000.0);
    return finish(opt, records);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvevict-demo: %s\n", e.what());
    return 1;
  }
  return 0;
}
