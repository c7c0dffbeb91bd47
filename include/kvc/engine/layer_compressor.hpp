// SPDX-License-Identifier: Apache-2.0
// kvc/engine/layer_compressor.hpp: one engine path for every policy. An engine plans once per layer shape, binds
// each layer's state (caller-owned memory) and then makes the same four calls whatever the policy:
//
//   LayerCompressor c{backend, policy, options};  c.plan(cache_view, QueryShape{...});      // once, host only
//   for each layer: copy c, bind(state + l * c.state_bytes(), c.state_bytes(), l), reset()   // a new sequence
//   after the prompt's forward:  prefill(cache, prompt_queries, ws)    // compress the layer
//   every decode forward:        append K, V (kvc::append); attend(queries, cache, out, ws); decode(cache, step, ws)
//
// `policy` is a kvc::Press{scorer, selector}; changing it changes the policy and nothing else. What each call runs:
//   prefill  stateful scorers (H2O, UNComp): kvc::update with the prompt's queries, then score;
//            ExpectedAttention: kvc::query_statistics of the prompt's queries, then score;
//            window scorers (SnapKV, TOVA, ...): the prompt's queries as window queries;
//            key-only scorers (KeyDiff, Knorm, StreamingLLM, random): keys and values alone;
//            then the selector, kvc::on_evict and kvc::compact (with the scorer's per-token state);
//            MomentKV: kvc::moment_kv_prefill (its rounds, the moments of the evicted tokens); with mi = false the
//            base score alone in one shot, then kvc::on_evict folds the evicted tokens into the moments.
//            Calling prefill after each chunk of a chunked prefill with a FixedBudget is KeyDiff's block-wise
//            protocol (Eq. 6; pipeline/blockwise.hpp), and for stateful scorers it folds every chunk's queries (with
//            a RatioBudget every chunk would cut the tokens kept before again).
//            options.prefill = false compresses only while decoding (kvpress's DecodingPress leaves the prompt
//            alone); prefill() then only starts a stateful scorer's state with the prompt's queries (kvc-eval's
//            --decode rows; the authors' H2O). MomentKV compresses its prompt always (Algorithm 1 starts from it).
//   decode   with options.decode: the step's queries join the layer's buffer (kvc::push_queries, only for policies
//            that read queries) and kvc::decode_step runs the schedule (kvpress's DecodingPress; MomentKV:
//            Algorithm 1 with scorer.decode()). The selection of a decode-time compression is the policy's selector
//            with the schedule's target_size as a FixedBudget, or the budget's own decode_budget(target_size) where
//            it has one (PyramidKV: its layer schedule around the target; AdaKV splits the target across heads); its
//            sink and recent windows are the schedule's n_sink / n_recent
//            where those are set (> 0), else the selector's. Selectors over a per-head table (UNComp's budgets,
//            PerHeadBudget) keep their table and ignore target_size; MomentKV with AdaKV keeps each head's prefill
//            length as its budget, or lets every head grow to target_size when the prefill evicted nothing from the
//            sequence (kvc::decode_budgets).
//            Without options.decode, decode does nothing.
//   attend   kvc::attend, or kvc::attend_corrected over the layer's moments for MomentKV (options.corrected).
// Every call checks its arguments and returns a Status; nothing allocates. On CUDA no call reads device memory on the
// host or synchronises, and a step's kernels take the same arguments at every step of one kind (the query buffer's
// fill is read from device state, stateful scorers fold the caller's query rows): an engine captures one plain and
// one compressing decode step into CUDA graphs and replays them, asking compresses_next() which to launch and
// calling replayed() for each replay in place of decode() (docs/integration.md).
//
// The packed policies (kvc::RDKVPress, kvc::KIVIPress) go through the same calls: engine/packed_compressor.hpp.
#pragma once

#include <kvc/attention/attend.hpp>
#include <kvc/attention/corrected.hpp>
#include <kvc/core/checks.hpp>
#include <kvc/core/observations.hpp>
#include <kvc/engine/compressor_types.hpp>
#include <kvc/engine/packed_compressor.hpp>
#include <kvc/pipeline/compact.hpp>
#include <kvc/pipeline/decode.hpp>
#include <kvc/pipeline/moment_kv.hpp>
#include <kvc/pipeline/press.hpp>
#include <kvc/pipeline/query_statistics.hpp>
#include <kvc/pipeline/state.hpp>
#include <kvc/scorers/h2o.hpp>
#include <kvc/scorers/moment_kv.hpp>
#include <kvc/scorers/uncomp.hpp>
#include <kvc/selectors/ada_kv.hpp>
#include <kvc/selectors/top_k.hpp>

#include <cstddef>
#include <type_traits>

namespace kvc {

namespace detail {
template <class S>
struct moment_type {
  using type = float;
};
template <class Space, class T>
struct moment_type<MomentKVScorer<Space, T>> {
  using type = T;
};
template <class Sel>
inline constexpr bool is_ada_kv = false;
template <class Bu>
inline constexpr bool is_ada_kv<AdaKVSelector<Bu>> = true;

/// Whether a policy's scorer reads query rows (window queries, statistics, or a stateful update).
template <class S>
inline constexpr bool reads_queries = has_need(S::needs, Needs::window_queries) ||
                                      has_need(S::needs, Needs::query_statistics) || is_h2o<S> || is_uncomp<S>;
/// Whether its decode-time compressions read buffered queries (window queries or statistics; H2O and UNComp fold
/// each step's queries into their state instead, so they keep no buffer).
template <class S>
inline constexpr bool buffers_queries = has_need(S::needs, Needs::window_queries) ||
                                        has_need(S::needs, Needs::query_statistics);

/// A budget that reads a per-head table keeps it while decoding; the others become the schedule's target.
template <class Bu>
inline constexpr bool keeps_table = requires {
  typename Bu::memory_space;
};

/// The selection a decode-time compression runs (see the file comment): `sel` with the schedule's target and, where
/// the schedule sets them (> 0), its sink and recent windows.
template <Selector Sel>
constexpr auto decode_selection(Sel sel, DecodeSchedule const& schedule) noexcept {
  if constexpr (requires {
                  sel.n_sink;
                  sel.n_recent;
                }) {
    sel.n_sink = schedule.n_sink > 0 ? schedule.n_sink : sel.n_sink;
    sel.n_recent = schedule.n_recent > 0 ? schedule.n_recent : sel.n_recent;
  }
  Index const target = schedule.target_size;
  auto const budget = [&] {  // a budget's own decode form (PyramidKV's schedule around the target), else the target
    if constexpr (requires { sel.budget.decode_budget(target); })
      return sel.budget.decode_budget(target);
    else
      return FixedBudget{target};
  };
  if constexpr (requires { typename Sel::budget_type; } && !keeps_table<typename Sel::budget_type>) {
    using Bu = decltype(budget());
    if constexpr (is_ada_kv<Sel>)
      return AdaKVSelector<Bu>{budget(), sel.alpha_safeguard, sel.reference, sel.n_sink, sel.n_recent};
    else
      return TopKSelector<Bu>{budget(), sel.n_sink, sel.n_recent};
  } else {
    return sel;
  }
}
}  // namespace detail

template <Scorer S, Selector Sel, Backend B, Element Q>
class LayerCompressor<Press<S, Sel>, B, Q> {
 public:
  using memory_space = typename B::memory_space;
  using policy_type = Press<S, Sel>;
  using moment_type = typename detail::moment_type<S>::type;

  B backend{};
  /// The policy (public: set a per-layer field, e.g. a random scorer's seed, before the calls).
  policy_type policy;
  CompressorOptions<memory_space> options{};

  LayerCompressor(B backend_, policy_type policy_, CompressorOptions<memory_space> options_ = {})
      : backend(backend_), policy(policy_), options(options_) {}

  /// Plans for caches shaped like `cache` (its extents and element types; its contents are not read) and queries
  /// `shape`: checks the policy and the options, and fixes state_bytes() and workspace_bytes(). Host only.
  template <KVCacheView C>
  Status plan(C const& cache, QueryShape const& shape) {
    static_assert(AccessibleFrom<C, B>,
                  "kvc::LayerCompressor: the cache lives in a memory space this backend cannot read");
    planned_ = false;
    bound_.on = ready_.on = false;  // a new plan needs its state bound and reset again
    KVExtents const e = cache.keys.extents();
    KVC_RETURN_IF_ERROR(detail::check_plan_shape(e, shape));
    if (detail::reads_queries<S> && (shape.prompt_rows < 1 || (options.decode && shape.step_rows < 1)))
      return {Errc::invalid_argument,
              "kvc::LayerCompressor::plan: this policy reads queries: prompt_rows (and step_rows with decode) must "
              "be >= 1"};
    KVC_RETURN_IF_ERROR(check_policy());
    if (detail::is_moment_kv<S> && !options.prefill)
      return {Errc::invalid_argument,
              "kvc::LayerCompressor::plan: MomentKV compresses its prompt in prefill (options.prefill must be true)"};
    if (has_need(S::needs, Needs::query_statistics) && options.rope.empty())
      return {Errc::invalid_argument,
              "kvc::LayerCompressor::plan: ExpectedAttention reads pre-RoPE queries: set options.rope (a table "
              "covering the context plus n_future_positions)"};
    if (options.decode)
      KVC_RETURN_IF_ERROR(options.schedule.check());
    if (options.decode && options.schedule.rerotate_keys && !HasKernel<RerotateStep, B>)
      return {Errc::invalid_argument,
              "kvc::LayerCompressor::plan: rerotate_keys needs the backend's re-rotation kernel (the CPU's)"};
    keys_ = e;
    value_dim_ = cache.values.extents().dim;
    queries_ = shape;
    step_rows_[0] = step_rows_[1] = shape.step_rows;  // what replayed() pushes until decode() pushes its own rows
    Index const rows = detail::buffers_queries<S> && options.decode ? options.schedule.compression_interval : 0;
    if (!checked_product(buffer_rows_, rows, shape.step_rows))
      return {Errc::invalid_argument, "kvc::LayerCompressor::plan: compression_interval x step_rows overflows"};
    state_bytes_ = carve_state(nullptr, saturated_bytes);
    workspace_bytes_ = plan_workspace(cache);
    if (state_bytes_ == saturated_bytes || workspace_bytes_ == saturated_bytes)
      return {Errc::invalid_argument, "kvc::LayerCompressor::plan: the state or workspace size overflows"};
    planned_ = true;
    return {};
  }

  /// Bytes of state one layer needs (backend memory; any alignment): the query buffer of the decode schedule, the
  /// scorer's per-token state (H2O's accumulator, UNComp's window rows), MomentKV's moments and decode budgets.
  std::size_t state_bytes() const noexcept { return state_bytes_; }
  /// Bytes of workspace every call needs (backend memory; any alignment; may be shared by all layers).
  std::size_t workspace_bytes() const noexcept { return workspace_bytes_; }

  /// Binds this layer's state: `bytes` >= state_bytes() of backend memory, owned by the caller for the
  /// compressor's life. `layer` sets a layer-dependent budget (PyramidKV's). Follow with reset().
  Status bind(void* state, std::size_t bytes, Index layer = 0) {
    if (!planned_)
      return {Errc::invalid_argument, "kvc::LayerCompressor::bind: call plan() first"};
    if (bytes < state_bytes_ || (state == nullptr && state_bytes_ > 0))
      return {Errc::out_of_capacity, "kvc::LayerCompressor::bind: state smaller than state_bytes()"};
    if constexpr (requires { policy.selector.budget.layer; })
      policy.selector.budget.layer = layer;
    carve_state(state, bytes);
    state_ = state;
    bound_.on = true;
    ready_.on = false;  // reset() zeroes the state
    return {};
  }

  /// A new sequence: zeroes the state (on CUDA, enqueued) and the schedule's counters.
  Status reset() {
    if (!planned_ || !bound_.on)
      return {Errc::invalid_argument, "kvc::LayerCompressor::reset: call plan() and bind() first"};
    counter_ = {};
    buffer_.count = 0;
    buffer_.fresh = 0;
    prefilled_ = false;
    KVC_RETURN_IF_ERROR(zero_state(backend, state_, state_bytes_));
    ready_.on = true;
    return {};
  }

  /// Compresses the layer after the prompt (or after a chunk of it): see the file comment. `queries`: the prompt's
  /// last rows (at most prompt_rows per sequence) for policies that read queries, else ignored. The cache needs a
  /// per-head length table (compaction writes each head's count).
  template <KVCacheView C>
  Status prefill(C const& cache, LayerQueries<Q, memory_space> const& queries, Workspace ws) {
    KVC_RETURN_IF_ERROR(check_call(cache, ws));
    constexpr bool starts_state = StatefulScorer<S> && !detail::is_moment_kv<S>;
    if (!options.prefill && !starts_state)
      return {};  // decode-time compression only
    if constexpr (detail::reads_queries<S>)
      KVC_RETURN_IF_ERROR(check_queries(queries, queries_.prompt_rows, "prefill"));
    KVExtents const e = cache.keys.extents();
    S const scorer = live_scorer();
    auto const window = observe(WindowQueries<Q, memory_space>{queries.rows, options.rope, queries.positions});
    if constexpr (starts_state) {
      if (!options.prefill)  // the prompt's attention starts H2O's / UNComp's state; nothing is evicted
        return update(backend, scorer, cache, window, ws);
    }
    if constexpr (detail::is_moment_kv<S>) {
      if constexpr (detail::is_ada_kv<Sel>)  // each head's length before, for its decode budget (below)
        KVC_RETURN_IF_ERROR(copy_indices(backend, budgets_, cache.lengths.data, e.batch * e.heads));
      if (scorer.mi) {
        KVC_RETURN_IF_ERROR(moment_kv_prefill(backend, scorer, policy.selector, cache, window, ws));
      } else {  // the base score alone, in one shot (rescoring rounds would renormalise its softmax)
        WorkspaceCarver carve(ws);
        KeepPlan<memory_space> const plan{carve.take<Index>(e.rows()), carve.take<Index>(e.batch * e.heads), e.batch,
                                          e.heads, e.tokens};
        KVC_RETURN_IF_ERROR(compress(backend, Press{scorer, policy.selector}, cache, window, plan, carve.rest()));
        KVC_RETURN_IF_ERROR(on_evict(backend, scorer, cache, plan, carve.rest()));
        KVC_RETURN_IF_ERROR(compact(backend, plan, cache));
      }
      if constexpr (detail::is_ada_kv<Sel>)  // Algorithm 1 then returns each head to what it kept
        KVC_RETURN_IF_ERROR(decode_budgets(backend, budgets_, cache.lengths.data, e.batch, e.heads,
                                           options.decode ? options.schedule.target_size : 0));
      prefilled_ = true;
      return {};
    } else {
      WorkspaceCarver carve(ws);
      KeepPlan<memory_space> const plan{carve.take<Index>(e.rows()), carve.take<Index>(e.batch * e.heads), e.batch,
                                        e.heads, e.tokens};
      Press const press{scorer, policy.selector};
      if constexpr (StatefulScorer<S>) {  // H2O, UNComp: the prompt's queries join the state, then score from it
        Workspace const rest = carve.rest();
        KVC_RETURN_IF_ERROR(update(backend, scorer, cache, window, rest));
        KVC_RETURN_IF_ERROR(compress(backend, press, cache, NoObservations{}, plan, rest));
      } else if constexpr (has_need(S::needs, Needs::query_statistics)) {
        KVExtents const q = queries.rows.extents();
        float* mean = carve.take<float>(q.batch * q.heads * q.dim);
        float* cov = carve.take<float>(q.batch * q.heads * q.dim * q.dim);
        Workspace const rest = carve.rest();
        KVC_RETURN_IF_ERROR(query_statistics(backend, queries.rows, queries.positions, StatisticsRows{scorer.n_sink},
                                             mean, scorer.use_covariance ? cov : nullptr, rest));
        QueryStatistics<memory_space> const stats{mean, cov, q.batch, q.heads, q.dim, options.rope, nullptr, q.tokens};
        KVC_RETURN_IF_ERROR(compress(backend, press, cache, observe(stats), plan, rest));
      } else if constexpr (has_need(S::needs, Needs::window_queries)) {
        KVC_RETURN_IF_ERROR(compress(backend, press, cache, window, plan, carve.rest()));
      } else {
        KVC_RETURN_IF_ERROR(compress(backend, press, cache, NoObservations{}, plan, carve.rest()));
      }
      KVC_RETURN_IF_ERROR(on_evict(backend, scorer, cache, plan, carve.rest()));
      return detail::compact_carrying(backend, plan, cache, scorer);
    }
  }

  /// One decode forward of the layer, after the engine appended the new tokens (kvc::append) and attended: the
  /// step's queries (step_rows per sequence; ignored by policies that read none) join the buffer and the schedule
  /// runs (see the file comment). `compressed` (optional) reports whether this step compressed.
  template <KVCacheView C>
  Status decode(C const& cache, LayerQueries<Q, memory_space> const& queries, Workspace ws,
                bool* compressed = nullptr) {
    if (compressed)
      *compressed = false;
    KVC_RETURN_IF_ERROR(check_call(cache, ws));
    if (!options.decode)
      return {};
    KVC_RETURN_IF_ERROR(
        check_prefilled("kvc::LayerCompressor::decode: MomentKV decodes from a compressed prompt: call "
                        "prefill() first"));
    if constexpr (detail::reads_queries<S>) {
      KVC_RETURN_IF_ERROR(check_queries(queries, queries_.step_rows, "decode"));
      Index const rows = queries.rows.extents().tokens;
      if constexpr (StatefulScorer<S>) {
        // H2O, UNComp (MomentKV's is a no-op): the step's queries join the state, read from the caller's rows rather
        // than from a buffer at the host's count, so that a graph captured at one step replays at any other.
        auto const step = observe(WindowQueries<Q, memory_space>{queries.rows, options.rope, queries.positions});
        if (rows > 0)
          KVC_RETURN_IF_ERROR(update(backend, decode_scorer(), cache, step, ws));
      }
      if constexpr (detail::buffers_queries<S>) {  // the compression's window or statistics read the buffer
        KVC_RETURN_IF_ERROR(push_queries(backend, buffer_, queries.rows, queries.positions));
        buffer_.fresh = 0;  // folded above: decode_step folds nothing again
      }
      step_rows_[compresses_next() ? 1 : 0] = rows;
    }
    return decode_step(backend, decode_scorer(), decode_selector(), options.schedule, cache, buffer_, counter_,
                       options.rope, ws, compressed);
  }

  /// Whether the next decode() compresses (the schedule's interval is reached; false without options.decode). Host
  /// only: an engine that replays captured CUDA graphs launches the compressing step's graph then.
  bool compresses_next() const noexcept { return options.decode && kvc::compresses_next(counter_, options.schedule); }

  /// Records a decode step the engine runs by replaying a CUDA graph captured around decode() (docs/integration.md):
  /// advances the host's counters as that decode() did, without launching anything. The buffer's count grows by the
  /// rows the last decode() of the same kind pushed (a plain or a compressing step; before any: the plan's step_rows,
  /// and reset() keeps them, since graphs outlive sequences); the schedule counts the step and, when
  /// compresses_next() is true, a compression (so the graph replayed must be the compressing one then, and the plain
  /// one otherwise). `compressed` (optional) reports whether the step compresses.
  Status replayed(bool* compressed = nullptr) {
    if (compressed)
      *compressed = false;
    if (!planned_ || !bound_.on || !ready_.on)
      return detail::not_ready();
    if (!options.decode)
      return {};
    KVC_RETURN_IF_ERROR(
        check_prefilled("kvc::LayerCompressor::replayed: MomentKV decodes from a compressed prompt: "
                        "call prefill() first"));
    bool const compressing = compresses_next();
    if constexpr (detail::buffers_queries<S>)
      KVC_RETURN_IF_ERROR(buffer_.push(step_rows_[compressing ? 1 : 0]));
    detail::count_decode_step(counter_, buffer_, compressing);
    if (compressed)
      *compressed = compressing;
    return {};
  }

  /// The decode schedule's query buffer (rows, positions and the host's count; empty for policies that buffer no
  /// queries), e.g. to check that replays keep its count.
  QueryBuffer<Q, memory_space> const& query_buffer() const noexcept { return buffer_; }

  /// Attention of `queries` (post-RoPE, attend_rows per sequence at most) over the layer into `out`: kvc::attend,
  /// or kvc::attend_corrected for MomentKV (options.corrected).
  template <KVCacheView C, Element T>
  Status attend(AttendQueries<T, memory_space> const& queries, C const& cache, AttendOutput<memory_space> out,
                Workspace ws) {
    KVC_RETURN_IF_ERROR(check_call(cache, ws));
    KVExtents const q = queries.rows.extents();
    if (q.heads != queries_.heads || q.tokens > queries_.attend_rows)
      return {Errc::invalid_argument, "kvc::LayerCompressor::attend: queries must be [batch, Hq, <= attend_rows, d_k]"};
    if constexpr (detail::is_moment_kv<S>) {
      if (options.corrected)
        return attend_corrected(backend, options.attention, queries, cache, moments(), out, ws);
    }
    return kvc::attend(backend, options.attention.attention, queries, cache, out, ws);
  }

  /// The schedule's counters (decode forwards since the last compression, compressions so far).
  DecodeCounter const& counter() const noexcept { return counter_; }
  /// MomentKV's moments of the evicted tokens (empty for other policies).
  MomentState<memory_space, moment_type> moments() const noexcept {
    return {count_, key_mean_, value_mean_, comoment_, keys_.batch, keys_.heads, keys_.dim, value_dim_};
  }

 private:
  Status check_policy() const {
    if constexpr (requires { policy.scorer.check(); })
      KVC_RETURN_IF_ERROR(policy.scorer.check());
    return policy.selector.check();
  }

  template <KVCacheView C>
  Status check_call(C const& cache, Workspace ws) const {
    if (!planned_ || !bound_.on || !ready_.on)
      return detail::not_ready();
    return detail::check_compressor_call(keys_, value_dim_, workspace_bytes_, cache, ws);
  }

  /// MomentKV decodes (and replays) only after its prefill (Algorithm 1 starts from the compressed prompt).
  Status check_prefilled(char const* message) const {
    if (detail::is_moment_kv<S> && !prefilled_)
      return {Errc::invalid_argument, message};
    return {};
  }

  Status check_queries(LayerQueries<Q, memory_space> const& q, Index most, char const* call) const {
    KVExtents const e = q.rows.extents();
    if (e.batch != keys_.batch || e.heads != queries_.heads || e.dim != keys_.dim || e.tokens < 0 || e.tokens > most)
      return {Errc::invalid_argument,
              call[0] == 'p' ? "kvc::LayerCompressor::prefill: queries must be [batch, Hq, <= prompt_rows, d_k]"
                             : "kvc::LayerCompressor::decode: queries must be [batch, Hq, <= step_rows, d_k]"};
    if (q.positions == nullptr && e.rows() > 0)
      return {Errc::invalid_argument, "kvc::LayerCompressor: the queries' positions ([batch, n]) are required"};
    return {};
  }

  /// The scorer with its state pointing into the bound memory.
  S live_scorer() const noexcept {
    S s = policy.scorer;
    if constexpr (detail::is_h2o<S>)
      s.state = {{accumulated_, keys_.batch, keys_.heads, keys_.tokens}, tracked_};
    else if constexpr (detail::is_uncomp<S>)
      s.state = {{window_rows_, uncomp_window_layout(keys_, s.window_size)}, tracked_};
    else if constexpr (detail::is_moment_kv<S>) {
      s.state = moments();
      s.residuals = {};  // the u_j cache is not part of the compressor's state (every score recomputes C k_j)
    }
    return s;
  }
  S decode_scorer() const noexcept {
    if constexpr (detail::is_moment_kv<S>)
      return live_scorer().decode();  // Algorithm 1: the current query's attention as the base
    else
      return live_scorer();
  }
  auto decode_selector() const noexcept {
    if constexpr (detail::is_moment_kv<S> && detail::is_ada_kv<Sel>)
      return TopKSelector<PerHeadBudget<memory_space>>{
          {budgets_, keys_.heads},
          options.schedule.n_sink > 0 ? options.schedule.n_sink : policy.selector.n_sink,
          options.schedule.n_recent > 0 ? options.schedule.n_recent : policy.selector.n_recent};
    else
      return detail::decode_selection(policy.selector, options.schedule);
  }

  /// Lays the state out from `base` (nullptr: sizing only) and returns the bytes it spans (slack included).
  std::size_t carve_state(void* base, std::size_t bytes) {
    KVExtents const e = keys_;
    Index const heads = e.batch * e.heads;
    std::size_t total = workspace_slack;
    WorkspaceCarver carve({base, bytes});
    auto take = [&](auto* tag, std::size_t count) {
      using T = std::remove_pointer_t<decltype(tag)>;
      total = bytes_sum(total, workspace_round(bytes_product(count, sizeof(T))));
      return base == nullptr ? static_cast<T*>(nullptr) : carve.take<T>(static_cast<Index>(count));
    };
    auto const n = [](Index x) { return static_cast<std::size_t>(x); };
    buffer_ = {take(static_cast<Q*>(nullptr), bytes_product(e.batch, queries_.heads, buffer_rows_, e.dim)),
               take(static_cast<Index*>(nullptr), bytes_product(e.batch, buffer_rows_)),
               e.batch,
               queries_.heads,
               buffer_rows_,
               e.dim};
    if (buffer_rows_ > 0)  // the fill in the backend's memory, which a replayed graph's push reads
      buffer_.fill = take(static_cast<Index*>(nullptr), 1);
    if constexpr (detail::is_h2o<S>) {
      accumulated_ = take(static_cast<float*>(nullptr), n(e.rows()));
      tracked_ = take(static_cast<Index*>(nullptr), n(heads));
    } else if constexpr (detail::is_uncomp<S>) {
      window_rows_ = take(static_cast<float*>(nullptr), bytes_product(e.rows(), policy.scorer.window_size));
      tracked_ = take(static_cast<Index*>(nullptr), n(heads));
    }
    if constexpr (detail::is_moment_kv<S>) {
      count_ = take(static_cast<Index*>(nullptr), n(heads));
      key_mean_ = take(static_cast<moment_type*>(nullptr), bytes_product(heads, e.dim));
      value_mean_ = take(static_cast<moment_type*>(nullptr), bytes_product(heads, value_dim_));
      comoment_ = take(static_cast<moment_type*>(nullptr), bytes_product(heads, e.dim, value_dim_));
      budgets_ = take(static_cast<Index*>(nullptr), n(heads));
    }
    return total;
  }

  /// The largest workspace of prefill, decode and attend for caches like `cache`.
  template <KVCacheView C>
  std::size_t plan_workspace(C const& cache) {
    KVExtents const e = keys_;
    S const scorer = live_scorer();  // its state's shapes (the pointers may still be null)
    using Rows = TokenRows<Q const, StridedLayout, memory_space>;
    Rows const prompt(nullptr, bhtd_layout({e.batch, queries_.heads, queries_.prompt_rows, e.dim}));
    auto const window = observe(WindowQueries<Q, memory_space>{prompt, options.rope});
    std::size_t prefill = 0;
    if constexpr (detail::is_moment_kv<S>) {
      prefill = moment_kv_prefill_workspace_bytes(backend, scorer, policy.selector, e, window);
      std::size_t const one_shot = compress_workspace_bytes(backend, Press{scorer, policy.selector}, e, window);
      std::size_t const fold = on_evict_workspace_bytes(backend, scorer, e);
      std::size_t const base = bytes_sum(workspace_round(bytes_product(e.rows(), sizeof(Index))),
                                         workspace_round(bytes_product(e.batch, e.heads, sizeof(Index))),
                                         one_shot > fold ? one_shot : fold, workspace_slack);
      prefill = prefill > base ? prefill : base;  // mi = false: the one-shot base compression
    } else {
      Press const press{scorer, policy.selector};
      std::size_t step = on_evict_workspace_bytes(backend, scorer, e);
      auto bigger = [&step](std::size_t x) { step = x > step ? x : step; };
      std::size_t before = 0;  // statistics carved ahead of the step's scratch
      if constexpr (StatefulScorer<S>) {
        bigger(update_workspace_bytes(backend, scorer, e, window));
        bigger(compress_workspace_bytes(backend, press, e));
      } else if constexpr (has_need(S::needs, Needs::query_statistics)) {
        Index const stats = e.batch * queries_.heads * e.dim;
        before = bytes_sum(workspace_round(bytes_product(stats, sizeof(float))),
                           workspace_round(bytes_product(stats, e.dim, sizeof(float))));
        bigger(query_statistics_workspace_bytes(backend, prompt.extents()));
        QueryStatistics<memory_space> const none{nullptr, nullptr, e.batch, queries_.heads, e.dim, options.rope};
        bigger(compress_workspace_bytes(backend, press, e, observe(none)));
      } else if constexpr (has_need(S::needs, Needs::window_queries)) {
        bigger(compress_workspace_bytes(backend, press, e, window));
      } else {
        bigger(compress_workspace_bytes(backend, press, e));
      }
      prefill =
          bytes_sum(workspace_round(bytes_product(e.rows(), sizeof(Index))),
                    workspace_round(bytes_product(e.batch, e.heads, sizeof(Index))), before, step, workspace_slack);
    }
    std::size_t decode = 0;
    if (options.decode) {
      decode = decode_workspace_bytes(backend, decode_scorer(), decode_selector(), options.schedule, e, buffer_);
      if constexpr (StatefulScorer<S>) {  // decode() folds the step's own rows
        Rows const step(nullptr, bhtd_layout({e.batch, queries_.heads, queries_.step_rows, e.dim}));
        std::size_t const fold = update_workspace_bytes(backend, decode_scorer(), e,
                                                        observe(WindowQueries<Q, memory_space>{step, options.rope}));
        decode = decode > fold ? decode : fold;
      }
    }
    AttendQueries<Q, memory_space> const attend_q{
        Rows(nullptr, bhtd_layout({e.batch, queries_.heads, queries_.attend_rows, e.dim}))};
    std::size_t attend = 0;
    if constexpr (detail::is_moment_kv<S>)
      attend = attend_corrected_workspace_bytes(backend, options.attention, attend_q, cache, moments());
    else
      attend = attend_workspace_bytes(backend, options.attention.attention, attend_q, cache);
    std::size_t most = prefill > decode ? prefill : decode;
    return most > attend ? most : attend;
  }

  KVExtents keys_{};
  Index value_dim_ = 0;
  QueryShape queries_{};
  Index buffer_rows_ = 0;
  std::size_t state_bytes_ = 0, workspace_bytes_ = 0;
  bool planned_ = false;
  detail::BindingFlag bound_, ready_;  // bound state; reset since (copies carry neither)
  bool prefilled_ = false;             // MomentKV: prefill ran since the last reset
  void* state_ = nullptr;
  // The state's pieces (in the bound memory).
  QueryBuffer<Q, memory_space> buffer_{};
  Index step_rows_[2] = {0, 0};  // rows the last plain [0] / compressing [1] decode() pushed: replayed() repeats them
  DecodeCounter counter_{};
  float* accumulated_ = nullptr;  // H2O: [batch, Hkv, tokens]
  float* window_rows_ = nullptr;  // UNComp: [batch, Hkv, tokens, w]
  Index* tracked_ = nullptr;      // H2O, UNComp: [batch, Hkv]
  Index* count_ = nullptr;        // MomentKV: the moments [batch, Hkv] ...
  moment_type* key_mean_ = nullptr;
  moment_type* value_mean_ = nullptr;
  moment_type* comoment_ = nullptr;
  Index* budgets_ = nullptr;  // MomentKV with AdaKV: each head's prefill length [batch, Hkv]
};

template <Scorer S, Selector Sel, Backend B>
LayerCompressor(B, Press<S, Sel>) -> LayerCompressor<Press<S, Sel>, B, float>;
template <Scorer S, Selector Sel, Backend B, class Space>
LayerCompressor(B, Press<S, Sel>, CompressorOptions<Space>) -> LayerCompressor<Press<S, Sel>, B, float>;

}  // namespace kvc
