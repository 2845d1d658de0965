// docs/algorithms.md#paged: keys and values read in place through a page table (a vLLM block table, SGLang's
// req_to_token at page size 1, FlashInfer's page indices), pages shuffled in a pool whose other pages hold NaN.
// Every catalogue policy selects through the paged view exactly as through the contiguous one, for every layout,
// storage type, page size and page layout, dense and ragged; the CacheBook compacts and re-rotates a paged cache
// to the same contents as a contiguous one; bad page tables are refused by name.
#include <catch2/catch.hpp>

#include <kvevict/kvevict.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "support/cases.hpp"
#include "support/matchers.hpp"
#include "support/random_inputs.hpp"
#include "support/selector_inputs.hpp"

namespace test_paged_view {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Budget;
using kvevict::Index;
using kvevict::Selection;
using kvevict_test::MessageContains;
using kvevict_test::Rng;
using kvevict_test::Shape;

namespace {

enum class PageLayout { tokens_major, heads_major };  // [page_rows, Hkv, d] or [Hkv, page_rows, d] per page

const char* name_of(PageLayout p) { return p == PageLayout::tokens_major ? "NHD" : "HND"; }

/// What fills the pool's pages no request owns: NaN for floating storage, so a read outside the table is caught;
/// the lowest value for integers (int8 codes, whose scales are NaN there; positions, which then stop increasing).
template <class T>
T filler() {
  if constexpr (std::is_integral_v<T>)
    return std::numeric_limits<T>::lowest();
  else
    return T(std::numeric_limits<float>::quiet_NaN());
}

/// A random page table: ceil(rows / page_rows) distinct ids of a pool of twice as many pages plus one, shuffled.
std::vector<std::int32_t> random_table(Index rows, Index page_rows, Index& pool_pages, Rng& rng) {
  const Index used = (rows + page_rows - 1) / page_rows;
  pool_pages = 2 * used + 1;
  std::vector<std::int32_t> ids(static_cast<std::size_t>(pool_pages));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  ids.resize(static_cast<std::size_t>(used));
  return ids;
}

/// A contiguous [heads, rows, cols] tensor (heads-major) copied into a pool of pages through `table`: the view over
/// it reads the same values. The pool's other pages hold filler<T>().
template <class T>
struct PagedCopy {
  std::vector<T> pool;
  kvevict::HeadsView<T> view;

  PagedCopy(const std::vector<T>& heads_major, Index heads, Index rows, Index cols,
            const std::vector<std::int32_t>& table, Index page_rows, Index pool_pages, PageLayout layout) {
    pool.assign(static_cast<std::size_t>(pool_pages * page_rows * heads * cols), filler<T>());
    const Index page = page_rows * heads * cols;
    view = layout == PageLayout::tokens_major
               ? kvevict::HeadsView<T>(pool.data(), heads, rows, cols, cols, heads * cols,
                                       kvevict::PageTable{table.data(), page_rows, page, pool_pages})
               : kvevict::HeadsView<T>(pool.data(), heads, rows, cols, page_rows * cols, cols,
                                       kvevict::PageTable{table.data(), page_rows, page, pool_pages});
    for (Index h = 0; h < heads; ++h)
      for (Index r = 0; r < rows; ++r) std::copy_n(heads_major.begin() + (h * rows + r) * cols, cols, view.row(h, r));
  }
  PagedCopy(const PagedCopy&) = delete;
  PagedCopy& operator=(const PagedCopy&) = delete;
};

/// One layer stored contiguously (heads-major) and through a page table, with optional ragged lengths and
/// positions (paged too) and, for int8, per-head token scales (paged too).
template <class T>
struct PagedLayer {
  std::vector<T> k, v;
  std::vector<float> q, w_o, ks, vs, scores;  // scores: the engine's [Hkv, L, 1] (EngineScores), paged too
  std::vector<std::int64_t> lengths, positions;
  std::vector<std::int32_t> table;
  std::unique_ptr<PagedCopy<T>> pk, pv;
  std::unique_ptr<PagedCopy<float>> pks, pvs, pscores;
  std::unique_ptr<PagedCopy<std::int64_t>> ppos;
  kvevict::LayerInputs<T, float, float> contiguous, paged;

  PagedLayer(const kvevict_test::VLayer& l, bool ragged, Index page_rows, PageLayout layout, Rng& rng) {
    const Shape& s = l.s;
    const Index Hkv = s.Hkv, L = s.L, d = s.d;
    std::uniform_real_distribution<float> factor(0.5f, 1.5f);
    const auto store = [&](const std::vector<double>& x, std::vector<T>& out) {
      out.resize(x.size());
      for (std::size_t i = 0; i < x.size(); ++i) {
        if constexpr (std::is_same_v<T, std::int8_t>)
          out[i] = static_cast<std::int8_t>(std::clamp(std::lround(x[i] * 40), -127L, 127L));
        else
          out[i] = T(static_cast<float>(x[i]));
      }
    };
    store(l.k, k);
    store(l.v, v);
    q = kvevict_test::cast_to<float>(l.q);
    w_o = kvevict_test::cast_to<float>(l.w_o);
    Index pool_pages = 0;
    table = random_table(L, page_rows, pool_pages, rng);
    pk = std::make_unique<PagedCopy<T>>(k, Hkv, L, d, table, page_rows, pool_pages, layout);
    pv = std::make_unique<PagedCopy<T>>(v, Hkv, L, d, table, page_rows, pool_pages, layout);
    for (auto* in : {&contiguous, &paged}) {
      in->queries = kvevict::HeadsView<const float>::heads_major(q.data(), s.H, s.w, d);
      in->w_o = kvevict::output_projection<const float>(w_o.data(), l.D, s.H, d);
    }
    scores = kvevict_test::engine_scores<float>(static_cast<int>(Hkv), static_cast<int>(L));
    pscores = std::make_unique<PagedCopy<float>>(scores, Hkv, L, 1, table, page_rows, pool_pages, layout);
    contiguous.scores = kvevict::HeadsView<const float>::heads_major(scores.data(), Hkv, L, 1);
    paged.scores = pscores->view;
    contiguous.keys = kvevict::kv_heads_major<const T>(k.data(), Hkv, L, d);
    contiguous.values = kvevict::kv_heads_major<const T>(v.data(), Hkv, L, d);
    paged.keys = pk->view;
    paged.values = pv->view;
    if constexpr (std::is_same_v<T, std::int8_t>) {
      ks.resize(static_cast<std::size_t>(Hkv * L));
      vs.resize(ks.size());
      for (std::size_t i = 0; i < ks.size(); ++i) ks[i] = factor(rng), vs[i] = factor(rng);
      pks = std::make_unique<PagedCopy<float>>(ks, Hkv, L, 1, table, page_rows, pool_pages, layout);
      pvs = std::make_unique<PagedCopy<float>>(vs, Hkv, L, 1, table, page_rows, pool_pages, layout);
      contiguous.keys_scale = {1.0f / 40, kvevict::per_head_token_scales(ks.data(), Hkv, L)};
      contiguous.values_scale = {1.0f / 40, kvevict::per_head_token_scales(vs.data(), Hkv, L)};
      paged.keys_scale = {1.0f / 40, pks->view};
      paged.values_scale = {1.0f / 40, pvs->view};
    }
    if (ragged) {
      lengths.resize(static_cast<std::size_t>(Hkv));
      positions.resize(static_cast<std::size_t>(Hkv * L));
      for (Index h = 0; h < Hkv; ++h) {
        lengths[static_cast<std::size_t>(h)] = h == 0 ? L : std::uniform_int_distribution<Index>(L / 2, L)(rng);
        std::int64_t p = 0;
        for (Index j = 0; j < L; ++j) positions[static_cast<std::size_t>(h * L + j)] = p += 1 + (j % 3 == h % 2);
      }
      ppos = std::make_unique<PagedCopy<std::int64_t>>(positions, Hkv, L, 1, table, page_rows, pool_pages, layout);
      // Rows past a head's length inside its pages hold the filler too: a read past L_h fails like one off the table.
      for (Index h = 0; h < Hkv; ++h)
        for (Index r = lengths[static_cast<std::size_t>(h)]; r < L; ++r) {
          std::fill_n(pk->view.row(h, r), d, filler<T>());
          std::fill_n(pv->view.row(h, r), d, filler<T>());
          if (pks) *pks->view.row(h, r) = *pvs->view.row(h, r) = filler<float>();
        }
      for (auto* in : {&contiguous, &paged}) in->lengths = lengths.data();
      contiguous.positions = kvevict::positions_heads_major(positions.data(), Hkv, L);
      paged.positions = ppos->view;
    }
  }
};

bool same(const Selection& a, const Selection& b) {
  return a.indices() == b.indices() && a.offsets() == b.offsets() && a.blocks() == b.blocks() &&
         a.positions() == b.positions();
}

/// Every catalogue policy under every engine layout selects the same through both views of a two-layer model.
template <class T>
void same_through_pages(Rng& rng, Index page_rows, PageLayout layout, bool ragged, int& compared, int L = 72) {
  const Shape s{8, 2, 4, L, 16};
  std::vector<std::unique_ptr<PagedLayer<T>>> layers;
  std::vector<kvevict::LayerInputs<T, float, float>> contiguous, paged;
  for (int l = 0; l < 2; ++l) {
    layers.push_back(
        std::make_unique<PagedLayer<T>>(kvevict_test::random_vlayer(s, 24, rng), ragged, page_rows, layout, rng));
    contiguous.push_back(layers.back()->contiguous);
    paged.push_back(layers.back()->paged);
  }
  for (const kvevict_test::EngineLayout engine : kvevict_test::engine_layouts()) {
    if (ragged && engine.share != kvevict::Sharing::per_head) continue;   // a shared set needs equal heads
    if (L > 72 && engine.share == kvevict::Sharing::per_layer) continue;  // long layers: the reads, not the layouts
    kvevict::Knobs k;
    k.window = s.w;
    k.share = engine.share;
    k.block = engine.block;
    kvevict::catalogue::for_each(kvevict::catalogue::entries(), [&](const auto& e) {
      const auto policy = e.make(k);
      for (const Budget budget : {Budget::keep_ratio(0.5), Budget::tokens(17)}) {
        INFO(e.name << " share " << kvevict::to_string(engine.share) << " block " << engine.block << " page_rows "
                    << page_rows << " " << name_of(layout) << (ragged ? " ragged" : " dense"));
        const std::vector<Selection> a = kvevict::select_layers(policy, contiguous, budget);
        const std::vector<Selection> b = kvevict::select_layers(policy, paged, budget);
        REQUIRE(a.size() == b.size());
        for (std::size_t l = 0; l < a.size(); ++l) CHECK(same(a[l], b[l]));
        ++compared;
      }
    });
  }
}

}  // namespace

TEST_CASE(
    "paged views: a row's address is table(r / page_rows) * page_stride + h * head_stride + (r % page_rows) * "
    "row_stride, and a run ends with its page",
    "[views][paged]") {
  // 5 rows of 2 heads, head_dim 3, pages of 2 rows [page_rows, Hkv, d] (vLLM's layout): 12 elements a page.
  std::vector<float> pool(4 * 12);
  const std::int32_t table[] = {3, 0, 2};
  const auto v = kvevict::kv_paged_tokens_major<float>(pool.data(), 4, table, 5, 2, 2, 3);
  CHECK(v.paged());
  CHECK(v.row(0, 0) == pool.data() + 36);
  CHECK(v.row(1, 1) == pool.data() + 36 + 3 + 6);  // page 3, head 1, row 1 of the page
  CHECK(v.row(0, 2) == pool.data() + 0);
  CHECK(v.row(1, 4) == pool.data() + 24 + 3);  // page 2, head 1, row 0 of the page
  CHECK(v.run_rows(0) == 2);
  CHECK(v.run_rows(1) == 1);
  CHECK(v.run_rows(4) == 1);  // the last page holds one row of the view
  CHECK(v.run(1, 2, 2).data() == pool.data() + 3);
  CHECK(v.run(1, 2, 2).outerStride() == 6);
  // [Hkv, page_rows, d] pages (FlashInfer's HND, OpenVINO): head 1 of page 2 starts 6 elements in.
  const auto hnd = kvevict::kv_paged_heads_major<float>(pool.data(), 4, table, 5, 2, 2, 3);
  CHECK(hnd.row(1, 4) == pool.data() + 24 + 6);
  CHECK(hnd.row(1, 3) == pool.data() + 0 + 6 + 3);
  // The read-only form keeps the table.
  const kvevict::HeadsView<const float> c = v;
  CHECK(c.paged());
  CHECK(c.row(1, 4) == v.row(1, 4));
  // An unpaged view is one run per head.
  const auto flat = kvevict::kv_heads_major<float>(pool.data(), 2, 5, 3);
  CHECK_FALSE(flat.paged());
  CHECK(flat.run_rows(1) == 4);
}

TEST_CASE("paged views: bad page tables and whole-head reads are refused by name", "[views][paged][errors]") {
  std::vector<float> pool(4 * 12);
  const std::int32_t table[] = {3, 4, 2};
  CHECK_THROWS_MATCHES(kvevict::kv_paged_tokens_major<float>(pool.data(), 4, table, 5, 2, 2, 3),
                       kvevict::invalid_argument,
                       MessageContains("page table entry 1 (rows 2..3) must be a page of the pool, in [0, 4), got 4"));
  const std::int32_t negative[] = {-1};
  CHECK_THROWS_MATCHES(kvevict::kv_paged_tokens_major<float>(pool.data(), 4, negative, 2, 2, 2, 3),
                       kvevict::invalid_argument, MessageContains("got -1"));
  CHECK_THROWS_MATCHES(kvevict::kv_paged_tokens_major<float>(pool.data(), 4, table, 5, 0, 2, 3),
                       kvevict::invalid_argument, MessageContains("page_rows must be >= 1, got 0"));
  const std::int32_t repeated[] = {3, 0, 3};
  CHECK_THROWS_MATCHES(kvevict::kv_paged_tokens_major<float>(pool.data(), 4, repeated, 5, 2, 2, 3),
                       kvevict::invalid_argument, MessageContains("the page table lists page 3 twice"));
  CHECK_THROWS_MATCHES(kvevict::kv_paged_tokens_major<float>(pool.data(), 4, nullptr, 5, 2, 2, 3),
                       kvevict::invalid_argument, MessageContains("the page table must not be null for 5 rows"));
  const std::int32_t good[] = {3, 0, 2};
  const auto v = kvevict::kv_paged_tokens_major<float>(pool.data(), 4, good, 5, 2, 2, 3);
  CHECK_THROWS_MATCHES(v.head(0), kvevict::invalid_argument,
                       MessageContains("a paged view has no single matrix per head"));
  CHECK_THROWS_MATCHES(kvevict::last_rows(v, 2), kvevict::invalid_argument,
                       MessageContains("the view must not be paged"));
  // A NaN in a page the table reaches is named with its row, as in a contiguous cache.
  kvevict::LayerInputs<float> in;
  std::vector<float> q(4 * 1 * 3, 0.5f);
  std::fill(pool.begin(), pool.end(), 1.0f);
  v.row(1, 3)[2] = std::numeric_limits<float>::quiet_NaN();
  in.queries = kvevict::HeadsView<const float>::heads_major(q.data(), 4, 1, 3);
  in.keys = v;
  kvevict::SnapKV::Params p;
  p.window = 1;
  CHECK_THROWS_MATCHES(kvevict::SnapKV(p).select(in, Budget::tokens(3)), kvevict::invalid_argument,
                       MessageContains("keys[1, 3, 2] is not finite"));
}

TEMPLATE_TEST_CASE(
    "paged views: every catalogue policy selects through a page table exactly as through the "
    "contiguous view, for every layout, page size and page layout, dense and ragged",
    "[views][paged]", float, Eigen::half, std::int8_t) {
  using T = TestType;
  Rng rng(3602);
  int compared = 0;
  for (const Index page_rows : {Index{1}, Index{5}, Index{16}})
    for (const PageLayout layout : {PageLayout::tokens_major, PageLayout::heads_major})
      for (const bool ragged : {false, true}) {
        if (page_rows == 1 && layout == PageLayout::heads_major) continue;  // one row a page: the layouts coincide
        same_through_pages<T>(rng, page_rows, layout, ragged, compared);
      }
  CHECK(compared > 400);
}

TEMPLATE_TEST_CASE(
    "paged views: layers of several blocks (600 rows: blocks start inside pages) select as the "
    "contiguous view, pages of 16 and one page holding them all",
    "[views][paged]", float, std::int8_t) {
  using T = TestType;
  Rng rng(3604);
  int compared = 0;
  // Under the sanitizers pages of 16 only (the reads that cross pages inside a block; one page holding all is the
  // contiguous path): the test took 94 of their CPU-s with both.
  for (const Index page_rows : {Index{16}, Index{1024}})
    for (const bool ragged : {false, true})
      if (page_rows == 16 || !kvevict_test::sanitized)
        same_through_pages<T>(rng, page_rows, PageLayout::tokens_major, ragged, compared, 600);
  CHECK(compared > (kvevict_test::sanitized ? 50 : 100));
}

TEST_CASE(
    "paged views: the CacheBook evicts, compacts and re-rotates a paged cache to the contents of a contiguous "
    "one, step after step",
    "[views][paged][stream]") {
  Rng rng(3603);
  const Index H = 4, Hkv = 2, w = 4, d = 16, capacity = 96, page_rows = 8, step = 24, budget = 20;
  kvevict::Rope rope;
  rope.theta = 10000.0;
  Index pool_pages = 0;
  const std::vector<std::int32_t> table = random_table(capacity, page_rows, pool_pages, rng);
  std::vector<float> k(static_cast<std::size_t>(Hkv * capacity * d), 0.0f), v = k, q;
  const std::vector<float> w_o =
      kvevict_test::cast_to<float>(kvevict_test::normal_vector(static_cast<std::size_t>(24 * H * d), rng, 0.2));
  PagedCopy<float> pk(k, Hkv, capacity, d, table, page_rows, pool_pages, PageLayout::tokens_major);
  PagedCopy<float> pv(v, Hkv, capacity, d, table, page_rows, pool_pages, PageLayout::tokens_major);
  const auto flat_k = kvevict::kv_heads_major<float>(k.data(), Hkv, capacity, d);
  const auto flat_v = kvevict::kv_heads_major<float>(v.data(), Hkv, capacity, d);
  kvevict::CacheBook flat_book(1, Hkv, capacity), paged_book(1, Hkv, capacity);
  kvevict::DefensiveKV::Params p;
  p.window = w;
  const kvevict::DefensiveKV policy(p);
  for (int round = 0; round < 5; ++round) {
    // Append a step's rows at each head's end, in both caches.
    const Index first = flat_book.layer(0).length(0);
    for (Index h = 0; h < Hkv; ++h)
      for (Index r = first; r < first + step; ++r)
        for (Index c = 0; c < d; ++c) {
          const auto x = static_cast<float>(std::normal_distribution<double>(0, 1)(rng));
          const auto y = static_cast<float>(std::normal_distribution<double>(0, 1)(rng));
          flat_k.row(h, r)[c] = pk.view.row(h, r)[c] = x;
          flat_v.row(h, r)[c] = pv.view.row(h, r)[c] = y;
        }
    flat_book.append(step);
    paged_book.append(step);
    q = kvevict_test::cast_to<float>(kvevict_test::normal_vector(static_cast<std::size_t>(H * w * d), rng, 1.5));
    const auto inputs = [&](const kvevict::KVView<const float>& keys, const kvevict::KVView<const float>& values) {
      return [keys, values, &q, &w_o](Index) {
        kvevict::LayerInputs<float> in;
        in.w_o = kvevict::output_projection<const float>(w_o.data(), 24, H, d);
        in.queries = kvevict::HeadsView<const float>::heads_major(q.data(), H, w, d);
        in.keys = keys;
        in.values = values;
        return in;
      };
    };
    Selection flat_sel, paged_sel;
    kvevict::evict_over_budget(policy, flat_book, budget, inputs(flat_k, flat_v), [&](Index l, const Selection& s) {
      flat_sel = s;
      flat_book.layer(l).apply(s, flat_k, flat_v);
      kvevict::rerotate_kept(flat_k, s, rope);
      flat_book.layer(l).renumber();
    });
    kvevict::evict_over_budget(policy, paged_book, budget, inputs(pk.view, pv.view), [&](Index l, const Selection& s) {
      paged_sel = s;
      paged_book.layer(l).apply(s, pk.view, pv.view);
      kvevict::rerotate_kept(pk.view, s, rope);
      paged_book.layer(l).renumber();
    });
    INFO("round " << round);
    REQUIRE(same(flat_sel, paged_sel));
    for (Index h = 0; h < Hkv; ++h) {
      REQUIRE(flat_book.layer(0).length(h) == paged_book.layer(0).length(h));
      for (Index r = 0; r < flat_book.layer(0).length(h); ++r)
        for (Index c = 0; c < d; ++c) {
          CHECK(flat_k.row(h, r)[c] == pk.view.row(h, r)[c]);
          CHECK(flat_v.row(h, r)[c] == pv.view.row(h, r)[c]);
        }
    }
  }
}

}  // namespace test_paged_view
