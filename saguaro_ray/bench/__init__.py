"""Side-by-side benchmarks: every mode on the same models, prompts and machine.

One module per part: :mod:`~saguaro_ray.bench.run` runs the engines
interleaved and collects their timelines, :mod:`~saguaro_ray.bench.report`
summarises the runs into the report's entries and its table,
:mod:`~saguaro_ray.bench.machine` measures the machine they ran on,
:mod:`~saguaro_ray.bench.peers` runs transformers' own decoding beside ours,
and :mod:`~saguaro_ray.bench.plot` draws the report (an optional extra).
"""

from saguaro_ray.bench.machine import step_costs  # jobs/gpu_check imports it from here

__all__ = ["step_costs"]
