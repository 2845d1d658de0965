// kvevict-select on quantized caches (docs/algorithms.md#quantized): keys and values stored as I8, F8_E4M3 or
// F8_E5M2 with an optional 'layers.{i}.keys_scale' / 'values_scale' (F32: one factor, one per token or one per KV
// head and token) select exactly what F32 keys and values holding the dequantized values float(code) * factor
// select, at both precisions, for every kind of policy; bad scales are one clear line.

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "cli_run.hpp"
#include "safetensors.hpp"

namespace test_select_cli_quantized {  // this file's scope in unity builds (tests/CMakeLists.txt)

namespace fs = std::filesystem;
namespace st = safetensors;

namespace {

using kvevict_cli_test::Run;
using kvevict_cli_test::run_cli;
using kvevict_cli_test::scratch;

/// The formats from their definitions (independent of the library's decoders).
double code_value(st::dtype type, std::uint8_t b) {
  if (type == st::dtype::I8) return static_cast<std::int8_t>(b);
  const bool e4m3 = type == st::dtype::F8_E4M3;
  const int mbits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
  const int e = (b & 0x7F) >> mbits, m = b & ((1 << mbits) - 1);
  const double mag = e == 0 ? std::ldexp(m, 1 - bias - mbits) : std::ldexp((1 << mbits) + m, e - bias - mbits);
  return (b & 0x80) ? -mag : mag;
}

/// A finite code of moderate magnitude.
std::uint8_t random_code(st::dtype type, std::mt19937_64& rng) {
  std::uniform_int_distribution<int> bit(0, 1), mant(0, 7);
  if (type == st::dtype::I8) return static_cast<std::uint8_t>(std::uniform_int_distribution<int>(-127, 127)(rng));
  if (type == st::dtype::F8_E4M3)
    return static_cast<std::uint8_t>((bit(rng) << 7) | (std::uniform_int_distribution<int>(4, 10)(rng) << 3) |
                                     mant(rng));
  return static_cast<std::uint8_t>((bit(rng) << 7) | (std::uniform_int_distribution<int>(12, 18)(rng) << 2) |
                                   (mant(rng) & 3));
}

enum class Scale { none, tensor, per_token, per_head_token };

/// One cache tensor [Hkv, L, d]: the codes and scale as written, and the dequantized values as F32.
struct Cache {
  st::tensor_out codes;
  std::vector<st::tensor_out> scale;  // zero or one tensor
  std::vector<double> dequantized;
};

Cache quantized_cache(const std::string& name, st::dtype type, Scale kind, int Hkv, int L, int d,
                      std::mt19937_64& rng) {
  std::uniform_real_distribution<double> factor(0.5, 1.5);
  const double base = type == st::dtype::I8 ? 1.0 / 64 : 0.25;
  Cache c;
  std::vector<double> scales;
  std::vector<std::int64_t> scale_shape;
  switch (kind) {
    case Scale::none:
      break;
    case Scale::tensor:
      scales = {static_cast<float>(base * factor(rng))}, scale_shape = {};
      break;
    case Scale::per_token:
      for (int j = 0; j < L; ++j) scales.push_back(static_cast<float>(base * factor(rng)));
      scale_shape = {L};
      break;
    case Scale::per_head_token:
      for (int i = 0; i < Hkv * L; ++i) scales.push_back(static_cast<float>(base * factor(rng)));
      scale_shape = {Hkv, L};
      break;
  }
  if (kind != Scale::none) c.scale.push_back(st::make_tensor(name + "_scale", scale_shape, scales, st::dtype::F32));
  c.codes = st::tensor_out{name, type, {Hkv, L, d}, {}};
  for (int h = 0; h < Hkv; ++h)
    for (int j = 0; j < L; ++j) {
      const float f = kind == Scale::none        ? 1.0f
                      : kind == Scale::tensor    ? static_cast<float>(scales[0])
                      : kind == Scale::per_token ? static_cast<float>(scales[static_cast<std::size_t>(j)])
                                                 : static_cast<float>(scales[static_cast<std::size_t>(h * L + j)]);
      for (int e = 0; e < d; ++e) {
        const std::uint8_t b = random_code(type, rng);
        c.codes.bytes.push_back(b);
        // Dequantized in float: the code's (exact) value times the factor, one rounding.
        c.dequantized.push_back(static_cast<double>(static_cast<float>(code_value(type, b)) * f));
      }
    }
  return c;
}

std::vector<std::int64_t> read_all(const fs::path& path, const std::string& name) {
  const st::file f = st::file::open(path.string());
  return f.read_i64(f.at(name));
}

std::string quote(const fs::path& p) { return "\"" + p.string() + "\""; }

}  // namespace

TEST_CASE("kvevict-select reads I8, F8_E4M3 and F8_E5M2 caches with their scales as F32 of the dequantized values",
          "[cli][quantized]") {
  std::mt19937_64 rng(20261202);
  const int H = 4, Hkv = 2, w = 6, d = 16, D = 24;
  std::normal_distribution<double> n(0.0, 1.0);
  int c = 0;
  for (st::dtype type : {st::dtype::I8, st::dtype::F8_E4M3, st::dtype::F8_E5M2})
    for (Scale kind : {Scale::none, Scale::tensor, Scale::per_token, Scale::per_head_token}) {
      const int L = 40 + 7 * c++;
      std::vector<st::tensor_out> quantized, dense;
      for (int layer = 0; layer < 2; ++layer) {
        const std::string p = "layers." + std::to_string(layer) + ".";
        std::vector<double> q(static_cast<std::size_t>(H * w * d)), wo(static_cast<std::size_t>(D * H * d));
        for (double& x : q) x = 1.5 * n(rng);
        for (double& x : wo) x = 0.2 * n(rng);
        for (auto* t : {&quantized, &dense}) {
          t->push_back(st::make_tensor(p + "q_window", {H, w, d}, q, st::dtype::F32));
          t->push_back(st::make_tensor(p + "w_o", {D, H * d}, wo, st::dtype::F32));
        }
        for (const char* name : {"keys", "values"}) {
          Cache cache = quantized_cache(p + name, type, kind, Hkv, L, d, rng);
          quantized.push_back(cache.codes);
          for (auto& s : cache.scale) quantized.push_back(s);
          dense.push_back(st::make_tensor(p + name, {Hkv, L, d}, cache.dequantized, st::dtype::F32));
        }
      }
      const fs::path qin = scratch() / "quantized.safetensors", din = scratch() / "dense.safetensors",
                     qout = scratch() / "quantized_out.safetensors", dout = scratch() / "dense_out.safetensors";
      st::write(qin.string(), quantized);
      st::write(din.string(), dense);
      for (const char* policy : {"snapkv", "adakv", "criticalkv", "defensivekv", "layer-defensivekv", "streamingllm"})
        for (const char* precision : {"f32", "f64"}) {
          const std::string args = std::string("--policy ") + policy + " --keep 0.3 --precision " + precision + " ";
          CAPTURE(st::dtype_name(type), static_cast<int>(kind), L, args);
          const Run rq = run_cli(args + quote(qin) + " " + quote(qout)),
                    rd = run_cli(args + quote(din) + " " + quote(dout));
          REQUIRE(rq.err.empty());
          REQUIRE(rq.status == 0);
          REQUIRE(rd.status == 0);
          for (const char* layer : {"layers.0.", "layers.1."})
            for (const char* t : {"kept_indices", "kept_offsets"})
              CHECK(read_all(qout, std::string(layer) + t) == read_all(dout, std::string(layer) + t));
        }
    }
}

TEST_CASE("kvevict-select refuses bad quantized caches and scales with one clear line", "[cli][quantized][errors]") {
  std::mt19937_64 rng(4);
  const int H = 2, Hkv = 1, w = 4, L = 20, d = 8;
  std::vector<double> q(static_cast<std::size_t>(H * w * d), 0.5);
  const auto qw = st::make_tensor("layers.0.q_window", {H, w, d}, q, st::dtype::F32);
  const Cache keys = quantized_cache("layers.0.keys", st::dtype::F8_E4M3, Scale::none, Hkv, L, d, rng);
  const fs::path in = scratch() / "bad_quantized.safetensors", out = scratch() / "bad_quantized_out.safetensors";
  const auto expect_failure = [&](const std::vector<st::tensor_out>& tensors, const std::string& needle) {
    st::write(in.string(), tensors);
    const Run r = run_cli("--policy snapkv --budget 5 " + quote(in) + " " + quote(out));
    CAPTURE(needle, r.err);
    CHECK(r.status != 0);
    CHECK(r.status < 128);
    CHECK(r.err.rfind("kvevict-select:", 0) == 0);
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
    CHECK(r.err.find(needle) != std::string::npos);
  };
  const auto scale = [](std::vector<std::int64_t> shape, std::vector<double> v, st::dtype t = st::dtype::F32) {
    return st::make_tensor("layers.0.keys_scale", shape, v, t);
  };
  SECTION("a scale on float keys") {
    expect_failure(
        {qw, st::make_tensor("layers.0.keys", {Hkv, L, d}, keys.dequantized, st::dtype::F32), scale({}, {2})},
        "layers.0.keys_scale is given and the cache is f32; expected scales only for quantized caches");
  }
  SECTION("a scale of the wrong dtype") {
    expect_failure({qw, keys.codes, scale({}, {2}, st::dtype::F16)}, "layers.0.keys_scale is f16; expected F32");
  }
  SECTION("a scale of the wrong shape") {
    expect_failure({qw, keys.codes, scale({L + 1}, std::vector<double>(L + 1, 1.0))},
                   "layers.0.keys_scale has shape [21]; expected []");
    expect_failure({qw, keys.codes, scale({2, L}, std::vector<double>(2 * L, 1.0))}, "[1, 20] (one per KV head");
  }
  SECTION("a non-finite scale") {
    expect_failure({qw, keys.codes, scale({L}, std::vector<double>(L, std::nan("")))}, "expected finite");
  }
  SECTION("a NaN code: the library names the entry") {
    Cache nan = keys;
    nan.codes.bytes[3] = 0x7F;  // e4m3 NaN
    expect_failure({qw, nan.codes}, "keys[0, 0, 3] is not finite");
  }
  SECTION("quantized queries are not a cache") {
    st::tensor_out q8{"layers.0.q_window", st::dtype::I8, {H, w, d}, std::vector<unsigned char>(H * w * d, 1)};
    expect_failure({q8, keys.codes}, "layers.0.q_window is i8: quantized codes are for the keys and values only");
  }
}

}  // namespace test_select_cli_quantized
