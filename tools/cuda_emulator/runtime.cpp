// SPDX-License-Identifier: Apache-2.0
// tools/cuda_emulator/runtime.cpp: the CUDA emulator's runtime (see include/cuda_runtime.h and
// docs/cuda_emulator.md). One launch at a time; the blocks of a grid run one after another on the calling thread, the
// threads of a block as fibers on their own stacks. A fiber runs until it reaches a barrier or warp intrinsic (or
// returns); the scheduler then resumes the next ready fiber in thread order, so a run is deterministic.
//
// What it checks, each a failed launch naming the kernel, the block and the thread:
//  - __syncthreads: every live thread waits at the same call site, and no thread returns while others wait at, or
//    have yet to reach, a barrier of the same interval (CUDA: a barrier in divergent code is undefined);
//  - warp intrinsics: every lane of the mask is a live thread of the block and calls the same intrinsic with the same
//    mask at the same site; shuffles read only lanes of the mask; no deadlock between warps and barriers;
//  - shared memory (with Clang's -fsanitize-coverage=trace-loads,trace-stores, which calls the __sanitizer_cov_*
//    hooks below on every load and store of the emulated translation units): two threads touching the same byte
//    between two barriers (or __syncwarp for lanes of one warp), one of them writing, not both atomically; accesses
//    around the dynamic shared memory but outside its launched size.
// Global memory is host memory from malloc, so AddressSanitizer and UBSan check every device access; their reports
// end with the kernel, block and thread that was running (a death callback).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dlfcn.h>
#include <mutex>
#include <string>
#include <sys/mman.h>
#include <type_traits>
#include <unordered_map>
#include <vector>

#if defined(__has_feature)
#  if __has_feature(address_sanitizer)
#    define KVC_EMU_ASAN 1
#  endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#  define KVC_EMU_ASAN 1
#endif
#if KVC_EMU_ASAN
#  include <sanitizer/asan_interface.h>
#  include <sanitizer/common_interface_defs.h>
#endif
// The race detector's own bookkeeping (shadow cells indexed after the overrun checks) runs on every shared access of
// every emulated thread: left uninstrumented, it is several times faster under the sanitizers.
#define KVC_EMU_UNSANITIZED __attribute__((no_sanitize("address", "undefined")))

// The static __shared__ variables of every emulated translation unit (the linker defines these for a section whose
// name is an identifier); weak, so a program without any still links.
extern "C" char __start_kvc_emu_shared[] __attribute__((weak));
extern "C" char __stop_kvc_emu_shared[] __attribute__((weak));
// The sanitizers' symbolizer, when a sanitizer runtime is linked (names the source line of a racing access).
extern "C" void __sanitizer_symbolize_pc(void* pc, char const* fmt, char* out, std::size_t size) __attribute__((weak));
extern "C" void __sanitizer_set_death_callback(void (*callback)()) __attribute__((weak));
// LeakSanitizer scans the fiber stacks too: a fiber abandoned after a violation still holds its message's strings.
extern "C" void __lsan_register_root_region(void const* p, std::size_t size) __attribute__((weak));

namespace kvc::emu {
/// One recorded operation of a captured stream: a kernel launch, or a copy or set of device memory.
struct GraphNode {
  Launch launch{};
  std::function<void()> body;  // the kernel with copies of its arguments (empty: a copy or set)
  void* dst = nullptr;
  void const* src = nullptr;  // a copy's source (null: a set)
  std::size_t bytes = 0;
  int value = 0;
};
}  // namespace kvc::emu

struct CUstream_st {
  int id;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  std::vector<kvc::emu::GraphNode> captured;  // what the capture recorded so far
};
struct CUgraph_st {
  std::vector<kvc::emu::GraphNode> nodes;
};
struct CUgraphExec_st {
  std::vector<kvc::emu::GraphNode> nodes;
};
struct CUevent_st {
  std::chrono::steady_clock::time_point when{};
  bool recorded = false;
};

// ---- Fibers -----------------------------------------------------------------------------------------------------
// switch_context saves the callee-saved registers on the current stack, stores the stack pointer in *save and
// continues on the stack `load` (a context saved by switch_context or made by new_context).
#if defined(__x86_64__)
extern "C" void kvc_emu_switch(void** save, void* load);
extern "C" void kvc_emu_trampoline();
asm(R"(
  .pushsection .text
  .globl kvc_emu_switch
  .type kvc_emu_switch, @function
kvc_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size kvc_emu_switch, .-kvc_emu_switch

  .globl kvc_emu_trampoline
  .type kvc_emu_trampoline, @function
kvc_emu_trampoline:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size kvc_emu_trampoline, .-kvc_emu_trampoline
  .popsection
)");

namespace {
using Context = void*;
inline void switch_context(Context* save, Context load) {
  kvc_emu_switch(save, load);
}
/// A context that, when switched to, calls fn(arg) on the stack [lo, lo + size) (fn never returns).
Context new_context(char* lo, std::size_t size, void (*fn)(void*), void* arg) {
  auto* top = reinterpret_cast<std::uint64_t*>(reinterpret_cast<std::uintptr_t>(lo + size) & ~std::uintptr_t{15});
  std::uint64_t* sp = top - 8;            // the frame kvc_emu_switch pops: control words, r15..rbp, return address
  sp[0] = 0x1f80ull | (0x037full << 32);  // MXCSR and the x87 control word at their defaults
  sp[1] = sp[2] = sp[5] = sp[6] = 0;      // r15, r14, rbx, rbp
  sp[3] = reinterpret_cast<std::uint64_t>(fn);                   // r13
  sp[4] = reinterpret_cast<std::uint64_t>(arg);                  // r12
  sp[7] = reinterpret_cast<std::uint64_t>(&kvc_emu_trampoline);  // return address; rsp = top (16-aligned) after it
  return sp;
}
}  // namespace
#else
#  include <ucontext.h>
namespace {
struct UContext {
  ucontext_t uc;
};
using Context = UContext*;
inline void switch_context(Context* save, Context load) {
  UContext here;
  *save = &here;
  swapcontext(&here.uc, &load->uc);
}
Context new_context(char* lo, std::size_t size, void (*fn)(void*), void* arg) {
  auto* c = reinterpret_cast<UContext*>(lo);  // the context lives at the bottom of its own stack
  getcontext(&c->uc);
  c->uc.uc_stack.ss_sp = lo + sizeof(UContext);
  c->uc.uc_stack.ss_size = size - sizeof(UContext);
  c->uc.uc_link = nullptr;
  makecontext(&c->uc, reinterpret_cast<void (*)()>(fn), 1, arg);  // one pointer argument: fine on LP64 glibc
  return c;
}
}  // namespace
#endif

namespace kvc::emu {

uint3 thread_idx{}, block_idx{};
dim3 block_dim{}, grid_dim{};

namespace {

constexpr int max_threads = 1024;
constexpr std::size_t stack_bytes = std::size_t{256} << 10;  // per fiber; ASan's redzones make frames large
constexpr std::size_t guard_bytes = 4096;
constexpr int default_shared_limit = 48 << 10;  // per block without an opt-in
constexpr int optin_shared_limit = 227 << 10;   // what an H100 allows with cudaFuncAttributeMaxDynamicSharedMemorySize
constexpr std::size_t dynamic_guard = 64 << 10;

enum class State : unsigned char { ready, at_barrier, at_warp, exited };

struct Thread {
  Context context{};
  void* fake_stack = nullptr;  // AddressSanitizer's fake stack of this fiber while it is switched out
  char* stack = nullptr;
  State state = State::ready;
  Site site{};  // where it waits
  int linear = 0;
  uint3 idx{};
  std::uint64_t warp_in = 0, warp_out = 0;  // the operand it gave the pending warp intrinsic, and its result
  int warp_operand = 0, warp_width = 32;
};

struct WarpState {
  unsigned arrived = 0, mask = 0;
  WarpOp op = WarpOp::sync;
  Site site{};
  std::uint32_t epoch = 0;  // __syncwarp releases (orders the lanes' shared-memory accesses)
};

/// The race detector's record of one access to a byte of shared memory (8 bytes: the detector runs on every shared
/// access of every emulated thread).
struct Access {
  std::uint32_t epoch = 0;       // Runtime::epoch when it happened (block start or last __syncthreads)
  std::uint16_t warp_epoch = 0;  // its warp's __syncwarp count then (low 16 bits)
  std::int16_t tid = -1;         // the thread (linear index in the block), -1: none
};
/// One byte of shared memory: its last write and last read since, and the write's program counter (for the report).
/// 32 bytes without padding, so that two cells compare as memory.
struct Cell {
  Access write, read;
  // Those other readers' warp (-1: more than one warp) and its __syncwarp count then: a __syncwarp of that warp since
  // orders them before a write by one of its lanes.
  std::int16_t others_warp = -1;
  std::uint16_t others_warp_epoch = 0;
  bool write_atomic = false, read_atomic = false;
  bool other_readers = false;  // another unordered thread read it in read.epoch too
  bool unused = false;
  void* write_pc = nullptr;
};
static_assert(sizeof(Cell) == 32 && std::has_unique_object_representations_v<Cell>);

struct Runtime {
  std::mutex mutex;
  // The launch being run.
  Launch launch{};
  std::function<void()> const* body = nullptr;
  std::vector<Thread> threads;
  std::vector<WarpState> warps;
  Thread* current = nullptr;
  int live = 0, waiting = 0, exited_since_barrier = 0, last_exited = -1;
  Site barrier_site{};
  bool aborted = false;
  // The scheduler's side of the fiber switches.
  Context scheduler{};
  void* scheduler_fake_stack = nullptr;
  void const* scheduler_bottom = nullptr;
  std::size_t scheduler_size = 0;
  // Fiber stacks: max_threads stacks with a guard page below each, mapped once.
  char* stacks = nullptr;
  // Dynamic shared memory: a mapping [guard | usable | guard] with the block's bytes at the end of the usable part.
  char* dynamic_region = nullptr;
  char* dynamic_base = nullptr;
  std::size_t dynamic_size = 0;
  // Race detector: one cell per byte of static shared memory, then of the dynamic shared memory.
  std::vector<Cell> shadow;
  std::uint32_t epoch = 0;  // advances at every block start and __syncthreads release
  // Errors and counters.
  cudaError_t last_error = cudaSuccess, sticky = cudaSuccess;
  std::string violation;
  bool violation_pending = false;  // reported by a launch but never taken: fails the process at exit
  Counters counters{};
  struct Function {
    int static_bytes = 0;                    // what the test said (the emulator cannot measure it)
    int max_dynamic = default_shared_limit;  // cudaFuncAttributeMaxDynamicSharedMemorySize
  };
  std::unordered_map<void const*, Function> functions;
  int next_stream = 1;
  std::vector<CUstream_st*> capturing;  // streams in capture (global mode: every unsafe call invalidates them all)
};

/// A fiber is running: the memory hooks look at its accesses. Constant-initialised, outside Runtime: the hooks run
/// from the first instrumented static initialiser on, before rt() can be constructed.
constinit bool running = false;
/// The shared-memory ranges the hooks look at (the static section, the whole dynamic mapping with its guards), as
/// [lo, lo + size): one subtraction and compare each.
constinit std::uintptr_t watch_lo[2] = {0, 0};
constinit std::size_t watch_size[2] = {0, 0};

Runtime& rt() {
  static Runtime r;
  return r;
}

char* static_shared_begin() {
  return __start_kvc_emu_shared;
}
std::size_t static_shared_size() {
  return __start_kvc_emu_shared ? static_cast<std::size_t>(__stop_kvc_emu_shared - __start_kvc_emu_shared) : 0;
}

std::string where(Thread const& t) {
  Runtime& r = rt();
  char buf[256];
  std::snprintf(buf, sizeof buf, "kernel %s, block (%u, %u, %u), thread (%u, %u, %u)", r.launch.name, block_idx.x,
                block_idx.y, block_idx.z, t.idx.x, t.idx.y, t.idx.z);
  return buf;
}

std::string site_text(Site s) {
  return std::string(s.file ? s.file : "?") + ":" + std::to_string(s.line);
}

std::string pc_text(void* pc) {
  char buf[512] = "";
  if (pc && __sanitizer_symbolize_pc)
    __sanitizer_symbolize_pc(static_cast<char*>(pc) - 1, "%s:%l (%f)", buf, sizeof buf);
  Dl_info info{};
  if (buf[0] == '\0' && dladdr(pc, &info) && info.dli_fname)  // for addr2line -e BINARY OFFSET
    std::snprintf(buf, sizeof buf, "%s+%#zx", info.dli_fname,
                  static_cast<std::size_t>(static_cast<char*>(pc) - static_cast<char*>(info.dli_fbase) - 1));
  else if (buf[0] == '\0')
    std::snprintf(buf, sizeof buf, "pc %p", pc);
  return buf;
}

bool same_site(Site a, Site b) {
  return a.line == b.line && (a.file == b.file || (a.file && b.file && std::string_view(a.file) == b.file));
}

void report_at_exit() {
  Runtime& r = rt();
  if (r.violation_pending) {
    std::fprintf(stderr, "kvc CUDA emulator: a kernel violation was never taken by a test: %s\n", r.violation.c_str());
    std::fflush(stderr);
    std::_Exit(1);
  }
}

void record_violation(std::string const& what) {
  Runtime& r = rt();
  if (r.violation.empty()) {
    r.violation = what;
    static bool registered = false;
    if (!registered) {
      std::atexit(report_at_exit);
      registered = true;
    }
  }
  r.violation_pending = true;
  r.aborted = true;
  std::fprintf(stderr, "kvc CUDA emulator: %s\n", what.c_str());
  std::fflush(stderr);
}

// ---- Switching ----------------------------------------------------------------------------------------------------

void resume(Thread& t) {
  Runtime& r = rt();
  r.current = &t;
  thread_idx = t.idx;
  running = true;
#if KVC_EMU_ASAN
  __sanitizer_start_switch_fiber(&r.scheduler_fake_stack, t.stack, stack_bytes);
#endif
  switch_context(&r.scheduler, t.context);
#if KVC_EMU_ASAN
  __sanitizer_finish_switch_fiber(r.scheduler_fake_stack, nullptr, nullptr);
  if (t.state == State::exited || r.aborted) {
    // The fiber left for good from inside thread_exit / fail, whose frames never return and so keep their redzones
    // poisoned; the next block's fiber on this stack would trip over them. Its live frames lie above the stack
    // pointer it saved.
    char* const sp = static_cast<char*>(static_cast<void*>(t.context)) - 256;
    char* const top = t.stack + stack_bytes;
    if (sp >= t.stack && sp < top)
      __asan_unpoison_memory_region(sp, static_cast<std::size_t>(top - sp));
  }
#endif
  running = false;
  r.current = nullptr;
}

/// Back to the scheduler from the running fiber; returns when the scheduler resumes it (never if `final`).
void yield(bool final) {
  Runtime& r = rt();
  Thread& me = *r.current;
  running = false;
#if KVC_EMU_ASAN
  __sanitizer_start_switch_fiber(final ? nullptr : &me.fake_stack, r.scheduler_bottom, r.scheduler_size);
#endif
  switch_context(&me.context, r.scheduler);
#if KVC_EMU_ASAN
  __sanitizer_finish_switch_fiber(me.fake_stack, &r.scheduler_bottom, &r.scheduler_size);
#endif
  running = true;
  (void) final;
}

/// A violation found on a fiber: the launch is abandoned (this fiber is never resumed). Called once the message is
/// recorded and every temporary of it destroyed (KVC_EMU_FAIL): the abandoned frames keep no heap memory.
[[noreturn]] void fail_recorded() {
  yield(true);
  std::abort();  // not reached
}

/// Records the message (the expression's temporaries end with the statement), then abandons the launch.
#define KVC_EMU_FAIL(message)  \
  do {                         \
    record_violation(message); \
    fail_recorded();           \
  } while (false)

void thread_exit();

void fiber_main(void* arg) {
  Runtime& r = rt();
#if KVC_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &r.scheduler_bottom, &r.scheduler_size);
#endif
  (void)arg;
  running = true;
  (*r.body)();
  thread_exit();
}

// ---- Barriers and warps -------------------------------------------------------------------------------------------

void release_barrier() {
  Runtime& r = rt();
  for (Thread& t : r.threads)
    if (t.state == State::at_barrier)
      t.state = State::ready;
  r.waiting = 0;
  r.exited_since_barrier = 0;
  ++r.epoch;
}

std::string thread_name(int linear) {
  Runtime& r = rt();
  uint3 const i = r.threads[static_cast<std::size_t>(linear)].idx;
  return "(" + std::to_string(i.x) + ", " + std::to_string(i.y) + ", " + std::to_string(i.z) + ")";
}

void thread_exit() {
  Runtime& r = rt();
  Thread& me = *r.current;
  me.state = State::exited;
  --r.live;
  ++r.exited_since_barrier;
  r.last_exited = me.linear;
  if (r.waiting > 0)
    KVC_EMU_FAIL("divergent __syncthreads: " + where(me) +
                 " returned while other threads wait at the __syncthreads at " + site_text(r.barrier_site));
  WarpState const& w = r.warps[static_cast<std::size_t>(me.linear / 32)];
  if (w.arrived != 0 && (w.mask >> (me.linear % 32) & 1u))
    KVC_EMU_FAIL("inactive lane: " + where(me) +
                 " returned while lanes of its warp wait for it in the warp intrinsic at " + site_text(w.site));
  yield(true);
}

}  // namespace

void sync_threads(Site site) {
  Runtime& r = rt();
  Thread& me = *r.current;
  if (r.exited_since_barrier > 0)
    KVC_EMU_FAIL("divergent __syncthreads: " + where(me) + " waits at " + site_text(site) + " but thread " +
                 thread_name(r.last_exited) + " returned without reaching it");
  if (r.waiting == 0)
    r.barrier_site = site;
  else if (!same_site(site, r.barrier_site))
    KVC_EMU_FAIL("divergent __syncthreads: " + where(me) + " waits at " + site_text(site) +
                 " while other threads wait at " + site_text(r.barrier_site));
  me.state = State::at_barrier;
  me.site = site;
  if (++r.waiting == r.live)
    release_barrier();  // the last one to arrive goes on at once
  else
    yield(false);
}

std::uint64_t warp_op(WarpOp op, unsigned mask, std::uint64_t value, int operand, int width, Site site) {
  static char const* const names[] = {"__syncwarp",       "__shfl_sync",   "__shfl_xor_sync", "__shfl_up_sync",
                                      "__shfl_down_sync", "__ballot_sync", "__any_sync",      "__all_sync"};
  Runtime& r = rt();
  Thread& me = *r.current;
  int const lane = me.linear % 32, warp = me.linear / 32;
  char const* const name = names[static_cast<int>(op)];
  if (!(mask >> lane & 1u))
    KVC_EMU_FAIL(std::string(name) + " at " + site_text(site) + ": " + where(me) +
                 " calls it with a mask that excludes its own lane");
  if (width < 1 || width > 32 || (width & (width - 1)) != 0)
    KVC_EMU_FAIL(std::string(name) + " at " + site_text(site) + ": width " + std::to_string(width) +
                 " is not a power of two up to 32");
  WarpState& w = r.warps[static_cast<std::size_t>(warp)];
  if (w.arrived == 0) {
    // The first lane to arrive checks the mask's lanes (one that returns later while others wait fails in
    // thread_exit); the others only need to match it.
    for (int l = 0; l < 32; ++l) {
      if (!(mask >> l & 1u))
        continue;
      auto const id = static_cast<std::size_t>(warp * 32 + l);
      if (id >= r.threads.size())
        KVC_EMU_FAIL("inactive lane: " + std::string(name) + " at " + site_text(site) + " (" + where(me) +
                     ") names lane " + std::to_string(l) + " in its mask, which the block (" +
                     std::to_string(r.threads.size()) + " threads) does not have");
      if (r.threads[id].state == State::exited)
        KVC_EMU_FAIL("inactive lane: " + std::string(name) + " at " + site_text(site) + " (" + where(me) +
                     ") names lane " + std::to_string(l) + " in its mask, which has returned");
    }
    w.op = op;
    w.mask = mask;
    w.site = site;
  } else if (w.op != op || w.mask != mask || !same_site(w.site, site)) {
    char m[2][16];
    std::snprintf(m[0], sizeof m[0], "%#x", mask);
    std::snprintf(m[1], sizeof m[1], "%#x", w.mask);
    KVC_EMU_FAIL("divergent warp: " + where(me) + " calls " + name + " (mask " + m[0] + ") at " + site_text(site) +
                 " while other lanes wait in " + names[static_cast<int>(w.op)] + " (mask " + m[1] + ") at " +
                 site_text(w.site));
  }
  me.warp_in = value;
  me.warp_operand = operand;
  me.warp_width = width;
  w.arrived |= 1u << lane;
  if (w.arrived != mask) {
    me.state = State::at_warp;
    me.site = site;
    yield(false);
    return me.warp_out;
  }
  // The last lane to arrive computes every lane's result, then all go on.
  unsigned votes = 0;
  for (int l = 0; l < 32; ++l)
    if ((mask >> l & 1u) && r.threads[static_cast<std::size_t>(warp * 32 + l)].warp_in != 0)
      votes |= 1u << l;
  for (int l = 0; l < 32; ++l) {
    if (!(mask >> l & 1u))
      continue;
    Thread& t = r.threads[static_cast<std::size_t>(warp * 32 + l)];
    int const seg = t.warp_width, base = l & ~(seg - 1);
    int src = l;
    switch (op) {
      case WarpOp::shfl: src = base + (t.warp_operand & (seg - 1)); break;
      case WarpOp::shfl_xor: src = l ^ t.warp_operand; break;
      case WarpOp::shfl_up: src = l - t.warp_operand; break;
      case WarpOp::shfl_down: src = l + t.warp_operand; break;
      default: break;
    }
    if (src < base || src >= base + seg)
      src = l;  // outside the lane's segment: its own value
    if (op == WarpOp::shfl || op == WarpOp::shfl_xor || op == WarpOp::shfl_up || op == WarpOp::shfl_down) {
      if (!(mask >> src & 1u))
        KVC_EMU_FAIL("inactive lane: " + std::string(name) + " at " + site_text(site) + ": lane " + std::to_string(l) +
                     " of " + where(me) + "'s warp reads lane " + std::to_string(src) + ", which is not in the mask");
      t.warp_out = r.threads[static_cast<std::size_t>(warp * 32 + src)].warp_in;
    } else if (op == WarpOp::ballot) {
      t.warp_out = votes;
    } else if (op == WarpOp::any) {
      t.warp_out = votes != 0;
    } else if (op == WarpOp::all) {
      t.warp_out = votes == mask;
    }
    if (t.state == State::at_warp)
      t.state = State::ready;
  }
  w.arrived = 0;
  if (op == WarpOp::sync)
    ++w.epoch;
  return me.warp_out;
}

// ---- Shared memory ------------------------------------------------------------------------------------------------

namespace {

/// An earlier access that races with a new one, and what it did.
struct Race {
  Access const* other = nullptr;  // null: no race
  char const* kind = nullptr;
};

/// An earlier access x is ordered before one by thread now.tid of warp `warp` when it is that thread's, from before the
/// last __syncthreads, or from a lane of that warp before its last __syncwarp.
KVC_EMU_UNSANITIZED inline bool ordered(Access const& x, Access const& now, int warp) {
  return x.tid < 0 || x.epoch != now.epoch || x.tid == now.tid ||
         (x.tid / 32 == warp && x.warp_epoch != now.warp_epoch);
}

/// Checks one byte's history against an access by thread now.tid of warp `warp` and records the access. Returns the
/// earlier access it races with (the cell is then left as it was), if any.
KVC_EMU_UNSANITIZED inline Race record(Cell& c, Access const& now, int warp, bool write, bool atomic, void* pc) {
  if (!ordered(c.write, now, warp) && !(atomic && c.write_atomic))
    return {&c.write, "wrote"};
  if (write && !ordered(c.read, now, warp) && !(atomic && c.read_atomic))
    return {&c.read, "read"};
  if (write && !atomic && c.other_readers && c.read.epoch == now.epoch &&
      !(c.others_warp == warp && c.others_warp_epoch != now.warp_epoch))
    return {&c.read, "read (with other threads)"};
  if (write) {
    c.write = now;
    c.write_atomic = atomic;
    c.write_pc = pc;
    c.read = Access{};
    c.other_readers = false;
  } else {
    if (c.read.epoch != now.epoch)
      c.other_readers = false;
    if (!ordered(c.read, now, warp)) {  // the last reader and this one are unordered: remember the other's warp
      int const other_warp = c.read.tid / 32;
      c.others_warp = static_cast<std::int16_t>(
          (!c.other_readers || c.others_warp == other_warp) && other_warp == warp ? warp : -1);
      c.others_warp_epoch = c.read.warp_epoch;
      c.other_readers = true;
    }
    c.read = now;
    c.read_atomic = atomic;
  }
  return {};
}

KVC_EMU_UNSANITIZED void access(void const* p, std::size_t bytes, bool write, bool atomic, void* pc) {
  Runtime& r = rt();
  auto const a = reinterpret_cast<std::uintptr_t>(p);
  auto const s0 = reinterpret_cast<std::uintptr_t>(static_shared_begin());
  std::size_t const ss = static_shared_size();
  auto const d0 = reinterpret_cast<std::uintptr_t>(r.dynamic_base);
  std::size_t offset = 0;
  char const* space = "static";
  if (a - s0 < ss) {
    offset = a - s0;
    if (offset + bytes > ss)
      KVC_EMU_FAIL("shared-memory overrun: " + where(*r.current) + " accesses " + std::to_string(bytes) +
                   " bytes past the end of the static __shared__ variables at " + pc_text(pc));
  } else if (a - d0 < r.dynamic_size) {
    offset = ss + (a - d0);
    space = "dynamic";
    if (a - d0 + bytes > r.dynamic_size)
      KVC_EMU_FAIL("shared-memory overrun: " + where(*r.current) + " accesses bytes " + std::to_string(a - d0) + ".." +
                   std::to_string(a - d0 + bytes - 1) + " of the dynamic shared memory, launched with " +
                   std::to_string(r.dynamic_size) + " bytes, at " + pc_text(pc));
  } else {
    auto const region = reinterpret_cast<std::uintptr_t>(r.dynamic_region);
    if (r.dynamic_region && a - region < 2 * dynamic_guard + static_cast<std::size_t>(optin_shared_limit))
      KVC_EMU_FAIL("shared-memory overrun: " + where(*r.current) + " accesses byte " +
                   std::to_string(static_cast<long long>(a - d0)) + " of the dynamic shared memory, launched with " +
                   std::to_string(r.dynamic_size) + " bytes, at " + pc_text(pc));
    return;
  }
  Thread const& me = *r.current;
  int const tid = me.linear, warp = tid / 32;
  std::uint32_t const epoch = r.epoch;
  auto const warp_epoch = static_cast<std::uint16_t>(r.warps.data()[warp].epoch);
  Access const now{epoch, warp_epoch, static_cast<std::int16_t>(tid)};
  Cell* const first = r.shadow.data() + offset;
  // The bytes of one access almost always share their history (the same earlier accesses covered all of them): the
  // check and the update of such a byte are those of the first, so only bytes that differ from it are checked again.
  Cell const before = *first;
  for (Cell *c = first, *end = first + bytes; c != end; ++c) {
    if (c != first && std::memcmp(c, &before, sizeof(Cell)) == 0) {
      *c = *first;
      continue;
    }
    if (Race const race = record(*c, now, warp, write, atomic, pc); race.other) [[unlikely]] {
      Thread const& o = r.threads[static_cast<std::size_t>(race.other->tid)];
      std::size_t const byte = offset + static_cast<std::size_t>(c - first) - (space[0] == 'd' ? ss : 0);
      KVC_EMU_FAIL("shared-memory race: " + where(me) + (write ? " writes" : " reads") + " byte " +
                   std::to_string(byte) + " of the " + space + " shared memory at " + pc_text(pc) + ", which thread (" +
                   std::to_string(o.idx.x) + ", " + std::to_string(o.idx.y) + ", " + std::to_string(o.idx.z) + ") " +
                   race.kind + (race.other == &c->write ? " at " + pc_text(c->write_pc) : std::string()) +
                   " with no barrier between them");
    }
  }
}

KVC_EMU_UNSANITIZED inline void trace(void const* p, std::size_t bytes, bool write, void* pc) {
  auto const a = reinterpret_cast<std::uintptr_t>(p);
  if (running && (a - watch_lo[0] < watch_size[0] || a - watch_lo[1] < watch_size[1])) [[unlikely]]
    access(p, bytes, write, false, pc);
}

}  // namespace

void atomic_begin(void const* p, std::size_t bytes) noexcept {
  if (running) {
    access(p, bytes, true, true, __builtin_return_address(0));
    running = false;  // the operation's own loads and stores are not plain accesses
  }
}
void atomic_end() noexcept {
  running = rt().current != nullptr;
}

void* dynamic_shared() noexcept {
  return rt().dynamic_base;
}

// ---- Launch -------------------------------------------------------------------------------------------------------

namespace {

cudaError_t set_error(cudaError_t e) {
  Runtime& r = rt();
  if (e != cudaSuccess)
    r.last_error = e;
  return e;
}

bool map_memory(Runtime& r) {
  if (r.stacks)
    return true;
  std::size_t const per = stack_bytes + guard_bytes;
  void* s =
      mmap(nullptr, per * max_threads, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (s == MAP_FAILED)
    return false;
  r.stacks = static_cast<char*>(s);
  if (__lsan_register_root_region)
    __lsan_register_root_region(r.stacks, per * max_threads);
  for (int i = 0; i < max_threads; ++i)  // a guard page below each stack: an overflow faults instead of corrupting
    mprotect(r.stacks + static_cast<std::size_t>(i) * per, guard_bytes, PROT_NONE);
  std::size_t const region = 2 * dynamic_guard + static_cast<std::size_t>(optin_shared_limit);
  void* d = mmap(nullptr, region, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (d == MAP_FAILED)
    return false;
  r.dynamic_region = static_cast<char*>(d);
  mprotect(r.dynamic_region + dynamic_guard, static_cast<std::size_t>(optin_shared_limit), PROT_READ | PROT_WRITE);
  watch_lo[0] = reinterpret_cast<std::uintptr_t>(static_shared_begin());
  watch_size[0] = static_shared_size();
  watch_lo[1] = reinterpret_cast<std::uintptr_t>(r.dynamic_region);
  watch_size[1] = region;
  return true;
}

void run_block(Runtime& r) {
  ++r.epoch;
  std::size_t const n = r.threads.size();
  for (std::size_t i = 0; i < n; ++i) {
    Thread& t = r.threads[i];
    t.state = State::ready;
    t.fake_stack = nullptr;
    t.context = new_context(t.stack, stack_bytes, &fiber_main, &t);
  }
  for (WarpState& w : r.warps)
    w = WarpState{};
  r.live = static_cast<int>(n);
  r.waiting = 0;
  r.exited_since_barrier = 0;
  r.last_exited = -1;
  std::memset(r.dynamic_base, 0xff, r.dynamic_size);  // shared memory starts undefined: never zero by luck
  while (r.live > 0 && !r.aborted) {
    bool ran = false;
    for (std::size_t i = 0; i < n && !r.aborted; ++i)
      if (r.threads[i].state == State::ready) {
        resume(r.threads[i]);
        ran = true;
      }
    if (!ran && r.live > 0 && !r.aborted) {  // everyone waits: say for what
      std::string what = "deadlock in kernel " + std::string(r.launch.name) + ", block (" +
                         std::to_string(block_idx.x) + ", " + std::to_string(block_idx.y) + ", " +
                         std::to_string(block_idx.z) + "):";
      for (Thread const& t : r.threads)
        if (t.state == State::at_barrier || t.state == State::at_warp) {
          what += " thread " + thread_name(t.linear) + " waits at " +
                  (t.state == State::at_barrier ? "__syncthreads " : "a warp intrinsic ") + site_text(t.site) + ";";
          if (what.size() > 600)
            break;
        }
      record_violation(what);
    }
  }
#if KVC_EMU_ASAN
  if (r.aborted)  // abandoned fibers leave their frames' redzones poisoned on stacks the next launch reuses
    __asan_unpoison_memory_region(r.stacks, (stack_bytes + guard_bytes) * static_cast<std::size_t>(max_threads));
#endif
}

}  // namespace

namespace {
/// Global capture mode's rule for stream work: on the legacy default stream while some stream captures, it fails
/// (cudaErrorStreamCaptureImplicit) and invalidates every capture; on an invalidated capturing stream it fails.
cudaError_t capture_gate(cudaStream_t s) {
  Runtime& r = rt();
  if (s == nullptr && !r.capturing.empty()) {
    for (CUstream_st* c : r.capturing)
      c->capture = cudaStreamCaptureStatusInvalidated;
    return cudaErrorStreamCaptureImplicit;
  }
  if (s && s->capture == cudaStreamCaptureStatusInvalidated)
    return cudaErrorStreamCaptureInvalidated;
  return cudaSuccess;
}

/// Global capture mode's rule for synchronous calls: while some stream captures they fail
/// (cudaErrorStreamCaptureUnsupported) and invalidate every capture.
cudaError_t unsafe_during_capture() {
  Runtime& r = rt();
  if (r.capturing.empty())
    return cudaSuccess;
  for (CUstream_st* c : r.capturing)
    c->capture = cudaStreamCaptureStatusInvalidated;
  return cudaErrorStreamCaptureUnsupported;
}

/// Whether the launch's configuration is one the driver accepts (as launch() documents).
cudaError_t check_configuration(Runtime& r, Launch const& l) {
  unsigned long long const threads = 1ull * l.block.x * l.block.y * l.block.z;
  if (threads == 0 || threads > max_threads || l.grid.x == 0 || l.grid.y == 0 || l.grid.z == 0 ||
      l.grid.x > 0x7fffffffu || l.grid.y > 65535 || l.grid.z > 65535 || l.block.z > 64)
    return cudaErrorInvalidConfiguration;
  // As the driver: dynamic bytes within the kernel's allowance, static + dynamic within the device's opt-in limit.
  auto const it = r.functions.find(l.func);
  Runtime::Function const f = it == r.functions.end() ? Runtime::Function{} : it->second;
  if (l.shared_bytes > static_cast<std::size_t>(f.max_dynamic) ||
      l.shared_bytes + static_cast<std::size_t>(f.static_bytes) > static_cast<std::size_t>(optin_shared_limit))
    return cudaErrorInvalidValue;
  return cudaSuccess;
}

/// Runs a launch (r.mutex held, configuration checked).
cudaError_t execute(Runtime& r, Launch const& l, std::function<void()> const& body) {
  unsigned long long const threads = 1ull * l.block.x * l.block.y * l.block.z;
  if (!map_memory(r))
    return set_error(cudaErrorMemoryAllocation);

  r.launch = l;
  r.body = &body;
  r.aborted = false;
  grid_dim = l.grid;
  block_dim = l.block;
  r.threads.assign(static_cast<std::size_t>(threads), Thread{});
  for (std::size_t i = 0; i < r.threads.size(); ++i) {
    Thread& t = r.threads[i];
    t.linear = static_cast<int>(i);
    t.idx = uint3{static_cast<unsigned>(i % l.block.x), static_cast<unsigned>(i / l.block.x % l.block.y),
                  static_cast<unsigned>(i / (l.block.x * l.block.y))};
    t.stack = r.stacks + i * (stack_bytes + guard_bytes) + guard_bytes;
  }
  r.warps.assign((r.threads.size() + 31) / 32, WarpState{});
  std::size_t const aligned = (l.shared_bytes + 15) & ~std::size_t{15};
  r.dynamic_base = r.dynamic_region + dynamic_guard + static_cast<std::size_t>(optin_shared_limit) - aligned;
  r.dynamic_size = l.shared_bytes;
  std::size_t const ss = static_shared_size();
  if (r.shadow.size() < ss + static_cast<std::size_t>(optin_shared_limit))
    r.shadow.resize(ss + static_cast<std::size_t>(optin_shared_limit));
  if (ss)
    std::memset(static_shared_begin(), 0xff, ss);

  for (unsigned z = 0; z < l.grid.z && !r.aborted; ++z)
    for (unsigned y = 0; y < l.grid.y && !r.aborted; ++y)
      for (unsigned x = 0; x < l.grid.x && !r.aborted; ++x) {
        block_idx = uint3{x, y, z};
        run_block(r);
      }
  r.threads.clear();
  r.body = nullptr;
  if (r.aborted) {
    r.sticky = cudaErrorLaunchFailure;
    return set_error(cudaErrorLaunchFailure);
  }
  return cudaSuccess;
}
}  // namespace

cudaError_t launch(Launch const& l, std::function<void()> const& body) {
  Runtime& r = rt();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (r.sticky != cudaSuccess)
    return set_error(r.sticky);
  ++r.counters.launches;
  ++(l.stream ? r.counters.other_stream_ops : r.counters.default_stream_ops);
  if (cudaError_t const e = capture_gate(l.stream); e != cudaSuccess)
    return set_error(e);
  if (cudaError_t const e = check_configuration(r, l); e != cudaSuccess)
    return set_error(e);
  if (l.stream && l.stream->capture == cudaStreamCaptureStatusActive) {
    l.stream->captured.push_back(GraphNode{l, body});
    return cudaSuccess;
  }
  return execute(r, l, body);
}

char const* violation() noexcept {
  return rt().violation.c_str();
}

std::string_view take_violation() noexcept {
  Runtime& r = rt();
  static std::string taken;
  taken = r.violation;
  r.violation.clear();
  r.violation_pending = false;
  r.sticky = cudaSuccess;
  r.last_error = cudaSuccess;
  return taken;
}

Counters counters() noexcept {
  return rt().counters;
}
void reset_counters() noexcept {
  rt().counters = Counters{};
}

namespace {
/// Under a sanitizer, its report is followed by the emulated thread that was running.
void print_running_thread() {
  Runtime& r = rt();
  if (r.current)
    std::fprintf(stderr, "kvc CUDA emulator: the report above happened in %s\n", where(*r.current).c_str());
}
[[maybe_unused]] bool const death_callback_installed = [] {
  if (__sanitizer_set_death_callback)
    __sanitizer_set_death_callback(print_running_thread);
  return true;
}();
}  // namespace

}  // namespace kvc::emu

// ---- Memory hooks (Clang's -fsanitize-coverage=trace-loads,trace-stores) -------------------------------------------
extern "C" {
#define KVC_EMU_HOOK(bytes, type)                                  \
  KVC_EMU_UNSANITIZED void __sanitizer_cov_load##bytes(type* p) {  \
    kvc::emu::trace(p, bytes, false, __builtin_return_address(0)); \
  }                                                                \
  KVC_EMU_UNSANITIZED void __sanitizer_cov_store##bytes(type* p) { \
    kvc::emu::trace(p, bytes, true, __builtin_return_address(0));  \
  }
KVC_EMU_HOOK(1, std::uint8_t)
KVC_EMU_HOOK(2, std::uint16_t)
KVC_EMU_HOOK(4, std::uint32_t)
KVC_EMU_HOOK(8, std::uint64_t)
KVC_EMU_HOOK(16, __int128)
#undef KVC_EMU_HOOK
// The coverage counters that trace-loads needs as its base (-fsanitize-coverage=inline-8bit-counters) are not used.
__attribute__((weak)) void __sanitizer_cov_8bit_counters_init(char*, char*) {}
}

// ---- Runtime API ----------------------------------------------------------------------------------------------------

using kvc::emu::rt;

cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  return device == 0 ? cudaSuccess : kvc::emu::set_error(cudaErrorInvalidDevice);
}
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device != 0)
    return kvc::emu::set_error(cudaErrorInvalidDevice);
  switch (attr) {  // an H100 (sm_90)
    case cudaDevAttrMaxThreadsPerBlock: *value = 1024; break;
    case cudaDevAttrMaxGridDimX: *value = 0x7fffffff; break;
    case cudaDevAttrMaxGridDimY:
    case cudaDevAttrMaxGridDimZ: *value = 65535; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = kvc::emu::default_shared_limit; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = kvc::emu::optin_shared_limit; break;
    case cudaDevAttrWarpSize: *value = 32; break;
    case cudaDevAttrMultiProcessorCount: *value = 132; break;
    case cudaDevAttrComputeCapabilityMajor: *value = 9; break;
    case cudaDevAttrComputeCapabilityMinor: *value = 0; break;
    default: return kvc::emu::set_error(cudaErrorInvalidValue);
  }
  return cudaSuccess;
}

namespace {
cudaError_t synchronisation() {
  auto& r = rt();
  ++r.counters.synchronizations;
  if (cudaError_t const e = kvc::emu::unsafe_during_capture(); e != cudaSuccess)
    return kvc::emu::set_error(e);
  return r.sticky != cudaSuccess ? kvc::emu::set_error(r.sticky) : cudaSuccess;
}
cudaError_t stream_op(cudaStream_t s) {
  auto& r = rt();
  ++(s ? r.counters.other_stream_ops : r.counters.default_stream_ops);
  if (cudaError_t const e = kvc::emu::capture_gate(s); e != cudaSuccess)
    return kvc::emu::set_error(e);
  return r.sticky != cudaSuccess ? kvc::emu::set_error(r.sticky) : cudaSuccess;
}
/// Whether `s` records its work (then the operation is appended to its capture instead of running).
bool capturing(cudaStream_t s) {
  return s && s->capture == cudaStreamCaptureStatusActive;
}
}  // namespace

cudaError_t cudaDeviceSynchronize() {
  return synchronisation();
}
cudaError_t cudaGetLastError() {
  auto& r = rt();
  cudaError_t const e = r.sticky != cudaSuccess ? r.sticky : r.last_error;
  r.last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() {
  auto& r = rt();
  return r.sticky != cudaSuccess ? r.sticky : r.last_error;
}
char const* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorIllegalState: return "cudaErrorIllegalState";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorStreamCaptureImplicit: return "cudaErrorStreamCaptureImplicit";
  }
  return "cudaErrorUnknown";
}
char const* cudaGetErrorString(cudaError_t e) {
  if (e == cudaErrorLaunchFailure && !rt().violation.empty())
    return rt().violation.c_str();  // the emulator's diagnosis says more than "unspecified launch failure"
  return cudaGetErrorName(e);
}

cudaError_t cudaMalloc(void** p, std::size_t bytes) {
  auto& r = rt();
  ++r.counters.allocations;
  *p = nullptr;
  if (cudaError_t const e = kvc::emu::unsafe_during_capture(); e != cudaSuccess)
    return kvc::emu::set_error(e);
  if (r.sticky != cudaSuccess)
    return kvc::emu::set_error(r.sticky);
  if (bytes == 0)
    return cudaSuccess;
  // The exact size (no rounding): AddressSanitizer then catches a kernel reading one element past a buffer.
  if (posix_memalign(p, 256, bytes) != 0) {
    *p = nullptr;
    return kvc::emu::set_error(cudaErrorMemoryAllocation);
  }
  std::memset(*p, 0xff, bytes);  // device memory starts undefined
  return cudaSuccess;
}
cudaError_t cudaFree(void* p) {
  ++rt().counters.allocations;
  if (cudaError_t const e = kvc::emu::unsafe_during_capture(); e != cudaSuccess)
    return kvc::emu::set_error(e);
  std::free(p);
  return cudaSuccess;
}
namespace {
/// A copy or set, synchronous or not, once `gate` (its counting, and the sticky error) let it through.
cudaError_t copy(cudaError_t gate, void* dst, void const* src, std::size_t bytes) {
  if (gate != cudaSuccess)
    return gate;
  if (bytes && (!dst || !src))
    return kvc::emu::set_error(cudaErrorInvalidValue);
  if (bytes)
    std::memmove(dst, src, bytes);
  return cudaSuccess;
}
cudaError_t set(cudaError_t gate, void* p, int value, std::size_t bytes) {
  if (gate != cudaSuccess)
    return gate;
  if (bytes && !p)
    return kvc::emu::set_error(cudaErrorInvalidValue);
  if (bytes)
    std::memset(p, value, bytes);
  return cudaSuccess;
}
}  // namespace

cudaError_t cudaMemcpy(void* dst, void const* src, std::size_t bytes, cudaMemcpyKind) {
  return copy(synchronisation(), dst, src, bytes);
}
cudaError_t cudaMemcpyAsync(void* dst, void const* src, std::size_t bytes, cudaMemcpyKind, cudaStream_t s) {
  cudaError_t const gate = stream_op(s);
  if (gate != cudaSuccess || !capturing(s))
    return copy(gate, dst, src, bytes);
  if (bytes && (!dst || !src))
    return kvc::emu::set_error(cudaErrorInvalidValue);
  s->captured.push_back(kvc::emu::GraphNode{{}, {}, dst, src, bytes, 0});
  return cudaSuccess;
}
cudaError_t cudaMemset(void* p, int value, std::size_t bytes) {
  return set(synchronisation(), p, value, bytes);
}
cudaError_t cudaMemsetAsync(void* p, int value, std::size_t bytes, cudaStream_t s) {
  cudaError_t const gate = stream_op(s);
  if (gate != cudaSuccess || !capturing(s))
    return set(gate, p, value, bytes);
  if (bytes && !p)
    return kvc::emu::set_error(cudaErrorInvalidValue);
  s->captured.push_back(kvc::emu::GraphNode{{}, {}, p, nullptr, bytes, value});
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* s) {
  *s = new CUstream_st{rt().next_stream++, cudaStreamCaptureStatusNone, {}};
  return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) {
  return cudaStreamCreate(s);
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  auto& c = rt().capturing;
  c.erase(std::remove(c.begin(), c.end(), s), c.end());
  delete s;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) {
  return synchronisation();
}
cudaError_t cudaEventCreate(cudaEvent_t* e) {
  *e = new CUevent_st{};
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) {
  return cudaEventCreate(e);
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete e;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  if (!e)
    return kvc::emu::set_error(cudaErrorInvalidResourceHandle);
  if (capturing(s)) {  // events in graphs (fork and join of streams) are not emulated
    s->capture = cudaStreamCaptureStatusInvalidated;
    return kvc::emu::set_error(cudaErrorStreamCaptureUnsupported);
  }
  e->when = std::chrono::steady_clock::now();  // work before it on the stream has run: launches are synchronous
  e->recorded = true;
  return stream_op(s);
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  if (!e)
    return kvc::emu::set_error(cudaErrorInvalidResourceHandle);
  return synchronisation();
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t stop) {
  if (!start || !stop || !start->recorded || !stop->recorded)
    return kvc::emu::set_error(cudaErrorInvalidResourceHandle);
  *ms = std::chrono::duration<float, std::milli>(stop->when - start->when).count();
  return cudaSuccess;
}

cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attr, void const* func) {
  auto& r = rt();
  auto const it = r.functions.find(func);
  auto const f = it == r.functions.end() ? kvc::emu::Runtime::Function{} : it->second;
  *attr = cudaFuncAttributes{};
  attr->sharedSizeBytes = static_cast<std::size_t>(f.static_bytes);
  attr->maxThreadsPerBlock = kvc::emu::max_threads;
  attr->maxDynamicSharedSizeBytes = f.max_dynamic;
  return cudaSuccess;
}
cudaError_t cudaFuncSetAttribute(void const* func, cudaFuncAttribute attr, int value) {
  auto& f = rt().functions[func];
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 ||
      value + f.static_bytes > kvc::emu::optin_shared_limit)
    return kvc::emu::set_error(cudaErrorInvalidValue);
  f.max_dynamic = value;
  return cudaSuccess;
}

void kvc::emu::set_static_shared_bytes(void const* func, std::size_t bytes) noexcept {
  auto& f = rt().functions[func];
  f.static_bytes = static_cast<int>(bytes);
  f.max_dynamic = default_shared_limit - f.static_bytes > 0 ? default_shared_limit - f.static_bytes : 0;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode) {
  auto& r = rt();
  if (s == nullptr)  // the legacy default stream cannot capture
    return kvc::emu::set_error(cudaErrorStreamCaptureUnsupported);
  if (s->capture != cudaStreamCaptureStatusNone)
    return kvc::emu::set_error(cudaErrorIllegalState);
  if (mode != cudaStreamCaptureModeGlobal)  // the only mode emulated (kvc's tests use it)
    return kvc::emu::set_error(cudaErrorInvalidValue);
  s->capture = cudaStreamCaptureStatusActive;
  s->captured.clear();
  r.capturing.push_back(s);
  return cudaSuccess;
}
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t* graph) {
  auto& r = rt();
  if (graph == nullptr)
    return kvc::emu::set_error(cudaErrorInvalidValue);
  *graph = nullptr;
  if (s == nullptr || s->capture == cudaStreamCaptureStatusNone)
    return kvc::emu::set_error(cudaErrorIllegalState);
  bool const valid = s->capture == cudaStreamCaptureStatusActive;
  s->capture = cudaStreamCaptureStatusNone;
  r.capturing.erase(std::remove(r.capturing.begin(), r.capturing.end(), s), r.capturing.end());
  std::vector<kvc::emu::GraphNode> nodes;
  nodes.swap(s->captured);
  if (!valid)
    return kvc::emu::set_error(cudaErrorStreamCaptureInvalidated);
  *graph = new CUgraph_st{std::move(nodes)};
  return cudaSuccess;
}
cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus* status) {
  if (status == nullptr)
    return kvc::emu::set_error(cudaErrorInvalidValue);
  *status = s ? s->capture : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long) {
  if (exec == nullptr || graph == nullptr)
    return kvc::emu::set_error(cudaErrorInvalidValue);
  *exec = new CUgraphExec_st{graph->nodes};
  return cudaSuccess;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s) {
  auto& r = rt();
  if (exec == nullptr)
    return kvc::emu::set_error(cudaErrorInvalidValue);
  ++r.counters.graph_launches;
  if (cudaError_t const e = stream_op(s); e != cudaSuccess)
    return e;
  if (capturing(s))  // a graph launched into a capture (a child graph) is not emulated
    return kvc::emu::set_error(cudaErrorStreamCaptureUnsupported);
  std::lock_guard<std::mutex> lock(r.mutex);
  for (kvc::emu::GraphNode const& n : exec->nodes) {  // in capture order (one stream: a chain)
    cudaError_t const e = n.body  ? kvc::emu::execute(r, n.launch, n.body)
                          : n.src ? copy(cudaSuccess, n.dst, n.src, n.bytes)
                                  : set(cudaSuccess, n.dst, n.value, n.bytes);
    if (e != cudaSuccess)
      return e;
  }
  return cudaSuccess;
}
cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  delete graph;
  return cudaSuccess;
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  delete exec;
  return cudaSuccess;
}
