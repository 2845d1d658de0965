// kvevict_engine_tests: the tinycode engine against the model's reference numbers, and eviction smoke runs.
//   1. forward pass of reference_logits.safetensors' 256 tokens: max |logit - reference| <= 1e-3
//   2. doc 0 with the full cache: 'all' and 'after_prefix' losses of eval/full_cache_nll.json within 1e-3
//   3. chunked decoding (extend of n tokens) == n single decoding steps, on a compressed cache; compaction keeps
//      original positions and rows; window queries do not depend on the chunking
//   4. SnapKV, AdaKV and StreamingLLM on doc 0 at keep 10%: exact budgets, finite loss, views are zero-copy
//   5. hand_attention_rows: the window's softmax rows are the attention of its queries (float64 reference), the
//      selections are the queries', and an eviction hands the queries until a window of positions has run
// The model directory is the vendored models/tinycode unless the environment variable KVEVICT_TINYCODE_DIR names
// another one.

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "engine.hpp"
#include "eval.hpp"

namespace {

std::filesystem::path model_dir() {
  const char* env = std::getenv("KVEVICT_TINYCODE_DIR");
  return env != nullptr && *env != '\0' ? std::filesystem::path(env)
                                        : std::filesystem::path(KVEVICT_SOURCE_DIR "/models/tinycode");
}

// Loaded on first use, so that listing the tests (catch_discover_tests) does not load the model.
const tinycode::Model& model() {
  static const tinycode::Model m = tinycode::Model::load(model_dir());
  return m;
}

// Doc 0: its bytes, its reference full-cache losses, the continuation task and the engine after prefilling the
// context. Built on first use, once per process.
struct Doc0 {
  tinycode::eval::Tokens doc;
  double ref_all = 0, ref_after = 0;
  tinycode::eval::ContinuationTask task;
  tinycode::Engine prefilled;
  tinycode::Matrix context_logits;

  Doc0(tinycode::eval::Tokens bytes, const nlohmann::json& nll)
      : doc(std::move(bytes)),
        ref_all(nll["docs"][0]["all"].get<double>()),
        ref_after(nll["docs"][0]["after_prefix"].get<double>()),
        task(doc),
        prefilled(model()),
        context_logits(prefilled.extend(task.context)) {}
};

const Doc0& doc0() {
  static const Doc0 d = [] {
    const auto docs = tinycode::eval::load_docs(model_dir() / "eval" / "docs.bin");
    nlohmann::json nll;
    std::ifstream(model_dir() / "eval" / "full_cache_nll.json") >> nll;
    return Doc0(docs.at(0), nll);
  }();
  return d;
}

}  // namespace

TEST_CASE("forward pass matches the reference logits", "[engine]") {
  const auto st = safetensors::file::open((model_dir() / "reference_logits.safetensors").string());
  const std::vector<float> tok = st.read_floats<float>(st.at("tokens"));
  const std::vector<float> ref = st.read_floats<float>(st.at("logits"));
  std::vector<tinycode::Token> tokens(tok.begin(), tok.end());
  tinycode::Engine engine(model());
  const tinycode::Matrix logits = engine.extend(tokens);
  REQUIRE(ref.size() == static_cast<std::size_t>(logits.size()));
  const Eigen::Map<const tinycode::Matrix> expected(ref.data(), logits.rows(), logits.cols());
  const double err = static_cast<double>((logits - expected).cwiseAbs().maxCoeff());
  INFO("max |logit - reference| over " << logits.rows() << " x " << logits.cols() << " logits");
  CHECK(err <= 1e-3);
}

TEST_CASE("doc 0 with the full cache matches the reference losses", "[engine]") {
  const Doc0& d = doc0();
  tinycode::Engine engine = d.prefilled;
  const tinycode::Matrix cont_logits = engine.extend(d.task.continuation_inputs());
  double sum = 0;
  for (tinycode::Index i = 0; i + 1 < d.context_logits.rows(); ++i)  // bytes 1..1535; 1536.. are in `after`
    sum += tinycode::eval::nll(d.context_logits.row(i), d.doc[static_cast<std::size_t>(i) + 1]);
  const double after = d.task.loss(d.context_logits, cont_logits);
  const double all = (sum + after * static_cast<double>(d.task.continuation.size())) /
                     static_cast<double>(d.context_logits.rows() + cont_logits.rows());
  CHECK(all == Approx(d.ref_all).margin(1e-3).epsilon(0.0));
  CHECK(after == Approx(d.ref_after).margin(1e-3).epsilon(0.0));
}

TEST_CASE("chunked decoding equals single steps on a compressed cache", "[engine]") {
  const Doc0& d = doc0();
  // Chunked decoding == single steps, on a compressed cache (AdaKV: heads of different lengths).
  {
    tinycode::Engine chunked = d.prefilled;
    chunked.compress(kvevict::AdaKV{}, kvevict::Budget::keep_ratio(0.1));
    tinycode::Engine stepped = chunked;
    const std::vector<tinycode::Token> next(d.task.continuation.begin(), d.task.continuation.begin() + 16);
    const tinycode::Matrix a = chunked.extend(next);
    double err = 0;
    for (std::size_t i = 0; i < next.size(); ++i) {
      const tinycode::RowVector b = stepped.decode(next[i]);
      err = std::max(err, static_cast<double>((a.row(static_cast<tinycode::Index>(i)) - b).cwiseAbs().maxCoeff()));
    }
    INFO("16 single decoding steps vs one chunk of 16 on an AdaKV cache: max diff");
    CHECK(err <= 1e-4);

    // The compressed cache keeps original positions, ascending, new tokens appended.
    for (tinycode::Index h = 0; h < 2; ++h) {
      CAPTURE(h);
      const auto& c = stepped.cache();
      const tinycode::Index len = c.length(0, h);
      CHECK(c.position(0, h, len - 1) == 1536 + 15);
      CHECK(c.position(0, h, len - 17) < 1536);
      bool ascending = true;
      for (tinycode::Index r = 1; r < len; ++r) ascending = ascending && c.position(0, h, r - 1) < c.position(0, h, r);
      CHECK(ascending);
    }

    // Compaction gathers exactly the rows at the kept positions (keys and values).
    bool rows_ok = true;
    const auto& c = chunked.cache();
    for (tinycode::Index l = 0; l < 10; ++l)
      for (tinycode::Index h = 0; h < 2; ++h)
        for (tinycode::Index r = 0; r < c.length(l, h) - 16; ++r) {
          const auto p = static_cast<tinycode::Index>(c.position(l, h, r));
          rows_ok = rows_ok && c.keys(l, h).row(r) == d.prefilled.cache().keys(l, h).row(p) &&
                    c.values(l, h).row(r) == d.prefilled.cache().values(l, h).row(p);
        }
    CHECK(rows_ok);
  }

  // The window queries do not depend on how the context was chunked (prefill + single steps here).
  {
    tinycode::Engine split(model());
    split.extend(d.task.context.data(), 1520);
    for (std::size_t i = 1520; i < d.task.context.size(); ++i) split.decode(d.task.context[i]);
    double err = 0;
    for (tinycode::Index l = 0; l < 10; ++l) {
      const auto a = split.eviction_inputs(l).queries, b = d.prefilled.eviction_inputs(l).queries;
      for (tinycode::Index q = 0; q < 8; ++q)
        err = std::max(err, static_cast<double>((a.head(q) - b.head(q)).cwiseAbs().maxCoeff()));
    }
    INFO("window queries after prefill(1520) + 16 decode steps vs after one prefill: max diff");
    CHECK(err <= 1e-4);
  }
}

TEST_CASE("eviction policies on doc 0 at keep 10%", "[engine]") {
  const Doc0& d = doc0();
  const tinycode::Index n_kept = 153;  // floor(0.1 * 1536)
  const kvevict::Budget budget = kvevict::Budget::keep_ratio(0.1);
  SECTION("eviction inputs: keys and values view the cache storage (no copy), queries [8, 32, 32]") {
    const auto in = d.prefilled.eviction_inputs(0);
    CHECK(in.keys.data() == d.prefilled.cache().keys(0, 0).data());
    CHECK(in.values.data() == d.prefilled.cache().values(0, 0).data());
    CHECK(in.keys.rows() == 2048);  // the capacity; each head holds 1536 entries at positions 0 .. 1535
    CHECK(in.lengths[0] == 1536);
    CHECK(in.lengths[1] == 1536);
    CHECK(*in.positions.row(1, 1535) == 1535);
    CHECK(in.queries.heads() == 8);
    CHECK(in.queries.rows() == 32);
  }
  const auto run = [&](auto policy, bool uniform) {
    tinycode::Engine engine = d.prefilled;
    const tinycode::EvictionStats stats = engine.compress(policy, budget);
    for (tinycode::Index l = 0; l < 10; ++l) {
      CAPTURE(l);
      const tinycode::Index k0 = stats.kept[static_cast<std::size_t>(2 * l)];
      const tinycode::Index k1 = stats.kept[static_cast<std::size_t>(2 * l + 1)];
      CHECK(k0 + k1 == 2 * n_kept);  // kept per layer = 2 x 153
      if (uniform) CHECK(k0 == n_kept);
    }
    const double loss = d.task.loss(d.context_logits, engine.extend(d.task.continuation_inputs()));
    INFO("full-cache loss " << d.ref_after);
    CHECK(std::isfinite(loss));
    CHECK(loss > d.ref_after - 0.05);
  };
  SECTION("snapkv") { run(kvevict::SnapKV{}, true); }
  SECTION("adakv") { run(kvevict::AdaKV{}, false); }
  SECTION("streamingllm") { run(kvevict::StreamingLLM{}, true); }
}

TEST_CASE("streaming eviction on doc 0: one step is one shot and small steps stay within budget + step", "[engine]") {
  const Doc0& d = doc0();
  const tinycode::Index n = 153;  // int(0.1 * 1536)
  const auto same_cache = [](const tinycode::Engine& a, const tinycode::Engine& b) {
    for (tinycode::Index l = 0; l < 10; ++l)
      for (tinycode::Index h = 0; h < 2; ++h) {
        if (a.cache().length(l, h) != b.cache().length(l, h)) return false;
        for (tinycode::Index r = 0; r < a.cache().length(l, h); ++r)
          if (a.cache().position(l, h, r) != b.cache().position(l, h, r)) return false;
      }
    return true;
  };
  const auto check = [&](const auto& policy) {
    // The whole context as one step, evicted to n tokens per head: the one-shot compression, bit for bit.
    tinycode::Engine once = d.prefilled;
    once.evict(kvevict::select_layers(policy, once.eviction_inputs(), kvevict::Budget::tokens(n)));
    tinycode::Engine stream = d.prefilled;
    CHECK(stream.evict_over_budget(policy, n) == 10);
    CHECK(same_cache(once, stream));
    // Capped decoding: the continuation in steps of 64 with eviction after each; memory <= budget + one step.
    const auto after = d.task.continuation_inputs();
    for (std::size_t at = 0; at + 64 <= after.size(); at += 64) {
      stream.extend(after.data() + at, 64);
      CHECK(stream.cache().total_length() <= 10 * 2 * (n + 64));
      stream.evict_over_budget(policy, n);
      CHECK(stream.cache().total_length() <= 10 * 2 * n);
      for (tinycode::Index l = 0; l < 10; ++l)
        for (tinycode::Index h = 0; h < 2; ++h)  // the window (the step's last 32 tokens) is kept
          CHECK(stream.cache().position(l, h, stream.cache().length(l, h) - 1) == stream.next_position() - 1);
    }
  };
  SECTION("snapkv") { check(kvevict::SnapKV{}); }
  SECTION("adakv") { check(kvevict::AdaKV{}); }
  SECTION("defensivekv") { check(kvevict::DefensiveKV{}); }
  SECTION("layer-defensivekv") { check(kvevict::LayerDefensiveKV{}); }
  SECTION("streamingllm") { check(kvevict::StreamingLLM{}); }
}

TEST_CASE("renumbered RoPE positions: a contiguous suffix attends as with its original positions", "[engine]") {
  // RoPE attention depends on position differences only. Keeping each head's last n entries (StreamingLLM without
  // sinks) and renumbering them 0 .. n-1 moves every key and every later query by the same offset, so the
  // continuation's logits must equal those with the original positions (up to float rounding of the rotations).
  const Doc0& d = doc0();
  kvevict::StreamingLLM::Params p;
  p.sinks = 0;
  const auto logits = [&](bool renumber, const kvevict::Budget& budget) {
    tinycode::Engine engine = d.prefilled;
    engine.renumber_positions(renumber);
    engine.compress(kvevict::StreamingLLM(p), budget);
    return tinycode::Matrix(engine.extend(d.task.continuation_inputs()));
  };
  const tinycode::Matrix original = logits(false, kvevict::Budget::keep_ratio(0.1));
  const tinycode::Matrix renumbered = logits(true, kvevict::Budget::keep_ratio(0.1));
  CHECK((original - renumbered).cwiseAbs().maxCoeff() < 2e-3);
  // With sinks the kept entries are not contiguous: renumbering changes what the model sees.
  p.sinks = 4;
  CHECK((logits(false, kvevict::Budget::keep_ratio(0.1)) - logits(true, kvevict::Budget::keep_ratio(0.1)))
            .cwiseAbs()
            .maxCoeff() > 1e-2);
  // Keeping everything renumbers nothing: bit-identical.
  p.sinks = 0;
  CHECK(logits(true, kvevict::Budget::keep_ratio(1.0)) == logits(false, kvevict::Budget::keep_ratio(1.0)));
}

TEST_CASE("shared layouts on doc 0: per-layer blocks keep one set per layer within budget", "[engine]") {
  const Doc0& d = doc0();
  kvevict::AdaKV::Params p;
  p.share = kvevict::Sharing::per_layer;
  p.block = 16;
  tinycode::Engine engine = d.prefilled;
  const auto sels =
      kvevict::select_layers(kvevict::AdaKV(p), engine.eviction_inputs(), kvevict::Budget::keep_ratio(0.1));
  for (const kvevict::Selection& s : sels) {
    CHECK(s.length(0) == 144);  // 153 rounded down to 9 blocks of 16
    CHECK(std::equal(s.head(0).begin(), s.head(0).end(), s.head(1).begin(), s.head(1).end()));
    CHECK(s.head_blocks(0).size() == 9);
  }
  engine.evict(sels);
  CHECK(std::isfinite(d.task.loss(d.context_logits, engine.extend(d.task.continuation_inputs()))));
}

TEST_CASE("a paged engine (vLLM's page pool and plans) reproduces the slab engine bit for bit", "[engine][paged]") {
  // The same doc through an engine whose cache is a shuffled page pool with one block table: kvevict reads it in
  // place through the table, every eviction applies adapters::vllm_plan (slot copies at blocks of 1, the table only
  // at blocks of 16), and the continuation's logits equal the slab engine's exactly, one-shot and capped.
  const Doc0& d = doc0();
  const auto& model_ = model();
  for (const kvevict::Index block : {kvevict::Index{1}, kvevict::Index{16}}) {
    kvevict::LayerDefensiveKV::Params p;
    p.share = kvevict::Sharing::per_model;
    p.block = block;
    const kvevict::LayerDefensiveKV policy(p);
    INFO("block " << block);
    tinycode::Engine paged(model_, 32, 0, 16);
    CHECK(paged.cache().paged());
    const tinycode::Matrix context_logits = paged.extend(d.task.context);
    CHECK(context_logits == d.context_logits);
    tinycode::Engine slab = d.prefilled;
    const auto budget = kvevict::Budget::keep_ratio(0.1);
    slab.evict(kvevict::select_layers(policy, slab.eviction_inputs(), budget));
    const auto sels = kvevict::select_layers(policy, paged.eviction_inputs(), budget);
    paged.evict(sels);
    CHECK(paged.kept_lengths() == slab.kept_lengths());
    CHECK(static_cast<kvevict::Index>(paged.cache().block_table().size()) == (sels[0].length(0) + 15) / 16);
    // Capped decoding after it: steps of 64 evicted back to 153 tokens per head, in both engines.
    const auto after = d.task.continuation_inputs();
    for (std::size_t at = 0; at + 64 <= after.size(); at += 64) {
      CHECK(paged.extend(after.data() + at, 64) == slab.extend(after.data() + at, 64));
      CHECK(paged.evict_over_budget(policy, 153) == slab.evict_over_budget(policy, 153));
      CHECK(paged.kept_lengths() == slab.kept_lengths());
    }
  }
  // A per-head selection cannot be applied to one block table: refused by the adapter, by name.
  tinycode::Engine paged(model_, 32, 0, 16);
  paged.extend(d.task.context);
  const auto per_head =
      kvevict::select_layers(kvevict::AdaKV{}, paged.eviction_inputs(), kvevict::Budget::keep_ratio(0.1));
  CHECK_THROWS_WITH(paged.evict(per_head), Catch::Contains("select with share = per_model"));
  CHECK_THROWS_AS(paged.renumber_positions(true), std::invalid_argument);
}

TEST_CASE("the window's softmax rows the engine hands are the attention of its queries, until an eviction",
          "[engine]") {
  const Doc0& d = doc0();
  const tinycode::Index w = 32, layers = 10, heads = 8, group = 4;
  tinycode::Engine rows(model()), queries(model());
  rows.hand_attention_rows(true);
  CHECK(rows.hands_attention_rows());
  CHECK_FALSE(queries.hands_attention_rows());
  // The reference: softmax(q k^T / sqrt(d)) in double over each head's entries, window row i seeing rows up to
  // length - w + i (the window is the cache's last w rows).
  const auto check_rows = [&](const char* when) {
    INFO(when);
    for (tinycode::Index l = 0; l < layers; ++l) {
      const auto a = rows.eviction_inputs(l);
      const auto q = queries.eviction_inputs(l);
      REQUIRE(a.queries.heads() == 0);
      REQUIRE(a.attention.heads() == heads);
      REQUIRE(a.attention.rows() == w);
      double worst = 0;
      for (tinycode::Index qh = 0; qh < heads; ++qh) {
        const tinycode::Index kh = qh / group, len = queries.cache().length(l, kh);
        REQUIRE(rows.cache().length(l, kh) == len);
        for (tinycode::Index i = 0; i < w; ++i) {
          const tinycode::Index visible = len - w + i + 1;
          std::vector<double> p(static_cast<std::size_t>(len), 0.0);
          double mx = -1e300, z = 0;
          for (tinycode::Index j = 0; j < visible; ++j) {
            double dot = 0;
            for (tinycode::Index c = 0; c < 32; ++c)
              dot += double(q.queries.row(qh, i)[c]) * double(q.keys.row(kh, j)[c]);
            p[static_cast<std::size_t>(j)] = dot / std::sqrt(32.0);
            mx = std::max(mx, p[static_cast<std::size_t>(j)]);
          }
          for (tinycode::Index j = 0; j < visible; ++j) z += std::exp(p[static_cast<std::size_t>(j)] - mx);
          for (tinycode::Index j = 0; j < len; ++j) {
            const double want = j < visible ? std::exp(p[static_cast<std::size_t>(j)] - mx) / z : 0.0;
            worst = std::max(worst, std::abs(double(a.attention.row(qh, i)[j]) - want));
          }
        }
      }
      CHECK(worst < 1e-5);
    }
  };
  const auto run = [&](const tinycode::Token* t, tinycode::Index n) {
    rows.extend(t, n);
    queries.extend(t, n);
  };
  const auto& ctx = d.task.context;
  run(ctx.data(), 600);  // a prefill
  check_rows("after a prefill of 600");
  for (tinycode::Index i = 0; i < 5; ++i) run(ctx.data() + 600 + i, 1);  // decoding steps: rows move up
  check_rows("after 5 decoding steps");
  run(ctx.data() + 605, 40);  // a chunk longer than the window
  check_rows("after a chunk of 40");
  // The same selections either way (SnapKV, and DefensiveKV's layer-global form, whose forcing reads the rows).
  const auto budget = kvevict::Budget::tokens(120);
  CHECK(kvevict::select_layers(kvevict::SnapKV{}, rows.eviction_inputs(), budget)[3].indices() ==
        kvevict::select_layers(kvevict::SnapKV{}, queries.eviction_inputs(), budget)[3].indices());
  const auto by_rows = kvevict::select_layers(kvevict::LayerDefensiveKV{}, rows.eviction_inputs(), budget);
  const auto by_queries = kvevict::select_layers(kvevict::LayerDefensiveKV{}, queries.eviction_inputs(), budget);
  for (std::size_t l = 0; l < by_rows.size(); ++l) CHECK(by_rows[l].indices() == by_queries[l].indices());
  // An eviction moves the columns: the engine hands the queries until a window of positions has run again.
  rows.evict(by_rows);
  queries.evict(by_queries);
  CHECK(rows.eviction_inputs(0).attention.heads() == 0);
  CHECK(rows.eviction_inputs(0).queries.heads() == heads);
  run(ctx.data() + 645, 31);
  CHECK(rows.eviction_inputs(9).attention.heads() == 0);
  run(ctx.data() + 676, 1);
  check_rows("after an eviction and 32 decoded positions (a ragged cache)");
}
