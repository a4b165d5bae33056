// SPDX-License-Identifier: MIT
/// \file
/// Large buffers on huge pages. Memory a process has not written yet costs a page fault per
/// 4 KiB page at its first write; in a virtual machine that fault is dear (measured on the
/// 2-vCPU VM of BENCHMARKS.md: 64 MiB of fresh memory took 190 ms to zero, 4 ms once
/// resident). A buffer of megabytes that is filled once (a cut's values and rows at the
/// chief, their gathering for a restore, a chunk of rows a ps sends) is advised onto
/// transparent huge pages before its first write: one fault per 2 MiB, 5 ms for the same
/// 64 MiB there. Not what a peer's bytes fill (wire::FrameReader): a huge page is resident
/// whole once touched, so memory bounded by a budget would grow by up to 2 MiB a buffer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace pulley::detail {

/// The size of a transparent huge page on x86-64 and most AArch64 kernels.
inline constexpr std::size_t kHugePageBytes = std::size_t{2} << 20U;

/// Asks the kernel to back the whole huge pages inside [data, data + bytes) with huge pages
/// at their first write (Linux: madvise MADV_HUGEPAGE, which takes effect where the system
/// enables transparent huge pages "always" or "madvise"). Advice only: nothing changes
/// where the kernel declines, on other systems, or for a range under two huge pages.
inline void advise_huge_pages(const void* data, std::size_t bytes) noexcept {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (data == nullptr || bytes < 2 * kHugePageBytes) return;
  const auto from = reinterpret_cast<std::uintptr_t>(data);
  const std::uintptr_t begin = (from + kHugePageBytes - 1) & ~(std::uintptr_t{kHugePageBytes} - 1);
  const std::uintptr_t end = (from + bytes) & ~(std::uintptr_t{kHugePageBytes} - 1);
  if (end > begin) (void)::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

/// `v.reserve(n)`, the new memory advised onto huge pages (advise_huge_pages) before any of
/// it is written: for a vector about to be filled with megabytes.
template <class T, class A>
void reserve_on_huge_pages(std::vector<T, A>& v, std::size_t n) {
  if (n <= v.capacity()) return;
  v.reserve(n);
  advise_huge_pages(v.data(), v.capacity() * sizeof(T));
}

/// `v.resize(n)`, the memory advised onto huge pages before the new elements are written
/// (reserve_on_huge_pages): for a vector about to hold megabytes, e.g. read straight into.
template <class T, class A>
void resize_on_huge_pages(std::vector<T, A>& v, std::size_t n) {
  reserve_on_huge_pages(v, n);
  v.resize(n);
}

}  // namespace pulley::detail
