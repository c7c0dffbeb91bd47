// SPDX-License-Identifier: Apache-2.0
// examples/02_paged_engine/main.cpp: kvc inside a paged engine (docs/integration.md shows main()).
// Two layers of fp16 vLLM-style paged caches (block table, NHD pages) with GQA (8 query heads over 2 KV heads), one
// kvc::LayerCompressor per layer: compress after the prompt, then 24 decode steps (append, attend, decode) with
// compression every 16 steps. Changing the `policy` line changes the policy and nothing else. CI builds and runs it.
#include <kvc/kvc.hpp>  // every CPU kernel, so that any policy compiles; an engine includes the ones it uses

#include <cstdio>
#include <vector>

using kvc::Index;

/// Stand-in for the engine's own memory and model: per layer, fp16 pages [pool_pages, page, kv_heads, dim] for K and
/// V, lengths per (sequence, KV head) and each slot's absolute position; one block table [batch, max_pages] (int32)
/// shared by the layers; the queries its projections would produce (pre-RoPE) and their rotary output (post-RoPE).
struct PagedEngine {
  static constexpr Index layers = 2, batch = 2, kv_heads = 2, q_heads = 8, dim = 64, page = 16, max_pages = 8,
                         pool_pages = 16;
  kvc::KVExtents const ext{batch, kv_heads, max_pages* page, dim};  // capacity: what the block table addresses
  std::vector<Index> const prompt = {100, 70};                      // sequence 0 holds 100 tokens, sequence 1 70
  std::vector<std::int32_t> block_table;
  kvc::PagedLayout layout;
  std::vector<std::vector<kvc::half>> k, v;
  std::vector<std::vector<Index>> lengths, positions;
  std::vector<float> rope_storage, queries, rotated, out;
  kvc::RopeTable<> rope;  // theta 10000, NeoX, positions [0, 1024)
  std::vector<Index> query_positions, token_positions;
  std::vector<kvc::half> k_new, v_new;

  static float fake(std::size_t i, int salt) {
    return static_cast<float>((i * 7919 + static_cast<std::size_t>(salt) * 104729) % 97) / 97 - 0.5f;
  }

  PagedEngine()
      : block_table(batch * max_pages),
        k(layers),
        v(layers),
        lengths(layers, {100, 100, 70, 70}),
        positions(layers),
        rope_storage(kvc::rope_table_floats(1024, dim)),
        queries(batch * q_heads * 16 * dim),
        rotated(batch * q_heads * dim),
        out(rotated.size()),
        k_new(batch * kv_heads * dim),
        v_new(k_new.size()) {
    for (Index i = 0; i < batch * max_pages; ++i)
      block_table[i] = static_cast<std::int32_t>((i * 5) % pool_pages);  // any permutation of pool pages
    layout = kvc::paged_layout(ext, page, kvc::PageOrder::nhd, block_table.data(), max_pages, pool_pages);
    for (Index l = 0; l < layers; ++l) {
      for (std::size_t i = 0; i < std::size_t(pool_pages * page * kv_heads * dim); ++i) {  // the prompt's K and V
        k[l].push_back(kvc::half(fake(i, int(l))));
        v[l].push_back(kvc::half(fake(i, int(l) + 7)));
      }
      for (Index i = 0; i < ext.rows(); ++i)
        positions[l].push_back(i % ext.tokens);
    }
    for (std::size_t i = 0; i < queries.size(); ++i)
      queries[i] = fake(i, 3);
    (void)kvc::fill_rope_table(kvc::RopeSpec{}, dim, 1024, rope_storage.data(), rope);
  }

  /// Layer l's cache: a view over the engine's pages and tables (no copy).
  auto cache(Index l) {
    return kvc::make_cache(kvc::TokenRows<kvc::half, kvc::PagedLayout>(k[l].data(), layout),
                           kvc::TokenRows<kvc::half, kvc::PagedLayout>(v[l].data(), layout),
                           kvc::head_lengths(lengths[l].data(), kv_heads), positions[l].data());
  }
  /// The prompt's last `window` pre-RoPE queries [batch, Hq, window, d] and their positions [batch, window].
  kvc::LayerQueries<float> prompt_queries(Index, Index window) {
    query_positions.clear();
    for (Index b = 0; b < batch; ++b)
      for (Index i = 0; i < window; ++i)
        query_positions.push_back(prompt[b] - window + i);
    return {{queries.data(), kvc::bhtd_layout({batch, q_heads, window, dim})}, query_positions.data()};
  }
  /// Decode step s: its token's K and V [batch, Hkv, 1, d] with positions, and its query, pre- and post-RoPE.
  kvc::KVCache<kvc::TokenRows<kvc::half, kvc::StridedLayout>, kvc::TokenRows<kvc::half, kvc::StridedLayout>> new_tokens(
      Index l, Index s) {
    for (std::size_t i = 0; i < k_new.size(); ++i) {
      k_new[i] = kvc::half(fake(i + std::size_t(s), int(l)));
      v_new[i] = kvc::half(fake(i + std::size_t(s), int(l) + 7));
    }
    token_positions = {prompt[0] + s, prompt[0] + s, prompt[1] + s, prompt[1] + s};
    return kvc::dense_cache(k_new.data(), v_new.data(), {batch, kv_heads, 1, dim}, kvc::Lengths{},
                            token_positions.data());
  }
  kvc::LayerQueries<float> step_queries(Index s) {
    query_positions = {prompt[0] + s, prompt[1] + s};
    return {{queries.data(), kvc::bhtd_layout({batch, q_heads, 1, dim})}, query_positions.data()};
  }
  kvc::AttendQueries<float> attend_queries(Index s) {
    kvc::LayerQueries<float> const q = step_queries(s);
    for (Index b = 0; b < batch; ++b)
      for (Index h = 0; h < q_heads; ++h) {
        std::copy_n(q.rows.row(b, h, 0), dim, rotated.data() + (b * q_heads + h) * dim);
        rope.rotate(rotated.data() + (b * q_heads + h) * dim, q.positions[b]);
      }
    return {{rotated.data(), q.rows.layout()}, q.positions};
  }
};

// example-begin integration
int main() {
  PagedEngine engine;  // fp16 pages, a block table, GQA: the memory an engine owns (above)
  Index const window = 16, steps = 24;

  // The policy (this line) and the schedule: SnapKV keeps half of the prompt, then 48 tokens every 16 steps.
  kvc::Press const policy{kvc::SnapKVScorer{.window_size = window},
                          kvc::TopKSelector{kvc::RatioBudget{0.5}, 0, window}};
  kvc::CompressorOptions<kvc::HostSpace> options{.rope = engine.rope, .decode = true};
  options.schedule = {.compression_interval = 16, .target_size = 48, .hidden_states_buffer_size = 16};

  // Plan once per layer shape; each layer binds its own state; one workspace serves them all.
  kvc::LayerCompressor planned(kvc::Cpu{}, policy, options);
  kvc::Status st =
      planned.plan(engine.cache(0), kvc::QueryShape{.heads = engine.q_heads, .prompt_rows = window, .step_rows = 1});
  std::vector<decltype(planned)> layer(engine.layers, planned);
  std::vector<std::byte> state(engine.layers * planned.state_bytes()), ws(planned.workspace_bytes());
  kvc::Workspace const workspace{ws.data(), ws.size()};
  for (Index l = 0; l < engine.layers && st.ok(); ++l)
    if (st = layer[l].bind(state.data() + l * planned.state_bytes(), planned.state_bytes(), l); st.ok())
      st = layer[l].reset();  // a new sequence

  // After the prompt's forward: compress each layer.
  for (Index l = 0; l < engine.layers && st.ok(); ++l)
    st = layer[l].prefill(engine.cache(l), engine.prompt_queries(l, window), workspace);

  // Each decode forward, per layer: append the token's K and V, attend, then let the compressor run its schedule.
  for (Index s = 0; s < steps && st.ok(); ++s)
    for (Index l = 0; l < engine.layers && st.ok(); ++l) {
      st = kvc::append(kvc::Cpu{}, engine.cache(l), engine.new_tokens(l, s));
      if (st.ok())
        st = layer[l].attend(engine.attend_queries(s), engine.cache(l), {engine.out.data()}, workspace);
      if (st.ok())
        st = layer[l].decode(engine.cache(l), engine.step_queries(s), workspace);
    }

  std::vector<Index> const& n = engine.lengths[1];
  std::printf("%s: %lld compressions per layer; layer 1 heads hold %lld %lld %lld %lld tokens, last position %lld\n",
              st.message(), static_cast<long long>(layer[1].counter().compressions), static_cast<long long>(n[0]),
              static_cast<long long>(n[1]), static_cast<long long>(n[2]), static_cast<long long>(n[3]),
              static_cast<long long>(engine.cache(1).position(1, 1, n[3] - 1)));
  return st.ok() ? 0 : 1;
}
// example-end integration
