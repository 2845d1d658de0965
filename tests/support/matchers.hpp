// Catch2 matchers shared by the test files.
#ifndef KVEVICT_TESTS_SUPPORT_MATCHERS_HPP
#define KVEVICT_TESTS_SUPPORT_MATCHERS_HPP

#include <catch2/catch.hpp>

#include <exception>
#include <string>
#include <utility>

namespace kvevict_test {

/// Matches an exception whose what() contains `part`; use with REQUIRE_THROWS_MATCHES, which also checks the type:
///   REQUIRE_THROWS_MATCHES(expr, kvevict::invalid_argument, MessageContains("window (40)"));
class MessageContains : public Catch::MatcherBase<std::exception> {
 public:
  explicit MessageContains(std::string part) : part_(std::move(part)) {}
  bool match(const std::exception& e) const override { return std::string(e.what()).find(part_) != std::string::npos; }
  std::string describe() const override { return "message contains \"" + part_ + "\""; }

 private:
  std::string part_;
};

}  // namespace kvevict_test

#endif  // KVEVICT_TESTS_SUPPORT_MATCHERS_HPP
