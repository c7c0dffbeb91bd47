// SPDX-License-Identifier: Apache-2.0
// Compile-fail twin: builds as-is ("ok": the CPU reads an fp8 cache); with KVC_SHOULD_FAIL ("ko") the CUDA backend,
// whose kernels do not apply fp8 scales yet, must refuse it with the message below.
// EXPECT: the cache lives in a memory space this backend cannot read, or holds fp8 elements it cannot read yet
#include <kvc/backend/cpu/scorers/knorm.hpp>

#include <vector>

int main() {
  std::vector<kvc::float8_e4m3> k(8), v(8);
  std::vector<float> out(2);
  kvc::KVExtents const e{1, 1, 2, 4};
#if defined(KVC_SHOULD_FAIL)
  kvc::Cuda const backend{};
  auto const cache = kvc::make_cache(kvc::bhtd_device_rows(k.data(), e, kvc::tensor_scale(0.5f)),
                                     kvc::bhtd_device_rows(v.data(), e, kvc::tensor_scale(0.5f)));
  kvc::ScoreSpan<kvc::DeviceSpace> const span{out.data(), 1, 1, 2};
#else
  kvc::Cpu const backend{};
  auto const cache = kvc::make_cache(kvc::bhtd_rows(k.data(), e, kvc::tensor_scale(0.5f)),
                                     kvc::bhtd_rows(v.data(), e, kvc::tensor_scale(0.5f)));
  kvc::ScoreSpan<> const span{out.data(), 1, 1, 2};
#endif
  return kvc::score(backend, kvc::KnormScorer{}, cache, span, {}).ok() ? 0 : 1;
}
