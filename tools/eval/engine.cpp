// SPDX-License-Identifier: Apache-2.0
// tools/eval/engine.cpp: the engine's type-independent parts (engine.hpp): cache type names and the session factory
// over the per-type instances.
#include "eval/engine.hpp"

#include <kvc/core/element.hpp>
#include <kvc/pipeline/decode.hpp>

#include "common/policies.hpp"
#include "common/uncomp.hpp"
#include "eval/model.hpp"

#include <Eigen/Core>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace kvc::eval {

char const* cache_type_name(CacheType t) noexcept {
  switch (t) {
    case CacheType::f32: return "fp32";
    case CacheType::f16: return "fp16";
    case CacheType::bf16: return "bf16";
    case CacheType::f8_e4m3: return "fp8_e4m3";
    case CacheType::f8_e5m2: return "fp8_e5m2";
  }
  return "?";
}

std::unique_ptr<Session> make_session(Model const& model, CacheOptions const& options, Index capacity) {
  switch (options.type) {
    case CacheType::f32: return detail::make_typed<float>(model, options, capacity);
    case CacheType::f16: return detail::make_typed<half>(model, options, capacity);
    case CacheType::bf16: return detail::make_typed<bfloat16>(model, options, capacity);
    case CacheType::f8_e4m3: return detail::make_typed<float8_e4m3>(model, options, capacity);
    case CacheType::f8_e5m2: return detail::make_typed<float8_e5m2>(model, options, capacity);
  }
  return nullptr;
}

}  // namespace kvc::eval
