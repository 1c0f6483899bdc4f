"""The Ray Serve application: `serve run tailrace.ray:build model=DIR num_replicas=2 threads=1`.

Two deployments. `TailraceIngress` is the FastAPI app of `tailrace serve` (`build_app`, under
`@serve.ingress`) behind Ray Serve's HTTP proxy; it tokenizes and frames, as the API process does.
`TailraceEngine` has the replicas, each with its own engine core; the ingress reaches them through a
handle whose request router (`request_router=prefix`, the default) sends a prompt to the replica
that holds its prefix. Ray Serve's proxy cannot route by prompt itself: it forwards the HTTP body
only once a replica has been chosen, which is why the engine sits behind a second deployment.

Arguments are `key=value` pairs: every `tailrace serve` flag without its dashes (`max-num-seqs=32`,
`tensor-parallel-size=2`; `enforce-eager=true` for a flag without a value), and for Ray:
`num_replicas` (default 1), `autoscaling_config` (JSON, replaces num_replicas), `max_ongoing_requests`
(per engine replica; default max-num-seqs + max-waiting-seqs), `request_router` (prefix or pow2, Ray's
default) and `max_imbalance` (queued requests beyond the least-loaded replica's at which the prefix
router gives up on the prefix; default 8).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from tailrace.api.app import build_app
from tailrace.cli import build_parser, server_setup
from tailrace.engine.config import EngineConfig
from tailrace.ray.prefix import DEFAULT_MAX_IMBALANCE
from tailrace.ray.remote_engine import RemoteEngine
from tailrace.ray.replica import EngineReplica

ROUTERS = {"prefix": "tailrace.ray.router:PrefixAwareRouter",
           "pow2": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"}


@dataclass(slots=True)
class RayOptions:
    num_replicas: int = 1
    autoscaling_config: dict[str, Any] | None = None
    max_ongoing_requests: int | None = None
    request_router: str = "prefix"
    max_imbalance: int = DEFAULT_MAX_IMBALANCE

    @property
    def most_replicas(self) -> int:
        if self.autoscaling_config is None:
            return self.num_replicas
        return int(self.autoscaling_config.get("max_replicas", 1))


def build(args: dict[str, Any]) -> serve.Application:
    """The application `serve run tailrace.ray:build KEY=VALUE...` runs."""
    ray_options, argv = split_args(args)
    serve_args = parse_serve_args(argv)
    setup = server_setup(serve_args)  # fails here, before Ray starts anything, on a bad flag or model
    engine = engine_deployment(setup.engine, serve_args, ray_options)
    capacity = setup.server.limits.max_num_seqs * ray_options.most_replicas + setup.server.limits.max_waiting_seqs
    ingress = serve.deployment(TailraceIngress, name="TailraceIngress", max_ongoing_requests=capacity,
                               ray_actor_options={"num_cpus": 0})
    return ingress.bind(engine.bind(setup.engine), argv, ray_options.most_replicas)


def split_args(args: dict[str, Any]) -> tuple[RayOptions, list[str]]:
    """Ray's options, and the rest as `tailrace serve` flags."""
    options = RayOptions()
    argv: list[str] = []
    for key, value in args.items():
        name = key.replace("-", "_")
        if name == "autoscaling_config":
            options.autoscaling_config = json.loads(value) if isinstance(value, str) else dict(value)
        elif name == "request_router":
            if value not in ROUTERS:
                raise ValueError(f"request_router={value}: choose one of {', '.join(ROUTERS)}")
            options.request_router = value
        elif name in ("num_replicas", "max_ongoing_requests", "max_imbalance"):
            setattr(options, name, int(value))
        else:
            argv += _flag(key.replace("_", "-"), value)
    return options, argv


def _flag(name: str, value: Any) -> list[str]:
    if value is True or str(value).lower() == "true":
        return [f"--{name}"]
    if isinstance(value, (list, tuple)):
        return [f"--{name}", *map(str, value)]
    return [f"--{name}", str(value)]


def parse_serve_args(argv: list[str]) -> argparse.Namespace:
    try:
        return build_parser().parse_args(["serve", *argv])
    except SystemExit:  # argparse printed the reason
        raise ValueError(f"these are not `tailrace serve` flags: {' '.join(argv)}") from None


def engine_deployment(config: EngineConfig, serve_args: argparse.Namespace, options: RayOptions) -> serve.Deployment:
    """Each replica's resources as one placement-group bundle: its tensor-parallel ranks are child
    processes of the replica's engine core, so they must share its node, and on GPUs its
    CUDA_VISIBLE_DEVICES must list every rank's device."""
    ranks = serve_args.tensor_parallel_size
    bundle = {"CPU": float((config.threads or 1) * ranks)}
    if config.device.startswith("cuda"):
        bundle["GPU"] = float(ranks)
    scaling: dict[str, Any] = ({"num_replicas": options.num_replicas} if options.autoscaling_config is None
                               else {"autoscaling_config": options.autoscaling_config})
    router_kwargs = {"block_size": config.block_size, "max_imbalance": options.max_imbalance}
    return serve.deployment(
        EngineReplica, name="TailraceEngine", **scaling,
        max_ongoing_requests=options.max_ongoing_requests or config.max_num_seqs + serve_args.max_waiting_seqs,
        ray_actor_options={"num_cpus": bundle["CPU"], "num_gpus": bundle.get("GPU", 0)},
        placement_group_bundles=[bundle], placement_group_strategy="STRICT_PACK",
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTERS[options.request_router],
            request_router_kwargs=router_kwargs if options.request_router == "prefix" else {}))


@serve.ingress()
class TailraceIngress:
    """The `tailrace serve` app over the engine replicas. Its admission queue holds as many
    sequences as all replicas run at once, plus the waiting room."""

    async def __init__(self, replicas: DeploymentHandle, argv: list[str], most_replicas: int) -> None:
        setup = server_setup(parse_serve_args(argv))
        limits = setup.server.limits
        self._config = dataclasses.replace(
            setup.server, limits=dataclasses.replace(limits, max_num_seqs=limits.max_num_seqs * most_replicas))
        self._engine = RemoteEngine(replicas, setup.engine.model_path, setup.tokenizer)
        await self._engine.launch()

    def __serve_build_asgi_app__(self) -> Any:
        return build_app(self._engine, self._config)
