"""``python -m saguaro_ray.jobs.bench ...`` — the benchmark as a Ray job (same flags as ``saguaro-ray bench``)."""

import sys

from saguaro_ray.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
