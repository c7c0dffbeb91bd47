// SPDX-License-Identifier: Apache-2.0
// tools/eval/metrics.hpp: what kvc-eval measures, one next-token row at a time, in double.
//
// Rows are logits [vocab] (fp32). The full cache's distribution p and the compressed cache's q come from the same
// token prefix; KL(p || q) = sum_i p_i (log p_i - log q_i) with log-softmax computed stably (max subtracted).
// Identical rows give exactly 0 (every term is p_i * 0).
#pragma once

#include <Eigen/Core>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace kvc::eval {

/// log-softmax of `logits` [n] into `out` [n], in double.
inline void log_softmax(float const* logits, std::int64_t n, std::vector<double>& out) {
  out.resize(static_cast<std::size_t>(n));
  double m = -std::numeric_limits<double>::infinity();
  for (std::int64_t i = 0; i < n; ++i)
    m = std::max(m, static_cast<double>(logits[i]));
  double sum = 0;
  for (std::int64_t i = 0; i < n; ++i)
    sum += std::exp(static_cast<double>(logits[i]) - m);
  double const log_z = m + std::log(sum);
  for (std::int64_t i = 0; i < n; ++i)
    out[static_cast<std::size_t>(i)] = static_cast<double>(logits[i]) - log_z;
}

/// KL(p || q) in nats from log-probabilities `lp`, `lq` (same length).
inline double kl_from_log_probs(std::vector<double> const& lp, std::vector<double> const& lq) {
  double kl = 0;
  for (std::size_t i = 0; i < lp.size(); ++i)
    kl += std::exp(lp[i]) * (lp[i] - lq[i]);
  return std::max(kl, 0.0);  // rounding can make a near-zero sum slightly negative; KL >= 0
}

/// KL(p || q) in nats between softmax(p_logits) and softmax(q_logits), both [n].
inline double kl_divergence(float const* p_logits, float const* q_logits, std::int64_t n) {
  std::vector<double> lp, lq;
  log_softmax(p_logits, n, lp);
  log_softmax(q_logits, n, lq);
  return kl_from_log_probs(lp, lq);
}

/// Index of the largest logit; ties keep the lower index (kvc's determinism rule).
inline std::int64_t argmax(float const* logits, std::int64_t n) {
  std::int64_t best = 0;
  for (std::int64_t i = 1; i < n; ++i)
    if (logits[i] > logits[best])
      best = i;
  return best;
}

/// -log softmax(logits)[target], in nats.
inline double negative_log_likelihood(float const* logits, std::int64_t n, std::int64_t target) {
  std::vector<double> l;
  log_softmax(logits, n, l);
  return -l[static_cast<std::size_t>(target)];
}

/// ||a - b||_F / ||b||_F (0 when both are zero).
template <class A, class B>
double relative_error(A const& a, B const& b) {
  double const den = b.template cast<double>().norm();
  double const num = (a.template cast<double>() - b.template cast<double>()).norm();
  return den > 0 ? num / den : (num > 0 ? std::numeric_limits<double>::infinity() : 0.0);
}

}  // namespace kvc::eval
