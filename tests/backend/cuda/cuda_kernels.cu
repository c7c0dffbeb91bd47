// SPDX-License-Identifier: Apache-2.0
// tests/backend/cuda/cuda_kernels.cu: device-side halves of the parity tests (see cuda_kernels.hpp).
#include <kvc/backend/cuda/attention/attend.cuh>
#include <kvc/backend/cuda/attention/corrected.cuh>
#include <kvc/backend/cuda/attention/packed.cuh>
#include <kvc/backend/cuda/pipeline/compact.cuh>
#include <kvc/backend/cuda/pipeline/query_statistics.cuh>
#include <kvc/backend/cuda/scorers/expected_attention.cuh>
#include <kvc/backend/cuda/scorers/h2o.cuh>
#include <kvc/backend/cuda/scorers/key_diff.cuh>
#include <kvc/backend/cuda/scorers/knorm.cuh>
#include <kvc/backend/cuda/scorers/moment_kv.cuh>
#include <kvc/backend/cuda/scorers/random.cuh>
#include <kvc/backend/cuda/scorers/rdkv.cuh>
#include <kvc/backend/cuda/scorers/snap_kv.cuh>
#include <kvc/backend/cuda/scorers/streaming_llm.cuh>
#include <kvc/backend/cuda/scorers/uncomp.cuh>
#include <kvc/backend/cuda/selectors/ada_kv.cuh>
#include <kvc/backend/cuda/selectors/rdkv.cuh>
#include <kvc/backend/cuda/selectors/top_k.cuh>
#include <kvc/backend/cuda/selectors/uncomp.cuh>
#include <kvc/backend/cuda/store/packed.cuh>
#include <kvc/pipeline/blockwise.hpp>
#include <kvc/pipeline/decode.hpp>
#include <kvc/pipeline/moment_kv.hpp>

#include "cuda_kernels.hpp"

#include <cstddef>
#include <cstdint>

namespace kvc::test::cuda {

namespace {

/// A device copy of a host vector, freed on scope exit.
template <class T>
struct DeviceBuffer {
  T* ptr = nullptr;
  std::size_t n = 0;
  explicit DeviceBuffer(std::size_t count) : n(count) {
    if (cudaMalloc(&ptr, (count > 0 ? count : 1) * sizeof(T)) != cudaSuccess)
      ptr = nullptr;
  }
  explicit DeviceBuffer(std::vector<T> const& host) : DeviceBuffer(host.size()) {
    if (ptr && n)
      cudaMemcpy(ptr, host.data(), n * sizeof(T), cudaMemcpyHostToDevice);
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(DeviceBuffer const&) = delete;
  DeviceBuffer& operator=(DeviceBuffer const&) = delete;
  void to_host(std::vector<T>& host) const {
    host.resize(n);
    if (n)
      cudaMemcpy(host.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost);
  }
  T* get_or_null(bool present) const { return present ? ptr : nullptr; }
};

std::string finish(Status st) {
  if (!st.ok())
    return st.message();
  cudaError_t const e = cudaDeviceSynchronize();
  return e == cudaSuccess ? std::string() : std::string(cudaGetErrorString(e));
}

template <class T>
std::vector<T> narrow(std::vector<float> const& x) {
  std::vector<T> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i)
    out[i] = from_float<T>(x[i]);
  return out;
}

template <class T>
std::vector<float> widen(std::vector<T> const& x) {
  std::vector<float> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i)
    out[i] = to_float(x[i]);
  return out;
}

constexpr Index page_size = 16;

/// The device mirror of a Case with element type T: K/V in the case's layout, tables, queries, RoPE table.
template <class T>
struct Mirror {
  Case const& c;
  Index pages;  // per sequence
  std::vector<std::int32_t> table_host;
  DeviceBuffer<T> k, v, q;
  DeviceBuffer<Index> lengths, positions, query_positions;
  DeviceBuffer<std::int32_t> table;
  DeviceBuffer<float> rope;

  static std::vector<T> place(Case const& c, std::vector<float> const& bhtd, Index dim,
                              std::vector<std::int32_t> const& table, Index pages) {
    KVExtents const e{c.e.batch, c.e.heads, c.e.tokens, dim};
    std::vector<T> out(c.layout == Layout::paged
                           ? static_cast<std::size_t>(c.e.batch * pages * page_size * e.heads * dim)
                           : bhtd.size());
    for (Index b = 0; b < e.batch; ++b)
      for (Index h = 0; h < e.heads; ++h)
        for (Index t = 0; t < e.tokens; ++t)
          for (Index i = 0; i < dim; ++i) {
            Index at = 0;
            if (c.layout == Layout::bhtd)
              at = bhtd_layout(e).offset(b, h, t);
            else if (c.layout == Layout::bthd)
              at = bthd_layout(e).offset(b, h, t);
            else
              at = paged_layout(e, page_size, PageOrder::nhd, table.data(), pages, e.batch * pages).offset(b, h, t);
            out[static_cast<std::size_t>(at + i)] =
                from_float<T>(bhtd[static_cast<std::size_t>(((b * e.heads + h) * e.tokens + t) * dim + i)]);
          }
    return out;
  }
  static std::vector<std::int32_t> make_table(Case const& c, Index pages) {
    std::vector<std::int32_t> t(static_cast<std::size_t>(c.e.batch * pages));
    for (std::size_t i = 0; i < t.size(); ++i)
      t[i] = static_cast<std::int32_t>(t.size() - 1 - i);  // reversed page ids: order in the pool differs
    return t;
  }

  explicit Mirror(Case const& cs)
      : c(cs),
        pages((cs.e.tokens + page_size - 1) / page_size),
        table_host(make_table(cs, pages)),
        k(place(cs, cs.k, cs.e.dim, table_host, pages)),
        v(place(cs, cs.v, cs.dim_v > 0 ? cs.dim_v : cs.e.dim, table_host, pages)),
        q(narrow<T>(cs.queries)),
        lengths(cs.lengths),
        positions(cs.positions),
        query_positions(cs.query_positions),
        table(table_host),
        rope(host_rope(cs)) {}

  static std::vector<float> host_rope(Case const& cs) {
    if (!cs.pre_rope)
      return {};
    std::vector<float> s(static_cast<std::size_t>(rope_table_floats(test_rope_positions, cs.e.dim)));
    RopeTable<HostSpace> t;
    (void)fill_rope_table(test_rope_spec(cs.rope_style), cs.e.dim, test_rope_positions, s.data(), t);
    return s;
  }

  Lengths length_table() const {
    if (c.lengths.empty())
      return {};
    return c.per_head ? head_lengths(lengths.ptr, c.e.heads) : Lengths(lengths.ptr);
  }
  RopeTable<DeviceSpace> rope_table() const {
    if (!c.pre_rope)
      return {};
    Index const half = c.e.dim / 2;
    return {rope.ptr, rope.ptr + test_rope_positions * half, test_rope_positions, c.e.dim, c.rope_style};
  }
  WindowQueries<T, DeviceSpace> window() const {
    return {TokenRows<T const, StridedLayout, DeviceSpace>(q.ptr, bhtd_layout(c.q_ext)), rope_table(),
            query_positions.get_or_null(!c.query_positions.empty())};
  }

  /// Calls fn(cache) with the device cache view in the case's layout.
  template <class Fn>
  std::string with_cache(Fn&& fn) {
    KVExtents const ek = c.e;
    KVExtents ev = c.e;
    ev.dim = c.dim_v > 0 ? c.dim_v : c.e.dim;
    Index* pos = positions.get_or_null(!c.positions.empty());
    if (c.layout == Layout::paged) {
      auto const kl = paged_layout(ek, page_size, PageOrder::nhd, table.ptr, pages, ek.batch * pages);
      auto const vl = paged_layout(ev, page_size, PageOrder::nhd, table.ptr, pages, ek.batch * pages);
      return fn(make_cache(TokenRows<T, PagedLayout, DeviceSpace>(k.ptr, kl),
                           TokenRows<T, PagedLayout, DeviceSpace>(v.ptr, vl), length_table(), pos));
    }
    auto const kl = c.layout == Layout::bthd ? bthd_layout(ek) : bhtd_layout(ek);
    auto const vl = c.layout == Layout::bthd ? bthd_layout(ev) : bhtd_layout(ev);
    return fn(make_cache(TokenRows<T, StridedLayout, DeviceSpace>(k.ptr, kl),
                         TokenRows<T, StridedLayout, DeviceSpace>(v.ptr, vl), length_table(), pos));
  }

  /// K and V back in BHTD fp32, positions and lengths back into a host case.
  void read_back(Case& out) {
    std::vector<T> kd, vd;
    k.to_host(kd);
    v.to_host(vd);
    auto const kf = widen(kd), vf = widen(vd);
    Index const dv = c.dim_v > 0 ? c.dim_v : c.e.dim;
    auto unplace = [&](std::vector<float> const& placed, Index dim, std::vector<float>& bhtd) {
      KVExtents const e{c.e.batch, c.e.heads, c.e.tokens, dim};
      bhtd.assign(static_cast<std::size_t>(e.rows() * dim), 0.0f);
      for (Index b = 0; b < e.batch; ++b)
        for (Index h = 0; h < e.heads; ++h)
          for (Index t = 0; t < e.tokens; ++t)
            for (Index i = 0; i < dim; ++i) {
              Index at = c.layout == Layout::bhtd ? bhtd_layout(e).offset(b, h, t)
                         : c.layout == Layout::bthd
                             ? bthd_layout(e).offset(b, h, t)
                             : paged_layout(e, page_size, PageOrder::nhd, table_host.data(), pages, e.batch * pages)
                                   .offset(b, h, t);
              bhtd[static_cast<std::size_t>(((b * e.heads + h) * e.tokens + t) * dim + i)] =
                  placed[static_cast<std::size_t>(at + i)];
            }
    };
    unplace(kf, c.e.dim, out.k);
    unplace(vf, dv, out.v);
    if (!c.positions.empty())
      positions.to_host(out.positions);
    if (!c.lengths.empty())
      lengths.to_host(out.lengths);
  }
};

template <class Fn>
std::string by_dtype(Dtype d, Fn&& fn) {
  if (d == Dtype::f16)
    return fn(half{});
  if (d == Dtype::bf16)
    return fn(bfloat16{});
  return fn(float{});
}

template <class S, class T>
std::string score_with(S scorer, Mirror<T>& m, std::vector<float>& out) {
  Case const& c = m.c;
  DeviceBuffer<float> o(static_cast<std::size_t>(c.e.rows()));
  std::string const err = m.with_cache([&](auto const& cache) {
    ScoreSpan<DeviceSpace> const span{o.ptr, c.e.batch, c.e.heads, c.e.tokens};
    if constexpr (has_need(S::needs, Needs::window_queries)) {
      auto const obs = observe(m.window());
      std::size_t const bytes = score_workspace_bytes(Cuda{}, scorer, c.e, obs);
      DeviceBuffer<unsigned char> ws(bytes);
      return finish(score(Cuda{}, scorer, cache, obs, span, Workspace{ws.ptr, bytes}));
    } else {
      std::size_t const bytes = score_workspace_bytes(Cuda{}, scorer, c.e);
      DeviceBuffer<unsigned char> ws(bytes);
      return finish(score(Cuda{}, scorer, cache, NoObservations{}, span, Workspace{ws.ptr, bytes}));
    }
  });
  o.to_host(out);
  return err;
}

/// Device copies of host moments stored as MT.
template <class MT>
struct DeviceMoments {
  KVExtents e;
  Index dv;
  DeviceBuffer<Index> count;
  DeviceBuffer<MT> key_mean, value_mean, comoment;
  DeviceMoments(Case const& c, Moments const& m)
      : e(c.e),
        dv(c.dim_v > 0 ? c.dim_v : c.e.dim),
        count(m.count),
        key_mean(narrow<MT>(m.key_mean)),
        value_mean(narrow<MT>(m.value_mean)),
        comoment(narrow<MT>(m.comoment)) {}
  MomentState<DeviceSpace, MT> view() const {
    return {count.ptr, key_mean.ptr, value_mean.ptr, comoment.ptr, e.batch, e.heads, e.dim, dv};
  }
  void read_back(Moments& m) const {
    count.to_host(m.count);
    std::vector<MT> x;
    key_mean.to_host(x);
    m.key_mean = widen(x);
    value_mean.to_host(x);
    m.value_mean = widen(x);
    comoment.to_host(x);
    m.comoment = widen(x);
  }
};

/// Device copies of a host u_j cache (disabled when its rows are empty).
struct DeviceResiduals {
  KVExtents rows_ext;
  Index refresh;
  bool enabled;
  DeviceBuffer<float> rows;
  DeviceBuffer<Index> tracked, age;
  DeviceResiduals(Case const& c, Residuals const& r)
      : rows_ext{c.e.batch, c.e.heads, c.e.tokens, c.dim_v > 0 ? c.dim_v : c.e.dim},
        refresh(r.refresh),
        enabled(!r.rows.empty()),
        rows(r.rows),
        tracked(r.tracked),
        age(r.age) {}
  MomentResiduals<DeviceSpace> view() const {
    if (!enabled)
      return {};
    return {TokenRows<float, StridedLayout, DeviceSpace>(rows.ptr, bhtd_layout(rows_ext)), tracked.ptr, age.ptr,
            refresh};
  }
  void read_back(Residuals& r) const {
    if (!enabled)
      return;
    rows.to_host(r.rows);
    tracked.to_host(r.tracked);
    age.to_host(r.age);
  }
};

/// The device scorer with the host scorer's parameters.
template <class MT>
MomentKVScorer<DeviceSpace, MT> device_moment_scorer(MomentKVScorer<> const& p, DeviceMoments<MT> const& m,
                                                     DeviceResiduals const& r) {
  MomentKVScorer<DeviceSpace, MT> s;
  s.state = m.view();
  s.residuals = r.view();
  s.base = p.base;
  s.scale = p.scale;
  s.clamp_tau = p.clamp_tau;
  s.prefill_rounds = p.prefill_rounds;
  return s;
}

/// Calls fn(cache_tag, moment_tag) for the case's cache dtype and the moments' storage dtype.
template <class Fn>
std::string by_dtypes(Dtype cache, Dtype moments, Fn&& fn) {
  return by_dtype(cache, [&](auto t) { return by_dtype(moments, [&](auto mt) { return fn(t, mt); }); });
}

}  // namespace

bool device_available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

std::string scores(std::string const& policy, Case const& c, std::vector<float>& out) {
  return by_dtype(c.dtype, [&](auto tag) {
    Mirror<decltype(tag)> m(c);
    Index const w = c.q_ext.tokens;
    if (policy == "key_diff")
      return score_with(KeyDiffScorer{}, m, out);
    if (policy == "key_diff_raw")
      return score_with(KeyDiffScorer{.anchor = KeyDiffAnchor::raw_mean}, m, out);
    if (policy == "knorm")
      return score_with(KnormScorer{}, m, out);
    if (policy == "streaming_llm")
      return score_with(StreamingLLMScorer{4}, m, out);
    if (policy == "random")
      return score_with(RandomScorer{11}, m, out);
    if (policy == "snap_kv")
      return score_with(SnapKVScorer{.window_size = w, .kernel_size = 5}, m, out);
    if (policy == "snap_kv_kvpress") {
      SnapKVScorer s = SnapKVScorer::kvpress();
      s.window_size = w;
      return score_with(s, m, out);
    }
    if (policy == "snap_kv_chunk")  // MomentKV's base: aligned chunks of 4 (the last one partial), group mean
      return score_with(SnapKVScorer{Reference::authors, w, 4, Pooling::chunk_mean, GqaReduce::mean}, m, out);
    if (policy == "snap_kv_chunk_kvpress") {
      SnapKVScorer s = SnapKVScorer::kvpress();
      s.window_size = w;
      s.kernel_size = 6;
      s.pooling = Pooling::chunk_mean;
      return score_with(s, m, out);
    }
    if (policy == "tova")
      return score_with(TOVAScorer{}, m, out);
    if (policy == "tova_kvpress")
      return score_with(TOVAScorer{Reference::kvpress}, m, out);
    if (policy == "observed_attention")
      return score_with(ObservedAttentionScorer{7}, m, out);
    if (policy == "observed_attention_one_tile")
      return score_with(ObservedAttentionScorer{256}, m, out);
    return std::string("unknown policy ") + policy;
  });
}

std::string attend(Case const& c, std::vector<float>& out, std::vector<float>& lse) {
  return by_dtype(c.dtype, [&](auto tag) {
    using T = decltype(tag);
    Mirror<T> m(c);
    Index const dv = c.dim_v > 0 ? c.dim_v : c.e.dim;
    DeviceBuffer<float> o(static_cast<std::size_t>(c.q_ext.rows() * dv)), l(static_cast<std::size_t>(c.q_ext.rows()));
    std::string const err = m.with_cache([&](auto const& cache) {
      AttendQueries<T, DeviceSpace> const q{
          TokenRows<T const, StridedLayout, DeviceSpace>(m.q.ptr, bhtd_layout(c.q_ext))};
      return finish(kvc::attend(Cuda{}, Attention{}, q, cache, AttendOutput<DeviceSpace>{o.ptr, l.ptr}, Workspace{}));
    });
    o.to_host(out);
    l.to_host(lse);
    return err;
  });
}

std::string top_k(double ratio, Index fixed, Index n_sink, Index n_recent, Index batch, Index heads, Index tokens,
                  std::vector<float> const& scores, std::vector<Index> const& lengths, bool per_head, Index capacity,
                  std::vector<Index>& index, std::vector<Index>& count) {
  DeviceBuffer<float> s(scores);
  DeviceBuffer<Index> len(lengths), idx(static_cast<std::size_t>(batch * heads * capacity)),
      cnt(static_cast<std::size_t>(batch * heads));
  Lengths const table = lengths.empty() ? Lengths{} : (per_head ? head_lengths(len.ptr, heads) : Lengths(len.ptr));
  ScoreSpan<DeviceSpace> const span{s.ptr, batch, heads, tokens, table};
  KeepPlan<DeviceSpace> const plan{idx.ptr, cnt.ptr, batch, heads, capacity};
  auto run = [&](auto const& sel) {  // the multi-block path (long heads) needs its workspace
    std::size_t const bytes = select_workspace_bytes(Cuda{}, sel, batch, heads, tokens);
    DeviceBuffer<unsigned char> ws(bytes);
    return finish(select(Cuda{}, sel, span, plan, Workspace{ws.ptr, bytes}));
  };
  std::string const err = ratio >= 0 ? run(TopKSelector{RatioBudget{ratio}, n_sink, n_recent})
                                     : run(TopKSelector{FixedBudget{fixed}, n_sink, n_recent});
  idx.to_host(index);
  cnt.to_host(count);
  return err;
}

std::string top_k_per_head(std::vector<Index> const& budget, Index batch, Index heads, Index tokens,
                           std::vector<float> const& scores, std::vector<Index>& index, std::vector<Index>& count) {
  DeviceBuffer<float> s(scores);
  DeviceBuffer<Index> table(budget), idx(static_cast<std::size_t>(batch * heads * tokens)),
      cnt(static_cast<std::size_t>(batch * heads));
  TopKSelector<PerHeadBudget<DeviceSpace>> const sel{PerHeadBudget<DeviceSpace>{table.ptr, heads}};
  std::string const err = finish(select(Cuda{}, sel, ScoreSpan<DeviceSpace>{s.ptr, batch, heads, tokens},
                                        KeepPlan<DeviceSpace>{idx.ptr, cnt.ptr, batch, heads, tokens}, {}));
  idx.to_host(index);
  cnt.to_host(count);
  return err;
}

std::string ada_kv(AdaKVCase const& c, std::vector<Index>& table, std::vector<Index>& index,
                   std::vector<Index>& count) {
  DeviceBuffer<float> s(c.scores);
  DeviceBuffer<Index> len(c.lengths), tab(static_cast<std::size_t>(c.batch * c.heads)),
      idx(static_cast<std::size_t>(c.batch * c.heads * c.tokens)), cnt(static_cast<std::size_t>(c.batch * c.heads));
  Lengths const lengths = c.lengths.empty() ? Lengths{} : head_lengths(len.ptr, c.heads);
  ScoreSpan<DeviceSpace> const span{s.ptr, c.batch, c.heads, c.tokens, lengths};
  KeepPlan<DeviceSpace> const plan{idx.ptr, cnt.ptr, c.batch, c.heads, c.tokens};
  Reference const ref = c.kvpress ? Reference::kvpress : Reference::authors;
  auto run = [&](auto const& sel) {
    std::size_t const bytes = select_workspace_bytes(Cuda{}, sel, c.batch, c.heads, c.tokens);
    DeviceBuffer<unsigned char> ws(bytes);
    std::string err = finish(allocate(Cuda{}, sel, span, tab.ptr, Workspace{ws.ptr, bytes}));
    if (err.empty())
      err = finish(select(Cuda{}, sel, span, plan, Workspace{ws.ptr, bytes}));
    return err;
  };
  std::string const err = c.ratio >= 0 ? run(AdaKVSelector{RatioBudget{c.ratio}, c.alpha, ref, c.n_sink, c.n_recent})
                                       : run(AdaKVSelector{FixedBudget{c.fixed}, c.alpha, ref, c.n_sink, c.n_recent});
  tab.to_host(table);
  idx.to_host(index);
  cnt.to_host(count);
  return err;
}

std::string ragged(Case const& c, std::vector<Index> const& index, std::vector<Index> const& count, Index capacity,
                   Index reserve, Case const& extra, RaggedResult& result) {
  return by_dtype(c.dtype, [&](auto tag) {
    using T = decltype(tag);
    Mirror<T> m(c), x(extra);
    Index const heads = c.e.batch * c.e.heads, dv = c.dim_v > 0 ? c.dim_v : c.e.dim;
    result.offsets.assign(static_cast<std::size_t>(heads + 1), 0);
    RaggedShape shape;
    std::vector<Index> room(count);
    for (Index& r : room)
      r += extra.e.tokens;
    if (auto const st = ragged_offsets(room.data(), heads, reserve, result.offsets.data(), shape); !st.ok())
      return std::string(st.message());
    DeviceBuffer<Index> offsets(result.offsets), lengths(std::vector<Index>(static_cast<std::size_t>(heads), 0)),
        positions(static_cast<std::size_t>(shape.rows)), idx(index), cnt(count);
    DeviceBuffer<T> k(static_cast<std::size_t>(shape.rows * c.e.dim)), v(static_cast<std::size_t>(shape.rows * dv));
    // The reserve's rows are never written: zero them as the host store's are, so whole buffers compare.
    cudaMemset(k.ptr, 0, k.n * sizeof(T));
    cudaMemset(v.ptr, 0, v.n * sizeof(T));
    cudaMemset(positions.ptr, 0, positions.n * sizeof(Index));
    auto const store = ragged_cache<DeviceSpace>(k.ptr, v.ptr, c.e.batch, c.e.heads, c.e.dim, dv, shape, offsets.ptr,
                                                 head_lengths(lengths.ptr, c.e.heads), positions.ptr);
    KeepPlan<DeviceSpace> const plan{idx.ptr, cnt.ptr, c.e.batch, c.e.heads, capacity};
    std::string err = m.with_cache([&](auto const& src) { return finish(kvc::gather(Cuda{}, plan, src, store)); });
    if (err.empty())
      err = x.with_cache([&](auto const& add) { return finish(kvc::append(Cuda{}, store, add)); });
    DeviceBuffer<float> o(static_cast<std::size_t>(c.q_ext.rows() * dv)), l(static_cast<std::size_t>(c.q_ext.rows()));
    if (err.empty()) {
      AttendQueries<T, DeviceSpace> const q{
          TokenRows<T const, StridedLayout, DeviceSpace>(m.q.ptr, bhtd_layout(c.q_ext))};
      err = finish(kvc::attend(Cuda{}, Attention{}, q, store, AttendOutput<DeviceSpace>{o.ptr, l.ptr}, Workspace{}));
    }
    std::vector<T> kh, vh;
    k.to_host(kh);
    v.to_host(vh);
    result.k = widen(kh);
    result.v = widen(vh);
    lengths.to_host(result.lengths);
    positions.to_host(result.positions);
    o.to_host(result.out);
    l.to_host(result.lse);
    return err;
  });
}

std::string compact(Case& c, std::vector<Index> const& index, std::vector<Index> const& count, Index capacity) {
  return by_dtype(c.dtype, [&](auto tag) {
    Mirror<decltype(tag)> m(c);
    DeviceBuffer<Index> idx(index), cnt(count);
    KeepPlan<DeviceSpace> const plan{idx.ptr, cnt.ptr, c.e.batch, c.e.heads, capacity};
    std::string const err = m.with_cache([&](auto const& cache) { return finish(kvc::compact(Cuda{}, plan, cache)); });
    m.read_back(c);
    return err;
  });
}

std::string gather(Case const& c, std::vector<Index> const& index, std::vector<Index> const& count, Index capacity,
                   Case& out) {
  return by_dtype(c.dtype, [&](auto tag) {
    using T = decltype(tag);
    Mirror<T> m(c);
    out = Case{};
    out.e = {c.e.batch, c.e.heads, capacity, c.e.dim};
    out.dim_v = c.dim_v;
    out.dtype = c.dtype;
    Index const dv = c.dim_v > 0 ? c.dim_v : c.e.dim;
    out.k.assign(static_cast<std::size_t>(out.e.rows() * c.e.dim), 0.0f);
    out.v.assign(static_cast<std::size_t>(out.e.rows() * dv), 0.0f);
    out.lengths.assign(static_cast<std::size_t>(c.e.batch * c.e.heads), 0);
    out.per_head = true;
    out.positions.assign(static_cast<std::size_t>(out.e.rows()), -1);
    Mirror<T> d(out);
    DeviceBuffer<Index> idx(index), cnt(count);
    KeepPlan<DeviceSpace> const plan{idx.ptr, cnt.ptr, c.e.batch, c.e.heads, capacity};
    std::string const err = m.with_cache([&](auto const& src) {
      return d.with_cache([&](auto const& dst) { return finish(kvc::gather(Cuda{}, plan, src, dst)); });
    });
    d.read_back(out);
    return err;
  });
}

std::string append(Case& dst, Case const& src, Index begin, Index count) {
  return by_dtype(dst.dtype, [&](auto tag) {
    using T = decltype(tag);
    Mirror<T> d(dst), s(src);
    std::string const err = d.with_cache([&](auto const& dc) {
      return s.with_cache([&](auto const& sc) { return finish(kvc::append(Cuda{}, dc, sc, begin, count)); });
    });
    d.read_back(dst);
    return err;
  });
}

std::string blockwise_key_diff(Case const& src, Index budget, Index block, std::vector<Index>& lengths,
                               std::vector<Index>& positions) {
  Press const press{KeyDiffScorer{}, TopKSelector{FixedBudget{budget}}};
  Index const cap = blockwise_capacity(press.selector, block);
  KVExtents const we{src.e.batch, src.e.heads, cap, src.e.dim};
  Mirror<float> s(src);
  DeviceBuffer<float> k(static_cast<std::size_t>(we.rows() * we.dim)), v(k.n);
  DeviceBuffer<Index> len(std::vector<Index>(static_cast<std::size_t>(we.batch * we.heads), 0)),
      pos(static_cast<std::size_t>(we.rows()));
  auto const work =
      make_cache(bhtd_device_rows(k.ptr, we), bhtd_device_rows(v.ptr, we), head_lengths(len.ptr, we.heads), pos.ptr);
  std::size_t const bytes = blockwise_workspace_bytes(Cuda{}, press, we);
  DeviceBuffer<unsigned char> ws(bytes);
  std::string const err = s.with_cache([&](auto const& cache) {
    return finish(blockwise_compress(Cuda{}, press, cache, block, work, {ws.ptr, bytes}));
  });
  len.to_host(lengths);
  pos.to_host(positions);
  return err;
}

std::string query_statistics(Dtype dtype, KVExtents q_ext, std::vector<float> const& rows, bool token_major,
                             std::vector<Index> const& positions, StatisticsRows const& sel, bool covariance,
                             std::vector<float>& mean, std::vector<float>& cov) {
  return by_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    StridedLayout const layout = token_major ? bthd_layout(q_ext) : bhtd_layout(q_ext);
    std::vector<T> placed(rows.size());
    for (Index b = 0; b < q_ext.batch; ++b)
      for (Index h = 0; h < q_ext.heads; ++h)
        for (Index t = 0; t < q_ext.tokens; ++t)
          for (Index i = 0; i < q_ext.dim; ++i)
            placed[static_cast<std::size_t>(layout.offset(b, h, t) + i)] = from_float<T>(
                rows[static_cast<std::size_t>(((b * q_ext.heads + h) * q_ext.tokens + t) * q_ext.dim + i)]);
    DeviceBuffer<T> q(placed);
    DeviceBuffer<Index> pos(positions);
    DeviceBuffer<float> mu(static_cast<std::size_t>(q_ext.batch * q_ext.heads * q_ext.dim)),
        sigma(static_cast<std::size_t>(q_ext.batch * q_ext.heads * q_ext.dim * q_ext.dim));
    std::size_t const bytes = query_statistics_workspace_bytes(Cuda{}, q_ext);
    DeviceBuffer<unsigned char> ws(bytes);
    std::string const err = finish(kvc::query_statistics(
        Cuda{}, TokenRows<T const, StridedLayout, DeviceSpace>(q.ptr, layout), pos.get_or_null(!positions.empty()), sel,
        mu.ptr, covariance ? sigma.ptr : nullptr, Workspace{ws.ptr, bytes}));
    mu.to_host(mean);
    if (covariance)
      sigma.to_host(cov);
    return err;
  });
}

std::string expected_attention(Case const& c, EAInputs const& in, std::vector<float>& out) {
  return by_dtype(c.dtype, [&](auto tag) {
    Mirror<decltype(tag)> m(c);
    Index const hq = in.query_heads;
    DeviceBuffer<float> mean(in.mean), cov(in.cov);
    DeviceBuffer<Index> next(in.next_position);
    RopeSpec const spec = test_rope_spec(in.style, in.rotary_dim);
    std::vector<float> table_host(
        static_cast<std::size_t>(rope_table_floats(test_rope_positions, spec.rotated(c.e.dim))));
    RopeTable<HostSpace> host_table;
    if (!fill_rope_table(spec, c.e.dim, test_rope_positions, table_host.data(), host_table).ok())
      return std::string("bad RopeSpec");
    DeviceBuffer<float> table(table_host);
    Index const half = spec.rotated(c.e.dim) / 2;
    QueryStatistics<DeviceSpace> st{mean.ptr, cov.get_or_null(!in.cov.empty()), c.e.batch, hq, c.e.dim};
    if (in.rope)
      st.rope = {table.ptr, table.ptr + test_rope_positions * half, test_rope_positions, 2 * half, in.style};
    st.next_position = next.get_or_null(!in.next_position.empty());
    st.observed = in.observed;
    DeviceBuffer<float> o(static_cast<std::size_t>(c.e.rows()));
    std::string const err = m.with_cache([&](auto const& cache) {
      auto const obs = observe(st);
      std::size_t const bytes = score_workspace_bytes(Cuda{}, in.scorer, c.e, obs);
      DeviceBuffer<unsigned char> ws(bytes);
      return finish(score(Cuda{}, in.scorer, cache, obs,
                          ScoreSpan<DeviceSpace>{o.ptr, c.e.batch, c.e.heads, c.e.tokens}, Workspace{ws.ptr, bytes}));
    });
    o.to_host(out);
    return err;
  });
}

std::string h2o(Case const& c, Index tile, std::vector<H2OStep> const& steps, std::vector<H2OResult>& results) {
  return by_dtype(c.dtype, [&](auto tag) {
    using T = decltype(tag);
    Mirror<T> m(c);
    KVExtents const e = c.e;
    DeviceBuffer<float> acc(std::vector<float>(static_cast<std::size_t>(e.rows()), -5.0f));
    DeviceBuffer<Index> tracked(std::vector<Index>(static_cast<std::size_t>(e.batch * e.heads), 0));
    H2OScorer<DeviceSpace> const scorer{{{acc.ptr, e.batch, e.heads, e.tokens}, tracked.ptr}, tile};
    results.clear();
    return m.with_cache([&](auto const& cache) -> std::string {
      for (H2OStep const& step : steps) {
        if (step.append.e.tokens > 0) {
          Mirror<T> src(step.append);
          std::string const err = src.with_cache(
              [&](auto const& sc) { return finish(kvc::append(Cuda{}, cache, sc, 0, step.append.e.tokens)); });
          if (!err.empty())
            return "append: " + err;
        }
        std::string err;
        if (!step.columns.empty()) {
          DeviceBuffer<float> cols(step.columns);
          auto const obs = observe(AttentionColumnSums<DeviceSpace>{cols.ptr, e.batch, step.column_heads, e.tokens, 1});
          std::size_t const bytes = update_workspace_bytes(Cuda{}, scorer, e, obs);
          DeviceBuffer<unsigned char> ws(bytes);
          err = finish(update(Cuda{}, scorer, cache, obs, Workspace{ws.ptr, bytes}));
        } else {
          DeviceBuffer<T> q(narrow<T>(step.queries));
          WindowQueries<T, DeviceSpace> const wq{
              TokenRows<T const, StridedLayout, DeviceSpace>(q.ptr, bhtd_layout(step.q_ext)), m.rope_table(), nullptr};
          auto const obs = observe(wq);
          std::size_t const bytes = update_workspace_bytes(Cuda{}, scorer, e, obs);
          DeviceBuffer<unsigned char> ws(bytes);
          err = finish(update(Cuda{}, scorer, cache, obs, Workspace{ws.ptr, bytes}));
        }
        if (!err.empty())
          return "update: " + err;
        H2OResult r;
        acc.to_host(r.acc);
        tracked.to_host(r.tracked);
        DeviceBuffer<float> o(static_cast<std::size_t>(e.rows()));
        std::size_t const bytes = score_workspace_bytes(Cuda{}, scorer, e);
        DeviceBuffer<unsigned char> ws(bytes);
        err = finish(score(Cuda{}, scorer, cache, ScoreSpan<DeviceSpace>{o.ptr, e.batch, e.heads, e.tokens},
                           Workspace{ws.ptr, bytes}));
        if (!err.empty())
          return "score: " + err;
        o.to_host(r.scores);
        if (!step.count.empty()) {
          DeviceBuffer<Index> idx(step.index), cnt(step.count);
          KeepPlan<DeviceSpace> const plan{idx.ptr, cnt.ptr, e.batch, e.heads, e.tokens};
          err = finish(on_evict(Cuda{}, scorer, cache, plan, Workspace{}));
          if (err.empty())
            err = finish(kvc::compact(Cuda{}, plan, cache, scorer.state.accumulated));
          if (!err.empty())
            return "evict: " + err;
        }
        m.lengths.to_host(r.lengths);
        results.push_back(std::move(r));
      }
      return std::string();
    });
  });
}

std::string uncomp(Case const& c, UNCompParams const& p, std::vector<UNCompStep> const& steps,
                   std::vector<UNCompResult>& results) {
  return by_dtype(c.dtype, [&](auto tag) {
    using T = decltype(tag);
    Mirror<T> m(c);
    KVExtents const e = c.e;
    Index const w = p.window;
    DeviceBuffer<float> rows(std::vector<float>(static_cast<std::size_t>(e.rows() * w), 9.0f));
    DeviceBuffer<Index> tracked(std::vector<Index>(static_cast<std::size_t>(e.batch * e.heads), 0));
    DeviceBuffer<Index> budgets(p.budgets);
    UNCompScorer<DeviceSpace> const scorer{
        {TokenRows<float, StridedLayout, DeviceSpace>(rows.ptr, uncomp_window_layout(e, w)), tracked.ptr},
        w,
        p.kernel,
        p.pooling};
    UNCompSelector<DeviceSpace> const sel{HeadBudgets<DeviceSpace>{budgets.ptr, e.heads}, 0, w};
    results.clear();
    return m.with_cache([&](auto const& cache) -> std::string {
      for (UNCompStep const& step : steps) {
        if (step.append.e.tokens > 0) {
          Mirror<T> src(step.append);
          std::string const err = src.with_cache(
              [&](auto const& sc) { return finish(kvc::append(Cuda{}, cache, sc, 0, step.append.e.tokens)); });
          if (!err.empty())
            return "append: " + err;
        }
        if (!step.queries.empty()) {
          DeviceBuffer<T> q(narrow<T>(step.queries));
          WindowQueries<T, DeviceSpace> const wq{
              TokenRows<T const, StridedLayout, DeviceSpace>(q.ptr, bhtd_layout(step.q_ext)), m.rope_table(), nullptr};
          auto const obs = observe(wq);
          std::size_t const bytes = update_workspace_bytes(Cuda{}, scorer, e, obs);
          DeviceBuffer<unsigned char> ws(bytes);
          std::string const err = finish(update(Cuda{}, scorer, cache, obs, Workspace{ws.ptr, bytes}));
          if (!err.empty())
            return "update: " + err;
        }
        UNCompResult r;
        rows.to_host(r.rows);
        tracked.to_host(r.tracked);
        DeviceBuffer<float> o(static_cast<std::size_t>(e.rows()));
        {
          std::size_t const bytes = score_workspace_bytes(Cuda{}, scorer, e);
          DeviceBuffer<unsigned char> ws(bytes);
          std::string const err =
              finish(score(Cuda{}, scorer, cache, ScoreSpan<DeviceSpace>{o.ptr, e.batch, e.heads, e.tokens},
                           Workspace{ws.ptr, bytes}));
          if (!err.empty())
            return "score: " + err;
        }
        o.to_host(r.scores);
        if (!step.count.empty()) {
          std::size_t const bytes = select_workspace_bytes(Cuda{}, sel, e.batch, e.heads, e.tokens);
          DeviceBuffer<unsigned char> ws(bytes);
          DeviceBuffer<float> cpu_scores(step.cpu_scores);
          DeviceBuffer<Index> table(static_cast<std::size_t>(e.batch * e.heads)),
              idx(static_cast<std::size_t>(e.rows())), cnt(static_cast<std::size_t>(e.batch * e.heads)),
              idx_cpu(static_cast<std::size_t>(e.rows())), cnt_cpu(static_cast<std::size_t>(e.batch * e.heads));
          ScoreSpan<DeviceSpace> const mine{o.ptr, e.batch, e.heads, e.tokens, cache.lengths};
          ScoreSpan<DeviceSpace> const theirs{cpu_scores.ptr, e.batch, e.heads, e.tokens, cache.lengths};
          std::string err = finish(kvc::allocate(Cuda{}, sel, mine, table.ptr, Workspace{ws.ptr, bytes}));
          if (err.empty())
            err = finish(kvc::select(Cuda{}, sel, mine,
                                     KeepPlan<DeviceSpace>{idx.ptr, cnt.ptr, e.batch, e.heads, e.tokens},
                                     Workspace{ws.ptr, bytes}));
          if (err.empty())
            err = finish(kvc::select(Cuda{}, sel, theirs,
                                     KeepPlan<DeviceSpace>{idx_cpu.ptr, cnt_cpu.ptr, e.batch, e.heads, e.tokens},
                                     Workspace{ws.ptr, bytes}));
          if (!err.empty())
            return "select: " + err;
          table.to_host(r.table);
          idx.to_host(r.index);
          cnt.to_host(r.count);
          idx_cpu.to_host(r.index_cpu);
          cnt_cpu.to_host(r.count_cpu);
          DeviceBuffer<Index> plan_idx(step.index), plan_cnt(step.count);
          KeepPlan<DeviceSpace> const plan{plan_idx.ptr, plan_cnt.ptr, e.batch, e.heads, e.tokens};
          err = finish(on_evict(Cuda{}, scorer, cache, plan, Workspace{}));
          if (err.empty())
            tracked.to_host(r.evicted_tracked);
          if (err.empty())
            err = finish(kvc::compact(Cuda{}, plan, cache, scorer.state.window_rows));
          if (!err.empty())
            return "evict: " + err;
        }
        m.lengths.to_host(r.lengths);
        results.push_back(std::move(r));
      }
      return std::string();
    });
  });
}

std::string uncomp_select(std::vector<Index> const& budgets, Index n_recent, Index batch, Index heads, Index tokens,
                          std::vector<float> const& scores, std::vector<Index> const& lengths,
                          std::vector<Index>& table, std::vector<Index>& index, std::vector<Index>& count) {
  DeviceBuffer<float> s(scores);
  DeviceBuffer<Index> bud(budgets), len(lengths), tab(static_cast<std::size_t>(batch * heads)),
      idx(static_cast<std::size_t>(batch * heads * tokens)), cnt(static_cast<std::size_t>(batch * heads));
  ScoreSpan<DeviceSpace> const span{s.ptr, batch, heads, tokens,
                                    lengths.empty() ? Lengths{} : head_lengths(len.ptr, heads)};
  UNCompSelector<DeviceSpace> const sel{HeadBudgets<DeviceSpace>{bud.ptr, heads}, 0, n_recent};
  std::size_t const bytes = select_workspace_bytes(Cuda{}, sel, batch, heads, tokens);
  DeviceBuffer<unsigned char> ws(bytes);
  std::string err = finish(kvc::allocate(Cuda{}, sel, span, tab.ptr, Workspace{ws.ptr, bytes}));
  if (err.empty())
    err = finish(kvc::select(Cuda{}, sel, span, KeepPlan<DeviceSpace>{idx.ptr, cnt.ptr, batch, heads, tokens},
                             Workspace{ws.ptr, bytes}));
  tab.to_host(table);
  idx.to_host(index);
  cnt.to_host(count);
  return err;
}

std::string compact_rows(Case& c, std::vector<Index> const& index, std::vector<Index> const& count, Index capacity,
                         std::vector<float>& rows) {
  return by_dtype(c.dtype, [&](auto tag) {
    Mirror<decltype(tag)> m(c);
    DeviceBuffer<Index> idx(index), cnt(count);
    DeviceBuffer<float> r(rows);
    KVExtents const re{c.e.batch, c.e.heads, c.e.tokens, c.dim_v > 0 ? c.dim_v : c.e.dim};
    TokenRows<float, StridedLayout, DeviceSpace> const extra(r.get_or_null(!rows.empty()), bhtd_layout(re));
    KeepPlan<DeviceSpace> const plan{idx.ptr, cnt.ptr, c.e.batch, c.e.heads, capacity};
    std::string const err =
        m.with_cache([&](auto const& cache) { return finish(kvc::compact(Cuda{}, plan, cache, extra)); });
    m.read_back(c);
    if (!rows.empty())
      r.to_host(rows);
    return err;
  });
}

std::string moment_scores(Case const& c, MomentKVScorer<> const& params, Moments const& mo, Residuals const& r,
                          std::vector<float> const& fixed_base, std::vector<float>& out) {
  return by_dtypes(c.dtype, mo.dtype, [&](auto tag, auto mtag) {
    using T = decltype(tag);
    Mirror<T> m(c);
    DeviceMoments<decltype(mtag)> const dm(c, mo);
    DeviceResiduals const dr(c, r);
    DeviceBuffer<float> base(fixed_base);
    auto scorer = device_moment_scorer(params, dm, dr);
    if (!fixed_base.empty())
      scorer.fixed_base = {base.ptr, c.e.batch, c.e.heads, c.e.tokens};
    return score_with(scorer, m, out);
  });
}

std::string moment_update(Case const& c, MomentKVScorer<> const& params, Moments const& mo, Residuals& r) {
  return by_dtypes(c.dtype, mo.dtype, [&](auto tag, auto mtag) {
    Mirror<decltype(tag)> m(c);
    DeviceMoments<decltype(mtag)> const dm(c, mo);
    DeviceResiduals const dr(c, r);
    auto const scorer = device_moment_scorer(params, dm, dr);
    std::string const err = m.with_cache([&](auto const& cache) {
      std::size_t const bytes = update_workspace_bytes(Cuda{}, scorer, c.e, NoObservations{});
      DeviceBuffer<unsigned char> ws(bytes);
      return finish(update(Cuda{}, scorer, cache, NoObservations{}, Workspace{ws.ptr, bytes}));
    });
    dr.read_back(r);
    return err;
  });
}

std::string moment_evict(Case const& c, MomentKVScorer<> const& params, Moments& mo, Residuals& r,
                         std::vector<Index> const& index, std::vector<Index> const& count, Index capacity) {
  return by_dtypes(c.dtype, mo.dtype, [&](auto tag, auto mtag) {
    Mirror<decltype(tag)> m(c);
    DeviceMoments<decltype(mtag)> const dm(c, mo);
    DeviceResiduals const dr(c, r);
    auto const scorer = device_moment_scorer(params, dm, dr);
    DeviceBuffer<Index> idx(index), cnt(count);
    KeepPlan<DeviceSpace> const plan{idx.ptr, cnt.ptr, c.e.batch, c.e.heads, capacity};
    std::string const err = m.with_cache([&](auto const& cache) {
      std::size_t const bytes = on_evict_workspace_bytes(Cuda{}, scorer, c.e);
      DeviceBuffer<unsigned char> ws(bytes);
      return finish(on_evict(Cuda{}, scorer, cache, plan, Workspace{ws.ptr, bytes}));
    });
    dm.read_back(mo);
    dr.read_back(r);
    return err;
  });
}

std::string attend_corrected(Case const& c, CorrectedAttention const& op, Moments const& mo, std::vector<float>& out,
                             std::vector<float>& lse) {
  return by_dtypes(c.dtype, mo.dtype, [&](auto tag, auto mtag) {
    using T = decltype(tag);
    Mirror<T> m(c);
    DeviceMoments<decltype(mtag)> const dm(c, mo);
    Index const dv = c.dim_v > 0 ? c.dim_v : c.e.dim;
    DeviceBuffer<float> o(static_cast<std::size_t>(c.q_ext.rows() * dv)), l(static_cast<std::size_t>(c.q_ext.rows()));
    std::string const err = m.with_cache([&](auto const& cache) {
      AttendQueries<T, DeviceSpace> const q{
          TokenRows<T const, StridedLayout, DeviceSpace>(m.q.ptr, bhtd_layout(c.q_ext))};
      std::size_t const bytes = attend_corrected_workspace_bytes(Cuda{}, op, q, cache, dm.view());
      DeviceBuffer<unsigned char> ws(bytes);
      return finish(kvc::attend_corrected(Cuda{}, op, q, cache, dm.view(), AttendOutput<DeviceSpace>{o.ptr, l.ptr},
                                          Workspace{ws.ptr, bytes}));
    });
    o.to_host(out);
    l.to_host(lse);
    return err;
  });
}

std::string moment_kv_prefill(Case& c, MomentKVScorer<> const& params, Moments& mo, Index budget, Index n_sink,
                              Index n_recent) {
  return by_dtypes(c.dtype, mo.dtype, [&](auto tag, auto mtag) {
    Mirror<decltype(tag)> m(c);
    DeviceMoments<decltype(mtag)> const dm(c, mo);
    DeviceResiduals const dr(c, Residuals{});
    auto const scorer = device_moment_scorer(params, dm, dr);
    TopKSelector const sel{FixedBudget{budget}, n_sink, n_recent};
    std::string const err = m.with_cache([&](auto const& cache) {
      auto const obs = observe(m.window());
      std::size_t const bytes = moment_kv_prefill_workspace_bytes(Cuda{}, scorer, sel, c.e, obs);
      DeviceBuffer<unsigned char> ws(bytes);
      return finish(kvc::moment_kv_prefill(Cuda{}, scorer, sel, cache, obs, Workspace{ws.ptr, bytes}));
    });
    m.read_back(c);
    dm.read_back(mo);
    return err;
  });
}

/// The decode driver is written against entry points only: it must build for the CUDA backend with every scorer
/// that has CUDA kernels (compile-time check; parity of the steps it calls is tested above).
void decode_driver_builds_for_cuda(Cuda const& cuda, Workspace ws) {
  KVExtents const e{1, 1, 0, 8};
  auto const cache =
      make_cache(bhtd_device_rows(static_cast<float*>(nullptr), e), bhtd_device_rows(static_cast<float*>(nullptr), e));
  QueryBuffer<float, DeviceSpace> buf{};
  DecodeCounter counter;
  DecodeSchedule const schedule{};
  RopeTable<DeviceSpace> const rope{};
  (void)decode_step(cuda, KnormScorer{}, schedule, cache, buf, counter, rope, ws);
  (void)decode_step(cuda, SnapKVScorer{}, schedule, cache, buf, counter, rope, ws);
  (void)decode_step(cuda, ExpectedAttentionScorer{}, schedule, cache, buf, counter, rope, ws);
  (void)decode_step(cuda, H2OScorer<DeviceSpace>{}, schedule, cache, buf, counter, rope, ws);
  (void)decode_step(cuda, ObservedAttentionScorer{}, schedule, cache, buf, counter, rope, ws);
  (void)decode_step(cuda, MomentKVScorer<DeviceSpace>{}.decode(), schedule, cache, buf, counter, rope, ws);
  (void)decode_step(cuda, MomentKVScorer<DeviceSpace, half>{}.decode(), schedule, cache, buf, counter, rope, ws);
  // UNComp's decode: one eviction per step over the per-head budgets (a device table), or the allocator itself.
  (void)decode_step(cuda, UNCompScorer<DeviceSpace>{}, TopKSelector<PerHeadBudget<DeviceSpace>>{}, schedule, cache, buf,
                    counter, rope, ws);
  (void)decode_step(cuda, UNCompScorer<DeviceSpace>{}, UNCompSelector<DeviceSpace>{}, schedule, cache, buf, counter,
                    rope, ws);
}

// --- RDKV (issue 13). Declared in parity_test.cpp beside their tests (cuda_kernels.hpp is shared with other work). --

/// kvc::attend_packed on the device: the host PackedKV copied with kvc::to_device, queries [B, Hq, n, d_k] (fp32
/// narrowed to `dtype`), positions [B, n] or empty (the context end), causal or not.
std::string attend_packed(PackedKV const& kv, Dtype dtype, KVExtents q_ext, std::vector<float> const& queries,
                          std::vector<Index> const& positions, bool causal, std::vector<float>& out,
                          std::vector<float>& lse) {
  Index const heads = kv.batch() * kv.kv_heads();
  DeviceBuffer<unsigned char> arena(kv.arena_bytes());
  DeviceBuffer<PackedHead> table(static_cast<std::size_t>(heads));
  DeviceBuffer<Index> pos(positions);
  DeviceBuffer<float> o(static_cast<std::size_t>(q_ext.rows() * kv.value_dim())),
      l(static_cast<std::size_t>(q_ext.rows()));
  PackedKVView<DeviceSpace> view;
  if (Status const st = to_device(Cuda{}, kv, arena.ptr, arena.n, table.ptr, heads, view); !st.ok())
    return st.message();
  std::string const err = by_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    DeviceBuffer<T> q(narrow<T>(queries));
    AttendQueries<T, DeviceSpace> const aq{TokenRows<T const, StridedLayout, DeviceSpace>(q.ptr, bhtd_layout(q_ext)),
                                           positions.empty() ? nullptr : pos.ptr};
    Attention op;
    op.causal = causal;
    return finish(kvc::attend_packed(Cuda{}, op, aq, view, AttendOutput<DeviceSpace>{o.ptr, l.ptr}, Workspace{}));
  });
  o.to_host(out);
  l.to_host(lse);
  return err;
}

/// kvc::allocate_bits (RDKV) on the device: token weights [B, H, T] with per-head lengths [B * H] (empty: none),
/// channel weights [B, H, dim]; the plan's v_bits [B, H, T] and k_bits [B, H, dim] come back.
std::string allocate_bits(RDKVAllocator const& a, KVExtents e, std::vector<float> const& token_weights,
                          std::vector<Index> const& lengths, std::vector<float> const& channel_weights,
                          std::vector<std::int8_t>& v_bits, std::vector<std::int8_t>& k_bits) {
  DeviceBuffer<float> w(token_weights), cw(channel_weights);
  DeviceBuffer<Index> len(lengths);
  DeviceBuffer<std::int8_t> v(static_cast<std::size_t>(e.rows())),
      k(static_cast<std::size_t>(e.batch * e.heads * e.dim));
  ScoreSpan<DeviceSpace> const span{w.ptr, e.batch, e.heads, e.tokens,
                                    lengths.empty() ? Lengths{} : head_lengths(len.ptr, e.heads)};
  BitPlan<DeviceSpace> const plan{v.ptr, k.ptr, e.batch, e.heads, e.tokens, e.dim};
  std::size_t const bytes = allocate_bits_workspace_bytes(Cuda{}, a, e.batch, e.heads, e.tokens, e.dim);
  DeviceBuffer<unsigned char> ws(bytes);
  std::string const err = finish(kvc::allocate_bits(Cuda{}, a, span, cw.ptr, plan, Workspace{ws.ptr, bytes}));
  v.to_host(v_bits);
  k.to_host(k_bits);
  return err;
}

/// RDKV's token weights (attn_linear, window = the case's window rows, pooling kernel `kernel`) on the device.
std::string rdkv_scores(Case const& c, Index kernel, std::vector<float>& out) {
  return by_dtype(c.dtype, [&](auto tag) {
    Mirror<decltype(tag)> m(c);
    RDKVTokenScorer s;
    s.window_size = c.q_ext.tokens;
    s.kernel_size = kernel;
    return score_with(s, m, out);
  });
}

/// ThinK's channel weights [B, Hkv, d] (window = the case's window rows) on the device.
std::string think_scores(Case const& c, std::vector<float>& out) {
  return by_dtype(c.dtype, [&](auto tag) {
    Mirror<decltype(tag)> m(c);
    DeviceBuffer<float> o(static_cast<std::size_t>(c.e.batch * c.e.heads * c.e.dim));
    ThinKChannelScorer const s{c.q_ext.tokens};
    std::string const err = m.with_cache([&](auto const& cache) {
      auto const obs = observe(m.window());
      std::size_t const bytes = channel_score_workspace_bytes(Cuda{}, s, c.e, obs);
      DeviceBuffer<unsigned char> ws(bytes);
      return finish(score_channels(Cuda{}, s, cache, obs, o.ptr, Workspace{ws.ptr, bytes}));
    });
    o.to_host(out);
    return err;
  });
}

}  // namespace kvc::test::cuda
