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
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("absl", "jax", "orbax", "grain"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        config = load_config(args.config, args.overrides)
        from train.loop import run  # JAX is imported only after the config is valid

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
