// kvevict_engine_tests: the tinycode engine against the model's reference numbers, and eviction smoke runs.
//   1. forward pass of reference_logits.safetensors' 256 tokens: max |logit - reference| <= 1e-3
//   2. doc 0 with the full cache: 'all' and 'after_prefix' losses of eval/full_cache_nll.json within 1e-3
//   3. chunked decoding (extend of n tokens) == n single decoding steps, on a compressed cache; compaction keeps
//      original positions and rows; window queries do not depend on the chunking
//   4. SnapKV, AdaKV and StreamingLLM on doc 0 at keep 10%: exact budgets, finite loss, views are zero-copy
// Usage: kvevict_engine_tests [MODEL_DIR]   (default: the vendored models/tinycode)

#include <cmath>
#include <cstdio>
#include <exception>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine.hpp"
#include "eval.hpp"

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  std::printf("%s %s\n", ok ? "[ok]  " : "[FAIL]", what.c_str());
  if (!ok) ++failures;
}

std::string fmt(const char* f, double a, double b = 0) {
  char buf[256];
  std::snprintf(buf, sizeof buf, f, a, b);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::filesystem::path dir = argc > 1 ? argv[1] : KVEVICT_SOURCE_DIR "/models/tinycode";
    const tinycode::Model model = tinycode::Model::load(dir);

    // 1. Reference logits.
    {
      const auto st = kvevict::safetensors::file::open((dir / "reference_logits.safetensors").string());
      const std::vector<float> tok = st.read_floats<float>(st.at("tokens"));
      const std::vector<float> ref = st.read_floats<float>(st.at("logits"));
      std::vector<tinycode::Token> tokens(tok.begin(), tok.end());
      tinycode::Engine engine(model);
      const tinycode::Matrix logits = engine.extend(tokens);
      const Eigen::Map<const tinycode::Matrix> expected(ref.data(), logits.rows(), logits.cols());
      const double err = static_cast<double>((logits - expected).cwiseAbs().maxCoeff());
      check(ref.size() == static_cast<std::size_t>(logits.size()) && err <= 1e-3,
            fmt("forward pass: max |logit - reference| = %.3g over 256 x 256 logits (<= 1e-3)", err));
    }

    // 2. Full-cache losses of doc 0.
    const auto docs = tinycode::eval::load_docs(dir / "eval" / "docs.bin");
    nlohmann::json nll;
    std::ifstream(dir / "eval" / "full_cache_nll.json") >> nll;
    const double ref_all = nll["docs"][0]["all"].get<double>();
    const double ref_after = nll["docs"][0]["after_prefix"].get<double>();
    const tinycode::eval::ContinuationTask task(docs[0]);
    tinycode::Engine prefilled(model);
    const tinycode::Matrix context_logits = prefilled.extend(task.context);
    {
      tinycode::Engine engine = prefilled;
      const tinycode::Matrix cont_logits = engine.extend(task.continuation_inputs());
      double sum = 0;
      for (tinycode::Index i = 0; i + 1 < context_logits.rows(); ++i)  // bytes 1..1535; 1536.. are in `after`
        sum += tinycode::eval::nll(context_logits.row(i), docs[0][static_cast<std::size_t>(i) + 1]);
      const double after = task.loss(context_logits, cont_logits);
      const double all = (sum + after * static_cast<double>(task.continuation.size())) /
                         static_cast<double>(context_logits.rows() + cont_logits.rows());
      check(std::abs(all - ref_all) <= 1e-3, fmt("doc 0 full cache, all: %.6f vs %.6f (<= 1e-3)", all, ref_all));
      check(std::abs(after - ref_after) <= 1e-3,
            fmt("doc 0 full cache, after_prefix: %.6f vs %.6f (<= 1e-3)", after, ref_after));
    }

    // 3. Chunked decoding == single steps, on a compressed cache (AdaKV: heads of different lengths).
    {
      tinycode::Engine chunked = prefilled;
      chunked.compress(kvevict::AdaKV{}, kvevict::Budget::keep_ratio(0.1));
      tinycode::Engine stepped = chunked;
      const std::vector<tinycode::Token> next(task.continuation.begin(), task.continuation.begin() + 16);
      const tinycode::Matrix a = chunked.extend(next);
      double err = 0;
      for (std::size_t i = 0; i < next.size(); ++i) {
        const tinycode::RowVector b = stepped.decode(next[i]);
        err = std::max(err, static_cast<double>((a.row(static_cast<tinycode::Index>(i)) - b).cwiseAbs().maxCoeff()));
      }
      check(err <= 1e-4, fmt("16 single decoding steps == one chunk of 16 on an AdaKV cache: max diff %.3g", err));
      bool positions_ok = true;
      for (tinycode::Index h = 0; h < 2; ++h) {
        const auto& c = stepped.cache();
        const tinycode::Index len = c.length(0, h);
        positions_ok = positions_ok && c.position(0, h, len - 1) == 1536 + 15 && c.position(0, h, len - 17) < 1536;
        for (tinycode::Index r = 1; r < len; ++r)
          positions_ok = positions_ok && c.position(0, h, r - 1) < c.position(0, h, r);
      }
      check(positions_ok, "compressed cache keeps original positions, ascending, new tokens appended");

      bool rows_ok = true;  // every kept row is the prefill's row at its original position
      const auto& c = chunked.cache();
      for (tinycode::Index l = 0; l < 10; ++l)
        for (tinycode::Index h = 0; h < 2; ++h)
          for (tinycode::Index r = 0; r < c.length(l, h) - 16; ++r) {
            const auto p = static_cast<tinycode::Index>(c.position(l, h, r));
            rows_ok = rows_ok && c.keys(l, h).row(r) == prefilled.cache().keys(l, h).row(p) &&
                      c.values(l, h).row(r) == prefilled.cache().values(l, h).row(p);
          }
      check(rows_ok, "compaction gathers exactly the rows at the kept positions (keys and values)");
    }

    // The window queries do not depend on how the context was chunked (prefill + single steps here).
    {
      tinycode::Engine split(model);
      split.extend(task.context.data(), 1520);
      for (std::size_t i = 1520; i < task.context.size(); ++i) split.decode(task.context[i]);
      double err = 0;
      for (tinycode::Index l = 0; l < 10; ++l) {
        const auto a = split.eviction_inputs(l).queries, b = prefilled.eviction_inputs(l).queries;
        for (tinycode::Index q = 0; q < 8; ++q)
          err = std::max(err, static_cast<double>((a.head(q) - b.head(q)).cwiseAbs().maxCoeff()));
      }
      check(err <= 1e-4, fmt("window queries after prefill(1520) + 16 decode steps == after one prefill: %.3g", err));
    }

    // 4. Policies on doc 0 at keep 10%.
    {
      const tinycode::Index n_kept = 153;  // floor(0.1 * 1536)
      const kvevict::Budget budget = kvevict::Budget::keep_ratio(0.1);
      const auto in = prefilled.eviction_inputs(0);
      check(in.keys.data() == prefilled.cache().keys(0, 0).data() &&
                in.values.data() == prefilled.cache().values(0, 0).data() && in.keys.rows() == 1536 &&
                in.queries.heads() == 8 && in.queries.rows() == 32,
            "eviction inputs: keys/values view the cache storage (no copy), queries [8, 32, 32]");
      const auto run = [&](const char* name, auto policy, bool uniform) {
        tinycode::Engine engine = prefilled;
        const tinycode::EvictionStats stats = engine.compress(policy, budget);
        bool budget_ok = true;
        for (tinycode::Index l = 0; l < 10; ++l) {
          const tinycode::Index sum =
              stats.kept[static_cast<std::size_t>(2 * l)] + stats.kept[static_cast<std::size_t>(2 * l + 1)];
          budget_ok =
              budget_ok && sum == 2 * n_kept && (!uniform || stats.kept[static_cast<std::size_t>(2 * l)] == n_kept);
        }
        const double loss = task.loss(context_logits, engine.extend(task.continuation_inputs()));
        check(budget_ok && std::isfinite(loss) && loss > ref_after - 0.05,
              std::string(name) + fmt(" keep 10%%: loss %.4f (full %.4f), kept per layer = 2 x 153", loss, ref_after));
      };
      run("snapkv", kvevict::SnapKV{}, true);
      run("adakv", kvevict::AdaKV{}, false);
      run("streamingllm", kvevict::StreamingLLM{}, true);
    }
  } catch (const std::exception& e) {
    std::printf("[FAIL] exception: %s\n", e.what());
    return 1;
  }
  std::printf("%s\n", failures ? "FAILED" : "all engine tests passed");
  return failures ? 1 : 0;
}
