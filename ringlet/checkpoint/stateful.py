"""``Stateful``: objects that ``save`` asks for their state and ``load`` hands it back to."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["Stateful", "resolve_stateful"]


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict(sd)`` (modules and optimizers too).

    A top-level value of the state dict passed to ``save`` / ``load`` that is Stateful is
    called: ``save`` stores ``obj.state_dict()``; ``load`` fills ``obj.state_dict()`` in
    place from the checkpoint and then calls ``obj.load_state_dict`` with it.

    Example::

        class AppState(Stateful):
            def __init__(self, model, optimizer):
                self.model, self.optimizer = model, optimizer
            def state_dict(self):
                model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
                return {"model": model_sd, "optim": optim_sd}
            def load_state_dict(self, sd):
                set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"],
                               optim_state_dict=sd["optim"])

        dcp.save({"app": AppState(model, optimizer)}, checkpoint_id="ckpt/step_10")
    """

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def resolve_stateful(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Stateful]]:
    """``state_dict`` with its Stateful top-level values replaced by their
    state, and those objects."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict: expected a dict, got {type(state_dict).__name__}")
    objects = {k: v for k, v in state_dict.items() if isinstance(v, Stateful)}
    resolved = {k: (objects[k].state_dict() if k in objects else v) for k, v in state_dict.items()}
    return resolved, objects
