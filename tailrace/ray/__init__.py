"""tailrace under Ray Serve (`pip install tailrace[ray]`): N engine replicas behind the OpenAI routes,
with prefix-aware routing between them.

    serve run tailrace.ray:app                                  # the embedded model, one replica
    serve run tailrace.ray:build model=DIR num_replicas=2 threads=1

`build` takes the flags of `tailrace serve` as key=value (see tailrace/ray/deployment.py). The names
resolve on first use, so `tailrace.ray.prefix`, which has no Ray in it, imports without Ray.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "build":
        from tailrace.ray.deployment import build

        return build
    if name == "app":
        from tailrace.ray.deployment import build

        return build({})
    raise AttributeError(f"module 'tailrace.ray' has no attribute {name!r}")
