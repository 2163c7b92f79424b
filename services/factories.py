"""Build each servicer from its config section. One function per component.

Kept apart from `components.py` so that importing the table does not import torch models
or crypto libraries: a process imports only what it serves.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from services.common import DeviceState, section


def build_auth(config: Mapping[str, Any], device: DeviceState, run_dir: Path) -> Any:
    from services.auth import AuthConfig, AuthService

    return AuthService(AuthConfig.from_dict(section(config, "auth")), device)


def build_ratelimit(config: Mapping[str, Any], device: DeviceState, run_dir: Path) -> Any:
    from services.ratelimit import RateLimitConfig, RateLimitService

    return RateLimitService(RateLimitConfig.from_dict(section(config, "ratelimit")), device)


def build_router(config: Mapping[str, Any], device: DeviceState, run_dir: Path) -> Any:
    from services.router import RouterConfig, RouterService

    return RouterService(RouterConfig.from_dict(section(config, "router")), device)


def build_cache(config: Mapping[str, Any], device: DeviceState, run_dir: Path) -> Any:
    from services.cache import CacheConfig, CacheService

    return CacheService(CacheConfig.from_dict(section(config, "cache")), device)


def build_metrics(config: Mapping[str, Any], device: DeviceState, run_dir: Path) -> Any:
    from services.metrics import MetricsConfig, MetricsService

    return MetricsService(MetricsConfig.from_dict(section(config, "metrics")), device)


def build_logs(config: Mapping[str, Any], device: DeviceState, run_dir: Path) -> Any:
    from services.logs import LogsConfig, LogsService

    return LogsService(LogsConfig.from_dict(section(config, "logs"), run_dir), device)


def build_inference(config: Mapping[str, Any], device: DeviceState, run_dir: Path) -> Any:
    from services.inference import InferenceConfig, InferenceService

    return InferenceService(InferenceConfig.from_dict(section(config, "inference")), device)
