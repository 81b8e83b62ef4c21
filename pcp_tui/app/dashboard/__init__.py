"""The Textual dashboard: `run_dashboard(shepherd)` hosts a run; `DashboardApp` shows a RunState."""

from pcp_tui.app.dashboard.app import DashboardApp, run_dashboard

__all__ = ["DashboardApp", "run_dashboard"]
