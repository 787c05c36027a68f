"""The retrieval service (Search-R1's /retrieve shape) and its client, on 127.0.0.1."""

from __future__ import annotations

import http.client
import json
import threading
import urllib.error
import urllib.parse
import urllib.request

import pytest

from rftgym.envs.search.corpora import Document
from rftgym.envs.search.env import SearchEvalQAEnv
from rftgym.envs.search.retrievers import BM25Retriever
from rftgym.envs.search.server import RemoteRetriever, RetrievalServiceError, make_server
from rftgym.envs.search.world import World

DOCS = [
    Document("d0", "Paris", "Paris is the capital of France."),
    Document("d1", "Berlin", "Berlin is the capital of Germany."),
    Document("d2", "Cheese", "Camembert is a soft cheese."),
]


@pytest.fixture
def service():
    servers = []

    def start(documents=DOCS):
        server = make_server(BM25Retriever(documents), host="127.0.0.1", port=0)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def post(url: str, payload) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_search_r1_request_and_response_shape(service):
    server = service()
    status, body = post(server.url, {"queries": ["capital of Germany", "cheese"], "topk": 2, "return_scores": True})
    assert status == 200 and len(body["result"]) == 2
    first = body["result"][0][0]
    assert first["document"] == {"id": "d1", "contents": '"Berlin"\nBerlin is the capital of Germany.'}
    assert first["score"] > 0
    status, body = post(server.url, {"queries": ["cheese"], "topk": 1, "return_scores": False})
    assert body == {"result": [[{"id": "d2", "contents": '"Cheese"\nCamembert is a soft cheese.'}]]}


@pytest.mark.parametrize("payload, message", [
    ([1], "expected a JSON object"), ({"queries": "q"}, '"queries" must be a list'),
    ({"queries": ["q"], "topk": 0}, '"topk" must be an int'),
])
def test_bad_requests_get_400(service, payload, message):
    status, body = post(service().url, payload)
    assert status == 400 and message in body["error"]


def test_health(service):
    server = service()
    with urllib.request.urlopen(server.url.replace("/retrieve", "/health"), timeout=5) as response:
        assert json.loads(response.read()) == {"status": "ok", "documents": 3, "index": "bm25"}


def test_remote_retriever_matches_the_local_one(service):
    server = service()
    remote = RemoteRetriever(server.url.removesuffix("/retrieve"))  # the path is added when missing
    local = BM25Retriever(DOCS)
    queries = ["capital of France", "soft cheese", "nothing matches this"]
    assert remote.search(queries, 2) == local.search(queries, 2)
    assert remote.search([], 2) == []


def test_a_down_service_is_a_clear_error():
    server = make_server(BM25Retriever(DOCS), port=0)
    url = server.url
    server.server_close()  # the port is free again: nothing listens there
    remote = RemoteRetriever(url, timeout=1, retries=1, backoff=0.01)
    with pytest.raises(RetrievalServiceError, match=r"did not answer after 2 attempts .*rftgym serve-retriever"):
        remote.search(["q"], 1)
    with pytest.raises(RetrievalServiceError, match="must start with http"):
        RemoteRetriever("localhost:8000")
    # The env probes the service when it is made, not at the agent's first search.
    with pytest.raises(RetrievalServiceError, match="did not answer after 3 attempts"):
        SearchEvalQAEnv(retriever="remote", retriever_url=url)


def test_a_negative_content_length_is_named(service):
    url = urllib.parse.urlsplit(service().url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=5)
    connection.putrequest("POST", "/retrieve")
    connection.putheader("Content-Length", "-5")
    connection.endheaders()
    response = connection.getresponse()
    assert response.status == 400 and "Content-Length must be a byte count, got -5" in response.read().decode()
    connection.close()


def test_the_env_with_a_remote_backend(service):
    world = World(0)
    server = service(world.documents)
    env = SearchEvalQAEnv(retriever="remote", retriever_url=server.url)
    env.reset(seed=0, options={"hops": 1})
    title = env.question.gold_titles[0]
    _, _, _, _, info = env.step(f"<search>{title}</search>")
    assert info["doc_ids"][0] == next(d.id for d in world.documents if d.title == title)
    env.close()


@pytest.mark.parametrize("body, problem", [
    (b"<html>Welcome to nginx</html>", "not UTF-8 JSON"),
    (b"", "not UTF-8 JSON"),
    (b"\xff\xfe{}", "not UTF-8 JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
])
def test_a_service_answering_in_another_shape_is_named_at_once(body, problem):
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    requests = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            requests.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        remote = RemoteRetriever(f"http://127.0.0.1:{httpd.server_address[1]}", timeout=5, retries=2, backoff=0.01)
        with pytest.raises(RetrievalServiceError, match=f"answered, but its body is {problem}.*/retrieve service"):
            remote.search(["q"], 1)
        assert len(requests) == 1  # an answer is not retried
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_the_server_answers_a_deeply_nested_request_and_refuses_an_empty_host(service):
    status, body = post(service().url, json.loads("[" * 10 + "]" * 10))
    assert status == 400
    request = urllib.request.Request(service().url, data=b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=5)
    assert info.value.code == 400 and "nested too deeply" in info.value.read().decode()
    with pytest.raises(RetrievalServiceError, match="the host is empty"):
        make_server(BM25Retriever(DOCS), host="", port=0)
