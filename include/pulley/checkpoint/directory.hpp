// SPDX-License-Identifier: MIT
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "pulley/checkpoint/format.hpp"
#include "pulley/checkpoint/model_state.hpp"
#include "pulley/core/error.hpp"
#include "pulley/core/log.hpp"

namespace pulley {

/// A directory of checkpoints, as the chief writes them and a restarted job or an evaluator
/// reads them: `ckpt-<global step>/` each (checkpoint/format.hpp), the last `keep` kept.
///
/// A checkpoint is written whole or not at all: into a temporary directory (`.tmp-...`),
/// its files flushed to the disk, then renamed to its name and the parent flushed. A crash
/// at any instant leaves every earlier checkpoint as it was, and at most a temporary
/// directory, which the next save removes. Reading skips, with a log line, any checkpoint
/// that does not read back whole (truncated, damaged, of another format version).
class CheckpointDirectory {
 public:
  /// @param root the directory (created if missing)
  /// @param keep how many checkpoints to keep, newest first (TensorFlow's max_to_keep: 5); 0
  ///             keeps all
  explicit CheckpointDirectory(std::filesystem::path root, std::size_t keep = 5)
      : root_(std::move(root)), keep_(keep) {
    std::error_code ec;
    std::filesystem::create_directories(root_, ec);
    if (ec || !std::filesystem::is_directory(root_)) {
      throw Error(ErrorCode::kInvalidArgument,
                  "cannot use " + root_.string() + " as a checkpoint directory: " +
                      (ec ? ec.message() : std::string("not a directory")));
    }
  }

  /// The directory.
  [[nodiscard]] const std::filesystem::path& root() const noexcept { return root_; }

  /// The name of the checkpoint of global step `step`.
  static std::string name_of(std::int64_t step) {
    char name[32];
    std::snprintf(name, sizeof name, "ckpt-%012lld", static_cast<long long>(step));
    return name;
  }

  /// Writes `state` as the checkpoint of its global step and returns its path; keeps the
  /// last `keep`. A checkpoint of that step that is already there is kept as it is.
  std::filesystem::path save(const ModelState& state) {
    remove_temporaries();
    const std::filesystem::path target = root_ / name_of(state.global_step);
    std::error_code ec;
    if (std::filesystem::exists(target, ec)) return target;
    const std::filesystem::path temporary =
        root_ / (".tmp-" + name_of(state.global_step) + "-" + std::to_string(::getpid()));
    std::filesystem::remove_all(temporary, ec);
    try {
      checkpoint::write_checkpoint(temporary, state);
      std::filesystem::rename(temporary, target);
      checkpoint::detail::sync_directory(root_);
    } catch (const std::filesystem::filesystem_error& e) {
      std::filesystem::remove_all(temporary, ec);
      throw Error(ErrorCode::kUnavailable, "cannot save " + target.string() + ": " + e.what());
    } catch (...) {
      std::filesystem::remove_all(temporary, ec);
      throw;
    }
    prune();
    return target;
  }

  /// The checkpoints there (finished ones: named `ckpt-<step>`), newest first.
  [[nodiscard]] std::vector<std::pair<std::int64_t, std::filesystem::path>> list() const {
    return list(root_);
  }

  /// The checkpoints in `root` (empty if it does not exist), newest first.
  static std::vector<std::pair<std::int64_t, std::filesystem::path>> list(
      const std::filesystem::path& root) {
    std::vector<std::pair<std::int64_t, std::filesystem::path>> found;
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(root, ec)) {
      const std::string name = entry.path().filename().string();
      if (name.size() != 17 || name.rfind("ckpt-", 0) != 0) continue;
      if (name.find_first_not_of("0123456789", 5) != std::string::npos) continue;
      found.emplace_back(std::stoll(name.substr(5)), entry.path());
    }
    std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    return found;
  }

  /// The newest checkpoint that reads back whole (every CRC checked), and where it is; any
  /// newer one that does not is logged and skipped. nullopt when there is none.
  [[nodiscard]] std::optional<std::pair<ModelState, std::filesystem::path>> latest() const {
    for (const auto& [step, path] : list()) {
      try {
        return std::pair{checkpoint::read_checkpoint(path), path};
      } catch (const Error& e) {
        log(LogLevel::kWarning, "skipping checkpoint " + path.string() + ": " + e.what());
      }
    }
    return std::nullopt;
  }

 private:
  /// What a save cut short left behind.
  void remove_temporaries() {
    std::error_code ec;
    std::vector<std::filesystem::path> stale;
    for (const auto& entry : std::filesystem::directory_iterator(root_, ec)) {
      if (entry.path().filename().string().rfind(".tmp-ckpt-", 0) == 0) stale.push_back(entry.path());
    }
    for (const auto& path : stale) std::filesystem::remove_all(path, ec);
  }

  void prune() {
    if (keep_ == 0) return;
    const auto all = list();
    std::error_code ec;
    for (std::size_t i = keep_; i < all.size(); ++i) std::filesystem::remove_all(all[i].second, ec);
  }

  std::filesystem::path root_;
  std::size_t keep_;
};

}  // namespace pulley
