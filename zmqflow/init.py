"""Public home of the initializers (``zf.init.normal`` ...); they are defined in :mod:`zmqflow.state.init`."""

from .state.init import *  # noqa: F401,F403
from .state.init import __all__  # noqa: F401
