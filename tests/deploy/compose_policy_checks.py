"""How the Compose project behaves on a real engine: which engines run it, how often the image
is built, how fast it starts and whether it heals.

Each check takes a resolved project (`docker compose config --format json`) and returns a list
of errors, empty when the file is right. These are the defects a real `docker compose up` on
Docker Engine 20.10 showed, none of which `docker compose config` itself reports.
"""

from __future__ import annotations

from typing import Any

# The oldest engine the file must run on, and the fields that need a newer one (the engine
# refuses to create a container that uses them).
MIN_ENGINE = "20.10"
NEWER_ENGINE_FIELDS = {("healthcheck", "start_interval"): "25.0"}
# A worker rank exits when its TP group breaks, with whatever code: it must come back anyway.
RESTARTS_ON_ANY_EXIT = {"always", "unless-stopped"}


def _long_running(services: dict[str, Any]) -> list[str]:
    """Services that keep running (they have a health check); the others are one-shot."""
    return sorted(n for n, s in services.items() if s.get("healthcheck"))


def engine_errors(project: dict[str, Any]) -> list[str]:
    """Fields that a Docker Engine as old as MIN_ENGINE does not accept."""
    errors: list[str] = []
    for name, svc in sorted(project["services"].items()):
        for (section, field), version in NEWER_ENGINE_FIELDS.items():
            if field in (svc.get(section) or {}):
                errors.append(f"{name}: {section}.{field} needs Docker Engine {version}+, "
                              f"the file must run on {MIN_ENGINE}")
    return errors


def build_errors(project: dict[str, Any]) -> list[str]:
    """Each image is built by exactly one service; the others use it by name (Compose skips
    pulling an image that another service builds). Several `build:` sections for one tag make
    the classic builder build it once per service."""
    errors: list[str] = []
    builders: dict[str, list[str]] = {}
    for name, svc in sorted(project["services"].items()):
        builders.setdefault(svc.get("image", f"<{name}>"), [])
        if svc.get("build"):
            builders[svc.get("image", f"<{name}>")].append(name)
    for image, names in sorted(builders.items()):
        if len(names) > 1:
            errors.append(f"image {image} is built by {len(names)} services ({', '.join(names)}): "
                          f"declare build: on one of them")
        elif not names:
            errors.append(f"image {image} is built by no service")
    return errors


def startup_errors(project: dict[str, Any]) -> list[str]:
    """Long-running services do not wait for each other's Docker health checks: each such tier
    adds up to a probe interval to a cold start, and the services wait for each other anyway
    (router and gateway report NOT_SERVING until the tier behind them answers)."""
    services = project["services"]
    long_running = set(_long_running(services))
    errors: list[str] = []
    for name in sorted(long_running):
        for dependency, spec in sorted((services[name].get("depends_on") or {}).items()):
            if dependency in long_running and spec.get("condition") == "service_healthy":
                errors.append(f"{name}: waits for {dependency}'s health check; depend on it with "
                              f"service_started")
    return errors


def restart_errors(project: dict[str, Any]) -> list[str]:
    """Workers restart after any exit (that is how a broken TP group forms again), the other
    long-running services after a failure at least, one-shot services never."""
    errors: list[str] = []
    for name, svc in sorted(project["services"].items()):
        policy = str(svc.get("restart", "no"))
        is_worker = svc.get("command", [])[-1:] == ["worker_service"]
        if is_worker and policy not in RESTARTS_ON_ANY_EXIT:
            errors.append(f"{name}: restart: {policy}; a worker rank must restart after any exit "
                          f"({' or '.join(sorted(RESTARTS_ON_ANY_EXIT))})")
        elif svc.get("healthcheck") and policy == "no":
            errors.append(f"{name}: a long-running service needs a restart policy")
        elif not svc.get("healthcheck") and policy in RESTARTS_ON_ANY_EXIT:
            errors.append(f"{name}: a one-shot service must not restart after it completes")
    return errors


def policy_errors(project: dict[str, Any]) -> list[str]:
    return engine_errors(project) + build_errors(project) + startup_errors(project) \
        + restart_errors(project)
