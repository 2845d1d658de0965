// Thread safety: policies are immutable after construction (select() is const and keeps no state between calls),
// so one policy object may be shared by threads. Several threads run the same selections concurrently on one
// shared policy and shared read-only inputs, and every result must equal the single-threaded one.
#include <catch2/catch.hpp>

#include <kvevict/kvevict.hpp>

#include <atomic>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "support/random_inputs.hpp"
#include "support/selector_inputs.hpp"

namespace test_thread_safety {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Budget;
using kvevict::Selection;
using kvevict_test::Layout;
using kvevict_test::Rng;
using kvevict_test::Shape;

namespace {

constexpr int kThreads = 4;
constexpr int kRounds = 8;

/// Runs `run()` kRounds times on each of kThreads threads at once; counts results that differ from `expected`.
template <class Result, class Run>
int concurrent_mismatches(const Result& expected, Run run) {
  std::atomic<int> mismatches{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&] {
      while (!go) std::this_thread::yield();  // start together
      for (int r = 0; r < kRounds; ++r)
        if (!(run() == expected)) ++mismatches;
    });
  go = true;
  for (auto& t : threads) t.join();
  return mismatches.load();
}

struct Flat {
  std::vector<std::int64_t> indices, offsets;
  bool operator==(const Flat& o) const { return indices == o.indices && offsets == o.offsets; }
};
Flat flat(const Selection& s) { return {s.indices(), s.offsets()}; }
std::vector<Flat> flat(const std::vector<Selection>& v) {
  std::vector<Flat> out;
  for (const Selection& s : v) out.push_back(flat(s));
  return out;
}

template <class Policy>
void check_shared(const char* name, const kvevict::LayerInputs<float>& in, int window) {
  typename Policy::Params p;
  if constexpr (!std::is_same_v<Policy, kvevict::StreamingLLM>) p.window = window;
  const Policy policy(p);  // shared, const
  const Budget budget = Budget::keep_ratio(0.2);
  const Flat expected = flat(policy.select(in, budget));
  INFO(name);
  CHECK(concurrent_mismatches(expected, [&] { return flat(policy.select(in, budget)); }) == 0);
}

}  // namespace

TEST_CASE("thread safety: one policy object shared by threads gives the single-threaded selections", "[threads]") {
  Rng rng(7);
  Shape s;
  s.H = 8, s.Hkv = 2, s.w = 16, s.L = 384, s.d = 32;
  const kvevict_test::VLayer l = kvevict_test::random_vlayer(s, 64, rng);
  const auto stored = kvevict_test::store_v<float>(l, Layout::tokens_major);
  check_shared<kvevict::SnapKV>("snapkv", stored.in, s.w);
  check_shared<kvevict::AdaKV>("adakv", stored.in, s.w);
  check_shared<kvevict::CriticalKV>("criticalkv", stored.in, s.w);
  check_shared<kvevict::CriticalSnapKV>("criticalkv-snapkv", stored.in, s.w);
  check_shared<kvevict::DefensiveKV>("defensivekv", stored.in, s.w);
  check_shared<kvevict::AdaKVDefensive>("adakv-defensive", stored.in, s.w);
  check_shared<kvevict::TOVA>("tova", stored.in, s.w);
  check_shared<kvevict::KNorm>("knorm", stored.in, s.w);
  check_shared<kvevict::KeyDiff>("keydiff", stored.in, s.w);
  check_shared<kvevict::StreamingLLM>("streamingllm", stored.in, s.w);

  // Layer-DefensiveKV: the shared policy, a plan per call (plans are per call by design).
  const auto second = kvevict_test::store_v<float>(kvevict_test::random_vlayer(s, 64, rng), Layout::heads_major);
  const std::vector<kvevict::LayerInputs<float>> layers = {stored.in, second.in};
  kvevict::LayerDefensiveKV::Params p;
  p.window = s.w;
  const kvevict::LayerDefensiveKV policy(p);
  const auto expected = flat(policy.select(layers, Budget::keep_ratio(0.1)));
  CHECK(concurrent_mismatches(expected, [&] { return flat(policy.select(layers, Budget::keep_ratio(0.1))); }) == 0);
}

}  // namespace test_thread_safety
