// Running the kvevict-select binary from a test: a per-process scratch folder and the exit status + stderr of a run.
#ifndef KVEVICT_TESTS_TOOLS_CLI_RUN_HPP
#define KVEVICT_TESTS_TOOLS_CLI_RUN_HPP

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>

#include <sys/wait.h>

namespace kvevict_cli_test {

struct Run {
  int status;       ///< the exit status, or 128 when the process did not exit (a signal)
  std::string err;  ///< everything it wrote on stderr
};

/// A scratch folder of this test process, created on first use.
inline std::filesystem::path scratch() {
  static const std::filesystem::path dir = [] {
    std::filesystem::path p =
        std::filesystem::temp_directory_path() / ("kvevict_cli_" + std::to_string(std::random_device{}()));
    std::filesystem::create_directories(p);
    return p;
  }();
  return dir;
}

/// Runs `kvevict-select ARGS` (stdout discarded).
inline Run run_cli(const std::string& args) {
  const std::filesystem::path err = scratch() / "stderr.txt";
  const std::string cmd =
      std::string("\"") + KVEVICT_SELECT_PATH + "\" " + args + " 2>\"" + err.string() + "\" >/dev/null";
  const int raw = std::system(cmd.c_str());
  std::ifstream in(err);
  std::stringstream ss;
  ss << in.rdbuf();
  return {WIFEXITED(raw) ? WEXITSTATUS(raw) : 128, ss.str()};
}

}  // namespace kvevict_cli_test

#endif  // KVEVICT_TESTS_TOOLS_CLI_RUN_HPP
