// SPDX-License-Identifier: Apache-2.0
// examples/02_paged_engine/main.cpp: kvc inside a paged engine (docs/integration.md shows this file's code).
// An fp16 vLLM-style paged cache (block table, NHD pages) with GQA (8 query heads over 2 KV heads): validate it,
// compress it with SnapKV from the prompt's last queries, read the page report, compact in place, attend over the
// compacted cache, append the next token and attend again. CI builds and runs it.
#include <cstdio>
#include <vector>

// example-begin integration
#include <kvc/backend/cpu/attention/attend.hpp>
#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/backend/cpu/scorers/snap_kv.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/core/validate.hpp>
#include <kvc/pipeline/press.hpp>

int main() {
  using kvc::Index;
  Index const batch = 2, kv_heads = 2, q_heads = 8, dim = 64, page = 16, max_pages = 8, pool_pages = 16;
  kvc::KVExtents const ext{batch, kv_heads, max_pages * page, dim};  // capacity: what the block table addresses

  // The engine's memory: a pool of fp16 pages [pool_pages, page, kv_heads, dim] for K and one for V, a block table
  // [batch, max_pages] of int32 page ids, a length per (sequence, KV head) and each slot's absolute position.
  std::vector<kvc::half> k_pool(pool_pages * page * kv_heads * dim), v_pool(k_pool.size());
  std::vector<std::int32_t> block_table(batch * max_pages);
  for (Index i = 0; i < batch * max_pages; ++i)
    block_table[i] = static_cast<std::int32_t>((i * 5) % pool_pages);  // any permutation of pool pages
  std::vector<Index> lengths = {100, 100, 70, 70};  // sequence 0 holds 100 tokens, sequence 1 holds 70
  std::vector<Index> positions(ext.rows());
  for (Index i = 0; i < ext.rows(); ++i)
    positions[i] = i % ext.tokens;
  for (std::size_t i = 0; i < k_pool.size(); ++i) {  // stand-in for prefill's keys and values
    k_pool[i] = kvc::half(static_cast<float>((i * 7919) % 97) / 97.0f - 0.5f);
    v_pool[i] = kvc::half(static_cast<float>((i * 104729) % 89) / 89.0f - 0.5f);
  }
  auto const layout = kvc::paged_layout(ext, page, kvc::PageOrder::nhd, block_table.data(), max_pages, pool_pages);
  auto cache = kvc::make_cache(kvc::TokenRows<kvc::half, kvc::PagedLayout>(k_pool.data(), layout),
                               kvc::TokenRows<kvc::half, kvc::PagedLayout>(v_pool.data(), layout),
                               kvc::head_lengths(lengths.data(), kv_heads), positions.data());
  kvc::Status st = kvc::validate(cache);  // once per new view: shapes, page ids within the pool, lengths, positions
  if (!st.ok())
    return std::printf("validate: %s\n", st.message()), 1;

  // The prompt's last 16 queries (post-RoPE here), [batch, q_heads, 16, dim]: SnapKV's observation window.
  kvc::KVExtents const q_ext{batch, q_heads, 16, dim};
  std::vector<float> q(q_ext.rows() * dim);
  for (std::size_t i = 0; i < q.size(); ++i)
    q[i] = static_cast<float>((i * 31) % 23) / 23.0f - 0.5f;
  kvc::TokenRows<float const, kvc::StridedLayout> const q_rows(q.data(), kvc::bhtd_layout(q_ext));
  auto const obs = kvc::observe(kvc::WindowQueries<float>{q_rows});  // positions: the context's last 16

  // Decide: keep 32 tokens per head (the window's 16 included), SnapKV as its authors run it.
  kvc::Press const press{kvc::SnapKVScorer{.window_size = 16}, kvc::TopKSelector{kvc::FixedBudget{32}}};
  std::vector<std::byte> ws(kvc::compress_workspace_bytes(kvc::Cpu{}, press, ext, obs));
  std::vector<Index> index(ext.rows()), count(batch * kv_heads);
  kvc::KeepPlan<> const plan{index.data(), count.data(), batch, kv_heads, ext.tokens};
  st = kvc::compress(kvc::Cpu{}, press, cache, obs, plan, {ws.data(), ws.size()});
  if (!st.ok())
    return std::printf("compress: %s\n", st.message()), 1;

  // Before moving anything: which tail pages each sequence can give back (read the old lengths).
  std::vector<Index> pages_in_use(batch);
  kvc::PageReport const report = kvc::page_report(plan, cache, pages_in_use.data());

  // Apply: rows, positions and lengths move together inside each sequence's own pages.
  st = kvc::compact(kvc::Cpu{}, plan, cache);
  if (!st.ok())
    return std::printf("compact: %s\n", st.message()), 1;
  // The engine now frees block_table[b][pages_in_use[b]:] for each b; the next token goes at slot lengths[b, h].

  // Attention over the compacted cache: the causal mask reads the kept tokens' absolute positions.
  std::vector<float> out(q_ext.rows() * dim);
  kvc::AttendQueries<float> const attend_q{q_rows};
  std::vector<std::byte> attend_ws(kvc::attend_workspace_bytes(kvc::Cpu{}, kvc::Attention{}, attend_q, cache));
  st = kvc::attend(kvc::Cpu{}, kvc::Attention{}, attend_q, cache, {out.data()}, {attend_ws.data(), attend_ws.size()});

  // Decode one token: its K and V (rotated at its position) are appended after each head's length.
  kvc::KVExtents const one{batch, kv_heads, 1, dim};
  std::vector<kvc::half> k_new(one.rows() * dim, kvc::half(0.25f)), v_new(k_new.size(), kvc::half(1.0f));
  std::vector<Index> new_positions = {100, 100, 70, 70};  // [batch, kv_heads, 1]: the next absolute position
  if (st.ok())
    st = kvc::append(kvc::Cpu{}, cache,
                     kvc::dense_cache(k_new.data(), v_new.data(), one, kvc::Lengths{}, new_positions.data()));
  std::printf("%s: freed %lld of %lld pages; heads hold %lld %lld %lld %lld tokens, last position %lld\n", st.message(),
              static_cast<long long>(report.pages_freed()), static_cast<long long>(report.pages_before),
              static_cast<long long>(lengths[0]), static_cast<long long>(lengths[1]),
              static_cast<long long>(lengths[2]), static_cast<long long>(lengths[3]),
              static_cast<long long>(cache.position(0, 0, lengths[0] - 1)));
  return st.ok() ? 0 : 1;
}
// example-end integration
