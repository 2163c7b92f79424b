"""The operator's web view of a migration, served by the controller (`DashboardServer`)."""

from migration.dashboard.server import DashboardServer

__all__ = ["DashboardServer"]
