"""Public home of the optimizers (``zf.optim.SGD`` ...); they are defined in :mod:`zmqflow.state.optim`."""

from .state.optim import *  # noqa: F401,F403
from .state.optim import __all__  # noqa: F401
