"""PCP-TUI: DiLoCo training across loosely connected machines, from Python or the `pcp-tui` command.

What a user imports is here; everything else is machinery that may change.

    import pcp_tui
    state = pcp_tui.train(rounds=3, workers=2)       # a shepherd and two local workers
    config = pcp_tui.RunConfig(model="examples/mlp_model.py", rounds=10)

A model file returns a `ModelSpec` (with a `Dataset`); `Shepherd` and `Worker`
are the two sides when you wire a run yourself (`Worker(WorkerConfig(connect=...,
token=...))`); `pcp_tui.testing` holds the
process harness the project's own tests use.

Names load lazily: `import pcp_tui` (every worker does) imports neither JAX
models nor the dashboard.
"""

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "ConfigError": "pcp_tui.config",
    "Dataset": "pcp_tui.training.model_file",
    "ModelSpec": "pcp_tui.training.model_file",
    "RunConfig": "pcp_tui.config",
    "RunFailed": "pcp_tui.shepherd.coordinator",
    "RunState": "pcp_tui.shepherd.run.state",
    "Shepherd": "pcp_tui.shepherd.coordinator",
    "Worker": "pcp_tui.worker.client",
    "WorkerConfig": "pcp_tui.config",
    "train": "pcp_tui.app.local",
}

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pcp_tui' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return __all__
