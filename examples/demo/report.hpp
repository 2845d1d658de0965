#pragma once
/// What kvevict-demo reports per (policy, keep): the Record, its JSON form (`--json`, read back by `--replot`),
/// the printed table, the chart (`--svg`) and the smoke checks (`--check`).

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <kvevict/layout/params.hpp>

#include "demo/svg_chart.hpp"

namespace demo {

/// How the cache is filled and evicted (--mode): once after the prefill, after every prefill chunk, or after
/// every step of the whole stream (docs/algorithms.md#streaming).
enum class Mode { oneshot, chunked, capped };

inline const char* to_string(Mode m) {
  return m == Mode::oneshot ? "oneshot" : m == Mode::chunked ? "chunked" : "capped";
}
inline Mode parse_mode(const std::string& text) {
  for (Mode m : {Mode::oneshot, Mode::chunked, Mode::capped})
    if (text == to_string(m)) return m;
  throw std::invalid_argument("--mode must be oneshot, chunked or capped, got '" + text + "'");
}
/// "oneshot", "chunked C=256", "capped C=64".
inline std::string describe_mode(Mode m, long chunk) {
  return m == Mode::oneshot ? std::string(to_string(m)) : std::string(to_string(m)) + " C=" + std::to_string(chunk);
}

/// "share head, tokens, original positions", "share layer, blocks of 16 (max), renumbered positions",
/// "share model, blocks of 16 (max), original positions, a page pool of 16-token pages (vLLM's plan)".
inline std::string describe_layout(kvevict::Sharing share, long block, kvevict::Reduce reduce, bool renumber,
                                   long pages = 0) {
  const std::string s = share == kvevict::Sharing::per_head    ? "head"
                        : share == kvevict::Sharing::per_layer ? "layer"
                                                               : "model";
  const std::string b = block > 1 ? "blocks of " + std::to_string(block) : std::string("tokens");
  const bool reduces = share != kvevict::Sharing::per_head || block > 1;
  return "share " + s + ", " + b + (reduces ? std::string(" (") + kvevict::to_string(reduce) + ")" : "") + ", " +
         (renumber ? "renumbered" : "original") + " positions" +
         (pages > 0 ? ", a page pool of " + std::to_string(pages) + "-token pages (vLLM's plan)" : std::string());
}
inline const char* share_name(kvevict::Sharing s) {
  return s == kvevict::Sharing::per_head ? "head" : s == kvevict::Sharing::per_layer ? "layer" : "model";
}
inline kvevict::Sharing parse_share(const std::string& text) {
  for (kvevict::Sharing s : {kvevict::Sharing::per_head, kvevict::Sharing::per_layer, kvevict::Sharing::per_model})
    if (text == share_name(s)) return s;
  throw std::invalid_argument("share must be head, layer or model, got '" + text + "'");
}

/// One (policy, keep) configuration's results, averaged over the docs (loss) or summed over the records (passkeys).
struct Record {
  std::string policy;  // the kvevict-select policy name; "full" for the full cache
  Mode mode = Mode::oneshot;
  long chunk = 0;                                       // the step of chunked / capped; 0 for oneshot
  kvevict::Sharing share = kvevict::Sharing::per_head;  // the layout (docs/algorithms.md#layouts)
  long block = 1;
  kvevict::Reduce reduce = kvevict::Reduce::max;
  bool renumber = false;        // RoPE positions renumbered after each eviction
  bool attention_rows = false;  // the engine handed the window's softmax rows (--attention-rows), not its queries
  long pages = 0;               // the engine's page pool (vLLM): pages of this many tokens; 0: slabs
  std::string engine;           // --engines: the engine mode (docs/engines.md); empty: the layout flags
  std::string refused;          // the engine's adapter refused the selections (for any doc or record): its message, and
                                // no numbers then (loss, passkeys and kept stay 0)
  double keep = 1;              // keep ratio; 1 for the full cache
  long n_kept = 0;              // floor(keep * context length)
  long docs = 0;
  double loss = 0;  // mean continuation NLL (nats/byte)
  std::vector<double> doc_losses;
  double loss_increase_pct = 0;  // vs the full cache
  int ident_solved = 0, ident_total = 0, assert_solved = 0, assert_total = 0;
  double select_ms = 0, prefill_ms = 0;  // per doc: the policy (all layers) and the full prefill
  double forward_ms = 0;                 // streaming modes, per doc: the forward passes (eviction excluded)
  double kept_mean = 0;                  // cache rows per (layer, KV head) after eviction, over all docs
  long kept_min = 0, kept_max = 0;
  std::vector<double> kept_by_head;  // [layer * kv_heads + kv_head]: cache rows after eviction, mean over docs

  bool full() const { return policy == "full"; }
  /// The row's name: the policy, @ the engine mode when there is one.
  std::string label() const { return engine.empty() ? policy : policy + "@" + engine; }
};

inline nlohmann::json to_json(const Record& r) {
  return {{"policy", r.policy},
          {"mode", to_string(r.mode)},
          {"chunk", r.chunk},
          {"share", share_name(r.share)},
          {"block", r.block},
          {"reduce", kvevict::to_string(r.reduce)},
          {"renumber", r.renumber},
          {"attention_rows", r.attention_rows},
          {"pages", r.pages},
          {"engine", r.engine},
          {"refused", r.refused},
          {"keep", r.keep},
          {"n_kept", r.n_kept},
          {"docs", r.docs},
          {"loss", r.loss},
          {"doc_losses", r.doc_losses},
          {"loss_increase_pct", r.loss_increase_pct},
          {"passkey_ident", {r.ident_solved, r.ident_total}},
          {"passkey_assert", {r.assert_solved, r.assert_total}},
          {"select_ms", r.select_ms},
          {"prefill_ms", r.prefill_ms},
          {"forward_ms", r.forward_ms},
          {"kept_per_head", {{"mean", r.kept_mean}, {"min", r.kept_min}, {"max", r.kept_max}}},
          {"kept_by_layer_head", r.kept_by_head}};
}

inline Record from_json(const nlohmann::json& j) {
  Record r;
  r.policy = j.at("policy").get<std::string>();
  r.mode = parse_mode(j.value("mode", std::string("oneshot")));  // files written before --mode are oneshot
  r.chunk = j.value("chunk", 0L);
  r.share = parse_share(j.value("share", std::string("head")));  // files written before --share: the defaults
  r.block = j.value("block", 1L);
  r.reduce = j.value("reduce", std::string("max")) == "mean" ? kvevict::Reduce::mean : kvevict::Reduce::max;
  r.renumber = j.value("renumber", false);
  r.attention_rows = j.value("attention_rows", false);
  r.pages = j.value("pages", 0L);
  r.engine = j.value("engine", std::string());
  r.refused = j.value("refused", std::string());
  r.keep = j.at("keep").get<double>();
  r.n_kept = j.at("n_kept").get<long>();
  r.docs = j.at("docs").get<long>();
  r.loss = j.at("loss").get<double>();
  r.doc_losses = j.at("doc_losses").get<std::vector<double>>();
  r.loss_increase_pct = j.at("loss_increase_pct").get<double>();
  r.ident_solved = j.at("passkey_ident").at(0).get<int>();
  r.ident_total = j.at("passkey_ident").at(1).get<int>();
  r.assert_solved = j.at("passkey_assert").at(0).get<int>();
  r.assert_total = j.at("passkey_assert").at(1).get<int>();
  r.select_ms = j.at("select_ms").get<double>();
  r.prefill_ms = j.at("prefill_ms").get<double>();
  r.forward_ms = j.value("forward_ms", 0.0);  // files written before 2026-12-07: none
  r.kept_mean = j.at("kept_per_head").at("mean").get<double>();
  r.kept_min = j.at("kept_per_head").at("min").get<long>();
  r.kept_max = j.at("kept_per_head").at("max").get<long>();
  r.kept_by_head = j.value("kept_by_layer_head", std::vector<double>());  // files written before 2026-12-07: none
  return r;
}

inline void write_json(const std::string& path, const std::vector<Record>& records) {
  nlohmann::json out = nlohmann::json::array();
  for (const Record& r : records) out.push_back(to_json(r));
  std::ofstream file(path);
  if (!file) throw std::runtime_error(path + ": cannot open for writing");
  file << out.dump(1) << "\n";
}

inline std::vector<Record> read_json(const std::string& path) {
  std::ifstream file(path);
  if (!file) throw std::runtime_error(path + ": cannot open for reading");
  try {
    const nlohmann::json j = nlohmann::json::parse(file);
    if (!j.is_array()) throw std::runtime_error(path + ": expected a JSON array of records");
    std::vector<Record> out;
    for (const auto& item : j) out.push_back(from_json(item));
    return out;
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(path + ": not a kvevict-demo --json file (" + e.what() + ")");
  }
}

inline std::string percent(double keep) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g%%", keep * 100.0);
  return buf;
}

inline void print_table(std::FILE* out, const std::vector<Record>& records) {
  if (!records.empty() && records.front().mode != Mode::oneshot)
    std::fprintf(out, "mode %s: select ms is the policy's time over the whole stream (all evictions, all layers)\n",
                 describe_mode(records.front().mode, records.front().chunk).c_str());
  if (!records.empty() && (records.front().share != kvevict::Sharing::per_head || records.front().block > 1 ||
                           records.front().renumber || records.front().pages > 0))
    std::fprintf(out, "layout: %s\n",
                 describe_layout(records.front().share, records.front().block, records.front().reduce,
                                 records.front().renumber, records.front().pages)
                     .c_str());
  int name_width = 17;  // the longest policy name (ablations and compositions run longer), columns aligned
  for (const Record& r : records) name_width = std::max(name_width, static_cast<int>(r.label().size()));
  // The time beside the policy's: the shared prefill (oneshot), or each configuration's forward passes (streaming).
  const bool streaming = !records.empty() && records.front().mode != Mode::oneshot;
  std::fprintf(out, "%-*s %5s %6s %8s %8s %8s %8s %9s %10s %7s  %s\n", name_width, "policy", "keep", "n_kept", "loss",
               "vs full", "ident", "assert", "select ms", streaming ? "forward ms" : "prefill ms",
               streaming ? "sel/fw" : "sel/pf", "kept/head mean [min, max]");
  for (const Record& r : records) {
    if (!r.refused.empty()) {
      std::fprintf(out, "%-*s %5s %6ld  refused by the engine's adapter: %s\n", name_width, r.label().c_str(),
                   percent(r.keep).c_str(), r.n_kept, r.refused.c_str());
      continue;
    }
    char ident[32], asrt[32], vs[32], kept[64];
    std::snprintf(ident, sizeof ident, "%d/%d", r.ident_solved, r.ident_total);
    std::snprintf(asrt, sizeof asrt, "%d/%d", r.assert_solved, r.assert_total);
    std::snprintf(vs, sizeof vs, "%+.2f%%", r.loss_increase_pct);
    std::snprintf(kept, sizeof kept, "%.1f [%ld, %ld]", r.kept_mean, r.kept_min, r.kept_max);
    char prefill[32] = "-", share[32] = "-";  // "-": no time recorded (streaming files written before forward_ms)
    const double other_ms = streaming ? r.forward_ms : r.prefill_ms;
    if (other_ms > 0) {
      std::snprintf(prefill, sizeof prefill, "%.1f", other_ms);
      std::snprintf(share, sizeof share, "%.2f%%", r.select_ms / other_ms * 100.0);
    }
    std::fprintf(out, "%-*s %5s %6ld %8.4f %8s %8s %8s %9.2f %10s %7s  %s\n", name_width, r.label().c_str(),
                 percent(r.keep).c_str(), r.n_kept, r.loss, vs, ident, asrt, r.select_ms, prefill, share, kept);
  }
}

/// Two panels: continuation-loss increase and passkey accuracy (both kinds), against the keep ratio, one line per
/// policy; the full cache is a dashed line in the passkey panel.
inline void write_chart(const std::string& path, const std::vector<Record>& records) {
  Panel loss{
      "continuation loss vs the full cache", "keep (share of the context cached)", "loss increase (%)", {}, {}, "%"};
  Panel keys{"passkey retrieval", "keep (share of the context cached)", "solved (%, ident + assert)", {}, {}, "%"};
  const Record* full = nullptr;
  std::vector<std::string> names;
  for (const Record& r : records) {
    if (r.full())
      full = &r;
    else if (r.refused.empty() && std::find(names.begin(), names.end(), r.label()) == names.end())
      names.push_back(r.label());
  }
  std::vector<double> all_x;
  for (const std::string& name : names) {
    std::vector<const Record*> rs;
    for (const Record& r : records)
      if (r.refused.empty() && r.label() == name) rs.push_back(&r);
    std::sort(rs.begin(), rs.end(), [](const Record* a, const Record* b) { return a->keep < b->keep; });
    Series l{name, {}, {}}, k{name, {}, {}};
    for (const Record* r : rs) {
      const double x = r->keep * 100.0;
      all_x.push_back(x);
      l.x.push_back(x), l.y.push_back(r->loss_increase_pct);
      const int total = r->ident_total + r->assert_total;
      if (total > 0) k.x.push_back(x), k.y.push_back(100.0 * (r->ident_solved + r->assert_solved) / total);
    }
    loss.series.push_back(l);
    if (!k.x.empty()) keys.series.push_back(k);
  }
  std::sort(all_x.begin(), all_x.end());
  all_x.erase(std::unique(all_x.begin(), all_x.end()), all_x.end());
  loss.x_ticks = keys.x_ticks = all_x;
  if (full && !all_x.empty() && full->ident_total + full->assert_total > 0) {
    const double y = 100.0 * (full->ident_solved + full->assert_solved) / (full->ident_total + full->assert_total);
    keys.series.insert(keys.series.begin(), Series{"full", {all_x.front(), all_x.back()}, {y, y}, true});
  }
  std::ofstream file(path);
  if (!file) throw std::runtime_error(path + ": cannot open for writing");
  write_svg(file, {loss, keys});
}

/// The smoke checks of `--check`: every number finite, and the full cache's per-doc losses equal to the
/// reference `after_prefix` losses of eval/full_cache_nll.json (within `tolerance`). Returns the failures.
inline std::vector<std::string> check_records(const std::vector<Record>& records, const nlohmann::json& reference,
                                              double tolerance = 1e-3) {
  std::vector<std::string> failures;
  const auto fail = [&](const Record& r, const std::string& what) {
    failures.push_back(r.label() + " at " + percent(r.keep) + ": " + what);
  };
  bool have_full = false;
  for (const Record& r : records) {
    if (!r.refused.empty()) continue;  // an engine's adapter refused it: no numbers to check
    for (double v : {r.loss, r.loss_increase_pct, r.select_ms, r.prefill_ms, r.forward_ms, r.kept_mean})
      if (!std::isfinite(v)) fail(r, "a non-finite number in the record");
    for (double v : r.doc_losses)
      if (!std::isfinite(v)) fail(r, "a non-finite doc loss");
    if (static_cast<long>(r.doc_losses.size()) != r.docs) fail(r, "doc_losses has the wrong length");
    if (r.docs > 0 && !r.kept_by_head.empty()) {  // the rows per (layer, KV head) average to kept/head's mean
      double sum = 0;
      for (double v : r.kept_by_head) sum += v;
      const auto n = static_cast<double>(r.kept_by_head.size());
      if (!(std::abs(sum / n - r.kept_mean) <= 1e-6 * std::max(1.0, r.kept_mean)))
        fail(r, "kept_by_layer_head does not average to kept_per_head's mean");
    }
    if (!r.full()) continue;
    have_full = true;
    const auto& docs = reference.at("docs");
    for (std::size_t d = 0; d < r.doc_losses.size(); ++d) {
      const double want = docs.at(d).at("after_prefix").get<double>();
      if (!(std::abs(r.doc_losses[d] - want) <= tolerance)) {
        char buf[160];
        std::snprintf(buf, sizeof buf, "doc %zu loss %.6f drifted from the reference %.6f (tolerance %g)", d,
                      r.doc_losses[d], want, tolerance);
        fail(r, buf);
      }
    }
  }
  if (!have_full) failures.push_back("--check needs the full cache among the policies");
  // The page pool (vllm-pages) reads and evicts through the block table what the slabs hold by the same layout
  // (vllm): every loss and passkey must be the same, bit for bit.
  for (const Record& paged : records) {
    if (paged.engine != "vllm-pages") continue;
    for (const Record& slab : records)
      if (slab.engine == "vllm" && slab.policy == paged.policy && slab.keep == paged.keep &&
          (slab.doc_losses != paged.doc_losses || slab.refused != paged.refused ||
           slab.ident_solved != paged.ident_solved || slab.assert_solved != paged.assert_solved))
        fail(paged, "the page pool's results differ from the slabs' of the same layout (vllm)");
  }
  return failures;
}

}  // namespace demo
