"""ChatAPIAgent against a real HTTP server on 127.0.0.1 (no other address is ever contacted)."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
import warnings
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Callable

import gymnasium as gym
import pytest
from loopback_http import serving

import rftgym  # noqa: F401 (registers the envs)

from rftgym.agents.base import CONTEXT_FULL, AgentReply
from rftgym.agents.chat_api import ChatAPIAgent, ChatAPIConfig
from rftgym.core.errors import ChatAPIError, ConfigError
from rftgym.core.messages import Context, Message


# -- a fake OpenAI-compatible server -----------------------------------------------------------


@dataclass
class Response:
    status: int = 200
    body: bytes | str | dict | None = None  # dict -> JSON; None -> a normal completion
    delay_s: float = 0.0
    headers: dict = field(default_factory=dict)
    trickle_s: float = 0.0  # > 0: the body goes out a byte at a time, this far apart
    # > 0: a chunked reply whose first chunk-size line goes out a byte at a time, this far apart
    # (an extension that never ends, for 10 s); one read of the body waits on the whole line.
    chunk_line_trickle_s: float = 0.0
    missing_bytes: int = 0  # > 0: Content-Length promises this many bytes more, then the connection closes
    # "chunked": one chunk announced, half of it sent; "unannounced": no length, half the body sent;
    # then the connection closes.
    cut: str = ""


def completion(content: str | None = "ok", finish_reason: str | None = "stop") -> dict:
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": finish_reason,
            }
        ],
    }


@dataclass
class Received:
    path: str
    headers: dict
    body: dict


class FakeServer:
    """Records every request; ``behaviour(received, attempt_number) -> Response``."""

    def __init__(self) -> None:
        self.requests: list[Received] = []
        self.behaviour: Callable[[Received, int], Response] = lambda req, n: Response()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.in_flight = 0
        self.max_in_flight = 0
        self.base_url = ""  # http://127.0.0.1:PORT/v1 once it serves

    def agent(self, **kwargs) -> ChatAPIAgent:
        kwargs.setdefault("backoff_s", 0.01)
        kwargs.setdefault("timeout_s", 5.0)
        kwargs.setdefault("api_key", None)
        return ChatAPIAgent.from_url(self.base_url, "test-model", **kwargs)


def make_handler(server: FakeServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # keep test output quiet
            pass

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            try:
                body = json.loads(raw)
            except ValueError:
                body = {"_unparsed": raw.decode("utf-8", "replace")}
            received = Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body)
            with server.lock:
                server.requests.append(received)
                attempt = len(server.requests)
                server.in_flight += 1
                server.max_in_flight = max(server.max_in_flight, server.in_flight)
            try:
                if self.path != "/v1/chat/completions":
                    response = Response(404, {"error": {"message": f"no route {self.path}"}})
                else:
                    response = server.behaviour(received, attempt)
                if response.delay_s:
                    server.stop.wait(response.delay_s)  # interrupted at teardown
            finally:
                # A request is in flight until its answer starts: once the client has read the
                # answer it may send its next request before this thread would run a later line.
                with server.lock:
                    server.in_flight -= 1
            try:
                payload = response.body
                if payload is None:
                    payload = completion()
                if isinstance(payload, dict):
                    payload = json.dumps(payload)
                if isinstance(payload, str):
                    payload = payload.encode("utf-8")
                self.send_response(response.status)
                self.send_header("Content-Type", "application/json")
                if response.chunk_line_trickle_s:
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    self.wfile.write(b"1;")
                    self.wfile.flush()
                    for _ in range(int(10 / response.chunk_line_trickle_s)):
                        if server.stop.wait(response.chunk_line_trickle_s):
                            break
                        self.wfile.write(b"x")
                        self.wfile.flush()
                    self.close_connection = True
                    return
                if response.cut:
                    if response.cut == "chunked":
                        self.send_header("Transfer-Encoding", "chunked")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    chunk = f"{len(payload):x}\r\n".encode() if response.cut == "chunked" else b""
                    self.wfile.write(chunk + payload[: len(payload) // 2])
                    self.close_connection = True
                    return
                self.send_header("Content-Length", str(len(payload) + response.missing_bytes))
                if response.missing_bytes:
                    self.send_header("Connection", "close")
                    self.close_connection = True
                for key, value in response.headers.items():
                    self.send_header(key, value)
                self.end_headers()
                if response.trickle_s:
                    for i in range(len(payload)):
                        if server.stop.wait(response.trickle_s):
                            break
                        self.wfile.write(payload[i:i + 1])
                        self.wfile.flush()
                else:
                    self.wfile.write(payload)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (timeout test)

    return Handler


@pytest.fixture
def server():
    fake = FakeServer()
    with serving(make_handler(fake)) as base:
        fake.base_url = f"{base}/v1"
        try:
            yield fake
        finally:
            fake.stop.set()  # before the shutdown: a handler held by a test lets go


def ctx(*pairs: tuple[str, str]) -> Context:
    return Context(tuple(Message(role, content, f"m-{i}") for i, (role, content) in enumerate(pairs)))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- normal replies ----------------------------------------------------------------------------


def test_normal_reply_and_request_body(server):
    server.behaviour = lambda req, n: Response(body=completion("Hello there.", "stop"))
    context = ctx(("system", "Be brief."), ("user", "Hi!"), ("assistant", "Hey."), ("user", "Again"))
    with server.agent(temperature=0.7, top_p=0.9, max_tokens=64, stop=("</answer>", "\n\n")) as agent:
        replies = agent.act([context])
    assert replies == [AgentReply(text="Hello there.", finish_reason="stop")]
    reply = replies[0]
    assert reply.prompt_ids is None and reply.sampled_ids is None and reply.logprobs is None

    assert len(server.requests) == 1
    req = server.requests[0]
    assert req.path == "/v1/chat/completions"
    assert req.headers["content-type"] == "application/json"
    assert "authorization" not in req.headers
    body = req.body
    assert body["model"] == "test-model"
    assert body["messages"] == context.to_chat()
    assert body["temperature"] == 0.7
    assert body["top_p"] == 0.9
    assert body["max_tokens"] == 64
    assert body["stop"] == ["</answer>", "\n\n"]
    assert "stream" not in body


def test_the_stop_string_the_server_matched_is_put_back(server):
    """OpenAI-compatible servers leave a stop string out of the reply: a search that "</search>"
    stopped would read as never closed. The one the server names is put back."""
    def reply(stop_reason, key="stop_reason"):
        body = completion("<search>Scott Derrickson", "stop")
        body["choices"][0][key] = stop_reason
        return Response(body=body)

    with server.agent(stop=("</search>", "</answer>")) as agent:
        for stop_reason, key, text in (("</search>", "stop_reason", "<search>Scott Derrickson</search>"),  # vLLM
                                       ("</search>", "matched_stop", "<search>Scott Derrickson</search>"),  # SGLang
                                       (None, "stop_reason", "<search>Scott Derrickson"),  # the end of a turn
                                       (128009, "matched_stop", "<search>Scott Derrickson"),  # a stop token's id
                                       ("\n\n", "stop_reason", "<search>Scott Derrickson")):  # no stop asked of it
            server.behaviour = lambda req, n: reply(stop_reason, key)
            assert agent.act_one(ctx(("user", "q"))).text == text
    with server.agent(extra_body={"stop": ["</search>"]}) as agent:  # (--api-extra '{"stop": [...]}')
        server.behaviour = lambda req, n: reply("</search>")
        assert agent.act_one(ctx(("user", "q"))).text == "<search>Scott Derrickson</search>"
        # A server asked to keep it (vLLM's include_stop_str_in_output) gets it once; a null
        # stop_reason does not hide matched_stop; no text (the stop hit in reasoning) stays empty.
        kept = completion("<search>Scott Derrickson</search>", "stop")
        kept["choices"][0].update(stop_reason=None, matched_stop="</search>")
        server.behaviour = lambda req, n: Response(body=kept)
        assert agent.act_one(ctx(("user", "q"))).text == "<search>Scott Derrickson</search>"
        empty = completion("", "stop")
        empty["choices"][0]["stop_reason"] = "</search>"
        server.behaviour = lambda req, n: Response(body=empty)
        assert agent.act_one(ctx(("user", "q"))).text == ""


def test_defaults_omit_stop_and_act_one(server):
    agent = server.agent()
    try:
        reply = agent.act_one(ctx(("user", "q")))
    finally:
        agent.close()
    assert reply.text == "ok"
    body = server.requests[0].body
    assert "stop" not in body
    assert body["temperature"] == 0.0 and body["top_p"] == 1.0 and body["max_tokens"] == 512


def test_none_content_is_empty_text_and_finish_reason_passed(server):
    server.behaviour = lambda req, n: Response(body=completion(None, "length"))
    reply = server.agent().act_one(ctx(("user", "q")))
    assert reply.text == "" and reply.finish_reason == "length"


def test_a_refusal_is_the_turns_text(server):
    body = completion(None, "stop")
    body["choices"][0]["message"]["refusal"] = "I can't help with that."
    server.behaviour = lambda req, n: Response(body=body)
    reply = server.agent().act_one(ctx(("user", "q")))
    assert (reply.text, reply.finish_reason) == ("I can't help with that.", "stop")


def test_finish_reasons_that_are_not_text_or_are_rftgyms_own_marker(server):
    for sent, kept in [(7, None), ({"a": 1}, None), ("banana", "banana"), ("context_full", "server:context_full")]:
        server.behaviour = lambda req, n: Response(body=completion("42", sent))
        reply = server.agent().act_one(ctx(("user", "q")))
        # A server's "context_full" is not the engine's marker, which would drop the reply and end the episode.
        assert (reply.text, reply.finish_reason) == ("42", kept)


def test_a_reply_cut_short_by_a_closed_connection_is_retried(server):
    server.behaviour = lambda req, n: Response(missing_bytes=50) if n == 1 else Response()
    assert server.agent(max_retries=1).act_one(ctx(("user", "q"))).text == "ok"
    assert len(server.requests) == 2


def test_the_first_request_to_fail_is_reported_at_once(server):
    # One refused request (a bad key) among requests that would time out and be retried.
    server.behaviour = lambda req, n: (Response(401, {"error": {"message": "invalid api key"}})
                                       if req.body["messages"][0]["content"] == "bad" else Response(delay_s=30))
    with server.agent(timeout_s=3, max_retries=2) as agent, pytest.raises(ChatAPIError) as info:
        agent.act([ctx(("user", "slow")), ctx(("user", "bad")), ctx(("user", "slow"))])
    assert info.value.status == 401 and "invalid api key" in str(info.value)
    # The slow ones were not retried (with retries there would be up to 7 requests); on a loaded
    # machine a slow one may not even have started before the failure stopped the batch.
    assert len(server.requests) <= 3


def test_content_parts_are_joined(server):
    body = completion()
    body["choices"][0]["message"]["content"] = [
        {"type": "text", "text": "a"},
        {"type": "text", "text": "b"},
    ]
    server.behaviour = lambda req, n: Response(body=body)
    assert server.agent().act_one(ctx(("user", "q"))).text == "ab"


def test_extra_body_is_merged(server):
    agent = server.agent(extra_body={"top_k": 20, "seed": 7, "temperature": 0.3})
    agent.act_one(ctx(("user", "q")))
    body = server.requests[0].body
    assert body["top_k"] == 20 and body["seed"] == 7 and body["temperature"] == 0.3


def test_empty_batch_makes_no_request(server):
    assert server.agent().act([]) == []
    assert server.requests == []


def test_batch_order_preserved_with_varying_delays(server):
    n = 6

    def behaviour(req, attempt):
        i = int(req.body["messages"][-1]["content"].split()[-1])
        # Earlier items answer later, so completion order is the reverse of request order.
        return Response(body=completion(f"echo {i}"), delay_s=0.04 * (n - i))

    server.behaviour = behaviour
    contexts = [ctx(("system", "s"), ("user", f"item {i}")) for i in range(n)]
    agent = server.agent(max_concurrency=n)
    try:
        replies = agent.act(contexts)
        assert [r.text for r in replies] == [f"echo {i}" for i in range(n)]
        assert server.max_in_flight >= 2  # requests really were concurrent
        # the pool is reused across calls and recreated after close()
        assert [r.text for r in agent.act(contexts[:2])] == ["echo 0", "echo 1"]
    finally:
        agent.close()
    assert [r.text for r in agent.act(contexts[:3])] == ["echo 0", "echo 1", "echo 2"]
    agent.close()
    agent.close()  # idempotent


def test_max_concurrency_is_respected(server):
    server.behaviour = lambda req, n: Response(delay_s=0.05)
    with server.agent(max_concurrency=2) as agent:
        replies = agent.act([ctx(("user", str(i))) for i in range(6)])
    assert len(replies) == 6
    assert server.max_in_flight <= 2


def test_a_high_concurrency_cap_starts_threads_only_for_the_requests_made(server):
    # all of them were started at once: --num-envs 20000 for 2 episodes took 48 s
    server.behaviour = lambda req, n: Response(delay_s=0.02)
    def request_threads() -> int:  # the agent's own, not the test server's per-connection threads
        return sum(thread.name.startswith("rftgym-chat-api") for thread in threading.enumerate())

    before = request_threads()
    with server.agent(max_concurrency=20_000) as agent:
        for _ in range(10):  # turn after turn: the idle workers take the next requests
            assert len(agent.act([ctx(("user", "a")), ctx(("user", "b"))])) == 2
        assert len(agent._pool._threads) == 2 and request_threads() <= before + 2


# -- retries and errors ------------------------------------------------------------------------


def test_retry_succeeds_after_two_503s(server):
    def behaviour(req, attempt):
        if attempt <= 2:
            return Response(503, {"error": {"message": "model is loading"}})
        return Response(body=completion("finally"))

    server.behaviour = behaviour
    reply = server.agent(max_retries=3).act_one(ctx(("user", "q")))
    assert reply.text == "finally"
    assert len(server.requests) == 3
    assert server.requests[0].body == server.requests[2].body


def test_429_is_retried(server):
    server.behaviour = lambda req, n: (
        Response(429, "slow down", headers={"Retry-After": "0"}) if n == 1 else Response()
    )
    assert server.agent(max_retries=1).act_one(ctx(("user", "q"))).text == "ok"
    assert len(server.requests) == 2


def test_5xx_exhausts_retries(server):
    server.behaviour = lambda req, n: Response(500, "internal kaboom")
    agent = server.agent(max_retries=2)
    with pytest.raises(ChatAPIError) as info:
        agent.act_one(ctx(("user", "q")))
    err = info.value
    assert err.status == 500
    assert len(server.requests) == 3
    message = str(err)
    assert "3 attempt" in message
    assert "internal kaboom" in message
    assert f"{server.base_url}/chat/completions" in message


def test_400_is_not_retried(server):
    error_body = {"error": {"message": "The model `nope` does not exist.", "code": 400}}
    server.behaviour = lambda req, n: Response(400, error_body)
    agent = server.agent(max_retries=3)
    with pytest.raises(ChatAPIError) as info:
        agent.act_one(ctx(("user", "q")))
    err = info.value
    assert err.status == 400
    assert len(server.requests) == 1
    message = str(err)
    assert "does not exist" in message
    assert "400" in message
    assert f"{server.base_url}/chat/completions" in message


@pytest.mark.parametrize("error_body", [
    {"object": "error", "message": "This model's maximum context length is 2048 tokens. However, you requested "
                                   "2100 tokens (1844 in the messages, 256 in the completion).",
     "type": "BadRequestError", "code": 400},  # vLLM
    {"error": {"message": "...", "type": "invalid_request_error", "code": "context_length_exceeded"}},  # OpenAI
    {"error": {"code": 400, "message": "the request exceeds the available context size, try increasing it",
               "type": "exceed_context_size_error"}},  # llama.cpp server
    {"error": "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 2048. Given: 1900 `inputs` "
              "tokens and 256 `max_new_tokens`", "error_type": "validation"},  # TGI, as HTTP 422
    {"error": "Input validation error: inputs tokens + max_new_tokens must be <= 2048. Given: 1900 inputs tokens and "
              "256 max_new_tokens", "error_type": "validation"},  # TGI's newer wording
    {"error": "Input validation error: `inputs` must have less than 1024 tokens. Given: 1100",
     "error_type": "validation"},  # TGI, a prompt alone too long
    {"object": "error", "message": "The decoder prompt (length 4200) is longer than the maximum model length of 4096. "
                                   "Make sure that `max_model_len` is no smaller than the number of text tokens.",
     "type": "BadRequestError", "code": 400},  # vLLM, a prompt alone too long
])
def test_a_context_that_does_not_fit_the_served_model_ends_the_episode(server, error_body):
    status = 422 if "error_type" in error_body else 400
    server.behaviour = lambda req, n: Response(status, error_body)
    agent = server.agent(max_retries=3)
    later = ctx(("user", "q"), ("assistant", "<search>x</search>"), ("user", "results"))
    with pytest.warns(UserWarning, match="outgrown the model's window") as caught:
        reply = agent.act_one(later)
    assert (reply.text, reply.finish_reason) == ("", CONTEXT_FULL)
    assert len(server.requests) == 1  # not retried
    assert {w.filename for w in caught} == {__file__}  # the user's line, not the agent's own
    # On an episode's first request too the episode ends there (as with a local policy), not the
    # whole evaluation; the warning says what to change, once.
    with pytest.warns(UserWarning, match=r"refused an episode's first request .*\(.+\).*Lower --max-new-tokens "
                                         r"\(max_tokens=512\), give shorter tasks, or serve a model with a longer"):
        reply = agent.act_one(ctx(("user", "q")))
    assert (reply.text, reply.finish_reason) == ("", CONTEXT_FULL)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert agent.act([ctx(("user", "q2")), later])[0].finish_reason == CONTEXT_FULL
    # Every first request of a batch refused (and none fitting before): a setting, which would end
    # every episode. The count is all the first requests refused so far: q, q2, q3 and q4.
    with pytest.raises(ChatAPIError, match=r"refused every one of 4 episodes' first requests .* lower "
                                           r"--max-new-tokens \(max_tokens=512\)"):
        agent.act([ctx(("user", "q3")), ctx(("user", "q4"))])


def test_an_error_reply_late_in_its_time_still_has_its_reason_read():
    """A 400 that comes near the end of the attempt's time, its body a moment later: the body (the
    reason, here a context that is full) still gets a few seconds, as error bodies are small."""
    body = json.dumps({"error": {"message": "This model's maximum context length is 2048 tokens. However, you "
                                            "requested 4000 tokens", "code": "context_length_exceeded"}}).encode()
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve():
        connection, _ = listener.accept()
        with connection:
            head = b""
            while b"\r\n\r\n" not in head:
                head += connection.recv(65536)
            time.sleep(0.8)  # a busy server: the refusal comes late in the attempt's 1 s
            connection.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: "
                               b"%d\r\nConnection: close\r\n\r\n" % len(body))
            stop.wait(0.5)  # the body in a later packet, past the attempt's deadline
            connection.sendall(body)

    worker = threading.Thread(target=serve)
    worker.start()
    try:
        agent = ChatAPIAgent.from_url(f"http://127.0.0.1:{listener.getsockname()[1]}/v1", "test-model",
                                      timeout_s=1.0, max_retries=0, api_key=None)
        with pytest.warns(UserWarning, match="refused an episode's first request"):
            reply = agent.act_one(ctx(("user", "q")))
        assert reply.finish_reason == CONTEXT_FULL
    finally:
        stop.set()
        worker.join(10)
        listener.close()


def test_a_reply_cut_inside_a_literal_is_taken_for_cut_short():
    from rftgym.agents.chat_api_http import cut_short

    for body in ('{"choices": [{"message": {"content": nul', '{"a": tru', '{"a": fals', '{"a": 1, "b": '):
        try:
            json.loads(body)
        except json.JSONDecodeError as exc:
            assert cut_short(body.encode(), exc), body
    try:
        json.loads('{"a": nope}')
    except json.JSONDecodeError as exc:
        assert not cut_short(b'{"a": nope}', exc)  # not a literal's start: a malformed body


def test_a_prompt_that_mentions_context_length_is_not_a_context_refusal(server):
    echo = {"object": "error", "message": "invalid request: unknown field", "type": "BadRequestError",
            "request": {"messages": [{"role": "user", "content": "What is the maximum context length of GPT-2?"}]}}
    server.behaviour = lambda req, n: Response(400, echo)
    with pytest.raises(ChatAPIError, match="HTTP 400"):
        server.agent().act_one(ctx(("user", "q"), ("assistant", "a"), ("user", "q2")))


def test_error_body_snippet_is_short(server):
    server.behaviour = lambda req, n: Response(422, "x" * 5000)
    with pytest.raises(ChatAPIError) as info:
        server.agent().act_one(ctx(("user", "q")))
    message = str(info.value)
    assert "x" * 100 in message
    assert "x" * 301 not in message
    assert len(message) < 1000


def test_wrong_base_url_gives_404_hint(server):
    agent = ChatAPIAgent.from_url(server.base_url[: -len("/v1")], "test-model", max_retries=0)
    with pytest.raises(ChatAPIError) as info:
        agent.act_one(ctx(("user", "q")))
    assert info.value.status == 404
    assert "/chat/completions" in str(info.value)


def test_timeout_raises_quickly(server):
    server.behaviour = lambda req, n: Response(delay_s=3.0)
    agent = server.agent(timeout_s=0.2, max_retries=1)
    start = time.monotonic()
    with pytest.raises(ChatAPIError) as info:
        agent.act_one(ctx(("user", "q")))
    elapsed = time.monotonic() - start
    assert elapsed < 2.0
    assert info.value.status is None
    message = str(info.value)
    assert "timed out" in message and "2 attempt" in message
    assert len(server.requests) == 2


@pytest.mark.parametrize("response, timeout_s, said", [
    # The whole body would take over 7 s.
    (Response(trickle_s=0.05), 0.5, r"the reply took over 0.5 s \(timeout_s\)"),
    # Each read returns a byte 1.8 s after the last, within the socket's 2 s timeout: the body is
    # given up at its 2 s deadline, not after the read that ends past it (3.6 s).
    (Response(trickle_s=1.8), 2.0, r"the reply took over 2 s \(timeout_s\)"),
    # One read of a chunked body reads a whole chunk-size line, a socket read per byte: without
    # the deadline it would wait out the 10 s the server trickles it for.
    (Response(chunk_line_trickle_s=0.3), 0.5, r"the reply took over 0.5 s \(timeout_s\)"),
    # An error's body is read for its reason; a byte each 0.3 s would take over 10 s in all.
    (Response(400, {"error": {"message": "bad request " + "x" * 20}}, trickle_s=0.3), 0.5, "HTTP 400"),
], ids=["trickle", "a byte just inside each read timeout", "chunk-size line", "error body"])
def test_a_reply_trickling_in_is_given_up_at_the_timeout(server, response, timeout_s, said):
    server.behaviour = lambda req, n: response
    agent = server.agent(timeout_s=timeout_s, max_retries=0)
    start = time.monotonic()
    with pytest.raises(ChatAPIError, match=said):
        agent.act_one(ctx(("user", "q")))
    assert time.monotonic() - start < 3.0


def test_headers_trickling_in_are_given_up_at_the_timeout_and_retried():
    from slow_servers import finishes_within, trickling_server

    # A status line, then a header byte each 0.2 s for ever: no socket read waits its 1 s.
    with trickling_server() as port:
        agent = ChatAPIAgent.from_url(f"http://127.0.0.1:{port}/v1", "m", timeout_s=1.0, max_retries=1,
                                      backoff_s=0.01, api_key=None)
        error = finishes_within(6.0, lambda: agent.act_one(ctx(("user", "q"))))
    agent.close()
    assert isinstance(error, ChatAPIError) and error.status is None, error
    assert "failed after 2 attempt(s): timed out after 1 s (timeout_s)" in str(error)
    assert "--api-timeout" in str(error)
    # A request that waits in a busy server's queue times out too: the hint says to send fewer at once.
    assert "The time a request waits in the server's queue counts too" in str(error)
    assert "lower --num-envs (max_concurrency)" in str(error)


def test_a_name_lookup_that_hangs_is_reported_as_the_resolvers(monkeypatch):
    from slow_servers import HangingResolver, finishes_within

    with HangingResolver.installed(monkeypatch):
        agent = ChatAPIAgent.from_url("http://llm.test:8000/v1", "m", timeout_s=1.0, max_retries=0, api_key=None)
        error = finishes_within(4.0, lambda: agent.act_one(ctx(("user", "q"))))
        agent.close()
    assert isinstance(error, ChatAPIError), error
    assert "the name lookup of llm.test did not finish within 1 s; check the DNS settings" in str(error)


def test_a_huge_reply_is_refused_without_holding_it(server):
    server.behaviour = lambda req, n: Response(body=b" " * (65 << 20))
    with pytest.raises(ChatAPIError, match="sent a reply of over 64 MiB"):
        server.agent(max_retries=0).act_one(ctx(("user", "q")))


@pytest.mark.parametrize(
    "body, expected",
    [
        ("this is not json {", "not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ({"choices": [{"message": {"content": [{"type": "text", "text": 5}]}}]}, "'text' that is not a string"),
        ({"choices": [{"message": {"content": ["4", "2"]}}]}, "content is not an object"),
        ({"object": "chat.completion"}, "choices"),
        ({"choices": []}, "choices"),
        ({"choices": [{"text": "legacy completion"}]}, "message"),
        ([1, 2, 3], "not an object"),
    ],
)
def test_malformed_response_raises(server, body, expected):
    server.behaviour = lambda req, n: Response(
        200, json.dumps(body) if not isinstance(body, str) else body
    )
    with pytest.raises(ChatAPIError) as info:
        server.agent(max_retries=2).act_one(ctx(("user", "q")))
    message = str(info.value)
    assert expected in message
    assert '"choices"' in message  # says what shape was expected
    assert len(server.requests) == 1  # a malformed 200 is not retried


def test_a_streamed_reply_and_an_error_sent_as_http_200_are_said_as_such(server):
    server.behaviour = lambda req, n: Response(200, 'data: {"choices": [{"delta": {"content": "Hi"}}]}\n\n'
                                                    "data: [DONE]\n\n", headers={"Content-Type": "text/event-stream"})
    with pytest.raises(ChatAPIError, match="answered with an event stream .*Turn streaming off on the server"):
        server.agent(max_retries=2).act_one(ctx(("user", "q")))
    assert len(server.requests) == 1
    # A failure the server reports with a 200 (out of GPU memory) is retried, then named.
    server.requests.clear()
    server.behaviour = lambda req, n: Response(200, {"error": {"message": "CUDA out of memory", "code": 500}})
    with pytest.raises(ChatAPIError, match=r"failed after 3 attempt\(s\): HTTP 200 with an error instead of a "
                                           r"completion: CUDA out of memory.*The server at .* is failing; check its "
                                           "logs"):
        server.agent(max_retries=2).act_one(ctx(("user", "q")))
    assert len(server.requests) == 3
    # One that says the context does not fit ends the episode, as the same error with a 4xx does.
    server.behaviour = lambda req, n: Response(200, {"error": {"message": "maximum context length is 2048 tokens"}})
    later = ctx(("user", "q"), ("assistant", "a"), ("user", "more"))
    with pytest.warns(UserWarning, match="outgrown the model's window"):
        assert server.agent().act_one(later).finish_reason == CONTEXT_FULL


def test_connection_refused_mentions_url():
    port = free_port()
    base_url = f"http://127.0.0.1:{port}/v1"
    agent = ChatAPIAgent.from_url(base_url, "m", max_retries=1, backoff_s=0.01, timeout_s=2.0)
    start = time.monotonic()
    with pytest.raises(ChatAPIError) as info:
        agent.act([ctx(("user", "a")), ctx(("user", "b"))])
    assert time.monotonic() - start < 3.0
    agent.close()
    message = str(info.value)
    assert f"{base_url}/chat/completions" in message
    assert "2 attempt" in message
    assert "--api-base" in message
    assert info.value.status is None


def test_batch_failure_raises(server):
    server.behaviour = lambda req, n: (
        Response(400, "bad item") if req.body["messages"][0]["content"] == "bad" else Response()
    )
    with server.agent() as agent, pytest.raises(ChatAPIError) as info:
        agent.act([ctx(("user", "good")), ctx(("user", "bad")), ctx(("user", "good"))])
    assert info.value.status == 400


# -- auth --------------------------------------------------------------------------------------


def test_authorization_header_sent_with_api_key(server):
    server.agent(api_key="sk-test-123").act_one(ctx(("user", "q")))
    assert server.requests[0].headers["authorization"] == "Bearer sk-test-123"


def test_api_key_defaults_to_env(server, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env")
    agent = ChatAPIAgent.from_url(server.base_url, "test-model")
    assert agent.config.api_key == "sk-from-env"
    agent.act_one(ctx(("user", "q")))
    assert server.requests[0].headers["authorization"] == "Bearer sk-from-env"
    assert "sk-from-env" not in repr(agent.config)

    monkeypatch.delenv("OPENAI_API_KEY")
    assert ChatAPIConfig(base_url=server.base_url, model="m").api_key is None


# -- config ------------------------------------------------------------------------------------


def test_config_normalisation_and_name():
    cfg = ChatAPIConfig(base_url="http://127.0.0.1:8000/v1/", model="qwen", stop=["a", "b"])
    assert cfg.base_url == "http://127.0.0.1:8000/v1"
    assert cfg.url == "http://127.0.0.1:8000/v1/chat/completions"
    assert cfg.stop == ("a", "b")
    assert ChatAPIConfig(base_url="https://example.invalid/api", model="m", stop="x").stop == ("x",)
    agent = ChatAPIAgent(cfg)
    assert agent.name == "api:qwen"
    agent.close()  # nothing to close: no pool was created
    extra = {"top_k": 5}
    cfg2 = ChatAPIConfig(base_url="http://localhost:1/v1", model="m", extra_body=extra)
    extra["top_k"] = 99
    assert cfg2.extra_body == {"top_k": 5}


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"base_url": "127.0.0.1:8000/v1"}, "http:// or https://"),
        ({"base_url": ""}, "base_url"),
        ({"base_url": "http://127.0.0.1:8000/v1/chat/completions"}, "before /chat/completions"),
        ({"base_url": "http:///v1"}, "host"),
        ({"base_url": "http://[::1/v1"}, "not a valid URL"),
        ({"model": ""}, "model"),
        ({"temperature": -0.1}, ">= 0"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "(0, 1]"),
        ({"top_p": 1.5}, "(0, 1]"),
        ({"max_tokens": 0}, ">= 1"),
        ({"max_tokens": 1.5}, "integer"),
        ({"max_tokens": True}, "integer"),
        ({"stop": ("ok", "")}, "non-empty strings"),
        ({"stop": (1,)}, "non-empty strings"),
        ({"timeout_s": 0}, "in (0, 86400]"),
        ({"timeout_s": 1e10}, "a day at most"),
        ({"timeout_s": 10**400}, "a day at most"),  # past float's range: refused, not an OverflowError
        ({"temperature": 10**400}, "temperature"),
        ({"max_retries": -1}, ">= 0"),
        ({"backoff_s": -1}, "in [0, 3600]"), ({"backoff_s": 1e308}, "in [0, 3600]"),
        ({"max_concurrency": 0}, ">= 1"),
        ({"extra_body": ["top_k"]}, "dict"),
        ({"extra_body": {"messages": []}}, "must not set"),
        ({"extra_body": {"stream": True}}, "must not set"),
        ({"extra_body": {"x": object()}}, "JSON"),
        ({"api_key": 123}, "api_key"),
        ({"api_key": "sk\nx"}, "api_key"),
    ],
)
def test_bad_config_raises_config_error(kwargs, fragment):
    args = {"base_url": "http://127.0.0.1:8000/v1", "model": "m", "api_key": None, **kwargs}
    with pytest.raises(ConfigError) as info:
        ChatAPIConfig(**args)
    assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)


def test_numpy_numbers_are_settings_and_go_into_the_body_as_json_numbers(server):
    # Sweeps and data pipelines hand numpy scalars around; SamplingConfig takes them, so does this.
    import numpy as np

    server.behaviour = lambda req, n: Response(body=completion("fine"))
    with server.agent(temperature=np.float32(0.5), top_p=np.float64(0.75), max_tokens=np.int64(64),
                      timeout_s=np.int32(5), max_retries=np.int64(1), max_concurrency=np.int64(2)) as agent:
        assert type(agent.config.max_tokens) is int and type(agent.config.temperature) is float
        assert agent.act([ctx(("user", "hi"))])[0].text == "fine"
    body = server.requests[0].body
    assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0.5, 0.75, 64)


def test_from_url_rejects_unknown_fields_and_agent_rejects_non_config():
    with pytest.raises(ConfigError, match="allowed"):
        ChatAPIAgent.from_url("http://127.0.0.1:8000/v1", "m", temprature=0.5)
    with pytest.raises(ConfigError):
        ChatAPIAgent({"base_url": "http://127.0.0.1:8000/v1", "model": "m"})  # type: ignore[arg-type]


def test_act_rejects_non_context():
    agent = ChatAPIAgent.from_url("http://127.0.0.1:9/v1", "m", api_key=None)
    with pytest.raises(TypeError, match="Context"):
        agent.act([[{"role": "user", "content": "hi"}]])  # type: ignore[list-item]


def test_an_interrupted_batch_does_not_hold_the_process_until_its_requests_time_out():
    import socket
    import subprocess
    import sys

    # A server that accepts and never answers; requests may wait 300 s for it.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        script = f"""
import os, signal, threading
# A test run started in the background (`pytest &` in a script) ignores SIGINT, and so would
# this process, which inherits that: Ctrl-C is taken as a terminal delivers it.
signal.signal(signal.SIGINT, signal.default_int_handler)
from rftgym.agents.chat_api import ChatAPIAgent
from rftgym.core.messages import Context, Message
agent = ChatAPIAgent.from_url("http://127.0.0.1:{port}/v1", "m", timeout_s=300, max_retries=0, max_concurrency=2)
threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
agent.act([Context((Message("user", "a", "u0"),)), Context((Message("user", "b", "u1"),))])
"""
        # Ctrl-C ends the process at once; before, the interpreter joined the request threads.
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "KeyboardInterrupt" in done.stderr


# -- retries: backoff, what is retried, what is said ---------------------------------------------


def test_backoff_is_exponential_with_full_jitter_and_a_cap(monkeypatch):
    import rftgym.agents.chat_api as chat_api

    agent = ChatAPIAgent.from_url("http://127.0.0.1:9/v1", "m", api_key=None)
    assert agent.config.max_retries == 5 and agent.config.backoff_s == 0.5

    class Highest:  # the top of each draw's range
        @staticmethod
        def uniform(low, high):
            return high

    monkeypatch.setattr(chat_api, "_JITTER", Highest)
    assert [agent._backoff_s(k, None) for k in range(1, 8)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert agent._backoff_s(1, 30.0) == 30.0  # the server's Retry-After is the least wait
    assert agent._backoff_s(10**6, None) == 8.0  # no overflow however many retries
    slow = ChatAPIAgent.from_url("http://127.0.0.1:9/v1", "m", api_key=None, backoff_s=20.0)
    assert slow._backoff_s(3, None) == 20.0  # a backoff above the cap is the cap
    monkeypatch.undo()
    # Full jitter: anywhere in [0, ceiling], so that requests that failed together spread out.
    draws = [agent._backoff_s(3, None) for _ in range(200)]
    assert all(0 <= d <= 2.0 for d in draws) and min(draws) < 0.5 and max(draws) > 1.5


def test_retry_after_in_seconds_or_as_an_http_date():
    from email.utils import formatdate

    from rftgym.core.web import retry_after_s as _retry_after_s

    assert _retry_after_s({"Retry-After": "2.5"}) == 2.5
    assert _retry_after_s({"Retry-After": "3600"}) == 60.0  # capped
    assert 28 <= _retry_after_s({"Retry-After": formatdate(time.time() + 30, usegmt=True)}) <= 30
    assert 28 <= _retry_after_s({"Retry-After": formatdate(time.time() + 30)[:-5] + "-0000"}) <= 30  # no zone: GMT
    assert _retry_after_s({"Retry-After": formatdate(time.time() - 30, usegmt=True)}) == 0.0
    assert _retry_after_s({"Retry-After": formatdate(time.time() + 3600, usegmt=True)}) == 60.0
    for value in ("soon", "nan", "Wed, 99 Foo 2020 00:00:00 GMT", ""):
        assert _retry_after_s({"Retry-After": value}) is None, value
    assert _retry_after_s({}) is None


def test_retry_after_ms_is_read_first():
    """OpenAI sends ``retry-after-ms`` beside ``Retry-After``: milliseconds, finer, read first
    (header names in any case, as an HTTP reply's headers are)."""
    from email.message import Message

    from rftgym.core.web import retry_after_s as _retry_after_s

    headers = Message()
    headers["Retry-After-Ms"] = "250"
    headers["Retry-After"] = "3"
    assert _retry_after_s(headers) == 0.25
    assert _retry_after_s({"retry-after-ms": "120000"}) == 60.0  # capped like Retry-After
    assert _retry_after_s({"retry-after-ms": "-5"}) == 0.0
    for broken in ("soon", "nan", "inf"):  # not a number: Retry-After decides
        assert _retry_after_s({"retry-after-ms": broken, "Retry-After": "2"}) == 2.0, broken
        assert _retry_after_s({"retry-after-ms": broken}) is None, broken


def test_a_retry_after_date_is_waited_for(server):
    from email.utils import formatdate

    server.behaviour = lambda req, n: (Response(503, "busy", headers={"Retry-After": formatdate(time.time() + 2,
                                                                                               usegmt=True)})
                                       if n == 1 else Response())
    start = time.monotonic()
    with pytest.warns(UserWarning, match="HTTP 503"):
        assert server.agent(max_retries=1).act_one(ctx(("user", "q"))).text == "ok"
    assert time.monotonic() - start >= 0.9  # the date has one-second resolution; backoff alone is 0.01 s
    assert len(server.requests) == 2


@pytest.mark.parametrize("status", [408, 409])
def test_request_timeout_and_conflict_are_retried(server, status):
    server.behaviour = lambda req, n: Response(status, "try again") if n == 1 else Response()
    with pytest.warns(UserWarning, match=f"attempt 1 of 2 failed: HTTP {status}"):
        assert server.agent(max_retries=1).act_one(ctx(("user", "q"))).text == "ok"
    assert len(server.requests) == 2
    server.behaviour = lambda req, n: Response(status, "try again")
    with pytest.raises(ChatAPIError, match=r"raise --api-max-retries \(max_retries\)") as info:
        server.agent(max_retries=1).act_one(ctx(("user", "q")))
    assert info.value.status == status


def test_an_exhausted_quota_is_not_retried(server):
    quota = {"error": {"message": "You exceeded your current quota, please check your plan and billing details.",
                       "type": "insufficient_quota", "code": "insufficient_quota"}}
    server.behaviour = lambda req, n: Response(429, quota)
    with pytest.raises(ChatAPIError, match="the account is out of quota") as info:
        server.agent(max_retries=3).act_one(ctx(("user", "q")))
    assert info.value.status == 429 and "OPENAI_API_KEY" in str(info.value)
    assert len(server.requests) == 1


def test_a_rate_limit_that_persists_names_the_flags_to_change(server):
    server.behaviour = lambda req, n: Response(429, {"error": {"message": "Rate limit reached", "type": "requests"}})
    with pytest.warns(UserWarning), pytest.raises(ChatAPIError) as info:
        server.agent(max_retries=1).act_one(ctx(("user", "q")))
    assert "lower --num-envs (max_concurrency) or raise --api-max-retries (max_retries) or --api-backoff " \
           "(backoff_s)" in str(info.value)


@pytest.mark.parametrize("cut", ["chunked", "unannounced"])
def test_a_reply_cut_short_without_a_length_to_tell_is_retried(server, cut):
    # IncompleteRead (a chunk that never ends), or JSON that breaks off where no length was announced.
    server.behaviour = lambda req, n: Response(cut=cut) if n == 1 else Response()
    with pytest.warns(UserWarning, match="attempt 1 of 2 failed"):
        assert server.agent(max_retries=1).act_one(ctx(("user", "q"))).text == "ok"
    assert len(server.requests) == 2
    server.behaviour = lambda req, n: Response(cut=cut)
    with pytest.raises(ChatAPIError, match="failed after 2 attempt") as info:
        server.agent(max_retries=1).act_one(ctx(("user", "q")))
    assert "not valid JSON" not in str(info.value)
    # The server is reachable: it is the replies that broke off.
    assert "answers, but its replies broke off before their end" in str(info.value)
    assert "Is the server running" not in str(info.value)


def test_a_whole_reply_whose_json_breaks_off_is_malformed_not_retried(server):
    # Its Content-Length says the body is all there: the server sent broken JSON, and a retry
    # would only get the same (as a reply without a length, above, could be a closed connection).
    server.behaviour = lambda req, n: Response(body='{"choices": [ {"message": ')
    with pytest.raises(ChatAPIError, match="the body is not valid JSON"):
        server.agent(max_retries=3).act_one(ctx(("user", "q")))
    assert len(server.requests) == 1


def test_the_first_retry_warns_once_naming_its_cause(server):
    server.behaviour = lambda req, n: Response(503, "loading") if n <= 4 else Response()
    agent = server.agent(max_retries=3, max_concurrency=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [r.text for r in agent.act([ctx(("user", "a")), ctx(("user", "b"))])] == ["ok", "ok"]
        server.requests.clear()  # attempts count afresh
        server.behaviour = lambda req, n: Response(503, "loading") if n <= 3 else Response()
        assert agent.act_one(ctx(("user", "c"))).text == "ok"
        assert len(server.requests) == 4
    retries = [w for w in caught if "retrying" in str(w.message)]
    assert len(retries) == 1 and "attempt 1 of 4 failed: HTTP 503: loading" in str(retries[0].message), retries
    # Met on a worker thread of the batch (whose stack holds no line of the user's), it is given
    # at the call of act.
    assert retries[0].filename == __file__
    # Timeouts and connection errors are named as such.
    server.requests.clear()
    server.behaviour = lambda req, n: Response(delay_s=2.0) if n == 1 else Response()
    with pytest.warns(UserWarning, match=r"attempt 1 of 2 failed: timed out after 0.2 s"):
        server.agent(timeout_s=0.2, max_retries=1).act_one(ctx(("user", "q")))
    refused = ChatAPIAgent.from_url(f"http://127.0.0.1:{free_port()}/v1", "m", max_retries=1, backoff_s=0.01)
    with pytest.warns(UserWarning, match="attempt 1 of 2 failed: could not connect"), pytest.raises(ChatAPIError):
        refused.act_one(ctx(("user", "q")))


def test_a_retry_met_in_a_batch_is_warned_while_the_batch_still_waits(server):
    """The warning of a worker thread's retry is given by the thread that called act, and as it
    comes: it explains a batch that stalls, so it does not wait for the batch to end."""
    def behaviour(req, n):
        if req.body["messages"][0]["content"] == "slow":
            return Response(delay_s=1.5)
        return Response(503, "loading") if n <= 2 else Response()

    server.behaviour = behaviour
    given = []  # (when, thread, file) of each warning given
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, category, filename, *rest: given.append(
            (time.monotonic(), threading.current_thread(), filename))
        start = time.monotonic()
        server.agent(max_retries=1, max_concurrency=2).act([ctx(("user", "slow")), ctx(("user", "fast"))])
        end = time.monotonic()
    assert [(thread, filename) for _, thread, filename in given] == [(threading.current_thread(), __file__)]
    assert given[0][0] - start < 1.0 < end - start  # given while the slow request still ran


# -- redirects ---------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_not_followed_and_names_the_new_address(server, status):
    server.behaviour = lambda req, n: Response(status, "", headers={"Location": "/v2/chat/completions"})
    with pytest.raises(ChatAPIError) as info:
        server.agent(max_retries=3).act_one(ctx(("user", "q")))
    message, new_base = str(info.value), server.base_url[: -len("/v1")] + "/v2"
    assert info.value.status == status
    assert f"redirected (HTTP {status}) to {new_base}/chat/completions" in message
    assert f"({new_base}), as --api-base (base_url)" in message
    assert len(server.requests) == 1  # nothing was resent (a GET would be answered 501, unrecorded, here)
    server.behaviour = lambda req, n: Response(status, "")
    with pytest.raises(ChatAPIError, match=r"no Location header.*check --api-base"):
        server.agent().act_one(ctx(("user", "q")))


# -- replies with no text ----------------------------------------------------------------------


@pytest.mark.parametrize("message, finish_reason, warning", [
    ({"content": None, "tool_calls": [{"id": "c1", "type": "function",
                                       "function": {"name": "search", "arguments": "{}"}}]},
     "tool_calls", r"tool calls and no text .*rftgym envs offer no tools .*answer in text"),
    ({"content": None}, "content_filter", r"content filter withheld a reply"),
    ({"content": None, "reasoning_content": "Let me think..."}, "length",
     r"reasoning but no answer \(finish_reason length\).*raise --max-new-tokens \(max_tokens=512\)"),
    ({"content": "", "reasoning": "Let me think..."}, "length", r"reasoning but no answer"),
])
def test_an_empty_reply_for_a_reason_says_it_once(server, message, finish_reason, warning):
    server.behaviour = lambda req, n: Response(body={"choices": [{"message": {"role": "assistant", **message},
                                                                  "finish_reason": finish_reason}]})
    agent = server.agent()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        replies = agent.act([ctx(("user", "a")), ctx(("user", "b"))]) + [agent.act_one(ctx(("user", "c")))]
    assert [(r.text, r.finish_reason) for r in replies] == [("", finish_reason)] * 3
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert re.search(warning, str(caught[0].message)), str(caught[0].message)
    assert caught[0].filename == __file__  # met on a worker thread of the batch, given at the call of act


def test_an_empty_reply_with_no_reason_is_not_warned_about(server):
    server.behaviour = lambda req, n: Response(body=completion(None, "stop"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert server.agent().act_one(ctx(("user", "q"))) == AgentReply(text="", finish_reason="stop")


# -- seeds and sample keys ---------------------------------------------------------------------


def seeds_by_content(server) -> dict[str, int | None]:
    return {r.body["messages"][-1]["content"]: r.body.get("seed") for r in server.requests}


def test_keyed_requests_carry_the_keys_seed_whatever_the_batch(server):
    from rftgym.agents.sampling_keys import keyed_seed

    agent = server.agent(temperature=0.7, seed=5, max_concurrency=3)
    assert agent.keyed_sampling
    keys = [(1, 2, 0, 0), (1, 3, 0, 0), (1, 3, 1, 0)]
    agent.act([ctx(("user", f"q{i}")) for i in range(3)], sample_keys=keys)
    assert seeds_by_content(server) == {f"q{i}": keyed_seed(5, key) for i, key in enumerate(keys)}
    assert len(set(seeds_by_content(server).values())) == 3
    server.requests.clear()
    agent.act([ctx(("user", "q2"))], sample_keys=[keys[2]])  # alone this time: the same seed
    assert seeds_by_content(server) == {"q2": keyed_seed(5, keys[2])}
    assert all(0 <= seed < 2**31 for seed in (keyed_seed(5, k) for k in keys))


def test_unkeyed_requests_sample_afresh_yet_replay(server):
    def seeds(agent) -> list[int]:
        server.requests.clear()
        agent.act([ctx(("user", "same")), ctx(("user", "same"))])
        first = sorted(r.body["seed"] for r in server.requests)
        server.requests.clear()
        agent.act_one(ctx(("user", "same")))
        return first + [server.requests[0].body["seed"]]

    one = seeds(server.agent(temperature=1.0, seed=3))
    assert len(set(one)) == 3  # one context asked twice, or asked again, is not answered alike
    assert seeds(server.agent(temperature=1.0, seed=3)) == one  # the same calls replay
    assert seeds(server.agent(temperature=1.0, seed=4)) != one


@pytest.mark.parametrize("kwargs, sent", [
    ({"temperature": 0.0, "seed": 5}, None),  # greedy needs none
    ({"temperature": 0.7}, None),  # no seed set
    ({"temperature": 0.7, "seed": 5, "extra_body": {"seed": 11}}, 11),  # extra_body wins
    ({"temperature": 0.0, "seed": 5, "extra_body": {"temperature": 0.5}}, "keyed"),  # the temperature sent counts
])
def test_when_a_seed_is_sent(server, kwargs, sent):
    from rftgym.agents.sampling_keys import keyed_seed

    server.agent(**kwargs).act([ctx(("user", "q"))], sample_keys=[(1, 0, 0, 0)])
    body = server.requests[0].body
    assert body.get("seed") == (keyed_seed(5, (1, 0, 0, 0)) if sent == "keyed" else sent)
    assert ("seed" in body) == (sent is not None)


def test_sample_keys_are_checked(server):
    agent = server.agent(temperature=0.7, seed=1)
    with pytest.raises(ValueError, match="2 sample keys for 1 contexts; give one per context"):
        agent.act([ctx(("user", "q"))], sample_keys=[(1,), (2,)])
    with pytest.raises(ValueError, match="non-negative ints"):
        agent.act([ctx(("user", "q"))], sample_keys=[(1, -2)])
    with pytest.raises(TypeError, match="non-negative ints"):
        agent.act([ctx(("user", "q"))], sample_keys=["ab"])
    assert server.requests == []


def test_the_seed_is_validated():
    import numpy as np

    base = {"base_url": "http://127.0.0.1:8000/v1", "model": "m", "api_key": None}
    for bad in (-1, 2**63, 1.5, True, "3"):
        with pytest.raises(ConfigError, match="ChatAPIConfig.seed must be None or an integer in") as info:
            ChatAPIConfig(**base, seed=bad)
        assert info.value.fields == ("seed",)
    config = ChatAPIConfig(**base, seed=np.int64(7))
    assert config.seed == 7 and type(config.seed) is int
    assert ChatAPIConfig(**base, seed=2**63 - 1).seed == 2**63 - 1


def test_the_rollout_engine_gives_the_api_agent_its_keys(server):
    """An episode samples the same whatever else shares its batch: its requests carry the same seeds."""
    from rftgym.rollout import RolloutConfig, run_episodes

    def seeds(num_envs: int) -> dict[str, int]:
        server.requests.clear()
        with server.agent(temperature=0.7, seed=9) as agent:
            run_episodes(lambda: gym.make("rftgym/VerifiableQA-v0"), agent, [0, 1, 2, 3],
                         config=RolloutConfig(num_envs=num_envs))
        return {json.dumps(r.body["messages"]): r.body["seed"] for r in server.requests}

    alone, together = seeds(1), seeds(4)
    assert alone == together and len(set(alone.values())) == len(alone) >= 4


# -- the Python API --------------------------------------------------------------------------------


def test_act_on_a_single_context_says_to_wrap_it():
    agent = ChatAPIAgent.from_url("http://127.0.0.1:9/v1", "m", api_key=None)
    with pytest.raises(TypeError, match=r"act takes a list of contexts; wrap one in a list: act\(\[context\]\)"):
        agent.act(ctx(("user", "q")))


def test_an_agent_copies_and_pickles(server):
    import copy
    import pickle

    agent = server.agent(temperature=0.5, seed=2, api_key="sk-x")
    assert [r.text for r in agent.act([ctx(("user", "a")), ctx(("user", "b"))])] == ["ok", "ok"]
    for clone in (copy.deepcopy(agent), pickle.loads(pickle.dumps(agent))):
        assert clone.config == agent.config and clone.name == agent.name
        assert clone._lock is not agent._lock and clone._pool is None
        assert [r.text for r in clone.act([ctx(("user", "c")), ctx(("user", "d"))])] == ["ok", "ok"]
        clone.close()
    assert agent.act_one(ctx(("user", "e"))).text == "ok"
    agent.close()


def test_first_requests_refused_one_at_a_time_stop_the_run(server):
    # --num-envs 1: each call holds one first request. One refused is a task too long; the first
    # three refused with none fitting is max_tokens past the served context.
    server.behaviour = lambda req, n: Response(400, {"error": {"message": "maximum context length is 2048 tokens"}})
    agent = server.agent(max_retries=0)
    with pytest.warns(UserWarning, match="refused an episode's first request"):
        assert agent.act_one(ctx(("user", "q1"))).finish_reason == CONTEXT_FULL
    assert agent.act_one(ctx(("user", "q2"))).finish_reason == CONTEXT_FULL
    with pytest.raises(ChatAPIError, match=r"refused every one of 3 episodes' first requests .* lower --max-new"):
        agent.act_one(ctx(("user", "q3")))
    # once a first request has fit, refusals are tasks too long, however many
    server.behaviour = lambda req, n: Response() if n == 1 else Response(
        400, {"error": {"message": "maximum context length is 2048 tokens"}})
    server.requests.clear()
    agent = server.agent(max_retries=0)
    assert agent.act_one(ctx(("user", "fits"))).text == "ok"
    with pytest.warns(UserWarning):
        for i in range(4):
            assert agent.act_one(ctx(("user", f"long {i}"))).finish_reason == CONTEXT_FULL
        assert all(r.finish_reason == CONTEXT_FULL for r in agent.act([ctx(("user", "a")), ctx(("user", "b"))]))


def test_a_reply_that_is_not_utf8_is_read_with_replacement_characters(server):
    body = json.dumps(completion("caf\u00e9 PLACEHOLDER")).encode("utf-8").replace(b"PLACEHOLDER", b"\xff\xfe!")
    server.behaviour = lambda req, n: Response(body=body)
    agent = server.agent()
    with pytest.warns(UserWarning, match=r"not valid UTF-8 \(invalid start byte at byte \d+\).*U\+FFFD"):
        assert agent.act_one(ctx(("user", "q"))).text == "caf\u00e9 \ufffd\ufffd!"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        assert agent.act_one(ctx(("user", "q"))).text == "caf\u00e9 \ufffd\ufffd!"


def test_an_empty_body_is_retried_as_cut_short(server):
    server.behaviour = lambda req, n: Response(body=b"") if n == 1 else Response()
    with pytest.warns(UserWarning, match="attempt 1 of 2 failed: the reply's body is empty"):
        assert server.agent(max_retries=1).act_one(ctx(("user", "q"))).text == "ok"
    assert len(server.requests) == 2


@pytest.mark.parametrize("coding, compress", [
    ("gzip", lambda b: __import__("gzip").compress(b)),
    ("deflate", lambda b: __import__("zlib").compress(b)),
    ("deflate", lambda b: __import__("zlib").compress(b)[2:-4]),  # raw deflate, as some servers send
])
def test_a_compressed_reply_the_agent_did_not_ask_for_is_inflated(server, coding, compress):
    packed = compress(json.dumps(completion("inflated")).encode())
    server.behaviour = lambda req, n: Response(body=packed, headers={"Content-Encoding": coding})
    assert server.agent().act_one(ctx(("user", "q"))).text == "inflated"
    assert server.requests[0].headers.get("accept-encoding", "identity") == "identity"


def test_an_unknown_or_broken_content_coding_is_named():
    from rftgym.agents.chat_api_http import decoded

    with pytest.raises(ChatAPIError, match=r"'br' content coding, which the agent does not read"):
        decoded(b"\x00", "br", "http://127.0.0.1/v1/chat/completions")
    with pytest.raises(ChatAPIError, match="said its reply is gzip-compressed, but it does not inflate"):
        decoded(b"{\"not\": \"gzip\"}", "gzip", "http://127.0.0.1/v1/chat/completions")
    assert decoded(b"{}", "Identity", "u") == b"{}"


def test_https_to_a_plain_http_server_says_to_use_http(server):
    plain = server.base_url.replace("http://", "https://")
    agent = ChatAPIAgent.from_url(plain, "test-model", backoff_s=0.01, timeout_s=5.0, api_key=None, max_retries=3)
    with pytest.raises(ChatAPIError, match=r"does not speak TLS .*use http:// in --api-base"):
        agent.act_one(ctx(("user", "q")))


def test_a_certificate_the_client_does_not_trust_is_said_at_once(tmp_path):
    """A self-signed certificate (a server of your own): no retry mends it; the message says how
    to trust it."""
    import shutil
    import ssl
    import subprocess
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-keyout", str(tmp_path / "key.pem"), "-out", str(tmp_path / "cert.pem")],
                   check=True, capture_output=True)
    asked = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # never reached: the handshake fails first
            asked.append(self.path)

        def log_message(self, *args):
            pass

    connections = []

    class Counting(ThreadingHTTPServer):
        def get_request(self):
            connections.append(1)
            return super().get_request()

    httpd = Counting(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        agent = ChatAPIAgent.from_url(f"https://127.0.0.1:{httpd.server_address[1]}/v1", "test-model",
                                      backoff_s=0.01, timeout_s=5.0, api_key=None, max_retries=3)
        with pytest.raises(ChatAPIError, match=r"the server's TLS certificate is not trusted \(self.signed "
                                               r"certificate.*name the CA's certificate file in the SSL_CERT_FILE"):
            agent.act_one(ctx(("user", "q")))
        assert len(connections) == 1 and not asked  # not retried
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_compressed_error_reply_is_read_for_its_reason(server):
    import gzip

    packed = gzip.compress(json.dumps({"error": {"message": "...", "code": "context_length_exceeded"}}).encode())
    server.behaviour = lambda req, n: Response(400, packed, headers={"Content-Encoding": "gzip"})
    later = ctx(("user", "q"), ("assistant", "a"), ("user", "more"))
    with pytest.warns(UserWarning, match="outgrown the model's window"):
        assert server.agent().act_one(later).finish_reason == CONTEXT_FULL  # it stopped the run


def test_the_plain_http_hint_reads_how_other_openssl_versions_word_it():
    import ssl

    from rftgym.core.web import plain_http_answer

    def failure(library_text: str) -> ssl.SSLError:
        return ssl.SSLError(1, library_text)

    assert plain_http_answer(failure("[SSL: WRONG_VERSION_NUMBER] wrong version number (_ssl.c:1000)"))
    assert plain_http_answer(failure("[SSL] record layer failure (_ssl.c:1010)"))  # OpenSSL 3.2 on
    assert plain_http_answer(failure("[SSL: PACKET_LENGTH_TOO_LONG] packet length too long"))
    # a certificate problem, or anything not TLS, is not mended by http://
    assert not plain_http_answer(ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] wrong version number"))
    assert not plain_http_answer(ConnectionRefusedError(111, "Connection refused"))
    assert not plain_http_answer("wrong version number")
