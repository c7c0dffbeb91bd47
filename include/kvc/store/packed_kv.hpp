// SPDX-License-Identifier: Apache-2.0
// kvc/store/packed_kv.hpp: kvc::PackedKV, the owning host object of one packed layer (layout: store/packed.hpp;
// built by kvc::pack in pipeline/pack.hpp). Host only (std::vector); device kernels read a PackedKVView of a copy.
#pragma once

#include <kvc/store/packed.hpp>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvc {

/// One packed layer on the host: the arena (16-byte aligned offsets into 16-byte aligned storage) and one
/// descriptor per (sequence, KV head). Copy it to a device by copying arena_data()[0, arena_bytes()) and
/// heads()[0, batch·kv_heads) as they are (offsets are relative) and building a PackedKVView<DeviceSpace> over them.
class PackedKV {
 public:
  PackedKV() = default;

  /// The view kernels read (valid while this object lives and is not rebuilt).
  PackedKVView<HostSpace> view() const noexcept {
    return {reinterpret_cast<std::byte const*>(arena_.data()),
            heads_.data(),
            batch_,
            kv_heads_,
            dim_,
            value_dim_,
            max_tokens_,
            quant_};
  }
  Index batch() const noexcept { return batch_; }
  Index kv_heads() const noexcept { return kv_heads_; }
  Index dim() const noexcept { return dim_; }
  Index value_dim() const noexcept { return value_dim_; }
  PackedQuant const& quant() const noexcept { return quant_; }
  /// Descriptor of head (b, h).
  PackedHead const& head(Index b, Index h) const noexcept {
    return heads_[static_cast<std::size_t>(b * kv_heads_ + h)];
  }
  PackedHead const* heads() const noexcept { return heads_.data(); }
  std::byte const* arena_data() const noexcept { return reinterpret_cast<std::byte const*>(arena_.data()); }
  /// Kept tokens of head (b, h) (T_eff).
  Index tokens(Index b, Index h) const noexcept { return head(b, h).tokens; }
  Index max_tokens() const noexcept { return max_tokens_; }
  /// Σ over heads of PackedHead::payload_bits: the bits the plan allocated, at their stored widths.
  std::int64_t payload_bits() const noexcept {
    std::int64_t s = 0;
    for (PackedHead const& h : heads_)
      s += h.payload_bits;
    return s;
  }
  /// Σ over heads of PackedHead::overhead_bits: params, pad codes, permutation.
  std::int64_t overhead_bits() const noexcept {
    std::int64_t s = 0;
    for (PackedHead const& h : heads_)
      s += h.overhead_bits;
    return s;
  }
  /// Bytes of the arena (payload, overhead, positions and alignment padding: what the store allocates).
  std::size_t arena_bytes() const noexcept { return arena_bytes_; }
  /// Bytes of the descriptors.
  std::size_t descriptor_bytes() const noexcept { return heads_.size() * sizeof(PackedHead); }

  /// For the builder (kvc::pack): resets the object to `batch` x `kv_heads` empty heads and an arena of `bytes`
  /// zero bytes. Allocates.
  void reset(Index batch, Index kv_heads, Index dim, Index value_dim, PackedQuant quant, std::size_t bytes) {
    batch_ = batch;
    kv_heads_ = kv_heads;
    dim_ = dim;
    value_dim_ = value_dim;
    quant_ = quant;
    max_tokens_ = 0;
    heads_.assign(static_cast<std::size_t>(batch * kv_heads), PackedHead{});
    arena_.assign((bytes + sizeof(Chunk) - 1) / sizeof(Chunk), Chunk{});
    arena_bytes_ = bytes;
  }
  /// For the builder: mutable descriptor and arena.
  PackedHead& head_mut(Index b, Index h) noexcept { return heads_[static_cast<std::size_t>(b * kv_heads_ + h)]; }
  std::byte* arena_mut() noexcept { return reinterpret_cast<std::byte*>(arena_.data()); }
  void set_max_tokens(Index n) noexcept { max_tokens_ = n; }

 private:
  struct alignas(16) Chunk {
    std::byte bytes[16];
  };
  std::vector<Chunk> arena_;
  std::vector<PackedHead> heads_;
  std::size_t arena_bytes_ = 0;
  Index batch_ = 0, kv_heads_ = 0, dim_ = 0, value_dim_ = 0, max_tokens_ = 0;
  PackedQuant quant_{};
};

/// dequantized() of a PackedKV (see store/packed.hpp): keys [T_eff, dim] in original channel order (pruned 0),
/// values [T_eff, value_dim], positions [T_eff], packed order; any output may be null.
inline void dequantized(PackedKV const& kv, Index b, Index h, float* keys_out, float* values_out,
                        Index* positions_out) noexcept {
  dequantized(kv.view(), b, h, keys_out, values_out, positions_out);
}

}  // namespace kvc
