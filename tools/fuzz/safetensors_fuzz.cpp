// SPDX-License-Identifier: Apache-2.0
// tools/fuzz/safetensors_fuzz.cpp: libFuzzer harness for the .safetensors header parser and the JSON parser under
// it (files are untrusted input). The input is a whole file (file_size = its size); the same bytes are also parsed as
// JSON text. Contracts, checked on every input: an accepted header describes tensors inside the file that cover its
// data buffer exactly with consistent sizes; an accepted JSON value is no deeper than the limit and its numbers and
// strings are what the grammar allows; every rejection says why.
//   cmake -DCMAKE_CXX_COMPILER=clang++ -DKVC_BUILD_FUZZERS=ON ... && ./tools/kvc_safetensors_fuzz -max_total_time=60

#include "io/json.hpp"
#include "io/safetensors.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace {

void require(bool ok) {
  if (!ok)
    std::abort();
}

/// Checks an accepted value: depth within `limit`, numbers written per the grammar (digits, sign, '.', exponent
/// only), strings valid UTF-8 (they re-encode), object keys unique. Returns the depth.
int check_value(kvc::json::Value const& v, int limit) {
  using kvc::json::Kind;
  switch (v.kind()) {
    case Kind::number: {
      std::string_view const t = v.number_text();
      require(!t.empty() && t.find_first_not_of("-+.eE0123456789") == std::string_view::npos);
      require(v.as_string().empty() && v.items().empty() && v.members().empty());
      return 0;
    }
    case Kind::string: {
      std::string quoted;
      require(kvc::json::append_string(quoted, v.as_string()));
      require(v.number_text().empty() && v.as_double() == 0.0);
      return 0;
    }
    case Kind::array: {
      int depth = 0;
      for (kvc::json::Value const& item : v.items())
        depth = std::max(depth, check_value(item, limit - 1));
      require(depth + 1 <= limit);
      return depth + 1;
    }
    case Kind::object: {
      int depth = 0;
      for (kvc::json::Value::Member const& m : v.members()) {
        std::string quoted;
        require(kvc::json::append_string(quoted, m.first));
        require(v.find(m.first) == &m.second);  // the first member of that name is this one: keys are unique
        depth = std::max(depth, check_value(m.second, limit - 1));
      }
      require(depth + 1 <= limit);
      return depth + 1;
    }
    case Kind::null:
    case Kind::boolean: return 0;
  }
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  std::span<std::byte const> const bytes(reinterpret_cast<std::byte const*>(data), size);

  kvc::SafetensorsHeader h;
  std::string error;
  if (kvc::parse_safetensors_header(bytes, size, h, error)) {
    require(h.data_begin >= 10 && h.data_begin <= size);  // 8 + N, N >= 2 for the smallest object "{}"
    std::uint64_t total = 0;
    std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges;
    for (kvc::SafetensorsTensor const& t : h.tensors) {
      require(!t.name.empty() && t.name != "__metadata__");
      require(t.begin >= h.data_begin && t.begin <= size && t.bytes <= size - t.begin);
      kvc::Index elements = 1;
      for (kvc::Index d : t.shape) {
        require(d >= 0);
        elements *= d;  // cannot overflow: the parser checked the product
      }
      require(t.bytes == static_cast<std::uint64_t>(elements) * kvc::safetensors_dtype_bytes(t.dtype));
      require(h.find(t.name) == &t);  // names unique
      total += t.bytes;
      ranges.emplace_back(t.begin, t.begin + t.bytes);
    }
    std::sort(ranges.begin(), ranges.end());
    std::uint64_t at = h.data_begin;
    for (auto const& [b, e] : ranges) {  // contiguous, no overlap
      require(b == at);
      at = e;
    }
    require(at == size && total == size - h.data_begin);  // the buffer is covered exactly
  } else {
    require(!error.empty());  // every rejection says why
  }

  // The same bytes as JSON text, with a small depth limit so the check's recursion stays shallow.
  constexpr int kDepth = 32;
  kvc::json::Value v;
  error.clear();
  std::string_view const text(reinterpret_cast<char const*>(data), size);
  if (kvc::json::parse(text, v, error, kvc::json::ParseLimits{kDepth})) {
    require(check_value(v, kDepth) <= kDepth);
    std::int64_t i = 0;
    if (kvc::json::to_int64(v, i))  // an integer reads back as the same double, within rounding
      require(static_cast<double>(i) == v.as_double());
  } else {
    require(!error.empty() && error.rfind("byte ", 0) == 0);
  }
  return 0;
}
