// SPDX-License-Identifier: Apache-2.0
// tools/kvc/timing.cpp: the --time lines of `kvc score` and `kvc compress` (compact JSON on stderr).

#include "common/isa.hpp"
#include "internal.hpp"

namespace kvc::cli {

void print_json_line(nlohmann::ordered_json const& j) {
  std::fprintf(io.err, "%s\n", j.dump().c_str());
}

void print_time(char const* command, PolicyInfo const& policy, std::string const& allocator,
                std::optional<std::pair<char const*, kvc::Index>> layer, Timing const& t) {
  nlohmann::ordered_json j;
  j["command"] = command;
  j["policy"] = policy.name;
  if (!allocator.empty())
    j["allocator"] = allocator;
  if (layer)
    j[layer->first] = layer->second;  // "layer": L (one layer of a dump) or "layers": count (the total)
  j["seconds"] = t.seconds;
  if (t.select_seconds >= 0)
    j["select_seconds"] = t.select_seconds;
  j["repeats"] = timing_repeats;
  j["bytes_read"] = t.bytes_read;
  j["workspace_bytes"] = t.workspace_bytes;
  if (t.memory && t.memory->packed) {
    Memory const& m = *t.memory;
    std::int64_t const payload_bytes = (m.payload_bits + 7) / 8, overhead_bytes = (m.overhead_bits + 7) / 8;
    j["input_bytes"] = m.input_bytes;
    j["input_tokens"] = m.input_tokens;
    j["kept_tokens"] = m.kept_tokens;
    j["tail_tokens"] = m.tail_tokens;
    j["payload_bits"] = m.payload_bits;
    j["overhead_bits"] = m.overhead_bits;
    j["payload_bytes"] = payload_bytes;
    j["overhead_bytes"] = overhead_bytes;
    j["packed_bytes"] = payload_bytes + overhead_bytes;
    j["state_bytes"] = t.state_bytes;
    j["retention"] = m.full_bits > 0 ? static_cast<double>(m.payload_bits) / static_cast<double>(m.full_bits) : 0.0;
  } else if (t.memory) {
    Memory const& m = *t.memory;
    j["state_bytes"] = t.state_bytes;
    j["input_bytes"] = m.input_bytes;
    j["padded_bytes"] = m.padded_bytes;
    j["ragged_bytes"] = m.ragged_bytes;
    j["row_bytes"] = m.row_bytes;
    j["input_tokens"] = m.input_tokens;
    j["kept_tokens"] = m.kept_tokens;
    if (m.moments) {
      j["moment_bytes"] = m.moment_bytes;
      j["moment_head_bytes"] = m.moment_head_bytes;
      j["moment_ratio"] =
          m.ragged_bytes > 0 ? static_cast<double>(m.moment_bytes) / static_cast<double>(m.ragged_bytes) : 0.0;
    }
  }
  j["threads"] = t.threads;
  j["isa"] = compiled_isa();
  print_json_line(j);
}

}  // namespace kvc::cli
