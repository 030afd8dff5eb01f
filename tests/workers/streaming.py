"""Run under torchrun with 2 ranks: the built-in GPT trained from an IterableDataset with a state.
Each rank writes the sample ids its dataset committed, and rank 0 the summary, to
RUN_DIR/result_rank{r}.json.

usage: torchrun ... tests/workers/streaming.py RUN_DIR FAULT_SPEC ROWS_ON_RANK_1
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import IterableDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from framework import DDPTrainer  # noqa: E402
from framework.data.datasets import MarkovDataset  # noqa: E402


class ShardedRows(IterableDataset):
    """Rows of a fixed table; rank r reads rows r, r + W, ... (the first ``limit`` of them). Its
    state is its position and the ids it has read, so a restored state also restores the record."""

    def __init__(self, table: MarkovDataset, limits: dict[int, int]):
        self.table, self.limits = table, limits
        self.rank, self.world = 0, 1
        self.pos, self.ids = 0, []

    def set_shard(self, rank: int, world_size: int) -> None:
        self.rank, self.world = rank, world_size

    def __iter__(self):
        mine = list(range(self.rank, len(self.table), self.world))[:self.limits.get(self.rank)]
        while self.pos < len(mine):
            i = mine[self.pos]
            self.pos += 1
            self.ids.append(i)
            yield self.table[i]

    def state_dict(self) -> dict:
        return {"pos": self.pos, "ids": list(self.ids)}

    def load_state_dict(self, state: dict) -> None:
        self.pos, self.ids = int(state["pos"]), [int(i) for i in state["ids"]]


def main(run_dir: Path, fault: str, rows_on_rank_1: int) -> None:
    rank = int(os.environ["RANK"])
    data = ShardedRows(MarkovDataset(32, 16, 96, chain_seed=3, sample_seed=1), {1: rows_on_rank_1})
    cfg = {"vocab_size": 32, "hidden_size": 32, "num_layers": 2, "num_heads": 2, "seq_len": 16, "batch_size": 4,
           "dropout": 0.0, "train.max_steps": 1000, "num_epochs": 1, "checkpoint.every_steps": 4, "log_interval": 1,
           "eval.interval": 0, "logging.tensorboard": False, "target_loss": 0.0, "train.deterministic": True,
           "train.seed": 3, "recovery.fault_inject": fault, "learning_rate": 2e-3,
           "logging.dir": str(run_dir / "logs"), "checkpoint.dir": str(run_dir / "ck")}
    summary = DDPTrainer(cfg, train_dataset=data, val_dataset=None).train()
    (run_dir / f"result_rank{rank}.json").write_text(json.dumps({"ids": data.ids, "summary": summary}))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
    sys.stdout.flush()
    os._exit(0)
