// SPDX-License-Identifier: MIT
#pragma once

// Reader for the gzip-compressed IDX files that MNIST and Fashion-MNIST ship as. Example
// code, not part of pulley: it needs zlib (link with -lz).

#include <zlib.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace fashion_mnist {

/// Where Debian's `dataset-fashion-mnist` package installs the four files.
inline constexpr std::string_view kDefaultDirectory = "/usr/share/datasets/fashion-mnist";

/// IDX magic numbers: 0x08 (unsigned bytes) then the number of dimensions.
inline constexpr std::uint32_t kImagesMagic = 0x00000803;  // 2051: count × rows × cols
inline constexpr std::uint32_t kLabelsMagic = 0x00000801;  // 2049: count

/// Images as the model consumes them: `count` rows of `rows × cols` pixels, row-major,
/// each scaled from 0..255 to [0, 1].
struct Images {
  std::size_t count = 0;      ///< number of images
  std::size_t rows = 0;       ///< pixel rows per image (28 for Fashion-MNIST)
  std::size_t cols = 0;       ///< pixel columns per image (28 for Fashion-MNIST)
  std::vector<float> pixels;  ///< count × rows × cols values in [0, 1]

  /// Features per image (784 for Fashion-MNIST).
  [[nodiscard]] std::size_t pixels_per_image() const noexcept { return rows * cols; }
};

/// One split of the data set: images and their labels, the same count of each.
struct Split {
  Images images;                     ///< the inputs
  std::vector<std::int32_t> labels;  ///< one class in 0..9 per image
};

namespace detail {

struct GzClose {
  void operator()(gzFile file) const noexcept { gzclose(file); }
};
using GzFile = std::unique_ptr<std::remove_pointer_t<gzFile>, GzClose>;

[[nodiscard]] inline std::runtime_error error(const std::filesystem::path& path,
                                              const std::string& what) {
  return std::runtime_error(path.string() + ": " + what);
}

/// Opens `path` for reading (gzip or plain: zlib reads both), with a message that says how
/// to get the data when it is missing.
[[nodiscard]] inline GzFile open(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    throw error(path,
                "no such file. Fashion-MNIST is not installed here; install it with "
                "`apt-get install dataset-fashion-mnist` (files land in " +
                    std::string(kDefaultDirectory) + ")");
  }
  GzFile file(gzopen(path.c_str(), "rb"));
  if (!file) throw error(path, "cannot open for reading");
  gzbuffer(file.get(), 1U << 17U);
  return file;
}

/// Reads exactly `size` bytes, or throws naming what was being read.
inline void read_exact(gzFile file, const std::filesystem::path& path, void* out, std::size_t size,
                       std::string_view what) {
  auto* bytes = static_cast<unsigned char*>(out);
  std::size_t done = 0;
  while (done < size) {
    const std::size_t want = std::min<std::size_t>(size - done, 1U << 30U);
    const int got = gzread(file, bytes + done, static_cast<unsigned>(want));
    if (got < 0) {
      int code = Z_OK;
      const char* message = gzerror(file, &code);
      throw error(path, "corrupt or truncated while reading " + std::string(what) + " (" +
                            std::string(message != nullptr ? message : "zlib error") + ")");
    }
    if (got == 0) {
      throw error(path, "truncated: expected " + std::to_string(size) + " bytes of " +
                            std::string(what) + ", got " + std::to_string(done));
    }
    done += static_cast<std::size_t>(got);
  }
}

/// Reads one big-endian 32-bit header field.
[[nodiscard]] inline std::uint32_t read_u32(gzFile file, const std::filesystem::path& path,
                                            std::string_view what) {
  unsigned char b[4];
  read_exact(file, path, b, sizeof b, what);
  return (std::uint32_t{b[0]} << 24U) | (std::uint32_t{b[1]} << 16U) | (std::uint32_t{b[2]} << 8U) |
         std::uint32_t{b[3]};
}

inline void expect_magic(gzFile file, const std::filesystem::path& path, std::uint32_t expected,
                         std::string_view kind) {
  const std::uint32_t magic = read_u32(file, path, "the magic number");
  if (magic != expected) {
    throw error(path, "not an IDX " + std::string(kind) + " file: magic number " +
                          std::to_string(magic) + ", expected " + std::to_string(expected));
  }
}

/// Throws if anything follows the payload the header announced.
inline void expect_end(gzFile file, const std::filesystem::path& path) {
  unsigned char extra = 0;
  if (gzread(file, &extra, 1) > 0) {
    throw error(path, "trailing data after the size the header announces");
  }
}

}  // namespace detail

/// Reads an IDX image file (magic 2051), e.g. `train-images-idx3-ubyte.gz`.
/// @throws std::runtime_error naming the file when it is missing (with install advice),
///   has the wrong magic number, zero-sized images, or a truncated or oversized payload.
[[nodiscard]] inline Images load_images(const std::filesystem::path& path) {
  const detail::GzFile file = detail::open(path);
  detail::expect_magic(file.get(), path, kImagesMagic, "image");
  Images images;
  images.count = detail::read_u32(file.get(), path, "the image count");
  images.rows = detail::read_u32(file.get(), path, "the row count");
  images.cols = detail::read_u32(file.get(), path, "the column count");
  if (images.rows == 0 || images.cols == 0) {
    throw detail::error(path, "images of " + std::to_string(images.rows) + " x " +
                                  std::to_string(images.cols) + " pixels");
  }
  const std::size_t per_image = images.pixels_per_image();
  constexpr auto kMaxBytes = static_cast<std::size_t>(std::numeric_limits<std::ptrdiff_t>::max());
  if (images.count > kMaxBytes / sizeof(float) / per_image) {
    throw detail::error(
        path, "header announces an implausible size (" + std::to_string(images.count) + " images)");
  }
  const std::size_t total = images.count * per_image;
  std::vector<unsigned char> raw(total);
  detail::read_exact(file.get(), path, raw.data(), total, "pixels");
  detail::expect_end(file.get(), path);
  images.pixels.resize(total);
  for (std::size_t i = 0; i < total; ++i) images.pixels[i] = static_cast<float>(raw[i]) / 255.0F;
  return images;
}

/// Reads an IDX label file (magic 2049), e.g. `train-labels-idx1-ubyte.gz`.
/// @throws std::runtime_error as `load_images` does.
[[nodiscard]] inline std::vector<std::int32_t> load_labels(const std::filesystem::path& path) {
  const detail::GzFile file = detail::open(path);
  detail::expect_magic(file.get(), path, kLabelsMagic, "label");
  const std::size_t count = detail::read_u32(file.get(), path, "the label count");
  std::vector<unsigned char> raw(count);
  detail::read_exact(file.get(), path, raw.data(), count, "labels");
  detail::expect_end(file.get(), path);
  return std::vector<std::int32_t>(raw.begin(), raw.end());
}

/// Loads `<directory>/<name>-images-idx3-ubyte.gz` and `<name>-labels-idx1-ubyte.gz`;
/// `name` is "train" (60000 images) or "t10k" (10000).
/// @throws std::runtime_error as `load_images` does, or if the counts differ.
[[nodiscard]] inline Split load_split(const std::filesystem::path& directory,
                                      std::string_view name) {
  const std::string prefix(name);
  Split split{load_images(directory / (prefix + "-images-idx3-ubyte.gz")),
              load_labels(directory / (prefix + "-labels-idx1-ubyte.gz"))};
  if (split.images.count != split.labels.size()) {
    throw std::runtime_error("fashion_mnist: " + (directory / prefix).string() + ": " +
                             std::to_string(split.images.count) + " images but " +
                             std::to_string(split.labels.size()) + " labels");
  }
  return split;
}

}  // namespace fashion_mnist
