#!/usr/bin/env python3
"""ddp_training.py with a streaming training set: the explorer's way to select one (the CLI has no
key for it). The built-in synthetic data is read as an IterableDataset sharded by rank, with a
state (its position), so a resume continues the stream exactly.

usage: python bench/explore_stream.py [ddp_training.py flags], alone or under torchrun.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

LAUNCHER_PID = os.getppid()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from framework.config import ConfigError, parse_command_line  # noqa: E402


def stream_of(table):
    from torch.utils.data import IterableDataset

    class ShardedRows(IterableDataset):
        """Rows r, r + W, ... of ``table`` on rank r, once per pass; the state is the position."""

        def __init__(self):
            self.rank, self.world, self.pos = 0, 1, 0

        def set_shard(self, rank: int, world_size: int) -> None:
            self.rank, self.world = rank, world_size

        def __iter__(self):
            mine = range(self.rank, len(table), self.world)
            while self.pos < len(mine):
                self.pos += 1
                yield table[mine[self.pos - 1]]
            self.pos = 0  # the next pass (epoch) starts from the beginning

        def state_dict(self) -> dict:
            return {"pos": self.pos}

        def load_state_dict(self, state: dict) -> None:
            self.pos = int(state["pos"])

    return ShardedRows()


def main(argv: list[str]) -> int:
    try:
        config, _ = parse_command_line(argv)
    except ConfigError as err:
        for problem in err.problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    from framework.ddp import process_group as distributed
    from framework.state.checkpoint_files import CheckpointDirLocked
    from framework.data.datasets import builtin_datasets
    from framework.trainer import DDPTrainer, FatalError

    try:
        config, train, val = builtin_datasets(config)
        DDPTrainer(config, train_dataset=stream_of(train), val_dataset=val).train()
    except CheckpointDirLocked as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except FatalError as err:
        print(f"fatal: {err}", file=sys.stderr)
        return 1
    finally:
        distributed.teardown()
    return 0


if __name__ == "__main__":
    if "TORCHELASTIC_RUN_ID" in os.environ:
        from framework.ddp.process_group import die_with_parent
        die_with_parent(LAUNCHER_PID)
    code = main(sys.argv[1:])
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
