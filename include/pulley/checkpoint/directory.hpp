// SPDX-License-Identifier: MIT
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <set>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "pulley/checkpoint/delta.hpp"
#include "pulley/checkpoint/format.hpp"
#include "pulley/checkpoint/model_state.hpp"
#include "pulley/core/error.hpp"
#include "pulley/core/log.hpp"

namespace pulley {

/// A directory of checkpoints, as the chief writes them and a restarted job or an evaluator
/// reads them: `ckpt-<global step>/` each (checkpoint/format.hpp), the last `keep` kept.
///
/// A checkpoint may be incremental (ModelState::base_step): its tables hold the rows changed
/// since the checkpoint of its base step, which it needs. `load` and `latest` read the
/// newest full checkpoint of its chain and apply the incremental ones after it, and `keep`
/// keeps every checkpoint a kept one needs.
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
  /// last `keep` that read back whole. A checkpoint of that step that is already there is
  /// kept as it is if it reads back whole, and replaced (with a log line) if it does not.
  std::filesystem::path save(const ModelState& state) {
    remove_temporaries();
    const std::filesystem::path target = root_ / name_of(state.global_step);
    std::error_code ec;
    wrote_ = false;
    const bool there = std::filesystem::exists(target, ec);
    whole_.erase(state.global_step);  // read it again: this is the one chance to replace it
    if (there && reads_whole(state.global_step, target)) return target;
    const std::string suffix = "-" + std::to_string(::getpid());
    const std::filesystem::path temporary = root_ / (".tmp-" + name_of(state.global_step) + suffix);
    const std::filesystem::path damaged = root_ / (".tmp-" + name_of(state.global_step) + "-damaged" + suffix);
    std::filesystem::remove_all(temporary, ec);
    try {
      checkpoint::write_checkpoint(temporary, state);
      if (there) {  // out of the way first: a crash between the renames leaves only a temporary
        log(LogLevel::kWarning, "checkpoint " + target.string() + " does not read back whole: written again");
        std::filesystem::rename(target, damaged);
      }
      std::filesystem::rename(temporary, target);
      checkpoint::detail::sync_directory(root_);
      std::filesystem::remove_all(damaged, ec);
    } catch (const std::filesystem::filesystem_error& e) {
      std::filesystem::remove_all(temporary, ec);
      throw Error(ErrorCode::kUnavailable, "cannot save " + target.string() + ": " + e.what());
    } catch (...) {
      std::filesystem::remove_all(temporary, ec);
      throw;
    }
    whole_.insert(state.global_step);
    wrote_ = true;
    prune();
    return target;
  }

  /// Whether the last `save` wrote its state (false: a checkpoint of that step was there
  /// already and was kept, so what is on disk may differ from the state, and an
  /// incremental checkpoint must not be taken over it).
  [[nodiscard]] bool wrote() const noexcept { return wrote_; }

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

  /// The newest checkpoint that reads back whole (every CRC checked, an incremental one with
  /// the checkpoints it needs), and where it is; any newer one that does not is logged and
  /// skipped. nullopt when there is none.
  [[nodiscard]] std::optional<std::pair<ModelState, std::filesystem::path>> latest() const {
    for (const auto& [step, path] : list()) {
      try {
        return std::pair{load(path), path};
      } catch (const Error& e) {
        log(LogLevel::kWarning, "skipping checkpoint " + path.string() + ": " + e.what());
      }
    }
    return std::nullopt;
  }

  /// The whole state the checkpoint in `path` holds: read, and if it is incremental, applied
  /// over the whole state of its base, found beside it (`apply_delta`), back to a full
  /// checkpoint. Throws kDataLoss when any of them does not read back whole or is missing.
  static ModelState load(const std::filesystem::path& path) {
    ModelState state;
    load_into(path, state);
    return state;
  }

  /// As load, into `state`; when `state` already holds the whole state of the checkpoint's
  /// base (an evaluator that reads checkpoints in order), only the checkpoint itself is
  /// read. On an error `state` is left valid but unspecified.
  static void load_into(const std::filesystem::path& path, ModelState& state) {
    // The chain, newest first: each checkpoint's base until a full one (or `state`'s step).
    std::vector<std::filesystem::path> chain{path};
    const bool have = !state.incremental() && !state.variables.empty();
    for (;;) {
      const ModelState head = checkpoint::read_checkpoint(chain.back(), false);
      if (!head.incremental() || (have && head.base_step == state.global_step)) break;
      if (chain.size() > kMaxChain) {
        throw Error(ErrorCode::kDataLoss, "checkpoint " + path.string() + ": more than " +
                                              std::to_string(kMaxChain) + " incremental checkpoints in a row");
      }
      const std::filesystem::path base = path.parent_path() / name_of(head.base_step);
      std::error_code ec;
      if (!std::filesystem::exists(base, ec)) {
        throw Error(ErrorCode::kDataLoss, "checkpoint " + chain.back().string() +
                                              " is incremental over global step " +
                                              std::to_string(head.base_step) + ", whose checkpoint is gone");
      }
      chain.push_back(base);
    }
    const ModelState first = checkpoint::read_checkpoint(chain.back(), false);
    if (!first.incremental()) {
      checkpoint::read_checkpoint_into(chain.back(), state);
      chain.pop_back();
    }
    for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
      ModelState delta = checkpoint::read_checkpoint(*it);
      try {
        apply_delta(state, std::move(delta));
      } catch (const Error& e) {
        throw Error(ErrorCode::kDataLoss, "checkpoint " + it->string() + ": " + e.what());
      }
    }
  }

  /// The most incremental checkpoints in a row `load` follows.
  static constexpr std::size_t kMaxChain = 10000;

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

  /// True if the checkpoint of `step` at `path` reads back whole (its own files, every CRC:
  /// not the checkpoints an incremental one needs). Each is read once: what this object
  /// wrote or read whole before is known.
  bool reads_whole(std::int64_t step, const std::filesystem::path& path) {
    if (whole_.contains(step)) return true;
    try {
      (void)checkpoint::read_checkpoint(path);
    } catch (const Error&) {
      return false;
    }
    whole_.insert(step);
    return true;
  }

  /// Removes all but the newest `keep` checkpoints that read back whole and those they need
  /// (an incremental checkpoint's base, back to a full one). A damaged checkpoint does not
  /// count: it goes once `keep` whole ones are newer.
  void prune() {
    if (keep_ == 0) return;
    const auto all = list();  // newest first
    std::vector<std::int64_t> needed;
    std::size_t kept_whole = 0;
    for (const auto& [step, path] : all) {
      const bool needed_by_a_kept_one = std::find(needed.begin(), needed.end(), step) != needed.end();
      if (kept_whole >= keep_ && !needed_by_a_kept_one) {
        std::error_code ec;
        std::filesystem::remove_all(path, ec);
        whole_.erase(step);
        continue;
      }
      if (!reads_whole(step, path)) continue;  // unreadable: it counts for nothing, needs nothing
      ++kept_whole;
      const ModelState head = checkpoint::read_checkpoint(path, false);
      if (head.incremental()) needed.push_back(head.base_step);
    }
  }

  std::filesystem::path root_;
  std::size_t keep_;
  bool wrote_ = false;
  std::set<std::int64_t> whole_;  ///< steps of the checkpoints known to read back whole
};

}  // namespace pulley
