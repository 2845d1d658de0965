// aggregation/pooling.hpp: stage "pooling" (docs/algorithms.md#pooling), 1-D pooling along tokens.
#include <catch2/catch.hpp>

#include <kvevict/extend.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "support/random_inputs.hpp"

namespace test_pooling {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Index;
using kvevict::Pooling;
using kvevict_test::Rng;
using kvevict_test::sz;

namespace {

template <class S>
std::vector<S> pool(const std::vector<S>& x, Index kernel, Pooling p) {
  std::vector<S> out(x.size());
  kvevict::extend::pool1d(x.data(), static_cast<Index>(x.size()), kernel, p, out.data());
  return out;
}

kvevict_ref::Pool ref_pool(Pooling p) { return p == Pooling::avg ? kvevict_ref::Pool::avg : kvevict_ref::Pool::max; }

}  // namespace

TEST_CASE("pool1d: hand-worked examples (count_include_pad for avg, in-range max)", "[pooling]") {
  const std::vector<double> x = {1, 2, 3, 4, 5, 6};
  CHECK(pool(x, 3, Pooling::avg) == std::vector<double>{1.0, 2.0, 3.0, 4.0, 5.0, 11.0 / 3.0});
  const std::vector<double> avg5 = pool(x, 5, Pooling::avg);
  const std::vector<double> want5 = {6.0 / 5, 10.0 / 5, 15.0 / 5, 20.0 / 5, 18.0 / 5, 15.0 / 5};
  for (std::size_t i = 0; i < x.size(); ++i) CHECK(avg5[i] == Approx(want5[i]).epsilon(1e-15));
  const std::vector<double> y = {3, 1, 4, 1, 5, 9};
  CHECK(pool(y, 3, Pooling::max) == std::vector<double>{3, 4, 4, 5, 9, 9});
  CHECK(pool(y, 5, Pooling::max) == std::vector<double>{4, 4, 5, 9, 9, 9});
  CHECK(pool(y, 7, Pooling::max) == std::vector<double>{4, 5, 9, 9, 9, 9});
  CHECK(pool(y, 1, Pooling::avg) == y);
  CHECK(pool(y, 1, Pooling::max) == y);
  // The padding of max pooling is not a zero that could win.
  CHECK(pool(std::vector<double>{-1, -2, -3}, 3, Pooling::max) == std::vector<double>{-1, -1, -2});
  // Kernel larger than the input: avg divides by the kernel anyway.
  CHECK(pool(std::vector<double>{2, 4}, 7, Pooling::avg) == std::vector<double>{6.0 / 7, 6.0 / 7});
  CHECK(pool(std::vector<double>{5}, 5, Pooling::avg) == std::vector<double>{1.0});
  CHECK(pool(std::vector<double>{5}, 5, Pooling::max) == std::vector<double>{5.0});
}

TEST_CASE("pool1d matches the reference on random vectors (kernels 1..9, avg and max)", "[pooling]") {
  Rng rng(41);
  for (Index n : {1, 2, 3, 4, 5, 6, 7, 8, 13, 64, 257, 1000}) {
    const std::vector<double> x = kvevict_test::normal_vector(sz(n), rng);
    for (Index k : {1, 3, 5, 7, 9})
      for (Pooling p : {Pooling::avg, Pooling::max}) {
        INFO("n=" << n << " kernel=" << k << " " << kvevict::to_string(p));
        const std::vector<double> want = kvevict_ref::pool1d(x, static_cast<int>(k), ref_pool(p));
        const std::vector<double> got = pool(x, k, p);
        // Same summation order as the reference: bitwise equal.
        REQUIRE(got == want);
        const std::vector<float> got_f = pool(kvevict_test::cast_to<float>(x), k, p);
        REQUIRE(kvevict_test::compare_close(kvevict_test::to_double(got_f), want, 1e-6, 1e-6) == "");
      }
  }
}

TEST_CASE("pool1d in float equals the left-to-right loop entry by entry, bit for bit (ties and signed zeros too)",
          "[pooling]") {
  const auto loop = [](const std::vector<float>& x, Index k, Pooling p) {  // the definition, one entry at a time
    const Index n = static_cast<Index>(x.size()), half = k / 2;
    std::vector<float> out(x.size());
    for (Index j = 0; j < n; ++j) {
      const Index lo = std::max<Index>(0, j - half), hi = std::min<Index>(n - 1, j + half);
      float acc = x[sz(lo)];
      for (Index t = lo + 1; t <= hi; ++t) acc = p == Pooling::avg ? acc + x[sz(t)] : std::max(acc, x[sz(t)]);
      out[sz(j)] = p == Pooling::avg ? acc / static_cast<float>(k) : acc;
    }
    return out;
  };
  const auto bits = [](const std::vector<float>& v) {
    std::vector<std::uint32_t> b(v.size());
    std::memcpy(b.data(), v.data(), v.size() * sizeof(float));
    return b;
  };
  Rng rng(43);
  for (Index n : {1, 2, 5, 6, 7, 8, 15, 16, 17, 31, 33, 100, 1000, 4099}) {
    std::vector<float> x = kvevict_test::cast_to<float>(kvevict_test::normal_vector(sz(n), rng));
    for (std::size_t i = 0; i < x.size(); i += 3) x[i] = i % 2 ? 0.0f : -0.0f;  // ties between signed zeros
    for (std::size_t i = 1; i < x.size(); i += 5) x[i] = 1e-3f * static_cast<float>(i % 4);  // repeated values
    for (Index k : {1, 3, 5, 7, 9, 15})
      for (Pooling p : {Pooling::avg, Pooling::max}) {
        INFO("n=" << n << " kernel=" << k << " " << kvevict::to_string(p));
        REQUIRE(bits(pool(x, k, p)) == bits(loop(x, k, p)));
      }
  }
}

TEST_CASE("pool1d avg with kernel k is linear and preserves the total away from the borders", "[pooling]") {
  Rng rng(42);
  const std::vector<double> x = kvevict_test::normal_vector(100, rng);
  const std::vector<double> y = kvevict_test::normal_vector(100, rng);
  std::vector<double> xy(100);
  for (std::size_t i = 0; i < 100; ++i) xy[i] = 2.0 * x[i] - y[i];
  const std::vector<double> px = pool(x, 5, Pooling::avg), py = pool(y, 5, Pooling::avg),
                            pxy = pool(xy, 5, Pooling::avg);
  for (std::size_t i = 0; i < 100; ++i) CHECK(pxy[i] == Approx(2.0 * px[i] - py[i]).margin(1e-14));
  // A delta away from the borders spreads into k entries of 1/k.
  std::vector<double> delta(20, 0.0);
  delta[10] = 1.0;
  const std::vector<double> pd = pool(delta, 7, Pooling::avg);
  for (std::size_t i = 0; i < 20; ++i) CHECK(pd[i] == (i >= 7 && i <= 13 ? 1.0 / 7.0 : 0.0));
}

TEST_CASE("pooling names", "[pooling]") {
  CHECK(std::strcmp(kvevict::to_string(Pooling::avg), "avg") == 0);
  CHECK(std::strcmp(kvevict::to_string(Pooling::max), "max") == 0);
}

}  // namespace test_pooling
