// A plain HTTP client on a loopback socket, for the tests of the trainer's endpoint: what a scraper, the
// kubelet or a hostile client sends, byte for byte, with no library in between.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <string>

namespace testutil {

/// A connected socket to 127.0.0.1:port whose sends and receives time out after timeout_s; -1 if the
/// connection was refused.
inline int connect_to(int port, double timeout_s = 5) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  timeval tv{static_cast<time_t>(timeout_s), static_cast<suseconds_t>((timeout_s - static_cast<int>(timeout_s)) * 1e6)};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

inline bool send_all(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    const ssize_t n = send(fd, s.data() + off, s.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return false;
    off += static_cast<size_t>(n);
  }
  return true;
}

/// Everything the server sends until it closes (or the receive timeout).
inline std::string read_all(int fd) {
  std::string all;
  char buf[4096];
  ssize_t n;
  while ((n = recv(fd, buf, sizeof buf, 0)) > 0) all.append(buf, static_cast<size_t>(n));
  return all;
}

/// The status code of a raw response (0 if there is none).
inline int status_of(const std::string& response) {
  int status = 0;
  std::sscanf(response.c_str(), "HTTP/1.%*d %d", &status);
  return status;
}

/// One request on a fresh connection; returns the raw response ("" when none came).
inline std::string request(int port, const std::string& raw, double timeout_s = 5) {
  int fd = connect_to(port, timeout_s);
  if (fd < 0) return "";
  std::string out = send_all(fd, raw) ? read_all(fd) : "";
  close(fd);
  return out;
}

/// A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, then released), so that tests
/// running in parallel do not collide; -1 if none could be had.
inline int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  close(fd);
  return ok ? ntohs(a.sin_port) : -1;
}

/// A response split into its status, headers and body (status 0 when none came).
struct HttpReply {
  int status = 0;
  std::string headers, body;
};

inline HttpReply parse_reply(const std::string& all) {
  HttpReply r;
  const auto sep = all.find("\r\n\r\n");
  if (sep == std::string::npos) return r;
  r.headers = all.substr(0, sep);
  r.body = all.substr(sep + 4);
  r.status = status_of(all);
  return r;
}

/// GET with HTTP/1.1 and `Connection: close`, as a scraper or the kubelet sends it.
inline HttpReply http_get(int port, const std::string& path) {
  return parse_reply(request(port, "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n", 10));
}

/// GET with HTTP/1.0, so that no server answers in chunks (the Prometheus server's own API).
inline HttpReply http10_get(int port, const std::string& path) {
  return parse_reply(request(port, "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n", 10));
}

}  // namespace testutil
