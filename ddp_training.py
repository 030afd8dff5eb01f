#!/usr/bin/env python3
"""Entry point: ``python ddp_training.py [--config FILE] [--key value ...]``, alone or under torchrun.

Exit codes: 0 done (or preempted and saved), 2 bad configuration (before any process group starts)
or a checkpoint.dir that another run is using, 75 a node of the run is lost (a torchrun agent died,
or a peer process went away in a collective; a restart or relaunch continues from the newest
checkpoint), 1 anything else (a FATAL marker says when a restart cannot help).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import traceback

# The parent (the agent under torchrun), read before the next import loads torch (seconds): see
# framework.ddp.process_group.die_with_parent.
LAUNCHER_PID = os.getppid()

from framework.config import ConfigError, help_text, parse_command_line  # noqa: E402

USAGE = """usage: ddp_training.py [--config FILE.toml|FILE.json] [--SECTION.KEY VALUE ...] [--check-config] [--debug]

Every configuration key is a flag --section.key (dashes or underscores). Booleans take a value:
--precision.autocast false. Sources, lowest to highest: defaults, --config file ([section] tables),
DDP_<SECTION>__<KEY> environment variables, flags. The flat keys of before sections (--use-amp,
DDP_USE_AMP, use_amp = ...) still work, each with a deprecation note naming its new key.

actions:
  --check-config   validate the configuration and exit (0 valid, 2 invalid); starts nothing
  --doctor         run only the DDP preflight on every rank, print its report; exit 0 when training
                   would be safe, 1 when it would fail
  --debug          DEBUG logging and faulthandler tracebacks
  -h, --help       this help

keys:
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        config, actions = parse_command_line(argv)
    except ConfigError as err:
        for problem in err.problems:
            print(f"error: {problem}", file=sys.stderr)
        raise SystemExit(2) from None
    if "help" in actions:
        print(USAGE + help_text())
        return 0
    if "check-config" in actions:
        print("configuration is valid", file=sys.stderr)
        print(config.checkpoint.dir)  # read by launch_training.sh to find this run's PREEMPTED marker
        return 0

    from framework.ddp import process_group
    from framework.ddp.membership import RunFinished
    from framework.resilience import markers
    from framework.state.checkpoint_files import CheckpointDirLocked
    from framework.ddp.policy import format_report
    from framework.trainer import DDPTrainer, FatalError

    try:
        if "doctor" in actions:
            trainer = DDPTrainer(config, debug="debug" in actions, doctor=True)
            trainer.close()
            if trainer.env.is_main:
                print(format_report(trainer.report, trainer.decision))
            return 0 if trainer.decision.safe else 1
        DDPTrainer(config, debug="debug" in actions).train()
    except CheckpointDirLocked as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except FatalError as err:
        # Already logged with its marker; one line, no traceback: a restart would not help.
        print(f"fatal: {err}", file=sys.stderr)
        return 1
    except RunFinished as err:
        print(str(err), file=sys.stderr)
        return 0
    except process_group.PeerLost as err:
        print(f"error: {err}", file=sys.stderr)
        return process_group.EXIT_PEER_LOST
    except Exception as err:
        if not markers.peer_lost(err):
            raise
        # Not this process's fault: its peer's error (in that peer's log) is the cause.
        logging.getLogger("ddp_training").error("a peer process went away", exc_info=True)
        message = f"a peer process of the run went away ({type(err).__name__}: {(str(err).splitlines() or [''])[0]})"
        try:  # for launch_training.sh, which exits 75 on it
            markers.write(config.checkpoint.dir, markers.NODE_LOST, message)
        except OSError as write_err:
            print(f"error: could not write {markers.NODE_LOST}: {write_err}", file=sys.stderr)
        print(f"error: {message}; exiting with {process_group.EXIT_PEER_LOST}", file=sys.stderr)
        return process_group.EXIT_PEER_LOST
    finally:
        process_group.teardown()
    return 0


def cli() -> None:
    """The ``ddp-train`` console script, and ``python ddp_training.py``; never returns."""
    faulthandler.enable()  # a fatal signal (SIGSEGV, SIGABRT from C++) prints every thread's stack
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker (--check-config and --help import no torch)
        from framework.ddp.process_group import die_with_parent
        die_with_parent(LAUNCHER_PID)
    try:
        code = main()
    except BaseException:
        collectives = sys.modules.get("framework.ddp.collectives")
        if collectives is None or not collectives.PARKED:
            raise
        traceback.print_exc()  # then end without freeing the parked groups (see exit_if_parked)
        code = 1
    if "framework.ddp.collectives" in sys.modules:
        from framework.ddp.collectives import exit_if_parked
        exit_if_parked(code)
    raise SystemExit(code)


if __name__ == "__main__":
    cli()
