"""Dataset-backed training goes through the dataset in epochs (each item once per epoch, in a
shuffled order), where it drew items with replacement; a generator keeps random seeds."""

from __future__ import annotations

from collections import Counter

import pytest
from support import SayAEnv, train_config

from rftgym.train.loop import train
from rftgym.train.task_order import epoch_task_seeds, served_dataset_size


def test_each_epoch_visits_every_item_once_in_its_own_order():
    seeds = epoch_task_seeds(seed=7, size=5, first=0, count=15)
    epochs = [seeds[i:i + 5] for i in range(0, 15, 5)]
    assert [sorted(s % 5 for s in epoch) for epoch in epochs] == [[0, 1, 2, 3, 4]] * 3
    assert [min(epoch) // 5 for epoch in epochs] == [0, 1, 2]   # item + epoch * size: new episodes each epoch
    assert len({tuple(s % 5 for s in epoch) for epoch in epochs}) > 1   # reshuffled
    # Any stretch of the run is drawn the same, whoever asks for it (a resumed run, a step at a time).
    assert epoch_task_seeds(7, 5, 3, 4) == seeds[3:7]
    assert epoch_task_seeds(8, 5, 0, 5) != seeds[:5]


class DatasetEnv(SayAEnv):
    """SayAEnv over a 5-item 'dataset' served by seed, recording the items it serves."""

    SIZE, served = 5, []

    @property
    def eval_episodes(self):
        return self.SIZE

    def reset(self, *, seed=None, options=None):
        DatasetEnv.served.append(seed % self.SIZE)
        return super().reset(seed=seed, options=options)


def test_training_on_a_dataset_serves_each_item_once_per_epoch(tmp_path, make_char_policy, capsys):
    DatasetEnv.served = []
    # 5 steps of 2 tasks over 5 items: 2 epochs; each task is reset group_size (8) times.
    rows = train(train_config(tmp_path, "run", steps=5, tasks_per_step=2), policy=make_char_policy(),
                 make_env=DatasetEnv)
    assert Counter(DatasetEnv.served) == {item: 2 * 8 for item in range(5)}   # twice each, not by chance
    steps = [Counter(DatasetEnv.served[i:i + 16]) for i in range(0, 80, 16)]
    first_epoch = steps[0] + steps[1] + Counter({item: 8 for item in steps[2] if steps[2][item] and
                                                 (steps[0] + steps[1])[item] == 0})
    assert first_epoch == {item: 8 for item in range(5)}   # steps 1, 2 and half of 3: all five items
    assert [row["epoch"] for row in rows] == pytest.approx([0.4, 0.8, 1.2, 1.6, 2.0])
    assert "tasks: the env's 5 dataset items, each once per epoch in a shuffled order (2 epochs in 5 steps of 2)" \
        in capsys.readouterr().err


class SeedRecordingDatasetEnv(DatasetEnv):
    seeds = []

    def reset(self, *, seed=None, options=None):
        SeedRecordingDatasetEnv.seeds.append(seed)
        return super().reset(seed=seed, options=options)


def test_the_refill_takes_the_next_items_of_the_epoch_order_and_a_resume_goes_on_from_there(tmp_path,
                                                                                              make_char_policy):
    refill = dict(group_size=2, tasks_per_step=2, max_rollout_batches=3)
    SeedRecordingDatasetEnv.seeds = []
    rows = train(train_config(tmp_path, "straight", steps=4, save_every=2, **refill), policy=make_char_policy(),
                 make_env=SeedRecordingDatasetEnv)
    drawn = 2 * sum(row["rollout_batches"] for row in rows)
    assert drawn > 8, rows  # some step refilled
    # The tasks in the order they were drawn: each rollout's tasks are the next items of the run's order.
    assert list(dict.fromkeys(SeedRecordingDatasetEnv.seeds)) == epoch_task_seeds(0, 5, 0, drawn)
    assert rows[-1]["epoch"] == pytest.approx(drawn / 5)
    train(train_config(tmp_path, "resumed", steps=2, **refill), policy=make_char_policy(),
          make_env=SeedRecordingDatasetEnv)
    SeedRecordingDatasetEnv.seeds = []
    resumed = train(train_config(tmp_path, "resumed", steps=4, **refill), policy=make_char_policy(),
                    make_env=SeedRecordingDatasetEnv, resume=True)
    assert [row["epoch"] for row in resumed] == [row["epoch"] for row in rows[2:]]
    before, after = (2 * sum(row["rollout_batches"] for row in part) for part in (rows[:2], rows[2:]))
    assert list(dict.fromkeys(SeedRecordingDatasetEnv.seeds)) == epoch_task_seeds(0, 5, before, after)


def test_an_env_without_a_dataset_keeps_random_task_seeds(tmp_path, make_char_policy):
    assert served_dataset_size(SayAEnv) is None
    rows = train(train_config(tmp_path, "run", steps=1), policy=make_char_policy(), make_env=SayAEnv)
    assert "epoch" not in rows[0]
