"""``rftgym serve-retriever``: a corpus index served over HTTP (Search-R1's /retrieve shape)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .common import UsageError


def cmd_serve_retriever(args: argparse.Namespace) -> int:
    from ..envs.search.server import serve

    if (args.corpus is None) == (args.world_seed is None):
        raise UsageError("give --corpus FILE (a corpus file) or --world-seed N (the generated world of an env without "
                         "dataset_path, as its world_seed and world_size make it), one of them")
    if args.world_size is not None and args.world_seed is None:
        raise UsageError("--world-size goes with --world-seed (it sizes the generated world)")
    if args.corpus is not None and not Path(args.corpus).is_file():
        raise UsageError(f"--corpus {args.corpus!r} is not a file; give a corpus in one of the supported formats "
                         "(HotpotQA JSON, {title: [sentences]} JSON, [{title, text}] JSON, FlashRAG {id, contents} JSONL)")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in 0-65535, got {args.port}")
    if args.max_connections < 1:
        raise UsageError(f"--max-connections must be >= 1 (connections handled at once), got {args.max_connections}")
    if args.world_seed is not None:
        from ..envs.search.env import SearchEvalQAConfig
        from ..envs.search.world import MAX_PEOPLE, World

        size = SearchEvalQAConfig.world_size if args.world_size is None else args.world_size
        if args.world_seed < 0:
            raise UsageError(f"--world-seed must be >= 0 (the env's world_seed), got {args.world_seed}")
        if not 2 <= size <= MAX_PEOPLE:
            raise UsageError(f"--world-size must be in [2, {MAX_PEOPLE}] (the env's world_size), got {size}")
        corpus = lambda: World(args.world_seed, size).documents  # noqa: E731
    else:
        corpus = args.corpus
    # a bad --host or a busy --port: ConfigError, before indexing
    serve(corpus, args.index, args.host, args.port, max_connections=args.max_connections)
    return 0
