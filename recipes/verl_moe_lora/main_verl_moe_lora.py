"""verl's main_ppo with our overrides checked up front: python recipes/verl_moe_lora/main_verl_moe_lora.py [k=v ...]"""
import hydra


@hydra.main(config_path="config", config_name="verl_moe_lora", version_base=None)
def main(cfg):
    from moe_lora_rl.integration.verl.config import check_config

    check_config(cfg)                     # one-line ValueError naming the key and value on a conflicting option
    from verl.trainer.main_ppo import run_ppo

    run_ppo(cfg)


if __name__ == "__main__":
    main()
