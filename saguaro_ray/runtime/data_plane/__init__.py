"""The data plane (being split into one module per concept; see ``group``)."""

from saguaro_ray.runtime.data_plane.group import *  # noqa: F403
from saguaro_ray.runtime.data_plane.group import __all__  # noqa: F401
