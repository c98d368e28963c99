"""Data-parallel engine replicas on Ray: `ContbatchPredictor` for `ray.data.Dataset.map_batches`, and
`run_ray_job`, the driver of `contbatch generate --ray` (same output, resume and error rules as one process).
Needs the `ray` extra."""

from contbatch.integrations.ray.driver import RayJobOptions, run_ray_job
from contbatch.integrations.ray.replica import ContbatchPredictor

__all__ = ["ContbatchPredictor", "RayJobOptions", "run_ray_job"]
