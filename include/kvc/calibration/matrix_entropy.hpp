// SPDX-License-Identifier: Apache-2.0
// kvc/calibration/matrix_entropy.hpp: the truncated matrix entropy of a head's token rows (UNComp, Xiong et al.,
// arXiv 2410.03090, §3.2, Eq. 1-6; the authors' uncomp/utils/entropy_utils.py). CPU only, fp64, Eigen: it is
// computed offline on calibration text (kvc calibrate), never at inference, so no CUDA kernel exists
// (docs/policies/uncomp.md).
//
// For rows X [n, d] (one head's post-RoPE queries):
//   R = X − 1 x̄ᵀ (centred over tokens)
//   normalize_rows (default, the authors' code): z_j = r_j / ‖r_j‖ (rows with ‖r_j‖ = 0 are skipped), A = ZᵀZ / n;
//   otherwise the paper's covariance A = RᵀR / (n − 1) (the factor cancels below).
//   λ_1 ≥ … ≥ λ_d: eigenvalues of A / Tr(A), negatives from round-off clamped to 0, then + ridge (the code's 1e-10;
//   0 by default, so Σλ = 1 exactly and rank-deficient inputs give exact zeros).
//   H_k = −Σ_{i<k} λ_i ln λ_i (0 ln 0 = 0; the top k are not renormalised unless renormalize_topk), H = the same over
//   all d, erank_k = exp(H_k), Ĥ_k = H_k / ln d (the unit the authors' files store).
// When every centred row is zero (n = 1, constant rows) the spectrum is empty: H_k = H = 0, erank = 1, no NaN.
//
// Cost: one pass for the mean, then A accumulated in fp64 over tiles of `tile_rows` rows (a SYRK, half a GEMM:
// n d² multiply-adds), then one d × d symmetric eigensolve (eigenvalues only, O(d³)). When n < d the n × n Gram
// matrix Z Zᵀ / n has the same nonzero spectrum and is solved instead (Gram::automatic). The solver object owns
// its buffers (sized at construction), so a calibration loop over heads allocates nothing per head.
#pragma once

#include <kvc/backend/cpu/detail/widen.hpp>
#include <kvc/core/element.hpp>
#include <kvc/core/extents.hpp>
#include <kvc/core/params.hpp>
#include <kvc/core/rope.hpp>
#include <kvc/core/status.hpp>

#include <Eigen/Core>
#include <Eigen/Eigenvalues>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

namespace kvc {

/// Which matrix's eigenvalues are solved: the d × d second moment, or the n × n Gram matrix (same nonzero
/// spectrum). `automatic` picks the smaller.
enum class Gram : std::uint8_t { automatic, features, tokens };

/// Options of the truncated matrix entropy (decisions A1–A4 in docs/policies/uncomp.md#decisions).
struct MatrixEntropyOptions {
  Index top_k = 0;  ///< k, leading eigenvalues kept; 0 = d / 4 (at least 1: the paper's 32 at d = 128, A4); clamped
                    ///< to min(n, d)
  bool normalize_rows = true;     ///< the authors' centred, row-L2-normalised second moment; false: Eq. 1's covariance
  bool renormalize_topk = false;  ///< divide the top k by their sum (isotropic then gives ln k, not (k/d) ln d)
  double ridge = 0.0;             ///< added to every normalised eigenvalue (the authors' code: 1e-10)
  Gram gram = Gram::automatic;
  Index tile_rows = 256;  ///< rows per fp64 rank update (bounds the solver's buffer)

  /// The parameters the tools expose (core/params.hpp; top_k's `auto` is the tools' spelling of 0). The tools take
  /// ridge up to 0.5 (an eigenvalue floor near 1 is no longer a ridge).
  static constexpr auto parameters() noexcept {
    using O = MatrixEntropyOptions;
    return std::tuple{
        flag_param("normalize_rows", &O::normalize_rows,
                   "true: the authors' centred, row-L2-normalised second moment; false: Eq. 1's covariance"),
        flag_param("renormalize_topk", &O::renormalize_topk,
                   "true: the top k eigenvalues divided by their sum (isotropic gives ln k)"),
        number_param("ridge", &O::ridge, 0.0, 0.5,
                     "added to every normalised eigenvalue (the authors' code: 1e-10), in [0, 0.5]")};
  }

  constexpr Status check() const noexcept {
    if (top_k < 0)
      return {Errc::invalid_argument, "MatrixEntropyOptions: `top_k` must be >= 0 (0: head dim / 4)"};
    if (!(ridge >= 0.0 && ridge < 1.0))
      return {Errc::invalid_argument, "MatrixEntropyOptions: `ridge` must be in [0, 1)"};
    if (tile_rows < 1)
      return {Errc::invalid_argument, "MatrixEntropyOptions: `tile_rows` must be >= 1"};
    return {};
  }
};

/// The k a head dim `dim` uses: options.top_k, or dim / 4 (at least 1) when it is 0.
constexpr Index resolved_top_k(MatrixEntropyOptions const& options, Index dim) noexcept {
  return options.top_k > 0 ? options.top_k : (dim / 4 > 1 ? dim / 4 : 1);
}

/// The entropies of one matrix (natural log).
struct MatrixEntropy {
  double truncated = 0.0;   ///< H_k
  double full = 0.0;        ///< H (all d eigenvalues)
  double erank = 1.0;       ///< exp(H_k), the truncated effective rank
  double normalized = 0.0;  ///< H_k / ln d (0 when d = 1)
  Index k = 0;              ///< the k used: min(top_k (or d / 4), n, d)
};

/// Computes truncated matrix entropies of [n, d] row blocks in fp64. One object per head dim; reuse it across heads.
class MatrixEntropySolver {
 public:
  using Matrix = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic>;

  explicit MatrixEntropySolver(Index dim, MatrixEntropyOptions options = {})
      : dim_(dim),
        options_(options),
        second_(clamp_size(dim), clamp_size(dim)),
        tile_(clamp_size(options.tile_rows), clamp_size(dim)),
        mean_(clamp_size(dim)),
        row_(clamp_size(dim)),
        values_(clamp_size(dim)),
        solver_(clamp_size(dim)) {}  // bad sizes: compute() errs

  MatrixEntropyOptions const& options() const noexcept { return options_; }

  /// The spectrum of the last successful compute(): [dim] normalised eigenvalues λ_1 ≥ … ≥ λ_d (Σ = 1 + d·ridge),
  /// all zero when the spectrum was empty (no variation). Unspecified after an error.
  Eigen::VectorXd const& spectrum() const noexcept { return values_; }

  /// The entropies of rows [n, dim] of element type T, row r at rows + r * row_stride. With a non-empty `rope`, row
  /// r is first rotated to position positions[r] (or r when `positions` is null): pre-RoPE queries become the
  /// post-RoPE queries the authors measure. Errors name the argument.
  template <Element T>
  Status compute(T const* rows, Index n, Index row_stride, MatrixEntropy& out, RopeTable<HostSpace> const& rope = {},
                 Index const* positions = nullptr) {
    KVC_RETURN_IF_ERROR(options_.check());
    if (dim_ < 1)
      return {Errc::invalid_argument, "matrix entropy: the head dim must be >= 1"};
    if (n < 0 || (n > 0 && rows == nullptr) || (n > 1 && row_stride < dim_))
      return {Errc::invalid_argument, "matrix entropy: rows must be [n >= 0, dim] with a row stride >= dim"};
    for (Index r = 0; r < n && !rope.empty(); ++r) {
      if (positions && positions[r] < 0)
        return {Errc::invalid_argument, "matrix entropy: `positions` must be >= 0"};
      KVC_RETURN_IF_ERROR(check_rope_table(rope, dim_, positions ? positions[r] : r));
    }
    auto load = [&](Index r) {  // row r, widened, rotated, in fp64 into row_
      float f[kMaxStackDim];
      float* x = dim_ <= kMaxStackDim ? f : scratch_float(r);
      detail::widen(rows + r * row_stride, x, dim_);
      if (!rope.empty())
        rope.rotate(x, positions ? positions[r] : r);
      for (Index c = 0; c < dim_; ++c)
        row_[c] = static_cast<double>(x[c]);
    };
    mean_.setZero();
    for (Index r = 0; r < n; ++r) {
      load(r);
      mean_ += row_;
    }
    if (n > 0)
      mean_ /= static_cast<double>(n);
    // NaN or Inf anywhere makes the mean non-finite; caught here because row normalisation would skip such rows.
    if (!mean_.allFinite())
      return {Errc::non_finite, "matrix entropy: `rows` hold NaN or Inf"};

    bool const use_gram = options_.gram == Gram::tokens || (options_.gram == Gram::automatic && n < dim_);
    Index used = 0;  // rows that enter the matrix (zero rows are skipped when normalising)
    if (use_gram) {
      gram_rows_.resize(n, dim_);
      for (Index r = 0; r < n; ++r)
        if (centred_row(load, r))
          gram_rows_.row(used++) = row_.transpose();
      gram_.resize(used, used);
      gram_.setZero();
      if (used > 0)  // an empty product would hand BLAS a null pointer (UBSan)
        gram_.selfadjointView<Eigen::Lower>().rankUpdate(gram_rows_.topRows(used));
      return finish(gram_, used, n, out);
    }
    second_.setZero();
    Index filled = 0;
    for (Index r = 0; r < n; ++r) {
      if (!centred_row(load, r))
        continue;
      tile_.row(filled++) = row_.transpose();
      ++used;
      if (filled == tile_.rows()) {
        second_.selfadjointView<Eigen::Lower>().rankUpdate(tile_.transpose());
        filled = 0;
      }
    }
    if (filled > 0)
      second_.selfadjointView<Eigen::Lower>().rankUpdate(tile_.topRows(filled).transpose());
    return finish(second_, used, n, out);
  }

 private:
  static constexpr Index kMaxStackDim = 1024;

  static Index clamp_size(Index n) noexcept { return n > 0 ? n : 0; }

  float* scratch_float(Index) {
    wide_.resize(dim_);
    return wide_.data();
  }

  /// Loads row r centred (and normalised) into row_; false when it is skipped (zero after centring).
  template <class Load>
  bool centred_row(Load& load, Index r) {
    load(r);
    row_ -= mean_;
    if (!options_.normalize_rows)
      return true;
    double const norm = row_.norm();
    if (!(norm > 0.0))
      return false;
    row_ /= norm;
    return true;
  }

  /// Eigenvalues of the lower triangle of `m` (square: [dim, dim], or [used, used] for the Gram path), normalised by
  /// their trace, into the entropies. `used`: rows that entered `m` (0: an empty spectrum).
  Status finish(Matrix& m, Index used, Index n, MatrixEntropy& out) {
    out = {};
    values_.setZero();
    out.k = std::min({resolved_top_k(options_, dim_), n, dim_});
    double const log_d = std::log(static_cast<double>(dim_));
    Index const size = m.rows();  // not `used`: the d x d path has d eigenvalues for any row count
    double const trace = used > 0 ? m.diagonal().sum() : 0.0;
    if (!(trace > 0.0) || !std::isfinite(trace)) {
      if (!std::isfinite(trace))  // finite rows can still overflow the fp64 sums (|x| ~ 1e154 and above)
        return {Errc::non_finite, "matrix entropy: the second moment of `rows` overflows"};
      return {};  // no variation: an empty spectrum, H = 0 and erank = 1 (decision A19)
    }
    // The upper triangle is unset (rankUpdate wrote the lower); the solver reads the lower one only.
    solver_.compute(m, Eigen::EigenvaluesOnly);
    if (solver_.info() != Eigen::Success)
      return {Errc::invalid_argument, "matrix entropy: the symmetric eigensolver did not converge"};
    auto const& ascending = solver_.eigenvalues();
    for (Index i = 0; i < size && i < dim_; ++i)  // descending, clamped, trace-normalised
      values_[i] = std::max(0.0, ascending[size - 1 - i] / trace);
    double sum = values_.sum();  // ~1; the clamp removed only round-off
    for (Index i = 0; i < dim_; ++i)
      values_[i] = values_[i] / sum + options_.ridge;
    auto plogp = [](double l) { return l > 0.0 ? -l * std::log(l) : 0.0; };
    double topk_sum = 0.0;
    for (Index i = 0; i < out.k; ++i)
      topk_sum += values_[i];
    for (Index i = 0; i < dim_; ++i) {
      double const l = values_[i];
      out.full += plogp(l);
      if (i < out.k)
        out.truncated += options_.renormalize_topk ? plogp(l / topk_sum) : plogp(l);
    }
    out.erank = std::exp(out.truncated);
    out.normalized = dim_ > 1 ? out.truncated / log_d : 0.0;
    return {};
  }

  Index dim_;
  MatrixEntropyOptions options_;
  Matrix second_;                                                                ///< A (lower triangle), [dim, dim]
  Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> tile_;  ///< [tile_rows, dim] centred rows
  Eigen::VectorXd mean_, row_, values_;
  Matrix gram_rows_, gram_;  ///< the n < dim path: Z [n, dim] and Z Zᵀ [n, n]
  Eigen::VectorXf wide_;     ///< a row widened to fp32 when dim exceeds the stack buffer
  Eigen::SelfAdjointEigenSolver<Matrix> solver_;
};

}  // namespace kvc
