"""Train from a YAML config, in one process or as a torchrun job (one process per GPU).

    torchrun --standalone --nproc_per_node=2 examples/train_ppo.py --config configs/ppo_torchrun.yaml
    python examples/train_ppo.py --config configs/ppo_reverse.yaml steps=5    # the config's executor

Under torchrun every rank joins the process group; rank 0 runs the usual ``train()`` with
``executor.name=torchrun`` (the same Controller and Plan as the local and Ray paths) and the other ranks
serve their plan group's worker until rank 0 is done. Any algorithm works; PPO is the example.
See docs/torchrun.md.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hybridflow.runtime.torchrun_protocol import DEFAULT_TIMEOUT_S, under_torchrun


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a YAML config (see configs/); keys map onto TrainConfig")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides, values parsed as YAML")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")
    parser.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S,
                        help="torchrun only: how long rank 0 waits for a rank's reply (and ranks for each other "
                             "in a gradient all-reduce) before failing; longer than your slowest node")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    from hybridflow.cli.train import run

    args = parse_args(argv)
    if not under_torchrun():
        return run(args)
    import torch.distributed as dist

    from hybridflow.cli.errors import TERMINATED, describe
    from hybridflow.runtime.torchrun_executor import serve, stop_serving
    from hybridflow.runtime.torchrun_protocol import init_world
    from hybridflow.train.signals import sigterm_deferred

    world = init_world(timeout_s=args.timeout_s)
    if world.rank != 0:
        with sigterm_deferred() as terminated:  # rank 0 got it too: it stops the run and then tells us to leave
            serve(world)
        dist.destroy_process_group()
        return TERMINATED if terminated else 0
    try:
        code = run(argparse.Namespace(**{**vars(args), "overrides": [*args.overrides, "executor.name=torchrun"]}))
    except KeyboardInterrupt as err:  # Ctrl-C or SIGTERM (torchrun forwards it): one line, as `hybridflow train`
        code, line = describe(err)
        print(f"hybridflow train (torchrun rank 0): error: {line}", file=sys.stderr)
    finally:
        stop_serving(world)  # on failure too, so serving ranks exit instead of waiting for the idle timeout
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
