// SPDX-License-Identifier: Apache-2.0
// tools/eval/metrics.cpp: the quality metrics (metrics.hpp): log-softmax, KL, argmax, NLL.
#include "eval/metrics.hpp"

#include <Eigen/Core>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace kvc::eval {

void log_softmax(float const* logits, std::int64_t n, std::vector<double>& out) {
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

double kl_from_log_probs(std::vector<double> const& lp, std::vector<double> const& lq) {
  double kl = 0;
  for (std::size_t i = 0; i < lp.size(); ++i)
    kl += std::exp(lp[i]) * (lp[i] - lq[i]);
  return std::max(kl, 0.0);  // rounding can make a near-zero sum slightly negative; KL >= 0
}

double kl_divergence(float const* p_logits, float const* q_logits, std::int64_t n) {
  std::vector<double> lp, lq;
  log_softmax(p_logits, n, lp);
  log_softmax(q_logits, n, lq);
  return kl_from_log_probs(lp, lq);
}

std::int64_t argmax(float const* logits, std::int64_t n) {
  std::int64_t best = 0;
  for (std::int64_t i = 1; i < n; ++i)
    if (logits[i] > logits[best])
      best = i;
  return best;
}

double negative_log_likelihood(float const* logits, std::int64_t n, std::int64_t target) {
  std::vector<double> l;
  log_softmax(logits, n, l);
  return -l[static_cast<std::size_t>(target)];
}

}  // namespace kvc::eval
