"""Entry points for ``ray job submit -- python -m saguaro_ray.jobs.<name> ...``."""
