// SPDX-License-Identifier: Apache-2.0
// tools/common/synthetic.hpp: deterministic random numbers and owned host caches for tests, benchmarks, tools and
// the demo; plus the demo's documented synthetic cache. Not part of the library API.
#pragma once

#include <kvc/core/element.hpp>
#include <kvc/core/kv_view.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvc::tools {

/// SplitMix64: tiny, fast, identical on every platform (std distributions are implementation-defined).
class Rng {
 public:
  explicit Rng(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  /// Uniform in [0, 1).
  double uniform() { return static_cast<double>(next() >> 11) * 0x1p-53; }
  /// Standard normal (Box-Muller).
  float normal() {
    double const u = 1.0 - uniform(), v = uniform();
    return static_cast<float>(std::sqrt(-2.0 * std::log(u)) * std::cos(6.283185307179586 * v));
  }

 private:
  std::uint64_t state_;
};

/// `n` standard normal values times `scale`, rounded to element type T (deterministic for a seed).
template <class T = float>
std::vector<T> random_values(Index n, std::uint64_t seed, float scale = 1.0f) {
  Rng rng(seed);
  std::vector<T> out(static_cast<std::size_t>(n));
  for (T& x : out)
    x = from_float<T>(scale * rng.normal());
  return out;
}

/// An owned contiguous BHTD host cache of element type T (keys [B, H, N, d_k], values [B, H, N, d_v]).
template <class T>
struct HostCache {
  KVExtents ext;
  Index dim_v = 0;
  std::vector<T> k, v;
  std::vector<Index> lengths;    ///< empty = every head holds ext.tokens; [batch] per sequence; [batch*heads] per head
  std::vector<Index> positions;  ///< empty = identity; else [batch, heads, tokens]
  bool per_head = false;         ///< lengths is [batch, heads] (else [batch])

  HostCache() = default;
  explicit HostCache(KVExtents e, Index dv = -1)
      : ext(e),
        dim_v(dv < 0 ? e.dim : dv),
        k(static_cast<std::size_t>(e.rows() * e.dim)),
        v(static_cast<std::size_t>(e.rows() * dim_v)) {}
  /// A cache with K and V filled with standard normal values.
  static HostCache random(KVExtents e, std::uint64_t seed, Index dv = -1) {
    HostCache c(e, dv);
    Rng rng(seed);
    for (T& x : c.k)
      x = from_float<T>(rng.normal());
    for (T& x : c.v)
      x = from_float<T>(rng.normal());
    return c;
  }

  /// Gives the cache a per-head length table (every head holding `length` tokens) and identity positions, as an
  /// engine's working cache has; `length` 0 makes an empty cache to append into.
  HostCache& track(Index length) {
    lengths.assign(static_cast<std::size_t>(ext.batch * ext.heads), length);
    per_head = true;
    positions.resize(static_cast<std::size_t>(ext.rows()));
    for (std::size_t i = 0; i < positions.size(); ++i)
      positions[i] = static_cast<Index>(i) % ext.tokens;
    return *this;
  }
  /// Positions of head (b, h)'s valid slots.
  std::vector<Index> head_positions(Index b, Index h) const {
    auto const first = positions.begin() + (b * ext.heads + h) * ext.tokens;
    return {first, first + length_table().at(b, h, ext.tokens)};
  }

  KVExtents value_extents() const { return {ext.batch, ext.heads, ext.tokens, dim_v}; }
  /// The length table the vectors describe (the view is shallow, so a const cache still hands out Index*).
  Lengths length_table() const {
    auto* data = const_cast<Index*>(lengths.data());
    if (lengths.empty())
      return {};
    return per_head ? head_lengths(data, ext.heads) : Lengths(data);
  }
  Index* positions_or_null() const { return positions.empty() ? nullptr : const_cast<Index*>(positions.data()); }
  auto view() {
    return make_cache(bhtd_rows(k.data(), ext), bhtd_rows(v.data(), value_extents()), length_table(),
                      positions_or_null());
  }
  auto view() const {
    return make_cache(bhtd_rows(k.data(), ext), bhtd_rows(v.data(), value_extents()), length_table(),
                      positions_or_null());
  }
  T* key(Index b, Index h, Index t) { return k.data() + ((b * ext.heads + h) * ext.tokens + t) * ext.dim; }
};

/// The demo's synthetic cache: a documented toy with the structure real heads show (docs/demo.md).
///  - keys: every KV head h has a mean direction m_h; k_t = 4 m_h + N(0, 1) noise per channel (keys cluster
///    around their mean, as KeyDiff's App. C observes);
///  - the first 4 tokens are attention sinks: k = 8 s_h with their own direction s_h;
///  - every 37th token is a "heavy hitter": it also carries 10 u_h along the head's query direction u_h;
///  - values: N(0, 1);
///  - queries (post-RoPE, [B, H, Nq, d], query head q reads KV head q / group): 4 u_h + 1.5 s_h - m_h + N(0, 0.5^2):
///    the mean query points away from the mean key, a heavy hitter's logit is ~5 above an ordinary token's and a
///    sink's ~2 above, so most attention mass sits on ~3% of the tokens, as in real long-context heads.
/// A toy: it rewards keeping distinctive keys by construction. Use --dump with real data for real conclusions.
struct SyntheticCache {
  HostCache<float> cache;
  std::vector<float> queries;
  KVExtents query_ext;
};

inline SyntheticCache make_synthetic(KVExtents e, Index query_heads, Index n_queries, std::uint64_t seed) {
  SyntheticCache s{HostCache<float>(e),
                   std::vector<float>(static_cast<std::size_t>(e.batch * query_heads * n_queries * e.dim)),
                   {e.batch, query_heads, n_queries, e.dim}};
  Rng rng(seed);
  auto unit = [&](std::vector<float>& u) {
    double n2 = 0;
    for (float& x : u) {
      x = rng.normal();
      n2 += double{x} * x;
    }
    for (float& x : u)
      x = static_cast<float>(x / std::sqrt(n2));
  };
  auto const d = static_cast<std::size_t>(e.dim);
  std::vector<float> m(d), sink(d), u(d);
  Index const group = query_heads / e.heads;
  for (Index b = 0; b < e.batch; ++b)
    for (Index h = 0; h < e.heads; ++h) {
      unit(m);
      unit(sink);
      unit(u);
      for (Index t = 0; t < e.tokens; ++t) {
        float* k = s.cache.key(b, h, t);
        for (std::size_t i = 0; i < d; ++i) {
          k[i] = t < 4 ? 8.0f * sink[i] : 4.0f * m[i] + rng.normal();
          if (t >= 4 && t % 37 == 0)
            k[i] += 10.0f * u[i];
        }
      }
      for (Index g = 0; g < group; ++g)
        for (Index i = 0; i < n_queries; ++i) {
          float* q = s.queries.data() + (((b * query_heads + h * group + g) * n_queries + i) * e.dim);
          for (std::size_t c = 0; c < d; ++c)
            q[c] = 4.0f * u[c] + 1.5f * sink[c] - m[c] + 0.5f * rng.normal();
        }
    }
  for (float& x : s.cache.v)
    x = rng.normal();
  return s;
}

}  // namespace kvc::tools
