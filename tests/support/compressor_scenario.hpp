// SPDX-License-Identifier: Apache-2.0
// tests/support/compressor_scenario.hpp: one engine session through kvc::LayerCompressor, the same on every backend:
// a prompt in a dense cache, prefill, then decode steps (append one token, attend, decode). The memory a backend
// reads comes from a `Mem` (host vectors, or device buffers in the CUDA parity wrappers), so the CPU test and the
// CUDA parity test run this one driver and compare what it reports. No Catch, no Eigen: nvcc compiles it too.
#pragma once

#include <kvc/core/rope.hpp>
#include <kvc/engine/layer_compressor.hpp>
#include <kvc/pipeline/compact.hpp>
#include <kvc/pipeline/packed_press.hpp>
#include <kvc/scorers/expected_attention.hpp>
#include <kvc/scorers/h2o.hpp>
#include <kvc/scorers/key_diff.hpp>
#include <kvc/scorers/knorm.hpp>
#include <kvc/scorers/moment_kv.hpp>
#include <kvc/scorers/random.hpp>
#include <kvc/scorers/snap_kv.hpp>
#include <kvc/scorers/streaming_llm.hpp>
#include <kvc/scorers/tova.hpp>
#include <kvc/scorers/uncomp.hpp>
#include <kvc/selectors/ada_kv.hpp>
#include <kvc/selectors/pyramid_kv.hpp>
#include <kvc/selectors/top_k.hpp>
#include <kvc/selectors/uncomp.hpp>

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

namespace kvc::test {

/// Every policy the scenario runs: the 11 token-eviction policies, AdaKV / PyramidKV over several scorers, MomentKV
/// without its MI score (`moment_kv_base`) and with AdaKV over prompts that fit its budget (`_fits`: nothing is
/// evicted at prefill, and every head grows to the target), and two with decode-time compression only (kvpress's
/// DecodingPress: `_decoding`).
inline std::vector<std::string> const& scenario_policies() {
  static std::vector<std::string> const names = {"streaming_llm",
                                                 "key_diff",
                                                 "knorm",
                                                 "random",
                                                 "snap_kv",
                                                 "tova",
                                                 "h2o",
                                                 "expected_attention",
                                                 "moment_kv",
                                                 "uncomp",
                                                 "ada_kv_snap_kv",
                                                 "ada_kv_key_diff",
                                                 "ada_kv_h2o",
                                                 "ada_kv_moment_kv",
                                                 "moment_kv_base",
                                                 "ada_kv_moment_kv_fits",
                                                 "pyramid_kv_snap_kv",
                                                 "pyramid_kv_tova",
                                                 "h2o_decoding",
                                                 "snap_kv_decoding"};
  return names;
}

/// The packed policies the scenario runs (RDKV with its own weights and with SnapKV's, KIVI): no decode-time
/// compression; the session reports their packed store.
inline std::vector<std::string> const& scenario_packed_policies() {
  static std::vector<std::string> const names = {"rdkv", "rdkv_snap_kv", "kivi"};
  return names;
}

/// scenario_policies() then scenario_packed_policies(): every policy the scenario runs.
inline std::vector<std::string> all_scenario_policies() {
  std::vector<std::string> names = scenario_policies();
  for (std::string const& p : scenario_packed_policies())
    names.push_back(p);
  return names;
}

/// How the session's cache holds K and V.
enum class CacheFormat {
  fp32,  ///< the values themselves
  e4m3,  ///< float8_e4m3 under a scale per (sequence, KV head) (or, in a float cache, the values that reads back)
  e5m2,  ///< float8_e5m2, likewise
};

/// The session: batch 2 (prompts of 40 and 29 tokens), 2 KV heads, 4 query heads, d = 16, a cache of 64 slots, the
/// prompt's last 8 queries, then `steps` decode tokens (compressions every 8 steps, or
/// every step for MomentKV and UNComp). Values come from a fixed integer hash (no RNG).
struct Scenario {
  Index batch = 2, kv_heads = 2, q_heads = 4, capacity = 64, dim = 16, window = 8, steps = 17;
  std::vector<Index> prompt = {40, 29};
  Index rope_positions = 1024;  ///< ExpectedAttention averages RoPE up to 512 positions past the context
  CacheFormat format = CacheFormat::fp32;
  /// Decode steps as an engine with CUDA graphs runs them (on a Mem that can capture): the first plain and the first
  /// compressing step are captured and launched, every later step replays one of the two
  /// (LayerCompressor::compresses_next picks it, LayerCompressor::replayed counts it).
  bool graphs = false;

  /// fp8 formats: head (b, h)'s K and V scales [B, Hkv], different per head (values in [-1, 1) then span up to
  /// about 100 stored units: inside both formats' range, with subnormals for the smallest).
  std::vector<float> k_scales() const { return scales(0.01f); }
  std::vector<float> v_scales() const { return scales(0.0125f); }
  std::vector<float> scales(float first) const {
    std::vector<float> s;
    for (Index i = 0; i < batch * kv_heads; ++i)
      s.push_back(first * (1.0f + 0.25f * static_cast<float>(i)));
    return s;
  }
  /// `x` ([B, Hkv, rows, d] values) as a cache of element type CT holds it under the format: the values (fp32); fp8
  /// elements stored under each head's scale; or, for a float cache of an fp8 format, the values those elements
  /// read back (the dequantised cache, which an fp8 cache must equal).
  template <class CT>
  std::vector<CT> stored(std::vector<float> const& x, std::vector<float> const& head_scales) const {
    std::size_t const per_head = x.size() / head_scales.size();
    std::vector<CT> out(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) {
      float const s = head_scales[i / per_head];
      if constexpr (is_fp8<CT>)
        out[i] = store<CT>(x[i], s);
      else if (format == CacheFormat::e4m3)
        out[i] = load(store<float8_e4m3>(x[i], s), s);
      else if (format == CacheFormat::e5m2)
        out[i] = load(store<float8_e5m2>(x[i], s), s);
      else
        out[i] = x[i];
    }
    return out;
  }

  KVExtents keys() const { return {batch, kv_heads, capacity, dim}; }
  /// A value in [-1, 1) from (stream, index).
  static float value(std::uint64_t stream, std::uint64_t i) {
    std::uint64_t z = stream * 0x9e3779b97f4a7c15ull + i * 0xbf58476d1ce4e5b9ull + 0x94d049bb133111ebull;
    z = (z ^ (z >> 31)) * 0xbf58476d1ce4e5b9ull;
    z ^= z >> 29;
    return static_cast<float>(z >> 40) / static_cast<float>(1ull << 23) - 1.0f;
  }
  std::vector<float> fill(std::uint64_t stream, std::size_t n) const {
    std::vector<float> x(n);
    for (std::size_t i = 0; i < n; ++i)
      x[i] = value(stream, i);
    return x;
  }
  /// The prompt's K (stream 1) and V (stream 2), [B, Hkv, capacity, d]: every slot filled (appends overwrite).
  std::vector<float> prompt_keys() const { return fill(1, static_cast<std::size_t>(keys().rows() * dim)); }
  std::vector<float> prompt_values() const { return fill(2, static_cast<std::size_t>(keys().rows() * dim)); }
  /// [B, Hkv]: every head of sequence b holds its prompt.
  std::vector<Index> prompt_lengths() const {
    std::vector<Index> n;
    for (Index b = 0; b < batch; ++b)
      n.insert(n.end(), static_cast<std::size_t>(kv_heads), prompt[static_cast<std::size_t>(b)]);
    return n;
  }
  /// [B, Hkv, capacity]: slot t holds position t.
  std::vector<Index> slot_positions() const {
    std::vector<Index> p(static_cast<std::size_t>(keys().rows()));
    for (std::size_t i = 0; i < p.size(); ++i)
      p[i] = static_cast<Index>(i) % capacity;
    return p;
  }
  /// The prompt's last `window` pre-RoPE queries (stream 3), [B, Hq, window, d], and their positions [B, window].
  KVExtents prompt_query_extents() const { return {batch, q_heads, window, dim}; }
  std::vector<float> prompt_queries() const {
    return fill(3, static_cast<std::size_t>(prompt_query_extents().rows() * dim));
  }
  std::vector<Index> prompt_query_positions() const {
    std::vector<Index> p;
    for (Index b = 0; b < batch; ++b)
      for (Index i = 0; i < window; ++i)
        p.push_back(prompt[static_cast<std::size_t>(b)] - window + i);
    return p;
  }
};

/// What a session reports (host copies): after prefill, and at the end.
struct ScenarioResult {
  std::vector<Index> prefill_lengths, prefill_positions;  ///< [B, Hkv], [B, Hkv, capacity] (slots < length)
  std::vector<Index> lengths, positions;                  ///< at the end
  std::vector<float> keys;                                ///< [B, Hkv, capacity, d] valid rows at the end, 0 beyond
  std::vector<float> attention;                           ///< every step's output [steps, B, Hq, 1, d]
  Index compressions = 0;
  std::vector<Index> moment_counts;    ///< MomentKV: evicted tokens per head at the end [B, Hkv]
  Index decode_synchronizations = -1;  ///< host synchronisations inside decode() calls (-1: not counted)
  // Packed policies, after prefill: per head [B, Hkv] the kept tokens and the accounting, and the dequantised store
  // (dequantized(), heads one after the other in packed order), and the state's error word.
  std::vector<Index> packed_tokens;
  std::vector<std::int64_t> packed_bits;  ///< [B, Hkv, 2]: payload, overhead
  std::vector<float> packed_keys, packed_values;
  std::vector<Index> packed_positions;
  int pack_error = -1;
  Index decode_allocations = -1;  ///< device allocations inside decode() calls (-1: not counted)
};

/// Calls fn(policy, options) with the named policy (scenario_policies) over memory space Space; tables the policy
/// reads are uploaded with mem.
template <class Space, class Mem, class Fn>
std::string with_scenario_policy(std::string const& name, Scenario const& sc, Mem& mem, Fn&& fn) {
  CompressorOptions<Space> options;
  options.decode = true;
  options.schedule.compression_interval = sc.window;  // window scorers read the last w buffered queries
  options.schedule.hidden_states_buffer_size = sc.window;
  options.schedule.target_size = 16;
  RatioBudget const half{0.5};
  SnapKVScorer const snap{Reference::authors, sc.window, 3, Pooling::max, GqaReduce::mean};
  PyramidKVBudget pyramid;
  pyramid.num_layers = 4;
  pyramid.window_size = 4;
  pyramid.compression_ratio = 0.5;
  pyramid.beta = 2;
  MomentKVScorer<Space, float> moment;
  moment.base.window_size = sc.window;
  moment.prefill_rounds = 4;
  auto algorithm_1 = [&] {  // MomentKV and UNComp decode one token at a time back to their budgets
    options.schedule.compression_interval = 1;
    options.schedule.hidden_states_buffer_size = 1;
  };
  if (name == "streaming_llm")
    return fn(Press{StreamingLLMScorer{4}, TopKSelector{FixedBudget{12}}}, options);
  if (name == "key_diff")
    return fn(Press{KeyDiffScorer{}, TopKSelector{half, 0, 2}}, options);
  if (name == "knorm")
    return fn(Press{KnormScorer{}, TopKSelector{half}}, options);
  if (name == "random")
    return fn(Press{RandomScorer{7}, TopKSelector{half}}, options);
  if (name == "snap_kv")
    return fn(Press{snap, TopKSelector{half, 0, sc.window}}, options);
  if (name == "tova")
    return fn(Press{TOVAScorer{}, TopKSelector{half}}, options);
  if (name == "h2o")
    return fn(Press{H2OScorer<Space>{}, TopKSelector{half, 0, 4}}, options);
  options.prefill = name.find("_decoding") == std::string::npos;  // kvpress's DecodingPress: decode compresses
  if (name == "h2o_decoding")
    return fn(Press{H2OScorer<Space>{}, TopKSelector{half, 0, 4}}, options);
  if (name == "snap_kv_decoding")
    return fn(Press{snap, TopKSelector{half, 0, sc.window}}, options);
  if (name == "expected_attention") {
    ExpectedAttentionScorer ea;
    ea.n_future_positions = 64;
    return fn(Press{ea, TopKSelector{half, ea.n_sink, 0}}, options);
  }
  if (name == "moment_kv") {
    algorithm_1();
    return fn(Press{moment, TopKSelector{FixedBudget{16}, 1, sc.window}}, options);
  }
  if (name == "uncomp") {
    algorithm_1();
    Index const* budgets = mem.upload(std::vector<Index>{18, 12});
    UNCompScorer<Space> uncomp;
    uncomp.window_size = sc.window;
    uncomp.kernel_size = 3;
    return fn(Press{uncomp, UNCompSelector<Space>{HeadBudgets<Space>{budgets, sc.kv_heads}, 0, sc.window}}, options);
  }
  if (name == "ada_kv_snap_kv")
    return fn(Press{snap, AdaKVSelector<RatioBudget>{half, 0.2, Reference::authors, 0, sc.window}}, options);
  if (name == "ada_kv_key_diff")
    return fn(Press{KeyDiffScorer{}, AdaKVSelector<RatioBudget>{half, 0.2, Reference::kvpress, 1, 0}}, options);
  if (name == "ada_kv_h2o")
    return fn(Press{H2OScorer<Space>{}, AdaKVSelector<RatioBudget>{half, 0.2, Reference::authors, 0, 4}}, options);
  if (name == "ada_kv_moment_kv") {
    algorithm_1();
    return fn(Press{moment, AdaKVSelector<FixedBudget>{{16}, 0.2, Reference::authors, 1, sc.window}}, options);
  }
  if (name == "moment_kv_base") {  // mi = false: the base score alone selects; the evicted tokens still fold
    algorithm_1();
    moment.mi = false;
    return fn(Press{moment, TopKSelector{FixedBudget{16}, 1, sc.window}}, options);
  }
  if (name == "ada_kv_moment_kv_fits") {
    algorithm_1();
    options.schedule.target_size = 48;
    return fn(Press{moment, AdaKVSelector<FixedBudget>{{48}, 0.2, Reference::authors, 1, sc.window}}, options);
  }
  if (name == "pyramid_kv_snap_kv")
    return fn(Press{snap, TopKSelector<PyramidKVBudget>{pyramid, 0, 4}}, options);
  if (name == "pyramid_kv_tova")
    return fn(Press{TOVAScorer{}, TopKSelector<PyramidKVBudget>{pyramid, 0, 4}}, options);
  return "unknown scenario policy " + name;
}

/// with_scenario_policy for the packed policies (scenario_packed_policies).
template <class Space, class Mem, class Fn>
std::string with_scenario_packed_policy(std::string const& name, Scenario const& sc, Mem&, Fn&& fn) {
  CompressorOptions<Space> options;  // no decode-time compression: the allocation is static, decoded tokens join
                                     // the fp16 tail
  SnapKVScorer const snap{Reference::authors, sc.window, 3, Pooling::max, GqaReduce::mean};
  if (name == "rdkv") {
    RDKVPress<> rdkv;
    rdkv.scorer.window_size = rdkv.channels.window_size = sc.window;
    rdkv.allocator.budget_tokens = 10;
    rdkv.allocator.residual = 4;
    rdkv.pack.k_group = 8;
    rdkv.pack.v_group = 8;
    return fn(rdkv, options);
  }
  if (name == "rdkv_snap_kv") {
    RDKVPress<SnapKVScorer> rdkv{snap};
    rdkv.channels.window_size = sc.window;
    rdkv.allocator.ratio = 0.5;
    rdkv.allocator.solver = BitSolver::lagrangian;
    rdkv.pack = {ZeroPoint::integer, 0, 0, true};
    return fn(rdkv, options);
  }
  if (name == "kivi")
    return fn(KIVIPress{2, 8, 6}, options);
  if (name == "kivi_small_store") {  // a store for 8 tokens a head: packing must fail whole (pack_error)
    options.packed_tokens = 8;
    return fn(KIVIPress{2, 8, 6}, options);
  }
  return "unknown scenario policy " + name;
}

/// with_scenario_policy or with_scenario_packed_policy, by name.
template <class Space, class Mem, class Fn>
std::string with_any_scenario_policy(std::string const& name, Scenario const& sc, Mem& mem, Fn&& fn) {
  for (std::string const& packed : scenario_packed_policies())
    if (name == packed)
      return with_scenario_packed_policy<Space>(name, sc, mem, fn);
  if (name == "kivi_small_store")
    return with_scenario_packed_policy<Space>(name, sc, mem, fn);
  return with_scenario_policy<Space>(name, sc, mem, fn);
}

/// A packed layer's store, read back to the host and dequantised (ScenarioResult's packed_ fields).
template <class Mem, class Compressor>
void packed_result(Mem& mem, Compressor const& layer, ScenarioResult& r) {
  auto const v = layer.packed();
  PackedStore<> const shape{nullptr, nullptr, v.batch, v.kv_heads, v.dim, v.value_dim, v.max_tokens, v.quant};
  std::vector<std::byte> const arena = mem.download(v.arena, static_cast<std::size_t>(shape.arena_bytes()));
  std::vector<PackedHead> const heads = mem.download(v.heads, static_cast<std::size_t>(v.batch * v.kv_heads));
  r.pack_error = mem.download(layer.pack_error(), 1)[0];
  PackedKVView<> const host{arena.data(), heads.data(), v.batch, v.kv_heads, v.dim, v.value_dim, v.max_tokens, v.quant};
  for (Index b = 0; b < v.batch; ++b)
    for (Index h = 0; h < v.kv_heads; ++h) {
      PackedHead const& d = host.head(b, h);
      r.packed_tokens.push_back(d.tokens);
      r.packed_bits.push_back(d.payload_bits);
      r.packed_bits.push_back(d.overhead_bits);
      auto const n = static_cast<std::size_t>(d.tokens);
      std::vector<float> k(n * static_cast<std::size_t>(v.dim)), val(n * static_cast<std::size_t>(v.value_dim));
      std::vector<Index> pos(n);
      dequantized(host, b, h, k.data(), val.data(), pos.data());
      r.packed_keys.insert(r.packed_keys.end(), k.begin(), k.end());
      r.packed_values.insert(r.packed_values.end(), val.begin(), val.end());
      r.packed_positions.insert(r.packed_positions.end(), pos.begin(), pos.end());
    }
}

/// Runs the session with `policy` on `backend` (layer index 1 of 4, for PyramidKV). Mem: upload(vector) -> pointer
/// in the backend's space, alloc<T>(n), write(pointer, vector), download(pointer, n) -> vector, sync() -> "" or an
/// error, and before_decode() / after_decode() around each decode() call (where a device memory counts what the call
/// did); for sc.graphs, begin_capture(), end_capture(kind), captured(kind) and launch(kind) (-> "" or an error) with
/// kind 0 a plain step's graph and 1 a compressing step's.
/// CT: the cache's element type (float, or the fp8 type of sc.format, whose views carry the scenario's scales).
template <class CT = float, Backend B, class Mem, class Policy>
std::string run_scenario(B const& backend, Mem& mem, Policy const& policy,
                         CompressorOptions<typename B::memory_space> options, Scenario const& sc, ScenarioResult& r) {
  using Space = typename B::memory_space;
  using Rows = TokenRows<CT, StridedLayout, Space>;
  KVExtents const e = sc.keys();
  auto fail = [](Status const& st) { return std::string(st.message()); };
  std::vector<float> const k_scales = sc.k_scales(), v_scales = sc.v_scales();
  auto access = [&](std::vector<float> const& scales) {  // fp8: one scale per (sequence, KV head)
    if constexpr (is_fp8<CT>)
      return sequence_head_scales(mem.upload(scales), e.heads);
    else
      return PlainAccess{};
  };
  auto const k_access = access(k_scales), v_access = access(v_scales);
  // The prompt's K and V (every slot filled; slots past a sequence's prompt are overwritten by appends).
  CT* k = mem.upload(sc.stored<CT>(sc.prompt_keys(), k_scales));
  CT* v = mem.upload(sc.stored<CT>(sc.prompt_values(), v_scales));
  std::vector<Index> const lengths_host = sc.prompt_lengths(), positions_host = sc.slot_positions();
  Index* lengths = mem.upload(lengths_host);
  Index* positions = mem.upload(positions_host);
  auto const cache = make_cache(Rows(k, bhtd_layout(e), k_access), Rows(v, bhtd_layout(e), v_access),
                                head_lengths(lengths, e.heads), positions);
  // RoPE (neox, theta 10000) for the queries, which are pre-RoPE.
  RopeSpec spec;
  std::vector<float> rope_host(static_cast<std::size_t>(rope_table_floats(sc.rope_positions, e.dim)));
  RopeTable<> host_table;
  if (Status const st = fill_rope_table(spec, e.dim, sc.rope_positions, rope_host.data(), host_table); !st.ok())
    return fail(st);
  float const* rope = mem.upload(rope_host);
  options.rope = {rope, rope + (host_table.sin - host_table.cos), host_table.positions, host_table.rotary_dim,
                  host_table.style};

  LayerCompressor<Policy, B, float> base(backend, policy, options);
  if (Status const st = base.plan(cache, QueryShape{sc.q_heads, sc.window, 1, 1}); !st.ok())
    return fail(st);
  LayerCompressor layer = base;  // a planned compressor copied per layer
  void* state = mem.template alloc<std::byte>(layer.state_bytes());
  void* ws_data = mem.template alloc<std::byte>(layer.workspace_bytes());
  Workspace const ws{ws_data, layer.workspace_bytes()};
  if (Status const st = layer.bind(state, layer.state_bytes(), 1); !st.ok())
    return fail(st);
  if (Status const st = layer.reset(); !st.ok())
    return fail(st);

  // Prefill: the prompt's last `window` queries (positions P_b - w + i).
  LayerQueries<float, Space> const prompt{TokenRows<float const, StridedLayout, Space>(
                                              mem.upload(sc.prompt_queries()), bhtd_layout(sc.prompt_query_extents())),
                                          mem.upload(sc.prompt_query_positions())};
  if (Status const st = layer.prefill(cache, prompt, ws); !st.ok())
    return fail(st);
  if (std::string const err = mem.sync(); !err.empty())
    return err;
  r.prefill_lengths = mem.download(lengths, lengths_host.size());
  r.prefill_positions = mem.download(positions, positions_host.size());
  if constexpr (is_packed_press<Policy>)
    packed_result(mem, layer, r);

  // Decode: each step appends one token per sequence at its next position, attends with its query, then decodes.
  // The step's inputs live in buffers of their own, rewritten before each step (an engine's static inputs: a graph
  // captured at one step reads them at every replay).
  KVExtents const one{e.batch, e.heads, 1, e.dim}, q1{e.batch, sc.q_heads, 1, e.dim};
  auto const row_count = [](KVExtents const& x) { return static_cast<std::size_t>(x.rows() * x.dim); };
  float* out = mem.template alloc<float>(row_count(q1));
  CT* k1 = mem.template alloc<CT>(row_count(one));
  CT* v1 = mem.template alloc<CT>(row_count(one));
  Index* token_pos = mem.template alloc<Index>(static_cast<std::size_t>(one.rows()));
  float* q = mem.template alloc<float>(row_count(q1));
  float* rotated = mem.template alloc<float>(row_count(q1));
  Index* qpos = mem.template alloc<Index>(static_cast<std::size_t>(e.batch));
  auto const fresh =
      make_cache(Rows(k1, bhtd_layout(one), k_access), Rows(v1, bhtd_layout(one), v_access), Lengths{}, token_pos);
  AttendQueries<float, Space> const attend_q{TokenRows<float const, StridedLayout, Space>(rotated, bhtd_layout(q1)),
                                             qpos};
  LayerQueries<float, Space> const step{TokenRows<float const, StridedLayout, Space>(q, bhtd_layout(q1)), qpos};
  auto const run_step = [&]() -> std::string {  // what an engine's decode forward calls, per layer
    if (Status const st = append(backend, cache, fresh); !st.ok())
      return fail(st);
    if (Status const st = layer.attend(attend_q, cache, AttendOutput<Space>{out}, ws); !st.ok())
      return fail(st);
    mem.before_decode();
    Status const st = layer.decode(cache, step, ws);
    mem.after_decode();
    return st.ok() ? std::string() : fail(st);
  };
  for (Index s = 0; s < sc.steps; ++s) {
    std::vector<Index> token_pos_host, query_pos;
    for (Index b = 0; b < e.batch; ++b) {
      query_pos.push_back(sc.prompt[static_cast<std::size_t>(b)] + s);
      for (Index h = 0; h < e.heads; ++h)
        token_pos_host.push_back(sc.prompt[static_cast<std::size_t>(b)] + s);
    }
    // The new token arrives as the cache stores it (fp8: already quantised under the head's scale).
    mem.write(k1, sc.stored<CT>(sc.fill(100 + 2 * static_cast<std::uint64_t>(s), row_count(one)), k_scales));
    mem.write(v1, sc.stored<CT>(sc.fill(101 + 2 * static_cast<std::uint64_t>(s), row_count(one)), v_scales));
    mem.write(token_pos, token_pos_host);
    // The step's query, pre-RoPE for the compressor; rotated on the host for attention (post-RoPE).
    std::vector<float> const q_host = sc.fill(200 + static_cast<std::uint64_t>(s), row_count(q1));
    std::vector<float> rotated_host = q_host;
    for (Index b = 0; b < e.batch; ++b)
      for (Index h = 0; h < sc.q_heads; ++h)
        host_table.rotate(rotated_host.data() + (b * sc.q_heads + h) * e.dim, query_pos[static_cast<std::size_t>(b)]);
    mem.write(q, q_host);
    mem.write(rotated, rotated_host);
    mem.write(qpos, query_pos);
    std::string err;
    if constexpr (requires { mem.begin_capture(); }) {
      if (sc.graphs) {
        int const kind = layer.compresses_next() ? 1 : 0;
        if (!mem.captured(kind)) {  // capture the step (decode() counts it), then run it
          err = mem.begin_capture();
          if (err.empty()) {
            err = run_step();
            std::string const ended = mem.end_capture(kind);
            err = err.empty() ? ended : err;
          }
        } else if (Status const st = layer.replayed(); !st.ok()) {
          err = fail(st);
        }
        if (err.empty())
          err = mem.launch(kind);
      } else {
        err = run_step();
      }
    } else {
      err = run_step();
    }
    if (err.empty())
      err = mem.sync();
    if (!err.empty())
      return "step " + std::to_string(s) + ": " + err;
    std::vector<float> const o = mem.download(out, row_count(q1));
    r.attention.insert(r.attention.end(), o.begin(), o.end());
  }
  if (std::string const err = mem.sync(); !err.empty())
    return err;
  r.compressions = layer.counter().compressions;
  if constexpr (requires { policy.scorer; }) {
    if constexpr (detail::is_moment_kv<std::remove_cvref_t<decltype(policy.scorer)>>)
      r.moment_counts = mem.download(layer.moments().count, lengths_host.size());
  }
  r.lengths = mem.download(lengths, lengths_host.size());
  r.positions = mem.download(positions, positions_host.size());
  std::vector<CT> const keys = mem.download(k, static_cast<std::size_t>(e.rows() * e.dim));
  r.keys.assign(keys.size(), 0.0f);
  for (Index row = 0; row < e.rows(); ++row)
    if (row % e.tokens < r.lengths[static_cast<std::size_t>(row / e.tokens)])
      for (Index c = 0; c < e.dim; ++c) {  // the values the cache holds (fp8: under the head's scale)
        float const x = to_float(keys[static_cast<std::size_t>(row * e.dim + c)]);
        r.keys[static_cast<std::size_t>(row * e.dim + c)] =
            is_fp8<CT> ? x * k_scales[static_cast<std::size_t>(row / e.tokens)] : x;
      }
  return {};
}

/// Host memory for run_scenario (kvc::Cpu).
struct HostMemory {
  std::vector<std::vector<std::byte>> blocks;

  template <class T>
  T* alloc(std::size_t n) {
    blocks.emplace_back(n * sizeof(T) + 64);
    auto const p = reinterpret_cast<std::uintptr_t>(blocks.back().data());
    return reinterpret_cast<T*>((p + 63) / 64 * 64);
  }
  template <class T>
  T* upload(std::vector<T> const& x) {
    T* p = alloc<T>(x.size());
    std::copy(x.begin(), x.end(), p);
    return p;
  }
  template <class T>
  void write(T* p, std::vector<T> const& x) const {
    std::copy(x.begin(), x.end(), p);
  }
  template <class T>
  std::vector<T> download(T const* p, std::size_t n) const {
    return std::vector<T>(p, p + n);
  }
  std::string sync() const { return {}; }
  void before_decode() const {}
  void after_decode() const {}
};

}  // namespace kvc::test
