"""A whole migration on one machine: layered stack, spine, front, controller.

The layered stack runs every component in its own process. The spine shares those
processes for whatever it has not collapsed yet (so a remote placement in the spine is
the very process the layered side uses), and builds local copies for what it has. The
front splits traffic by the controller's weight; the controller reads the front's
windows and moves placements in the spine without a restart: directly when the spine is a
`Stack` in this process (tests reach into it), over ADS when it is a process of its own
(`spine_process`, what `make run` does: `SpineProcess` follows the stages like any replica).

With `shadow.share` > 0 the front mirrors that share of answered requests to the other
side and serves its comparison counters on its own /metrics (`front_metrics_address`);
the parity gate reads them there through a `ScrapeSource`, the same code and arithmetic
as a direct scrape of spines behind Envoy. Without shadow, a plan with a parity gate is
refused (`FrontTarget.shadow`).

`Cutover` says what to run; `Cutover.start()` starts it and returns a `RunningCutover`, the
parts as they run (frozen: nothing is filled in later, and a part that is absent is absent
because the settings leave it out). The parts start under one `ExitStack`
(`cutover_parts`): a part that fails to start stops the ones started before it, and
`RunningCutover.stop()` stops them in the reverse of the order they started.
"""

from __future__ import annotations

import secrets
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from migration.metrics.scrape import ScrapeSource
from migration.server import ControllerProcess
from migration.traffic.cutover_parts import controller_address, serve_comparisons, start_controller
from migration.traffic.endpoint_health import EndpointHealth, endpoint
from migration.traffic.front import Front
from migration.traffic.front_target import FrontTarget
from migration.traffic.layered_process import LayeredProcess
from migration.traffic.spine_process import SpineProcess
from migration.xds import XdsControlPlane
from migration.xds.snapshot import HTTP_SUFFIX, Endpoint
from monolith.device import DeviceContext
from runtime.config.file import SpineConfig, internal_key, placements_for
from runtime.faults import FaultHook, FaultSwitch, WrongAnswers
from runtime.http.server import HttpServer, start_http
from runtime.running_parts import RunningParts
from runtime.running_stack import RunningStack
from runtime.server import RunningServer, free_port, request_pool, request_threads, start_server
from runtime.stack import Stack
from services.common.prometheus_http import PrometheusHTTPServer
from services.ratelimit.api import RATELIMIT, RateLimit
from services.registry import COMPONENTS, DEFAULT, GATEWAY, MIDDLEWARES


@dataclass(frozen=True)
class Cutover:
    """What a whole migration on one machine runs; `start()` runs it."""

    config: SpineConfig = field(repr=False)  # it may hold the internal secret
    run_dir: Path
    listen: str = "127.0.0.1:0"
    xds_listen: str | None = None  # e.g. "127.0.0.1:0": serve ADS so Envoy/proxyless clients follow
    # The front's HTTP API (OpenAI/Anthropic-compatible, `runtime.http`), split like its
    # gRPC traffic; None: gRPC only. Both sides then serve HTTP too, and the xDS snapshot
    # routes an HTTP listener between them (`layered-http`, `spine-http`) by the same weights.
    http_listen: str | None = None
    # The layered stack as its own process tree (`spine up --layout layered`), as in
    # production, rather than a Stack in this process (its gateway then shares this
    # interpreter with the spine's model): what `make run` compares. In-process, tests can
    # reach into it (`layered.supervisor`).
    layered_process: bool = False
    # The spine as its own process (`SpineProcess`), following the stages over ADS (an xDS
    # control plane is started for it, on `xds_listen` or any free loopback port), rather
    # than a Stack in this process: what `make run` compares. Faults: `switch_fault`.
    spine_process: bool = False
    admin_token: str = field(default_factory=lambda: secrets.token_urlsafe(24), repr=False)
    # The controller's dashboard (`migration.dashboard`), e.g. "127.0.0.1:0"; None: none.
    dashboard_listen: str | None = None

    def start(self) -> RunningCutover:
        """Start both layouts, the front and the controller, in that order; what runs.

        Should one fail to start, those started before it are stopped and the error raised."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        config = self.config
        if internal_key(config) is None:  # the front and both sides share one, made for this run
            config = config.with_overrides({"internal": {"secret": secrets.token_urlsafe(32)}})
        with ExitStack() as parts:  # left by an error: it stops what had started
            return self._start(config, parts)

    def _start(self, config: SpineConfig, parts: ExitStack) -> RunningCutover:
        tls = config.tls  # every TCP listener and link of the run speaks it
        fault = FaultHook()  # the in-process spine's
        layered, layered_tree, layered_address, shared, layered_ratelimit = self._start_layered(config, parts)
        spine, spine_tree, xds, spine_address = self._start_spine(config, parts, layered_address, shared, fault)
        shadow = config.shadow
        front = Front({"layered": layered_address, "spine": spine_address},
                      shadow=shadow if shadow.share > 0 else None, internal_key=internal_key(config), tls=tls)
        parts.callback(front.close)
        comparisons = serve_comparisons(parts, front.shadow.counters.registry) if front.shadow is not None else None
        limits = config.limits
        # Sized like the gateways behind it: requests wait in the model's priority queue.
        front_server = start_server([(GATEWAY, front)], self.listen, max_message_bytes=limits.max_message_bytes,
                                    tls=tls, **request_pool(config.inference))
        parts.callback(front_server.stop, 2.0)
        front_http = self._start_front_http(config, parts, front)
        if xds is None and self.xds_listen is not None:
            xds = XdsControlPlane("spine-gateway", {
                "layered": [endpoint(layered_address)], "spine": [endpoint(spine_address)]})
            parts.callback(xds.stop)
            xds.start(self.xds_listen, tls)
        if xds is not None:
            xds.set_endpoints(_http_endpoints({"layered": layered if layered is not None else layered_tree,
                                               "spine": spine if spine is not None else spine_tree}))
        # Each side's gateway health (SERVING only while its fail-closed components are)
        # steers the front and the xDS endpoints.
        endpoint_health = EndpointHealth({"layered": [layered_address], "spine": [spine_address]},
                                         front=front, xds=xds, tls=tls).start()
        parts.callback(endpoint_health.stop)
        parity = comparisons.parity if comparisons is not None else None
        target = FrontTarget(front, spine, layered_ratelimit, xds, parity)
        controller = start_controller(parts, self.run_dir, self.admin_token, target, tick_s=0.1,
                                      dashboard_listen=self.dashboard_listen)
        return RunningCutover(
            config=config, run_dir=self.run_dir, admin_token=self.admin_token, fault=fault,
            layered=layered, layered_tree=layered_tree, spine=spine, spine_tree=spine_tree, front=front,
            front_server=front_server, front_http=front_http, xds=xds, endpoint_health=endpoint_health,
            front_metrics=comparisons.metrics if comparisons is not None else None, parity=parity,
            target=target, controller=controller,
            parts=parts.pop_all())  # last: the running cutover holds the stops from here on

    def _start_layered(self, config: SpineConfig, parts: ExitStack) -> tuple[
            RunningStack | None, LayeredProcess | None, str, dict[str, str], RateLimit]:
        """The layered stack, in this process or its own (the other None): its gateway's
        address, its middlewares' addresses (the spine's remote placements) and its rate limiter."""
        if self.layered_process:
            tree = LayeredProcess(config, self.run_dir / "layered")
            parts.callback(tree.stop)  # before it starts: one that stops half way leaves no child
            address = tree.start()
            return None, tree, address, tree.component_addresses(), tree.ratelimit()
        stack = parts.enter_context(Stack(config, placements_for("layered", config), run_dir=self.run_dir / "layered",
                                          http_listen=self._side_http()).start())
        assert stack.supervisor is not None  # every component remote: each is a child of this stack
        shared = {name: child.address for name, child in stack.supervisor.children.items() if name != "inference"}
        return stack, None, stack.address, shared, stack.component(RATELIMIT)

    def _start_spine(self, config: SpineConfig, parts: ExitStack, layered_address: str, shared: dict[str, str],
                     fault: FaultHook) -> tuple[RunningStack | None, SpineProcess | None, XdsControlPlane | None, str]:
        """The spine, on the layered stack's middlewares and its own model, in this process
        or its own (the other None); the xDS control plane it follows if its own; its address."""
        tls = config.tls
        if self.spine_process:
            # It follows the stages over ADS. It is started before the control plane: a child
            # is forked, and no gRPC server thread of this process should be running then
            # (gRPC's fork handlers complain, and a lock held by one would stay held in the
            # child until its exec). So the control plane's port is chosen first; the spine
            # connects once it listens, and its endpoint joins once it has said where it serves.
            host, port = (self.xds_listen or "127.0.0.1:0").rsplit(":", 1)
            listen = f"{host}:{free_port() if port == '0' else port}"
            tree = SpineProcess(config, self.run_dir / "spine", controller=listen, remote=shared)
            parts.callback(tree.stop)
            address = tree.start()
            xds = XdsControlPlane("spine-gateway", {"layered": [endpoint(layered_address)],
                                                    "spine": [endpoint(address)]})
            parts.callback(xds.stop)
            xds.start(listen, tls)
            return None, tree, xds, address
        placements = {name: "remote" for name in MIDDLEWARES} | {"inference": "local"}
        # The spine's model behind the parity fault's switch (`fault.wrong_answers`).
        device = DeviceContext.for_section(config.device)
        model = WrongAnswers(DEFAULT["inference"].build(config, device, self.run_dir), fault)
        stack = parts.enter_context(Stack(config, placements, run_dir=self.run_dir / "spine", hooks=[fault],
                                          remote_addresses=shared, device=device, servicers={"inference": model},
                                          http_listen=self._side_http()).start())
        return stack, None, None, stack.address

    def _start_front_http(self, config: SpineConfig, parts: ExitStack, front: Front) -> HttpServer | None:
        """The front's HTTP API on `http_listen`, split like its gRPC traffic; None without one."""
        if self.http_listen is None:
            return None
        server, app = start_http(front, config.http, config.router, config.limits, request_threads(config.inference),
                                 self.http_listen, layout=lambda: "front",
                                 serving=lambda: any(front.healthy.values()), tls=config.tls)
        parts.callback(app.close)
        parts.callback(server.stop, 2.0)  # first: its requests in flight finish on the app
        return server

    def _side_http(self) -> str | None:
        """Where an in-process side serves HTTP: anywhere on loopback when the run serves HTTP."""
        return "127.0.0.1:0" if self.http_listen is not None else None


def _http_endpoints(sides: dict[str, RunningStack | LayeredProcess | SpineProcess | None]) -> dict[str, list[Endpoint]]:
    """Each side's HTTP API as the xDS cluster `<side>-http` (none where a side serves none)."""
    return {f"{side}{HTTP_SUFFIX}": [endpoint(running.http_address)] for side, running in sides.items()
            if running is not None and running.http_address}


@dataclass(frozen=True)
class RunningCutover(RunningParts):
    """A started `Cutover`: both sides, the front, the controller. Of each pair of a side
    (`layered`/`layered_tree`, `spine`/`spine_tree`) the one that runs is set; `xds`,
    `front_http`, `front_metrics` and `parity` are None where the settings leave them out.
    `stop()` stops every part, in the reverse of the order they started."""

    # As run: with the internal secret made for the run if it had none (kept out of its repr).
    config: SpineConfig = field(repr=False)
    run_dir: Path
    admin_token: str = field(repr=False)
    fault: FaultHook  # the in-process spine's (`switch_fault`)
    layered: RunningStack | None
    layered_tree: LayeredProcess | None
    spine: RunningStack | None
    spine_tree: SpineProcess | None
    front: Front
    front_server: RunningServer
    front_http: HttpServer | None
    xds: XdsControlPlane | None
    endpoint_health: EndpointHealth
    front_metrics: PrometheusHTTPServer | None  # the front's shadow counters, with shadow on
    parity: ScrapeSource | None  # what the parity gate reads them with
    target: FrontTarget
    controller: ControllerProcess

    @property
    def address(self) -> str:
        """The front's gRPC address (HOST:PORT)."""
        return self.front_server.address

    @property
    def http_address(self) -> str | None:
        """The front's HTTP API (None without `http_listen`)."""
        return self.front_http.address if self.front_http is not None else None

    @property
    def front_metrics_address(self) -> str | None:
        """Where the front serves its shadow comparison counters (None with shadow off)."""
        return self.front_metrics.address if self.front_metrics is not None else None

    @property
    def controller_address(self) -> str:
        return controller_address(self.run_dir)

    def switch_fault(self, command: str) -> dict[str, Any]:
        """Switch the spine's fault (`FaultSwitch`'s commands: `error-rate R`, `wrong-answers
        on|off`, `clear`) wherever it runs; the fault now, or FaultNotSwitched / ValueError."""
        if self.spine_tree is not None:
            return self.spine_tree.switch_fault(command)
        answer = FaultSwitch(self.fault, lambda _: None).apply(command)
        if answer["event"] != "fault":
            raise ValueError(f"{command!r}: {answer['why']}")
        return answer


__all__ = ["COMPONENTS", "Cutover", "RunningCutover"]
