"""Errors raised by the core. Each message names the input, the value and the fix."""


class WanVACEError(Exception):
    """Base class for every error this package raises on purpose."""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        _shown_by_name(cls)


def _shown_by_name(cls: type) -> None:
    # ComfyUI's error dialog and /history show `exception_type` as `__module__ + "." + __qualname__`, except for
    # "builtins", and its custom-node loader names our modules by their folder's path: the dialog said
    # "/home/.../custom_nodes/ComfyUI-WanVACE.wanvace_core.errors.WanVACEInputError". With "builtins" it says
    # "WanVACEInputError", as Python's own tracebacks then do too. (No WanVACEError is pickled: the parallel
    # workers send error texts.)
    cls.__module__ = "builtins"


_shown_by_name(WanVACEError)


class WanVACEInputError(WanVACEError, ValueError):
    """A user-supplied value is invalid; raised before any heavy work starts."""


class WanVACEModelFolderError(WanVACEError, ValueError):
    """A model folder or weight file is missing, malformed or not a VACE pipeline."""
