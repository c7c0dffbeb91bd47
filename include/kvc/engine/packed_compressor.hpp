// SPDX-License-Identifier: Apache-2.0
// kvc/engine/packed_compressor.hpp: kvc::LayerCompressor for the packed policies (kvc::RDKVPress, kvc::KIVIPress):
// the same calls as every other policy (engine/layer_compressor.hpp), with a packed store in the layer's state.
//
//   plan     checks; state_bytes() = the packed store of the layer (a region of packed_head_bytes_bound(n) per
//            (sequence, KV head), n = (options.packed_tokens, or the cache's slots) - residual, and the
//            descriptors); workspace_bytes().
//   prefill  once per sequence, after the prompt: the bit plan (RDKV: token weights from `scorer` over the prompt's
//            queries — window queries, ExpectedAttention's statistics, or H2O's accumulated attention in scratch
//            state —, shifted to >= 0 unless they are RDKV's own; ThinK channel weights from the window queries;
//            kvc::allocate_bits. KIVI: kvc::kivi_bit_plan), the newest `residual`
//            valid tokens of each head kept in the engine's cache (compacted to its front: the fp16 tail, zone C),
//            every other kept token packed into the state (kvc::pack_into). The allocation is static (the paper's):
//            a second prefill before reset() is an error. bit_plan(ws) reads the plan back from the workspace.
//   decode   nothing to run: the engine appends decoded tokens to its cache, the tail (options.decode is refused).
//   attend   kvc::attend_packed over the packed store and kvc::attend over the tail, merged through their
//            log-sum-exps (kvc::merge_attention): exact attention over the union of the two token sets. Before
//            prefill the store is empty and this is attention over the cache. The queries' positions are required.
// On both backends; on CUDA nothing is read on the host. Bad data found while packing (a NaN, an Inf or a value beyond
// FP16 among the tokens to store) leaves the store empty, all heads: the CPU returns it as prefill's Status, CUDA
// cannot without a synchronisation and sets the state's error word instead (pack_error(), a device int, 0 = fine,
// cleared by reset()); attention then runs over the tail alone.
#pragma once

#include <kvc/attention/attend.hpp>
#include <kvc/attention/merge.hpp>
#include <kvc/attention/packed.hpp>
#include <kvc/core/checks.hpp>
#include <kvc/core/observations.hpp>
#include <kvc/core/scorer.hpp>
#include <kvc/engine/compressor_types.hpp>
#include <kvc/pipeline/compact.hpp>
#include <kvc/pipeline/pack.hpp>
#include <kvc/pipeline/packed_press.hpp>
#include <kvc/pipeline/query_statistics.hpp>
#include <kvc/pipeline/state.hpp>
#include <kvc/scorers/rdkv.hpp>
#include <kvc/selectors/rdkv.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace kvc {

namespace detail {
/// The scorer of RDKV's token weights (RDKVTokenScorer for KIVI, which has none).
template <class P>
struct weight_scorer_of {
  using type = RDKVTokenScorer;
};
template <class S>
struct weight_scorer_of<RDKVPress<S>> {
  using type = S;
};
template <class P>
using weight_scorer = typename weight_scorer_of<P>::type;
template <class P>
inline constexpr bool reads_statistics = has_need(weight_scorer<P>::needs, Needs::query_statistics);
}  // namespace detail

template <class P, Backend B, Element Q>
requires is_packed_press<P>
class LayerCompressor<P, B, Q> {
 public:
  using memory_space = typename B::memory_space;
  using policy_type = P;

  static_assert(std::is_same_v<P, KIVIPress> || !StatefulScorer<detail::weight_scorer<P>> ||
                    detail::is_h2o<detail::weight_scorer<P>>,
                "kvc::LayerCompressor: RDKV's weights come from a stateless scorer or H2O (UNComp and MomentKV run "
                "their own drivers)");

  B backend{};
  policy_type policy;
  CompressorOptions<memory_space> options{};

  LayerCompressor(B backend_, policy_type policy_, CompressorOptions<memory_space> options_ = {})
      : backend(backend_), policy(policy_), options(options_) {}

  /// Plans for caches shaped like `cache` and queries `shape` (RDKV: prompt_rows >= the weights' window). Host only.
  template <KVCacheView C>
  Status plan(C const& cache, QueryShape const& shape) {
    static_assert(AccessibleFrom<C, B>,
                  "kvc::LayerCompressor: the cache lives in a memory space this backend cannot read");
    planned_ = false;
    bound_.on = ready_.on = false;
    KVExtents const e = cache.keys.extents();
    KVC_RETURN_IF_ERROR(detail::check_plan_shape(e, shape));
    KVC_RETURN_IF_ERROR(policy.check());
    if (shape.prompt_rows < policy.window_rows())
      return {Errc::invalid_argument,
              "kvc::LayerCompressor::plan: RDKV's weights read the prompt's last window_size query rows: "
              "prompt_rows must be >= window_size"};
    if (detail::reads_statistics<P> && options.rope.empty())
      return {Errc::invalid_argument,
              "kvc::LayerCompressor::plan: ExpectedAttention's weights read pre-RoPE queries: set options.rope"};
    if (options.decode || !options.prefill)
      return {Errc::invalid_argument,
              "kvc::LayerCompressor::plan: RDKV and KIVI allocate once, after the prompt (options.prefill = true); "
              "decoded tokens join the fp16 tail (options.decode = false)"};
    keys_ = e;
    value_dim_ = cache.values.extents().dim;
    queries_ = shape;
    if (options.packed_tokens < 0)
      return {Errc::invalid_argument, "kvc::LayerCompressor::plan: options.packed_tokens must be >= 0"};
    // A head packs at most its valid tokens at prefill (options.packed_tokens, else every slot) less the tail.
    Index const valid =
        options.packed_tokens > 0 && options.packed_tokens < e.tokens ? options.packed_tokens : e.tokens;
    Index const packed = valid > residual() ? valid - residual() : 0;
    store_ = {nullptr, nullptr, e.batch, e.heads, e.dim, value_dim_, packed, quant()};
    state_bytes_ = carve_state(nullptr, saturated_bytes);
    workspace_bytes_ = plan_workspace(cache);
    if (store_.region_bytes() > saturated_bytes / static_cast<std::uint64_t>(e.batch * e.heads) ||
        state_bytes_ == saturated_bytes || workspace_bytes_ == saturated_bytes)
      return {Errc::invalid_argument, "kvc::LayerCompressor::plan: the state or workspace size overflows"};
    planned_ = true;
    return {};
  }

  /// Bytes of state one layer needs: the packed store (arena and descriptors) and an error word (any alignment).
  std::size_t state_bytes() const noexcept { return state_bytes_; }
  /// Bytes of workspace every call needs (any alignment; may be shared by all layers).
  std::size_t workspace_bytes() const noexcept { return workspace_bytes_; }

  /// Binds this layer's state (`bytes` >= state_bytes()). `layer` is unused (no layer-dependent budget). Follow with
  /// reset().
  Status bind(void* state, std::size_t bytes, Index layer = 0) {
    (void)layer;
    if (!planned_)
      return {Errc::invalid_argument, "kvc::LayerCompressor::bind: call plan() first"};
    if (bytes < state_bytes_ || (state == nullptr && state_bytes_ > 0))
      return {Errc::out_of_capacity, "kvc::LayerCompressor::bind: state smaller than state_bytes()"};
    carve_state(state, bytes);
    state_ = state;
    bound_.on = true;
    ready_.on = false;
    return {};
  }

  /// A new sequence: the packed store is emptied (its descriptors zeroed) and the error word cleared.
  Status reset() {
    if (!planned_ || !bound_.on)
      return {Errc::invalid_argument, "kvc::LayerCompressor::reset: call plan() and bind() first"};
    prefilled_ = false;
    KVC_RETURN_IF_ERROR(zero_state(backend, store_.heads, descriptor_bytes()));
    KVC_RETURN_IF_ERROR(zero_state(backend, error_, sizeof(int)));
    ready_.on = true;
    return {};
  }

  /// Packs the layer after the prompt (see the file comment). `queries`: the prompt's last rows (RDKV; KIVI reads
  /// none). The cache needs a per-head length table (the tail's lengths are written there).
  template <KVCacheView C>
  Status prefill(C const& cache, LayerQueries<Q, memory_space> const& queries, Workspace ws) {
    KVC_RETURN_IF_ERROR(check_call(cache, ws));
    if (prefilled_)
      return {Errc::invalid_argument,
              "kvc::LayerCompressor::prefill: RDKV and KIVI pack once per sequence: reset() before the next prompt"};
    if (cache.lengths.data == nullptr)
      return {Errc::invalid_argument,
              "kvc::LayerCompressor::prefill: the cache needs a per-head length table (the tail's lengths)"};
    KVExtents const e = cache.keys.extents();
    WorkspaceCarver carve(ws);
    BitPlan<memory_space> const bits = carve_plan(carve, e);
    KeepPlan<memory_space> const tail{carve.take<Index>(e.rows()), carve.take<Index>(e.batch * e.heads), e.batch,
                                      e.heads, e.tokens};
    if constexpr (std::is_same_v<P, KIVIPress>) {
      KVC_RETURN_IF_ERROR(kivi_bit_plan(backend, policy, cache.lengths, bits));
    } else {
      KVC_RETURN_IF_ERROR(check_queries(queries));
      float* weights = carve.take<float>(e.rows());
      float* channels = carve.take<float>(e.batch * e.heads * e.dim);
      auto const window = observe(WindowQueries<Q, memory_space>{queries.rows, options.rope, queries.positions});
      ScoreSpan<memory_space> const span{weights, e.batch, e.heads, e.tokens, cache.lengths};
      using S = typename P::scorer_type;
      if constexpr (detail::is_h2o<S>) {  // the prompt's attention into a scratch accumulator, then its scores
        S scorer = policy.scorer;
        float* accumulated = carve.take<float>(e.rows());
        Index* tracked = carve.take<Index>(e.batch * e.heads);
        scorer.state = {{accumulated, e.batch, e.heads, e.tokens}, tracked};
        Workspace const rest = carve.rest();
        KVC_RETURN_IF_ERROR(zero_state(backend, accumulated, static_cast<std::size_t>(e.rows()) * sizeof(float)));
        KVC_RETURN_IF_ERROR(zero_state(backend, tracked, static_cast<std::size_t>(e.batch * e.heads) * sizeof(Index)));
        KVC_RETURN_IF_ERROR(update(backend, scorer, cache, window, rest));
        KVC_RETURN_IF_ERROR(score(backend, scorer, cache, span, rest));
      } else if constexpr (has_need(S::needs, Needs::query_statistics)) {
        KVExtents const q = queries.rows.extents();
        float* mean = carve.take<float>(q.batch * q.heads * q.dim);
        float* cov = carve.take<float>(q.batch * q.heads * q.dim * q.dim);
        Workspace const rest = carve.rest();
        KVC_RETURN_IF_ERROR(query_statistics(backend, queries.rows, queries.positions,
                                             StatisticsRows{policy.scorer.n_sink}, mean,
                                             policy.scorer.use_covariance ? cov : nullptr, rest));
        QueryStatistics<memory_space> const stats{mean, cov, q.batch, q.heads, q.dim, options.rope, nullptr, q.tokens};
        KVC_RETURN_IF_ERROR(score(backend, policy.scorer, cache, observe(stats), span, rest));
      } else if constexpr (has_need(S::needs, Needs::window_queries)) {
        KVC_RETURN_IF_ERROR(score(backend, policy.scorer, cache, window, span, carve.rest()));
      } else {
        KVC_RETURN_IF_ERROR(score(backend, policy.scorer, cache, span, carve.rest()));
      }
      Workspace const rest = carve.rest();
      if constexpr (!std::is_same_v<S, RDKVTokenScorer>)
        KVC_RETURN_IF_ERROR(scores_to_weights(backend, span));
      KVC_RETURN_IF_ERROR(score_channels(backend, policy.channels, cache, window, channels, rest));
      KVC_RETURN_IF_ERROR(allocate_bits(backend, policy.allocator, span, channels, bits, rest));
    }
    // The newest `residual` valid tokens of each head stay in the cache (the fp16 tail); the rest is packed.
    KVC_RETURN_IF_ERROR(split_tail(backend, residual(), cache.lengths, bits, tail));
    KVC_RETURN_IF_ERROR(pack_into(backend, cache, bits, pack_options(), store_, carve.rest(), error_));
    KVC_RETURN_IF_ERROR(compact(backend, tail, cache));
    prefilled_ = true;
    prefill_extents_ = e;
    return {};
  }

  /// The bit plan of the last prefill(), where it left it: at the front of `ws`, the workspace prefill was given
  /// (backend memory; valid until a call reuses that workspace). v_bits [batch, heads, tokens]: each packed token's
  /// bits, 0 for evicted tokens, for the fp16 tail (it stays in the cache) and past each head's length; k_bits
  /// [batch, heads, d]. Empty (null tables) before prefill.
  BitPlan<memory_space> bit_plan(Workspace ws) const noexcept {
    if (!prefilled_ || ws.bytes < workspace_bytes_)
      return {};
    WorkspaceCarver carve(ws);
    return carve_plan(carve, prefill_extents_);
  }

  /// Nothing to run while decoding (the engine appends to the tail); checks its arguments like every call.
  template <KVCacheView C>
  Status decode(C const& cache, LayerQueries<Q, memory_space> const& queries, Workspace ws,
                bool* compressed = nullptr) {
    (void)queries;
    if (compressed)
      *compressed = false;
    return check_call(cache, ws);
  }

  /// Never true: the packed policies do not compress while decoding (the same interface as every policy's).
  bool compresses_next() const noexcept { return false; }
  /// A decode step replayed from a captured CUDA graph: nothing to count (decode() does nothing either).
  Status replayed(bool* compressed = nullptr) const {
    if (compressed)
      *compressed = false;
    return planned_ && bound_.on && ready_.on ? Status{} : detail::not_ready();
  }

  /// Attention of `queries` (post-RoPE, attend_rows per sequence at most, positions required) over the packed store
  /// and the tail (`cache`), into `out` (out.lse may be null).
  template <KVCacheView C, Element T>
  Status attend(AttendQueries<T, memory_space> const& queries, C const& cache, AttendOutput<memory_space> out,
                Workspace ws) {
    KVC_RETURN_IF_ERROR(check_call(cache, ws));
    KVExtents const q = queries.rows.extents();
    if (q.batch != keys_.batch || q.heads != queries_.heads || q.dim != keys_.dim || q.tokens > queries_.attend_rows)
      return {Errc::invalid_argument, "kvc::LayerCompressor::attend: queries must be [batch, Hq, <= attend_rows, d_k]"};
    if (queries.positions == nullptr && q.rows() > 0)
      return {Errc::invalid_argument,
              "kvc::LayerCompressor::attend: a packed layer needs the queries' positions ([batch, n]): the packed "
              "store and the tail end at different positions"};
    WorkspaceCarver carve(ws);
    float* lse = out.lse != nullptr ? out.lse : carve.take<float>(q.rows());
    float* tail_out = carve.take<float>(q.rows() * value_dim_);
    float* tail_lse = carve.take<float>(q.rows());
    Workspace const rest = carve.rest();
    Attention const& op = options.attention.attention;
    KVC_RETURN_IF_ERROR(attend_packed(backend, op, queries, store_.view(), {out.out, lse}, rest));
    KVC_RETURN_IF_ERROR(kvc::attend(backend, op, queries, cache, {tail_out, tail_lse}, rest));
    return merge_attention(backend, out.out, lse, tail_out, tail_lse, q.rows(), value_dim_);
  }

  /// The decode schedule's counters: always zero (a packed layer is not compressed again while decoding).
  DecodeCounter const& counter() const noexcept { return counter_; }
  /// The layer's packed store (valid after bind; its descriptors after prefill), e.g. to measure its memory.
  PackedKVView<memory_space> packed() const noexcept { return store_.view(); }
  /// The state's error word (backend memory): 1 when the last prefill found bad data and left the store empty (see
  /// the file comment), else 0. On the CPU prefill's Status says the same.
  int const* pack_error() const noexcept { return error_; }

 private:
  /// The bit plan at the front of prefill's workspace: v_bits [batch, heads, tokens], k_bits [batch, heads, d].
  static BitPlan<memory_space> carve_plan(WorkspaceCarver& carve, KVExtents const& e) noexcept {
    return {carve.take<std::int8_t>(e.rows()),
            carve.take<std::int8_t>(e.batch * e.heads * e.dim),
            e.batch,
            e.heads,
            e.tokens,
            e.dim};
  }
  PackedQuant quant() const noexcept {
    PackOptions const o = pack_options();
    return {o.zero_point, o.v_group, o.k_group};
  }
  PackOptions pack_options() const noexcept {
    if constexpr (std::is_same_v<P, KIVIPress>)
      return policy.pack_options();
    else
      return policy.pack;
  }
  Index residual() const noexcept {
    if constexpr (std::is_same_v<P, KIVIPress>)
      return policy.residual;
    else
      return policy.allocator.residual;
  }
  std::size_t descriptor_bytes() const noexcept {
    return static_cast<std::size_t>(keys_.batch * keys_.heads) * sizeof(PackedHead);
  }

  template <KVCacheView C>
  Status check_call(C const& cache, Workspace ws) const {
    if (!planned_ || !bound_.on || !ready_.on)
      return detail::not_ready();
    return detail::check_compressor_call(keys_, value_dim_, workspace_bytes_, cache, ws);
  }
  Status check_queries(LayerQueries<Q, memory_space> const& q) const {
    KVExtents const e = q.rows.extents();
    if (e.batch != keys_.batch || e.heads != queries_.heads || e.dim != keys_.dim || e.tokens < policy.window_rows() ||
        e.tokens > queries_.prompt_rows)
      return {Errc::invalid_argument,
              "kvc::LayerCompressor::prefill: queries must be [batch, Hq, window_size..prompt_rows, d_k]"};
    if (q.positions == nullptr)
      return {Errc::invalid_argument, "kvc::LayerCompressor: the queries' positions ([batch, n]) are required"};
    return {};
  }

  /// Lays the state out from `base` (nullptr: sizing only): descriptors, then the arena (16-byte aligned: the
  /// carver's alignment is larger).
  std::size_t carve_state(void* base, std::size_t bytes) {
    std::size_t total = workspace_slack;
    WorkspaceCarver carve({base, bytes});
    Index const heads = keys_.batch * keys_.heads;
    std::uint64_t const arena = store_.arena_bytes();
    total = bytes_sum(total, workspace_round(descriptor_bytes()), workspace_round(static_cast<std::size_t>(arena)),
                      workspace_round(sizeof(int)));
    if (base != nullptr) {
      store_.heads = carve.take<PackedHead>(heads);
      store_.arena = carve.take<std::byte>(static_cast<Index>(arena));
      error_ = carve.take<int>(1);
    }
    return total;
  }

  /// The larger workspace of prefill and attend.
  template <KVCacheView C>
  std::size_t plan_workspace(C const& cache) {
    KVExtents const e = keys_;
    Index const rows = e.rows(), head_dims = e.batch * e.heads * e.dim;
    std::size_t prefill =
        bytes_sum(workspace_round(bytes_product(rows, 1)), workspace_round(bytes_product(head_dims, 1)),
                  workspace_round(bytes_product(rows, sizeof(Index))),
                  workspace_round(bytes_product(e.batch, e.heads, sizeof(Index))));
    std::size_t step = pack_workspace_bytes(backend, cache);
    if constexpr (!std::is_same_v<P, KIVIPress>) {
      using Rows = TokenRows<Q const, StridedLayout, memory_space>;
      Rows const prompt(nullptr, bhtd_layout({e.batch, queries_.heads, queries_.prompt_rows, e.dim}));
      auto const window = observe(WindowQueries<Q, memory_space>{prompt, options.rope});
      prefill = bytes_sum(prefill, workspace_round(bytes_product(rows, sizeof(float))),
                          workspace_round(bytes_product(head_dims, sizeof(float))));
      auto bigger = [&step](std::size_t x) { step = x > step ? x : step; };
      using S = typename P::scorer_type;
      if constexpr (detail::is_h2o<S>) {
        prefill = bytes_sum(prefill, workspace_round(bytes_product(rows, sizeof(float))),
                            workspace_round(bytes_product(e.batch, e.heads, sizeof(Index))));
        S shaped = policy.scorer;  // the scratch state's shapes (its pointers are carved in prefill)
        shaped.state = {{nullptr, e.batch, e.heads, e.tokens}, nullptr};
        bigger(update_workspace_bytes(backend, shaped, e, window));
        bigger(score_workspace_bytes(backend, shaped, e));
      } else if constexpr (has_need(S::needs, Needs::query_statistics)) {
        Index const stats = e.batch * queries_.heads * e.dim;
        prefill = bytes_sum(prefill, workspace_round(bytes_product(stats, sizeof(float))),
                            workspace_round(bytes_product(stats, e.dim, sizeof(float))));
        bigger(query_statistics_workspace_bytes(backend, prompt.extents()));
        QueryStatistics<memory_space> const none{nullptr, nullptr, e.batch, queries_.heads, e.dim, options.rope};
        bigger(score_workspace_bytes(backend, policy.scorer, e, observe(none)));
      } else if constexpr (has_need(S::needs, Needs::window_queries)) {
        bigger(score_workspace_bytes(backend, policy.scorer, e, window));
      } else {
        bigger(score_workspace_bytes(backend, policy.scorer, e));
      }
      bigger(channel_score_workspace_bytes(backend, policy.channels, e, window));
      bigger(allocate_bits_workspace_bytes(backend, policy.allocator, e.batch, e.heads, e.tokens, e.dim));
    }
    prefill = bytes_sum(prefill, step, workspace_slack);
    using Rows = TokenRows<Q const, StridedLayout, memory_space>;
    Index const q_rows = e.batch * queries_.heads * queries_.attend_rows;
    AttendQueries<Q, memory_space> const attend_q{
        Rows(nullptr, bhtd_layout({e.batch, queries_.heads, queries_.attend_rows, e.dim}))};
    std::size_t inner = attend_workspace_bytes(backend, options.attention.attention, attend_q, cache);
    std::size_t const packed =
        attend_packed_workspace_bytes(backend, options.attention.attention, attend_q, store_.view());
    inner = inner > packed ? inner : packed;
    std::size_t const attend = bytes_sum(workspace_round(bytes_product(q_rows, sizeof(float))),
                                         workspace_round(bytes_product(q_rows, value_dim_, sizeof(float))),
                                         workspace_round(bytes_product(q_rows, sizeof(float))), inner, workspace_slack);
    return prefill > attend ? prefill : attend;
  }

  KVExtents keys_{};
  Index value_dim_ = 0;
  QueryShape queries_{};
  std::size_t state_bytes_ = 0, workspace_bytes_ = 0;
  bool planned_ = false;
  detail::BindingFlag bound_, ready_;
  bool prefilled_ = false;
  KVExtents prefill_extents_{};  // the cache prefill compressed (the bit plan's shape)
  void* state_ = nullptr;
  PackedStore<memory_space> store_{};  // the layer's packed store (in the bound state)
  int* error_ = nullptr;               // the state's error word
  DecodeCounter counter_{};
};

template <class P, Backend B>
requires is_packed_press<P> LayerCompressor(B, P)
->LayerCompressor<P, B, float>;
template <class P, Backend B, class Space>
requires is_packed_press<P> LayerCompressor(B, P, CompressorOptions<Space>)
->LayerCompressor<P, B, float>;

}  // namespace kvc
