// The process heap under a container's memory limit. The capped CPU allocator keeps freed memory in the
// process for speed (cpu_allocator::install(): large mmap threshold, no trimming), so the process's RSS
// stays at the high-water mark of its tensors plus the heap's fragmentation; a container counts all of
// it. Measured: peak RSS went 0.9-1.4x the tensor peak past what the cap allowed (docs/MEMORY.md "RSS
// against the container's limit").
#pragma once

namespace trainer {

/// Gives freed memory back to the kernel from now on: blocks from 256 KiB up are mapped and unmapped
/// each time, the heap is trimmed on free (glibc's default threshold), and what is free now is trimmed.
/// The RSS then follows the live tensors. Costs page faults every step. Process-wide; idempotent.
void return_freed_memory();

}  // namespace trainer
