"""What a distributed optimizer shares with the torch optimizer it was made from.

``DistributedOptimizer`` returns an instance of a subclass of the wrapped optimizer's class whose
attributes are the wrapped one's (Horovod's way), so code that kept the wrapped optimizer (a
learning-rate scheduler made before wrapping) reads and writes the same ``param_groups``. torch's
``load_state_dict`` replaces ``param_groups`` and ``state`` with new objects on the instance it is
called on: without handing them to the wrapped optimizer too, that scheduler would go on setting
learning rates nobody reads.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SharesState"]


class SharesState:
    """Mixin: ``load_state_dict`` keeps the wrapped optimizer on the same groups and state."""

    _zf_wrapped: Any = None  # the torch optimizer this one was made from

    def made_from(self, optimizer: Any) -> None:
        """Record the torch optimizer this one was made from (and shares its attributes with)."""
        self._zf_wrapped = optimizer

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # type: ignore[misc]
        wrapped = self._zf_wrapped
        if wrapped is not None and wrapped is not self:
            wrapped.param_groups = self.param_groups  # type: ignore[attr-defined]
            wrapped.state = self.state  # type: ignore[attr-defined]
