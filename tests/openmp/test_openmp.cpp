// KVEVICT_OPENMP (include/kvevict/core/parallel.hpp): selection with OpenMP threads over heads. Every stage that runs
// in parallel (window attention + aggregation + mass statistics, the value term, the Gram matrices) and every preset's
// selection must be bit-identical for 1, 2, 3 and 4 threads; exceptions must leave the parallel region; a call from
// inside the engine's own parallel region must run serially with the same results.
#include <catch2/catch.hpp>

#include <kvevict/extend.hpp>

#include <omp.h>

#include <set>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "support/random_inputs.hpp"
#include "support/selector_inputs.hpp"

using kvevict::Budget;
using kvevict::Index;
using kvevict::RowMatrix;
using kvevict::Selection;
using kvevict_test::Layout;
using kvevict_test::Rng;
using kvevict_test::Shape;

#if !defined(KVEVICT_OPENMP)
#error "this suite is built with KVEVICT_OPENMP"
#endif

namespace {

const int kThreadCounts[] = {2, 3, 4};

/// f() with `threads` OpenMP threads (restoring the previous setting).
template <class F>
auto with_threads(int threads, F&& f) {
  const int before = omp_get_max_threads();
  omp_set_num_threads(threads);
  auto out = f();
  omp_set_num_threads(before);
  return out;
}

struct Flat {
  std::vector<std::int64_t> indices, offsets;
  bool operator==(const Flat& o) const { return indices == o.indices && offsets == o.offsets; }
};
Flat flat(const Selection& s) { return {s.indices(), s.offsets()}; }

/// Every preset's selection of `in` (value-aware ones with both norms), flattened, in a fixed order.
template <class S, class T>
std::vector<Flat> every_selection(const kvevict::LayerInputs<T>& in, int window, const Budget& b) {
  std::vector<Flat> out;
  const auto add = [&](auto policy) {
    if constexpr (std::is_same_v<decltype(policy), kvevict::LayerDefensiveKV>) {
      for (const Selection& s : policy.template select<S>(std::vector<kvevict::LayerInputs<T>>{in, in}, b))
        out.push_back(flat(s));
    } else {
      out.push_back(flat(policy.template select<S>(in, b)));
    }
  };
  const auto with_window = [&](auto p) {
    p.window = window;
    return p;
  };
  add(kvevict::SnapKV(with_window(kvevict::SnapKV::Params{})));
  add(kvevict::AdaKV(with_window(kvevict::AdaKV::Params{})));
  add(kvevict::AdaKVDefensive(with_window(kvevict::AdaKVDefensive::Params{})));
  for (const auto norm : {kvevict::ValueNorm::l1, kvevict::ValueNorm::l2}) {
    auto c = with_window(kvevict::CriticalKV::Params{});
    c.value_norm = norm;
    add(kvevict::CriticalKV(c));
    auto cs = with_window(kvevict::CriticalSnapKV::Params{});
    cs.value_norm = norm;
    add(kvevict::CriticalSnapKV(cs));
    auto d = with_window(kvevict::DefensiveKV::Params{});
    d.value_norm = norm;
    add(kvevict::DefensiveKV(d));
    auto l = with_window(kvevict::LayerDefensiveKV::Params{});
    l.value_norm = norm;
    add(kvevict::LayerDefensiveKV(l));
  }
  return out;
}

/// The parallel stages' outputs themselves (not only the selections they lead to).
template <class S, class T>
std::vector<RowMatrix<S>> stage_outputs(const kvevict::LayerInputs<T>& in, const kvevict::extend::LayerShape& shape) {
  const kvevict::extend::WindowObservation<S, T> obs(in, shape);
  std::vector<RowMatrix<S>> out;
  out.push_back(kvevict::extend::mean_scores(obs, 5, kvevict::Pooling::avg));
  out.push_back(kvevict::extend::defensive_scores(obs, 7, kvevict::Pooling::max, true));
  const auto gram = kvevict::OutputGram<S>::compute(in.w_o);
  for (const auto& g : gram.per_head) out.push_back(g);
  out.push_back(kvevict::extend::value_norms<S>(in.values, in.w_o, shape.group, kvevict::ValueNorm::l1));
  out.push_back(kvevict::extend::value_norms<S>(in.values, in.w_o, shape.group, kvevict::ValueNorm::l2, &gram));
  kvevict::extend::MassStatistics<S> mass(shape, false);
  obs.for_each_head([&](Index q, const RowMatrix<S>& rows) { mass.add(q, rows); });
  RowMatrix<S> bias(1, 1);
  bias(0, 0) = static_cast<S>(mass.window_bias());
  out.push_back(bias);
  return out;
}

bool bit_identical(const std::vector<RowMatrix<float>>& a, const std::vector<RowMatrix<float>>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].rows() != b[i].rows() || a[i].cols() != b[i].cols() ||
        std::memcmp(a[i].data(), b[i].data(), sizeof(float) * static_cast<std::size_t>(a[i].size())) != 0)
      return false;
  return true;
}

}  // namespace

TEST_CASE("OpenMP: every preset selects exactly as single-threaded, for 2-4 threads, float and half storage",
          "[openmp]") {
  Rng rng(2026113001);
  for (int c = 0; c < 12; ++c) {
    Shape s = kvevict_test::random_shape(rng, 300);
    if (c == 0) s.H = 8, s.Hkv = 8, s.w = 32, s.L = 700, s.d = 64;  // many KV heads: one per thread and more
    const auto l = kvevict_test::random_vlayer(s, 48, rng);
    const Budget b = Budget::keep_ratio(0.3);
    const auto f = kvevict_test::store_v<float>(l, c % 2 ? Layout::tokens_major : Layout::heads_major);
    const auto h = kvevict_test::store_v<Eigen::half>(l, Layout::tokens_major);
    const auto one = with_threads(1, [&] { return every_selection<float>(f.in, s.w, b); });
    const auto one_half = with_threads(1, [&] { return every_selection<float>(h.in, s.w, b); });
    const auto one_double = with_threads(1, [&] { return every_selection<double>(f.in, s.w, b); });
    for (int t : kThreadCounts) {
      INFO("case " << c << " H " << s.H << " Hkv " << s.Hkv << " w " << s.w << " L " << s.L << " d " << s.d
                   << " threads " << t);
      CHECK(with_threads(t, [&] { return every_selection<float>(f.in, s.w, b); }) == one);
      CHECK(with_threads(t, [&] { return every_selection<float>(h.in, s.w, b); }) == one_half);
      CHECK(with_threads(t, [&] { return every_selection<double>(f.in, s.w, b); }) == one_double);
    }
  }
}

TEST_CASE("OpenMP: the parallel stages (scores, value norms, Gram matrices, window bias) are bit-identical",
          "[openmp]") {
  Rng rng(2026113002);
  for (int c = 0; c < 8; ++c) {
    Shape s = kvevict_test::random_shape(rng, 400);
    s.Hkv = 4, s.H = 8;
    const auto l = kvevict_test::random_vlayer(s, 40, rng);
    const auto f = kvevict_test::store_v<float>(l, Layout::tokens_major);
    const auto shape = kvevict_test::layer_shape(s);
    const auto one = with_threads(1, [&] { return stage_outputs<float>(f.in, shape); });
    for (int t : kThreadCounts) {
      INFO("case " << c << " L " << s.L << " threads " << t);
      CHECK(bit_identical(with_threads(t, [&] { return stage_outputs<float>(f.in, shape); }), one));
    }
  }
}

TEST_CASE("OpenMP: parallel_for uses the threads, runs every index once, and rethrows the lowest index's exception",
          "[openmp]") {
  std::vector<int> thread_of(64, -1), calls(64, 0);
  with_threads(4, [&] {
    kvevict::detail::parallel_for(64, [&](Index i) {
      thread_of[static_cast<std::size_t>(i)] = omp_get_thread_num();
      ++calls[static_cast<std::size_t>(i)];
    });
    return 0;
  });
  CHECK(std::set<int>(thread_of.begin(), thread_of.end()).size() > 1);
  CHECK(calls == std::vector<int>(64, 1));

  std::vector<int> ran(40, 0);
  const auto throwing = [&] {
    kvevict::detail::parallel_for(40, [&](Index i) {
      ran[static_cast<std::size_t>(i)] = 1;
      if (i == 7 || i == 31) throw std::runtime_error("index " + std::to_string(i));
    });
    return 0;
  };
  CHECK_THROWS_WITH(with_threads(4, throwing), "index 7");
  CHECK(ran == std::vector<int>(40, 1));  // the other indices still ran; nothing terminated
}

TEST_CASE("OpenMP: called from the engine's own parallel region, select runs serially with the same results",
          "[openmp]") {
  Rng rng(2026113003);
  Shape s;
  s.H = 8, s.Hkv = 4, s.w = 8, s.L = 200, s.d = 32;
  const auto l = kvevict_test::random_vlayer(s, 32, rng);
  const auto f = kvevict_test::store_v<float>(l, Layout::heads_major);
  const Budget b = Budget::keep_ratio(0.25);
  const auto expected = with_threads(1, [&] { return every_selection<float>(f.in, s.w, b); });
  std::vector<std::vector<Flat>> got(4);
  with_threads(4, [&] {
#pragma omp parallel for
    for (int i = 0; i < 4; ++i) got[static_cast<std::size_t>(i)] = every_selection<float>(f.in, s.w, b);
    return 0;
  });
  for (const auto& g : got) CHECK(g == expected);
}
