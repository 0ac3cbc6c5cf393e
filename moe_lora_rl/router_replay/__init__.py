"""Router replay: routes recorded at rollout (R3) or in an earlier training pass (R2), aligned to the training
layout and replayed in Megatron's routers, consumed exactly once; plus the router disagreement between two routings
(disagreement.py). The log-prob mismatch statistics are moe_lora_rl/mismatch.py's."""
