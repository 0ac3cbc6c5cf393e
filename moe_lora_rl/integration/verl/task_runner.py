"""verl's V0 task runner with our CPU worker on the CPU platform, and verl's own everywhere else.

`verl.trainer.main_ppo_v0.TaskRunner` is a Ray actor class (Ray forbids subclassing those, and its `__init__`'s
`super()` breaks once the wrapped class is re-pickled by value in the Ray worker), so we subclass verl's
`BaseTaskRunner`, reuse `TaskRunner.run` unchanged, and override the documented hook `add_actor_rollout_worker`:
after verl's mapping is built, the actor-rollout role is mapped to `CPUActorRolloutRefWorker` only when
VERL_PLATFORM selects our CPU platform.
"""
from __future__ import annotations

import ray
from verl.trainer import main_ppo_v0

from .cpu_worker import cpu_platform_selected

_VerlTaskRunner = main_ppo_v0.TaskRunner.__ray_metadata__.modified_class.__ray_actor_class__


class MoELoRATaskRunner(main_ppo_v0.BaseTaskRunner):
    def run(self, config):
        """verl's V0 training workflow, unchanged, after our names are registered in this process (the driver
        computes advantages: algorithm.adv_estimator=grpo_exact is looked up here)."""
        from .plugin import register

        register()
        return _VerlTaskRunner.run(self, config)

    def add_actor_rollout_worker(self, config):
        actor_rollout_cls, group_cls = super().add_actor_rollout_worker(config)
        if not cpu_platform_selected():
            return actor_rollout_cls, group_cls
        from .cpu_worker import CPUActorRolloutRefWorker

        for role, remote_cls in list(self.role_worker_mapping.items()):
            if remote_cls.__ray_metadata__.modified_class.__ray_actor_class__ is actor_rollout_cls:
                self.role_worker_mapping[role] = ray.remote(CPUActorRolloutRefWorker)
        return CPUActorRolloutRefWorker, group_cls


TaskRunner = ray.remote(MoELoRATaskRunner)
