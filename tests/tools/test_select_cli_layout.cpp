// kvevict-select's layout options (docs/algorithms.md#layouts): --share head|layer|model, --reduce max|mean and
// --block B, recorded in the output's metadata, and layers.{i}.kept_blocks / kept_block_offsets in block mode. The
// CLI must select exactly what the library's select_layers selects on the same LayerInputs built here in C++, for
// every catalogue policy, sharing, reduction and block size; bad values are usage errors, and the library's refusals
// (a block over n_kept, sharing heads that hold different entries, quirks with a layout) come through as its
// message with exit status 1.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <sys/wait.h>

#include "cli_run.hpp"
#include "safetensors.hpp"
#include "support/ragged_inputs.hpp"

namespace test_select_cli_layout {  // this file's scope in unity builds (tests/CMakeLists.txt)

namespace fs = std::filesystem;
namespace st = safetensors;
using kvevict::Index;
using kvevict_test::Ragged;

namespace {

using kvevict_cli_test::Run;
using kvevict_cli_test::run_cli;
using kvevict_cli_test::scratch;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

std::size_t sz(Index i) { return static_cast<std::size_t>(i); }

/// One layer of the file: its entries and the rows each head is padded to (>= the longest head).
struct FileLayer {
  Ragged r;
  Index capacity;
};

/// The tensors of one layer: q_window, keys/values [Hkv, capacity, d] with NaN padding, w_o, the engine's scores
/// [Hkv, capacity], lengths [Hkv] and positions [Hkv, capacity] (-7 padding; kvevict_test::store).
std::vector<st::tensor_out> layer_tensors(std::size_t i, const FileLayer& x) {
  const kvevict_test::RaggedStored<double> s = kvevict_test::store<double>(x.r, x.capacity, false, kNaN);
  const Ragged& r = x.r;
  const std::string p = "layers." + std::to_string(i) + ".";
  return {st::make_tensor(p + "q_window", {r.H, r.w, r.d}, s.q, st::dtype::F32),
          st::make_tensor(p + "keys", {r.Hkv, x.capacity, r.d}, s.k, st::dtype::F32),
          st::make_tensor(p + "values", {r.Hkv, x.capacity, r.d}, s.v, st::dtype::F32),
          st::make_tensor(p + "w_o", {r.D, r.H * r.d}, s.w_o, st::dtype::F32),
          st::make_tensor(p + "scores", {r.Hkv, x.capacity}, s.scores, st::dtype::F32),
          st::make_tensor_i64(p + "lengths", {r.Hkv}, s.lengths),
          st::make_tensor_i64(p + "positions", {r.Hkv, x.capacity}, s.positions)};
}

void write_model(const fs::path& path, const std::vector<FileLayer>& layers) {
  std::vector<st::tensor_out> t;
  for (std::size_t i = 0; i < layers.size(); ++i)
    for (st::tensor_out& x : layer_tensors(i, layers[i])) t.push_back(std::move(x));
  st::write(path.string(), t);
}

/// A random model of `n_layers` layers (H 4, Hkv 2, w 4) whose KV heads, in every layer, hold the same entries at the
/// same positions (with gaps), as an engine sharing its storage has (what --share layer and model need); each
/// (layer, head) has its own keys and values. Layer 1 is padded 3 rows beyond its entries.
std::vector<FileLayer> shared_model(std::uint64_t seed, int n_layers) {
  kvevict_test::Rng rng(seed);
  const int H = 4, Hkv = 2, w = 4, d = 8, T = 48;
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<std::int64_t> pos;
  for (int t = 0; t < T - w; ++t)
    if (u(rng) < 0.6) pos.push_back(t);
  for (int t = T - w; t < T; ++t) pos.push_back(t);
  const auto L = static_cast<Index>(pos.size());
  std::vector<FileLayer> layers;
  for (int l = 0; l < n_layers; ++l) {
    Ragged r;
    r.H = H;
    r.Hkv = Hkv;
    r.w = w;
    r.d = d;
    r.D = 8;
    for (int h = 0; h < Hkv; ++h)
      r.heads.push_back(
          {kvevict_test::normal_vector(sz(L * d), rng), kvevict_test::normal_vector(sz(L * d), rng), pos});
    r.q = kvevict_test::normal_vector(static_cast<std::size_t>(H * w * d), rng, 1.5);
    r.w_o = kvevict_test::normal_vector(static_cast<std::size_t>(r.D * H * d), rng, 0.5);
    layers.push_back({r, L + (l == 1 ? 3 : 0)});
  }
  return layers;
}

/// Two ragged layers (KV heads of different lengths, positions with gaps): only --share head applies.
std::vector<FileLayer> ragged_model(std::uint64_t seed) {
  kvevict_test::Rng rng(seed);
  std::vector<FileLayer> layers;
  for (int l = 0; l < 2; ++l) {
    Ragged r;
    do r = kvevict_test::random_ragged(rng, 4, 2, 4, 8, 48, 0.5);
    while (kvevict_test::length(r, 0) == kvevict_test::length(r, 1));
    layers.push_back({r, kvevict_test::longest(r) + (l == 0 ? 0 : 3)});
  }
  return layers;
}

/// One value of each layout option: its command-line text and the knob it sets.
struct Layout {
  std::string share, reduce;
  Index block;
  kvevict::Sharing sharing() const {
    return share == "head"    ? kvevict::Sharing::per_head
           : share == "layer" ? kvevict::Sharing::per_layer
                              : kvevict::Sharing::per_model;
  }
  kvevict::Reduce reduction() const { return reduce == "max" ? kvevict::Reduce::max : kvevict::Reduce::mean; }
  std::string flags() const {
    return " --share " + share + " --reduce " + reduce + " --block " + std::to_string(block);
  }
};

/// What the CLI wrote for one layer (blocks and block_offsets empty when the file has no kept_blocks).
struct Written {
  std::vector<std::int64_t> indices, offsets, positions, blocks, block_offsets;
  bool has_blocks = false;
};

Written read_written(const st::file& f, std::size_t layer) {
  const std::string p = "layers." + std::to_string(layer) + ".";
  Written w{f.read_i64(f.at(p + "kept_indices")),
            f.read_i64(f.at(p + "kept_offsets")),
            f.read_i64(f.at(p + "kept_positions")),
            {},
            {},
            false};
  const st::tensor_info* blocks = f.find(p + "kept_blocks");
  const st::tensor_info* block_offsets = f.find(p + "kept_block_offsets");
  CHECK((blocks == nullptr) == (block_offsets == nullptr));
  if (blocks && block_offsets) {
    CHECK(blocks->type == st::dtype::I64);
    CHECK(blocks->shape.size() == 1);
    CHECK(block_offsets->type == st::dtype::I64);
    CHECK(block_offsets->shape == std::vector<std::int64_t>{static_cast<std::int64_t>(w.offsets.size())});
    w.blocks = f.read_i64(*blocks);
    w.block_offsets = f.read_i64(*block_offsets);
    w.has_blocks = true;
  }
  return w;
}

/// The library's selections on the same LayerInputs, built here from the layers (not from the file).
/// `retrieval[l]`: layer l's LayerInputs::retrieval_heads (empty: none).
std::vector<kvevict::Selection> library_select(const std::string& policy, const std::vector<FileLayer>& layers,
                                               const Layout& layout, const kvevict::Budget& budget,
                                               const std::vector<std::vector<Index>>& retrieval = {}) {
  std::vector<kvevict_test::RaggedStored<float>> stored;
  stored.reserve(layers.size());  // the views point into these buffers
  std::vector<kvevict::LayerInputs<float>> in;
  for (const FileLayer& x : layers) {
    stored.push_back(kvevict_test::store<float>(x.r, x.capacity, false, static_cast<float>(kNaN)));
    in.push_back(stored.back().in);
    if (in.size() <= retrieval.size()) in.back().retrieval_heads = retrieval[in.size() - 1];
  }
  kvevict::Knobs knobs;
  knobs.window = layers.front().r.w;
  knobs.share = layout.sharing();
  knobs.reduce = layout.reduction();
  knobs.block = layout.block;
  std::vector<kvevict::Selection> out;
  const bool found = kvevict::catalogue::visit(policy, [&](const auto& e) {
    kvevict::Knobs k = knobs;  // kvevict-select takes the window from q_window only for a policy that reads it
    if (!std::decay_t<decltype(e)>::policy_type::reads_observation()) k.window.reset();
    out = kvevict::select_layers<float>(e.make(k), in, budget);
  });
  REQUIRE(found);
  return out;
}

/// The kept blocks, expanded to rows (block b: rows [bB, min(bB + B, L_h))), are exactly the kept rows.
void check_blocks_cover_rows(const Written& w, const FileLayer& x, Index B) {
  REQUIRE(w.block_offsets.size() == w.offsets.size());
  for (std::size_t h = 0; h + 1 < w.offsets.size(); ++h) {
    const auto L = static_cast<std::int64_t>(x.r.heads[h].pos.size());
    std::vector<std::int64_t> rows;
    for (auto k = sz(w.block_offsets[h]); k < sz(w.block_offsets[h + 1]); ++k)
      for (std::int64_t j = w.blocks[k] * B; j < std::min<std::int64_t>((w.blocks[k] + 1) * B, L); ++j)
        rows.push_back(j);
    CHECK(rows == std::vector<std::int64_t>(w.indices.begin() + w.offsets[h], w.indices.begin() + w.offsets[h + 1]));
  }
}

std::vector<std::string> policy_names() {
  std::vector<std::string> out;
  kvevict::catalogue::for_each(kvevict::catalogue::entries(), [&](const auto& e) { out.emplace_back(e.name); });
  return out;
}

std::string io(const fs::path& in, const fs::path& out) { return " \"" + in.string() + "\" \"" + out.string() + "\""; }

struct BudgetFlag {
  std::string text;
  kvevict::Budget budget;
};

/// Runs the CLI on `in` (the layers written there) and checks that it wrote, layer by layer, exactly the library's
/// selections, the blocks in block mode, and the layout in the metadata.
void expect_library(const std::string& policy, const BudgetFlag& b, const Layout& layout, const fs::path& in,
                    const std::vector<FileLayer>& layers) {
  const fs::path out = scratch() / "layout_out.safetensors";
  const std::string args = "--policy " + policy + " " + b.text + layout.flags() + io(in, out);
  const Run r = run_cli(args);
  CAPTURE(args, r.err);
  REQUIRE(r.status == 0);
  REQUIRE(r.err.empty());
  const std::vector<kvevict::Selection> expected = library_select(policy, layers, layout, b.budget);
  REQUIRE(expected.size() == layers.size());
  const st::file f = st::file::open(out.string());
  CHECK(f.metadata().at("share") == layout.share);
  CHECK(f.metadata().at("reduce") == layout.reduce);
  CHECK(f.metadata().at("block") == std::to_string(layout.block));
  CHECK(f.metadata().at("policy") == policy);
  // The metadata names the policy's real composition (catalogue::base_of), not a guess from its budget scope.
  static const std::map<std::string, std::string> bases = {
      {"streamingllm", "streamingllm"}, {"snapkv", "snapkv"},       {"adakv", "adakv"},
      {"defensivekv", "defensivekv"},   {"pyramidkv", "pyramidkv"}, {"layer-defensivekv", "layer"},
      {"open-defensivekv", "layer"}};
  if (const auto it = bases.find(policy); it != bases.end()) CHECK(f.metadata().at("base") == it->second);
  CHECK(f.tensors().size() == (layout.block > 1 ? 5 : 3) * layers.size());
  for (std::size_t l = 0; l < layers.size(); ++l) {
    CAPTURE(l);
    const Written w = read_written(f, l);
    CHECK(w.indices == expected[l].indices());
    CHECK(w.offsets == expected[l].offsets());
    CHECK(w.positions == expected[l].positions());
    CHECK(w.has_blocks == (layout.block > 1));
    if (layout.block > 1) {
      CHECK(expected[l].block_size() == layout.block);
      CHECK(w.blocks == expected[l].blocks());
      CHECK(w.block_offsets == expected[l].block_offsets());
      check_blocks_cover_rows(w, layers[l], layout.block);
    }
    // Shared heads keep one common set: every head of a layer the same rows.
    if (layout.share != "head")
      for (std::size_t h = 1; h + 1 < w.offsets.size(); ++h)
        CHECK(std::vector<std::int64_t>(w.indices.begin() + w.offsets[h], w.indices.begin() + w.offsets[h + 1]) ==
              std::vector<std::int64_t>(w.indices.begin() + w.offsets[0], w.indices.begin() + w.offsets[1]));
  }
  // Every layer the same rows as layer 0 under --share model.
  if (layout.share == "model")
    for (std::size_t l = 1; l < layers.size(); ++l) CHECK(read_written(f, l).indices == read_written(f, 0).indices);
}

/// Runs `kvevict-select ARGS` and returns what it wrote on stdout (its exit status must be 0).
std::string stdout_of(const std::string& args) {
  const fs::path out = scratch() / "stdout.txt";
  const std::string cmd = std::string("\"") + KVEVICT_SELECT_PATH + "\" " + args + " >\"" + out.string() + "\"";
  const int raw = std::system(cmd.c_str());
  REQUIRE(WIFEXITED(raw));
  REQUIRE(WEXITSTATUS(raw) == 0);
  std::ifstream in(out);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void expect_failure(const std::string& args, int status, const std::vector<std::string>& needles) {
  const Run r = run_cli(args);
  CAPTURE(args, r.err);
  CHECK(r.status == status);
  CHECK(r.err.rfind("kvevict-select:", 0) == 0);
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  for (const std::string& needle : needles) CHECK(r.err.find(needle) != std::string::npos);
}

}  // namespace

TEST_CASE("kvevict-select --share --reduce --block selects what the library's select_layers selects", "[cli][layout]") {
  for (std::uint64_t seed : {20260701u, 20260702u}) {
    const std::vector<FileLayer> layers = shared_model(seed, seed % 2 == 1 ? 2 : 3);
    CAPTURE(seed, layers.size(), layers.front().r.heads.front().pos.size());
    const fs::path in = scratch() / "layout.safetensors";
    write_model(in, layers);
    // Block 1 with a ratio budget, block 4 with a token budget (and the other way round for the second seed).
    const std::vector<BudgetFlag> budgets = {{"--budget 12", kvevict::Budget::tokens(12)},
                                             {"--keep 0.35", kvevict::Budget::keep_ratio(0.35)}};
    for (const std::string& policy : policy_names())
      for (const char* share : {"head", "layer", "model"})
        for (Index block : {Index{1}, Index{4}})
          for (const char* reduce : {"max", "mean"}) {
            const BudgetFlag& b = budgets[(sz(block) / 4 + (seed & 1)) % 2];
            expect_library(policy, b, {share, reduce, block}, in, layers);
          }
  }
}

TEST_CASE("kvevict-select --block on ragged layers (heads of different lengths) with --share head", "[cli][layout]") {
  const std::vector<FileLayer> layers = ragged_model(20260703);
  const fs::path in = scratch() / "layout_ragged.safetensors";
  write_model(in, layers);
  for (const std::string& policy : policy_names())
    for (const char* reduce : {"max", "mean"})
      for (Index block : {Index{2}, Index{4}})
        expect_library(policy, {"--budget 8", kvevict::Budget::tokens(8)}, {"head", reduce, block}, in, layers);
}

TEST_CASE(
    "kvevict-select without layout options: the preset's layout in the metadata (share head, reduce max, "
    "block 1, except TOVA: share layer, reduce mean), no kept_blocks",
    "[cli][layout]") {
  const std::vector<FileLayer> layers = shared_model(20260704, 3);
  const fs::path in = scratch() / "layout_default.safetensors", out = scratch() / "layout_default_out.safetensors",
                 out_explicit = scratch() / "layout_explicit_out.safetensors";
  write_model(in, layers);
  for (const std::string& policy : policy_names()) {
    CAPTURE(policy);
    const std::string share = policy == "tova" ? "layer" : "head", reduce = policy == "tova" ? "mean" : "max";
    REQUIRE(run_cli("--policy " + policy + " --budget 10" + io(in, out)).status == 0);
    REQUIRE(run_cli("--policy " + policy + " --budget 10 --share " + share + " --reduce " + reduce + " --block 1" +
                    io(in, out_explicit))
                .status == 0);
    const st::file f = st::file::open(out.string()), e = st::file::open(out_explicit.string());
    CHECK(f.metadata().at("share") == share);
    CHECK(f.metadata().at("reduce") == reduce);
    CHECK(f.metadata().at("block") == "1");
    CHECK(f.metadata() == e.metadata());
    CHECK(f.tensors().size() == 3 * layers.size());
    for (std::size_t l = 0; l < layers.size(); ++l) {
      const Written a = read_written(f, l), b = read_written(e, l);
      CHECK_FALSE(a.has_blocks);
      CHECK(a.indices == b.indices);
      CHECK(a.offsets == b.offsets);
      CHECK(a.positions == b.positions);
    }
  }
}

TEST_CASE("kvevict-select --help lists --share, --reduce, --block and kept_blocks", "[cli][layout]") {
  const std::string help = stdout_of("--help");
  for (const char* needle :
       {"--share head|layer|model", "--reduce max|mean", "--block B", "kept_blocks", "kept_block_offsets"})
    CHECK(help.find(needle) != std::string::npos);
}

TEST_CASE("kvevict-select: bad layout values are usage errors", "[cli][layout][errors]") {
  const std::vector<FileLayer> layers = shared_model(20260705, 2);
  const fs::path in = scratch() / "layout_usage.safetensors", out = scratch() / "layout_usage_out.safetensors";
  write_model(in, layers);
  const std::string snapkv = "--policy snapkv --budget 10";
  expect_failure(snapkv + " --block 0" + io(in, out), 2, {"--block must be >= 1, got 0", "(see --help)"});
  expect_failure(snapkv + " --block -3" + io(in, out), 2, {"--block must be >= 1, got -3"});
  expect_failure(snapkv + " --block four" + io(in, out), 2, {"--block expects an integer, got 'four'"});
  expect_failure(snapkv + " --share x" + io(in, out), 2, {"--share must be head, layer or model, got 'x'"});
  expect_failure(snapkv + " --share per_layer" + io(in, out), 2, {"--share must be head, layer or model"});
  expect_failure(snapkv + " --reduce x" + io(in, out), 2, {"--reduce must be max or mean, got 'x'"});
  expect_failure(snapkv + io(in, out) + " --block", 2, {"--block expects a value"});
  CHECK_FALSE(fs::exists(out));
}

TEST_CASE("kvevict-select: the library's layout errors come through with its message", "[cli][layout][errors]") {
  const fs::path in = scratch() / "layout_lib.safetensors", out = scratch() / "layout_lib_out.safetensors";
  SECTION("a block over n_kept") {
    write_model(in, shared_model(20260706, 2));
    for (const std::string& policy : policy_names())
      expect_failure("--policy " + policy + " --budget 10 --block 16" + io(in, out), 1,
                     {"block (16) must be <= n_kept (10)"});
    expect_failure("--policy adakv --budget 10 --block 16 --share model" + io(in, out), 1,
                   {"block (16) must be <= n_kept (10)"});
  }
  SECTION("sharing heads that hold different entries") {
    write_model(in, ragged_model(20260707));
    expect_failure("--policy snapkv --budget 8 --share layer" + io(in, out), 1,
                   {"per_layer sharing needs every KV head of the layer to hold the same entries"});
    expect_failure("--policy layer-defensivekv --budget 8 --share layer --block 4" + io(in, out), 1,
                   {"per_layer sharing needs every KV head of the layer to hold the same"});
    expect_failure("--policy streamingllm --budget 8 --share model" + io(in, out), 1,
                   {"per_model sharing needs every KV head of every layer to hold the same"});
  }
  SECTION("reference quirks with a layout") {
    write_model(in, shared_model(20260708, 2));
    expect_failure("--policy snapkv --compression-ratio 0.5 --reference-quirks --block 2" + io(in, out), 1,
                   {"reference_quirks reproduces the reference code, which has neither sharing nor blocks"});
    expect_failure("--policy defensivekv --compression-ratio 0.5 --reference-quirks --share layer" + io(in, out), 1,
                   {"share = per_layer"});
  }
  CHECK_FALSE(fs::exists(out));
}

TEST_CASE("kvevict-select --retrieval-heads forces the heads named, as the library's LayerInputs::retrieval_heads",
          "[cli][layout][retrieval]") {
  // docs/algorithms.md#retrieval-heads: layer 0's KV head 1 and layer 2's KV head 0, under every policy and two
  // layouts; the selections equal the library's on the same inputs with those heads named.
  const std::vector<FileLayer> layers = shared_model(20261209u, 3);
  const fs::path in = scratch() / "retrieval.safetensors", out = scratch() / "retrieval_out.safetensors";
  write_model(in, layers);
  const std::vector<std::vector<Index>> retrieval = {{1}, {}, {0}};
  int differs = 0;
  for (const std::string& policy : policy_names())
    for (const Layout& layout : {Layout{"head", "max", 1}, Layout{"layer", "mean", 4}}) {
      const std::string args = "--policy " + policy + " --budget 12 --retrieval-heads 2:0,0:1" + layout.flags();
      const Run r = run_cli(args + io(in, out));
      CAPTURE(args, r.err);
      REQUIRE(r.status == 0);
      const std::vector<kvevict::Selection> want =
          library_select(policy, layers, layout, kvevict::Budget::tokens(12), retrieval);
      const std::vector<kvevict::Selection> plain = library_select(policy, layers, layout, kvevict::Budget::tokens(12));
      const st::file f = st::file::open(out.string());
      CHECK(f.metadata().at("retrieval_heads") == "0:1,2:0");
      for (std::size_t l = 0; l < layers.size(); ++l) {
        CHECK(read_written(f, l).indices == want[l].indices());
        differs += want[l].indices() != plain[l].indices();
      }
    }
  CHECK(differs > 10);  // the heads named change the selections
  expect_failure("--policy snapkv --budget 8 --retrieval-heads 1" + io(in, out), 2,
                 {"--retrieval-heads expects layer:head pairs of indices >= 0 separated by commas (6:0,7:1), got '1'"});
  expect_failure("--policy snapkv --budget 8 --retrieval-heads 1:0,1:0" + io(in, out), 2,
                 {"--retrieval-heads names a head twice, got '1:0,1:0'"});
  expect_failure("--policy snapkv --budget 8 --retrieval-heads 0:-1" + io(in, out), 2,
                 {"--retrieval-heads expects layer:head pairs"});
  expect_failure("--policy snapkv --budget 8 --retrieval-heads 3:0" + io(in, out), 1,
                 {"the retrieval heads name layer 3; the model has 3 layers"});
  expect_failure("--policy snapkv --budget 8 --retrieval-heads 1:2" + io(in, out), 1,
                 {"retrieval_heads names KV head 2, expected a KV head of the layer in [0, 2)"});
}

}  // namespace test_select_cli_layout

namespace test_select_cli_layout {

TEST_CASE("kvevict-select --protect-prefix keeps a shared prompt prefix, counted or on top, as the library does",
          "[cli][layout][protected]") {
  // docs/algorithms.md#protected-prefix: the entries at positions < 10 (about 6 of each head: positions have gaps).
  const std::vector<FileLayer> layers = shared_model(20261206u, 2);
  const fs::path in = scratch() / "protected.safetensors", out = scratch() / "protected_out.safetensors";
  write_model(in, layers);
  const std::vector<BudgetFlag> budgets = {
      {"--budget 16 --protect-prefix 10", kvevict::Budget::tokens(16).protect_prefix(10)},
      {"--keep 0.3 --protect-prefix 10 --prefix-budget extra",
       kvevict::Budget::keep_ratio(0.3).protect_prefix(10, kvevict::Budget::PrefixBudget::extra)}};
  for (const std::string& policy : policy_names())
    for (const BudgetFlag& b : budgets) {
      expect_library(policy, b, {"layer", "max", 4}, in, layers);
      const st::file f = st::file::open((scratch() / "layout_out.safetensors").string());
      CHECK(f.metadata().at("protect_prefix") == "10");
      CHECK(f.metadata().at("prefix_budget") == (b.budget.extra() ? "extra" : "counted"));
      for (std::size_t l = 0; l < layers.size(); ++l) {  // every head keeps every entry at a position < 10
        const Written w = read_written(f, l);
        for (std::size_t h = 0; h + 1 < w.offsets.size(); ++h) {
          std::size_t held = 0;
          for (auto k = sz(w.offsets[h]); k < sz(w.offsets[h + 1]); ++k) held += w.positions[k] < 10;
          std::size_t protected_entries = 0;
          for (std::int64_t p : layers[l].r.heads[h].pos) protected_entries += p < 10;
          CHECK(held == protected_entries);
        }
      }
    }
  const std::string snapkv = "--policy snapkv --share layer --block 4";
  expect_failure(snapkv + " --budget 8 --protect-prefix 40" + io(in, out), 1,
                 {"kvevict::SnapKV::select (layer 0): the budget keeps", "its protected prefix"});
  expect_failure(snapkv + " --budget 8 --protect-prefix -1" + io(in, out), 2,
                 {"--protect-prefix must be >= 0, got -1"});
  expect_failure(snapkv + " --budget 8 --prefix-budget all" + io(in, out), 2,
                 {"--prefix-budget must be counted or extra, got 'all'"});
}

TEST_CASE("kvevict-select --threshold with --count-lower/-upper/-scope selects as the library does",
          "[cli][layout][threshold]") {
  // docs/algorithms.md#threshold-budgets: every policy but PyramidKV (a scheduled count per layer, refused).
  const std::vector<FileLayer> layers = shared_model(20261207u, 2);
  const fs::path in = scratch() / "threshold.safetensors", out = scratch() / "threshold_out.safetensors";
  write_model(in, layers);
  using Scope = kvevict::Budget::Scope;
  const std::vector<BudgetFlag> budgets = {{"--threshold 0.02", kvevict::Budget::threshold(0.02)},
                                           {"--threshold 0.05 --count-lower 6 --count-upper 20 --count-scope layer",
                                            kvevict::Budget::threshold(0.05).count_bounds(6, 20, Scope::layer)},
                                           {"--threshold 0.01 --count-upper 40 --count-scope model",
                                            kvevict::Budget::threshold(0.01).count_bounds(0, 40, Scope::model)}};
  for (const std::string& policy : policy_names())
    for (std::size_t i = 0; i < budgets.size(); ++i) {
      const Layout layout = i == 1 ? Layout{"layer", "max", 4} : Layout{"head", "max", 1};
      if (policy == "pyramidkv") {
        expect_failure("--policy pyramidkv " + budgets[i].text + layout.flags() + io(in, out), 1,
                       {"a threshold budget decides its counts from the scores"});
        continue;
      }
      expect_library(policy, budgets[i], layout, in, layers);
      const st::file f = st::file::open((scratch() / "layout_out.safetensors").string());
      CHECK(f.metadata().at("budget") ==
            std::vector<std::string>{"threshold=0.02", "threshold=0.05", "threshold=0.01"}[i]);
      if (i == 1) {
        CHECK(f.metadata().at("count_lower") == "6");
        CHECK(f.metadata().at("count_upper") == "20");
        CHECK(f.metadata().at("count_scope") == "layer");
      }
    }
  const std::string snapkv = "--policy snapkv";
  expect_failure(snapkv + " --budget 8 --count-upper 4" + io(in, out), 2,
                 {"--count-upper bounds a threshold budget, got a count budget"});
  expect_failure(snapkv + " --budget 8 --threshold 0.1" + io(in, out), 2, {"give exactly one of"});
  expect_failure(snapkv + " --threshold 0.1 --count-lower 5 --count-upper 2" + io(in, out), 1,
                 {"the upper bound must be >= the lower bound (5)"});
  expect_failure(snapkv + " --threshold 0.1 --count-scope all" + io(in, out), 2,
                 {"--count-scope must be head, layer or model, got 'all'"});
}

TEST_CASE("kvevict-select --keep-whole keeps a hybrid model's layers whole, the others as a model of them alone",
          "[cli][layout][hybrid]") {
  // docs/algorithms.md#hybrid-models: layer 1 of 3 kept whole; layers 0 and 2 select as the file of those two.
  const std::vector<FileLayer> layers = shared_model(20261208u, 3);
  const fs::path in = scratch() / "hybrid.safetensors", pair = scratch() / "hybrid_pair.safetensors",
                 out = scratch() / "hybrid_out.safetensors", pair_out = scratch() / "hybrid_pair_out.safetensors";
  write_model(in, layers);
  write_model(pair, {layers[0], layers[2]});
  for (const std::string& policy : policy_names()) {
    const Run whole = run_cli("--policy " + policy + " --budget 8 --keep-whole 1" + io(in, out));
    const Run alone = run_cli("--policy " + policy + " --budget 8" + io(pair, pair_out));
    CAPTURE(policy, whole.err, alone.err);
    REQUIRE(whole.status == 0);
    REQUIRE(alone.status == 0);
    const st::file f = st::file::open(out.string()), g = st::file::open(pair_out.string());
    CHECK(f.metadata().at("keep_whole") == "1");
    CHECK(read_written(f, 0).indices == read_written(g, 0).indices);
    CHECK(read_written(f, 2).indices == read_written(g, 1).indices);
    const Written kept = read_written(f, 1);
    std::size_t entries = 0;
    for (const auto& head : layers[1].r.heads) entries += head.pos.size();
    CHECK(kept.indices.size() == entries);
  }
  expect_failure("--policy snapkv --budget 8 --keep-whole 1,x" + io(in, out), 2,
                 {"--keep-whole expects layer indices >= 0 separated by commas, got '1,x'"});
  expect_failure("--policy snapkv --budget 8 --keep-whole 1,1" + io(in, out), 2,
                 {"--keep-whole names a layer twice, got '1,1'"});
  expect_failure("--policy snapkv --budget 8 --keep-whole 3" + io(in, out), 1,
                 {"the layers kept whole name layer 3; the model has 3 layers"});
}

}  // namespace test_select_cli_layout
