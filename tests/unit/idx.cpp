// SPDX-License-Identifier: MIT
// examples/ is on the include path (tests/CMakeLists.txt: pulley_test_idx_INCLUDES).
#include "fashion_mnist/idx.hpp"

#include <doctest/doctest.h>
#include <zlib.h>

#include <array>
#include <cstdint>
#include <filesystem>
#include <random>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

namespace {

namespace fs = std::filesystem;

/// Where the real data set lives: the build's PULLEY_FASHION_MNIST_DIR, else Debian's path.
#ifdef PULLEY_FASHION_MNIST_DIR
const fs::path kDataDirectory(PULLEY_FASHION_MNIST_DIR);
#else
const fs::path kDataDirectory(fashion_mnist::kDefaultDirectory);
#endif

/// A fresh directory under the system temp directory, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    path_ =
        fs::temp_directory_path() / ("pulley-idx-test-" + std::to_string(std::random_device{}()) +
                                     "-" + std::to_string(counter++));
    fs::create_directories(path_);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  [[nodiscard]] const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

void put_u32(std::vector<unsigned char>& out, std::uint32_t v) {
  out.push_back(static_cast<unsigned char>(v >> 24U));
  out.push_back(static_cast<unsigned char>(v >> 16U));
  out.push_back(static_cast<unsigned char>(v >> 8U));
  out.push_back(static_cast<unsigned char>(v));
}

/// An IDX file: magic, dimensions, then the bytes of `payload`.
std::vector<unsigned char> idx(std::uint32_t magic, std::vector<std::uint32_t> dims,
                               const std::vector<unsigned char>& payload) {
  std::vector<unsigned char> out;
  put_u32(out, magic);
  for (std::uint32_t d : dims) put_u32(out, d);
  out.insert(out.end(), payload.begin(), payload.end());
  return out;
}

/// Writes `bytes` gzip-compressed, as the data set ships.
void write_gz(const fs::path& path, const std::vector<unsigned char>& bytes) {
  gzFile file = gzopen(path.c_str(), "wb");
  REQUIRE(file != nullptr);
  const int written = gzwrite(file, bytes.data(), static_cast<unsigned>(bytes.size()));
  gzclose(file);
  REQUIRE(written == static_cast<int>(bytes.size()));
}

}  // namespace

TEST_CASE("IDX images round-trip through gzip, scaled to [0, 1]") {
  TempDir dir;
  const fs::path path = dir.path() / "images.gz";
  // 2 images of 2 × 3 pixels
  const std::vector<unsigned char> pixels = {0,  255, 51, 102, 1,  254,  //
                                             10, 20,  30, 40,  50, 60};
  write_gz(path, idx(2051, {2, 2, 3}, pixels));

  const fashion_mnist::Images images = fashion_mnist::load_images(path);
  CHECK(images.count == 2);
  CHECK(images.rows == 2);
  CHECK(images.cols == 3);
  CHECK(images.pixels_per_image() == 6);
  REQUIRE(images.pixels.size() == pixels.size());
  for (std::size_t i = 0; i < pixels.size(); ++i) {
    CAPTURE(i);
    CHECK(images.pixels[i] == doctest::Approx(pixels[i] / 255.0).epsilon(1e-6));
  }
  CHECK(images.pixels[0] == 0.0F);
  CHECK(images.pixels[1] == 1.0F);
}

TEST_CASE("IDX labels round-trip through gzip") {
  TempDir dir;
  const fs::path path = dir.path() / "labels.gz";
  write_gz(path, idx(2049, {5}, {3, 0, 9, 1, 255}));
  CHECK(fashion_mnist::load_labels(path) == std::vector<std::int32_t>{3, 0, 9, 1, 255});
}

TEST_CASE("IDX reader rejects a wrong magic number") {
  TempDir dir;
  const fs::path labels = dir.path() / "labels.gz";
  write_gz(labels, idx(2049, {2}, {1, 2}));
  CHECK_THROWS_WITH_AS((void)fashion_mnist::load_images(labels),
                       doctest::Contains("magic number 2049, expected 2051"), std::runtime_error);

  const fs::path images = dir.path() / "images.gz";
  write_gz(images, idx(2051, {1, 1, 1}, {7}));
  CHECK_THROWS_WITH_AS((void)fashion_mnist::load_labels(images),
                       doctest::Contains("magic number 2051, expected 2049"), std::runtime_error);
}

TEST_CASE("IDX reader rejects truncated, oversized and degenerate files") {
  TempDir dir;
  const fs::path path = dir.path() / "bad.gz";

  write_gz(path, idx(2051, {3, 2, 2}, std::vector<unsigned char>(11, 1)));  // 12 announced
  CHECK_THROWS_WITH_AS((void)fashion_mnist::load_images(path), doctest::Contains("truncated"),
                       std::runtime_error);

  write_gz(path, idx(2049, {4}, {1, 2, 3}));
  CHECK_THROWS_WITH_AS((void)fashion_mnist::load_labels(path), doctest::Contains("truncated"),
                       std::runtime_error);

  write_gz(path, {0, 0, 8});  // not even a whole magic number
  CHECK_THROWS_WITH_AS((void)fashion_mnist::load_labels(path), doctest::Contains("truncated"),
                       std::runtime_error);

  write_gz(path, idx(2049, {2}, {1, 2, 3}));
  CHECK_THROWS_WITH_AS((void)fashion_mnist::load_labels(path), doctest::Contains("trailing"),
                       std::runtime_error);

  // A cut-off gzip stream, as from an interrupted download.
  std::vector<unsigned char> noise(4000);
  for (std::size_t i = 0; i < noise.size(); ++i) {
    noise[i] = static_cast<unsigned char>(i * 7919U >> 3U);
  }
  write_gz(path, idx(2051, {1, 40, 100}, noise));
  CHECK_NOTHROW((void)fashion_mnist::load_images(path));
  fs::resize_file(path, fs::file_size(path) / 2);
  CHECK_THROWS_AS((void)fashion_mnist::load_images(path), std::runtime_error);

  write_gz(path, idx(2051, {1, 0, 28}, {}));
  CHECK_THROWS_AS((void)fashion_mnist::load_images(path), std::runtime_error);
}

TEST_CASE("IDX reader names a missing file and says how to install the data set") {
  TempDir dir;
  const fs::path missing = dir.path() / "train-images-idx3-ubyte.gz";
  try {
    (void)fashion_mnist::load_images(missing);
    FAIL("no exception for a missing file");
  } catch (const std::runtime_error& e) {
    const std::string message = e.what();
    CHECK(message.find(missing.string()) != std::string::npos);
    CHECK(message.find("apt-get install dataset-fashion-mnist") != std::string::npos);
  }
  CHECK_THROWS_WITH_AS((void)fashion_mnist::load_split(dir.path(), "t10k"),
                       doctest::Contains("dataset-fashion-mnist"), std::runtime_error);
}

TEST_CASE("load_split reads the installed Fashion-MNIST test split, if present") {
  const fs::path& dir = kDataDirectory;
  if (!fs::exists(dir / "t10k-images-idx3-ubyte.gz")) {
    MESSAGE("Fashion-MNIST not installed; skipped");
    return;
  }
  const fashion_mnist::Split split = fashion_mnist::load_split(dir, "t10k");
  CHECK(split.images.count == 10000);
  CHECK(split.images.pixels_per_image() == 784);
  CHECK(split.images.pixels.size() == 10000 * 784);
  std::array<int, 10> per_class{};
  int out_of_range = 0;
  for (std::int32_t label : split.labels) {
    if (label < 0 || label >= 10) {
      ++out_of_range;
    } else {
      ++per_class[static_cast<std::size_t>(label)];
    }
  }
  CHECK(out_of_range == 0);
  for (int n : per_class) CHECK(n == 1000);  // the test split is balanced
}
