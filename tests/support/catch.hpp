// SPDX-License-Identifier: Apache-2.0
// tests/support/catch.hpp: one include for every test. Catch2 v3 where installed, else v2 (Debian 12 ships 2.13).
#pragma once

#if __has_include(<catch2/catch_test_macros.hpp>)
#  include <catch2/catch_template_test_macros.hpp>
#  include <catch2/catch_test_macros.hpp>
#  include <catch2/generators/catch_generators.hpp>
#  include <catch2/matchers/catch_matchers_floating_point.hpp>
#else
#  include <catch2/catch.hpp>
#endif
