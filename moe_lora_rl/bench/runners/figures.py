"""The curve panels of the benches of whole jobs (r3_ab, sparse, e2e, peers, policies, verl): one style, one way to
save, and each bench's figure."""
from __future__ import annotations

from pathlib import Path


def panels(rows: int, cols: int, size=(10, 7)):
    """(figure, flat list of axes) on the Agg canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=100)
    FigureCanvasAgg(fig)
    return fig, list(fig.subplots(rows, cols, squeeze=False).ravel())


def style(ax, title: str, log: bool = False) -> None:
    if log:
        ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def save(fig, title: str, png: Path) -> Path:
    fig.suptitle(title)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)
    return png


def verl_learning_png(png, curve: dict, curve_lr0: dict, main_job_dir=None, *, lr: str = "1e-3",
                      title: str = "The sort task, warm-started glm4_moe wide, GRPO 8x8, LoRA r8, R3") -> Path:
    """verl's held-out success (greedy) of the learning run and its lr=0 control; beside it, our main job's held-out
    success (its own evaluation: samples at temperature 1) read from its metrics.jsonl, when given."""
    import json

    fig, axes = panels(1, 2 if main_job_dir else 1, size=(10 if main_job_dir else 5.5, 4))
    ax = axes[0]
    for c, label in ((curve, f"lr {lr}"), (curve_lr0, "lr 0 (control)")):
        steps = sorted(int(k) for k in c)
        ax.plot(steps, [c[k] if k in c else c[str(k)] for k in steps], marker="o", label=label)
    style(ax, "verl main_ppo + our override: held-out (greedy)")
    if main_job_dir:
        from ...rl.metrics import EVAL_SUCCESS

        rows = [json.loads(l) for l in Path(main_job_dir, "metrics.jsonl").read_text().splitlines() if l.strip()]
        pts = [(r["step"], r[EVAL_SUCCESS]) for r in rows if EVAL_SUCCESS in r]
        axes[1].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color="C2", label="main job")
        style(axes[1], "our main job: held-out (temperature 1, 4 samples)")
    return save(fig, title, Path(png))


def peers_png(png: Path, rewards: dict, evals: dict, result: dict) -> Path:
    """bench peers: against each training loop's seconds, the one evaluator's held-out success of each saved adapter
    and the training reward (a 10-step running mean); the loops' samples per second."""
    fig, (held, train, speed) = panels(1, 3, size=(15, 4.5))
    for name, curve in evals.items():
        held.plot([c[1] for c in curve], [c[2] for c in curve], marker="o", label=name)
    held.axhline(result["target"], color="grey", lw=0.8, ls="--", label=f"target {result['target']:.3f}")
    style(held, "held-out success (one evaluator: HF + peft, T=1)")
    for name, curve in rewards.items():
        r = [c[1] for c in curve]
        smooth = [sum(r[max(0, i - 9):i + 1]) / len(r[max(0, i - 9):i + 1]) for i in range(len(r))]
        train.plot([c[0] for c in curve], smooth, label=name)
    style(train, "training reward (10-step mean)")
    for ax in (held, train):
        ax.set_xlabel("seconds of the training loop")
    names = [n for n in rewards if result.get(f"{n}_samples_per_s")]
    speed.bar(names, [result[f"{n}_samples_per_s"] for n in names])
    speed.set_title("samples per second of the training loop", fontsize=10)
    speed.grid(alpha=0.3, axis="y")
    task = result.get("task", "sort")
    return save(fig, f"{', '.join(names)}: the same model, task ({task}) and budget ({result['samples']} samples "
                     "each)", png)


def policies_png(png: Path, result: dict) -> Path:
    """bench policies: each policy's held-out success together (solid) and alone (dashed); the job seconds."""
    fig, (held, wall) = panels(1, 2, size=(11, 4))
    for i, (name, p) in enumerate(result["policies"].items()):
        for key, ls, how in (("eval_together", "-", "together"), ("eval_alone", "--", "alone")):
            steps = sorted(int(s) for s in p[key])
            held.plot(steps, [p[key][s] if s in p[key] else p[key][str(s)] for s in steps], ls=ls, marker="o",
                      color=f"C{i}", label=f"{name} (seed {p['seed']}, lr {p['lr']:g}) {how}")
    style(held, "held-out success of each policy")
    wall.bar(["apart (one after the other)", "together"], [result["job_s_apart"], result["job_s_together"]],
             color=["C7", "C2"])
    pred = f" (predicted {result['predicted_speedup']:.2f}x)" if "predicted_speedup" in result else ""
    wall.set_title(f"job seconds: {result['speedup']:.2f}x{pred}", fontsize=10)
    wall.grid(alpha=0.3, axis="y")
    return save(fig, f"Two policies on one base and engine, {result['steps']} steps each", png)


def e2e_png(png, runs: dict, title: str) -> Path:
    """bench e2e: the training reward (a 5-step running mean) and the held-out success of each run, runs = {label:
    the job's out_dir} (its metrics.jsonl)."""
    import json

    from ...rl.metrics import EVAL_SUCCESS

    fig, (rew, held) = panels(1, 2, size=(10, 4))
    for label, where in runs.items():
        rows = [json.loads(l) for l in Path(where, "metrics.jsonl").read_text().splitlines() if l.strip()]
        pts = [(r["step"], r["reward"]) for r in rows if "reward" in r]
        r = [p[1] for p in pts]
        rew.plot([p[0] for p in pts], [sum(r[max(0, i - 4):i + 1]) / len(r[max(0, i - 4):i + 1])
                                       for i in range(len(r))], label=label)
        pts = [(r["step"], r[EVAL_SUCCESS]) for r in rows if EVAL_SUCCESS in r]
        held.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    style(rew, "training reward (5-step mean)")
    style(held, "held-out success (temperature 1)")
    return save(fig, title, Path(png))


R3_AB_CURVES = (("Held-out success", ("eval",)), ("Train-inference KL (k3)", ("kl",)),
          ("Tokens with ratio > 2 (solid) / > 5 (dotted)", ("f2", "f5")),
          ("Sequences with a token past ratio 2", ("seq_f2",)),
          ("Largest per-sequence |log-ratio sum|", ("seq_log_ratio_max",)),
          ("KL, first half (solid) / second half (dotted) of a response", ("kl_first_half", "kl_second_half")),
          ("Grad norm", ("grad_norm",)), ("Clip fraction", ("pg_clipfrac",)),
          ("Response length (tokens)", ("response_len",)))


def r3_ab_png(curves: dict, png: Path, title: str) -> Path:
    """curves: (replay, seed) -> metrics rows; R3_AB_CURVES' panels, 3 x 3."""
    fig, axes = panels(3, 3, size=(15, 10))
    first = min(s for _, s in curves)
    for ax, (name, keys) in zip(axes, R3_AB_CURVES):
        for key, dotted in zip(keys, (False, True)):
            for (replay, seed), rows in sorted(curves.items()):
                pts = [(r["step"], r[key]) for r in rows if key in r]
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, color="C0" if replay == "r3" else "C3",
                            ls=":" if dotted else "-" if seed == first else "--",
                            marker="o" if key == "eval" else None, ms=3,
                            label=None if dotted else f"{replay} seed {seed}")
        style(ax, name, log=keys[0].startswith("kl"))
    return save(fig, title, png)


SPARSE_CURVES = (("Held-out success (the run's sampler; final: dense engine)", "eval"), ("Reward", "reward"),
          ("Trainer vs sampler KL (k3)", "r3_kl"), ("Sequences rejected (Sparse-RL)", "sparse/seq_rejected_frac"))


def sparse_png(curves: dict, png: Path, title: str) -> Path:
    """curves: (run, seed) -> (metrics rows, the final adapter's held-out success on a dense engine or None)."""
    fig, axes = panels(2, 2, size=(11, 7))
    colors = {"dense": "C0", "sparse_uncorrected": "C3", "sparse_corrected": "C2", "sparse_replay": "C4"}
    seeds = sorted({s for _, s in curves})
    for ax, (name, key) in zip(axes, SPARSE_CURVES):
        for (run, seed), (rows, dense_end) in sorted(curves.items()):
            pts = [(r["step"], r[key]) for r in rows if key in r]
            if not pts:
                continue
            xs, ys = zip(*pts)
            ax.plot(xs, ys, color=colors[run], ls="-" if seed == seeds[0] else "--",
                    marker="o" if key == "eval" else None, ms=3, label=f"{run} s{seed}")
            if key == "eval" and dense_end is not None:
                ax.plot([xs[-1]], [dense_end], color=colors[run], marker="*", ms=11, ls="none")
        style(ax, name, log=key == "r3_kl")
    return save(fig, title, png)
