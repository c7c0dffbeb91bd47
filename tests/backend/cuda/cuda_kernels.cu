// SPDX-License-Identifier: Apache-2.0
// tests/backend/cuda/cuda_kernels.cu: device-side halves of the parity tests (see cuda_kernels.hpp).
#include <kvc/backend/cuda/attention/attend.cuh>
#include <kvc/backend/cuda/attention/corrected.cuh>
#include <kvc/backend/cuda/attention/merge.cuh>
#include <kvc/backend/cuda/attention/packed.cuh>
#include <kvc/backend/cuda/pipeline/compact.cuh>
#include <kvc/backend/cuda/pipeline/pack.cuh>
#include <kvc/backend/cuda/pipeline/query_statistics.cuh>
#include <kvc/backend/cuda/pipeline/state.cuh>
#include <kvc/backend/cuda/scorers/expected_attention.cuh>
#include <kvc/backend/cuda/scorers/h2o.cuh>
#include <kvc/backend/cuda/scorers/key_diff.cuh>
#include <kvc/backend/cuda/scorers/knorm.cuh>
#include <kvc/backend/cuda/scorers/moment_kv.cuh>
#include <kvc/backend/cuda/scorers/random.cuh>
#include <kvc/backend/cuda/scorers/rdkv.cuh>
#include <kvc/backend/cuda/scorers/snap_kv.cuh>
#include <kvc/backend/cuda/scorers/streaming_llm.cuh>
#include <kvc/backend/cuda/scorers/tova.cuh>
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

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <type_traits>

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

/// The stream the wrappers run their entry points on (StreamScope): nullptr, the legacy default stream, outside one.
cudaStream_t wrapper_stream = nullptr;

/// The backend every wrapper passes to the entry points.
Cuda dev() {
  return Cuda{wrapper_stream};
}

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

/// Rows per page of the per-head paged layout: the largest size <= 16 that divides `tokens` (a head's capacity is
/// whole pages, and it must equal the case's tokens).
Index head_page_size(Index tokens) {
  for (Index p : {16, 15, 12, 10, 8, 6, 5, 4, 3, 2})
    if (tokens % p == 0)
      return p;
  return 1;
}

/// The host tables of a case's layout (see Layout): page tables, CSR lists or ragged offsets, and the pool's size.
struct Tables {
  Layout layout = Layout::bhtd;
  KVExtents e{};
  Index page = page_size;  ///< rows per page
  Index max_pages = 0;     ///< block table width (per sequence, or per head for head_paged)
  Index pool = 0;          ///< pages in the pool
  std::vector<std::int32_t> table, indptr, indices;
  std::vector<Index> offsets;

  /// The length the tables of head (b, h) are sized for.
  static Index length(Case const& c, Index b, Index h) {
    std::vector<Index> const& n = c.room.empty() ? c.lengths : c.room;
    if (n.empty())
      return c.e.tokens;
    return n[static_cast<std::size_t>(c.per_head ? b * c.e.heads + h : b)];
  }

  explicit Tables(Case const& c) : layout(c.layout), e(c.e) {
    Index const heads = e.batch * e.heads;
    if (layout == Layout::paged || layout == Layout::paged_hnd) {
      max_pages = (e.tokens + page - 1) / page;
      pool = e.batch * max_pages;
      table.resize(static_cast<std::size_t>(pool));
      for (std::size_t i = 0; i < table.size(); ++i)
        table[i] = static_cast<std::int32_t>(table.size() - 1 - i);  // reversed page ids: order in the pool differs
    } else if (layout == Layout::paged_csr) {
      indptr.push_back(0);
      for (Index b = 0; b < e.batch; ++b) {
        Index longest = 0;
        for (Index h = 0; h < e.heads; ++h)
          longest = std::max(longest, length(c, b, h));
        indptr.push_back(indptr.back() + static_cast<std::int32_t>((longest + page - 1) / page));
      }
      pool = indptr.back();
      for (Index i = 0; i < pool; ++i)
        indices.push_back(static_cast<std::int32_t>(pool - 1 - i));
    } else if (layout == Layout::head_paged) {
      page = head_page_size(e.tokens);
      max_pages = e.tokens / page;
      pool = heads * max_pages;
      table.resize(static_cast<std::size_t>(pool));
      for (Index i = 0; i < heads; ++i)  // page p of head i is pool page p * heads + i: the heads' pages interleave
        for (Index p = 0; p < max_pages; ++p)
          table[static_cast<std::size_t>(i * max_pages + p)] = static_cast<std::int32_t>(p * heads + i);
    } else if (layout == Layout::ragged) {
      offsets.push_back(0);
      for (Index i = 0; i < heads; ++i) {
        Index const n = length(c, i / e.heads, i % e.heads);
        offsets.push_back(offsets.back() + (i == 0 ? e.tokens : std::min(e.tokens, n + i % 3)));
      }
    }
  }

  /// Elements of a K or V buffer of head dim `dim`, and of the positions array.
  Index elements(Index dim) const {
    switch (layout) {
      case Layout::paged:
      case Layout::paged_hnd:
      case Layout::paged_csr: return pool * page * e.heads * dim;
      case Layout::head_paged: return pool * page * dim;
      case Layout::ragged: return offsets.back() * dim;
      default: return e.rows() * dim;
    }
  }
  Index position_slots() const {
    return layout == Layout::head_paged ? pool * page : layout == Layout::ragged ? offsets.back() : e.rows();
  }
  /// Whether slot t of head (b, h) has storage (a CSR list reaches its page; a ragged segment holds it).
  bool addressable(Index b, Index h, Index t) const {
    if (layout == Layout::paged_csr)
      return t / page < indptr[static_cast<std::size_t>(b + 1)] - indptr[static_cast<std::size_t>(b)];
    if (layout == Layout::ragged)
      return t < offsets[static_cast<std::size_t>(b * e.heads + h + 1)] -
                     offsets[static_cast<std::size_t>(b * e.heads + h)];
    return true;
  }

  /// Calls fn(keys layout, values layout) over the given tables (host or device copies of these).
  template <class Fn>
  decltype(auto) layouts(Index dim_k, Index dim_v, std::int32_t const* tab, std::int32_t const* ptr,
                         std::int32_t const* idx, Index const* off, Fn&& fn) const {
    KVExtents ek = e, ev = e;
    ek.dim = dim_k;
    ev.dim = dim_v;
    switch (layout) {
      case Layout::paged:
      case Layout::paged_hnd: {
        PageOrder const order = layout == Layout::paged ? PageOrder::nhd : PageOrder::hnd;
        return fn(paged_layout(ek, page, order, tab, max_pages, pool),
                  paged_layout(ev, page, order, tab, max_pages, pool));
      }
      case Layout::paged_csr:
        return fn(paged_layout_csr(ek, page, PageOrder::nhd, ptr, idx, pool, pool),
                  paged_layout_csr(ev, page, PageOrder::nhd, ptr, idx, pool, pool));
      case Layout::head_paged:
        return fn(head_paged_layout(e.batch, e.heads, dim_k, page, tab, max_pages, pool),
                  head_paged_layout(e.batch, e.heads, dim_v, page, tab, max_pages, pool));
      case Layout::ragged:
        return fn(ragged_layout(e.batch, e.heads, dim_k, e.tokens, off),
                  ragged_layout(e.batch, e.heads, dim_v, e.tokens, off));
      case Layout::bthd: return fn(bthd_layout(ek), bthd_layout(ev));
      default: return fn(bhtd_layout(ek), bhtd_layout(ev));
    }
  }
  template <class Fn>
  decltype(auto) host_layouts(Index dim_k, Index dim_v, Fn&& fn) const {
    return layouts(dim_k, dim_v, table.data(), indptr.data(), indices.data(), offsets.data(), fn);
  }
};

/// Where a layout stores the position of slot t of head (b, h): the row's number for layouts that number their rows
/// (per-head paged, ragged), else [B, H, N] (KVCache::position_slot).
template <class L>
Index position_slot(L const& l, Index b, Index h, Index t) {
  if constexpr (requires { l.slot(b, h, t); })
    return l.slot(b, h, t);
  else
    return (b * l.ext.heads + h) * l.ext.tokens + t;
}

/// The device mirror of a Case with element type T: K/V in the case's layout, tables, queries, RoPE table.
template <class T>
struct Mirror {
  Case const& c;
  Tables tab;
  DeviceBuffer<T> k, v, q;
  DeviceBuffer<Index> lengths, positions, query_positions, offsets;
  DeviceBuffer<std::int32_t> table, indptr, indices;
  DeviceBuffer<float> rope;

  Index dim_v() const { return c.dim_v > 0 ? c.dim_v : c.e.dim; }

  /// Host rows [B, H, N, dim] placed where the layout keeps them (K when `keys`, else V).
  std::vector<T> place(std::vector<float> const& bhtd, bool keys) const {
    Index const dim = keys ? c.e.dim : dim_v();
    std::vector<T> out(static_cast<std::size_t>(tab.elements(dim)));
    tab.host_layouts(c.e.dim, dim_v(), [&](auto const& kl, auto const& vl) {
      auto const& l = keys ? kl : vl;
      for (Index b = 0; b < c.e.batch; ++b)
        for (Index h = 0; h < c.e.heads; ++h)
          for (Index t = 0; t < c.e.tokens; ++t)
            if (tab.addressable(b, h, t))
              for (Index i = 0; i < dim; ++i)
                out[static_cast<std::size_t>(l.offset(b, h, t) + i)] =
                    from_float<T>(bhtd[static_cast<std::size_t>(((b * c.e.heads + h) * c.e.tokens + t) * dim + i)]);
    });
    return out;
  }
  std::vector<Index> place_positions() const {
    if (c.positions.empty())
      return {};
    std::vector<Index> out(static_cast<std::size_t>(tab.position_slots()), 0);
    tab.host_layouts(c.e.dim, dim_v(), [&](auto const& kl, auto const&) {
      for (Index b = 0; b < c.e.batch; ++b)
        for (Index h = 0; h < c.e.heads; ++h)
          for (Index t = 0; t < c.e.tokens; ++t)
            if (tab.addressable(b, h, t))
              out[static_cast<std::size_t>(position_slot(kl, b, h, t))] =
                  c.positions[static_cast<std::size_t>((b * c.e.heads + h) * c.e.tokens + t)];
    });
    return out;
  }

  explicit Mirror(Case const& cs)
      : c(cs),
        tab(cs),
        k(place(cs.k, true)),
        v(place(cs.v, false)),
        q(narrow<T>(cs.queries)),
        lengths(cs.lengths),
        positions(place_positions()),
        query_positions(cs.query_positions),
        offsets(tab.offsets),
        table(tab.table),
        indptr(tab.indptr),
        indices(tab.indices),
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
    Index* pos = positions.get_or_null(!c.positions.empty());
    return tab.layouts(c.e.dim, dim_v(), table.ptr, indptr.ptr, indices.ptr, offsets.ptr,
                       [&](auto const& kl, auto const& vl) -> std::string {
                         using KL = std::remove_cvref_t<decltype(kl)>;
                         return fn(make_cache(TokenRows<T, KL, DeviceSpace>(k.ptr, kl),
                                              TokenRows<T, KL, DeviceSpace>(v.ptr, vl), length_table(), pos));
                       });
  }

  /// K and V back in BHTD fp32, positions and lengths back into a host case (slots without storage: 0).
  void read_back(Case& out) {
    std::vector<T> kd, vd;
    k.to_host(kd);
    v.to_host(vd);
    auto const kf = widen(kd), vf = widen(vd);
    std::vector<Index> pd;
    if (!c.positions.empty())
      positions.to_host(pd);
    KVExtents const e = c.e;
    std::vector<float> ko(static_cast<std::size_t>(e.rows() * e.dim), 0.0f),
        vo(static_cast<std::size_t>(e.rows() * dim_v()), 0.0f);
    std::vector<Index> po(pd.empty() ? 0 : static_cast<std::size_t>(e.rows()), 0);
    tab.host_layouts(e.dim, dim_v(), [&](auto const& kl, auto const& vl) {
      for (Index b = 0; b < e.batch; ++b)
        for (Index h = 0; h < e.heads; ++h)
          for (Index t = 0; t < e.tokens; ++t) {
            if (!tab.addressable(b, h, t))
              continue;
            Index const row = (b * e.heads + h) * e.tokens + t;
            for (Index i = 0; i < e.dim; ++i)
              ko[static_cast<std::size_t>(row * e.dim + i)] = kf[static_cast<std::size_t>(kl.offset(b, h, t) + i)];
            for (Index i = 0; i < dim_v(); ++i)
              vo[static_cast<std::size_t>(row * dim_v() + i)] = vf[static_cast<std::size_t>(vl.offset(b, h, t) + i)];
            if (!pd.empty())
              po[static_cast<std::size_t>(row)] = pd[static_cast<std::size_t>(position_slot(kl, b, h, t))];
          }
    });
    out.k = std::move(ko);
    out.v = std::move(vo);
    if (!c.positions.empty())
      out.positions = std::move(po);
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

/// A BHTD case's K and V stored on the device as fp8 F8 under per-(sequence, KV head) scales [B, Hkv] (kvc::store),
/// beside the fp32 mirror of everything else (tables, queries, RoPE).
template <class F8>
struct Fp8Mirror : Mirror<float> {
  DeviceBuffer<F8> k8, v8;
  DeviceBuffer<float> k_scale, v_scale;

  Fp8Mirror(Case const& cs, std::vector<float> const& ks, std::vector<float> const& vs)
      : Mirror<float>(cs),
        k8(Scenario{}.stored<F8>(cs.k, ks)),
        v8(Scenario{}.stored<F8>(cs.v, vs)),
        k_scale(ks),
        v_scale(vs) {}

  template <class Fn>
  std::string with_cache(Fn&& fn) {
    KVExtents const ve{c.e.batch, c.e.heads, c.e.tokens, dim_v()};
    return fn(make_cache(bhtd_device_rows(k8.ptr, c.e, sequence_head_scales(k_scale.ptr, c.e.heads)),
                         bhtd_device_rows(v8.ptr, ve, sequence_head_scales(v_scale.ptr, c.e.heads)), length_table(),
                         positions.get_or_null(!c.positions.empty())));
  }
};

/// fn(mirror) over an Fp8Mirror of the case in `format` (e4m3 or e5m2); an error for a case that is not BHTD fp32 or
/// scales that are not one per (sequence, KV head).
template <class Fn>
std::string with_fp8_mirror(Case const& c, CacheFormat format, std::vector<float> const& k_scales,
                            std::vector<float> const& v_scales, Fn&& fn) {
  if (c.layout != Layout::bhtd || c.dtype != Dtype::f32 ||
      k_scales.size() != static_cast<std::size_t>(c.e.batch * c.e.heads) || v_scales.size() != k_scales.size())
    return "fp8 wrappers: a BHTD fp32 case and one K and V scale per (sequence, KV head)";
  if (format == CacheFormat::e4m3) {
    Fp8Mirror<float8_e4m3> m(c, k_scales, v_scales);
    return fn(m);
  }
  if (format == CacheFormat::e5m2) {
    Fp8Mirror<float8_e5m2> m(c, k_scales, v_scales);
    return fn(m);
  }
  return "fp8 wrappers: an fp8 format (e4m3 or e5m2)";
}

/// Scores of `scorer` over a mirror's cache (Mirror or Fp8Mirror) into `out`.
template <class S, class M>
std::string score_with(S scorer, M& m, std::vector<float>& out) {
  Case const& c = m.c;
  DeviceBuffer<float> o(static_cast<std::size_t>(c.e.rows()));
  std::string const err = m.with_cache([&](auto const& cache) {
    ScoreSpan<DeviceSpace> const span{o.ptr, c.e.batch, c.e.heads, c.e.tokens};
    if constexpr (has_need(S::needs, Needs::window_queries)) {
      auto const obs = observe(m.window());
      std::size_t const bytes = score_workspace_bytes(dev(), scorer, c.e, obs);
      DeviceBuffer<unsigned char> ws(bytes);
      return finish(score(dev(), scorer, cache, obs, span, Workspace{ws.ptr, bytes}));
    } else {
      std::size_t const bytes = score_workspace_bytes(dev(), scorer, c.e);
      DeviceBuffer<unsigned char> ws(bytes);
      return finish(score(dev(), scorer, cache, NoObservations{}, span, Workspace{ws.ptr, bytes}));
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

/// The named policy's scores over a mirror (see scores() in cuda_kernels.hpp).
template <class M>
std::string named_scores(std::string const& policy, M& m, std::vector<float>& out) {
  Index const w = m.c.q_ext.tokens;
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
}

std::string scores(std::string const& policy, Case const& c, std::vector<float>& out) {
  return by_dtype(c.dtype, [&](auto tag) {
    Mirror<decltype(tag)> m(c);
    return named_scores(policy, m, out);
  });
}

std::string fp8_scores(std::string const& policy, Case const& c, CacheFormat format, std::vector<float> const& k_scales,
                       std::vector<float> const& v_scales, std::vector<float>& out) {
  return with_fp8_mirror(c, format, k_scales, v_scales, [&](auto& m) { return named_scores(policy, m, out); });
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
      return finish(kvc::attend(dev(), Attention{}, q, cache, AttendOutput<DeviceSpace>{o.ptr, l.ptr}, Workspace{}));
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
    std::size_t const bytes = select_workspace_bytes(dev(), sel, batch, heads, tokens);
    DeviceBuffer<unsigned char> ws(bytes);
    return finish(select(dev(), sel, span, plan, Workspace{ws.ptr, bytes}));
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
  std::string const err = finish(select(dev(), sel, ScoreSpan<DeviceSpace>{s.ptr, batch, heads, tokens},
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
    std::size_t const bytes = select_workspace_bytes(dev(), sel, c.batch, c.heads, c.tokens);
    DeviceBuffer<unsigned char> ws(bytes);
    std::string err = finish(allocate(dev(), sel, span, tab.ptr, Workspace{ws.ptr, bytes}));
    if (err.empty())
      err = finish(select(dev(), sel, span, plan, Workspace{ws.ptr, bytes}));
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
    std::string err = m.with_cache([&](auto const& src) { return finish(kvc::gather(dev(), plan, src, store)); });
    if (err.empty())
      err = x.with_cache([&](auto const& add) { return finish(kvc::append(dev(), store, add)); });
    DeviceBuffer<float> o(static_cast<std::size_t>(c.q_ext.rows() * dv)), l(static_cast<std::size_t>(c.q_ext.rows()));
    if (err.empty()) {
      AttendQueries<T, DeviceSpace> const q{
          TokenRows<T const, StridedLayout, DeviceSpace>(m.q.ptr, bhtd_layout(c.q_ext))};
      err = finish(kvc::attend(dev(), Attention{}, q, store, AttendOutput<DeviceSpace>{o.ptr, l.ptr}, Workspace{}));
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
    std::string const err = m.with_cache([&](auto const& cache) { return finish(kvc::compact(dev(), plan, cache)); });
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
      return d.with_cache([&](auto const& dst) { return finish(kvc::gather(dev(), plan, src, dst)); });
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
      return s.with_cache([&](auto const& sc) { return finish(kvc::append(dev(), dc, sc, begin, count)); });
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
  std::size_t const bytes = blockwise_workspace_bytes(dev(), press, we);
  DeviceBuffer<unsigned char> ws(bytes);
  std::string const err = s.with_cache([&](auto const& cache) {
    return finish(blockwise_compress(dev(), press, cache, block, work, {ws.ptr, bytes}));
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
    std::size_t const bytes = query_statistics_workspace_bytes(dev(), q_ext);
    DeviceBuffer<unsigned char> ws(bytes);
    std::string const err = finish(kvc::query_statistics(
        dev(), TokenRows<T const, StridedLayout, DeviceSpace>(q.ptr, layout), pos.get_or_null(!positions.empty()), sel,
        mu.ptr, covariance ? sigma.ptr : nullptr, Workspace{ws.ptr, bytes}));
    mu.to_host(mean);
    if (covariance)
      sigma.to_host(cov);
    return err;
  });
}

/// ExpectedAttention's scores over a mirror's cache (Mirror or Fp8Mirror).
template <class M>
std::string ea_scores(M& m, EAInputs const& in, std::vector<float>& out) {
  Case const& c = m.c;
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
    std::size_t const bytes = score_workspace_bytes(dev(), in.scorer, c.e, obs);
    DeviceBuffer<unsigned char> ws(bytes);
    return finish(score(dev(), in.scorer, cache, obs, ScoreSpan<DeviceSpace>{o.ptr, c.e.batch, c.e.heads, c.e.tokens},
                        Workspace{ws.ptr, bytes}));
  });
  o.to_host(out);
  return err;
}

std::string expected_attention(Case const& c, EAInputs const& in, std::vector<float>& out) {
  return by_dtype(c.dtype, [&](auto tag) {
    Mirror<decltype(tag)> m(c);
    return ea_scores(m, in, out);
  });
}

std::string fp8_expected_attention(Case const& c, CacheFormat format, std::vector<float> const& k_scales,
                                   std::vector<float> const& v_scales, EAInputs const& in, std::vector<float>& out) {
  return with_fp8_mirror(c, format, k_scales, v_scales, [&](auto& m) { return ea_scores(m, in, out); });
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
              [&](auto const& sc) { return finish(kvc::append(dev(), cache, sc, 0, step.append.e.tokens)); });
          if (!err.empty())
            return "append: " + err;
        }
        std::string err;
        if (!step.columns.empty()) {
          DeviceBuffer<float> cols(step.columns);
          auto const obs = observe(AttentionColumnSums<DeviceSpace>{cols.ptr, e.batch, step.column_heads, e.tokens, 1});
          std::size_t const bytes = update_workspace_bytes(dev(), scorer, e, obs);
          DeviceBuffer<unsigned char> ws(bytes);
          err = finish(update(dev(), scorer, cache, obs, Workspace{ws.ptr, bytes}));
        } else {
          DeviceBuffer<T> q(narrow<T>(step.queries));
          WindowQueries<T, DeviceSpace> const wq{
              TokenRows<T const, StridedLayout, DeviceSpace>(q.ptr, bhtd_layout(step.q_ext)), m.rope_table(), nullptr};
          auto const obs = observe(wq);
          std::size_t const bytes = update_workspace_bytes(dev(), scorer, e, obs);
          DeviceBuffer<unsigned char> ws(bytes);
          err = finish(update(dev(), scorer, cache, obs, Workspace{ws.ptr, bytes}));
        }
        if (!err.empty())
          return "update: " + err;
        H2OResult r;
        acc.to_host(r.acc);
        tracked.to_host(r.tracked);
        DeviceBuffer<float> o(static_cast<std::size_t>(e.rows()));
        std::size_t const bytes = score_workspace_bytes(dev(), scorer, e);
        DeviceBuffer<unsigned char> ws(bytes);
        err = finish(score(dev(), scorer, cache, ScoreSpan<DeviceSpace>{o.ptr, e.batch, e.heads, e.tokens},
                           Workspace{ws.ptr, bytes}));
        if (!err.empty())
          return "score: " + err;
        o.to_host(r.scores);
        if (!step.count.empty()) {
          DeviceBuffer<Index> idx(step.index), cnt(step.count);
          KeepPlan<DeviceSpace> const plan{idx.ptr, cnt.ptr, e.batch, e.heads, e.tokens};
          err = finish(on_evict(dev(), scorer, cache, plan, Workspace{}));
          if (err.empty())
            err = finish(kvc::compact(dev(), plan, cache, scorer.state.accumulated));
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
              [&](auto const& sc) { return finish(kvc::append(dev(), cache, sc, 0, step.append.e.tokens)); });
          if (!err.empty())
            return "append: " + err;
        }
        if (!step.queries.empty()) {
          DeviceBuffer<T> q(narrow<T>(step.queries));
          WindowQueries<T, DeviceSpace> const wq{
              TokenRows<T const, StridedLayout, DeviceSpace>(q.ptr, bhtd_layout(step.q_ext)), m.rope_table(), nullptr};
          auto const obs = observe(wq);
          std::size_t const bytes = update_workspace_bytes(dev(), scorer, e, obs);
          DeviceBuffer<unsigned char> ws(bytes);
          std::string const err = finish(update(dev(), scorer, cache, obs, Workspace{ws.ptr, bytes}));
          if (!err.empty())
            return "update: " + err;
        }
        UNCompResult r;
        rows.to_host(r.rows);
        tracked.to_host(r.tracked);
        DeviceBuffer<float> o(static_cast<std::size_t>(e.rows()));
        {
          std::size_t const bytes = score_workspace_bytes(dev(), scorer, e);
          DeviceBuffer<unsigned char> ws(bytes);
          std::string const err =
              finish(score(dev(), scorer, cache, ScoreSpan<DeviceSpace>{o.ptr, e.batch, e.heads, e.tokens},
                           Workspace{ws.ptr, bytes}));
          if (!err.empty())
            return "score: " + err;
        }
        o.to_host(r.scores);
        if (!step.count.empty()) {
          std::size_t const bytes = select_workspace_bytes(dev(), sel, e.batch, e.heads, e.tokens);
          DeviceBuffer<unsigned char> ws(bytes);
          DeviceBuffer<float> cpu_scores(step.cpu_scores);
          DeviceBuffer<Index> table(static_cast<std::size_t>(e.batch * e.heads)),
              idx(static_cast<std::size_t>(e.rows())), cnt(static_cast<std::size_t>(e.batch * e.heads)),
              idx_cpu(static_cast<std::size_t>(e.rows())), cnt_cpu(static_cast<std::size_t>(e.batch * e.heads));
          ScoreSpan<DeviceSpace> const mine{o.ptr, e.batch, e.heads, e.tokens, cache.lengths};
          ScoreSpan<DeviceSpace> const theirs{cpu_scores.ptr, e.batch, e.heads, e.tokens, cache.lengths};
          std::string err = finish(kvc::allocate(dev(), sel, mine, table.ptr, Workspace{ws.ptr, bytes}));
          if (err.empty())
            err = finish(kvc::select(dev(), sel, mine,
                                     KeepPlan<DeviceSpace>{idx.ptr, cnt.ptr, e.batch, e.heads, e.tokens},
                                     Workspace{ws.ptr, bytes}));
          if (err.empty())
            err = finish(kvc::select(dev(), sel, theirs,
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
          err = finish(on_evict(dev(), scorer, cache, plan, Workspace{}));
          if (err.empty())
            tracked.to_host(r.evicted_tracked);
          if (err.empty())
            err = finish(kvc::compact(dev(), plan, cache, scorer.state.window_rows));
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
  std::size_t const bytes = select_workspace_bytes(dev(), sel, batch, heads, tokens);
  DeviceBuffer<unsigned char> ws(bytes);
  std::string err = finish(kvc::allocate(dev(), sel, span, tab.ptr, Workspace{ws.ptr, bytes}));
  if (err.empty())
    err = finish(kvc::select(dev(), sel, span, KeepPlan<DeviceSpace>{idx.ptr, cnt.ptr, batch, heads, tokens},
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
        m.with_cache([&](auto const& cache) { return finish(kvc::compact(dev(), plan, cache, extra)); });
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
      std::size_t const bytes = update_workspace_bytes(dev(), scorer, c.e, NoObservations{});
      DeviceBuffer<unsigned char> ws(bytes);
      return finish(update(dev(), scorer, cache, NoObservations{}, Workspace{ws.ptr, bytes}));
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
      std::size_t const bytes = on_evict_workspace_bytes(dev(), scorer, c.e);
      DeviceBuffer<unsigned char> ws(bytes);
      return finish(on_evict(dev(), scorer, cache, plan, Workspace{ws.ptr, bytes}));
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
      std::size_t const bytes = attend_corrected_workspace_bytes(dev(), op, q, cache, dm.view());
      DeviceBuffer<unsigned char> ws(bytes);
      return finish(kvc::attend_corrected(dev(), op, q, cache, dm.view(), AttendOutput<DeviceSpace>{o.ptr, l.ptr},
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
      std::size_t const bytes = moment_kv_prefill_workspace_bytes(dev(), scorer, sel, c.e, obs);
      DeviceBuffer<unsigned char> ws(bytes);
      return finish(kvc::moment_kv_prefill(dev(), scorer, sel, cache, obs, Workspace{ws.ptr, bytes}));
    });
    m.read_back(c);
    dm.read_back(mo);
    return err;
  });
}

StreamScope::StreamScope() : previous_(wrapper_stream) {
  cudaStream_t s = nullptr;
  ok_ = cudaStreamCreate(&s) == cudaSuccess;
  if (ok_)
    wrapper_stream = s;
}

StreamScope::~StreamScope() {
  if (ok_) {
    (void)cudaStreamSynchronize(wrapper_stream);
    (void)cudaStreamDestroy(wrapper_stream);
  }
  wrapper_stream = static_cast<cudaStream_t>(previous_);
}

void reset_op_counts() {
#if defined(KVC_CUDA_EMULATOR)
  ::kvc::emu::reset_counters();
#endif
}

OpCounts op_counts() {
  OpCounts o;
#if defined(KVC_CUDA_EMULATOR)
  auto const n = ::kvc::emu::counters();
  o.available = true;
  o.launches = n.launches;
  o.synchronizations = n.synchronizations;
  o.allocations = n.allocations;
  o.default_stream_ops = n.default_stream_ops;
  o.other_stream_ops = n.other_stream_ops;
#endif
  return o;
}

std::string decode(Case const& c, DecodeRun const& run, bool on_stream, DecodeResult& out) {
  std::optional<StreamScope> scope;
  if (on_stream) {
    scope.emplace();
    if (!scope->ok())
      return "cudaStreamCreate failed";
  }
  out = DecodeResult{};
  return by_dtype(c.dtype, [&](auto tag) -> std::string {
    using T = decltype(tag);
    Mirror<T> m(c);
    KVExtents const e = c.e;
    Index const heads = e.batch * e.heads, dv = m.dim_v(), w = 4;
    DeviceBuffer<T> qd(narrow<T>(run.queries));
    DeviceBuffer<Index> qp(run.query_positions);
    QueryBuffer<T, DeviceSpace> buf{qd.ptr,           qp.ptr,        run.q_ext.batch, run.q_ext.heads,
                                    run.q_ext.tokens, run.q_ext.dim, run.buffered,    0};
    DecodeCounter counter;
    RopeTable<DeviceSpace> const rope = m.rope_table();
    // Scorer state: H2O's accumulator or UNComp's window rows, tracked counts, MomentKV's (empty) moments.
    bool const h2o = run.policy == "h2o", uncomp = run.policy == "uncomp";
    DeviceBuffer<float> state(
        std::vector<float>(static_cast<std::size_t>(h2o ? e.rows() : (uncomp ? e.rows() * w : 0)), 0.0f));
    DeviceBuffer<Index> tracked(std::vector<Index>(static_cast<std::size_t>(heads), 0)), budgets(run.budgets);
    Moments zero;
    zero.count.assign(static_cast<std::size_t>(heads), 0);
    zero.key_mean.assign(static_cast<std::size_t>(heads * e.dim), 0.0f);
    zero.value_mean.assign(static_cast<std::size_t>(heads * dv), 0.0f);
    zero.comoment.assign(static_cast<std::size_t>(heads * e.dim * dv), 0.0f);
    DeviceMoments<float> const moments(c, zero);
    DeviceResiduals const residuals(c, Residuals{});
    auto steps = [&](auto const& scorer, auto const& selector) {
      return m.with_cache([&](auto const& cache) -> std::string {
        std::size_t const bytes =
            decode_workspace_bytes(dev(), scorer, selector, run.schedule, cache.keys.extents(), buf);
        DeviceBuffer<unsigned char> ws(bytes);
        for (Index step = 0; step < run.steps; ++step) {
          if (Status const st = buf.push(1); !st.ok())
            return st.message();
          bool compressed = false;
          reset_op_counts();
          Status const st = decode_step(dev(), scorer, selector, run.schedule, cache, buf, counter, rope,
                                        Workspace{ws.ptr, bytes}, &compressed);
          out.counts.push_back(op_counts());
          if (!st.ok())
            return "step " + std::to_string(step) + ": " + st.message();
          out.compressed.push_back(compressed ? 1 : 0);
        }
        return finish(Status{});
      });
    };
    std::string err;
    auto const top_k = run.schedule.selector();
    if (run.policy == "knorm")
      err = steps(KnormScorer{}, top_k);
    else if (run.policy == "snap_kv")
      err = steps(SnapKVScorer{.window_size = w, .kernel_size = 3}, top_k);
    else if (run.policy == "tova")
      err = steps(TOVAScorer{}, top_k);
    else if (run.policy == "expected_attention")
      err = steps(ExpectedAttentionScorer{}, top_k);
    else if (h2o)
      err = steps(H2OScorer<DeviceSpace>{{{state.ptr, e.batch, e.heads, e.tokens}, tracked.ptr}, 5}, top_k);
    else if (run.policy == "moment_kv")
      err = steps(device_moment_scorer(MomentKVScorer<>{}, moments, residuals).decode(), top_k);
    else if (uncomp)
      err = steps(
          UNCompScorer<DeviceSpace>{
              {TokenRows<float, StridedLayout, DeviceSpace>(state.ptr, uncomp_window_layout(e, w)), tracked.ptr},
              w,
              3,
              Pooling::max},
          UNCompSelector<DeviceSpace>{HeadBudgets<DeviceSpace>{budgets.ptr, e.heads}, 0, w});
    else
      return "unknown policy " + run.policy;
    out.cache = c;
    m.read_back(out.cache);
    if (h2o || uncomp) {
      state.to_host(out.state);
      tracked.to_host(out.tracked);
    }
    if (run.policy == "moment_kv") {
      Moments got;
      moments.read_back(got);
      out.tracked = got.count;
      out.key_mean = got.key_mean;
    }
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
  if (Status const st = to_device(dev(), kv, arena.ptr, arena.n, table.ptr, heads, view); !st.ok())
    return st.message();
  std::string const err = by_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    DeviceBuffer<T> q(narrow<T>(queries));
    AttendQueries<T, DeviceSpace> const aq{TokenRows<T const, StridedLayout, DeviceSpace>(q.ptr, bhtd_layout(q_ext)),
                                           positions.empty() ? nullptr : pos.ptr};
    Attention op;
    op.causal = causal;
    return finish(kvc::attend_packed(dev(), op, aq, view, AttendOutput<DeviceSpace>{o.ptr, l.ptr}, Workspace{}));
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
  std::size_t const bytes = allocate_bits_workspace_bytes(dev(), a, e.batch, e.heads, e.tokens, e.dim);
  DeviceBuffer<unsigned char> ws(bytes);
  std::string const err = finish(kvc::allocate_bits(dev(), a, span, cw.ptr, plan, Workspace{ws.ptr, bytes}));
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
      std::size_t const bytes = channel_score_workspace_bytes(dev(), s, c.e, obs);
      DeviceBuffer<unsigned char> ws(bytes);
      return finish(score_channels(dev(), s, cache, obs, o.ptr, Workspace{ws.ptr, bytes}));
    });
    o.to_host(out);
    return err;
  });
}

namespace {

/// Device memory for run_scenario: every block freed on scope exit; copies are synchronous (a test, not an engine).
struct DeviceMemory {
  std::vector<void*> blocks;
  DeviceMemory() = default;
  DeviceMemory(DeviceMemory const&) = delete;
  DeviceMemory& operator=(DeviceMemory const&) = delete;
  ~DeviceMemory() {
    for (cudaGraphExec_t g : graphs)
      if (g)
        cudaGraphExecDestroy(g);
    for (void* p : blocks)
      cudaFree(p);
  }
  template <class T>
  T* alloc(std::size_t n) {
    void* p = nullptr;
    if (cudaMalloc(&p, (n > 0 ? n : 1) * sizeof(T)) != cudaSuccess)
      return nullptr;
    blocks.push_back(p);
    return static_cast<T*>(p);
  }
  template <class T>
  T* upload(std::vector<T> const& x) {
    T* p = alloc<T>(x.size());
    if (p && !x.empty())
      cudaMemcpy(p, x.data(), x.size() * sizeof(T), cudaMemcpyHostToDevice);
    return p;
  }
  template <class T>
  void write(T* p, std::vector<T> const& x) const {
    if (!x.empty())
      cudaMemcpy(p, x.data(), x.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  template <class T>
  std::vector<T> download(T const* p, std::size_t n) const {
    std::vector<T> out(n);
    if (n > 0)
      cudaMemcpy(out.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost);
    return out;
  }
  std::string sync() const { return finish({}); }
  /// CUDA graphs of a plain (kind 0) and a compressing (kind 1) decode step, captured on the wrappers' stream.
  cudaGraphExec_t graphs[2] = {nullptr, nullptr};
  bool captured(int kind) const { return graphs[kind] != nullptr; }
  std::string begin_capture() const {
    cudaError_t const e = cudaStreamBeginCapture(wrapper_stream, cudaStreamCaptureModeGlobal);
    return e == cudaSuccess ? std::string() : std::string("cudaStreamBeginCapture: ") + cudaGetErrorString(e);
  }
  std::string end_capture(int kind) {
    cudaGraph_t graph = nullptr;
    cudaError_t e = cudaStreamEndCapture(wrapper_stream, &graph);
    if (e == cudaSuccess)
      e = cudaGraphInstantiate(&graphs[kind], graph, 0);
    if (graph)
      cudaGraphDestroy(graph);
    return e == cudaSuccess ? std::string() : std::string("capturing a decode step: ") + cudaGetErrorString(e);
  }
  std::string launch(int kind) const {
    cudaError_t const e = cudaGraphLaunch(graphs[kind], wrapper_stream);
    return e == cudaSuccess ? std::string() : std::string("cudaGraphLaunch: ") + cudaGetErrorString(e);
  }
  /// Under the emulator: the synchronisations and allocations of the decode() calls, summed.
  OpCounts at_start{};
  Index synchronizations = 0, allocations = 0;
  void before_decode() { at_start = op_counts(); }
  void after_decode() {
    OpCounts const now = op_counts();
    synchronizations += static_cast<Index>(now.synchronizations - at_start.synchronizations);
    allocations += static_cast<Index>(now.allocations - at_start.allocations);
  }
};

}  // namespace

std::string compressor_scenario(std::string const& policy, ScenarioResult& out, CacheFormat format, bool dequantised,
                                bool graphs) {
  StreamScope scope;  // every call on a stream of its own, as an engine runs a layer
  if (!scope.ok())
    return "cudaStreamCreate failed";
  Scenario sc;
  sc.format = format;
  sc.graphs = graphs;
  DeviceMemory mem;
  std::string const err =
      with_any_scenario_policy<DeviceSpace>(policy, sc, mem, [&](auto const& p, auto const& options) {
        if (format == CacheFormat::e4m3 && !dequantised)
          return run_scenario<float8_e4m3>(dev(), mem, p, options, sc, out);
        if (format == CacheFormat::e5m2 && !dequantised)
          return run_scenario<float8_e5m2>(dev(), mem, p, options, sc, out);
        return run_scenario<float>(dev(), mem, p, options, sc, out);
      });
  if (op_counts().available) {
    out.decode_synchronizations = mem.synchronizations;
    out.decode_allocations = mem.allocations;
  }
  return err;
}

}  // namespace kvc::test::cuda
