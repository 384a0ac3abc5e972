"""`python -m train CONFIG [section.key=value ...]`: train (or resume) as configured."""

from __future__ import annotations

import argparse
import logging
import sys

from parallel.mesh import MeshError
from train.config import ConfigError, load_config
from train.errors import NonFiniteLoss


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train", description=__doc__)
    parser.add_argument("config", help="YAML run config, e.g. configs/tiny.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100 data.seq_len=512")
    parser.add_argument("--distributed", action="store_true",
                        help="multi-host: call jax.distributed.initialize() (cluster found from SLURM, Open MPI, "
                             "TPU or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("absl", "jax", "orbax", "grain"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        config = load_config(args.config, args.overrides)
        import jax

        from train.loop import run

        if args.distributed:
            jax.distributed.initialize()
        run(config)
    except (ConfigError, MeshError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except NonFiniteLoss as error:
        print(f"error: {error}", file=sys.stderr)
        return 3
    except ValueError as error:
        if "empty corpus" not in str(error):
            raise
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
