// SPDX-License-Identifier: MIT
// What the benchmarks measure pulley against, shared by them: a raw exchange over loopback
// TCP or a local socket with no protocol at all, and a plain memcpy of as many bytes.
#pragma once

#include <unistd.h>

#include <asio.hpp>
#include <cstddef>
#include <cstring>
#include <string>
#include <system_error>
#include <thread>
#include <type_traits>
#include <vector>

namespace pulley::bench {

/// A raw stream connection on this host and a peer thread, no protocol at all: each
/// `exchange()` writes `out_bytes`, the peer reads them and writes `back_bytes`, and it reads
/// those. An echo (out = back = n) moves what a push+pull moves; out = n, back = 1 is a
/// one-way transfer with its acknowledgement. `Protocol` is asio::ip::tcp (loopback, Nagle
/// off on both ends: RawLoopback) or asio::local::stream_protocol (an abstract Unix-domain
/// socket with 4 MiB send buffers, as pulley's local sockets have: RawLocal).
template <class Protocol>
class RawStream {
 public:
  RawStream(std::size_t out_bytes, std::size_t back_bytes)
      : acceptor_(io_, listen_at()), client_(io_), out_(out_bytes, 'x'), in_(back_bytes) {
    peer_ = std::thread([this, out_bytes, back_bytes] {
      typename Protocol::socket peer = acceptor_.accept();
      tune(peer);
      std::vector<char> buffer(out_bytes), reply(back_bytes, 'y');
      std::error_code ec;
      while (!ec) {
        asio::read(peer, asio::buffer(buffer), ec);
        if (!ec) asio::write(peer, asio::buffer(reply), ec);
      }
    });
    client_.connect(acceptor_.local_endpoint());
    tune(client_);
  }
  RawStream(const RawStream&) = delete;
  RawStream& operator=(const RawStream&) = delete;
  ~RawStream() {
    client_.close();  // the peer's read fails, and its loop ends
    peer_.join();
  }

  /// One exchange: `out_bytes` there, `back_bytes` back.
  void exchange() {
    asio::write(client_, asio::buffer(out_));
    asio::read(client_, asio::buffer(in_));
  }

 private:
  static typename Protocol::endpoint listen_at() {
    if constexpr (std::is_same_v<Protocol, asio::ip::tcp>) {
      return {asio::ip::make_address("127.0.0.1"), 0};
    } else {
      static int made = 0;
      return typename Protocol::endpoint(std::string(1, '\0') + "pulley-bench/" + std::to_string(::getpid()) + "/" +
                                         std::to_string(made++));
    }
  }
  static void tune(typename Protocol::socket& socket) {
    if constexpr (std::is_same_v<Protocol, asio::ip::tcp>) {
      socket.set_option(asio::ip::tcp::no_delay(true));
    } else {
      socket.set_option(asio::socket_base::send_buffer_size(4 << 20));
    }
  }

  asio::io_context io_;
  typename Protocol::acceptor acceptor_;
  typename Protocol::socket client_;
  std::vector<char> out_, in_;
  std::thread peer_;
};

using RawLoopback = RawStream<asio::ip::tcp>;
using RawLocal = RawStream<asio::local::stream_protocol>;

/// A memcpy of `bytes` between two buffers of its own, which the compiler may not drop.
class Memcpy {
 public:
  explicit Memcpy(std::size_t bytes) : from_(bytes, 'a'), to_(bytes) {}
  void operator()() {
    std::memcpy(to_.data(), from_.data(), from_.size());
    asm volatile("" : : "r"(to_.data()) : "memory");
  }

 private:
  std::vector<char> from_, to_;
};

}  // namespace pulley::bench
