// SPDX-License-Identifier: MIT
#pragma once

// What the TCP tests share: the job's credentials, a raw client that speaks the wire format
// (with or without the handshake) to send what a real client would not, and a fake ps that
// completes the handshake and then never reads.

#include <asio.hpp>

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "pulley/transport/tcp.hpp"

namespace pulley::testing {

/// `n` ports of 127.0.0.1 free a moment ago, as "127.0.0.1:port", held together so that
/// they differ. They are taken below Linux's ephemeral range (32768 and up): a test
/// running beside this one that binds port 0, or connects, is never given one meanwhile.
inline std::vector<std::string> free_addresses(std::size_t n) {
  asio::io_context io;
  std::vector<asio::ip::tcp::acceptor> held;
  std::vector<std::string> addresses;
  std::random_device seed;
  std::mt19937 random(seed());
  std::uniform_int_distribution<int> port(20000, 32767);
  for (int tries = 0; addresses.size() < n && tries < 10000; ++tries) {
    asio::ip::tcp::acceptor acceptor(io);
    asio::error_code error;
    const asio::ip::tcp::endpoint at(asio::ip::make_address("127.0.0.1"), static_cast<std::uint16_t>(port(random)));
    acceptor.open(at.protocol(), error);
    if (!error) acceptor.bind(at, error);
    if (error) continue;
    addresses.push_back("127.0.0.1:" + std::to_string(at.port()));
    held.push_back(std::move(acceptor));
  }
  if (addresses.size() != n) throw std::runtime_error("no " + std::to_string(n) + " free ports on 127.0.0.1");
  return addresses;
}

/// The credentials every task of a test job holds.
inline Credentials test_credentials() { return {"test-job", "a secret only the test knows"}; }

/// Client options of a test job's tasks.
inline TcpOptions test_client_options() {
  TcpOptions options;
  options.credentials = test_credentials();
  return options;
}

/// A client of the test job, as task `self`.
inline Tcp client(Node self, const std::vector<std::string>& addresses,
                  TcpOptions options = test_client_options()) {
  options.credentials = test_credentials();
  return Tcp(self, addresses, options);
}

/// Server options of the test job, which shut a ps down quickly while its own clients stay
/// connected.
inline TcpServerOptions test_server_options() {
  TcpServerOptions options;
  options.credentials = test_credentials();
  options.linger = std::chrono::milliseconds(100);
  return options;
}

/// Reads one whole frame (header, metadata, padding, payload) from `socket` within `limit`;
/// returns its header, or nullopt (the socket then closed).
inline std::optional<wire::Header> read_frame(asio::io_context& io, asio::ip::tcp::socket& socket,
                                              std::vector<char>& body,
                                              std::chrono::milliseconds limit = std::chrono::seconds(5)) {
  wire::Header header;
  bool done = false;
  asio::async_read(socket, asio::buffer(&header, sizeof header),
                   [&](std::error_code ec, std::size_t) {
                     if (ec) return;
                     body.resize(wire::head_bytes(header) - sizeof header + header.payload_bytes);
                     asio::async_read(socket, asio::buffer(body), [&](std::error_code ec2, std::size_t) {
                       done = !ec2;
                     });
                   });
  io.restart();
  io.run_for(limit);
  if (!done) {
    std::error_code ignored;
    socket.close(ignored);
    io.restart();
    io.run();
    return std::nullopt;
  }
  return header;
}

/// Writes a whole frame to `socket`.
inline void write_frame(asio::ip::tcp::socket& socket, const wire::Frame& frame) {
  transport_detail::GatherList list;
  list.append(frame);
  asio::write(socket, list.remaining());
}

/// A raw connection to a ps, for sending frames a real client would not.
struct RawClient {
  asio::io_context io;
  asio::ip::tcp::socket socket{io};

  /// Connects to `port` on 127.0.0.1 (no handshake).
  void connect(std::uint16_t port) { socket.connect({asio::ip::make_address("127.0.0.1"), port}); }

  /// Connects and completes the handshake as `self`; returns "" once welcomed, else why
  /// not (the ps's refusal, or what went wrong).
  std::string join(std::uint16_t port, Node self, const Credentials& credentials = test_credentials(),
                   std::uint64_t incarnation = wire::incarnation()) {
    connect(port);
    return handshake(self, credentials, incarnation);
  }

  /// The handshake on a connected socket; returns what `join` returns.
  std::string handshake(Node self, const Credentials& credentials = test_credentials(),
                        std::uint64_t incarnation = wire::incarnation()) {
    std::vector<char> body;
    const auto first = read_frame(io, socket, body);
    if (!first) return "no challenge";
    const auto challenge =
        wire::decode_handshake_as<wire::Challenge>(*first, std::span(body).first(first->meta_bytes));
    const std::string nonce = wire::make_nonce();
    write_frame(socket, wire::encode(wire::Handshake{wire::Hello{
                                         credentials.job, self, nonce,
                                         wire::client_proof(credentials.secret, challenge, self, nonce),
                                         incarnation}},
                                     0));
    const auto answer = read_frame(io, socket, body);
    if (!answer) return "no answer to the hello";
    const wire::Handshake reply = wire::decode_handshake(*answer, std::span(body).first(answer->meta_bytes));
    if (const auto* refusal = std::get_if<wire::Refusal>(&reply)) return refusal->reason;
    return std::holds_alternative<wire::Welcome>(reply) ? "" : "an odd answer";
  }

  void send(const Request& request, std::uint64_t call) {
    write_frame(socket, wire::encode(request, call));
  }

  /// Reads one whole frame within five seconds; returns its header (call 0 on timeout or
  /// when the ps closed the connection).
  wire::Header receive(std::vector<char>& body) {
    const auto header = read_frame(io, socket, body);
    if (header) return *header;
    wire::Header none;
    none.call = 0;
    return none;
  }

  /// True once the ps has closed the connection (EOF or reset) within `limit`.
  bool closed_by_ps(std::chrono::milliseconds limit = std::chrono::seconds(5)) {
    std::array<char, 256> sink{};
    bool closed = false;
    std::function<void()> drain = [&] {
      socket.async_read_some(asio::buffer(sink), [&](std::error_code ec, std::size_t) {
        if (ec) {
          closed = ec == asio::error::eof || ec == asio::error::connection_reset;
          return;
        }
        drain();
      });
    };
    drain();
    io.restart();
    io.run_for(limit);
    std::error_code ignored;
    socket.close(ignored);
    io.restart();
    io.run();
    return closed;
  }
};

/// The ps's side of the handshake on an accepted socket, by hand: challenge, read the hello,
/// welcome it (with the proof a real ps would give). For fake peers.
inline void welcome(asio::io_context& io, asio::ip::tcp::socket& socket, std::uint32_t ps_task = 0) {
  const Credentials credentials = test_credentials();
  const wire::Challenge challenge{credentials.job, ps_task, wire::make_nonce()};
  write_frame(socket, wire::encode(wire::Handshake{challenge}, 0));
  std::vector<char> body;
  const auto header = read_frame(io, socket, body);
  if (!header) return;
  const auto hello = wire::decode_handshake_as<wire::Hello>(*header, std::span(body).first(header->meta_bytes));
  write_frame(socket, wire::encode(wire::Handshake{wire::Welcome{
                                       wire::server_proof(credentials.secret, challenge, hello)}},
                                   0));
}

}  // namespace pulley::testing
