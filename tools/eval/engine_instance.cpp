// SPDX-License-Identifier: Apache-2.0
// tools/eval/engine_instance.cpp: kvc-eval's engine (engine_impl.hpp, engine_passes.hpp) for one cache element type,
// KVC_EVAL_ELEMENT, which tools/CMakeLists.txt defines per object library: the five types build in parallel, once for
// kvc-eval and the tests that run sessions.
#include "eval/engine_passes.hpp"  // with engine_impl.hpp

#ifndef KVC_EVAL_ELEMENT
#  error "tools/eval/engine_instance.cpp is compiled once per cache element type, with KVC_EVAL_ELEMENT defined"
#endif

template std::unique_ptr<kvc::eval::Session> kvc::eval::detail::make_typed<KVC_EVAL_ELEMENT>(
    kvc::eval::Model const& model, kvc::eval::CacheOptions const& options, kvc::Index capacity);
