"""The Textual dashboard: `run_dashboard(shepherd)` hosts a run; `DashboardApp` shows a RunState."""

from .app import DashboardApp, run_dashboard

__all__ = ["DashboardApp", "run_dashboard"]
