// kvevict-select against the float64 reference (tests/support/reference.hpp), and its handling of bad input.

#include <catch2/catch.hpp>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cli_run.hpp"
#include "safetensors.hpp"
#include "support/reference.hpp"

namespace test_select_cli {  // this file's scope in unity builds (tests/CMakeLists.txt)

namespace fs = std::filesystem;
namespace st = safetensors;

namespace {

using kvevict_cli_test::Run;
using kvevict_cli_test::run_cli;
using kvevict_cli_test::scratch;

std::vector<double> randn(std::size_t n, std::mt19937_64& rng, double scale = 1.0) {
  std::normal_distribution<double> dist(0.0, scale);
  std::vector<double> v(n);
  for (double& x : v) x = dist(rng);
  return v;
}

struct LayerData {
  int H, Hkv, w, L, d;
  std::vector<double> q, k, v;
};

LayerData random_layer(int H, int Hkv, int w, int L, int d, std::mt19937_64& rng) {
  LayerData x{H, Hkv, w, L, d, {}, {}, {}};
  x.q = randn(static_cast<std::size_t>(H * w * d), rng, 1.5);
  x.k = randn(static_cast<std::size_t>(Hkv * L * d), rng);
  x.v = randn(static_cast<std::size_t>(Hkv * L * d), rng);
  return x;
}

void write_layers(const fs::path& path, const std::vector<LayerData>& layers, st::dtype type, bool attention_rows) {
  std::vector<st::tensor_out> t;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const LayerData& x = layers[i];
    const std::string p = "layers." + std::to_string(i) + ".";
    if (attention_rows)
      t.push_back(st::make_tensor(p + "window_attention", {x.H, x.w, x.L},
                                  kvevict_ref::window_attention(x.q, x.k, x.H, x.Hkv, x.w, x.L, x.d), type));
    else
      t.push_back(st::make_tensor(p + "q_window", {x.H, x.w, x.d}, x.q, type));
    t.push_back(st::make_tensor(p + "keys", {x.Hkv, x.L, x.d}, x.k, type));
    t.push_back(st::make_tensor(p + "values", {x.Hkv, x.L, x.d}, x.v, type));
  }
  st::write(path.string(), t);
}

kvevict_ref::Kept read_kept(const fs::path& path, std::size_t layer) {
  const st::file f = st::file::open(path.string());
  const std::string p = "layers." + std::to_string(layer) + ".";
  const auto idx = f.read_i64(f.at(p + "kept_indices"));
  const auto off = f.read_i64(f.at(p + "kept_offsets"));
  kvevict_ref::Kept kept(off.size() - 1);
  for (std::size_t h = 0; h + 1 < off.size(); ++h) kept[h].assign(idx.begin() + off[h], idx.begin() + off[h + 1]);
  return kept;
}

}  // namespace

TEST_CASE("kvevict-select --precision f64 matches the float64 reference index for index", "[cli]") {
  std::mt19937_64 rng(20261130);
  struct Shape {
    int H, Hkv, w, L, d;
  };
  const Shape shapes[] = {{4, 2, 8, 70, 16}, {8, 8, 4, 33, 16}, {8, 2, 16, 300, 64}, {2, 1, 32, 129, 128}};
  for (const Shape& s : shapes) {
    const std::vector<LayerData> layers = {random_layer(s.H, s.Hkv, s.w, s.L, s.d, rng),
                                           random_layer(s.H, s.Hkv, s.w, s.L, s.d, rng)};
    for (bool rows : {false, true}) {
      const fs::path in = scratch() / "in.safetensors", out = scratch() / "out.safetensors";
      write_layers(in, layers, st::dtype::F64, rows);
      for (const char* pool : {"avg", "max"}) {
        for (const std::string& budget : {std::string("--budget ") + std::to_string(s.w + 5),
                                          std::string("--compression-ratio 0.7"), std::string("--keep 0.35")}) {
          for (const char* policy : {"snapkv", "adakv"}) {
            const std::string args = std::string("--policy ") + policy + " " + budget + " --pool " + pool +
                                     " --kernel 5 --precision f64 \"" + in.string() + "\" \"" + out.string() + "\"";
            CAPTURE(s.H, s.Hkv, s.w, s.L, s.d, rows, args);
            const Run r = run_cli(args);
            REQUIRE(r.err.empty());
            REQUIRE(r.status == 0);
            const kvevict_ref::Pool p = std::string(pool) == "avg" ? kvevict_ref::Pool::avg : kvevict_ref::Pool::max;
            std::int64_t n_kept = s.w + 5;
            if (budget.find("compression") != std::string::npos)
              n_kept = kvevict_ref::n_kept_from_compression_ratio(s.L, 0.7);
            if (budget.find("keep") != std::string::npos) n_kept = kvevict_ref::n_kept_from_keep_ratio(s.L, 0.35);
            for (std::size_t i = 0; i < layers.size(); ++i) {
              const LayerData& x = layers[i];
              const auto scores = kvevict_ref::mean_scores(
                  kvevict_ref::window_attention(x.q, x.k, x.H, x.Hkv, x.w, x.L, x.d), x.H, x.Hkv, x.w, x.L, 5, p);
              const kvevict_ref::Kept expected = std::string(policy) == "snapkv"
                                                     ? kvevict_ref::snapkv(scores, x.Hkv, x.w, x.L, n_kept)
                                                     : kvevict_ref::adakv(scores, x.Hkv, x.w, x.L, n_kept, 0.2);
              CHECK(read_kept(out, i) == expected);
            }
          }
        }
      }
    }
  }
}

TEST_CASE("kvevict-select reads F32, F16 and BF16 and agrees with the reference on the decoded values", "[cli]") {
  std::mt19937_64 rng(7);
  const std::vector<LayerData> layers = {random_layer(4, 2, 8, 100, 16, rng)};
  for (st::dtype type : {st::dtype::F32, st::dtype::F16, st::dtype::BF16}) {
    const fs::path in = scratch() / "typed.safetensors", out = scratch() / "typed_out.safetensors";
    write_layers(in, layers, type, false);
    const st::file f = st::file::open(in.string());
    const auto q = f.read_floats<double>(f.at("layers.0.q_window"));
    const auto k = f.read_floats<double>(f.at("layers.0.keys"));
    const Run r = run_cli("--base adakv --selector attention --budget 30 --precision f64 \"" + in.string() + "\" \"" +
                          out.string() + "\"");
    CAPTURE(st::dtype_name(type), r.err);
    REQUIRE(r.status == 0);
    const auto scores = kvevict_ref::mean_scores(kvevict_ref::window_attention(q, k, 4, 2, 8, 100, 16), 4, 2, 8, 100, 5,
                                                 kvevict_ref::Pool::avg);
    CHECK(read_kept(out, 0) == kvevict_ref::adakv(scores, 2, 8, 100, 30, 0.2));
    // f32 arithmetic keeps the exact budget too.
    REQUIRE(run_cli("--policy snapkv --budget 30 \"" + in.string() + "\" \"" + out.string() + "\"").status == 0);
    for (const auto& head : read_kept(out, 0)) CHECK(head.size() == 30);
  }
}

TEST_CASE("kvevict-select streamingllm needs only keys", "[cli]") {
  const fs::path in = scratch() / "keys_only.safetensors", out = scratch() / "keys_only_out.safetensors";
  st::write(in.string(), {st::make_tensor("layers.0.keys", {2, 20, 4}, std::vector<double>(160, 0.5), st::dtype::F32)});
  REQUIRE(
      run_cli("--policy streamingllm --budget 7 --sinks 2 \"" + in.string() + "\" \"" + out.string() + "\"").status ==
      0);
  CHECK(read_kept(out, 0) == kvevict_ref::streamingllm(2, 20, 7, 2));
}

TEST_CASE("kvevict-select rejects bad input with one clear line and a non-zero exit", "[cli][errors]") {
  std::mt19937_64 rng(3);
  const LayerData x = random_layer(4, 2, 8, 40, 8, rng);
  const fs::path good = scratch() / "good.safetensors", bad = scratch() / "bad.safetensors",
                 out = scratch() / "bad_out.safetensors";
  write_layers(good, {x}, st::dtype::F32, false);
  const std::string io = " \"" + bad.string() + "\" \"" + out.string() + "\"";
  auto expect_failure = [&](const std::string& args, const std::string& needle) {
    const Run r = run_cli(args);
    CAPTURE(args, r.err);
    CHECK(r.status != 0);
    CHECK(r.status < 128);  // an exit, not a signal
    CHECK(r.err.rfind("kvevict-select:", 0) == 0);
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
    CHECK(r.err.find(needle) != std::string::npos);
  };
  auto write_bad = [&](const std::vector<st::tensor_out>& t) { st::write(bad.string(), t); };
  const auto q = st::make_tensor("layers.0.q_window", {4, 8, 8}, x.q, st::dtype::F32);
  const auto k = st::make_tensor("layers.0.keys", {2, 40, 8}, x.k, st::dtype::F32);
  const auto v = st::make_tensor("layers.0.values", {2, 40, 8}, x.v, st::dtype::F32);

  SECTION("missing window queries") {
    write_bad({k, v});
    expect_failure("--policy snapkv --budget 10" + io, "layers.0.q_window");
  }
  SECTION("missing keys") {
    write_bad({q, v});
    expect_failure("--policy snapkv --budget 10" + io, "layers.0.keys");
  }
  SECTION("layers not contiguous") {
    auto k2 = k;
    k2.name = "layers.2.keys";
    write_bad({q, k, v, k2});
    expect_failure("--policy snapkv --budget 10" + io, "layers.2.keys");
  }
  SECTION("wrong rank") {
    write_bad({q, st::make_tensor("layers.0.keys", {80, 8}, x.k, st::dtype::F32), v});
    expect_failure("--policy snapkv --budget 10" + io, "rank 2");
  }
  SECTION("wrong shape: head_dim mismatch") {
    write_bad({st::make_tensor("layers.0.q_window", {4, 16, 4}, x.q, st::dtype::F32), k, v});
    expect_failure("--policy snapkv --budget 10" + io, "head_dim");
  }
  SECTION("wrong shape: heads not a multiple of KV heads") {
    write_bad({st::make_tensor("layers.0.q_window", {3, 8, 8}, std::vector<double>(x.q.begin(), x.q.begin() + 192),
                               st::dtype::F32),
               k, v});
    expect_failure("--policy snapkv --budget 10" + io, "multiple of the KV heads");
  }
  SECTION("values disagree with keys") {
    write_bad({q, k, st::make_tensor("layers.0.values", {2, 39, 8}, std::vector<double>(624, 0.0), st::dtype::F32)});
    expect_failure("--policy snapkv --budget 10" + io, "layers.0.values");
  }
  SECTION("bad dtype") {
    write_bad({q, st::make_tensor_i64("layers.0.keys", {2, 40, 8}, std::vector<std::int64_t>(640, 1)), v});
    expect_failure("--policy snapkv --budget 10" + io, "dtype I64");
  }
  SECTION("truncated file") {
    std::ifstream in(good, std::ios::binary);
    std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::ofstream(bad, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size() - 100));
    expect_failure("--policy snapkv --budget 10" + io, bad.string());
  }
  SECTION("malformed header") {
    const std::string junk = std::string("\x10\0\0\0\0\0\0\0", 8) + "{not json at all";
    std::ofstream(bad, std::ios::binary) << junk;
    expect_failure("--policy snapkv --budget 10" + io, bad.string());
  }
  SECTION("file that does not exist") {
    expect_failure(
        "--policy snapkv --budget 10 \"" + (scratch() / "nope.safetensors").string() + "\" \"" + out.string() + "\"",
        "nope.safetensors");
  }
  SECTION("budget out of range") {
    fs::copy_file(good, bad, fs::copy_options::overwrite_existing);
    expect_failure("--policy snapkv --budget 41" + io, "n_kept must be in [1, 40]");
    expect_failure("--policy snapkv --budget 0" + io, "kvevict::Budget::tokens: tokens must be >= 1, got 0");
    expect_failure("--policy snapkv --budget 41" + io, "kvevict::SnapKV::select (layer 0): n_kept must be in [1, 40]");
    expect_failure("--policy snapkv --keep 0.01" + io, "n_kept must be in [1, 40]");
    expect_failure("--policy snapkv --keep 1.5" + io, "--keep");
    expect_failure("--policy snapkv --compression-ratio 1" + io, "--compression-ratio");
  }
  SECTION("window that does not match the tensors") {
    fs::copy_file(good, bad, fs::copy_options::overwrite_existing);
    expect_failure("--policy snapkv --budget 10 --window 4" + io, "window 4 does not match");
  }
  SECTION("usage errors") {
    fs::copy_file(good, bad, fs::copy_options::overwrite_existing);
    expect_failure("--policy nosuch --budget 10" + io, "unknown policy 'nosuch'");
    expect_failure("--policy snapkv" + io, "a budget is required");
    expect_failure("--policy snapkv --budget 10 --keep 0.5" + io, "exactly one");
    expect_failure("--policy snapkv --budget ten" + io, "expects an integer");
    expect_failure("--policy snapkv --budget 10 --kernel 4" + io, "--kernel");
    expect_failure("--policy snapkv --budget 10 --pool mean" + io, "--pool");
    expect_failure("--policy snapkv --budget 10 --precision f16" + io, "--precision");
    expect_failure("--policy snapkv --budget 10 --frobnicate" + io, "unknown option");
    expect_failure("--policy snapkv --budget 10 \"" + bad.string() + "\"", "expected INPUT and OUTPUT");
    expect_failure("--budget 10" + io, "a policy is required");
    expect_failure("--base adakv --selector nosuch --budget 10" + io, "unknown selector");
  }
}

}  // namespace test_select_cli
