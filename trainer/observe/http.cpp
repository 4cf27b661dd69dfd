#include "trainer/observe/http.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <vector>

#include "common/log.h"
#include "trainer/observe/telemetry.h"

namespace trainer {
namespace {

using Clock = std::chrono::steady_clock;

Clock::time_point after(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// One client connection. It is in one of three states: reading a request head (`out` empty, not
// lingering), writing a response (`out` not empty), or lingering (the response sent and the write side
// shut: what the client still sends is read and dropped until it closes, so closing never resets the
// connection under a response it has not read yet).
struct Connection {
  int fd = -1;
  std::string in;              // received bytes not yet answered (at most one request head, plus a chunk)
  std::string out;             // the response being sent
  size_t sent = 0;             // bytes of `out` sent
  bool close_after = false;    // linger and close once `out` is sent
  bool lingering = false;
  bool eof = false;            // the client shut its side after sending: answer what it sent, then close
  size_t discarded = 0;        // bytes read and dropped while lingering
  int requests = 0;            // answered on this connection
  Clock::time_point since;     // accepted, or the last response finished: the eviction order
  Clock::time_point deadline;  // the current state's deadline
};

struct Request {
  std::string method, path;
  bool keep_alive = true;
};

// What the server answers: a status line's code, the content and whether the connection ends after it.
struct Response {
  int status = 200;
  std::string type = "text/plain; charset=utf-8";
  std::string body;
  std::string extra_headers;  // whole lines, "\r\n" terminated
  bool close = false;
};

const char* reason(int status) {
  switch (status) {
    case 200: return "OK";
    case 202: return "Accepted";
    case 400: return "Bad Request";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 414: return "URI Too Long";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 503: return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
    default: return "Unknown";
  }
}

Response error_response(int status, const std::string& why) { return {status, "text/plain; charset=utf-8", why + "\n", "", true}; }

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  const auto e = s.find_last_not_of(" \t");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

// The end of the request head in `in` (just past its empty line, "\r\n" or a bare "\n"), or npos.
size_t head_end(const std::string& in) {
  for (size_t at = in.find('\n'); at != std::string::npos; at = in.find('\n', at + 1)) {
    if (at + 1 < in.size() && in[at + 1] == '\n') return at + 2;
    if (at + 2 < in.size() && in[at + 1] == '\r' && in[at + 2] == '\n') return at + 3;
  }
  return std::string::npos;
}

// Parses a request head. Returns an error response for anything but a well-formed HTTP/1.x request;
// a request that announces a body is answered and its connection closed (the body is never read).
std::optional<Response> parse_head(const std::string& head, Request& req) {
  std::vector<std::string> lines;
  for (size_t b = 0, e; b < head.size(); b = e + 1) {
    e = head.find('\n', b);
    if (e == std::string::npos) e = head.size();
    std::string line = head.substr(b, e - b);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (!line.empty()) lines.push_back(line);
  }
  if (lines.empty()) return error_response(400, "empty request");
  std::istringstream first(lines[0]);
  std::string target, version, rest;
  if (!(first >> req.method >> target >> version) || (first >> rest)) return error_response(400, "malformed request line");
  if (version != "HTTP/1.1" && version != "HTTP/1.0") return error_response(505, "HTTP/1.0 and HTTP/1.1 only");
  req.keep_alive = version == "HTTP/1.1";
  for (size_t i = 1; i < lines.size(); ++i) {
    const auto colon = lines[i].find(':');
    if (colon == std::string::npos || colon == 0 || lines[i].find_first_of(" \t") < colon)
      return error_response(400, "malformed header line");
    const std::string name = lower(lines[i].substr(0, colon)), value = lower(trim(lines[i].substr(colon + 1)));
    if (name == "connection" && value.find("close") != std::string::npos) req.keep_alive = false;
    if ((name == "content-length" && value != "0") || name == "transfer-encoding") req.keep_alive = false;
  }
  // Absolute form ("http://host/metrics") names the same path; the query is ignored.
  if (target.rfind("http://", 0) == 0) {
    const auto slash = target.find('/', 7);
    target = slash == std::string::npos ? "/" : target.substr(slash);
  }
  req.path = target.substr(0, target.find('?'));
  if (req.path.empty() || req.path[0] != '/') return error_response(400, "the target must be a path");
  return std::nullopt;
}

}  // namespace

struct HttpServer::Impl {
  Telemetry& telemetry;
  HttpServerOptions opt;
  int listen_fd = -1;
  int wake_fd = -1;  // an eventfd: the destructor writes it to end the loop
  int port = 0;
  std::vector<Connection> conns;
  Clock::time_point accept_paused_until;  // out of file descriptors: try again later, not in a busy loop
  std::thread thread;

  Impl(Telemetry& t, HttpServerOptions o) : telemetry(t), opt(std::move(o)) {}
  ~Impl() {
    for (auto& c : conns) ::close(c.fd);
    if (listen_fd >= 0) ::close(listen_fd);
    if (wake_fd >= 0) ::close(wake_fd);
  }

  void bind_and_listen();
  void serve();
  void accept_new();
  void on_readable(Connection& c);
  void on_writable(Connection& c);
  void answer_if_complete(Connection& c);
  Response route(const Request& req);
  void start_response(Connection& c, const Request* req, Response res);
  void close(Connection& c);
};

void HttpServer::Impl::bind_and_listen() {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const std::string where = opt.port == 0 ? opt.host + " on any port" : opt.host + ":" + std::to_string(opt.port);
  const std::string hint = opt.port == 0 ? " (log.http_host: is it an address of this machine?)"
                                         : " (log.http_port / log.http_host: port in use by another process, or not an "
                                           "address of this machine); choose another port or set log.http_port: 0";
  if (getaddrinfo(opt.host.c_str(), std::to_string(opt.port).c_str(), &hints, &found) != 0 || found == nullptr)
    throw std::runtime_error("http: cannot bind " + where + hint);
  int err = 0;
  for (addrinfo* a = found; a != nullptr && listen_fd < 0; a = a->ai_next) {
    int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    // SO_REUSEADDR (not SO_REUSEPORT): a quick restart binds over TIME_WAIT sockets, a second process
    // on the same port fails.
    int yes = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 64) == 0) {
      listen_fd = fd;
    } else {
      err = errno;
      ::close(fd);
    }
  }
  freeaddrinfo(found);
  if (listen_fd < 0) throw std::runtime_error("http: cannot bind " + where + " (" + std::strerror(err) + ")" + hint);
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  getsockname(listen_fd, reinterpret_cast<sockaddr*>(&addr), &len);
  port = ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                          : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
}

void HttpServer::Impl::serve() {
  std::vector<pollfd> fds;
  for (;;) {
    fds.clear();
    fds.push_back({wake_fd, POLLIN, 0});
    const bool accepting = Clock::now() >= accept_paused_until;
    fds.push_back({listen_fd, static_cast<short>(accepting ? POLLIN : 0), 0});
    auto next = accepting ? Clock::now() + std::chrono::seconds(1) : accept_paused_until;
    for (const auto& c : conns) {
      fds.push_back({c.fd, static_cast<short>(c.out.size() > c.sent ? POLLOUT : c.eof ? 0 : POLLIN), 0});
      next = std::min(next, c.deadline);
    }
    const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(next - Clock::now()).count();
    if (::poll(fds.data(), fds.size(), static_cast<int>(std::max<int64_t>(0, wait) + 1)) < 0 && errno != EINTR) {
      spdlog::error("http: poll failed ({}); the endpoint stops", std::strerror(errno));
      return;
    }
    if (fds[0].revents != 0) return;  // the destructor
    const auto now = Clock::now();
    for (size_t i = 0; i < conns.size(); ++i) {
      Connection& c = conns[i];
      const short ev = fds[i + 2].revents;
      if (ev & (POLLIN | POLLHUP | POLLERR)) on_readable(c);
      if (c.fd >= 0 && (ev & (POLLOUT | POLLERR))) on_writable(c);
      if (c.fd >= 0 && c.deadline <= now) close(c);
    }
    conns.erase(std::remove_if(conns.begin(), conns.end(), [](const Connection& c) { return c.fd < 0; }), conns.end());
    if (fds[1].revents & POLLIN) accept_new();
  }
}

void HttpServer::Impl::accept_new() {
  // A bounded number per round, so the connections just accepted are answered before more arrive.
  for (int k = 0; k < 16; ++k) {
    const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0 && (errno == EMFILE || errno == ENFILE)) accept_paused_until = after(0.1);
    if (fd < 0) return;  // EAGAIN: none left (or an error of that one connection)
    if (static_cast<int>(conns.size()) >= opt.max_connections) {
      // Full: the connection that has waited longest goes. A silent or slow client then holds a slot for
      // at most as long as it takes others to connect, and a probe, which sends its request at once, is
      // answered in the round after it connects.
      auto oldest = std::min_element(conns.begin(), conns.end(),
                                     [](const Connection& a, const Connection& b) { return a.since < b.since; });
      ::close(oldest->fd);
      conns.erase(oldest);
    }
    Connection c;
    c.fd = fd;
    c.since = Clock::now();
    c.deadline = after(opt.read_timeout_s);
    conns.push_back(std::move(c));
  }
}

void HttpServer::Impl::on_readable(Connection& c) {
  char buf[16384];
  for (;;) {
    // Never more than a request head (plus one chunk) is held per connection.
    if (!c.lingering && c.in.size() > static_cast<size_t>(opt.max_request_bytes)) break;
    const ssize_t n = ::recv(c.fd, buf, sizeof buf, 0);
    if (n == 0 && !c.lingering && !c.in.empty()) {
      c.eof = true;  // a request, then shutdown(SHUT_WR): still answered
      break;
    }
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
      close(c);  // the client closed or reset: nothing to answer
      return;
    }
    if (n < 0) break;
    if (c.lingering) {
      // A client still sending 64 KiB after its answer is not reading it: close now.
      c.discarded += static_cast<size_t>(n);
      if (c.discarded > 64 * 1024) {
        close(c);
        return;
      }
      continue;
    }
    // The first byte of a kept-alive connection's next request starts its read timeout.
    if (c.in.empty() && c.requests > 0 && c.out.empty()) c.deadline = after(opt.read_timeout_s);
    c.in.append(buf, static_cast<size_t>(n));
  }
  if (!c.lingering && c.out.size() == c.sent) answer_if_complete(c);
}

void HttpServer::Impl::answer_if_complete(Connection& c) {
  const size_t end = head_end(c.in);
  if (end == std::string::npos || end > static_cast<size_t>(opt.max_request_bytes)) {
    if (c.in.size() < static_cast<size_t>(opt.max_request_bytes)) {
      if (c.eof) close(c);  // half a request and no more to come
      return;               // else wait for more
    }
    const bool line_too_long = c.in.find('\n') > static_cast<size_t>(opt.max_request_bytes);
    start_response(c, nullptr,
                   line_too_long ? error_response(414, "request line longer than " + std::to_string(opt.max_request_bytes) + " bytes")
                                 : error_response(431, "request head longer than " + std::to_string(opt.max_request_bytes) + " bytes"));
    return;
  }
  Request req;
  const std::string head = c.in.substr(0, end);
  c.in.erase(0, end);
  if (auto bad = parse_head(head, req)) {
    start_response(c, nullptr, *bad);
    return;
  }
  start_response(c, &req, route(req));
}

Response HttpServer::Impl::route(const Request& req) {
  if (req.method != "GET" && req.method != "HEAD") {
    Response r = error_response(405, "GET or HEAD only");
    r.extra_headers = "Allow: GET, HEAD\r\n";
    return r;
  }
  Response r;
  Telemetry& t = telemetry;
  try {
    std::string why;
    if (req.path == "/metrics") {
      r.type = "text/plain; version=0.0.4; charset=utf-8";
      r.body = t.prometheus_text(opt.root);
    } else if (req.path == "/healthz" || req.path == "/readyz") {
      r.status = (req.path == "/healthz" ? t.live(&why) : t.ready(&why)) ? 200 : 503;
      r.body = why + "\n";
    } else if (req.path == "/memory") {
      // The report needs the device allocator's state, which belongs to the loop's thread: ask for a
      // fresh one and answer with the latest one written.
      t.request_memory_report();
      r.type = "application/json";
      r.body = t.memory_report();
      if (r.body.empty()) {
        r.status = 202;
        r.body = "{\"status\": \"requested\", \"message\": \"no memory report yet; one is written after the current "
                 "step (memory_report_<step>.json in the run folder); ask again\"}\n";
      }
    } else if (req.path == "/") {
      r.body = "trainer endpoints: /metrics /healthz /readyz /memory\n";
    } else {
      r = error_response(404, "not found; endpoints: /metrics /healthz /readyz /memory");
      r.close = false;
    }
  } catch (const std::exception& e) {
    r = error_response(500, "internal error: " + error_message(e));
  }
  return r;
}

void HttpServer::Impl::start_response(Connection& c, const Request* req, Response res) {
  ++c.requests;
  c.close_after = res.close || req == nullptr || !req->keep_alive || c.requests >= opt.max_requests_per_connection;
  std::string out = "HTTP/1.1 " + std::to_string(res.status) + " " + reason(res.status) + "\r\n";
  out += "Content-Type: " + res.type + "\r\n";
  out += "Content-Length: " + std::to_string(res.body.size()) + "\r\n";
  out += c.close_after ? "Connection: close\r\n" : "Connection: keep-alive\r\n";
  out += res.extra_headers + "\r\n";
  if (req == nullptr || req->method != "HEAD") out += res.body;
  c.out = std::move(out);
  c.sent = 0;
  c.deadline = after(opt.write_timeout_s);
  on_writable(c);  // most responses fit the socket's buffer: sent now, without another round
}

void HttpServer::Impl::on_writable(Connection& c) {
  while (c.sent < c.out.size()) {
    const ssize_t n = ::send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;  // wait for POLLOUT
    if (n <= 0) {
      close(c);
      return;
    }
    c.sent += static_cast<size_t>(n);
  }
  c.out.clear();
  c.sent = 0;
  c.since = Clock::now();
  if (c.close_after && c.eof) {
    close(c);
    return;
  }
  if (c.close_after) {
    ::shutdown(c.fd, SHUT_WR);
    c.lingering = true;
    c.in.clear();
    c.deadline = after(std::min(1.0, opt.read_timeout_s));
    return;
  }
  c.deadline = after(c.in.empty() ? opt.idle_timeout_s : opt.read_timeout_s);
  answer_if_complete(c);  // a pipelined request already received
}

void HttpServer::Impl::close(Connection& c) {
  if (c.fd >= 0) ::close(c.fd);
  c.fd = -1;
}

HttpServer::HttpServer(Telemetry& telemetry, const std::string& host, int port)
    : HttpServer(telemetry, [&] {
        HttpServerOptions o;
        o.host = host;
        o.port = port;
        return o;
      }()) {}

HttpServer::HttpServer(Telemetry& telemetry, HttpServerOptions options)
    : impl_(std::make_unique<Impl>(telemetry, std::move(options))) {
  const HttpServerOptions& o = impl_->opt;
  if (o.port < 0 || o.port > 65535)
    throw std::invalid_argument("http: port must be in [0, 65535] (0 = any free port), got " + std::to_string(o.port));
  if (o.max_connections < 1 || o.max_request_bytes < 256 || o.max_requests_per_connection < 1)
    throw std::invalid_argument("http: max_connections and max_requests_per_connection must be >= 1, "
                                "max_request_bytes >= 256");
  if (!(o.read_timeout_s > 0) || !(o.write_timeout_s > 0) || !(o.idle_timeout_s > 0))
    throw std::invalid_argument("http: read, write and idle timeouts must be > 0 seconds");
  impl_->bind_and_listen();
  impl_->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (impl_->wake_fd < 0) throw std::runtime_error(std::string("http: eventfd: ") + std::strerror(errno));
  impl_->thread = std::thread([impl = impl_.get()] { impl->serve(); });
}

HttpServer::~HttpServer() {
  if (!impl_) return;
  const uint64_t one = 1;
  if (::write(impl_->wake_fd, &one, sizeof one) != sizeof one) spdlog::error("http: cannot wake the server's thread");
  if (impl_->thread.joinable()) impl_->thread.join();
}

int HttpServer::port() const { return impl_->port; }
const std::string& HttpServer::host() const { return impl_->opt.host; }
std::string HttpServer::url() const { return "http://" + impl_->opt.host + ":" + std::to_string(impl_->port); }

}  // namespace trainer
