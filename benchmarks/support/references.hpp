// SPDX-License-Identifier: MIT
// What the benchmarks measure pulley against, shared by them: a raw loopback TCP exchange
// with no protocol at all, and a plain memcpy of as many bytes.
#pragma once

#include <asio.hpp>
#include <cstddef>
#include <cstring>
#include <system_error>
#include <thread>
#include <vector>

namespace pulley::bench {

/// A raw TCP connection over loopback, Nagle off on both ends, and a peer thread: each
/// `exchange()` writes `out_bytes`, the peer reads them and writes `back_bytes`, and it reads
/// those. An echo (out = back = n) moves what a push+pull moves; out = n, back = 1 is a
/// one-way transfer with its acknowledgement.
class RawLoopback {
 public:
  RawLoopback(std::size_t out_bytes, std::size_t back_bytes)
      : acceptor_(io_, {asio::ip::make_address("127.0.0.1"), 0}),
        client_(io_),
        out_(out_bytes, 'x'),
        in_(back_bytes) {
    peer_ = std::thread([this, out_bytes, back_bytes] {
      asio::ip::tcp::socket peer = acceptor_.accept();
      peer.set_option(asio::ip::tcp::no_delay(true));
      std::vector<char> buffer(out_bytes), reply(back_bytes, 'y');
      std::error_code ec;
      while (!ec) {
        asio::read(peer, asio::buffer(buffer), ec);
        if (!ec) asio::write(peer, asio::buffer(reply), ec);
      }
    });
    client_.connect(acceptor_.local_endpoint());
    client_.set_option(asio::ip::tcp::no_delay(true));
  }
  RawLoopback(const RawLoopback&) = delete;
  RawLoopback& operator=(const RawLoopback&) = delete;
  ~RawLoopback() {
    client_.close();  // the peer's read fails, and its loop ends
    peer_.join();
  }

  /// One exchange: `out_bytes` there, `back_bytes` back.
  void exchange() {
    asio::write(client_, asio::buffer(out_));
    asio::read(client_, asio::buffer(in_));
  }

 private:
  asio::io_context io_;
  asio::ip::tcp::acceptor acceptor_;
  asio::ip::tcp::socket client_;
  std::vector<char> out_, in_;
  std::thread peer_;
};

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
