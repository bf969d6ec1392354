"""`tokenflow dashboard push`: upload dashboards/tokenflow.json to a Grafana server.

Through `grafana-client`, the maintained fork of `grafana-api` (whose last release dates
from 2020). Idempotent: the dashboard keeps its uid and is posted with `overwrite: true`,
so pushing twice leaves one dashboard, at the newest version.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DASHBOARD_PATH = Path(__file__).resolve().parents[1] / "dashboards" / "tokenflow.json"


class DashboardPushError(RuntimeError):
    """Grafana refused the dashboard or could not be reached; the message says why."""


def load_dashboard(path: Path = DASHBOARD_PATH) -> dict[str, Any]:
    return json.loads(path.read_text())


def push_payload(dashboard: dict[str, Any]) -> dict[str, Any]:
    """The body of Grafana's `POST /api/dashboards/db`."""
    # `id` null: Grafana matches on the uid, so the same dashboard is overwritten anywhere.
    return {"dashboard": {**dashboard, "id": None}, "overwrite": True,
            "message": "tokenflow dashboard push"}


def push_dashboard(grafana_url: str, token: str | None = None,
                   path: Path = DASHBOARD_PATH, timeout_s: float = 10.0) -> dict[str, Any]:
    """Create or overwrite the dashboard; returns Grafana's answer (uid, url, version)."""
    from grafana_client import GrafanaApi
    from grafana_client.client import (
        GrafanaClientError,
        GrafanaException,
        GrafanaServerError,
        GrafanaUnauthorizedError,
    )

    api = GrafanaApi.from_url(grafana_url, credential=token, timeout=timeout_s)
    try:
        return api.dashboard.update_dashboard(push_payload(load_dashboard(path)))
    except GrafanaUnauthorizedError as err:
        raise DashboardPushError(
            f"Grafana at {grafana_url} refused the credentials ({err.status_code}): pass a "
            f"service-account token with --token") from None
    except GrafanaServerError as err:
        raise DashboardPushError(
            f"Grafana at {grafana_url} failed ({err.status_code}): {err.message}") from None
    except (GrafanaClientError, GrafanaException) as err:
        if not err.status_code:  # no HTTP answer: refused connection, DNS, timeout
            raise DashboardPushError(f"cannot reach Grafana at {grafana_url}: "
                                     f"{err.message}") from None
        raise DashboardPushError(f"Grafana at {grafana_url} refused the dashboard "
                                 f"({err.status_code}): {err.message}") from None
    except OSError as err:  # connection refused, DNS, timeout
        raise DashboardPushError(f"cannot reach Grafana at {grafana_url}: {err}") from None
