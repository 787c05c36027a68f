"""Sequence packing: several training samples per row, so the update computes no padding.

A step's samples differ widely in length (a short answer beside a long multi-turn episode; DCPO
and PCAR segments), and :func:`~rftgym.train.batching.collate` pads every row to the longest, so
the forward and backward passes spend much of their work on padding. :func:`collate_packed`
instead places samples one after another in rows (first-fit decreasing), with position ids that
restart at 0 at each sample. Hugging Face decoders read such position ids as packed sequences
and attend only within each one (``transformers.masking_utils``); training checks that once per
run (:func:`rftgym.train.model_setup.check_packed_attention`) and refuses packing for a model that does not.

Per row, position ``p`` predicts token ``p + 1``, as in ``collate``; the last position of each
sample would predict the next sample's first token, so it is masked. ``sequence_ids`` names the
sample at each position (-1 on padding), for the aggregation that averages per sequence.
"""

from __future__ import annotations

import torch

from .batching import TrainSample, empty_rows, place_sample, trained_index


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
    tensors = empty_rows(len(layout), width, pad_id)
    positions = torch.zeros((len(layout), width), dtype=torch.long)
    sequence_ids = torch.full((len(layout), width - 1), -1, dtype=torch.long)
    for row, members in enumerate(layout):
        start = 0
        for index in members:
            n = len(samples[index].token_ids)
            # The sample's last position would predict the next sample's first token: masked.
            sequence_ids[row, place_sample(tensors, row, start, samples[index])] = index
            positions[row, start:start + n] = torch.arange(n)
            start += n
        if start < width:  # padding continues the last sample's positions
            last = int(positions[row, start - 1])
            positions[row, start:] = torch.arange(last + 1, last + 1 + width - start)
    return {**tensors, "position_ids": positions, "targets": tensors["input_ids"][:, 1:].contiguous(),
            "sequence_ids": sequence_ids, "trained_index": trained_index(tensors["loss_mask"])}
