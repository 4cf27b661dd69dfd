#include "trainer/memory/heap.h"

#include <malloc.h>

namespace trainer {

void return_freed_memory() {
  mallopt(M_MMAP_THRESHOLD, 256 * 1024);
  mallopt(M_TRIM_THRESHOLD, 128 * 1024);
  malloc_trim(0);
}

}  // namespace trainer
