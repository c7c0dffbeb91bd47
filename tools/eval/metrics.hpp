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
void log_softmax(float const* logits, std::int64_t n, std::vector<double>& out);

/// KL(p || q) in nats from log-probabilities `lp`, `lq` (same length).
double kl_from_log_probs(std::vector<double> const& lp, std::vector<double> const& lq);

/// KL(p || q) in nats between softmax(p_logits) and softmax(q_logits), both [n].
double kl_divergence(float const* p_logits, float const* q_logits, std::int64_t n);

/// Index of the largest logit; ties keep the lower index (kvc's determinism rule).
std::int64_t argmax(float const* logits, std::int64_t n);

/// -log softmax(logits)[target], in nats.
double negative_log_likelihood(float const* logits, std::int64_t n, std::int64_t target);

/// ||a - b||_F / ||b||_F (0 when both are zero).
template <class A, class B>
double relative_error(A const& a, B const& b) {
  double const den = b.template cast<double>().norm();
  double const num = (a.template cast<double>() - b.template cast<double>()).norm();
  return den > 0 ? num / den : (num > 0 ? std::numeric_limits<double>::infinity() : 0.0);
}

}  // namespace kvc::eval
