#!/usr/bin/env python3
"""Tokenise once: a restart's start-up against the first start, on a 100k-row text dataset.

framework.hf.SFTTrainer has the global rank 0 prepare the data with TRL's own code and save it
under ``output_dir/prepared/<key>``; every other rank, and every restart, loads it. This measures,
in one process, the trainer's construction (the data preparation is nearly all of it):

- ``first``: framework.hf.SFTTrainer in a fresh output_dir (TRL prepares, the result is saved);
- ``restart``: framework.hf.SFTTrainer again on the same output_dir (the prepared data is loaded);
- ``trl``: trl.SFTTrainer (it prepares at every start, on every rank).

    python bench/sft_prepare.py --rows 100000 --out sft_prepare.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--out", default="sft_prepare.json", help="a file name under bench/results/, or a path")
    args = parser.parse_args()

    from trl import SFTTrainer as TRLTrainer

    from framework.hf import SFTConfig, SFTTrainer
    from harness.sft_script import build_model, build_tokenizer, dataset

    tokenizer = build_tokenizer()
    data = dataset("text", args.rows)
    report: dict = {"rows": args.rows}
    with tempfile.TemporaryDirectory(prefix="sft-prepare-") as tmp:
        def config(out: str) -> SFTConfig:
            return SFTConfig(output_dir=out, per_device_train_batch_size=8, max_steps=1, max_length=128,
                             report_to="none", use_cpu=True, bf16=False, disable_tqdm=True, save_strategy="no")

        for name, cls, out in (("first", SFTTrainer, f"{tmp}/run"), ("restart", SFTTrainer, f"{tmp}/run"),
                               ("trl", TRLTrainer, f"{tmp}/trl")):
            start = time.perf_counter()
            trainer = cls(model=build_model(tokenizer), args=config(out), train_dataset=data,
                          processing_class=tokenizer)
            report[f"{name}_s"] = round(time.perf_counter() - start, 2)
            if name != "trl":
                report[f"{name}_tokenised"] = trainer.tokenised_here
            print(f"{name}: {report[f'{name}_s']} s", flush=True)
    report["restart_over_first"] = round(report["restart_s"] / report["first_s"], 3)
    report["restart_over_trl"] = round(report["restart_s"] / report["trl_s"], 3)
    print(json.dumps(report, indent=2))
    out = Path(args.out) if "/" in args.out else ROOT / "bench" / "results" / args.out
    out.write_text(json.dumps(report, indent=2))
    print(f"written: {out}")


if __name__ == "__main__":
    main()
