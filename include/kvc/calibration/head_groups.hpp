// SPDX-License-Identifier: Apache-2.0
// kvc/calibration/head_groups.hpp: UNComp's offline head grouping (Xiong et al., arXiv 2410.03090, §3.3.1 and
// Alg. 1; decisions A5, A15, A16 in docs/policies/uncomp.md#decisions). Host only, no Eigen, no allocation except in
// EntropyCalibration (which owns its sums and the per-sample labels of the vote).
//
// Within one layer, heads are ranked by their entropy (any strictly monotone unit: H_k, Ĥ_k or erank_k give the same
// groups), highest first, ties to the lower head index, and the ranking is cut into `groups` contiguous balanced
// groups. Group 0 holds the HIGHEST-entropy heads (the paper's g = 1), so it gets the largest budget
// (head_budgets.hpp). Default: the mean over calibration samples, then sort (Eq. 7); option: the authors' greedy
// majority vote over per-sample labels (Alg. 1 / their code).
//
// Balanced sizes (balanced_group_sizes): q = ⌊H/M⌋ heads per group, and the r = H mod M extra heads go to the
// outermost groups in pairs, (0, M−1), (1, M−2), …; when r is odd the last one goes to the middle group (M odd) or to
// group ⌊r/2⌋ (M even). The sizes are symmetric (n_g = n_{M−1−g}) unless r is odd and M even, which keeps the
// budget-preserving centre c = Σ_g n_g g / H at (M+1)/2, and they reproduce the authors' hard-coded 11/10/11 (M = 3,
// H = 32) and 7/6/6/6/7 (M = 5, H = 32). M > H is allowed: the inner groups are then empty.
#pragma once

#include <kvc/calibration/matrix_entropy.hpp>
#include <kvc/core/extents.hpp>
#include <kvc/core/status.hpp>

#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

namespace kvc {

namespace detail {

/// Size of group g (0-based) of the balanced split of `heads` heads into `groups` groups (the rule above).
/// Requires heads >= 0, groups >= 1, 0 <= g < groups.
constexpr Index balanced_group_size(Index heads, Index groups, Index g) noexcept {
  Index const q = heads / groups, r = heads % groups;
  Index const pairs = r / 2;
  Index const mirror = g < groups - 1 - g ? g : groups - 1 - g;  // distance from the nearer end
  bool extra = mirror < pairs;
  if (r % 2 == 1) {
    Index const odd = groups % 2 == 1 ? groups / 2 : pairs;  // the middle group, or the next from the top
    extra = extra || g == odd;
  }
  return q + (extra ? 1 : 0);
}

/// The group (0-based) holding ranked position p (0 = highest entropy) of the balanced split.
constexpr Index balanced_group_of_rank(Index heads, Index groups, Index p) noexcept {
  Index start = 0;
  for (Index g = 0; g < groups; ++g) {
    start += balanced_group_size(heads, groups, g);
    if (p < start)
      return g;
  }
  return groups - 1;
}

constexpr Status check_heads_groups(Index heads, Index groups, char const* message) noexcept {
  if (heads < 1 || groups < 1)
    return {Errc::invalid_argument, message};
  return {};
}

}  // namespace detail

/// Sizes of `groups` balanced groups over `heads` heads: sizes [groups] differ by at most 1 and sum to heads (the
/// symmetric rule in the file comment; group 0 = highest entropy). heads >= 1, groups >= 1.
inline Status balanced_group_sizes(Index heads, Index groups, Index* sizes /*[groups]*/) noexcept {
  KVC_RETURN_IF_ERROR(
      detail::check_heads_groups(heads, groups, "balanced_group_sizes: `heads` and `groups` must be >= 1"));
  if (sizes == nullptr)
    return {Errc::invalid_argument, "balanced_group_sizes: `sizes` must be non-null ([groups])"};
  for (Index g = 0; g < groups; ++g)
    sizes[g] = detail::balanced_group_size(heads, groups, g);
  return {};
}

/// Groups from one layer's per-head entropies [heads] (any strictly monotone unit; finite): heads sorted by entropy
/// descending (ties: lower head index first) and cut into balanced contiguous groups. group_of_head [heads] receives
/// values in [0, groups), 0 = HIGHEST entropy (the paper's g = 1). O(heads²) compares, no allocation.
inline Status group_heads(double const* entropy /*[heads]*/, Index heads, Index groups,
                          Index* group_of_head /*[heads]*/) noexcept {
  KVC_RETURN_IF_ERROR(detail::check_heads_groups(heads, groups, "group_heads: `heads` and `groups` must be >= 1"));
  if (entropy == nullptr || group_of_head == nullptr)
    return {Errc::invalid_argument, "group_heads: `entropy` and `group_of_head` must be non-null ([heads])"};
  for (Index h = 0; h < heads; ++h)
    if (!std::isfinite(entropy[h]))
      return {Errc::non_finite, "group_heads: `entropy` holds NaN or Inf"};
  for (Index h = 0; h < heads; ++h) {
    Index rank = 0;  // heads ranked before h: higher entropy, or equal and a lower index
    for (Index j = 0; j < heads; ++j)
      rank += (entropy[j] > entropy[h] || (entropy[j] == entropy[h] && j < h)) ? 1 : 0;
    group_of_head[h] = detail::balanced_group_of_rank(heads, groups, rank);
  }
  return {};
}

/// The authors' greedy majority vote over samples. labels [samples, heads] (row-major, sample s at
/// labels + s * heads) hold per-sample group labels in [0, groups), 0 = highest entropy (as group_heads gives).
/// For label v = 0, 1, …, groups − 1 in turn, the balanced_group_sizes(heads, groups)[v] still-unassigned heads with
/// the most votes for v (ties: lower head index) form group v. group_of_head [heads] receives values in
/// [0, groups). O(heads² · samples), no allocation. samples >= 1.
inline Status majority_vote_groups(Index const* labels /*[samples, heads]*/, Index samples, Index heads, Index groups,
                                   Index* group_of_head /*[heads]*/) noexcept {
  KVC_RETURN_IF_ERROR(
      detail::check_heads_groups(heads, groups, "majority_vote_groups: `heads` and `groups` must be >= 1"));
  if (samples < 1)
    return {Errc::invalid_argument, "majority_vote_groups: `samples` must be >= 1"};
  if (labels == nullptr || group_of_head == nullptr)
    return {Errc::invalid_argument, "majority_vote_groups: `labels` and `group_of_head` must be non-null"};
  for (Index i = 0; i < samples * heads; ++i)
    if (labels[i] < 0 || labels[i] >= groups)
      return {Errc::invalid_argument, "majority_vote_groups: every entry of `labels` must be in [0, groups)"};
  auto votes = [&](Index h, Index v) {
    Index count = 0;
    for (Index s = 0; s < samples; ++s)
      count += labels[s * heads + h] == v ? 1 : 0;
    return count;
  };
  for (Index h = 0; h < heads; ++h)
    group_of_head[h] = -1;  // unassigned
  for (Index v = 0; v < groups; ++v) {
    for (Index taken = 0; taken < detail::balanced_group_size(heads, groups, v); ++taken) {
      Index best = -1, best_votes = -1;
      for (Index h = 0; h < heads; ++h) {  // first maximum: ties to the lower index
        if (group_of_head[h] >= 0)
          continue;
        Index const c = votes(h, v);
        if (c > best_votes) {
          best = h;
          best_votes = c;
        }
      }
      group_of_head[best] = v;
    }
  }
  return {};
}

/// GQA (decision A15): per-KV-head value = the mean over the g = heads / kv_heads query heads of each KV head, query
/// head h belonging to KV head h / g (Hugging Face's repeat_kv layout). Any unit (kvc's calibration uses erank_k).
/// per_query_head [heads], per_kv_head [kv_heads]; heads must be a multiple of kv_heads >= 1.
inline Status reduce_to_kv_heads(double const* per_query_head /*[heads]*/, Index heads, Index kv_heads,
                                 double* per_kv_head /*[kv_heads]*/) noexcept {
  if (heads < 1 || kv_heads < 1 || heads % kv_heads != 0)
    return {Errc::invalid_argument, "reduce_to_kv_heads: `heads` must be a positive multiple of `kv_heads` >= 1"};
  if (per_query_head == nullptr || per_kv_head == nullptr)
    return {Errc::invalid_argument, "reduce_to_kv_heads: `per_query_head` and `per_kv_head` must be non-null"};
  Index const g = heads / kv_heads;
  for (Index k = 0; k < kv_heads; ++k) {
    double sum = 0.0;
    for (Index i = 0; i < g; ++i)
      sum += per_query_head[k * g + i];
    per_kv_head[k] = sum / static_cast<double>(g);
  }
  return {};
}

/// Accumulates per-(layer, head) entropies over calibration samples and the per-sample group labels for the vote.
/// Means are running sums in sample order divided by the count (the order changes them by round-off only). Each
/// add() also stores that sample's labels, group_heads of its Ĥ_k ([samples, heads] Index per layer), for the vote.
class EntropyCalibration {
 public:
  /// layers, heads, groups >= 1 (otherwise every add() and groups() returns an error).
  EntropyCalibration(Index layers, Index heads, Index groups)
      : layers_(layers),
        heads_(heads),
        groups_(groups),
        count_(size(layers)),
        normalized_(size(layers) * size(heads)),
        erank_(normalized_.size()),
        truncated_(normalized_.size()),
        labels_(size(layers)),
        scratch_(size(heads)),
        scratch_labels_(size(heads)) {}

  Index layers() const noexcept { return layers_; }
  Index heads() const noexcept { return heads_; }
  Index group_count() const noexcept { return groups_; }

  /// One sample's layer: per_head [heads] entropies of that layer's heads (finite). Call once per layer per sample.
  Status add(Index layer, MatrixEntropy const* per_head /*[heads]*/) {
    KVC_RETURN_IF_ERROR(check_shape());
    if (layer < 0 || layer >= layers_)
      return {Errc::invalid_argument, "EntropyCalibration::add: `layer` must be in [0, layers)"};
    if (per_head == nullptr)
      return {Errc::invalid_argument, "EntropyCalibration::add: `per_head` must be non-null ([heads])"};
    for (Index h = 0; h < heads_; ++h) {
      MatrixEntropy const& e = per_head[h];
      if (!std::isfinite(e.normalized) || !std::isfinite(e.erank) || !std::isfinite(e.truncated))
        return {Errc::non_finite, "EntropyCalibration::add: `per_head` holds NaN or Inf"};
      scratch_[at(h)] = e.normalized;
    }
    KVC_RETURN_IF_ERROR(group_heads(scratch_.data(), heads_, groups_, scratch_labels_.data()));
    for (Index h = 0; h < heads_; ++h) {
      std::size_t const i = cell(layer, h);
      normalized_[i] += per_head[h].normalized;
      erank_[i] += per_head[h].erank;
      truncated_[i] += per_head[h].truncated;
    }
    auto& labels = labels_[at(layer)];
    labels.insert(labels.end(), scratch_labels_.begin(), scratch_labels_.end());
    ++count_[at(layer)];
    return {};
  }

  /// Samples added to `layer` (0 for an out-of-range layer).
  Index samples(Index layer) const noexcept { return valid_layer(layer) ? count_[at(layer)] : 0; }
  /// Means over the samples of Ĥ_k, erank_k (Eq. 7) and H_k; NaN before the first sample or out of range.
  double mean_normalized(Index layer, Index head) const noexcept { return mean(normalized_, layer, head); }
  double mean_erank(Index layer, Index head) const noexcept { return mean(erank_, layer, head); }
  double mean_truncated(Index layer, Index head) const noexcept { return mean(truncated_, layer, head); }

  /// The layer's groups into group_of_head [heads] (0 = highest entropy): group_heads of the mean erank_k (Eq. 7, the
  /// default), or with `majority_vote` the authors' vote over the stored per-sample labels. Needs >= 1 sample.
  Status groups(Index layer, bool majority_vote, Index* group_of_head /*[heads]*/) const {
    KVC_RETURN_IF_ERROR(check_shape());
    if (!valid_layer(layer))
      return {Errc::invalid_argument, "EntropyCalibration::groups: `layer` must be in [0, layers)"};
    if (count_[at(layer)] < 1)
      return {Errc::invalid_argument, "EntropyCalibration::groups: the layer has no sample yet"};
    if (majority_vote)
      return majority_vote_groups(labels_[at(layer)].data(), count_[at(layer)], heads_, groups_, group_of_head);
    std::vector<double> means(size(heads_));
    for (Index h = 0; h < heads_; ++h)
      means[at(h)] = mean_erank(layer, h);
    return group_heads(means.data(), heads_, groups_, group_of_head);
  }

 private:
  static std::size_t size(Index n) noexcept { return n > 0 ? static_cast<std::size_t>(n) : 0; }
  static std::size_t at(Index i) noexcept { return static_cast<std::size_t>(i); }
  std::size_t cell(Index layer, Index head) const noexcept { return at(layer * heads_ + head); }
  bool valid_layer(Index layer) const noexcept { return layer >= 0 && layer < layers_; }

  Status check_shape() const noexcept {
    if (layers_ < 1 || heads_ < 1 || groups_ < 1)
      return {Errc::invalid_argument, "EntropyCalibration: `layers`, `heads` and `groups` must be >= 1"};
    return {};
  }

  double mean(std::vector<double> const& sums, Index layer, Index head) const noexcept {
    if (!valid_layer(layer) || head < 0 || head >= heads_ || count_[at(layer)] < 1)
      return std::numeric_limits<double>::quiet_NaN();
    return sums[cell(layer, head)] / static_cast<double>(count_[at(layer)]);
  }

  Index layers_, heads_, groups_;
  std::vector<Index> count_;                            ///< [layers] samples added
  std::vector<double> normalized_, erank_, truncated_;  ///< [layers, heads] sums over samples
  std::vector<std::vector<Index>> labels_;              ///< [layers][samples, heads] per-sample group labels
  std::vector<double> scratch_;                         ///< [heads] one sample's Ĥ_k
  std::vector<Index> scratch_labels_;                   ///< [heads] its labels
};

}  // namespace kvc
