// tl::parallel_for: the one way tierlm's native kernels run in parallel.
//
// A persistent pool of helper threads, started lazily on the first parallel call. Work is cut
// into chunks of at most `grain` items and claimed through one atomic counter, the calling
// thread included, so the caller never waits for a helper that has not claimed a chunk: a
// descheduled helper costs at most the chunk it holds. Idle helpers spin for a bounded time
// (a decode step issues its next call within microseconds) and then sleep on a futex (Linux;
// a condition variable elsewhere), so they never take a busy core's time between steps.
//
// Adaptive mode (default on): when the caller has to wait for a chunk a late helper holds
// (it was descheduled because another process wants the core), the following calls run on
// the caller alone for a backoff period that doubles while probes keep finding helpers late
// and shrinks again once they are on time. Under contention work then runs at one thread's
// speed instead of stalling a scheduler time slice per call; on a quiet machine every call
// uses all threads.
//
// Controls and statistics are exported by pool.cpp (tierlm_pool_threads / _configure /
// _stats). Stats layout (tierlm_pool_stats(out, n) fills the first n of these doubles):
//   0 calls         parallel_for calls with more than one chunk and threads > 1
//   1 reduced       of those, calls the adaptive mode ran on the caller alone
//   2 late          calls where the caller waited for a late helper (the trigger)
//   3 wait_s        seconds the caller spent waiting for helpers' in-flight chunks
//   4 threads       threads the next call would use (1 while backing off)
//   5 helpers       helper threads started
//   6 backoff_s     the current backoff period
//   7 sleeps        times a helper gave up spinning and slept
//   8 helper_chunks chunks run by helpers
//   9 chunks        chunks run in total by parallel calls
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#if defined(__GNUC__)
#define TL_POOL_HIDDEN __attribute__((visibility("hidden")))
#else
#define TL_POOL_HIDDEN
#endif

// Hidden: every shared library that includes this header has its own pool, even when two are
// loaded into one process.
namespace tl TL_POOL_HIDDEN {

namespace pool_detail {

using Clock = std::chrono::steady_clock;

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

// A 32-bit word threads can sleep on until it changes: a futex on Linux, a condition variable
// elsewhere. wait() may return spuriously; callers re-check the word.
class Signal {
 public:
  std::atomic<uint32_t> word{0};

  void wait(uint32_t expected) {
#if defined(__linux__)
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, nullptr,
            nullptr, 0);
#else
    std::unique_lock<std::mutex> lock(mutex_);
    while (word.load() == expected) cv_.wait(lock);
#endif
  }

  void wake_all() {
#if defined(__linux__)
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr,
            nullptr, 0);
#else
    { std::lock_guard<std::mutex> lock(mutex_); }  // a waiter between check and wait sees the change
    cv_.notify_all();
#endif
  }

 private:
#if !defined(__linux__)
  std::mutex mutex_;
  std::condition_variable cv_;
#endif
};

// Spin until pred() or budget_ns have passed; the clock is read every 64 pauses.
template <class Pred>
inline bool spin_until(Pred pred, int64_t budget_ns) {
  const int64_t start = now_ns();
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (pred()) return true;
      cpu_relax();
    }
    if (now_ns() - start >= budget_ns) return pred();
  }
}

inline int64_t env_int(const char* name, int64_t fallback) {
  const char* text = std::getenv(name);
  if (!text || !*text) return fallback;
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  return end && *end == '\0' && value >= 0 ? value : fallback;
}

inline thread_local bool in_pool_work = false;  // nested calls run inline

}  // namespace pool_detail

class Pool {
 public:
  using Fn = std::function<void(int64_t, int64_t)>;

  // The library's pool; never destroyed, so exit never waits on (or races) a sleeping helper.
  static Pool& instance() {
    static Pool* pool = new Pool();
    return *pool;
  }

  void parallel_for(int64_t n, int64_t grain, int threads, const Fn& fn) {
    using namespace pool_detail;
    if (n <= 0) return;
    grain = std::max<int64_t>(1, grain);
    const int64_t chunks = (n + grain - 1) / grain;
    int want = std::min<int64_t>(std::max(1, threads), chunks);
    if (max_threads_ > 0) want = std::min(want, max_threads_);
    // Chunk numbers live in 32 bits of the ticket; so many chunks would not be worth a pool.
    if (want <= 1 || in_pool_work || chunks > INT32_MAX) return run_inline(n, grain, fn);
    // One parallel call at a time; a second caller (another Python thread) runs inline.
    std::unique_lock<std::mutex> lock(dispatch_, std::try_to_lock);
    if (!lock.owns_lock()) return run_inline(n, grain, fn);

    const int64_t start = now_ns();
    stats_.calls += 1;
    stats_.chunks += chunks;
    if (adaptive_ && start < backoff_until_) {
      stats_.reduced += 1;
      return run_inline(n, grain, fn);
    }
    ensure_helpers(want - 1);
    publish(n, grain, chunks, want - 1, fn);
    const int64_t own = work();  // the caller claims chunks like any helper
    const int64_t claimed = now_ns();
    wait_done(chunks);
    const int64_t finished = now_ns();
    stats_.helper_chunks += chunks - own;
    fn_ = nullptr;
    adapt(finished - claimed, claimed - start, own, finished);
    if (error_) {
      std::exception_ptr error = error_;
      error_ = nullptr;
      std::rethrow_exception(error);
    }
  }

  // max_threads <= 0: no cap beyond each call's `threads`. Resets statistics and backoff.
  void configure(int max_threads, bool adaptive) {
    std::lock_guard<std::mutex> lock(dispatch_);
    max_threads_ = max_threads;
    adaptive_ = adaptive;
    backoff_until_ = 0;
    backoff_ns_ = 0;
    on_time_ = 0;
    stats_ = Stats{};
  }

  // Threads a call asking for `threads` would use now.
  int threads(int threads) const {
    int want = std::max(1, threads);
    if (max_threads_ > 0) want = std::min(want, max_threads_);
    if (adaptive_ && pool_detail::now_ns() < backoff_until_) want = 1;
    return want;
  }

  int max_threads() const { return max_threads_; }

  void stats(double* out, int n) const {
    const double values[] = {double(stats_.calls),
                             double(stats_.reduced),
                             double(stats_.late),
                             stats_.wait_ns * 1e-9,
                             double(threads(max_threads_ > 0 ? max_threads_ : hardware())),
                             double(started_),
                             backoff_ns_ * 1e-9,
                             double(sleeps_.load(std::memory_order_relaxed)),
                             double(stats_.helper_chunks),
                             double(stats_.chunks)};
    const int count = static_cast<int>(sizeof(values) / sizeof(values[0]));
    for (int i = 0; i < n; ++i) out[i] = i < count ? values[i] : 0.0;
  }

  static int hardware() {
    const unsigned count = std::thread::hardware_concurrency();
    return count ? static_cast<int>(count) : 1;
  }

 private:
  struct Stats {
    int64_t calls = 0, reduced = 0, late = 0, wait_ns = 0, helper_chunks = 0, chunks = 0;
  };

  Pool()
      : spin_ns_(pool_detail::env_int("TIERLM_POOL_SPIN_US", 50) * 1000),
        backoff_min_ns_(pool_detail::env_int("TIERLM_POOL_BACKOFF_MIN_US", 2000) * 1000),
        backoff_max_ns_(pool_detail::env_int("TIERLM_POOL_BACKOFF_MAX_US", 256000) * 1000) {
#if defined(__linux__)
    // A forked child has none of the parent's helpers: start afresh there.
    pthread_atfork(nullptr, nullptr, [] { Pool::instance().after_fork(); });
#endif
  }

  void run_inline(int64_t n, int64_t grain, const Fn& fn) {
    for (int64_t begin = 0; begin < n; begin += grain) fn(begin, std::min(n, begin + grain));
  }

  void ensure_helpers(int count) {
    while (started_ < count) {
      const int index = started_++;
      std::thread([this, index] { helper_loop(index); }).detach();
    }
  }

  // The ticket is closed (no chunk claimable) before the job's fields change and opened after
  // (release), so a helper whose claim (a CAS on the ticket) succeeds read this job's fields.
  void publish(int64_t n, int64_t grain, int64_t chunks, int helpers, const Fn& fn) {
    const uint32_t job = ++job_;
    ticket_.store(static_cast<uint64_t>(job) << 32 | 0xffffffffu, std::memory_order_seq_cst);
    fn_ = &fn;
    n_.store(n, std::memory_order_relaxed);
    grain_.store(grain, std::memory_order_relaxed);
    chunks_.store(chunks, std::memory_order_relaxed);
    allowed_.store(helpers, std::memory_order_relaxed);
    done_.word.store(0, std::memory_order_relaxed);
    ticket_.store(static_cast<uint64_t>(job) << 32, std::memory_order_release);
    epoch_.word.store(job, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) epoch_.wake_all();
  }

  // Claim and run chunks of the current job until none are left; returns how many ran here.
  int64_t work() {
    int64_t ran = 0;
    for (;;) {
      uint64_t ticket = ticket_.load(std::memory_order_acquire);
      const int64_t chunks = chunks_.load(std::memory_order_relaxed);
      if (static_cast<int64_t>(ticket & 0xffffffffu) >= chunks) return ran;
      // Claim only if the ticket still names the job whose fields were just read.
      if (!ticket_.compare_exchange_weak(ticket, ticket + 1, std::memory_order_acq_rel,
                                         std::memory_order_acquire))
        continue;
      const int64_t chunk = static_cast<int64_t>(ticket & 0xffffffffu);
      const int64_t grain = grain_.load(std::memory_order_relaxed);
      const int64_t n = n_.load(std::memory_order_relaxed);
      const Fn* fn = fn_;
      run_chunk(*fn, chunk * grain, std::min(n, (chunk + 1) * grain));
      ++ran;
      const uint32_t done = done_.word.fetch_add(1, std::memory_order_seq_cst) + 1;
      if (done == static_cast<uint32_t>(chunks) && caller_sleeping_.load(std::memory_order_seq_cst))
        done_.wake_all();
    }
  }

  void run_chunk(const Fn& fn, int64_t begin, int64_t end) {
    pool_detail::in_pool_work = true;
    try {
      fn(begin, end);
    } catch (...) {  // kept for the caller: a throw on a helper would end the process
      std::lock_guard<std::mutex> lock(error_mutex_);
      if (!error_) error_ = std::current_exception();
    }
    pool_detail::in_pool_work = false;
  }

  // The caller spins briefly for in-flight chunks, then sleeps until the last one finishes.
  void wait_done(int64_t chunks) {
    const uint32_t total = static_cast<uint32_t>(chunks);
    auto finished = [&] { return done_.word.load(std::memory_order_acquire) == total; };
    if (pool_detail::spin_until(finished, spin_ns_)) return;
    caller_sleeping_.store(true, std::memory_order_seq_cst);
    for (uint32_t done; (done = done_.word.load(std::memory_order_seq_cst)) != total;)
      done_.wait(done);
    caller_sleeping_.store(false, std::memory_order_relaxed);
  }

  // Late helpers (waited > 4 of the caller's chunk times and 30 us) start or lengthen a backoff
  // on the caller alone; a run of on-time calls shortens it again.
  void adapt(int64_t waited, int64_t own_ns, int64_t own_chunks, int64_t now) {
    stats_.wait_ns += waited;
    const int64_t per_chunk = own_chunks > 0 ? own_ns / own_chunks : own_ns;
    const bool late = waited > 30000 && waited > 4 * per_chunk;
    if (!late) {
      if (++on_time_ >= 64 && backoff_ns_ > 0) {
        backoff_ns_ = backoff_ns_ > backoff_min_ns_ ? backoff_ns_ / 2 : 0;
        on_time_ = 0;
      }
      return;
    }
    stats_.late += 1;
    on_time_ = 0;
    if (!adaptive_) return;
    backoff_ns_ = std::min(backoff_max_ns_, std::max(backoff_min_ns_, backoff_ns_ * 2));
    backoff_until_ = now + backoff_ns_;
  }

  void helper_loop(int index) {
    using namespace pool_detail;
    uint32_t seen = epoch_.word.load(std::memory_order_acquire);
    for (;;) {
      auto changed = [&] { return epoch_.word.load(std::memory_order_acquire) != seen; };
      if (!spin_until(changed, spin_ns_)) {
        sleeps_.fetch_add(1, std::memory_order_relaxed);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        while (epoch_.word.load(std::memory_order_seq_cst) == seen) epoch_.wait(seen);
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
      }
      seen = epoch_.word.load(std::memory_order_acquire);
      if (index < allowed_.load(std::memory_order_relaxed)) work();
    }
  }

  void after_fork() {  // the child has none of the helpers (they were detached): start anew
    started_ = 0;
    sleepers_.store(0);
  }

  // Caller-side state, guarded by dispatch_.
  std::mutex dispatch_;
  int max_threads_ = 0;
  bool adaptive_ = true;
  int started_ = 0;
  uint32_t job_ = 0;
  int64_t backoff_until_ = 0, backoff_ns_ = 0;
  int on_time_ = 0;
  Stats stats_;
  const int64_t spin_ns_, backoff_min_ns_, backoff_max_ns_;

  // The current job, shared with helpers.
  const Fn* fn_ = nullptr;
  std::atomic<int64_t> n_{0}, grain_{1}, chunks_{0};
  std::atomic<int> allowed_{0};
  std::atomic<uint64_t> ticket_{0};  // job id << 32 | next chunk to claim
  pool_detail::Signal epoch_;        // job id; helpers sleep on it
  pool_detail::Signal done_;         // chunks finished; the caller sleeps on it
  std::atomic<bool> caller_sleeping_{false};
  std::atomic<int> sleepers_{0};
  std::atomic<int64_t> sleeps_{0};
  std::mutex error_mutex_;
  std::exception_ptr error_;
};

// Run fn(begin, end) over [0, n) in chunks of at most `grain` items, using up to `threads`
// threads, the calling thread included. Returns when every chunk has completed. fn must write
// only outputs belonging to [begin, end).
inline void parallel_for(int64_t n, int64_t grain, int threads,
                         const std::function<void(int64_t, int64_t)>& fn) {
  Pool::instance().parallel_for(n, grain, threads, fn);
}

}  // namespace tl
