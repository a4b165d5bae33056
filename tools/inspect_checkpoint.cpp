// SPDX-License-Identifier: MIT
// Prints what a pulley checkpoint holds (TensorFlow's inspect_checkpoint):
//   inspect_checkpoint [--stats] CHECKPOINT_DIR/ckpt-000000001234
//   inspect_checkpoint [--stats] CHECKPOINT_DIR          (its newest checkpoint)
// With --stats, every tensor is read and checked, and its min, max and mean printed. Exits 1
// naming the problem when the checkpoint does not read back whole.
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <string>

#include "pulley/checkpoint/directory.hpp"
#include "pulley/checkpoint/inspect.hpp"

int main(int argc, char** argv) {
  bool stats = false;
  const char* path = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--stats") == 0) {
      stats = true;
    } else if (std::strcmp(argv[i], "--help") == 0) {
      std::puts("usage: inspect_checkpoint [--stats] CHECKPOINT | CHECKPOINT_DIRECTORY");
      return 0;
    } else {
      path = argv[i];
    }
  }
  if (path == nullptr) {
    std::fputs("inspect_checkpoint: give a checkpoint or a checkpoint directory (--help)\n", stderr);
    return 2;
  }
  try {
    std::filesystem::path target(path);
    if (!std::filesystem::exists(target / "index")) {
      const auto all = pulley::CheckpointDirectory::list(target);
      if (all.empty()) throw std::runtime_error("no checkpoint in " + target.string());
      target = all.front().second;
    }
    std::fputs(pulley::checkpoint::describe(target, stats).c_str(), stdout);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "inspect_checkpoint: %s\n", e.what());
    return 1;
  }
}
