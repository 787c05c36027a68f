"""Sequence packing: several training samples per row, so the update computes no padding.

A step's samples differ widely in length (a short answer beside a long multi-turn episode; DCPO
and PCAR segments), and :func:`~rftgym.train.batching.collate` pads every row to the longest, so
the forward and backward passes spend much of their work on padding. :func:`collate_packed`
instead places samples one after another in rows (first-fit decreasing), with position ids that
restart at 0 at each sample. Hugging Face decoders read such position ids as packed sequences
and attend only within each one (``transformers.masking_utils``); training checks that once per
run (:func:`rftgym.train.loop.check_packed_attention`) and refuses packing for a model that does not.

Per row, position ``p`` predicts token ``p + 1``, as in ``collate``; the last position of each
sample would predict the next sample's first token, so it is masked. ``sequence_ids`` names the
sample at each position (-1 on padding), for the aggregation that averages per sequence.
"""

from __future__ import annotations

import torch

from .batching import TrainSample, trained_index


def pack_rows(lengths: list[int], row_length: int) -> list[list[int]]:
    """Sample indices per row, first-fit decreasing: each sample, longest first, goes into the
    first row with room for it, else into a new row. Every ``length <= row_length``."""
    too_long = [n for n in lengths if n > row_length]
    if too_long:
        raise ValueError(f"a sample of {max(too_long)} tokens does not fit a row of {row_length}")
    rows: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        row = next((r for r, free in enumerate(room) if free >= lengths[index]), None)
        if row is None:
            rows.append([])
            room.append(row_length)
            row = len(rows) - 1
        rows[row].append(index)
        room[row] -= lengths[index]
    return rows


def collate_packed(samples: list[TrainSample], pad_id: int, row_length: int | None = None) -> dict[str, torch.Tensor]:
    """``samples`` packed into rows of ``row_length`` tokens (default: the longest sample's).

    Returns ``input_ids`` and ``position_ids`` ``[rows, L]``; ``targets``, ``loss_mask``,
    ``old_logprobs``, ``advantages`` and ``sequence_ids`` ``[rows, L - 1]`` (as ``collate``'s, plus
    the index in ``samples`` of the sample each position belongs to, -1 on padding) and
    ``trained_index`` (:func:`~rftgym.train.batching.trained_index`). Padding
    after a row's last sample continues its positions, so it joins that sample's block, after it,
    where causal attention keeps it from every real token.
    """
    width = row_length or max(len(s.token_ids) for s in samples)
    layout = pack_rows([len(s.token_ids) for s in samples], width)
    rows = len(layout)
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    positions = torch.zeros((rows, width), dtype=torch.long)
    mask = torch.zeros((rows, width - 1))
    old = torch.zeros((rows, width - 1))
    adv = torch.zeros((rows, width - 1))
    sequence_ids = torch.full((rows, width - 1), -1, dtype=torch.long)
    for row, members in enumerate(layout):
        start = 0
        for index in members:
            s = samples[index]
            n = len(s.token_ids)
            input_ids[row, start:start + n] = torch.tensor(s.token_ids)
            positions[row, start:start + n] = torch.arange(n)
            # Positions start .. start+n-2 predict this sample's tokens 1..n-1; start+n-1 would
            # predict the next sample's first token and stays masked.
            span = slice(start, start + n - 1)
            mask[row, span] = torch.tensor(s.loss_mask[1:], dtype=torch.float32)
            old[row, span] = torch.tensor(s.old_logprobs[1:], dtype=torch.float32)
            adv[row, span] = torch.tensor(s.advantages[1:], dtype=torch.float32)
            sequence_ids[row, span] = index
            start += n
        if start < width:  # padding continues the last sample's positions
            last = int(positions[row, start - 1])
            positions[row, start:] = torch.arange(last + 1, last + 1 + width - start)
    return {"input_ids": input_ids, "position_ids": positions, "targets": input_ids[:, 1:], "loss_mask": mask,
            "old_logprobs": old, "advantages": adv, "sequence_ids": sequence_ids,
            "trained_index": trained_index(mask)}
