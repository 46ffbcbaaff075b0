"""Which policy runs: the built-in one of each mode, or a plug-in named by import path (`--policy MODULE:CLASS`)."""

from __future__ import annotations

import importlib

from scheduler.config import Mode, SchedulerConfig
from scheduler.continuous import ContinuousPolicy
from scheduler.dynamic import DynamicPolicy
from scheduler.engine_port import SchedulerEngine
from scheduler.policy import Policy
from scheduler.static import StaticPolicy


def check_seats(engine: SchedulerEngine, config: SchedulerConfig) -> None:
    if engine.config.max_rows < config.seats:
        raise ValueError(
            f"the engine has {engine.config.max_rows} rows but the {config.mode.value} policy needs {config.seats}"
        )


def builtin_policy(mode: Mode) -> type[Policy]:
    """The mode's own policy: what runs without --policy, and what takes over from a plug-in that raises."""
    policies: dict[Mode, type[Policy]] = {
        Mode.DYNAMIC: DynamicPolicy,
        Mode.CONTINUOUS: ContinuousPolicy,
        Mode.STATIC: StaticPolicy,
    }
    return policies[mode]


def policy_class(config: SchedulerConfig) -> type[Policy]:
    return load_policy(config.policy) if config.policy is not None else builtin_policy(config.mode)


def load_policy(path: str) -> type[Policy]:
    """The Policy subclass at "package.module:Class"; ValueError naming what is wrong."""
    module_name, _, class_name = path.partition(":")
    try:
        policy_class = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load the policy {path!r}: {exc}") from None
    except Exception as exc:  # the module itself raised while importing: its error, as a config error naming it
        raise ValueError(f"cannot load the policy {path!r}: {type(exc).__name__}: {exc}") from None
    if not (isinstance(policy_class, type) and issubclass(policy_class, Policy)):
        raise ValueError(f"the policy {path!r} is not a subclass of scheduler.policy.Policy")
    return policy_class
