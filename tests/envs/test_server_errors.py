"""The retrieval service's answers to bad requests: every error a JSON body that says what was
wrong and what to send, with its status code; the service goes on serving. On 127.0.0.1 only."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

import pytest
from loopback_http import serving

from rftgym.envs.search.corpora import Document
from rftgym.envs.search.retrievers import BM25Retriever
from rftgym.envs.search.client import RemoteRetriever, RetrievalServiceError
from rftgym.envs.search.server import make_server

DOCS = [
    Document("d0", "Paris", "Paris is the capital of France."),
    Document("d1", "Berlin", "Berlin is the capital of Germany."),
    Document("d2", "Cheese", "Camembert is a soft cheese."),
]
GOOD = b'{"queries": ["cheese"], "topk": 1}'
TLS_CLIENT_HELLO = bytes.fromhex("16030100a5010000a10303") + bytes(32)  # no line end in it


@pytest.fixture(scope="module")
def server():
    server = make_server(BM25Retriever(DOCS), host="127.0.0.1", port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def address(server) -> tuple[str, int]:
    parts = urllib.parse.urlsplit(server.url)
    return parts.hostname, parts.port


def post(body: bytes, *headers: str, path: str = "/retrieve", length: int | None = None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", f"Content-Length: {len(body) if length is None else length}",
             *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def exchange(server, data: bytes, close_after_send: bool = True) -> bytes:
    """Send ``data`` on a fresh connection and read everything until the server closes it."""
    with socket.create_connection(address(server), timeout=10) as sock:
        sock.sendall(data)
        if close_after_send:
            sock.shutdown(socket.SHUT_WR)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return received


def replies(received: bytes) -> list[tuple[int, dict, bytes]]:
    """The HTTP replies in ``received``: (status, headers by lower-case name, body)."""
    out = []
    while received:
        head, _, rest = received.partition(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in header_lines)}
        length = int(headers.get("content-length", 0))
        out.append((int(status_line.split()[1]), headers, rest[:length]))
        received = rest[length:]
    return out


def json_error(received: bytes) -> tuple[int, str]:
    (status, headers, body), = replies(received)
    assert headers["content-type"] == "application/json", headers
    return status, json.loads(body)["error"]


def assert_still_serving(server) -> None:
    (status, _, body), = replies(exchange(server, post(GOOD, "Content-Type: application/json", "Connection: close")))
    assert status == 200 and json.loads(body)["result"][0][0]["document"]["id"] == "d2"


CASES = [
    # (what the client sends, status, what the error says)
    (b"hello garbage\r\n\r\n", 400, "this service answers POST /retrieve with a JSON body"),
    (b"GET /health\r\n\r\n", 400, "HTTP/0.9 request ('GET /health')"),
    (b"POST /retrieve HTTP/9.0\r\nHost: x\r\n\r\n", 505, "send HTTP/1.1"),
    (b"FOO /retrieve HTTP/1.1\r\nHost: x\r\n\r\n", 501, "this service serves POST /retrieve and GET /health"),
    (b"post /retrieve HTTP/1.1\r\nHost: x\r\n\r\n", 501, "method names are upper case"),
    (b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n", 414, "queries go in the JSON body of POST /retrieve"),
    (b"POST /retrieve HTTP/1.1\r\nX-Long: " + b"a" * 70_000 + b"\r\n\r\n", 431, "send fewer and shorter headers"),
    (b"POST /retrieve HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(120)) + b"\r\n", 431,
     "got more than 100 headers"),
    (post(b"hello"), 400, "the request body is not JSON (Expecting value"),
    (post(b"queries=cheese", "Content-Type: application/x-www-form-urlencoded"), 400,
     "not JSON (it came as application/x-www-form-urlencoded"),
    (post(b"\xff\xfe{}"), 400, "the request body is not UTF-8 text"),
    (post(b""), 400, "the request body is empty; send the JSON object"),
    (post(GOOD, "Content-Type: text/html"), 415, "labelled 'text/html'; send it as JSON"),
    (post(GOOD, "Content-Type: multipart/form-data; boundary=x"), 415, "with Content-Type: application/json"),
    (post(GOOD, "Content-Type: application/json; charset=latin-1"), 415, "send it in UTF-8"),
    (post(GOOD, "Content-Encoding: gzip"), 415, "send it uncompressed"),
    (post(GOOD, "Transfer-Encoding: gzip"), 411, "with a Content-Length, not Transfer-Encoding"),
    (post(GOOD, f"Content-Length: {len(GOOD) + 3}"), 400, "2 different Content-Length headers"),
    (post(GOOD, length="+34"), 400, "Content-Length must be a byte count, got +34"),
    (post(b"", length=10 ** 12), 413, "must be at most 8388608 bytes: send fewer queries"),
    (post(b'{"queries": ["cheese"], "top_k": 2}'), 400, "unknown field 'top_k' (did you mean \"topk\"?); the fields"),
    (post(b'{"query": ["cheese"]}'), 400, "unknown field 'query' (did you mean \"queries\"?)"),
    (post(b'{"queries": ["cheese"], "return_score": false}'), 400, 'did you mean "return_scores"?'),
    # No Content-Length: the body was read as empty ("the request body is empty", which it was not).
    (b"POST /retrieve HTTP/1.1\r\nHost: x\r\n\r\n" + GOOD, 411, "with a Content-Length header"),
    (b"POST /retrieve HTTP/1.0\r\n\r\n" + GOOD, 411, "with a Content-Length header"),
    # A request line over 64 KiB after an empty line: the standard library checked only the empty line.
    (b"\r\nGET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n", 414, ""),
    (post(b'{"queries": ["cheese"], "topk": NaN}'), 400, '"topk" must be an int in [1, 1000], got \'NaN\''),
    (post(b'["cheese"]'), 400, "expected a JSON object"),
    (post(b'{"queries": [1]}'), 400, '"queries" must be a list of strings, e.g.'),
    (post(GOOD, path="/search"), 404, "unknown path '/search'; use POST /retrieve or GET /health"),
    (b"DELETE /retrieve HTTP/1.1\r\nHost: x\r\n\r\n", 405, "use POST"),
]


def test_an_http_09_request_is_answered_at_once_with_a_status_line(server):
    """Such a client sends no headers and keeps its side open: the request was held for the headers'
    10 s, then answered with no status line."""
    with socket.create_connection(address(server), timeout=5) as sock:
        sock.sendall(b"GET /health\r\n")
        received = b""
        while chunk := sock.recv(65536):  # the server closes the connection after its reply
            received += chunk
    status, error = json_error(received)
    assert status == 400 and error.startswith("HTTP/0.9 request ('GET /health')"), error


def test_extra_fields_of_other_clients_are_ignored_as_search_r1_does(server):
    body = (b'{"queries": ["cheese"], "topk": 1, "request_id": "r-7", "model": "e5", "query_ids": [3], '
            b'"top_p": 0.9, "return_scores_only": false}')
    (status, _, reply), = replies(exchange(server, post(body, "Connection: close")))
    assert status == 200 and len(json.loads(reply)["result"][0]) == 1


@pytest.mark.parametrize("data, status, message", CASES, ids=range(len(CASES)))
def test_every_bad_request_gets_a_json_error_saying_what_to_send(server, data, status, message):
    got_status, error = json_error(exchange(server, data))
    assert got_status == status and message in error, (got_status, error)
    assert_still_serving(server)


def test_an_https_client_is_told_at_once_that_the_service_is_plain_http(server):
    # A TLS handshake has no line end: the server answered only once the handler's 60 s timeout
    # ended its wait for a request line (here the client would wait for its own 10 s first).
    status, error = json_error(exchange(server, TLS_CLIENT_HELLO, close_after_send=False))
    assert status == 400 and "plain HTTP, not HTTPS: use an http:// URL" in error
    assert_still_serving(server)


def test_a_refused_request_that_expects_100_continue_gets_its_refusal_first(server):
    # Before, "100 Continue" invited the client to send a body the server then refused.
    received = exchange(server, post(b"", "Expect: 100-continue", length=10 ** 9))
    assert received.startswith(b"HTTP/1.1 413"), received[:40]
    # A request it will read still gets the standard 100 Continue.
    with socket.create_connection(address(server), timeout=10) as sock:
        sock.sendall(post(b"", "Expect: 100-continue", "Connection: close", length=len(GOOD)))
        assert sock.recv(65536).startswith(b"HTTP/1.1 100 Continue")
        sock.sendall(GOOD)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    assert received.startswith(b"HTTP/1.1 200")


def test_an_empty_line_before_a_request_is_read_past(server):
    # RFC 9112 2.2: a server should ignore an empty line before a request line (some clients send
    # one after a body). Before, the connection was closed without an answer to the second request.
    data = post(GOOD) + b"\r\n" + post(GOOD, "Connection: close")
    assert [status for status, _, _ in replies(exchange(server, data))] == [200, 200]


def test_the_client_reads_the_services_json_error_into_a_clear_exception(server):
    remote = RemoteRetriever(server.url, retries=0)
    # Before: "rejected the request (400): {"error": "bad request: \"topk\" ..."}", the raw body.
    with pytest.raises(RetrievalServiceError, match=r'rejected the request \(400\): bad request: "topk" must be '
                                                    r"an int in \[1, 1000\], got '5000'$"):
        remote.search(["cheese"], 5000)
    assert remote.search(["cheese"], 1)[0][0].doc_id == "d2"


@pytest.fixture
def fake_service():
    from http.server import BaseHTTPRequestHandler

    servers = contextlib.ExitStack()

    def start(status: int, body: bytes, content_type: str = "application/json"):
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        return servers.enter_context(serving(Handler)) + "/retrieve"

    with servers:
        yield start


def test_the_client_names_what_other_services_say_when_they_refuse_or_fail(fake_service):
    url = fake_service(404, b"<html><body>Not Found</body></html>", "text/html")
    with pytest.raises(RetrievalServiceError, match=r"rejected the request \(404\): <html><body>Not Found"):
        RemoteRetriever(url, retries=0).search(["q"], 1)
    url = fake_service(422, json.dumps({"detail": [{"msg": "field required"}]}).encode())  # FastAPI's shape
    with pytest.raises(RetrievalServiceError, match=r"rejected the request \(422\): \{\"detail\""):
        RemoteRetriever(url, retries=0).search(["q"], 1)
    url = fake_service(200, json.dumps({"error": "index not loaded yet"}).encode())
    with pytest.raises(RetrievalServiceError, match=r"answered with an error: index not loaded yet$"):
        RemoteRetriever(url, retries=0).search(["q"], 1)


def test_garbage_and_good_clients_at_once_are_all_answered(server, capsys):
    bad = [data for data, _, _ in CASES[:12]]
    clients = 2 * len(bad)
    start = threading.Barrier(clients)
    remote = RemoteRetriever(server.url, timeout=30, retries=0)

    def client(i: int):
        start.wait()  # all connect at once
        if i % 2:
            return json_error(exchange(server, bad[i // 2]))[0]
        return [hit.doc_id for hit in remote.search(["capital of France"], 1)[0]]

    with ThreadPoolExecutor(clients) as pool:
        answers = list(pool.map(client, range(clients)))
    assert answers[0::2] == [["d0"]] * len(bad)
    assert answers[1::2] == [status for _, status, _ in CASES[:12]]
    assert "Traceback" not in capsys.readouterr().err
