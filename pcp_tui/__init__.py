__version__ = "0.1.0"

__all__ = ["Dataset", "ModelSpec", "__version__"]


def __getattr__(name: str):
    # Lazy, so `import pcp_tui` (every worker) does not import the model-file machinery.
    if name in ("Dataset", "ModelSpec"):
        from pcp_tui.training import model_file as custom

        return getattr(custom, name)
    raise AttributeError(f"module 'pcp_tui' has no attribute {name!r}")
