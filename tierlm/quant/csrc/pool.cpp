// The pool's controls, exported from the kernels' shared library (see pool.h for the layout
// of the statistics).
#include "pool.h"

extern "C" {

// Threads the next parallel call asking for all of them would use (1 while backing off).
int tierlm_pool_threads(void) {
  tl::Pool& pool = tl::Pool::instance();
  return pool.threads(pool.max_threads() > 0 ? pool.max_threads() : tl::Pool::hardware());
}

// max_threads <= 0: no cap beyond each call's `threads`; adaptive 0/1. Resets the statistics.
void tierlm_pool_configure(int max_threads, int adaptive) {
  tl::Pool::instance().configure(max_threads, adaptive != 0);
}

void tierlm_pool_stats(double* out, int n) { tl::Pool::instance().stats(out, n); }

}  // extern "C"
