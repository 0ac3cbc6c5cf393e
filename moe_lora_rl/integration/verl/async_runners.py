"""verl's asynchronous trainers with our override, on any platform: the one-step-off-policy and fully-async task
runners, with the training roles on our CPU worker when the CPU platform is selected.

verl's `OneStepTaskRunner.run` builds its role -> worker mapping with `create_role_worker_mapping` (DetachActorWorker,
whose process group verl makes as `cpu:gloo,cpu:gloo` on our CPU platform, which torch refuses) and hands it straight
to its trainer, with no hook in between; so this runner repeats verl's run body (datasets, trainer, fit, unchanged)
and only swaps the mapped class for `CPUDetachActorWorker` (gloo group first) on the CPU platform.
"""
from __future__ import annotations

import ray

from .cpu_worker import cpu_platform_selected, init_gloo_process_group


def cpu_detach_worker():
    from verl.experimental.separation.engine_workers import DetachActorWorker

    class CPUDetachActorWorker(DetachActorWorker):
        def __init__(self, *args, **kwargs):
            init_gloo_process_group()
            super().__init__(*args, **kwargs)

    return CPUDetachActorWorker


def role_worker_mapping(config):
    """verl's mapping for its separated trainers; on the CPU platform the DetachActorWorker roles run ours."""
    from verl.experimental.separation.engine_workers import DetachActorWorker
    from verl.experimental.separation.utils import create_role_worker_mapping

    mapping, group_cls = create_role_worker_mapping(config)
    if cpu_platform_selected():
        cpu_cls = ray.remote(cpu_detach_worker())
        for role, remote_cls in list(mapping.items()):
            if remote_cls.__ray_metadata__.modified_class.__ray_actor_class__ is DetachActorWorker:
                mapping[role] = cpu_cls
    return mapping, group_cls


class OneStepTaskRunner:
    def run(self, config):
        import asyncio

        from .plugin import register

        register()                    # this driver computes advantages: verl's registry gets grpo_exact

        from omegaconf import OmegaConf
        from verl.experimental.one_step_off_policy.ray_trainer import OneStepOffRayTrainer
        from verl.experimental.separation.utils import create_resource_pool_manager
        from verl.trainer.ppo.utils import create_rl_dataset, create_rl_sampler, need_critic, need_reference_policy
        from verl.utils import hf_processor, hf_tokenizer
        from verl.utils.config import validate_config
        from verl.utils.dataset.rl_dataset import collate_fn
        from verl.utils.fs import copy_to_local

        OmegaConf.resolve(config)
        mapping, group_cls = role_worker_mapping(config)
        validate_config(config=config, use_reference_policy=need_reference_policy(config),
                        use_critic=need_critic(config))
        local_path = copy_to_local(config.actor_rollout_ref.model.path,
                                   use_shm=config.actor_rollout_ref.model.get("use_shm", False))
        trust = config.data.get("trust_remote_code", False)
        tokenizer = hf_tokenizer(local_path, trust_remote_code=trust)
        processor = hf_processor(local_path, trust_remote_code=trust, use_fast=True)
        pools = create_resource_pool_manager(config, mapping.keys())
        train = create_rl_dataset(config.data.train_files, config.data, tokenizer, processor,
                                  max_samples=config.data.get("train_max_samples", -1))
        val = create_rl_dataset(config.data.val_files, config.data, tokenizer, processor,
                                max_samples=config.data.get("val_max_samples", -1))
        trainer = OneStepOffRayTrainer(config=config, tokenizer=tokenizer, processor=processor,
                                       role_worker_mapping=mapping, resource_pool_manager=pools,
                                       ray_worker_group_cls=group_cls, train_dataset=train, val_dataset=val,
                                       collate_fn=collate_fn, train_sampler=create_rl_sampler(config.data, train),
                                       device_name=config.trainer.device)
        trainer.init_workers()
        asyncio.run(trainer.fit())


def fully_async_task_runner():
    """verl's FullyAsyncTaskRunner with one documented step overridden: `_create_trainer` reads the role mapping verl
    built (self.components) and, on the CPU platform, gets it with our CPU worker swapped in (role_worker_mapping)."""
    from verl.experimental.fully_async_policy import fully_async_main

    base = fully_async_main.FullyAsyncTaskRunner.__ray_metadata__.modified_class.__ray_actor_class__

    class MoELoRAFullyAsyncTaskRunner(base):
        def _create_trainer(self, config):
            from .plugin import register

            register()                # the trainer computes advantages here: verl's registry gets grpo_exact
            if cpu_platform_selected():
                self.components["role_worker_mapping"] = role_worker_mapping(config)[0]
            return super()._create_trainer(config)

    return ray.remote(num_cpus=1)(MoELoRAFullyAsyncTaskRunner)
