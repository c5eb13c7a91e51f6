"""The built-in model family ("zoo"): a tokenizer and a Llama target /
qualifier / draft trained locally on the Python standard library, saved as
ordinary Hugging Face checkpoints (see DESIGN §7).

Public API::

    zoo_root()                       -> Path   ($SAGUARO_ZOO_DIR or ~/.cache/saguaro-ray/zoo)
    build_family(preset, out=None, progress=True) -> dict   (also DIR/zoo.json)
    format_summary(summary)          -> str
    heldout_texts(max_files=None)    -> list[str]  (prompts never seen in training)
"""

from saguaro_ray.zoo.build import build_family, format_summary, zoo_root
from saguaro_ray.zoo.corpus import heldout_texts
from saguaro_ray.zoo.presets import PRESETS, ROLES
from saguaro_ray.zoo.recipe import BUILD_VERSION

__all__ = [
    "BUILD_VERSION",
    "PRESETS",
    "ROLES",
    "build_family",
    "format_summary",
    "heldout_texts",
    "zoo_root",
]
