// kvevict-select on ragged layers (docs/algorithms.md#ragged): layers.{i}.lengths and layers.{i}.positions in,
// layers.{i}.kept_positions out. The CLI must select exactly what the library selects on the same LayerInputs built
// here in C++ (keys and values padded with NaN beyond each head's entries, positions with gaps), for every policy,
// budget form, precision and observation kind; at --precision f64 also what the float64 ragged reference selects;
// a file without lengths and positions selects as before with kept_positions == kept_indices; and bad lengths or
// positions are refused with one clear line.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "cli_run.hpp"
#include "safetensors.hpp"
#include "support/ragged_inputs.hpp"
#include "support/reference_ragged.hpp"

namespace test_select_cli_ragged {  // this file's scope in unity builds (tests/CMakeLists.txt)

namespace fs = std::filesystem;
namespace st = safetensors;
namespace ref = kvevict_ref::ragged;
using kvevict::Index;
using kvevict_test::Ragged;

namespace {

using kvevict_cli_test::Run;
using kvevict_cli_test::run_cli;
using kvevict_cli_test::scratch;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

/// One layer of the file: its entries and the rows each head is padded to (>= the longest head).
struct FileLayer {
  Ragged r;
  Index capacity;
};

enum class Obs { queries, attention };

/// What the file holds besides keys, values and w_o.
struct Contents {
  bool lengths = true;
  bool positions = true;
  Obs obs = Obs::queries;
  st::dtype floats = st::dtype::F32;
  st::dtype ints = st::dtype::I64;
};

std::size_t sz(Index i) { return static_cast<std::size_t>(i); }

/// Window attention [H, w, capacity] of a ragged layer: query head q's rows over its KV head's L_h entries, NaN
/// beyond them (the library reads columns 0 .. L_h - 1 only).
std::vector<double> padded_attention(const FileLayer& x) {
  const ref::Attn a = ref::window_attention(x.r);
  std::vector<double> out(sz(x.r.H) * sz(x.r.w) * sz(x.capacity), kNaN);
  for (std::size_t q = 0; q < a.size(); ++q) {
    const std::size_t L = a[q].size() / sz(x.r.w);
    for (std::size_t i = 0; i < sz(x.r.w); ++i)
      for (std::size_t j = 0; j < L; ++j) out[(q * sz(x.r.w) + i) * sz(x.capacity) + j] = a[q][i * L + j];
  }
  return out;
}

st::tensor_out int_tensor(const std::string& name, const std::vector<std::int64_t>& shape,
                          const std::vector<std::int64_t>& values, st::dtype type) {
  if (type == st::dtype::I64) return st::make_tensor_i64(name, shape, values);
  st::tensor_out t{name, st::dtype::I32, shape, std::vector<unsigned char>(values.size() * 4)};
  for (std::size_t i = 0; i < values.size(); ++i) {
    const auto v = static_cast<std::int32_t>(values[i]);
    std::memcpy(t.bytes.data() + 4 * i, &v, 4);
  }
  return t;
}

/// The tensors of one layer: keys/values [Hkv, capacity, d] with NaN padding, the engine's scores [Hkv, capacity],
/// positions [Hkv, capacity] with -7 padding (kvevict_test::store), lengths [Hkv].
std::vector<st::tensor_out> layer_tensors(std::size_t i, const FileLayer& x, const Contents& c) {
  const kvevict_test::RaggedStored<double> s = kvevict_test::store<double>(x.r, x.capacity, false, kNaN);
  const Ragged& r = x.r;
  const std::string p = "layers." + std::to_string(i) + ".";
  std::vector<st::tensor_out> t;
  if (c.obs == Obs::attention)
    t.push_back(st::make_tensor(p + "window_attention", {r.H, r.w, x.capacity}, padded_attention(x), c.floats));
  else
    t.push_back(st::make_tensor(p + "q_window", {r.H, r.w, r.d}, s.q, c.floats));
  t.push_back(st::make_tensor(p + "keys", {r.Hkv, x.capacity, r.d}, s.k, c.floats));
  t.push_back(st::make_tensor(p + "values", {r.Hkv, x.capacity, r.d}, s.v, c.floats));
  t.push_back(st::make_tensor(p + "w_o", {r.D, r.H * r.d}, s.w_o, c.floats));
  t.push_back(st::make_tensor(p + "scores", {r.Hkv, x.capacity}, s.scores, c.floats));
  if (c.lengths) t.push_back(int_tensor(p + "lengths", {r.Hkv}, s.lengths, c.ints));
  if (c.positions) t.push_back(int_tensor(p + "positions", {r.Hkv, x.capacity}, s.positions, c.ints));
  return t;
}

void write_model(const fs::path& path, const std::vector<FileLayer>& layers, const Contents& c) {
  std::vector<st::tensor_out> t;
  for (std::size_t i = 0; i < layers.size(); ++i)
    for (st::tensor_out& x : layer_tensors(i, layers[i], c)) t.push_back(std::move(x));
  st::write(path.string(), t);
}

/// What the CLI wrote for one layer.
struct Written {
  std::vector<std::int64_t> indices, offsets, positions;
};

Written read_written(const fs::path& path, std::size_t layer) {
  const st::file f = st::file::open(path.string());
  const std::string p = "layers." + std::to_string(layer) + ".";
  const st::tensor_info& idx = f.at(p + "kept_indices");
  const st::tensor_info& pos = f.at(p + "kept_positions");
  CHECK(pos.type == st::dtype::I64);
  CHECK(pos.shape == idx.shape);
  return {f.read_i64(idx), f.read_i64(f.at(p + "kept_offsets")), f.read_i64(pos)};
}

/// The library's selections on the same LayerInputs, built here from the layers (not from the file), in S.
template <class S>
std::vector<kvevict::Selection> library_select(const std::string& policy, const std::vector<FileLayer>& layers,
                                               const Contents& c, const kvevict::Budget& budget) {
  std::vector<kvevict_test::RaggedStored<S>> stored;
  std::vector<std::vector<S>> attention;
  stored.reserve(layers.size());  // the views point into these buffers
  attention.reserve(layers.size());
  std::vector<kvevict::LayerInputs<S>> in;
  for (const FileLayer& x : layers) {
    stored.push_back(kvevict_test::store<S>(x.r, x.capacity, false, static_cast<S>(kNaN), 0, c.positions));
    kvevict::LayerInputs<S> li = stored.back().in;
    if (!c.lengths) li.lengths = nullptr;
    if (c.obs == Obs::attention) {
      attention.push_back(kvevict_test::cast_to<S>(padded_attention(x)));
      li.queries = {};
      li.attention = kvevict::HeadsView<const S>::heads_major(attention.back().data(), x.r.H, x.r.w, x.capacity);
    }
    in.push_back(li);
  }
  kvevict::Knobs knobs;
  knobs.window = layers.front().r.w;
  std::vector<kvevict::Selection> out;
  const bool found = kvevict::catalogue::visit(policy, [&](const auto& e) {
    kvevict::Knobs k = knobs;  // kvevict-select takes the window from q_window only for a policy that reads it
    if (!std::decay_t<decltype(e)>::policy_type::reads_observation()) k.window.reset();
    if (policy == "tova") k.share = kvevict::Sharing::per_head;  // as expect_library runs it
    out = kvevict::select_layers<S>(e.make(k), in, budget);
  });
  REQUIRE(found);
  return out;
}

/// (b): each kept index is a row of its head's entries, and its kept position is the position of that row (the row
/// itself when the file gave no positions).
void check_kept_positions(const Written& w, const FileLayer& x, bool positions_given) {
  REQUIRE(w.offsets.size() == sz(x.r.Hkv) + 1);
  REQUIRE(w.positions.size() == w.indices.size());
  for (std::size_t h = 0; h < sz(x.r.Hkv); ++h) {
    const std::vector<std::int64_t>& pos = x.r.heads[h].pos;
    for (auto k = sz(w.offsets[h]); k < sz(w.offsets[h + 1]); ++k) {
      const std::int64_t row = w.indices[k];
      REQUIRE(row >= 0);
      REQUIRE(row < static_cast<std::int64_t>(pos.size()));
      CHECK(w.positions[k] == (positions_given ? pos[sz(row)] : row));
    }
  }
}

/// Two ragged layers, KV heads of different lengths, positions with gaps; layer 0 padded to its longest head
/// exactly, layer 1 to 3 rows more.
std::vector<FileLayer> ragged_model(std::uint64_t seed) {
  kvevict_test::Rng rng(seed);
  std::vector<FileLayer> layers;
  for (int l = 0; l < 2; ++l) {
    const Ragged r = kvevict_test::random_ragged(rng, 4, 2, 4, 8, 48, 0.5);
    const Index a = kvevict_test::length(r, 0), b = kvevict_test::length(r, 1);
    REQUIRE(a != b);
    REQUIRE(std::min(a, b) >= 14);
    REQUIRE(r.heads[0].pos.back() - r.heads[0].pos.front() + 1 > a);  // gaps
    layers.push_back({r, kvevict_test::longest(r) + (l == 0 ? 0 : 3)});
  }
  return layers;
}

/// The layers cut to their heads' last m entries (m: the shortest head), so that every head holds the same number
/// of entries, still at positions with gaps; no padding.
std::vector<FileLayer> equal_lengths(std::vector<FileLayer> layers) {
  for (FileLayer& x : layers) {
    Index m = x.capacity;
    for (int h = 0; h < x.r.Hkv; ++h) m = std::min(m, kvevict_test::length(x.r, h));
    for (auto& head : x.r.heads) {
      const auto drop = static_cast<std::ptrdiff_t>(head.pos.size() - sz(m));
      head.pos.erase(head.pos.begin(), head.pos.begin() + drop);
      head.keys.erase(head.keys.begin(), head.keys.begin() + drop * x.r.d);
      head.values.erase(head.values.begin(), head.values.begin() + drop * x.r.d);
    }
    x.capacity = m;
  }
  return layers;
}

struct BudgetFlag {
  std::string text;
  kvevict::Budget budget;
};

std::vector<BudgetFlag> budget_flags() {
  return {{"--budget 8", kvevict::Budget::tokens(8)},
          {"--keep 0.4", kvevict::Budget::keep_ratio(0.4)},
          {"--compression-ratio 0.6", kvevict::Budget::compression_ratio(0.6)}};
}

std::vector<std::string> policy_names() {
  std::vector<std::string> out;
  kvevict::catalogue::for_each(kvevict::catalogue::entries(), [&](const auto& e) { out.emplace_back(e.name); });
  return out;
}

std::string io(const fs::path& in, const fs::path& out) { return " \"" + in.string() + "\" \"" + out.string() + "\""; }

/// Runs the CLI and checks that it wrote, layer by layer, exactly the library's selections.
template <class S>
void expect_library(const std::string& policy, const BudgetFlag& b, const std::vector<FileLayer>& layers,
                    const Contents& c, const std::string& extra = "") {
  const fs::path in = scratch() / "ragged.safetensors", out = scratch() / "ragged_out.safetensors";
  write_model(in, layers, c);
  // TOVA's default (one set per layer) needs the heads at the same positions: per head on these layers.
  const std::string args =
      "--policy " + policy + " " + b.text + extra + (policy == "tova" ? " --share head" : "") + io(in, out);
  const Run r = run_cli(args);
  CAPTURE(args, c.lengths, c.positions, c.obs == Obs::attention, r.err);
  REQUIRE(r.status == 0);
  REQUIRE(r.err.empty());
  const std::vector<kvevict::Selection> expected = library_select<S>(policy, layers, c, b.budget);
  REQUIRE(expected.size() == layers.size());
  for (std::size_t l = 0; l < layers.size(); ++l) {
    CAPTURE(l);
    const Written w = read_written(out, l);
    CHECK(w.indices == expected[l].indices());
    CHECK(w.offsets == expected[l].offsets());
    CHECK(w.positions == expected[l].positions());
    check_kept_positions(w, layers[l], c.positions);
  }
}

/// Whether the catalogue policy needs the window queries themselves (attention rows will not do).
bool reads_queries(const std::string& policy) {
  bool out = false;
  REQUIRE(kvevict::catalogue::visit(
      policy, [&](const auto& e) { out = std::decay_t<decltype(e)>::policy_type::reads_queries(); }));
  return out;
}

/// A policy that needs q_window, given window_attention: the CLI refuses with the library's message.
void expect_queries_refusal(const std::string& policy, const std::vector<FileLayer>& layers, const Contents& c) {
  const fs::path in = scratch() / "ragged.safetensors", out = scratch() / "ragged_out.safetensors";
  write_model(in, layers, c);
  const Run r = run_cli("--policy " + policy + " --budget 8" + io(in, out));
  CAPTURE(policy, r.err);
  CHECK(r.status != 0);
  CHECK(r.err.find("needs the window queries [H, w, head_dim]") != std::string::npos);
}

}  // namespace

TEST_CASE("kvevict-select on ragged layers selects what the library selects on the same LayerInputs", "[cli][ragged]") {
  const std::vector<FileLayer> layers = ragged_model(20260601);
  for (const std::string& policy : policy_names())
    for (const BudgetFlag& b : budget_flags())
      for (Obs obs : {Obs::queries, Obs::attention}) {
        Contents c;
        c.obs = obs;
        if (obs == Obs::attention && reads_queries(policy)) {
          if (b.text == budget_flags().front().text) expect_queries_refusal(policy, layers, c);
          continue;
        }
        c.floats = st::dtype::F32;
        expect_library<float>(policy, b, layers, c);
        c.floats = st::dtype::F64;
        expect_library<double>(policy, b, layers, c, " --precision f64");
      }
}

TEST_CASE("kvevict-select on ragged layers at --precision f64 matches the float64 ragged reference", "[cli][ragged]") {
  const std::vector<FileLayer> layers = ragged_model(20260602);
  const fs::path in = scratch() / "ragged_ref.safetensors", out = scratch() / "ragged_ref_out.safetensors";
  Contents c;
  c.floats = st::dtype::F64;
  write_model(in, layers, c);
  const std::int64_t n_kept = 9;
  const auto run = [&](const std::string& policy) {
    const std::string args =
        "--policy " + policy + " --budget " + std::to_string(n_kept) + " --precision f64" + io(in, out);
    const Run r = run_cli(args);
    CAPTURE(args, r.err);
    REQUIRE(r.status == 0);
  };
  const auto rows = [&](std::size_t l) {
    const Written w = read_written(out, l);
    ref::KeptRows k(w.offsets.size() - 1);
    for (std::size_t h = 0; h + 1 < w.offsets.size(); ++h)
      k[h].assign(w.indices.begin() + w.offsets[h], w.indices.begin() + w.offsets[h + 1]);
    check_kept_positions(w, layers[l], true);
    return k;
  };
  run("snapkv");
  for (std::size_t l = 0; l < layers.size(); ++l) CHECK(rows(l) == ref::snapkv(layers[l].r, n_kept, 5, ref::Pool::avg));
  run("adakv");
  for (std::size_t l = 0; l < layers.size(); ++l)
    CHECK(rows(l) == ref::adakv(layers[l].r, n_kept, 0.2, 5, ref::Pool::avg));
  run("streamingllm");
  for (std::size_t l = 0; l < layers.size(); ++l)
    CHECK(rows(l) == ref::streamingllm(ref::lengths(layers[l].r), n_kept, 4));
  run("criticalkv");
  for (std::size_t l = 0; l < layers.size(); ++l) CHECK(rows(l) == ref::criticalkv(layers[l].r, n_kept, {}));
  run("defensivekv");
  for (std::size_t l = 0; l < layers.size(); ++l) CHECK(rows(l) == ref::defensivekv(layers[l].r, n_kept, {}));
  run("layer-defensivekv");
  const std::vector<ref::KeptRows> global =
      ref::layer_defensivekv({layers[0].r, layers[1].r}, {n_kept, n_kept}, ref::DefensiveParams{});
  for (std::size_t l = 0; l < layers.size(); ++l) CHECK(rows(l) == global[l]);
}

TEST_CASE("kvevict-select: lengths alone, positions alone, I32 like I64", "[cli][ragged]") {
  const std::vector<FileLayer> layers = ragged_model(20260613);
  const BudgetFlag b = budget_flags().front();
  for (const char* policy : {"snapkv", "adakv", "defensivekv", "layer-defensivekv", "streamingllm"}) {
    CAPTURE(policy);
    Contents lengths_only;
    lengths_only.positions = false;  // positions default to 0 .. L_h - 1: kept_positions == kept_indices
    expect_library<float>(policy, b, layers, lengths_only);
    Contents positions_only;
    positions_only.lengths = false;  // every head holds all its rows, at the given positions
    expect_library<float>(policy, b, equal_lengths(layers), positions_only);
  }
  // The same file with I32 lengths and positions writes the same bytes as with I64.
  const fs::path in = scratch() / "ints.safetensors", out64 = scratch() / "ints64.safetensors",
                 out32 = scratch() / "ints32.safetensors";
  for (const char* policy : {"adakv", "layer-defensivekv"}) {
    Contents c;
    write_model(in, layers, c);
    REQUIRE(run_cli(std::string("--policy ") + policy + " --keep 0.4" + io(in, out64)).status == 0);
    c.ints = st::dtype::I32;
    write_model(in, layers, c);
    REQUIRE(run_cli(std::string("--policy ") + policy + " --keep 0.4" + io(in, out32)).status == 0);
    for (std::size_t l = 0; l < layers.size(); ++l) {
      const Written a = read_written(out64, l), w = read_written(out32, l);
      CHECK(a.indices == w.indices);
      CHECK(a.offsets == w.offsets);
      CHECK(a.positions == w.positions);
    }
  }
}

TEST_CASE("kvevict-select without lengths and positions selects as before, kept_positions == kept_indices",
          "[cli][ragged]") {
  // Dense layers (every head L rows, positions 0 .. L - 1 implied).
  std::vector<FileLayer> layers = equal_lengths(ragged_model(20260604));
  for (FileLayer& x : layers)
    for (auto& head : x.r.heads) std::iota(head.pos.begin(), head.pos.end(), std::int64_t{0});
  Contents dense;
  dense.lengths = false;
  dense.positions = false;
  Contents explicit_dense;  // the same layers with lengths [L, L] and positions 0 .. L - 1 written out
  const fs::path in = scratch() / "dense.safetensors", out = scratch() / "dense_out.safetensors",
                 out_explicit = scratch() / "dense_explicit_out.safetensors";
  for (const std::string& policy : policy_names())
    for (const BudgetFlag& b : budget_flags()) {
      CAPTURE(policy, b.text);
      expect_library<float>(policy, b, layers, dense);
      write_model(in, layers, dense);
      REQUIRE(run_cli("--policy " + policy + " " + b.text + io(in, out)).status == 0);
      write_model(in, layers, explicit_dense);
      REQUIRE(run_cli("--policy " + policy + " " + b.text + io(in, out_explicit)).status == 0);
      for (std::size_t l = 0; l < layers.size(); ++l) {
        const Written w = read_written(out, l), e = read_written(out_explicit, l);
        CHECK(w.positions == w.indices);
        CHECK(e.indices == w.indices);
        CHECK(e.offsets == w.offsets);
        CHECK(e.positions == w.positions);
      }
    }
  // The output holds exactly the three tensors per layer.
  const st::file f = st::file::open(out.string());
  CHECK(f.tensors().size() == 3 * layers.size());
}

TEST_CASE("kvevict-select rejects bad lengths and positions with one clear line", "[cli][ragged][errors]") {
  const std::vector<FileLayer> layers = ragged_model(20260605);
  const FileLayer& x = layers[0];  // Hkv 2, capacity = its longest head
  const std::string L = std::to_string(x.capacity);
  const fs::path bad = scratch() / "ragged_bad.safetensors", out = scratch() / "ragged_bad_out.safetensors";
  auto expect_failure = [&](const std::vector<st::tensor_out>& tensors, const std::string& args,
                            const std::vector<std::string>& needles) {
    st::write(bad.string(), tensors);
    const Run r = run_cli(args + io(bad, out));
    CAPTURE(args, r.err);
    CHECK(r.status == 1);
    CHECK(r.err.rfind("kvevict-select:", 0) == 0);
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
    for (const std::string& needle : needles) CHECK(r.err.find(needle) != std::string::npos);
  };
  // Layer 0's tensors with lengths and positions replaced.
  const kvevict_test::RaggedStored<double> s = kvevict_test::store<double>(x.r, x.capacity, false, kNaN);
  Contents base;
  base.lengths = false;
  base.positions = false;
  const std::vector<st::tensor_out> rest = layer_tensors(0, x, base);
  auto with = [&](std::vector<st::tensor_out> extra) {
    std::vector<st::tensor_out> t = rest;
    for (st::tensor_out& e : extra) t.push_back(std::move(e));
    return t;
  };
  const auto lengths = [&](std::vector<std::int64_t> v) { return st::make_tensor_i64("layers.0.lengths", {2}, v); };
  const auto positions = [&](std::vector<std::int64_t> v) {
    return st::make_tensor_i64("layers.0.positions", {2, x.capacity}, v);
  };
  const std::string snapkv = "--policy snapkv --budget 8";

  SECTION("lengths of the wrong dtype, rank or shape") {
    expect_failure(with({st::make_tensor("layers.0.lengths", {2}, {20.0, 15.0}, st::dtype::F32)}), snapkv,
                   {"tensor 'layers.0.lengths' has dtype F32; expected I64 or I32 [2]", "KV heads"});
    expect_failure(with({st::make_tensor_i64("layers.0.lengths", {3}, {20, 15, 15})}), snapkv,
                   {"tensor 'layers.0.lengths' has shape [3]; expected [2]", "layers.0.keys"});
    expect_failure(with({st::make_tensor_i64("layers.0.lengths", {2, 1}, {20, 15})}), snapkv,
                   {"tensor 'layers.0.lengths' has shape [2, 1]; expected [2]"});
    expect_failure(with({st::make_tensor_i64("layers.0.lengths", {}, {20})}), "--policy streamingllm --budget 8",
                   {"tensor 'layers.0.lengths' has shape []; expected [2]"});
  }
  SECTION("positions of the wrong dtype, rank or shape") {
    expect_failure(with({st::make_tensor("layers.0.positions", {2, x.capacity},
                                         std::vector<double>(sz(2 * x.capacity), 1.0), st::dtype::BF16)}),
                   snapkv, {"tensor 'layers.0.positions' has dtype BF16; expected I64 or I32 [2, " + L + "]"});
    expect_failure(
        with({st::make_tensor_i64("layers.0.positions", {2, x.capacity - 1},
                                  std::vector<std::int64_t>(sz(2 * x.capacity - 2), 0))}),
        snapkv,
        {"tensor 'layers.0.positions' has shape [2, " + std::to_string(x.capacity - 1) + "]; expected [2, " + L + "]",
         "[kv_heads, tokens]"});
    expect_failure(
        with({st::make_tensor_i64("layers.0.positions", {2 * x.capacity}, s.positions)}),
        "--policy streamingllm --budget 8",
        {"tensor 'layers.0.positions' has shape [" + std::to_string(2 * x.capacity) + "]; expected [2, " + L + "]"});
    expect_failure(with({st::make_tensor_i64("layers.0.positions", {x.capacity, 2}, s.positions)}), snapkv,
                   {"tensor 'layers.0.positions' has shape [" + L + ", 2]; expected [2, " + L + "]"});
  }
  SECTION("the library's checks come through: lengths over the capacity or below 1") {
    expect_failure(with({lengths({x.capacity + 1, 15})}), snapkv,
                   {"lengths[0] must be in [1, " + L + "]", "got " + std::to_string(x.capacity + 1)});
    expect_failure(with({lengths({x.capacity, 0})}), "--policy streamingllm --budget 8",
                   {"lengths[1] must be in [1, " + L + "]", "got 0"});
  }
  SECTION("the library's checks come through: positions not increasing") {
    std::vector<std::int64_t> p = s.positions;
    p[sz(x.capacity) + 3] = p[sz(x.capacity) + 2];  // head 1, entry 3 repeats entry 2
    expect_failure(with({lengths(s.lengths), positions(p)}), snapkv,
                   {"positions of KV head 1 must be strictly increasing", "at entry 3"});
    expect_failure(with({lengths(s.lengths), positions(p)}), "--policy layer-defensivekv --budget 8",
                   {"positions of KV head 1 must be strictly increasing"});
  }
  SECTION("the library's checks come through: a window not smaller than a head's entries") {
    expect_failure(with({lengths({x.capacity, 4})}), snapkv,
                   {"window (4) must be smaller than the entries of KV head 1 (4)"});
  }
  SECTION("the library's checks come through: a budget over the mean length, quirks on a ragged layer, NaN inside") {
    const std::int64_t too_many = (s.lengths[0] + s.lengths[1]) / 2 + 1;
    expect_failure(with({lengths(s.lengths), positions(s.positions)}),
                   "--policy snapkv --budget " + std::to_string(too_many),
                   {"n_kept must be in [1, " + std::to_string(too_many - 1) + "] (the mean entries per KV head"});
    expect_failure(with({lengths(s.lengths), positions(s.positions)}),
                   "--policy defensivekv --compression-ratio 0.5 --reference-quirks",
                   {"reference_quirks needs every KV head to hold the same number of entries"});
    // Padding may be NaN; an entry a head holds may not (lengths reaching one row into the shorter head's padding).
    std::vector<std::int64_t> into_padding = s.lengths;
    ++into_padding[s.lengths[0] < s.lengths[1] ? 0 : 1];
    expect_failure(with({lengths(into_padding)}), snapkv, {"is not finite (nan)"});
  }
}

}  // namespace test_select_cli_ragged
