// SPDX-License-Identifier: MIT
#pragma once

/// What the TCP client and server share: addresses, listening, the local sockets of tasks
/// on one host, and gather-writes of frames that take what the kernel accepts now without
/// waiting.

#include <algorithm>
#include <array>
#include <asio.hpp>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <ifaddrs.h>
#include <sys/socket.h>
#endif

#include "pulley/core/error.hpp"
#include "pulley/transport/wire/frame.hpp"

namespace pulley::transport_detail {

/// The first endpoint `host` resolves to (a name, a numeric address, "0.0.0.0" or "::" for
/// every interface) with `port`; throws kInvalidArgument when it does not resolve.
inline asio::ip::tcp::endpoint resolve_listen_endpoint(asio::io_context& io,
                                                       const std::string& host,
                                                       std::uint16_t port) {
  std::error_code ec;
  asio::ip::tcp::resolver resolver(io);
  const auto results =
      resolver.resolve(host, std::to_string(port), asio::ip::resolver_base::passive, ec);
  if (ec || results.empty()) {
    throw Error(ErrorCode::kInvalidArgument,
                "cannot listen on '" + host + "': " + (ec ? ec.message() : "no address"));
  }
  return results.begin()->endpoint();
}

/// What `host`:`port` resolves to, or an error in `ec`, by `deadline`: a numeric address at
/// once; a name by the system's resolver, which has no deadline of its own (a DNS server that
/// does not answer holds getaddrinfo 10 s and more, a default resolv.conf's 5 s times 2
/// tries), on a thread of its own that is left to finish alone when `deadline` comes first
/// (`ec` then std::errc::timed_out). For the looks and connections that promise an answer in
/// their time (probe_ps, listens_at, the ring's); a ps binding its own address resolves
/// the plain way (resolve_listen_endpoint).
template <class Clock, class Duration>
asio::ip::tcp::resolver::results_type resolve_by(const std::string& host, std::uint16_t port,
                                                 std::chrono::time_point<Clock, Duration> deadline,
                                                 std::error_code& ec) {
  using Results = asio::ip::tcp::resolver::results_type;
  ec.clear();
  std::error_code not_numeric;
  const asio::ip::address numeric = asio::ip::make_address(host, not_numeric);
  if (!not_numeric)
    return Results::create(asio::ip::tcp::endpoint(numeric, port), host, std::to_string(port));
  struct Answer {
    std::mutex mutex;
    std::condition_variable done_cv;
    bool done = false;
    Results results;
    std::error_code ec;
  };
  const auto answer = std::make_shared<Answer>();
  try {
    std::thread([answer, host, port] {
      asio::io_context io;
      asio::ip::tcp::resolver resolver(io);
      std::error_code resolved_ec;
      Results results = resolver.resolve(host, std::to_string(port), resolved_ec);
      const std::scoped_lock lock(answer->mutex);
      answer->results = std::move(results);
      answer->ec = resolved_ec;
      answer->done = true;
      answer->done_cv.notify_all();
    }).detach();
  } catch (const std::system_error& e) {  // no thread to be had: nothing resolved
    ec = e.code();
    return {};
  }
  std::unique_lock lock(answer->mutex);
  while (!answer->done) {
    if (answer->done_cv.wait_until(lock, deadline) == std::cv_status::timeout && !answer->done) {
      ec = std::make_error_code(std::errc::timed_out);
      return {};
    }
  }
  ec = answer->ec;
  return answer->results;
}

/// An acceptor listening on `endpoint`; throws kUnavailable naming it (e.g. a port in use).
inline asio::ip::tcp::acceptor listen(asio::io_context& io,
                                      const asio::ip::tcp::endpoint& endpoint) {
  try {
    return asio::ip::tcp::acceptor(io, endpoint);
  } catch (const std::system_error& e) {
    throw Error(ErrorCode::kUnavailable, "cannot listen on " + endpoint.address().to_string() +
                                             ":" + std::to_string(endpoint.port()) + ": " +
                                             e.code().message());
  }
}

/// The socket a TCP client and server talk over: a TCP one, or, between tasks on one host,
/// a local (Unix-domain) one (see `local_socket_name`).
using StreamSocket = asio::generic::stream_protocol::socket;

/// True where a ps also listens on a local socket and clients on its host use it: Linux,
/// whose abstract socket names (no file, gone with the process) belong to one network
/// namespace, as the ps's TCP port does: a client in another namespace, whose link to the
/// ps may be cut, never reaches it this way.
#if defined(__linux__)
inline constexpr bool kLocalSockets = true;
#else
inline constexpr bool kLocalSockets = false;
#endif

/// The abstract socket name of a ps listening on TCP `address`:`port` ("\0pulley/127.0.0.1:2222",
/// "\0pulley/[::]:2222"): a ps binds it beside its port, and a client that reaches that
/// address on its own host connects there instead.
inline std::string local_socket_name(const asio::ip::address& address, std::uint16_t port) {
  const std::string host = address.is_v6() ? "[" + address.to_string() + "]" : address.to_string();
  return std::string(1, '\0') + "pulley/" + host + ":" + std::to_string(port);
}

/// True if `address` is one an interface of this host holds now (getifaddrs).
inline bool held_by_an_interface(const asio::ip::address& address) {
#if defined(__linux__)
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return false;
  bool found = false;
  for (const ifaddrs* a = list; a != nullptr && !found; a = a->ifa_next) {
    if (a->ifa_addr == nullptr) continue;
    if (a->ifa_addr->sa_family == AF_INET && address.is_v4()) {
      asio::ip::address_v4::bytes_type bytes{};
      std::memcpy(bytes.data(), &reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr, bytes.size());
      found = asio::ip::address_v4(bytes) == address.to_v4();
    } else if (a->ifa_addr->sa_family == AF_INET6 && address.is_v6()) {
      asio::ip::address_v6::bytes_type bytes{};
      std::memcpy(bytes.data(), &reinterpret_cast<const sockaddr_in6*>(a->ifa_addr)->sin6_addr, bytes.size());
      found = asio::ip::address_v6(bytes) == address.to_v6();
    }
  }
  freeifaddrs(list);
  return found;
#else
  (void)address;
  return false;
#endif
}

/// True if `address` is this host's: a loopback address, or one an interface holds. The
/// answer for an address is kept (a reconnect asks again for the same ps): an address that
/// moves to or from this host later merely takes the other path, since a local name no ps
/// holds is refused at once and the client goes on over TCP.
inline bool is_this_hosts(const asio::ip::address& address) {
  if (address.is_loopback()) return true;
  static std::mutex mutex;
  static std::map<asio::ip::address, bool> known;
  const std::lock_guard lock(mutex);
  const auto [it, inserted] = known.try_emplace(address, false);
  if (inserted) it->second = held_by_an_interface(address);
  return it->second;
}

/// The local socket names to try, in order, for a ps at TCP `address`:`port`: none unless
/// the address is this host's; else the name of a ps listening on that address, then those
/// of one listening on every interface ("0.0.0.0" for an IPv4 address, and "::"). Each name
/// belongs to whichever process listens on that TCP address and port, so a client reaches
/// the same ps either way (and proves itself to it in the same handshake).
inline std::vector<std::string> local_socket_names(const asio::ip::address& address, std::uint16_t port) {
  if (!kLocalSockets || !is_this_hosts(address)) return {};
  std::vector<std::string> names{local_socket_name(address, port)};
  if (address.is_v4()) names.push_back(local_socket_name(asio::ip::address_v4::any(), port));
  names.push_back(local_socket_name(asio::ip::address_v6::any(), port));
  return names;
}

/// Asks for send buffers of 4 MiB on a local socket (the kernel caps it at
/// net.core.wmem_max): a Unix-domain socket's default (about 200 KiB) makes a megabyte's
/// frame cross in many small wake-ups, where TCP loopback grows its window by itself.
inline void widen_local_buffers(StreamSocket& socket) {
  std::error_code ignored;  // without it, merely more wake-ups
  socket.set_option(asio::socket_base::send_buffer_size(4 << 20), ignored);
}

/// The buffers of several frames, gather-written in order and consumed as the kernel takes
/// them.
class GatherList {
 public:
  /// Appends a frame: header, metadata, padding, payload views (which must outlive the write).
  void append(const wire::Frame& f) {
    buffers_.emplace_back(&f.header, sizeof f.header);
    if (!f.meta.empty()) buffers_.emplace_back(f.meta.data(), f.meta.size());
    if (const std::size_t pad = wire::padding(f.meta.size())) {
      buffers_.emplace_back(wire::kZeros.data(), pad);
    }
    for (std::span<const float> v : f.payload) {
      if (!v.empty()) buffers_.emplace_back(v.data(), v.size_bytes());
    }
    bytes_ += f.size();
    appended_ += f.size();
  }

  /// Writes what `socket` (non-blocking) takes now; returns false on an error other than
  /// would_block, in `ec`.
  template <class Socket>
  bool write_now(Socket& socket, std::error_code& ec) {
    while (!empty()) {
      const std::size_t n = socket.write_some(remaining(), ec);
      if (ec == asio::error::would_block || ec == asio::error::try_again) {
        ec.clear();
        return true;
      }
      if (ec) return false;
      consume(n);
    }
    return true;
  }

  /// What is left to write.
  [[nodiscard]] std::span<const asio::const_buffer> remaining() const {
    return std::span(buffers_).subspan(first_);
  }
  /// Bytes left to write.
  [[nodiscard]] std::uint64_t bytes() const noexcept { return bytes_; }
  /// Bytes appended since the last `clear`, and of those, bytes written.
  [[nodiscard]] std::uint64_t appended() const noexcept { return appended_; }
  [[nodiscard]] std::uint64_t written() const noexcept { return appended_ - bytes_; }
  [[nodiscard]] bool empty() const noexcept { return bytes_ == 0; }

  /// Appends bytes that are no frame of their own (a copy of another list's remainder).
  void append(const char* data, std::size_t n) {
    if (n == 0) return;
    buffers_.emplace_back(data, n);
    bytes_ += n;
    appended_ += n;
  }

  /// Copies what is left to `out`, which has room for `bytes()`.
  void copy_remaining(char* out) const {
    for (const asio::const_buffer& b : remaining()) {
      std::memcpy(out, b.data(), b.size());
      out += b.size();
    }
  }

  /// `n` bytes were written.
  void consume(std::size_t n) {
    bytes_ -= n;
    while (n > 0) {
      asio::const_buffer& b = buffers_[first_];
      if (n < b.size()) {
        b += n;
        return;
      }
      n -= b.size();
      ++first_;
    }
    while (first_ < buffers_.size() && buffers_[first_].size() == 0) ++first_;
  }

  void clear() {
    buffers_.clear();
    first_ = 0;
    bytes_ = 0;
    appended_ = 0;
  }

 private:
  std::vector<asio::const_buffer> buffers_;
  std::size_t first_ = 0;
  std::uint64_t bytes_ = 0;
  std::uint64_t appended_ = 0;
};

/// FrameReader's receive buffers as an Asio buffer sequence; holds them while a receive is
/// under way.
class ReceiveBuffers {
 public:
  /// While a large payload comes in, a receive completes only once a quarter of what is left
  /// of it (at most 512 KiB) has arrived, not once per arriving burst: few wake-ups while
  /// much is to come, small ones at the end, so the last copy overlaps the sender's.
  /// Measured on loopback: 16 MB push+pull 0.70 -> 0.9 of a blocking echo, 1 MB 0.7 -> 1.0
  /// (a fixed 512 KiB mark helped at 16 MB and hurt at 1 MB). Never more than the peer has
  /// committed to send, and Linux (5.10 and later) still wakes a reader whose receive window
  /// closes or whose memory is under pressure, so it cannot wait for bytes that will not
  /// come; a closed connection or an error completes it at once. One setsockopt when the
  /// mark changes.
  /// (Not for a local socket, whose non-blocking receives return what has come whatever
  /// the mark.)
  template <class Socket>
  void watermark(Socket& socket, std::uint64_t payload_left) {
    constexpr std::uint64_t kMaxMark = std::uint64_t{512} << 10U;
    const int mark = static_cast<int>(std::clamp<std::uint64_t>(payload_left / 4, 1, kMaxMark));
    if (mark == mark_) return;
    std::error_code failed;  // without a mark, receives are merely more numerous
    socket.set_option(asio::socket_base::receive_low_watermark(mark), failed);
    if (!failed) mark_ = mark;  // else the next receive sets it again
  }

  /// The sequence for `spans` (at most 16), valid until the next call.
  std::span<const asio::mutable_buffer> of(std::span<const std::span<std::byte>> spans) {
    count_ = 0;
    for (std::span<std::byte> s : spans) {
      if (count_ == buffers_.size()) break;
      buffers_[count_++] = asio::mutable_buffer(s.data(), s.size());
    }
    return {buffers_.data(), count_};
  }

 private:
  std::array<asio::mutable_buffer, 16> buffers_{};
  std::size_t count_ = 0;
  int mark_ = 1;
};

}  // namespace pulley::transport_detail
