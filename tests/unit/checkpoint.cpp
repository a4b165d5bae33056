// SPDX-License-Identifier: MIT
// Checkpoints on disk: CRC-32C against its published values, a state written and read back
// whole, every kind of damage refused by name, a directory that keeps the last few and
// skips what does not read back, and a writer killed mid-write leaving the previous
// checkpoint whole.
#include "pulley/checkpoint/directory.hpp"
#include "pulley/checkpoint/inspect.hpp"

#include <doctest/doctest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

using namespace pulley;
namespace fs = std::filesystem;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "pulley-ckpt-XXXXXX").string();
    path = ::mkdtemp(pattern.data());
  }
  ~TempDir() { fs::remove_all(path); }
};

std::uint32_t crc_of(const std::vector<unsigned char>& bytes) {
  return checkpoint::crc32c(std::as_bytes(std::span(bytes)));
}

/// A state of two variables with Adam-like slots and counters, `n` floats in the first.
ModelState sample_state(std::int64_t step, std::size_t n = 12) {
  ModelState s;
  s.global_step = step;
  s.pacer = {step, 0, 3};
  VariableState w;
  w.spec = {"dense/kernel", {n / 3, 3}, Initializer::glorot_uniform()};
  w.values.resize(n);
  std::iota(w.values.begin(), w.values.end(), 0.5F + static_cast<float>(step));
  w.slots = {{"m", std::vector<float>(n, 0.25F)}, {"v", std::vector<float>(n, 0.125F)}};
  w.counter_names = {"t"};
  w.counters = {{{0, n / 6}, {step}}, {{n / 6, n / 3}, {step}}};
  VariableState b;
  b.spec = {"dense/bias", {3}, Initializer::zeros()};
  b.values = {1.0F, -2.0F, 3.0F};
  s.variables = {w, b};
  return s;
}

void flip_byte(const fs::path& file, std::uint64_t at) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(at));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x40);
  f.seekp(static_cast<std::streamoff>(at));
  f.write(&c, 1);
}

}  // namespace

TEST_CASE("CRC-32C gives the published check values, with and without the instruction") {
  std::vector<unsigned char> digits{'1', '2', '3', '4', '5', '6', '7', '8', '9'};
  CHECK(crc_of(digits) == 0xE3069283U);
  CHECK(crc_of(std::vector<unsigned char>(32, 0x00)) == 0x8A9136AAU);  // RFC 3720 B.4
  CHECK(crc_of(std::vector<unsigned char>(32, 0xFF)) == 0x62A8AB43U);
  std::vector<unsigned char> ramp(32);
  std::iota(ramp.begin(), ramp.end(), 0);
  CHECK(crc_of(ramp) == 0x46DD794EU);
  // The table gives the same as the instruction, for every length and split, on both sides
  // of the three-stream blocks (3 x 8 KiB) and their joins.
  std::vector<unsigned char> data(100003);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<unsigned char>(i * 7 + 3 + i / 251);
  for (std::size_t len : {0U, 1U, 7U, 8U, 9U, 63U, 1000U, 24575U, 24576U, 24577U, 49159U, 100003U}) {
    const std::uint32_t table = ~checkpoint::detail::crc32c_table(~0U, data.data(), len);
    CHECK(table == checkpoint::crc32c(std::as_bytes(std::span(data).first(len))));
  }
  const std::uint32_t whole = crc_of(data);
  const std::uint32_t split = checkpoint::crc32c(
      std::as_bytes(std::span(data).subspan(333)), checkpoint::crc32c(std::as_bytes(std::span(data).first(333))));
  CHECK(split == whole);
  CHECK(whole == ~checkpoint::detail::crc32c_table(~0U, data.data(), data.size()));
}

TEST_CASE("a checkpoint reads back exactly what was written") {
  TempDir tmp;
  const ModelState state = sample_state(42);
  checkpoint::write_checkpoint(tmp.path / "c", state);
  CHECK(checkpoint::read_checkpoint(tmp.path / "c") == state);
  // The index alone: the same but for the tensors' values.
  const ModelState index = checkpoint::read_checkpoint(tmp.path / "c", false);
  CHECK(index.global_step == 42);
  CHECK(index.variables.size() == 2);
  CHECK(index.variables[0].slots.size() == 2);
  CHECK(index.variables[0].values.empty());
  const std::string text = checkpoint::describe(tmp.path / "c", true);
  CHECK(text.find("global step 42") != std::string::npos);
  CHECK(text.find("dense/kernel [4, 3]") != std::string::npos);
  CHECK(text.find("slot m") != std::string::npos);
  CHECK(text.find("counter t: rows [0, 2) = 42; rows [2, 4) = 42") != std::string::npos);
  CHECK(text.find("min -2 max 3 mean 0.666667") != std::string::npos);  // dense/bias
  // A directory that exists is never written over.
  CHECK_THROWS_AS(checkpoint::write_checkpoint(tmp.path / "c", state), Error);
}

TEST_CASE("read_checkpoint_into reads into the memory of the tensors it is given") {
  TempDir tmp;
  const ModelState first = sample_state(1, 3000);
  const ModelState second = sample_state(2, 3000);
  checkpoint::write_checkpoint(tmp.path / "1", first);
  checkpoint::write_checkpoint(tmp.path / "2", second);
  ModelState into;
  checkpoint::read_checkpoint_into(tmp.path / "1", into);  // nothing to reuse yet
  CHECK(into == first);
  const float* values = into.variables[0].values.data();
  const float* slot_v = into.variables[0].slots[1].values.data();
  checkpoint::read_checkpoint_into(tmp.path / "2", into);
  CHECK(into == second);
  CHECK(into.variables[0].values.data() == values);  // the same memory, by variable and slot
  CHECK(into.variables[0].slots[1].values.data() == slot_v);
  // A state of other variables, or other sizes, is no obstacle: it reads as read_checkpoint.
  ModelState other = sample_state(9, 6);
  other.variables[1].spec.name = "elsewhere";
  checkpoint::read_checkpoint_into(tmp.path / "1", other);
  CHECK(other == first);
  // A damaged checkpoint is refused as by read_checkpoint.
  flip_byte(tmp.path / "2" / "data", 4 * 1500);
  CHECK_THROWS_AS(checkpoint::read_checkpoint_into(tmp.path / "2", into), Error);
}

TEST_CASE("a damaged, truncated or unfinished checkpoint is refused, naming the problem") {
  TempDir tmp;
  const ModelState state = sample_state(7, 3000);
  auto fresh = [&](const std::string& name) {
    checkpoint::write_checkpoint(tmp.path / name, state);
    return tmp.path / name;
  };
  auto refused = [&](const fs::path& dir, const std::string& why) {
    try {
      (void)checkpoint::read_checkpoint(dir);
      FAIL("read back a damaged checkpoint");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kDataLoss);
      CHECK_MESSAGE(std::string(e.what()).find(why) != std::string::npos, e.what());
    }
  };
  const fs::path a = fresh("a");
  flip_byte(a / "data", 4 * 1500);  // inside dense/kernel's values
  refused(a, "'dense/kernel' is damaged");
  const fs::path b = fresh("b");
  flip_byte(b / "data", fs::file_size(b / "data") - 64);  // inside the last tensor (dense/bias)
  refused(b, "is damaged");
  const fs::path c = fresh("c");
  fs::resize_file(c / "data", fs::file_size(c / "data") / 2);
  refused(c, "truncated");
  const fs::path d = fresh("d");
  fs::resize_file(d / "index", fs::file_size(d / "index") - 9);
  refused(d, "damaged");
  const fs::path e = fresh("e");
  flip_byte(e / "index", 20);
  refused(e, "damaged");
  const fs::path f = fresh("f");
  fs::remove(f / "index");
  refused(f, "never finished");
  std::ofstream(tmp.path / "g") << "";
  fs::create_directory(tmp.path / "h");
  std::ofstream(tmp.path / "h" / "index") << "not a checkpoint at all, but long enough";
  refused(tmp.path / "h", "not a pulley checkpoint");
}

TEST_CASE("a checkpoint directory keeps the newest few and reads the newest that is whole") {
  TempDir tmp;
  CheckpointDirectory dir(tmp.path / "run", 3);
  for (std::int64_t step = 100; step <= 700; step += 100) dir.save(sample_state(step));
  const auto all = dir.list();
  REQUIRE(all.size() == 3);
  CHECK(all[0].first == 700);
  CHECK(all[2].first == 500);
  CHECK(dir.latest()->first.global_step == 700);
  // The newest is damaged: the one before it is used, and the skip is logged.
  flip_byte(all[0].second / "data", 8);
  const auto latest = dir.latest();
  REQUIRE(latest.has_value());
  CHECK(latest->first.global_step == 600);
  CHECK(latest->first == sample_state(600));
  // Saving a step that is there already keeps it; a new save removes leftovers of a crash.
  fs::create_directory(tmp.path / "run" / ".tmp-ckpt-000000000800-999");
  dir.save(sample_state(800));
  CHECK_FALSE(fs::exists(tmp.path / "run" / ".tmp-ckpt-000000000800-999"));
  CHECK(dir.list().size() == 3);
  CHECK(CheckpointDirectory::list(tmp.path / "nowhere").empty());
}

TEST_CASE("a damaged checkpoint is written again when its step is saved, and does not count among those kept") {
  TempDir tmp;
  const fs::path root = tmp.path / "run";
  {
    CheckpointDirectory dir(root, 2);
    for (std::int64_t step = 100; step <= 300; step += 100) dir.save(sample_state(step));
  }
  // The newest is damaged; a restarted chief resumes from the one before and trains on.
  flip_byte(root / CheckpointDirectory::name_of(300) / "data", 8);
  CheckpointDirectory dir(root, 2);
  REQUIRE(dir.latest()->first.global_step == 200);
  // Its step comes again: written anew, not kept damaged.
  dir.save(sample_state(300));
  CHECK(dir.wrote());
  CHECK(CheckpointDirectory::load(root / CheckpointDirectory::name_of(300)) == sample_state(300));
  // A whole one of the same step is kept as it is.
  dir.save(sample_state(300));
  CHECK_FALSE(dir.wrote());
  // Damaged ones do not take a place among the `keep` newest: 400 (whole), 500 (damaged),
  // 600 (whole) keep 400 and 600, and 300 goes.
  dir.save(sample_state(400));
  const fs::path five = dir.save(sample_state(500));
  flip_byte(five / "data", 8);
  CheckpointDirectory later(root, 2);  // a new process: what it did not write, it reads once
  later.save(sample_state(600));
  std::vector<std::int64_t> steps;
  for (const auto& [step, path] : later.list()) steps.push_back(step);
  CHECK(steps == std::vector<std::int64_t>{600, 500, 400});
  // Once two whole ones are newer, the damaged one goes too.
  later.save(sample_state(700));
  steps.clear();
  for (const auto& [step, path] : later.list()) steps.push_back(step);
  CHECK(steps == std::vector<std::int64_t>{700, 600});
}

TEST_CASE("a writer killed at any moment of a save leaves the previous checkpoint whole") {
  TempDir tmp;
  const fs::path root = tmp.path / "run";
  CheckpointDirectory(root, 0).save(sample_state(1, 3000));
  const ModelState big = sample_state(2, 6 << 20);  // 24 MiB and slots: a save takes a while
  for (int delay_ms : {0, 2, 5, 10, 20, 40, 80}) {
    CAPTURE(delay_ms);
    fs::remove_all(root / CheckpointDirectory::name_of(2));
    const pid_t child = fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      try {
        CheckpointDirectory(root, 0).save(big);
      } catch (...) {
        _exit(1);
      }
      _exit(0);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    ::kill(child, SIGKILL);
    int status = 0;
    REQUIRE(::waitpid(child, &status, 0) == child);
    // Whatever the moment, the newest checkpoint that reads back is whole: the old one, or
    // the new one if the save had finished.
    const auto latest = CheckpointDirectory(root, 0).latest();
    REQUIRE(latest.has_value());
    if (latest->first.global_step == 2) {
      CHECK(latest->first == big);
    } else {
      CHECK(latest->first == sample_state(1, 3000));
    }
  }
}
