import sys

from saguaro_ray.cli import main

sys.exit(main())
