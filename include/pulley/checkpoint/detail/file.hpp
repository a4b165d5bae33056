// SPDX-License-Identifier: MIT
#pragma once

/// detail::File, a file descriptor whose writes, reads and flushes are checked (throwing
/// kUnavailable when the system refuses, kDataLoss when a read finds the file cut short),
/// and detail::sync_directory: the disk access shared by the checkpoint writer and reader.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>

#include "pulley/core/error.hpp"

namespace pulley::checkpoint::detail {

/// A file descriptor, closed when it goes.
class File {
 public:
  File(const std::filesystem::path& path, int flags, mode_t mode = 0644)
      : fd_(::open(path.c_str(), flags | O_CLOEXEC, mode)), path_(path) {
    if (fd_ < 0) fail("cannot open");
  }
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File() {
    if (fd_ >= 0) ::close(fd_);
  }

  /// Writes all of `bytes`.
  void write(std::span<const std::byte> bytes) {
    while (!bytes.empty()) {
      const ssize_t n = ::write(fd_, bytes.data(), bytes.size());
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) fail("cannot write");
      bytes = bytes.subspan(static_cast<std::size_t>(n));
    }
  }
  /// Reads exactly `out.size()` bytes at `offset`; throws kDataLoss if the file ends first.
  void read_at(std::span<std::byte> out, std::uint64_t offset) const {
    while (!out.empty()) {
      const ssize_t n = ::pread(fd_, out.data(), out.size(), static_cast<off_t>(offset));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) fail("cannot read");
      if (n == 0) throw Error(ErrorCode::kDataLoss, path_.string() + " is truncated");
      out = out.subspan(static_cast<std::size_t>(n));
      offset += static_cast<std::uint64_t>(n);
    }
  }
  /// The file's size in bytes.
  [[nodiscard]] std::uint64_t size() const {
    struct stat info {};
    if (::fstat(fd_, &info) != 0) fail("cannot stat");
    return static_cast<std::uint64_t>(info.st_size);
  }
  /// Flushes what was written to the disk.
  void sync() {
    if (::fsync(fd_) != 0) fail("cannot flush");
  }

 private:
  [[noreturn]] void fail(const char* what) const {
    throw Error(ErrorCode::kUnavailable,
                std::string(what) + " " + path_.string() + ": " + std::strerror(errno));
  }

  int fd_;
  std::filesystem::path path_;
};

/// Flushes a directory's entries (a file created or renamed in it) to the disk.
inline void sync_directory(const std::filesystem::path& dir) {
  File d(dir, O_RDONLY | O_DIRECTORY);
  d.sync();
}

}  // namespace pulley::checkpoint::detail
