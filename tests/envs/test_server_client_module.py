"""The retrieval client in its own module: envs holding one copy and pickle, and the names that
imported from the server module still do. On 127.0.0.1 only."""

from __future__ import annotations

import copy
import pickle
import threading

import pytest

from rftgym.envs.search import client
from rftgym.envs.search.env import SearchEvalQAEnv
from rftgym.envs.search.retrievers import BM25Retriever
from rftgym.envs.search.server import make_server
from rftgym.envs.search.world import World


@pytest.fixture(scope="module")
def world_service():
    server = make_server(BM25Retriever(World(0).documents), host="127.0.0.1", port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def test_an_env_with_a_remote_retriever_pickles_and_its_copy_searches_the_service(world_service):
    env = SearchEvalQAEnv(retriever="remote", retriever_url=world_service.url)
    env.reset(seed=0, options={"hops": 1})
    title = env.question.gold_titles[0]
    moved = pickle.loads(pickle.dumps(env))
    assert type(moved.retriever) is client.RemoteRetriever and moved.retriever.url == world_service.url
    branch = copy.deepcopy(env)
    ours, theirs, branched = (e.step(f"<search>{title}</search>") for e in (env, moved, branch))
    assert ours[4]["doc_ids"] == theirs[4]["doc_ids"] == branched[4]["doc_ids"] and ours[4]["doc_ids"]
    for each in (env, moved, branch):
        each.close()


def test_the_client_names_still_import_from_the_server_module():
    from rftgym.envs.search.server import RemoteRetriever, RetrievalServiceError, check_service_url

    assert RemoteRetriever is client.RemoteRetriever and RetrievalServiceError is client.RetrievalServiceError
    assert check_service_url is client.check_service_url
