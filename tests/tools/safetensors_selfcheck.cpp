// The safetensors reader/writer of tools/ (tools/safetensors/): round trips for every dtype, exact half/bfloat16
// conversions, every malformed-input case, and a mutation fuzz that must only ever produce safetensors::error.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "tools/safetensors/convert.hpp"
#include "tools/safetensors/dtype.hpp"
#include "tools/safetensors/reader.hpp"
#include "tools/safetensors/writer.hpp"

namespace st = safetensors;

namespace {

// Runs `f`, which must throw st::error whose one-line message contains every substring in `needles`. Returns what
// went wrong, or "" when it did just that.
template <class F>
std::string error_problem(F&& f, std::initializer_list<const char*> needles) {
  try {
    f();
  } catch (const st::error& e) {
    const std::string msg = e.what();
    if (msg.find('\n') != std::string::npos || msg.find('\r') != std::string::npos)
      return "message spans lines: " + msg;
    for (const char* needle : needles)
      if (msg.find(needle) == std::string::npos) return "message lacks [" + std::string(needle) + "]: " + msg;
    return "";
  } catch (const std::exception& e) {
    return std::string("threw a non-safetensors exception: ") + e.what();
  }
  return "did not throw";
}

#define EXPECT_ERROR(expr, ...)                                                                 \
  do {                                                                                          \
    const std::string expect_error_problem = error_problem([&] { (void)(expr); }, __VA_ARGS__); \
    INFO(#expr);                                                                                \
    CHECK(expect_error_problem == "");                                                          \
  } while (0)

std::vector<unsigned char> with_length(std::uint64_t n, const std::string& header, std::size_t data_len) {
  std::vector<unsigned char> out;
  for (int b = 0; b < 8; ++b) out.push_back(static_cast<unsigned char>((n >> (8 * b)) & 0xFFu));
  out.insert(out.end(), header.begin(), header.end());
  out.resize(out.size() + data_len, 0);
  return out;
}

std::vector<unsigned char> make_file(const std::string& header, std::size_t data_len) {
  return with_length(header.size(), header, data_len);
}

const char* const kSrc = "case.safetensors";
const std::string ok_entry = R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})";

st::file parse_header(const std::string& header, std::size_t data_len) {
  return st::file::parse(make_file(header, data_len), kSrc);
}

std::uint32_t bits_of(float f) {
  std::uint32_t bits = 0;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

std::string hex(unsigned v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%04x", v);
  return buf;
}

bool same_double(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return a == b && std::signbit(a) == std::signbit(b);
}

std::uint16_t stored_u16(const st::tensor_out& t, std::size_t i) { return st::detail::load_u16(&t.bytes[2 * i]); }

struct rng {
  std::uint64_t s = 0x9E3779B97F4A7C15ull;
  std::uint64_t next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
  }
  std::size_t below(std::size_t n) { return static_cast<std::size_t>(next() % n); }
};

// Exact value of a binary16 pattern computed independently of the library (ldexp).
double half_reference(std::uint16_t h) {
  const int exp = (h >> 10) & 0x1F;
  const int man = h & 0x3FF;
  double mag;
  if (exp == 0x1F) {
    mag = man ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else if (exp == 0) {
    mag = std::ldexp(static_cast<double>(man), -24);
  } else {
    mag = std::ldexp(static_cast<double>(man + 1024), exp - 25);
  }
  return (h & 0x8000) ? -mag : mag;
}

}  // namespace

// ---- F16 / BF16 conversions ----

TEST_CASE("F16 decode and encode of known bit patterns", "[safetensors]") {
  using st::detail::double_to_half_bits;
  using st::detail::half_bits_to_float;
  // decode known patterns
  CHECK(half_bits_to_float(0x3C00) == 1.0f);
  CHECK(half_bits_to_float(0xC000) == -2.0f);
  CHECK(half_bits_to_float(0x0001) == std::ldexp(1.0f, -24));
  CHECK(half_bits_to_float(0x8001) == -std::ldexp(1.0f, -24));
  CHECK(half_bits_to_float(0x03FF) == std::ldexp(1023.0f, -24));
  CHECK(half_bits_to_float(0x0400) == std::ldexp(1.0f, -14));
  CHECK(half_bits_to_float(0x7BFF) == 65504.0f);
  CHECK(half_bits_to_float(0x7C00) == std::numeric_limits<float>::infinity());
  CHECK(half_bits_to_float(0xFC00) == -std::numeric_limits<float>::infinity());
  CHECK(std::isnan(half_bits_to_float(0x7E00)));
  CHECK(std::isnan(half_bits_to_float(0x7C01)));
  CHECK(bits_of(half_bits_to_float(0x7E00)) == 0x7FC00000u);
  CHECK(bits_of(half_bits_to_float(0x0000)) == 0x00000000u);
  CHECK(bits_of(half_bits_to_float(0x8000)) == 0x80000000u);
  CHECK(half_bits_to_float(0x3555) == 1365.0f / 4096.0f);  // nearest half to 1/3
  // encode known values (round to nearest even)
  CHECK(double_to_half_bits(1.0) == 0x3C00);
  CHECK(double_to_half_bits(-2.0) == 0xC000);
  CHECK(double_to_half_bits(0.0) == 0x0000);
  CHECK(double_to_half_bits(-0.0) == 0x8000);
  CHECK(double_to_half_bits(std::ldexp(1.0, -24)) == 0x0001);
  CHECK(double_to_half_bits(std::ldexp(1.0, -14)) == 0x0400);
  CHECK(double_to_half_bits(std::ldexp(1023.0, -24)) == 0x03FF);
  CHECK(double_to_half_bits(std::ldexp(1.0, -25)) == 0x0000);                // tie -> even (0)
  CHECK(double_to_half_bits(std::ldexp(1.0000001, -25)) == 0x0001);          // just above the tie
  CHECK(double_to_half_bits(std::ldexp(3.0, -25)) == 0x0002);                // tie 1|2 -> 2
  CHECK(double_to_half_bits(std::ldexp(5.0, -25)) == 0x0002);                // tie 2|3 -> 2
  CHECK(double_to_half_bits(std::ldexp(2047.0, -25)) == 0x0400);             // tie 0x3FF|0x400 -> 0x400
  CHECK(double_to_half_bits(1.0 + std::ldexp(1.0, -11)) == 0x3C00);          // tie -> even
  CHECK(double_to_half_bits(1.0 + 3 * std::ldexp(1.0, -11)) == 0x3C02);      // tie -> even (up)
  CHECK(double_to_half_bits(1.0 + std::ldexp(1.0, -11) + 1e-12) == 0x3C01);  // above tie
  CHECK(double_to_half_bits(0.1) == 0x2E66);
  CHECK(double_to_half_bits(1.0 / 3.0) == 0x3555);
  CHECK(double_to_half_bits(65504.0) == 0x7BFF);
  CHECK(double_to_half_bits(65519.99) == 0x7BFF);
  CHECK(double_to_half_bits(65520.0) == 0x7C00);  // tie between 65504 and 65536 -> even -> inf
  CHECK(double_to_half_bits(-1e10) == 0xFC00);
  CHECK(double_to_half_bits(std::numeric_limits<double>::infinity()) == 0x7C00);
  CHECK(double_to_half_bits(-std::numeric_limits<double>::infinity()) == 0xFC00);
  CHECK(double_to_half_bits(std::numeric_limits<double>::quiet_NaN()) == 0x7E00);
  CHECK(double_to_half_bits(std::numeric_limits<double>::denorm_min()) == 0x0000);
  CHECK(double_to_half_bits(-std::numeric_limits<double>::denorm_min()) == 0x8000);
  CHECK(double_to_half_bits(std::numeric_limits<double>::max()) == 0x7C00);
  // double rounding trap: just above a half tie as a double, exactly on it once rounded to float
  CHECK(double_to_half_bits(1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -40)) == 0x3C01);
}

TEST_CASE("F16 every pattern: exact decode, round trip, midpoints round to even", "[safetensors]") {
  using st::detail::double_to_half_bits;
  using st::detail::half_bits_to_float;
  // exhaustive: decode matches an independent reference, and decode->encode is the identity (NaNs stay NaNs)
  bool all_ok = true;
  for (std::uint32_t h = 0; h <= 0xFFFFu; ++h) {
    const auto h16 = static_cast<std::uint16_t>(h);
    const float f = half_bits_to_float(h16);
    if (!same_double(static_cast<double>(f), half_reference(h16))) {
      FAIL_CHECK("half decode differs from reference: pattern " << hex(h));
      all_ok = false;
      break;
    }
    const std::uint16_t back = double_to_half_bits(static_cast<double>(f));
    const bool is_nan = (h & 0x7C00u) == 0x7C00u && (h & 0x3FFu) != 0;
    const bool ok = is_nan ? ((back & 0x7C00u) == 0x7C00u && (back & 0x3FFu) != 0 && (back & 0x8000u) == (h & 0x8000u))
                           : back == h16;
    if (!ok) {
      FAIL_CHECK("half round trip failed: pattern " << hex(h) << " -> " << hex(back));
      all_ok = false;
      break;
    }
    // midpoint to the next pattern (same sign, finite, below max): rounds to the even of the two
    if (!is_nan && (h & 0x7FFFu) < 0x7BFFu) {
      const double next = half_reference(static_cast<std::uint16_t>(h + 1));
      const double mid = (static_cast<double>(f) + next) / 2;
      const std::uint16_t even = (h & 1u) ? static_cast<std::uint16_t>(h + 1) : h16;
      if (double_to_half_bits(mid) != even) {
        FAIL_CHECK("half midpoint does not round to even: pattern " << hex(h));
        all_ok = false;
        break;
      }
    }
  }
  CHECK(all_ok);
}

TEST_CASE("BF16 decode and encode of known bit patterns", "[safetensors]") {
  using st::detail::bf16_bits_to_float;
  using st::detail::double_to_bf16_bits;
  CHECK(bf16_bits_to_float(0x3F80) == 1.0f);
  CHECK(bf16_bits_to_float(0xC000) == -2.0f);
  CHECK(bf16_bits_to_float(0x0001) == std::ldexp(1.0f, -133));   // smallest subnormal
  CHECK(bf16_bits_to_float(0x0080) == std::ldexp(1.0f, -126));   // smallest normal
  CHECK(bf16_bits_to_float(0x7F7F) == std::ldexp(255.0f, 120));  // largest finite: 0x1.fep127
  CHECK(bf16_bits_to_float(0x7F80) == std::numeric_limits<float>::infinity());
  CHECK(bf16_bits_to_float(0xFF80) == -std::numeric_limits<float>::infinity());
  CHECK(std::isnan(bf16_bits_to_float(0x7FC0)));
  CHECK(bits_of(bf16_bits_to_float(0x8000)) == 0x80000000u);
  CHECK(double_to_bf16_bits(1.0) == 0x3F80);
  CHECK(double_to_bf16_bits(-2.0) == 0xC000);
  CHECK(double_to_bf16_bits(3.14159265358979) == 0x4049);
  CHECK(double_to_bf16_bits(1.0 + std::ldexp(1.0, -8)) == 0x3F80);      // tie -> even
  CHECK(double_to_bf16_bits(1.0 + 3 * std::ldexp(1.0, -8)) == 0x3F82);  // tie -> even (up)
  CHECK(double_to_bf16_bits(std::ldexp(1.0, -133)) == 0x0001);
  CHECK(double_to_bf16_bits(std::ldexp(1.0, -134)) == 0x0000);  // tie -> even (0)
  CHECK(double_to_bf16_bits(std::ldexp(3.0, -134)) == 0x0002);
  CHECK(double_to_bf16_bits(0x1.fep127) == 0x7F7F);
  CHECK(double_to_bf16_bits(0x1.fefffffp127) == 0x7F7F);
  CHECK(double_to_bf16_bits(0x1.ffp127) == 0x7F80);  // tie above max -> inf
  CHECK(double_to_bf16_bits(std::numeric_limits<double>::infinity()) == 0x7F80);
  CHECK(double_to_bf16_bits(-std::numeric_limits<double>::infinity()) == 0xFF80);
  CHECK(double_to_bf16_bits(std::numeric_limits<double>::quiet_NaN()) == 0x7FC0);
  CHECK(double_to_bf16_bits(-0.0) == 0x8000);
  // double rounding trap: x rounds to a bf16 tie when first rounded to float, but is above it in double
  CHECK(double_to_bf16_bits(1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -40)) == 0x3F81);
}

TEST_CASE("BF16 every pattern round trips", "[safetensors]") {
  using st::detail::bf16_bits_to_float;
  using st::detail::double_to_bf16_bits;
  bool all_ok = true;
  for (std::uint32_t b = 0; b <= 0xFFFFu; ++b) {
    const auto b16 = static_cast<std::uint16_t>(b);
    const float f = bf16_bits_to_float(b16);
    const std::uint16_t back = double_to_bf16_bits(static_cast<double>(f));
    const bool is_nan = (b & 0x7F80u) == 0x7F80u && (b & 0x7Fu) != 0;
    const bool ok = is_nan ? std::isnan(bf16_bits_to_float(back)) : back == b16;
    if (!ok || bits_of(f) != (b << 16)) {
      FAIL_CHECK("bf16 round trip failed: pattern " << hex(b) << " -> " << hex(back));
      all_ok = false;
      break;
    }
  }
  CHECK(all_ok);
}

// The generic encoder instantiated as binary32 must agree bit-for-bit with the hardware double->float conversion.
TEST_CASE("encode_ieee<8, 23> agrees with the hardware double to float conversion", "[safetensors]") {
  rng r;
  int mismatches = 0;
  for (int i = 0; i < 2000000 && mismatches < 5; ++i) {
    std::uint64_t bits = r.next();
    // concentrate exponents around the float range (normal, subnormal, overflow, underflow)
    const std::uint64_t exp = 1023 - 160 + (r.next() % 300);
    bits = (bits & 0x800FFFFFFFFFFFFFull) | (exp << 52);
    if (i % 7 == 0) bits &= ~((std::uint64_t{1} << (r.next() % 40)) - 1u);  // more ties and exact values
    double d = 0;
    std::memcpy(&d, &bits, 8);
    const std::uint32_t mine = st::detail::encode_ieee<8, 23>(d);
    const std::uint32_t hw = bits_of(st::detail::narrow_to_float(d));
    if (mine != hw) {
      ++mismatches;
      char buf[96];
      std::snprintf(buf, sizeof buf, "double %a: mine 0x%08x, hardware 0x%08x", d, mine, hw);
      FAIL_CHECK("encode_ieee<8,23> differs from hardware conversion: " << buf);
    }
  }
  CHECK(mismatches == 0);
  CHECK(st::detail::narrow_to_float(1e300) == std::numeric_limits<float>::infinity());
  CHECK(st::detail::narrow_to_float(-1e300) == -std::numeric_limits<float>::infinity());
  CHECK(st::detail::narrow_to_float(0x1.fffffefp127) == std::numeric_limits<float>::max());
  CHECK(st::detail::narrow_to_float(0x1.ffffffp127) == std::numeric_limits<float>::infinity());
  CHECK(st::detail::encode_ieee<8, 23>(0x1.fffffefp127) == 0x7F7FFFFFu);
  CHECK(st::detail::encode_ieee<8, 23>(0x1.ffffffp127) == 0x7F800000u);
}

// ---- round trips ----

namespace {

// One tensor of every dtype (and a scalar, an empty tensor and an odd name), with the values they were made from.
struct sample {
  std::vector<double> f64_values, f32_values, f16_values, bf16_values;
  std::vector<std::uint16_t> f16_bits, bf16_bits;
  std::vector<std::int64_t> i64_values;
  st::tensor_out u8, flags, i32;
  std::vector<st::tensor_out> out;
  std::map<std::string, std::string> meta;
};

sample make_sample() {
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  sample s;
  s.f64_values = {0.0,
                  -0.0,
                  1.0,
                  -2.5,
                  1e300,
                  -1e-300,
                  std::numeric_limits<double>::denorm_min(),
                  inf,
                  -inf,
                  nan,
                  0.1,
                  3.141592653589793};
  s.f32_values = {0.0,
                  -0.0,
                  1.0,
                  -2.5,
                  0.1,
                  static_cast<double>(std::numeric_limits<float>::max()),
                  static_cast<double>(std::numeric_limits<float>::denorm_min()),
                  inf,
                  -inf,
                  nan,
                  1e300,
                  1e-300};
  // F16 / BF16 values given as the doubles of known patterns
  s.f16_values = {
      1.0, std::ldexp(1.0, -24), -std::ldexp(1.0, -24), std::ldexp(1023.0, -24), 65504.0, inf, -inf, nan, -0.0, 0.1};
  s.f16_bits = {0x3C00, 0x0001, 0x8001, 0x03FF, 0x7BFF, 0x7C00, 0xFC00, 0x7E00, 0x8000, 0x2E66};
  s.bf16_values = {1.0, std::ldexp(1.0, -133), 0x1.fep127, inf, -inf, nan, -0.0, 3.14159265358979};
  s.bf16_bits = {0x3F80, 0x0001, 0x7F7F, 0x7F80, 0xFF80, 0x7FC0, 0x8000, 0x4049};
  s.i64_values = {0, 1, -1, std::numeric_limits<std::int64_t>::min(), std::numeric_limits<std::int64_t>::max(), 42};

  s.out.push_back(st::make_tensor("f16", {2, 5}, s.f16_values, st::dtype::F16));
  s.out.push_back(st::make_tensor("f64", {3, 4}, s.f64_values, st::dtype::F64));
  s.out.push_back(st::make_tensor("bf16", {8}, s.bf16_values, st::dtype::BF16));
  s.out.push_back(st::make_tensor("f32", {12}, s.f32_values, st::dtype::F32));
  s.out.push_back(st::make_tensor_i64("i64", {2, 3}, s.i64_values));
  s.u8 = st::tensor_out{"u8", st::dtype::U8, {3}, {0, 127, 255}};
  s.out.push_back(s.u8);
  s.flags = st::tensor_out{"flags", st::dtype::BOOL, {2, 2}, {1, 0, 0, 1}};
  s.out.push_back(s.flags);
  s.i32 = st::tensor_out{"i32", st::dtype::I32, {3}, std::vector<unsigned char>(12)};
  const std::int32_t i32_values[3] = {-7, std::numeric_limits<std::int32_t>::min(),
                                      std::numeric_limits<std::int32_t>::max()};
  std::memcpy(s.i32.bytes.data(), i32_values, sizeof i32_values);
  s.out.push_back(s.i32);
  s.out.push_back(st::make_tensor("scalar", {}, {2.0}, st::dtype::F32));
  s.out.push_back(st::make_tensor("empty", {0, 3}, {}, st::dtype::F16));
  s.out.push_back(st::make_tensor("odd\nname \xc3\xa9", {1}, {5.0}, st::dtype::BF16));
  s.meta = {{"format", "pt"}, {"note", "x\"y\\z \xe2\x82\xac"}};
  return s;
}

}  // namespace

TEST_CASE("make_tensor stores the known F16 and BF16 bit patterns", "[safetensors]") {
  const sample s = make_sample();
  for (std::size_t i = 0; i < s.f16_bits.size(); ++i) CHECK(stored_u16(s.out[0], i) == s.f16_bits[i]);
  for (std::size_t i = 0; i < s.bf16_bits.size(); ++i) CHECK(stored_u16(s.out[2], i) == s.bf16_bits[i]);
}

TEST_CASE("every dtype round trips through serialize and parse", "[safetensors]") {
  const sample s = make_sample();
  const std::vector<unsigned char> bytes = st::serialize(s.out, s.meta);
  const std::uint64_t n = st::detail::load_u64(bytes.data());
  CHECK(n % 8 == 0);
  CHECK(bytes[8] == '{');
  CHECK((bytes[8 + n - 1] == ' ' || bytes[8 + n - 1] == '}'));

  const st::file f = st::file::parse(bytes, "roundtrip");
  CHECK(f.metadata() == s.meta);
  CHECK(f.tensors().size() == s.out.size());
  for (std::size_t i = 1; i < f.tensors().size(); ++i) CHECK(f.tensors()[i - 1].begin <= f.tensors()[i].begin);
  for (const st::tensor_info& t : f.tensors()) {
    CHECK(t.begin % st::dtype_size(t.type) == 0);  // natural alignment within the data section
    CHECK((8 + n + t.begin) % st::dtype_size(t.type) == 0);
  }

  const auto check_floats = [&](const char* name, const std::vector<double>& expect, bool via_float) {
    INFO("tensor " << name);
    const st::tensor_info& t = f.at(name);
    const std::vector<double> d = f.read_floats<double>(t);
    const std::vector<float> v = f.read_floats<float>(t);
    CHECK((d.size() == expect.size() && v.size() == expect.size()));
    for (std::size_t i = 0; i < expect.size() && i < d.size() && i < v.size(); ++i) {
      const double want = via_float ? static_cast<double>(st::detail::narrow_to_float(expect[i])) : expect[i];
      if (!same_double(d[i], want)) {
        char buf[128];
        std::snprintf(buf, sizeof buf, "%s[%zu]: got %a want %a", name, i, d[i], want);
        FAIL_CHECK("read_floats<double> mismatch: " << buf);
      }
      CHECK(same_double(static_cast<double>(v[i]), static_cast<double>(st::detail::narrow_to_float(want))));
    }
  };
  check_floats("f64", s.f64_values, false);
  check_floats("f32", s.f32_values, true);
  // F16/BF16 read back as the exact values of the stored patterns (0.1 and pi are not representable)
  std::vector<double> f16_exact, bf16_exact;
  for (const std::uint16_t h : s.f16_bits) f16_exact.push_back(half_reference(h));
  for (const std::uint16_t b : s.bf16_bits)
    bf16_exact.push_back(static_cast<double>(st::detail::bf16_bits_to_float(b)));
  CHECK((f16_exact[9] == 0x1.998p-4 && bf16_exact[7] == 0x1.92p+1));
  check_floats("f16", f16_exact, false);
  check_floats("bf16", bf16_exact, false);
  check_floats("scalar", {2.0}, false);
  check_floats("empty", {}, false);
  CHECK(f.at("f64").shape == (std::vector<std::int64_t>{3, 4}));
  CHECK(f.at("f64").numel() == 12);
  CHECK((f.at("scalar").shape.empty() && f.at("scalar").numel() == 1));
  CHECK((f.at("empty").numel() == 0 && f.at("empty").begin == f.at("empty").end));
  CHECK(f.find("odd\nname \xc3\xa9") != nullptr);
  CHECK(f.find("nope") == nullptr);

  CHECK(f.read_i64(f.at("i64")) == s.i64_values);
  CHECK(f.read_i64(f.at("i32")) == (std::vector<std::int64_t>{-7, std::numeric_limits<std::int32_t>::min(),
                                                              std::numeric_limits<std::int32_t>::max()}));
  const st::tensor_info& tu8 = f.at("u8");
  CHECK((tu8.type == st::dtype::U8 && tu8.end - tu8.begin == 3));
  CHECK(std::memcmp(f.raw(tu8), s.u8.bytes.data(), 3) == 0);
  const st::tensor_info& tb = f.at("flags");
  CHECK((tb.type == st::dtype::BOOL && std::memcmp(f.raw(tb), s.flags.bytes.data(), 4) == 0));
  CHECK(std::memcmp(f.raw(f.at("i32")), s.i32.bytes.data(), 12) == 0);
}

TEST_CASE("reader API errors on a valid file", "[safetensors]") {
  const sample s = make_sample();
  const st::file f = st::file::parse(st::serialize(s.out, s.meta), "roundtrip");
  EXPECT_ERROR(f.at("nope"), {"missing tensor 'nope' in roundtrip"});
  EXPECT_ERROR(f.read_floats<float>(f.at("i64")), {"roundtrip", "tensor 'i64'", "I64", "not floating point"});
  EXPECT_ERROR(f.read_floats<double>(f.at("flags")), {"tensor 'flags'", "BOOL", "not floating point"});
  EXPECT_ERROR(f.read_i64(f.at("f32")), {"tensor 'f32'", "F32", "expected I64"});
  st::tensor_info foreign = f.at("f64");
  foreign.end = foreign.begin + 1000000;
  EXPECT_ERROR(f.read_floats<double>(foreign), {"tensor 'f64'", "does not fit"});
  foreign = f.at("f64");
  foreign.begin = foreign.end + 8;
  EXPECT_ERROR(f.raw(foreign), {"does not fit"});
}

TEST_CASE("I64 and I32: known little-endian bit patterns, I32 widened, byte ranges of the wrong size",
          "[safetensors]") {
  const std::string header =
      R"({"a":{"dtype":"I64","shape":[3],"data_offsets":[0,24]},"b":{"dtype":"I32","shape":[3],"data_offsets":[24,36]}})";
  std::vector<unsigned char> bytes = make_file(header, 36);
  const std::vector<unsigned char> a_bytes = {0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01,   // 0x0102030405060708
                                              0xFE, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF,   // -2
                                              0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x80};  // INT64_MIN
  const std::vector<unsigned char> b_bytes = {0x04, 0x03, 0x02, 0x01,                           // 0x01020304
                                              0xFF, 0xFF, 0xFF, 0xFF,                           // -1
                                              0x00, 0x00, 0x00, 0x80};                          // INT32_MIN
  const std::size_t data = 8 + header.size();
  std::copy(a_bytes.begin(), a_bytes.end(), bytes.begin() + static_cast<std::ptrdiff_t>(data));
  std::copy(b_bytes.begin(), b_bytes.end(), bytes.begin() + static_cast<std::ptrdiff_t>(data + 24));
  const st::file f = st::file::parse(bytes, kSrc);
  const std::vector<std::int64_t> a = {0x0102030405060708, -2, std::numeric_limits<std::int64_t>::min()};
  CHECK(f.read_i64(f.at("a")) == a);
  CHECK(f.read_i64(f.at("b")) ==
        (std::vector<std::int64_t>{0x01020304, -1, std::numeric_limits<std::int32_t>::min()}));  // sign-extended
  CHECK(st::make_tensor_i64("a", {3}, a).bytes == a_bytes);
  CHECK(st::make_tensor_i64("a", {3, 1}, a).shape == (std::vector<std::int64_t>{3, 1}));
  EXPECT_ERROR(f.read_floats<double>(f.at("b")), {"tensor 'b'", "I32", "not floating point"});
  st::tensor_info foreign = f.at("a");
  foreign.end = foreign.begin + 12;  // not a whole number of I64 elements
  EXPECT_ERROR(f.read_i64(foreign), {"tensor 'a'", "does not fit"});
  // Byte ranges that disagree with the shape, or lie beyond the data.
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"I64","shape":[2],"data_offsets":[0,12]}})", 16),
               {"tensor 't'", "span 12 bytes", "expected 16 bytes"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"I64","shape":[2],"data_offsets":[0,8]}})", 16),
               {"tensor 't'", "span 8 bytes", "expected 16 bytes"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"I32","shape":[2,2],"data_offsets":[0,8]}})", 16),
               {"tensor 't'", "span 8 bytes", "expected 16 bytes"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"I32","shape":[3],"data_offsets":[0,16]}})", 16),
               {"tensor 't'", "span 16 bytes", "expected 12 bytes"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})", 4),
               {"tensor 't'", "beyond the data section of 4 bytes"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"I64","shape":[4611686018427387904],"data_offsets":[0,8]}})", 8),
               {"tensor 't'", "byte size", "overflows"});
  EXPECT_ERROR(st::make_tensor_i64("x", {2, 2}, {1, 2, 3}), {"tensor 'x'", "got 3 values", "expected 4"});
}

TEST_CASE("dtype names and sizes", "[safetensors]") {
  CHECK(std::string(st::dtype_name(st::dtype::BF16)) == "BF16");
  CHECK((st::dtype_size(st::dtype::F64) == 8 && st::dtype_size(st::dtype::BF16) == 2 &&
         st::dtype_size(st::dtype::BOOL) == 1));
  // The quantized cache codes: one byte each, parsed from their safetensors names.
  for (st::dtype t : {st::dtype::I8, st::dtype::F8_E4M3, st::dtype::F8_E5M2}) {
    const std::string name = st::dtype_name(t);
    CHECK(st::dtype_size(t) == 1);
    const st::file parsed =
        parse_header("{\"t\":{\"dtype\":\"" + name + "\",\"shape\":[2,3],\"data_offsets\":[0,6]}}", 8);
    REQUIRE(parsed.tensors().size() == 1);
    CHECK(parsed.tensors()[0].type == t);
  }
  CHECK(std::string(st::dtype_name(st::dtype::F8_E4M3)) == "F8_E4M3");
}

TEST_CASE("writer errors", "[safetensors]") {
  const sample s = make_sample();
  EXPECT_ERROR(st::make_tensor("x", {2, 2}, {1.0, 2.0}, st::dtype::F32), {"tensor 'x'", "got 2 values", "expected 4"});
  EXPECT_ERROR(st::make_tensor("x", {1}, {1.0}, st::dtype::I64), {"tensor 'x'", "not floating point"});
  EXPECT_ERROR(st::make_tensor("x", {-1}, {}, st::dtype::F32), {"tensor 'x'", "negative"});
  EXPECT_ERROR(st::make_tensor("x", {std::int64_t{1} << 62, 4}, {}, st::dtype::F32), {"tensor 'x'", "overflow"});
  EXPECT_ERROR(st::make_tensor_i64("x", {3}, {1}), {"tensor 'x'", "expected 3"});
  EXPECT_ERROR(st::serialize({s.out[0], s.out[0]}), {"tensor 'f16'", "duplicate"});
  EXPECT_ERROR(st::serialize({st::tensor_out{"__metadata__", st::dtype::U8, {}, {1}}}), {"reserved"});
  EXPECT_ERROR(st::serialize({st::tensor_out{"t", st::dtype::F32, {2}, {1, 2, 3}}}),
               {"tensor 't'", "3 bytes", "expected"});
  EXPECT_ERROR(st::serialize({st::tensor_out{"bad\xff", st::dtype::U8, {}, {1}}}), {"UTF-8"});
}

TEST_CASE("file I/O: write, open, a large file, an empty file, and their errors", "[safetensors]") {
  const sample s = make_sample();
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "kvevict_safetensors_selfcheck";
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "model.safetensors").string();
  st::write(path, s.out, s.meta);
  {
    const st::file g = st::file::open(path);
    CHECK(g.metadata() == s.meta);
    CHECK(g.read_i64(g.at("i64")) == s.i64_values);
    CHECK(g.tensors().size() == s.out.size());
    EXPECT_ERROR(g.at("zzz"), {"missing tensor 'zzz' in ", "model.safetensors"});
  }
  // a file larger than the read chunk
  {
    std::vector<double> big(300000);
    for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<double>(i % 1000) - 500.0;
    const std::string big_path = (dir / "big.safetensors").string();
    st::write(big_path, {st::make_tensor("big", {300, 1000}, big, st::dtype::F32)});
    const st::file g = st::file::open(big_path);
    CHECK(g.read_floats<double>(g.at("big")) == big);
  }
  // empty file list: header "{}" padded
  const std::string empty_path = (dir / "empty.safetensors").string();
  st::write(empty_path, {});
  CHECK(st::file::open(empty_path).tensors().empty());
  EXPECT_ERROR(st::file::open((dir / "does_not_exist").string()), {"does_not_exist", "cannot open"});
  EXPECT_ERROR(st::file::open(dir.string()), {"is a directory"});
  EXPECT_ERROR(st::write((dir / "no_such_dir" / "x.safetensors").string(), s.out),
               {"no_such_dir", "cannot open for writing"});
  if (std::filesystem::exists("/dev/full")) EXPECT_ERROR(st::write("/dev/full", s.out), {"/dev/full", "write failed"});
  if (std::filesystem::exists("/dev/null")) EXPECT_ERROR(st::file::open("/dev/null"), {"not a regular file"});
  {
    std::FILE* fp = std::fopen((dir / "short.safetensors").string().c_str(), "wb");
    CHECK(fp != nullptr);
    if (fp) {
      std::fwrite("abc", 1, 3, fp);
      std::fclose(fp);
    }
    EXPECT_ERROR(st::file::open((dir / "short.safetensors").string()), {"short.safetensors", "shorter than 8 bytes"});
  }
  std::filesystem::remove_all(dir);
}

// ---- malformed input ----

TEST_CASE("parse accepts valid oddities: whitespace, unknown fields however nested, gaps, empty tensors",
          "[safetensors]") {
  // sanity: the base case parses
  CHECK(parse_header("{\"t\":" + ok_entry + "}", 8).tensors().size() == 1);
  CHECK(parse_header("{}", 0).tensors().empty());
  CHECK(parse_header("  {}   ", 0).tensors().empty());
  CHECK(parse_header("{\"__metadata__\":{}}", 0).metadata().empty());
  // unknown fields in a tensor entry are ignored, however nested
  CHECK(
      parse_header(
          R"({"t":{"x":[{"a":[1,{"b":null}]}],"dtype":"F32","y":{"dtype":3},"shape":[2],"data_offsets":[0,8],"z":"s"}})",
          8)
          .at("t")
          .numel() == 2);
  CHECK(parse_header("{\"t\":{\"deep\":" + std::string(100000, '[') + std::string(100000, ']') +
                         R"(,"dtype":"U8","shape":[],"data_offsets":[0,1]}})",
                     1)
            .at("t")
            .numel() == 1);
  // gaps are allowed, empty tensors anywhere
  CHECK(
      parse_header(
          R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[4,5]},"b":{"dtype":"U8","shape":[0],"data_offsets":[4,4]},"c":{"dtype":"U8","shape":[0,7],"data_offsets":[9,9]}})",
          9)
          .tensors()
          .size() == 3);
}

TEST_CASE("malformed: file too short, header length beyond the file or the limit", "[safetensors]") {
  // file shorter than 8 bytes
  EXPECT_ERROR(st::file::parse({}, kSrc), {kSrc, "0 bytes", "shorter than 8 bytes"});
  EXPECT_ERROR(st::file::parse({1, 0, 0, 0, 0, 0, 0}, kSrc), {kSrc, "7 bytes", "shorter than 8 bytes"});
  // header length larger than the file / the limit
  EXPECT_ERROR(st::file::parse(with_length(100, "{}", 0), kSrc), {kSrc, "header length 100", "exceeds the file size"});
  EXPECT_ERROR(st::file::parse(with_length(3, "{}", 0), kSrc), {kSrc, "header length 3", "exceeds the file size"});
  EXPECT_ERROR(st::file::parse(with_length(100000001, "{}", 0), kSrc), {kSrc, "exceeds the limit of 100000000"});
  EXPECT_ERROR(st::file::parse(with_length(std::numeric_limits<std::uint64_t>::max(), "{}", 0), kSrc),
               {kSrc, "18446744073709551615", "exceeds the limit"});
}

TEST_CASE("malformed: header not valid JSON", "[safetensors]") {
  EXPECT_ERROR(parse_header("", 0), {kSrc, "not valid JSON"});
  EXPECT_ERROR(parse_header("{", 0), {kSrc, "not valid JSON"});
  EXPECT_ERROR(parse_header("{\"t\":}", 0), {kSrc, "not valid JSON"});
  EXPECT_ERROR(parse_header("xyz", 0), {kSrc, "not valid JSON"});
  EXPECT_ERROR(parse_header("{} x", 0), {kSrc, "not valid JSON"});
  EXPECT_ERROR(parse_header("{}{}", 0), {kSrc, "not valid JSON"});
  EXPECT_ERROR(parse_header("{\"__metadata__\":{},}", 0), {kSrc, "not valid JSON"});
  EXPECT_ERROR(parse_header(std::string("{\"\xff\":1}"), 0), {kSrc, "not valid JSON"});  // invalid UTF-8
  EXPECT_ERROR(parse_header(std::string("{\0}", 3), 0), {kSrc, "not valid JSON"});
  EXPECT_ERROR(parse_header("{\"t\":{\"dtype\":\"F32\",\"shape\":[1e400]}}", 0), {kSrc, "not valid JSON"});
  EXPECT_ERROR(parse_header(std::string(200000, '['), 0), {kSrc, "not"});
}

TEST_CASE("malformed: header or tensor entry not an object", "[safetensors]") {
  // header not a JSON object
  EXPECT_ERROR(parse_header("[]", 0), {kSrc, "not a JSON object", "got an array"});
  EXPECT_ERROR(parse_header("3", 0), {kSrc, "not a JSON object", "got a number"});
  EXPECT_ERROR(parse_header("\"s\"", 0), {kSrc, "not a JSON object", "got a string"});
  EXPECT_ERROR(parse_header("null", 0), {kSrc, "not a JSON object", "got null"});
  EXPECT_ERROR(parse_header(std::string(200000, '[') + std::string(200000, ']'), 0), {kSrc, "not a JSON object"});
  // tensor entry not an object
  EXPECT_ERROR(parse_header(R"({"t":3})", 0), {kSrc, "tensor 't'", "not an object", "expected"});
  EXPECT_ERROR(parse_header(R"({"t":[]})", 0), {kSrc, "tensor 't'", "not an object"});
  EXPECT_ERROR(parse_header(R"({"t":"F32"})", 0), {kSrc, "tensor 't'", "not an object"});
  EXPECT_ERROR(parse_header(R"({"t":null})", 0), {kSrc, "tensor 't'", "not an object"});
}

TEST_CASE("malformed: missing and ill-typed fields", "[safetensors]") {
  // missing fields
  EXPECT_ERROR(parse_header(R"({"t":{"shape":[2],"data_offsets":[0,8]}})", 8),
               {kSrc, "tensor 't'", "missing field 'dtype'"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"F32","data_offsets":[0,8]}})", 8),
               {kSrc, "tensor 't'", "missing field 'shape'"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"F32","shape":[2]}})", 8),
               {kSrc, "tensor 't'", "missing field 'data_offsets'"});
  EXPECT_ERROR(parse_header(R"({"t":{}})", 8), {kSrc, "tensor 't'", "missing field"});
  // ill-typed fields
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":5,"shape":[2],"data_offsets":[0,8]}})", 8),
               {"tensor 't'", "'dtype' must be a string", "got a number"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":["F32"],"shape":[2],"data_offsets":[0,8]}})", 8),
               {"tensor 't'", "'dtype'", "got an array"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"F32","shape":"2","data_offsets":[0,8]}})", 8),
               {"tensor 't'", "'shape' must be an array", "got a string"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"F32","shape":{"a":2},"data_offsets":[0,8]}})", 8),
               {"tensor 't'", "'shape'", "got an object"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"F32","shape":[2,"a"],"data_offsets":[0,8]}})", 8),
               {"tensor 't'", "'shape' element", "got a string"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"F32","shape":[[2]],"data_offsets":[0,8]}})", 8),
               {"tensor 't'", "'shape' element", "got an array"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"F32","shape":[true],"data_offsets":[0,8]}})", 8),
               {"tensor 't'", "'shape' element", "boolean"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":{}}})", 8),
               {"tensor 't'", "'data_offsets' must be an array"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":8}})", 8),
               {"tensor 't'", "'data_offsets' must be an array"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", 8),
               {"tensor 't'", "1 element(s)", "exactly 2"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[]}})", 8),
               {"tensor 't'", "0 element(s)", "exactly 2"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8,16]}})", 16),
               {"tensor 't'", "more than 2", "exactly 2"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0.0,8]}})", 8),
               {"tensor 't'", "0.0", "not an integer"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8e0]}})", 8),
               {"tensor 't'", "8e0", "not an integer"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}})", 8),
               {"tensor 't'", "-8", "negative"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,"8"]}})", 8),
               {"tensor 't'", "'data_offsets' element", "got a string"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,null]}})", 8),
               {"tensor 't'", "'data_offsets' element", "got null"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[8,4]}})", 8),
               {"tensor 't'", "begin > end"});
}

TEST_CASE("malformed: unknown dtype", "[safetensors]") {
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"F8","shape":[2],"data_offsets":[0,2]}})", 8),
               {"tensor 't'", "unknown dtype 'F8'", "BF16", "F8_E4M3"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"f32","shape":[2],"data_offsets":[0,8]}})", 8),
               {"tensor 't'", "unknown dtype 'f32'"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"","shape":[2],"data_offsets":[0,8]}})", 8),
               {"tensor 't'", "unknown dtype ''"});
}

TEST_CASE("malformed: negative, non-integer, out of range, overflowing and too many dimensions", "[safetensors]") {
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"F32","shape":[-1],"data_offsets":[0,8]}})", 8),
               {"tensor 't'", "'shape' element -1", "negative"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", 8),
               {"tensor 't'", "2.5", "not an integer"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", 8),
               {"tensor 't'", "2.0", "not an integer"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"F32","shape":[1e3],"data_offsets":[0,8]}})", 8),
               {"tensor 't'", "not an integer"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"F32","shape":[99999999999999999999999],"data_offsets":[0,8]}})", 8),
               {"tensor 't'", "not an integer"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,8]}})", 8),
               {"tensor 't'", "out of range"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"F32","shape":[9223372036854775808],"data_offsets":[0,8]}})", 8),
               {"tensor 't'", "out of range"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8),
               {"tensor 't'", "overflows"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"F32","shape":[3037000500,3037000500],"data_offsets":[0,8]}})", 8),
               {"tensor 't'", "overflows"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"F32","shape":[9223372036854775807,2,0],"data_offsets":[0,0]}})", 8),
               {"tensor 't'", "overflows"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,8]}})", 8),
               {"tensor 't'", "byte size", "overflows"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"F32","shape":[9223372036854775807],"data_offsets":[0,8]}})", 8),
               {"tensor 't'", "overflows"});
  std::string dims = "[";
  for (int i = 0; i < 1025; ++i) dims += i ? ",1" : "1";
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"U8","shape":)" + dims + R"(],"data_offsets":[0,1]}})", 1),
               {"tensor 't'", "more than 1024 dimensions"});
}

TEST_CASE("malformed: data_offsets beyond the data section, of the wrong length, or huge", "[safetensors]") {
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 7),
               {"tensor 't'", "beyond the data section of 7 bytes"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,18446744073709551615]}})", 8),
               {"tensor 't'", "beyond the data section"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,99999999999999999999]}})", 8),
               {"tensor 't'", "not an integer"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", 8),
               {"tensor 't'", "span 4 bytes", "expected 8 bytes"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"F16","shape":[2,3],"data_offsets":[0,8]}})", 16),
               {"tensor 't'", "span 8 bytes", "expected 12 bytes"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"BOOL","shape":[0],"data_offsets":[0,1]}})", 1),
               {"tensor 't'", "expected 0 bytes"});
}

TEST_CASE("malformed: duplicate keys at every level", "[safetensors]") {
  // nlohmann would silently keep the last
  EXPECT_ERROR(parse_header("{\"t\":" + ok_entry + ",\"t\":" + ok_entry + "}", 8), {kSrc, "duplicate tensor name 't'"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8),
               {"tensor 't'", "duplicate field 'dtype'"});
  EXPECT_ERROR(parse_header(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1,"x":2}})", 8),
               {"tensor 't'", "duplicate field 'x'"});
  EXPECT_ERROR(parse_header(R"({"__metadata__":{"a":"1","a":"2"}})", 0), {kSrc, "duplicate __metadata__ key 'a'"});
  EXPECT_ERROR(parse_header(R"({"__metadata__":{},"__metadata__":{}})", 0), {kSrc, "duplicate '__metadata__'"});
}

TEST_CASE("malformed: overlapping byte ranges", "[safetensors]") {
  EXPECT_ERROR(
      parse_header(
          R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
          12),
      {kSrc, "overlap", "'a'", "'b'"});
  EXPECT_ERROR(
      parse_header(
          R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
          8),
      {kSrc, "overlap"});
  EXPECT_ERROR(
      parse_header(
          R"({"a":{"dtype":"U8","shape":[12],"data_offsets":[0,12]},"b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]},"c":{"dtype":"U8","shape":[1],"data_offsets":[6,7]}})",
          12),
      {kSrc, "overlap"});
}

TEST_CASE("malformed: __metadata__ not an object of strings", "[safetensors]") {
  EXPECT_ERROR(parse_header(R"({"__metadata__":[]})", 0), {kSrc, "'__metadata__' is not an object", "got an array"});
  EXPECT_ERROR(parse_header(R"({"__metadata__":"x"})", 0), {kSrc, "'__metadata__' is not an object"});
  EXPECT_ERROR(parse_header(R"({"__metadata__":{"a":1}})", 0),
               {kSrc, "__metadata__ value for key 'a'", "not a string"});
  EXPECT_ERROR(parse_header(R"({"__metadata__":{"a":{"b":"c"}}})", 0), {kSrc, "key 'a'", "not a string"});
  EXPECT_ERROR(parse_header(R"({"__metadata__":{"a":null}})", 0), {kSrc, "key 'a'", "got null"});
}

TEST_CASE("malformed: untrusted text in messages stays on one line and bounded", "[safetensors]") {
  EXPECT_ERROR(parse_header("{\"a\\nb\":3}", 0), {"tensor 'a\\x0ab'"});
  EXPECT_ERROR(parse_header("{\"" + std::string(5000, 'x') + "\":3}", 0), {"...'"});
}

// Random mutations of valid files: parsing and reading must either succeed or throw st::error, never crash (the asan
// preset's ASan/UBSan watch for out-of-bounds reads and overflow).
TEST_CASE("mutation fuzz: parse and read only ever throw safetensors::error", "[safetensors]") {
  std::vector<st::tensor_out> out;
  out.push_back(st::make_tensor("a", {2, 3}, {1, 2, 3, 4, 5, 6}, st::dtype::F32));
  out.push_back(st::make_tensor("b", {4}, {1, -1, 0.5, 65504}, st::dtype::F16));
  out.push_back(st::make_tensor("c", {2}, {1, 2}, st::dtype::BF16));
  out.push_back(st::make_tensor("d", {1}, {3}, st::dtype::F64));
  out.push_back(st::make_tensor_i64("e", {2}, {7, 8}));
  out.push_back(st::tensor_out{"f", st::dtype::U8, {3}, {1, 2, 3}});
  out.push_back(st::tensor_out{"g", st::dtype::I32, {1}, {1, 0, 0, 0}});
  out.push_back(st::tensor_out{"h", st::dtype::BOOL, {}, {1}});
  const std::vector<unsigned char> base = st::serialize(out, {{"k", "v"}});
  const std::uint64_t n = st::detail::load_u64(base.data());
  const std::string header(base.begin() + 8, base.begin() + 8 + static_cast<std::ptrdiff_t>(n));
  const std::size_t data_len = base.size() - 8 - static_cast<std::size_t>(n);
  const char interesting[] = "{}[],:\"0123456789-.eE \\tfnu";

  rng r;
  std::size_t accepted = 0, rejected = 0;
  const auto exercise = [&](std::vector<unsigned char> bytes) {
    try {
      const st::file f = st::file::parse(std::move(bytes), "fuzz");
      for (const st::tensor_info& t : f.tensors()) {
        (void)f.raw(t);
        (void)t.numel();
        switch (t.type) {
          case st::dtype::F64:
          case st::dtype::F32:
          case st::dtype::F16:
          case st::dtype::BF16:
            (void)f.read_floats<float>(t);
            (void)f.read_floats<double>(t);
            break;
          case st::dtype::I64:
          case st::dtype::I32:
            (void)f.read_i64(t);
            break;
          default:
            break;
        }
      }
      ++accepted;
    } catch (const st::error& e) {
      const std::string msg = e.what();
      if (msg.find('\n') != std::string::npos || msg.rfind("fuzz", 0) != 0)
        FAIL_CHECK("fuzz: badly formed error message: " << msg);
      ++rejected;
    } catch (const std::exception& e) {
      FAIL_CHECK("fuzz: non-safetensors exception: " << e.what());
    }
  };
  for (int iter = 0; iter < 30000; ++iter) {
    if (iter % 2 == 0) {
      // byte-level mutation of the whole file (length prefix, header and data)
      std::vector<unsigned char> bytes = base;
      const std::size_t edits = 1 + r.below(4);
      for (std::size_t k = 0; k < edits && !bytes.empty(); ++k) {
        const std::size_t pos = r.below(bytes.size());
        switch (r.below(4)) {
          case 0:
            bytes[pos] = static_cast<unsigned char>(r.next());
            break;
          case 1:
            bytes[pos] = static_cast<unsigned char>(interesting[r.below(sizeof interesting - 1)]);
            break;
          case 2:
            bytes.resize(pos);
            break;
          default:
            bytes[pos] ^= static_cast<unsigned char>(1u << r.below(8));
            break;
        }
      }
      exercise(std::move(bytes));
    } else {
      // text-level mutation of the header with a consistent length prefix
      std::string h = header;
      const std::size_t edits = 1 + r.below(3);
      for (std::size_t k = 0; k < edits && !h.empty(); ++k) {
        const std::size_t pos = r.below(h.size());
        const char c = interesting[r.below(sizeof interesting - 1)];
        switch (r.below(4)) {
          case 0:
            h[pos] = c;
            break;
          case 1:
            h.insert(h.begin() + static_cast<std::ptrdiff_t>(pos), c);
            break;
          case 2:
            h.erase(pos, 1 + r.below(4));
            break;
          default: {
            const std::size_t from = r.below(h.size());
            const std::size_t len = r.below(16);
            h.insert(pos, h.substr(from, len));
            break;
          }
        }
      }
      const std::size_t cut = iter % 3 == 0 ? r.below(data_len + 1) : 0;
      exercise(make_file(h, data_len - cut));
    }
  }
  INFO("fuzz: " << accepted << " accepted, " << rejected << " rejected");
  CHECK(accepted > 0);
  CHECK(rejected > 0);
}
