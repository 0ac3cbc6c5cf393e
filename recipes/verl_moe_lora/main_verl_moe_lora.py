"""verl's trainers with our overrides checked up front:
    python recipes/verl_moe_lora/main_verl_moe_lora.py [k=v ...]                                          main_ppo
    python recipes/verl_moe_lora/main_verl_moe_lora.py --config-name verl_moe_lora_one_step_off [k=v ...]  one-step-off
    python recipes/verl_moe_lora/main_verl_moe_lora.py --config-name verl_moe_lora_fully_async [k=v ...]   fully-async
"""
import hydra


@hydra.main(config_path="config", config_name="verl_moe_lora", version_base=None)
def main(cfg):
    from moe_lora_rl.integration.verl.verl_config import check_config

    check_config(cfg)                     # one-line ValueError naming the key and value on a conflicting option
    from verl.trainer import main_ppo     # the body of verl's main_ppo.main, after our check

    main_ppo.auto_set_device(cfg)
    if "rollout" in cfg and "n_gpus_per_node" in cfg.rollout:     # verl's async configs (the rollout's own pool)
        import ray

        from moe_lora_rl.integration.verl import async_runners

        cfg.actor_rollout_ref.rollout.nnodes = cfg.rollout.nnodes          # what verl's async mains do
        cfg.actor_rollout_ref.rollout.n_gpus_per_node = cfg.rollout.n_gpus_per_node
        if "async_training" in cfg:                                         # fully-async
            from verl.experimental.reward_loop import migrate_legacy_reward_impl

            runner = async_runners.fully_async_task_runner()
            main_ppo.run_ppo(migrate_legacy_reward_impl(cfg), task_runner_class=runner)
        else:                                                               # one-step-off
            main_ppo.run_ppo(cfg, task_runner_class=ray.remote(num_cpus=1)(async_runners.OneStepTaskRunner))
        return
    main_ppo.validate_config(config=cfg, use_reference_policy=main_ppo.need_reference_policy(cfg),
                             use_critic=main_ppo.need_critic(cfg))
    if cfg.trainer.use_v1:
        main_ppo.run_ppo(cfg, task_runner_class=main_ppo.TaskRunnerV1)
    else:                                 # verl's deprecated V0 trainer (needs no transfer_queue)
        from moe_lora_rl.integration.verl.task_runner import TaskRunner   # verl's, plus the CPU worker on CPU

        main_ppo.run_ppo(cfg, task_runner_class=TaskRunner)


if __name__ == "__main__":
    main()
