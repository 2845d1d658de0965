// How many seeded random cases a test loop runs. The dev tier runs every case: it compares the values. Under the
// sanitizers (the asan preset defines KVEVICT_TEST_SANITIZED) the same loops run their first quarter: ASan and UBSan
// look for memory errors and undefined behaviour on each path, which the first cases already take, and at -O0 with
// the sanitizers Eigen's kernels run about 90 times slower than in dev (CI's time: docs/results/ci-time.md).
#ifndef KVEVICT_TESTS_SUPPORT_CASES_HPP
#define KVEVICT_TESTS_SUPPORT_CASES_HPP

namespace kvevict_test {

#ifdef KVEVICT_TEST_SANITIZED
inline constexpr bool sanitized = true;
#else
inline constexpr bool sanitized = false;
#endif

/// n cases in the dev tier, ceil(n / 4) under the sanitizers.
constexpr int cases(int n) { return sanitized ? (n + 3) / 4 : n; }

}  // namespace kvevict_test

#endif  // KVEVICT_TESTS_SUPPORT_CASES_HPP
