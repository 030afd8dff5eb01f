#!/usr/bin/env python3
"""framework.hf.Trainer against transformers.Trainer on the same LoRA script
(harness/hf_script.py, the one import changed), 2 gloo ranks on this machine.

Reports, for each: the wall time of the whole command and of ``train()``, the training speed
(steps/s), and the in-place restart outcomes after a kill -9 of rank 1 at a step drawn from a fixed
seed, under ``torchrun --max-restarts 1``: finished (exit 0 with both ranks' results), bit-exact
(the trainable weights equal an uninterrupted run's), failed (non-zero exit), hung (killed at the
per-launch timeout). The script passes ``resume_from_checkpoint=None``, as most scripts do.

    python bench/hf_peer.py --kills 10 --out hf_peer.json
    python bench/hf_peer.py --peers framework.hf.Trainer --out hf_peer_dropin.json
    python bench/hf_peer.py --sft --kills 10 --max-steps 60 --out hf_peer_sft.json

``--sft``: trl.SFTTrainer against framework.hf.SFTTrainer on the Kaggle guide's script
(harness/sft_script.py: its own init_process_group, DDP wrapping, rank 0's save_pretrained):
TRL runs it with save_strategy "steps" on every rank (the guide's per-rank save_strategy hangs it
at its first save: ``--guide-as-written`` measures that once), the drop-in as written. The kill
comes mid-step (in the forward after the drawn step), and each outcome also says whether the
restarted run started over from step 0 (``resume_from_checkpoint=None``, as the guide has it).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.launch import launch  # noqa: E402

SCRIPT = ROOT / "harness" / "hf_script.py"
PEERS = {"transformers.Trainer": ["--plain"], "framework.hf.Trainer": []}
SFT_SCRIPT = ROOT / "harness" / "sft_script.py"
SFT_PEERS = {"trl.SFTTrainer": ["--plain", "--same-save-strategy"], "framework.hf.SFTTrainer": []}


def one(work: Path, name: str, flags: list[str], *, timeout: float, extra: list[str] | None = None,
        script: Path = SCRIPT) -> dict:
    run = launch(script, [str(work / name), *flags], work / name, timeout=timeout, torchrun_extra=extra)
    hung = "timed out after" in run.output
    ok = run.returncode == 0 and sorted(run.results) == [0, 1]
    return {"rc": run.returncode, "ok": ok, "hung": hung, "wall_s": round(run.duration_s, 1),
            "sha256": run.results.get(0, {}).get("sha256"), "train_s": run.results.get(0, {}).get("train_s"),
            "steps": run.results.get(0, {}).get("steps"), "restarts": run.results.get(0, {}).get("restarts"),
            "began_at": run.results.get(0, {}).get("began_at"), "tail": "" if ok else run.output[-600:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=180, help="seconds per launch before it counts as hung")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="hf_peer.json", help="a file name under bench/results/, or a path")
    parser.add_argument("--peers", nargs="+", choices=[*PEERS, *SFT_PEERS], default=None,
                        help="run only these (the ratios need both)")
    parser.add_argument("--sft", action="store_true", help="trl.SFTTrainer against framework.hf.SFTTrainer")
    parser.add_argument("--guide-as-written", action="store_true",
                        help="with --sft: also run trl on the guide's per-rank save_strategy once")
    args = parser.parse_args()
    peers, script = (SFT_PEERS, SFT_SCRIPT) if args.sft else (PEERS, SCRIPT)
    chosen = args.peers or list(peers)
    steps = ["--max-steps", str(args.max_steps)]
    kill_how = ["--kill-mid-step"] if args.sft else []
    rng = random.Random(args.seed)
    kill_steps = [rng.randint(2, args.max_steps - 2) for _ in range(args.kills)]
    report = {"max_steps": args.max_steps, "kill_steps": kill_steps, "script": str(script.relative_to(ROOT)),
              "peers": {}}
    with tempfile.TemporaryDirectory(prefix="hf-peer-") as tmp:
        work = Path(tmp)
        if args.sft and args.guide_as_written:
            as_written = one(work, "guide-as-written", ["--plain"] + steps, timeout=60, script=script)
            report["trl_guide_as_written"] = {k: as_written[k] for k in ("rc", "ok", "hung", "wall_s")}
            print(f"trl.SFTTrainer on the guide as written: {'hung' if as_written['hung'] else as_written['rc']}")
        for peer, flags in ((p, peers[p]) for p in chosen):
            ref = one(work, f"{len(report['peers'])}-ref", flags + steps, timeout=args.timeout, script=script)
            kills = []
            for i, step in enumerate(kill_steps):
                run = one(work, f"{len(report['peers'])}-kill{i}", flags + steps + kill_how + [
                          "--kill-rank", "1", "--kill-step", str(step)], timeout=args.timeout,
                          extra=["--max-restarts", "1"], script=script)
                run.update(kill_step=step, bit_exact=run["ok"] and run["sha256"] == ref["sha256"],
                           started_over=run["ok"] and run["began_at"] == 0)
                kills.append(run)
                print(f"{peer}: kill at step {step}: {'finished' if run['ok'] else 'hung' if run['hung'] else 'failed'}"
                      f"{', bit-exact' if run['bit_exact'] else ''}"
                      f"{', started over' if run['started_over'] else ''} ({run['wall_s']} s)", flush=True)
            report["peers"][peer] = {"ref": ref, "kills": kills}
    rows = []
    for peer, r in report["peers"].items():
        ref, kills = r["ref"], r["kills"]
        speed = ref["steps"] / ref["train_s"] if ref["ok"] and ref["train_s"] else float("nan")
        r["summary"] = {"wall_s": ref["wall_s"], "train_s": ref["train_s"], "steps_per_s": speed,
                        "finished": sum(k["ok"] for k in kills), "bit_exact": sum(k["bit_exact"] for k in kills),
                        "started_over": sum(k["started_over"] for k in kills),
                        "failed": sum(not k["ok"] and not k["hung"] for k in kills),
                        "hung": sum(k["hung"] for k in kills), "kills": len(kills)}
        rows.append((peer, r["summary"]))
    print(f"\n{'':24} {'wall s':>7} {'train s':>8} {'steps/s':>8} {'finished':>9} {'bit-exact':>10} "
          f"{'started over':>13} {'failed':>7} {'hung':>5}")
    for peer, s in rows:
        print(f"{peer:24} {s['wall_s']:>7.1f} {s['train_s'] or float('nan'):>8.1f} {s['steps_per_s']:>8.2f} "
              f"{s['finished']:>5}/{s['kills']:<3} {s['bit_exact']:>6}/{s['kills']:<3} "
              f"{s['started_over']:>9}/{s['kills']:<3} {s['failed']:>7} {s['hung']:>5}")
    a, b = (report["peers"].get(p, {}).get("summary") for p in peers)
    if a and b and a["steps_per_s"] and b["wall_s"]:
        report["ratios"] = {"speed_dropin_over_hf": b["steps_per_s"] / a["steps_per_s"],
                            "wall_dropin_over_hf": b["wall_s"] / a["wall_s"]}
        print(f"\ndrop-in / transformers: speed {report['ratios']['speed_dropin_over_hf']:.3f}x, "
              f"whole command {report['ratios']['wall_dropin_over_hf']:.3f}x")
    out = Path(args.out) if "/" in args.out else ROOT / "bench" / "results" / args.out
    out.write_text(json.dumps(report, indent=2))
    print(f"written: {out}")


if __name__ == "__main__":
    main()
