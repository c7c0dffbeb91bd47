// SPDX-License-Identifier: Apache-2.0
// kvc/core/status.hpp: the result of entry points that can fail at run time.
#pragma once

#include <kvc/config.hpp>

namespace kvc {

/// What went wrong. `ok` is zero so that a Status converts to false only on error.
enum class Errc : int {
  ok = 0,
  invalid_argument,  ///< a shape, stride, budget or parameter is out of range
  non_finite,        ///< validation found NaN or Inf in an input
  out_of_capacity,   ///< a caller-owned buffer (plan, workspace, destination) is too small
  backend_error,     ///< the backend reported an error (e.g. a CUDA launch failure)
};

/// [[nodiscard]] result with a static message naming the argument and what was expected.
/// Messages are string literals, so a Status is trivially copyable and never allocates.
class [[nodiscard]] Status {
 public:
  constexpr Status() noexcept = default;
  constexpr Status(Errc code, char const* message) noexcept : code_(code), message_(message) {}

  constexpr bool ok() const noexcept { return code_ == Errc::ok; }
  constexpr explicit operator bool() const noexcept { return ok(); }
  constexpr Errc code() const noexcept { return code_; }
  /// Never null: "ok" on success.
  constexpr char const* message() const noexcept { return message_; }

 private:
  Errc code_ = Errc::ok;
  char const* message_ = "ok";
};

/// Success.
constexpr Status ok_status() noexcept {
  return {};
}

/// Returns early from the enclosing function when `expr` yields an error Status.
#define KVC_RETURN_IF_ERROR(expr)       \
  do {                                  \
    ::kvc::Status kvc_status_ = (expr); \
    if (!kvc_status_.ok())              \
      return kvc_status_;               \
  } while (0)

}  // namespace kvc
