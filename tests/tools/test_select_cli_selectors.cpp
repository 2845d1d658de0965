// kvevict-select with the value-aware policies (criticalkv, criticalkv-snapkv, defensivekv, layer-defensivekv,
// adakv-defensive, --base layer --selector critical): --precision f64 against the float64 reference index for index
// in both quirk modes and every budget form, the selector flags, and bad input.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <sys/wait.h>

#include "cli_run.hpp"
#include "safetensors.hpp"
#include "support/selector_inputs.hpp"

namespace test_select_cli_selectors {  // this file's scope in unity builds (tests/CMakeLists.txt)

namespace fs = std::filesystem;
namespace st = safetensors;
using kvevict_test::DefBase;
using kvevict_test::Forced;
using kvevict_test::Kept;
using kvevict_test::SelKnobs;
using kvevict_test::Shape;
using kvevict_test::sz;

namespace {

using kvevict_cli_test::Run;
using kvevict_cli_test::run_cli;
using kvevict_cli_test::scratch;

struct Layer {
  kvevict_test::VLayer l;
  std::vector<double> attn;
};

std::vector<Layer> random_model(const Shape& s, int D, int NL, kvevict_test::Rng& rng) {
  std::vector<Layer> out;
  for (int i = 0; i < NL; ++i) {
    Layer x{kvevict_test::random_vlayer(s, D, rng, i % 2 ? 2.5 : 1.5), {}};
    x.attn = kvevict_test::ref_attention(x.l);
    out.push_back(std::move(x));
  }
  return out;
}

struct Contents {
  bool attention_rows = false;
  bool values = true;
  bool w_o = true;
  st::dtype type = st::dtype::F64;
};

void write_model(const fs::path& path, const std::vector<Layer>& layers, const Contents& c) {
  std::vector<st::tensor_out> t;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const kvevict_test::VLayer& x = layers[i].l;
    const Shape& s = x.s;
    const std::string p = "layers." + std::to_string(i) + ".";
    if (c.attention_rows)
      t.push_back(st::make_tensor(p + "window_attention", {s.H, s.w, s.L}, layers[i].attn, c.type));
    else
      t.push_back(st::make_tensor(p + "q_window", {s.H, s.w, s.d}, x.q, c.type));
    t.push_back(st::make_tensor(p + "keys", {s.Hkv, s.L, s.d}, x.k, c.type));
    if (c.values) t.push_back(st::make_tensor(p + "values", {s.Hkv, s.L, s.d}, x.v, c.type));
    if (c.w_o) t.push_back(st::make_tensor(p + "w_o", {x.D, s.H * s.d}, x.w_o, c.type));
  }
  st::write(path.string(), t);
}

Kept read_kept(const fs::path& path, std::size_t layer) {
  const st::file f = st::file::open(path.string());
  const std::string p = "layers." + std::to_string(layer) + ".";
  const auto idx = f.read_i64(f.at(p + "kept_indices"));
  const auto off = f.read_i64(f.at(p + "kept_offsets"));
  Kept kept(off.size() - 1);
  for (std::size_t h = 0; h + 1 < off.size(); ++h) kept[h].assign(idx.begin() + off[h], idx.begin() + off[h + 1]);
  return kept;
}

// A budget flag with the n_kept and compression ratio it means for L tokens.
struct BudgetFlag {
  std::string text;
  std::int64_t n_kept;
  double cr;  // NaN unless --compression-ratio
};

std::vector<BudgetFlag> budget_flags(const Shape& s, std::int64_t tokens, double keep, double cr) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  return {
      {"--budget " + std::to_string(tokens), tokens, nan},
      {"--keep " + std::to_string(keep), kvevict_ref::n_kept_from_keep_ratio(s.L, std::stod(std::to_string(keep))),
       nan},
      {"--compression-ratio " + std::to_string(cr),
       kvevict_ref::n_kept_from_compression_ratio(s.L, std::stod(std::to_string(cr))), std::stod(std::to_string(cr))}};
}

// What the CLI must write for each layer, from the reference.
enum class Cli { criticalkv, criticalkv_snapkv, defensivekv, layer_defensivekv, adakv_defensive, layer_critical };

const char* policy_args(Cli p) {
  switch (p) {
    case Cli::criticalkv:
      return "--policy criticalkv";
    case Cli::criticalkv_snapkv:
      return "--policy criticalkv-snapkv";
    case Cli::defensivekv:
      return "--policy defensivekv";
    case Cli::layer_defensivekv:
      return "--policy layer-defensivekv";
    case Cli::adakv_defensive:
      return "--policy adakv-defensive";
    case Cli::layer_critical:
      return "--base layer --selector critical";
  }
  return "";
}

bool uses_mass(Cli p) { return p == Cli::defensivekv || p == Cli::layer_defensivekv; }

// nullopt-like: empty vector when the case is a mass near-tie (skipped and counted by the caller).
std::vector<Kept> expected(Cli p, const std::vector<Layer>& layers, SelKnobs k, std::int64_t n_kept, double cr,
                           bool& near_tie) {
  const Shape& s = layers[0].l.s;
  if (p == Cli::defensivekv) k.alpha = 0.0;
  if (p == Cli::adakv_defensive) {
    k.value_term = false;
    k.mass_forcing = false;
  }
  near_tie = false;
  std::vector<kvevict_test::RefLayer> refs;
  for (const Layer& x : layers) {
    refs.push_back(kvevict_test::ref_layer(x.l, x.attn, k));
    if (uses_mass(p) && kvevict_test::mass_margin(x.attn, s, k.threshold, k.quirks) < 1e-9) near_tie = true;
  }
  const double qcr = k.quirks ? cr : 0.0;
  std::vector<Kept> out;
  if (p == Cli::layer_defensivekv || p == Cli::layer_critical) {
    std::vector<std::vector<double>> scores;
    std::vector<Forced> forced;
    for (const auto& r : refs) {
      scores.push_back(p == Cli::layer_critical ? r.s : r.sprime);
      if (p == Cli::layer_defensivekv) forced.push_back(kvevict_test::ref_forced(r, s, k, n_kept, cr));
    }
    const std::vector<Kept> global =
        kvevict_ref::layer_defensivekv(scores, forced, s.Hkv, s.w, s.L, n_kept, k.quirks, qcr);
    if (p == Cli::layer_defensivekv) return global;
    const auto lengths = kvevict_test::lengths_of(global);
    for (std::size_t l = 0; l < refs.size(); ++l)
      out.push_back(kvevict_test::critical_stages(refs[l].s, refs[l].n, s, lengths[l], k));
    return out;
  }
  for (const auto& r : refs) {
    if (p == Cli::criticalkv || p == Cli::criticalkv_snapkv) {
      out.push_back(kvevict_test::expect_critical(r, s, n_kept, p == Cli::criticalkv, k));
    } else {
      const Forced f = kvevict_test::ref_forced(r, s, k, n_kept, cr);
      out.push_back(kvevict_test::expect_defensive(r, f, s, n_kept,
                                                   p == Cli::defensivekv ? DefBase::flat : DefBase::adaptive, k, qcr));
    }
  }
  return out;
}

std::string io(const fs::path& in, const fs::path& out) { return " \"" + in.string() + "\" \"" + out.string() + "\""; }

struct Tally {
  int runs = 0, skipped = 0;
};

// Runs one command and compares every layer with the reference (or, for quirks without a compression ratio in the
// defensive family, expects the one-line error).
void check_run(Cli p, const std::vector<Layer>& layers, const SelKnobs& k, const BudgetFlag& b,
               const std::string& flags, const fs::path& in, Tally& tally) {
  const fs::path out = scratch() / "out.safetensors";
  fs::remove(out);
  const std::string args = std::string(policy_args(p)) + " " + b.text + " --precision f64" +
                           (k.quirks ? " --reference-quirks" : "") + flags + io(in, out);
  const Run r = run_cli(args);
  CAPTURE(args, r.err);
  ++tally.runs;
  const bool defensive_family = p != Cli::criticalkv && p != Cli::criticalkv_snapkv;
  if (k.quirks && defensive_family && std::isnan(b.cr)) {
    CHECK(r.status == 1);
    CHECK(r.err.rfind("kvevict-select: ", 0) == 0);
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
    CHECK(r.err.find("reference_quirks needs the budget as a compression ratio") != std::string::npos);
    return;
  }
  REQUIRE(r.status == 0);
  REQUIRE(r.err.empty());
  bool near_tie = false;
  const std::vector<Kept> want = expected(p, layers, k, b.n_kept, b.cr, near_tie);
  if (near_tie) {
    ++tally.skipped;
    return;
  }
  for (std::size_t l = 0; l < layers.size(); ++l) {
    INFO("layer " << l);
    CHECK(kvevict_test::first_difference(read_kept(out, l), want[l]) == "");
  }
}

}  // namespace

TEST_CASE("kvevict-select value-aware policies --precision f64 match the reference (both modes, every budget form)",
          "[cli][selectors]") {
  kvevict_test::Rng rng(20261201);
  struct Case {
    Shape s;
    int D;
    int NL;
    bool rows;
  };
  const Case cases[] = {{{4, 2, 8, 70, 16}, 16, 2, false}, {{8, 8, 4, 45, 16}, 12, 3, true}};
  Tally tally;
  for (const Case& c : cases) {
    const std::vector<Layer> layers = random_model(c.s, c.D, c.NL, rng);
    const fs::path in = scratch() / "model.safetensors";
    Contents contents;
    contents.attention_rows = c.rows;
    write_model(in, layers, contents);
    for (const BudgetFlag& b : budget_flags(c.s, c.s.w + 5, 0.35, 0.7))
      for (bool quirks : {false, true})
        for (Cli p : {Cli::criticalkv, Cli::criticalkv_snapkv, Cli::defensivekv, Cli::layer_defensivekv,
                      Cli::adakv_defensive, Cli::layer_critical}) {
          if (quirks && p == Cli::layer_critical && std::isnan(b.cr)) continue;  // (its error is tested below)
          SelKnobs k;
          k.quirks = quirks;
          check_run(p, layers, k, b, " --pool avg --kernel 5", in, tally);
        }
  }
  INFO("runs " << tally.runs << ", skipped as mass near-ties " << tally.skipped);
  CHECK(tally.skipped * 20 <= tally.runs);
}

TEST_CASE(
    "kvevict-select selector flags: --value-norm l2, --no-floor, --no-value-term, --mass-threshold, --eps, "
    "--first-stage-ratio, --pool/--kernel, --alpha",
    "[cli][selectors]") {
  kvevict_test::Rng rng(20261202);
  const Shape s{4, 2, 8, 90, 16};
  const std::vector<Layer> layers = random_model(s, 20, 2, rng);
  const fs::path in = scratch() / "flags.safetensors";
  write_model(in, layers, Contents{});
  Tally tally;
  const std::vector<BudgetFlag> budgets = budget_flags(s, 20, 0.3, 0.75);
  struct FlagCase {
    std::string flags;
    SelKnobs knobs;
    std::vector<Cli> policies;  // the policies the flag means something to
  };
  const std::vector<Cli> critical = {Cli::criticalkv, Cli::criticalkv_snapkv, Cli::layer_critical};
  const std::vector<Cli> defensive = {Cli::defensivekv, Cli::layer_defensivekv, Cli::adakv_defensive};
  const std::vector<Cli> value_aware = {Cli::criticalkv, Cli::criticalkv_snapkv, Cli::layer_critical, Cli::defensivekv,
                                        Cli::layer_defensivekv};
  const std::vector<Cli> all = {Cli::criticalkv,        Cli::criticalkv_snapkv, Cli::defensivekv,
                                Cli::layer_defensivekv, Cli::adakv_defensive,   Cli::layer_critical};
  std::vector<FlagCase> flag_cases;
  auto add = [&](const std::string& f, const std::vector<Cli>& policies, auto edit) {
    SelKnobs k;
    edit(k);
    flag_cases.push_back({f, k, policies});
  };
  add(" --value-norm l2", value_aware, [](SelKnobs& k) { k.norm = kvevict::ValueNorm::l2; });
  add(" --no-floor", defensive, [](SelKnobs& k) { k.floor = false; });
  add(" --no-value-term", {Cli::defensivekv, Cli::layer_defensivekv}, [](SelKnobs& k) { k.value_term = false; });
  add(" --mass-threshold 0.6", {Cli::defensivekv, Cli::layer_defensivekv}, [](SelKnobs& k) { k.threshold = 0.6; });
  add(" --eps 0.01", critical, [](SelKnobs& k) { k.eps = 0.01; });
  add(" --first-stage-ratio 0.25", critical, [](SelKnobs& k) { k.ratio = 0.25; });
  add(" --pool max --kernel 7 --no-floor --value-norm l2", all, [](SelKnobs& k) {
    k.pooling = kvevict::Pooling::max;
    k.kernel = 7;
    k.floor = false;
    k.norm = kvevict::ValueNorm::l2;
  });
  add(" --kernel 1 --eps 0 --first-stage-ratio 1 --alpha 0.5",
      {Cli::criticalkv, Cli::adakv_defensive, Cli::defensivekv}, [](SelKnobs& k) {
        k.kernel = 1;
        k.eps = 0.0;
        k.ratio = 1.0;
        k.alpha = 0.5;
      });
  int i = 0;
  for (const FlagCase& fc : flag_cases)
    for (bool quirks : {false, true})
      for (Cli p : fc.policies) {
        SelKnobs k = fc.knobs;
        k.quirks = quirks;
        check_run(p, layers, k, budgets[quirks ? 2 : sz(i++) % 2], fc.flags, in, tally);
      }
  INFO("runs " << tally.runs << ", skipped as mass near-ties " << tally.skipped);
  CHECK(tally.skipped * 20 <= tally.runs);
}

TEST_CASE("kvevict-select value-aware policies reject bad input with one clear line", "[cli][selectors][errors]") {
  kvevict_test::Rng rng(20261203);
  const Shape s{4, 2, 8, 40, 8};
  const std::vector<Layer> layers = random_model(s, 6, 2, rng);
  const fs::path bad = scratch() / "bad.safetensors", out = scratch() / "bad_out.safetensors";
  auto expect_failure = [&](const std::string& args, int status, const std::string& needle) {
    const Run r = run_cli(args);
    CAPTURE(args, r.err);
    CHECK(r.status == status);
    CHECK(r.err.rfind("kvevict-select:", 0) == 0);
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
    CHECK(r.err.find(needle) != std::string::npos);
  };
  SECTION("missing w_o") {
    Contents c;
    c.w_o = false;
    write_model(bad, layers, c);
    for (const char* p : {"criticalkv", "criticalkv-snapkv", "defensivekv", "layer-defensivekv"})
      expect_failure(std::string("--policy ") + p + " --budget 12" + io(bad, out), 1,
                     "layers.0.w_o [hidden, heads * head_dim] is missing; the " + std::string(p) + " policy needs it");
    expect_failure("--base layer --selector critical --budget 12" + io(bad, out), 1, "layers.0.w_o");
    expect_failure("--base snapkv --selector defensive --budget 12" + io(bad, out), 1, "layers.0.w_o");
    // The ablation reads neither values nor W_o.
    CHECK(run_cli("--policy adakv-defensive --budget 12" + io(bad, out)).status == 0);
  }
  SECTION("missing w_o in a later layer only") {
    std::vector<st::tensor_out> t;
    for (std::size_t i = 0; i < 2; ++i) {
      const auto& x = layers[i].l;
      const std::string p = "layers." + std::to_string(i) + ".";
      t.push_back(st::make_tensor(p + "q_window", {4, 8, 8}, x.q, st::dtype::F32));
      t.push_back(st::make_tensor(p + "keys", {2, 40, 8}, x.k, st::dtype::F32));
      t.push_back(st::make_tensor(p + "values", {2, 40, 8}, x.v, st::dtype::F32));
      if (i == 0) t.push_back(st::make_tensor(p + "w_o", {6, 32}, x.w_o, st::dtype::F32));
    }
    st::write(bad.string(), t);
    expect_failure("--policy layer-defensivekv --budget 12" + io(bad, out), 1, "layers.1.w_o");
  }
  SECTION("missing values") {
    Contents c;
    c.values = false;
    write_model(bad, layers, c);
    expect_failure("--policy criticalkv --budget 12" + io(bad, out), 1,
                   "layers.0.values [kv_heads, tokens, head_dim] is missing; the criticalkv policy needs it");
    expect_failure("--policy defensivekv --compression-ratio 0.5 --reference-quirks" + io(bad, out), 1,
                   "layers.0.values");
  }
  SECTION("w_o with the wrong number of columns") {
    std::vector<st::tensor_out> t;
    const auto& x = layers[0].l;
    t.push_back(st::make_tensor("layers.0.q_window", {4, 8, 8}, x.q, st::dtype::F32));
    t.push_back(st::make_tensor("layers.0.keys", {2, 40, 8}, x.k, st::dtype::F32));
    t.push_back(st::make_tensor("layers.0.values", {2, 40, 8}, x.v, st::dtype::F32));
    t.push_back(st::make_tensor("layers.0.w_o", {8, 24}, std::vector<double>(x.w_o.begin(), x.w_o.begin() + 192),
                                st::dtype::F32));
    st::write(bad.string(), t);
    expect_failure("--policy defensivekv --budget 12" + io(bad, out), 1,
                   "layers.0.w_o has shape [8, 24]; expected [hidden, 32] (heads * head_dim)");
    t.back() =
        st::make_tensor("layers.0.w_o", {192}, std::vector<double>(x.w_o.begin(), x.w_o.begin() + 192), st::dtype::F32);
    st::write(bad.string(), t);
    expect_failure("--policy criticalkv --budget 12" + io(bad, out), 1, "layers.0.w_o has rank 1");
  }
  SECTION("engine scores missing, of the wrong shape, or not finite") {
    std::vector<st::tensor_out> t;
    const auto& x = layers[0].l;
    t.push_back(st::make_tensor("layers.0.keys", {2, 40, 8}, x.k, st::dtype::F32));
    t.push_back(st::make_tensor("layers.0.values", {2, 40, 8}, x.v, st::dtype::F32));
    st::write(bad.string(), t);
    for (const char* p : {"engine-scores", "layer-engine-scores"})
      expect_failure(std::string("--policy ") + p + " --budget 12" + io(bad, out), 1,
                     "layers.0.scores [kv_heads, tokens] is missing; the " + std::string(p) + " policy ranks");
    expect_failure("--base adakv --selector engine --budget 12" + io(bad, out), 1, "layers.0.scores");
    std::vector<double> scores(80, 0.5);
    t.push_back(st::make_tensor("layers.0.scores", {40, 2}, scores, st::dtype::F32));
    st::write(bad.string(), t);
    expect_failure("--policy engine-scores --budget 12" + io(bad, out), 1,
                   "layers.0.scores has shape [40, 2]; expected [2, 40]");
    scores[3] = std::numeric_limits<double>::quiet_NaN();
    t.back() = st::make_tensor("layers.0.scores", {2, 40}, scores, st::dtype::F32);
    st::write(bad.string(), t);
    expect_failure("--policy engine-scores --budget 12" + io(bad, out), 1, "scores[0, 3] is not finite");
    scores[3] = 0.25;
    t.back() = st::make_tensor("layers.0.scores", {2, 40}, scores, st::dtype::F32);
    st::write(bad.string(), t);
    CHECK(run_cli("--policy engine-scores --budget 12" + io(bad, out)).status == 0);  // no queries needed
  }
  SECTION("NaN in values") {
    std::vector<Layer> poisoned = layers;
    poisoned[1].l.v[17] = std::numeric_limits<double>::quiet_NaN();
    write_model(bad, poisoned, Contents{});
    expect_failure("--policy defensivekv --budget 12" + io(bad, out), 1,
                   "kvevict::DefensiveKV::select (layer 1): values[");
    expect_failure("--policy criticalkv --budget 12 --precision f64" + io(bad, out), 1, "is not finite");
    expect_failure("--policy layer-defensivekv --budget 12" + io(bad, out), 1,
                   "kvevict::LayerDefensiveKV::add (layer 1): values[");
  }
  SECTION("reference quirks without a compression ratio") {
    write_model(bad, layers, Contents{});
    for (const char* p : {"defensivekv", "layer-defensivekv", "adakv-defensive"})
      for (const char* b : {"--budget 12", "--keep 0.3"})
        expect_failure(std::string("--policy ") + p + " " + b + " --reference-quirks" + io(bad, out), 1,
                       "reference_quirks needs the budget as a compression ratio");
    expect_failure("--base layer --selector critical --budget 12 --reference-quirks" + io(bad, out), 1,
                   "reference_quirks needs the budget as a compression ratio");
    // CriticalKV's quirk does not use the compression ratio.
    CHECK(run_cli("--policy criticalkv --budget 12 --reference-quirks" + io(bad, out)).status == 0);
  }
  SECTION("bad selector flags") {
    write_model(bad, layers, Contents{});
    expect_failure("--policy criticalkv --budget 12 --eps -1" + io(bad, out), 2, "--eps must be >= 0, got -1");
    expect_failure("--policy criticalkv --budget 12 --eps nan" + io(bad, out), 2, "--eps expects a finite number");
    expect_failure("--policy criticalkv --budget 12 --first-stage-ratio 1.5" + io(bad, out), 2,
                   "--first-stage-ratio must be in [0, 1], got 1.5");
    expect_failure("--policy criticalkv --budget 12 --first-stage-ratio -0.1" + io(bad, out), 2, "--first-stage-ratio");
    expect_failure("--policy defensivekv --budget 12 --mass-threshold 1.5" + io(bad, out), 2,
                   "--mass-threshold must be in [0, 1], got 1.5");
    expect_failure("--policy defensivekv --budget 12 --mass-threshold x" + io(bad, out), 2,
                   "--mass-threshold expects a finite number, got 'x'");
    expect_failure("--policy defensivekv --budget 12 --value-norm l3" + io(bad, out), 2,
                   "--value-norm must be l1 or l2, got 'l3'");
    expect_failure("--policy defensivekv --budget 12 --value-norm" + io(bad, out), 2, "--value-norm must be l1 or l2");
  }
  SECTION("bad Expected Attention flags") {
    write_model(bad, layers, Contents{});
    const std::string ea = "--policy expected-attention --budget 12 ";
    expect_failure(ea + "--rope-theta 0" + io(bad, out), 2, "--rope-theta must be > 0, got 0");
    expect_failure(ea + "--rope-theta inf" + io(bad, out), 2, "--rope-theta expects a finite number");
    expect_failure(ea + "--rotary-dim 3" + io(bad, out), 2, "--rotary-dim must be even and >= 0, got 3");
    expect_failure(ea + "--rotary-dim -2" + io(bad, out), 2, "--rotary-dim must be even and >= 0, got -2");
    expect_failure(ea + "--rope-layout gptj" + io(bad, out), 2,
                   "--rope-layout must be half or interleaved, got 'gptj'");
    expect_failure(ea + "--future-positions 0" + io(bad, out), 2, "--future-positions must be >= 1, got 0");
    expect_failure(ea + "--sinks -1" + io(bad, out), 2, "--sinks must be >= 0, got -1");
    // The same flags in range select.
    CHECK(run_cli(ea + "--rope-theta 500000 --rope-layout interleaved --future-positions 64 --no-covariance" +
                  io(bad, out))
              .status == 0);
  }
  SECTION("bad H2O flags") {
    write_model(bad, layers, Contents{});
    const std::string h2o = "--policy h2o --budget 12 ";
    expect_failure(h2o + "--recent-share 1.5" + io(bad, out), 2, "--recent-share must be in [0, 1], got 1.5");
    expect_failure(h2o + "--recent-share -0.1" + io(bad, out), 2, "--recent-share must be in [0, 1], got -0.1");
    expect_failure(h2o + "--recent-share half" + io(bad, out), 2, "--recent-share");
    CHECK(run_cli(h2o + "--recent-share 0.25" + io(bad, out)).status == 0);
    CHECK(run_cli("--base layer --selector h2o --budget 12 --recent-share 1" + io(bad, out)).status == 0);
  }
}

}  // namespace test_select_cli_selectors
