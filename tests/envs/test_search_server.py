"""The retrieval service (Search-R1's /retrieve shape) and its client, on 127.0.0.1."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings

import gymnasium as gym
import pytest
from loopback_http import serving

import rftgym  # noqa: F401  (registers the envs)
from rftgym.core.errors import ConfigError
from rftgym.envs.search.corpora import Document
from rftgym.envs.search.env import SearchEvalQAEnv
from rftgym.envs.search.retrievers import BM25Retriever
from rftgym.envs.search.client import RemoteRetriever, RetrievalServiceError
from rftgym.envs.search.server import make_server
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
    ({"queries": ["q"], "return_scores": "false"}, '"return_scores" must be true or false'),
    ({"queries": ["q"] * 20_000, "topk": 10}, "20000 queries x topk 10 is more than 100,000 results"),
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
    with pytest.raises(RetrievalServiceError, match=r"failed 2 attempts \(last: no answer: .*rftgym serve-retriever"):
        remote.search(["q"], 1)
    # The env probes the service when it is made, not at the agent's first search.
    # ... and told how to serve its own documents: here its generated world.
    with pytest.raises(RetrievalServiceError, match="failed 3 attempts .* Start one with: rftgym serve-retriever "
                                                    r"--world-seed 4 --world-size 30 --port \d+$"):
        SearchEvalQAEnv(retriever="remote", retriever_url=url, world_seed=4, world_size=30)
    # A service spoken to in TLS that answers in plain HTTP is said at once, not retried.
    plain = make_server(BM25Retriever(DOCS), port=0)
    threading.Thread(target=plain.serve_forever, daemon=True).start()
    try:
        tls = RemoteRetriever(plain.url.replace("http://", "https://"), timeout=2, retries=3, backoff=5)
        with pytest.raises(RetrievalServiceError, match="does not speak TLS .* give an http:// retriever_url"):
            tls.search(["q"], 1)
    finally:
        plain.shutdown()
        plain.server_close()


def test_the_command_that_serves_an_envs_documents():
    from types import SimpleNamespace

    from rftgym.envs.search.retrievers import serve_command

    world = SimpleNamespace(dataset_path=None, corpus_path=None, world_seed=3, world_size=40)
    assert serve_command(world) == "rftgym serve-retriever --world-seed 3 --world-size 40"
    search = SimpleNamespace(dataset_path="q.json", corpus_path="my corpus.jsonl")
    assert serve_command(search) == "rftgym serve-retriever --corpus 'my corpus.jsonl' --index bm25"
    assert serve_command(SimpleNamespace(dataset_path="q.json", corpus_path=None)) == \
        "rftgym serve-retriever --corpus q.json --index bm25"
    # Where the env looks for it: the port of its retriever_url (serve-retriever's own is 8000).
    remote = SimpleNamespace(dataset_path=None, corpus_path=None, world_seed=3, world_size=40,
                             retriever_url="http://127.0.0.1:35105")
    assert serve_command(remote) == "rftgym serve-retriever --world-seed 3 --world-size 40 --port 35105"
    remote.retriever_url = "http://10.0.0.7/retrieve"  # no port: http's; another machine's address
    assert serve_command(remote) == "rftgym serve-retriever --world-seed 3 --world-size 40 --host 10.0.0.7 --port 80"


@pytest.mark.parametrize("url, problem", [
    ("localhost:8000", "must be an http:// or https:// URL with a host"),
    ("http://", "must be an http:// or https:// URL with a host"),
    (5, "must be the service's URL"),
    ("http://[::1", "is not a valid URL"),
    ("http://127.0.0.1:110647/retrieve", "is not a valid URL"),  # urllib would wrap it round to port 45111
    ("http://127.0.0.1:0/retrieve", "has a port 0"),
    ("http://127.0.0.1:8000/retrieve?x=1", "a query"),
    ("http://127.0.0.1:8000/ret rieve", "a space"),
])
def test_a_service_url_that_cannot_be_one_is_a_config_error(url, problem):
    from rftgym.core.errors import ConfigError
    from rftgym.envs.search.client import check_service_url

    with pytest.raises(ConfigError, match=problem):
        check_service_url(url)
    with pytest.raises(ConfigError, match=problem):  # when the env is configured, before anything runs
        SearchEvalQAEnv(retriever="remote", retriever_url=url)
    assert check_service_url("HTTP://127.0.0.1:8000") == "http://127.0.0.1:8000/retrieve"


@pytest.fixture
def fake_service():
    """A service on 127.0.0.1 whose answer a test writes: ``start(answer)``, where ``answer(handler)``
    sends the response; each request's path is recorded."""
    from http.server import BaseHTTPRequestHandler

    servers, seen = contextlib.ExitStack(), []

    def start(answer):
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                seen.append((self.command, self.path))
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                answer(self)

            do_GET = do_POST

        return servers.enter_context(serving(Handler)) + "/retrieve", seen

    with servers:
        yield start


def reply(handler, status: int, body: bytes, headers=()):
    handler.send_response(status)
    for key, value in headers:
        handler.send_header(key, value)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def test_a_redirect_is_reported_not_followed(fake_service):
    url, seen = fake_service(lambda h: reply(h, 302, b"", [("Location", "http://127.0.0.1:9/elsewhere")]))
    with pytest.raises(RetrievalServiceError, match=r"answered with a redirect \(302\) to 'http://127.0.0.1:9/elsewhere'"):
        RemoteRetriever(url, retries=0).search(["q"], 1)
    assert seen == [("POST", "/retrieve")]


def test_a_proxy_setting_is_not_used_for_a_service_on_this_machine(fake_service, monkeypatch):
    body = json.dumps({"result": [[{"document": {"id": "d0", "contents": '"T"\ntext'}, "score": 1.0}]]}).encode()
    url, seen = fake_service(lambda h: reply(h, 200, body))
    proxy, via_proxy = fake_service(lambda h: reply(h, 502, b""))
    monkeypatch.setenv("http_proxy", proxy.removesuffix("/retrieve"))
    assert RemoteRetriever(url, retries=0).search(["q"], 1)[0][0].doc_id == "d0"
    assert seen == [("POST", "/retrieve")]  # the service itself, not the proxy (one recorder for both)


def test_a_reply_that_trickles_in_is_cut_at_the_timeout(fake_service):
    import time

    def trickle(handler):
        handler.send_response(200)
        handler.send_header("Content-Length", "1000")
        handler.end_headers()
        for _ in range(100):
            handler.wfile.write(b" ")
            handler.wfile.flush()
            time.sleep(0.1)

    url, _ = fake_service(trickle)
    with pytest.raises(RetrievalServiceError, match=r"failed 1 attempt \(last: the reply took over 0.5 s"):
        RemoteRetriever(url, timeout=0.5, retries=0).search(["q"], 1)


def _trickling(status: int, headers: list[tuple[str, str]], first: bytes):
    """A service answering ``status`` with ``headers``, then ``first`` and a byte each 0.3 s for 10 s."""
    import time

    def trickle(handler):
        handler.send_response(status)
        for name, value in headers:
            handler.send_header(name, value)
        handler.end_headers()
        handler.wfile.write(first)
        try:
            for _ in range(33):
                handler.wfile.flush()
                time.sleep(0.3)
                handler.wfile.write(b"x")
        except (BrokenPipeError, ConnectionResetError):  # the client gave up
            pass
        handler.close_connection = True
    return trickle


@pytest.mark.parametrize("status, headers, first, said", [
    # One read of a chunked body reads a whole chunk-size line, a socket read per byte: without
    # the deadline it would wait out the 10 s this service trickles it for.
    (200, [("Transfer-Encoding", "chunked")], b"1;", r"failed 1 attempt \(last: the reply took over 0.5 s"),
    # A refusal's reason is read for the message, within the timeout too.
    (400, [("Content-Length", "34")], b"x", r"rejected the request \(400\): x+$"),
], ids=["chunk-size line", "refusal's reason"])
def test_a_reply_trickling_in_is_given_up_at_the_timeout(fake_service, status, headers, first, said):
    import time

    url, _ = fake_service(_trickling(status, headers, first))
    start = time.monotonic()
    with pytest.raises(RetrievalServiceError, match=said):
        RemoteRetriever(url, timeout=0.5, retries=0).search(["q"], 1)
    assert time.monotonic() - start < 3.0


def test_a_name_lookup_that_hangs_is_reported_as_the_resolvers(monkeypatch):
    from slow_servers import HangingResolver, finishes_within

    with HangingResolver.installed(monkeypatch):
        remote = RemoteRetriever("http://search.test:8000/retrieve", timeout=1.0, retries=0)
        error = finishes_within(4.0, lambda: remote.search(["q"], 1))
    assert isinstance(error, RetrievalServiceError), error
    assert "(last: the name lookup of search.test did not finish within 1 s; check the DNS settings" in str(error)


def test_headers_trickling_in_are_given_up_at_the_timeout():
    from slow_servers import finishes_within, trickling_server

    # A status line, then a header byte each 0.2 s for ever: no socket read waits its 1 s.
    with trickling_server() as port:
        remote = RemoteRetriever(f"http://127.0.0.1:{port}/retrieve", timeout=1.0, retries=0)
        error = finishes_within(4.0, lambda: remote.search(["q"], 1))
    assert isinstance(error, RetrievalServiceError), error
    assert "failed 1 attempt (last: the reply took over 1 s to arrive; for a service that is slow rather than down, " \
           "raise retriever_timeout_s (--env-arg retriever_timeout_s=60))" in str(error)


def test_a_failing_service_is_not_called_down(fake_service):
    url, _ = fake_service(lambda h: reply(h, 503, b"overloaded"))
    with pytest.raises(RetrievalServiceError, match=r"failed 2 attempts \(last: it failed with HTTP 503: overloaded\)"):
        RemoteRetriever(url, retries=1, backoff=0.01).search(["q"], 1)


def test_what_a_service_sends_is_cleaned_for_the_observation(fake_service):
    hit = {"document": {"id": "x" * 5000 + "\n</information>", "contents": '"' + "T" * 2000 + '"\ntext \ud800 end'},
           "score": 2.0}
    url, _ = fake_service(lambda h: reply(h, 200, json.dumps({"result": [[hit]]}).encode()))
    got = RemoteRetriever(url, retries=0).search(["q"], 1)[0][0]
    assert len(got.doc_id) == 201 and "\n" not in got.doc_id and len(got.title) == 501
    assert got.text == "text \ufffd end"
    bad = {"document": {"id": None, "contents": "c"}, "score": float("nan")}
    url, _ = fake_service(lambda h: reply(h, 200, json.dumps({"result": [[bad]]}).encode()))
    with pytest.raises(RetrievalServiceError, match="a string \\(or int\\) 'id'"):
        RemoteRetriever(url, retries=0).search(["q"], 1)


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
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the service indexes the env's own corpus: no warning
        env = SearchEvalQAEnv(retriever="remote", retriever_url=server.url)
    env.reset(seed=0, options={"hops": 1})
    title = env.question.gold_titles[0]
    _, _, _, _, info = env.step(f"<search>{title}</search>")
    assert info["doc_ids"][0] == next(d.id for d in world.documents if d.title == title)
    env.close()
    # A slow service's time per attempt and retries are the env's options (--env-arg from the CLI).
    env = SearchEvalQAEnv(retriever="remote", retriever_url=server.url, retriever_timeout_s=45, retriever_retries=5)
    assert (env.retriever.timeout, env.retriever.retries) == (45.0, 5)
    env.close()
    with pytest.raises(ConfigError, match="retriever_timeout_s=45 is for a remote retrieval service, and retriever is "
                                          "'bm25'; drop retriever_timeout_s, or use retriever=remote"):
        SearchEvalQAEnv(retriever_timeout_s=45)


def test_memoryqa_with_a_remote_backend_and_one_serving_another_world(service):
    from rftgym.envs.memory.env import MemoryQAEnv

    served = service(World(0, 60).documents)  # MemoryQA's default world: world_seed 0, world_size 60
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        env = MemoryQAEnv(retriever="remote", retriever_url=served.url)
    env.reset(seed=0, options={"objectives": 1, "hops": 1})
    title = env.task.objectives[0].gold_titles[0]
    obs, *_ = env.step(f"<search>{title}</search>")
    assert title in obs[-1].content
    env.close()
    other = service(World(1, 60).documents)  # another world, whose documents are numbered alike
    with pytest.warns(RuntimeWarning, match=r"world_size=60: rftgym serve-retriever --world-seed 0 --world-size 60"):
        MemoryQAEnv(retriever="remote", retriever_url=other.url).close()
    smaller = service(World(0).documents)  # serve-retriever's default size: a few of the same names
    with pytest.warns(RuntimeWarning, match=r"returned (none|only \d) of the env's documents .* when asked for 3"):
        MemoryQAEnv(retriever="remote", retriever_url=smaller.url).close()
    # a neighbouring size holds every id and name of the env's world, with other facts
    neighbour = service(World(0, 61).documents)
    assert {(d.id, d.title) for d in World(0, 60).documents} <= {(d.id, d.title) for d in World(0, 61).documents}
    with pytest.warns(RuntimeWarning, match=r"world_size=60"):
        MemoryQAEnv(retriever="remote", retriever_url=neighbour.url).close()
    with pytest.raises(ConfigError, match="retriever='remote' needs retriever_url"):
        MemoryQAEnv(retriever="remote")


@pytest.mark.parametrize("body, problem", [
    (b"<html>Welcome to nginx</html>", "not UTF-8 JSON"),
    (b"", "not UTF-8 JSON"),
    (b"\xff\xfe{}", "not UTF-8 JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
])
def test_a_service_answering_in_another_shape_is_named_at_once(body, problem):
    from http.server import BaseHTTPRequestHandler

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

    with serving(Handler) as base:
        remote = RemoteRetriever(base, timeout=5, retries=2, backoff=0.01)
        with pytest.raises(RetrievalServiceError, match=f"answered, but its body is {problem}.*/retrieve service"):
            remote.search(["q"], 1)
        assert len(requests) == 1  # an answer is not retried


def test_the_server_answers_a_deeply_nested_request_and_refuses_an_empty_host(service):
    status, body = post(service().url, json.loads("[" * 10 + "]" * 10))
    assert status == 400
    request = urllib.request.Request(service().url, data=b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=5)
    assert info.value.code == 400 and "nested too deeply" in info.value.read().decode()
    with pytest.raises(ConfigError, match="the host is empty"):
        make_server(BM25Retriever(DOCS), host="", port=0)


def _ipv6_loopback_works() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback_works(), reason="this machine has no IPv6 loopback")
def test_the_server_serves_on_an_ipv6_address():
    server = make_server(BM25Retriever(DOCS), host="::1", port=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert server.url.startswith("http://[::1]:")
        hits = RemoteRetriever(server.url).search(["capital of France"], 1)
        assert hits[0][0].title == BM25Retriever(DOCS).search(["capital of France"], 1)[0][0].title
    finally:
        server.shutdown()
        server.server_close()


def test_a_chunked_request_is_asked_for_a_content_length(service):
    parts = urllib.parse.urlsplit(service().url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=5)
    body = json.dumps({"queries": ["Veloria"], "topk": 1}).encode()
    connection.putrequest("POST", "/retrieve")
    connection.putheader("Transfer-Encoding", "chunked")
    connection.endheaders()
    connection.send(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
    reply = connection.getresponse()
    assert reply.status == 411 and "Content-Length" in json.loads(reply.read())["error"]
    connection.close()


def test_a_service_indexing_another_corpus_is_warned_of_once(service):
    server = service(DOCS)  # not the generated world the env's questions come from
    with pytest.warns(RuntimeWarning, match="returned none of the env's documents \\(by id, title or text\\) when asked for 3 of them: "
                                            r"it indexes another corpus than the env's generated world \(world_seed=0"
                      ) as caught:
        SearchEvalQAEnv(retriever="remote", retriever_url=server.url).close()
    assert {w.filename for w in caught if "indexes another corpus" in str(w.message)} == {__file__}  # this line
    with pytest.warns(RuntimeWarning, match="indexes another corpus") as caught:  # past gymnasium's make too
        gym.make("rftgym/SearchEvalQA-v0", retriever="remote", retriever_url=service(DOCS).url).close()
    assert {w.filename for w in caught if "indexes another corpus" in str(w.message)} == {__file__}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per service and corpus in a process
        SearchEvalQAEnv(retriever="remote", retriever_url=server.url).close()


def test_a_service_numbering_the_envs_documents_its_own_way_is_not_warned_of(service):
    from rftgym.envs.search.corpora import Document

    world = World(3)
    renumbered = [Document(str(i), d.title, d.text) for i, d in enumerate(world.documents)]
    server = service(renumbered)  # the same documents under other ids, as a Wikipedia dump numbers passages
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SearchEvalQAEnv(retriever="remote", retriever_url=server.url, world_seed=3).close()


def test_a_service_indexing_untitled_documents_is_checked_by_their_text(service):
    """FlashRAG passages without a title line: asked for by their first words, not by an empty title."""
    untitled = [Document(f"p{i}", "", text) for i, text in enumerate(
        ["The river Alde flows east past the old mill.", "Copper was first mined in the northern hills.",
         "A festival of lanterns is held each spring.", "The bridge was rebuilt after the flood of 1902."])]
    remote = RemoteRetriever(service(untitled).url)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        remote.check_corpus(untitled, "the env's corpus", 3)
    other = RemoteRetriever(service(DOCS).url)
    with pytest.warns(RuntimeWarning, match="indexes another corpus than the env's corpus") as caught:
        other.check_corpus(untitled, "the env's corpus", 3)
    assert [w.filename for w in caught] == [__file__]


def test_a_busy_service_is_asked_again(fake_service):
    body = json.dumps({"result": [[{"document": {"id": "d0", "contents": '"T"\ntext'}, "score": 1.0}]]}).encode()
    answers = [lambda h: reply(h, 429, b"slow down"), lambda h: reply(h, 408, b"late"), lambda h: reply(h, 200, body)]
    url, seen = fake_service(lambda h: answers[len(seen) - 1](h))
    assert RemoteRetriever(url, retries=2, backoff=0.01).search(["q"], 1)[0][0].doc_id == "d0"
    assert len(seen) == 3


def test_a_busy_services_retry_after_is_waited_out(fake_service, monkeypatch):
    import time as time_module

    body = json.dumps({"result": [[{"document": {"id": "d0", "contents": '"T"\ntext'}, "score": 1.0}]]}).encode()
    answers = [lambda h: reply(h, 429, b"slow down", [("Retry-After", "7")]), lambda h: reply(h, 200, body)]
    url, seen = fake_service(lambda h: answers[len(seen) - 1](h))
    waits = []
    monkeypatch.setattr(time_module, "sleep", waits.append)
    assert RemoteRetriever(url, retries=1, backoff=0.01).search(["q"], 1)[0][0].doc_id == "d0"
    assert waits == [7.0]  # the server's 7 s, not the 0.01 s backoff


def test_a_reply_cut_short_is_asked_for_again(fake_service):
    body = json.dumps({"result": [[{"document": {"id": "d0", "contents": '"T"\ntext'}, "score": 1.0}]]}).encode()
    calls = []

    def cut_once(handler):
        calls.append(1)
        if len(calls) == 1:  # promises the whole body, sends half, closes
            handler.send_response(200)
            handler.send_header("Content-Length", str(len(body)))
            handler.end_headers()
            handler.wfile.write(body[: len(body) // 2])
            handler.close_connection = True
            return
        reply(handler, 200, body)

    url, _ = fake_service(cut_once)
    assert RemoteRetriever(url, retries=1, backoff=0.01).search(["q"], 1)[0][0].doc_id == "d0"
    assert len(calls) == 2
    calls.clear()
    with pytest.raises(RetrievalServiceError, match=r"failed 1 attempt \(last: the connection closed \d+ bytes before"):
        RemoteRetriever(url, retries=0).search(["q"], 1)


def test_other_methods_and_paths_get_a_json_answer(service):
    server = service()
    address = urllib.parse.urlsplit(server.url)
    for method, path, status, allow in [("PUT", "/retrieve", 405, "POST"), ("DELETE", "/retrieve", 405, "POST"),
                                        ("GET", "/retrieve", 405, "POST"), ("POST", "/health", 405, "GET, HEAD"),
                                        ("OPTIONS", "/nowhere", 404, None), ("HEAD", "/retrieve", 405, "POST"),
                                        ("HEAD", "/health", 200, None)]:
        connection = http.client.HTTPConnection(address.hostname, address.port, timeout=5)
        connection.request(method, path, body=b"{}" if method in ("PUT", "POST") else None)
        response = connection.getresponse()
        body = response.read()
        connection.close()
        assert response.status == status and response.getheader("Allow") == allow, (method, path)
        if method != "HEAD":
            assert "error" in json.loads(body), (method, path)
        else:
            assert body == b"", (method, path)
    # a query string does not change the path; the service still serves
    status, body = post(server.url + "?verbose=1", {"queries": ["cheese"], "topk": 1})
    assert status == 200 and body["result"][0][0]["document"]["id"] == "d2"


def test_an_unread_body_is_never_read_as_the_next_request(service):
    """A PUT's body is not read: on a kept-alive connection it would be parsed as a request."""
    address = urllib.parse.urlsplit(service().url)
    smuggled = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection((address.hostname, address.port), timeout=5) as sock:
        sock.sendall(b"PUT /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(smuggled) + smuggled)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    assert received.startswith(b"HTTP/1.1 405") and received.count(b"HTTP/1.1 ") == 1


def test_a_search_that_fails_is_a_500_with_its_reason_and_the_service_goes_on(service):
    class Flaky(BM25Retriever):
        def search(self, queries, k):
            if queries == ["boom"]:
                raise RuntimeError("index on fire")
            return super().search(queries, k)

    server = make_server(Flaky(DOCS), host="127.0.0.1", port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        status, body = post(server.url, {"queries": ["boom"], "topk": 1})
        assert status == 500 and body == {"error": "the search failed: RuntimeError: index on fire"}
        with pytest.raises(RetrievalServiceError, match="failed 1 attempt .*HTTP 500.*index on fire"):
            RemoteRetriever(server.url, retries=0).search(["boom"], 1)
        assert post(server.url, {"queries": ["cheese"], "topk": 1})[0] == 200
    finally:
        server.shutdown()
        server.server_close()


def test_lone_surrogates_in_documents_and_queries_never_reach_an_observation():
    """JSON may escape a lone surrogate (some Wikipedia dumps do); no tokenizer takes one."""
    document = Document("d9\ud800", "Al\ud800pha", "alpha \udc80 gamma")
    assert (document.id, document.title, document.text) == ("d9\ufffd", "Al\ufffdpha", "alpha \ufffd gamma")
    hits = BM25Retriever([*DOCS, document]).search(["alpha \ud800"], 1)
    assert hits[0][0].doc_id == "d9\ufffd" and "\ud800" not in hits[0][0].text


def test_a_body_over_the_limit_is_refused_with_a_reply_the_client_reads(service, monkeypatch):
    monkeypatch.setattr("rftgym.envs.search.server.MAX_BODY_BYTES", 1000)
    server = service()
    # 4 MB, far past what the socket buffers hold: before, the server closed on the unread body and
    # the client, still sending, got a broken pipe or a reset instead of the refusal.
    status, body = post(server.url, {"queries": ["x" * (4 << 20)], "topk": 1})
    assert status == 413 and "must be at most 1000 bytes: send fewer queries" in body["error"]
    with pytest.raises(RetrievalServiceError, match="413"):
        RemoteRetriever(server.url, retries=0).search(["x" * 2000], 1)
    assert post(server.url, {"queries": ["cheese"], "topk": 1})[0] == 200  # the service goes on


def test_a_request_body_that_trickles_in_is_cut_at_a_deadline(service, monkeypatch):
    monkeypatch.setattr("rftgym.envs.search.server.REQUEST_BODY_S", 0.3)
    server = service()
    address = urllib.parse.urlsplit(server.url)
    with socket.create_connection((address.hostname, address.port), timeout=5) as sock:
        sock.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
        received = b""
        for _ in range(40):  # a byte each 50 ms: each read is well within the socket timeout
            try:
                sock.sendall(b" ")
            except OSError:
                break
            sock.settimeout(0.05)
            try:
                received += sock.recv(65536)
            except TimeoutError:
                continue
            if received:
                break
        sock.settimeout(5)
        while chunk := sock.recv(65536):  # the rest of the reply, up to the server's close
            received += chunk
    assert received.startswith(b"HTTP/1.1 408") and b"did not arrive within 0.3 s" in received


def test_a_client_that_leaves_before_its_body_ends_costs_nothing(service, capsys):
    server = service()
    address = urllib.parse.urlsplit(server.url)
    with socket.create_connection((address.hostname, address.port), timeout=5) as sock:
        sock.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"queries\"")
    assert post(server.url, {"queries": ["cheese"], "topk": 1})[0] == 200
    time.sleep(0.3)  # the first request's thread has seen the connection close by now
    assert "Traceback" not in capsys.readouterr().err  # before: a broken pipe answering nobody


def test_a_burst_of_simultaneous_clients_is_served_without_retries(service):
    from concurrent.futures import ThreadPoolExecutor

    server = service()
    remote = RemoteRetriever(server.url, timeout=30, retries=0)
    clients = 64
    start = threading.Barrier(clients)

    def search(_):
        start.wait()  # all connect at once, as a batch of rollout workers does
        return [hit.doc_id for hit in remote.search(["paris"], 2)[0]]

    with ThreadPoolExecutor(clients) as pool:
        answers = list(pool.map(search, range(clients)))
    assert answers == [answers[0]] * clients and answers[0]
