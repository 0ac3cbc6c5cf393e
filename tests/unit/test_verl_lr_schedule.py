"""Our engine's lr schedule (integration/verl/lr_schedule.py, MoELoRAEngine.lr_scheduler_step) against verl's own
Megatron scheduler (verl.utils.megatron.optimizer.get_megatron_optimizer_param_scheduler on megatron-core's
OptimizerParamScheduler), driven as verl drives it: built before the first step, one optimizer step then one
scheduler step per update, 20 updates. Compared: the lr and weight decay each AdamW step ran with, and the adapter
parameter after each step (the lr reached the update). Controls: warmup on vs off, and cosine vs linear, differ."""
import pytest
import torch

pytestmark = pytest.mark.verl

STEPS = 20
CASES = {
    "constant": dict(lr_decay_style="constant"),
    "constant_warmup_steps": dict(lr_decay_style="constant", lr_warmup_steps=5, lr_warmup_init=1e-5),
    "cosine_warmup_ratio": dict(lr_decay_style="cosine", lr_warmup_steps_ratio=0.25, min_lr=1e-4),
    "cosine_warmup_steps": dict(lr_decay_style="cosine", lr_warmup_steps=3, min_lr=1e-4),
    "linear_warmup_ratio": dict(lr_decay_style="linear", lr_warmup_steps_ratio=0.1, min_lr=2e-4),
    "linear_no_warmup": dict(lr_decay_style="linear", min_lr=0.0),
    "cosine_decay_steps": dict(lr_decay_style="cosine", lr_decay_steps=12, min_lr=1e-4),
    "inverse_sqrt": dict(lr_decay_style="inverse-square-root", lr_warmup_steps=4),
    "wsd": dict(lr_decay_style="WSD", lr_wsd_decay_steps=6, lr_wsd_decay_style="cosine", min_lr=1e-4),
}


def optim(**kw):
    from verl.workers.config import McoreOptimizerConfig

    return McoreOptimizerConfig(**{"lr": 1e-3, "weight_decay": 0.01, "total_training_steps": STEPS, **kw})


class _Eng:
    """The engine's lr_scheduler_step / optimizer pair without a model: MoELoRAEngine's own method on an object
    holding an AdamW and the scheduler build_lr_scheduler made."""
    def __init__(self, cfg):
        from moe_lora_rl.integration.verl.lr_schedule import build_lr_scheduler

        self.p = torch.nn.Parameter(torch.ones(4))
        self.optimizer = torch.optim.AdamW([self.p], lr=cfg.lr, weight_decay=cfg.weight_decay, betas=tuple(cfg.betas))
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg)

    def lr_scheduler_step(self):
        from moe_lora_rl.integration.verl.engine import MoELoRAEngine

        return MoELoRAEngine.lr_scheduler_step(self)


def run(opt, step_sched, p):
    seen = []
    for k in range(STEPS):
        g = opt.param_groups[0]
        seen.append((g["lr"], g["weight_decay"]))
        p.grad = torch.full_like(p, 0.1 * (k + 1))
        opt.step()
        step_sched()
        seen[-1] += (p.detach().clone(),)
    return seen


def ours(cfg):
    e = _Eng(cfg)
    return run(e.optimizer, e.lr_scheduler_step, e.p)


def verls(cfg):
    from verl.utils.megatron.optimizer import get_megatron_optimizer_param_scheduler

    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], lr=cfg.lr, weight_decay=cfg.weight_decay, betas=tuple(cfg.betas))
    sched = get_megatron_optimizer_param_scheduler(opt, cfg)
    return run(opt, lambda: sched.step(1), p)


def lrs(seen):
    return [s[0] for s in seen]


@pytest.mark.parametrize("case", sorted(CASES))
def test_lr_per_step_equals_verls_scheduler(case):
    cfg = optim(**CASES[case])
    got, want = ours(cfg), verls(cfg)
    assert lrs(got) == lrs(want), (case, lrs(got), lrs(want))
    assert [s[1] for s in got] == [s[1] for s in want]
    assert all(torch.equal(a[2], b[2]) for a, b in zip(got, want))
    if case != "constant":
        assert len(set(lrs(got))) > 2, lrs(got)            # the lr moves


def test_controls_warmup_and_style_change_the_lr():
    base = dict(lr_decay_style="cosine", min_lr=1e-4)
    on, off = lrs(ours(optim(**base, lr_warmup_steps_ratio=0.25))), lrs(ours(optim(**base)))
    assert max(abs(a - b) for a, b in zip(on, off)) > 1e-4
    lin = lrs(ours(optim(lr_decay_style="linear", min_lr=1e-4)))
    assert max(abs(a - b) for a, b in zip(lin, off)) > 1e-5
    assert on[0] == 0.0 and off[0] == 1e-3                  # warmup starts at lr_warmup_init


def test_no_step_count_constant_lr_or_refusal():
    from verl.workers.config.optimizer import OptimizerConfig

    from moe_lora_rl.integration.verl.lr_schedule import build_lr_scheduler

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))], lr=1e-3)
    assert build_lr_scheduler(opt, optim(lr_decay_style="constant", total_training_steps=-1)) is None
    assert build_lr_scheduler(opt, OptimizerConfig(lr=1e-3)) is None
    with pytest.raises(ValueError, match="total_training_steps"):
        build_lr_scheduler(opt, optim(lr_decay_style="cosine", total_training_steps=-1))


@pytest.mark.parametrize("kw,msg", [
    (dict(lr_decay_style="inverse_square_root"), "lr_decay_style='inverse_square_root'.*inverse-square-root"),
    (dict(lr_decay_style="polynomial"), "lr_decay_style='polynomial'"),
    (dict(lr_decay_style="WSD"), "lr_wsd_decay_steps"),
    (dict(lr_decay_style="WSD", lr_wsd_decay_steps=3, lr_wsd_decay_style="constant"), "lr_wsd_decay_style"),
    (dict(weight_decay_incr_style="exponential"), "weight_decay_incr_style"),
    (dict(min_lr=1e-2), "min_lr"),
    (dict(lr_warmup_init=1e-2), "lr_warmup_init"),
    (dict(lr_decay_steps=4, lr_warmup_steps=4), "lr_decay_steps=4"),
])
def test_refused_in_one_line(kw, msg):
    from moe_lora_rl.integration.verl.lr_schedule import check_lr_schedule

    with pytest.raises(ValueError, match=msg) as e:
        check_lr_schedule(optim(**kw))
    assert "\n" not in str(e.value) and str(e.value).startswith("actor_rollout_ref.actor.optim")


def test_schedule_without_megatron_keys_refused():
    from verl.workers.config.optimizer import OptimizerConfig

    from moe_lora_rl.integration.verl.lr_schedule import check_lr_schedule

    with pytest.raises(ValueError, match="Megatron optimizer config"):
        check_lr_schedule(OptimizerConfig(lr=1e-3, lr_warmup_steps=5))


def test_resumed_schedule_continues():
    """The scheduler's state_dict after 7 steps, loaded as MoELoRAEngine.load_checkpoint does into a fresh one,
    gives the same next 13 lrs as the uninterrupted run; a fresh one without the state does not (control)."""
    from moe_lora_rl.integration.verl.lr_schedule import build_lr_scheduler, current_lr

    cfg = optim(lr_decay_style="cosine", lr_warmup_steps=4, min_lr=1e-4)

    def fresh():
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))], lr=cfg.lr)
        return opt, build_lr_scheduler(opt, cfg)

    opt, s = fresh()
    full = []
    for _ in range(STEPS):
        s.step(1)
        full.append(current_lr(opt))
    opt, s = fresh()
    for _ in range(7):
        s.step(1)
    saved = s.state_dict()
    opt2, s2 = fresh()
    s2.step(3)                                   # a restarted engine may have stepped before the load
    s2.num_steps = 0
    s2.load_state_dict(saved)
    rest = []
    for _ in range(STEPS - 7):
        s2.step(1)
        rest.append(current_lr(opt2))
    assert rest == full[7:]
    opt3, s3 = fresh()
    assert [s3.step(1) or current_lr(opt3) for _ in range(STEPS - 7)] != full[7:]
